"""Regenerate the committed stubs from engine.proto: `python -m dsjax.serving.proto.generate` (needs grpcio-tools).

The proto is compiled as `dsjax/serving/proto/engine.proto`, so the stubs import each other as
`dsjax.serving.proto.*` and reflection names the file by its installed path. tests/test_serving_proto.py
checks that the committed stubs are what this writes.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
OUTPUTS = ("engine_pb2.py", "engine_pb2.pyi", "engine_pb2_grpc.py")


def generate(out_dir: str) -> None:
    from grpc_tools import protoc

    with tempfile.TemporaryDirectory() as tmp:
        pkg = os.path.join(tmp, "dsjax", "serving", "proto")
        os.makedirs(pkg)
        shutil.copy(os.path.join(HERE, "engine.proto"), pkg)
        args = ["protoc", f"-I{tmp}", f"--python_out={tmp}", f"--pyi_out={tmp}", f"--grpc_python_out={tmp}",
                "dsjax/serving/proto/engine.proto"]
        if protoc.main(args) != 0:
            raise RuntimeError("protoc failed on engine.proto")
        for name in OUTPUTS:
            shutil.copy(os.path.join(pkg, name), os.path.join(out_dir, name))


if __name__ == "__main__":
    generate(sys.argv[1] if len(sys.argv) > 1 else HERE)
