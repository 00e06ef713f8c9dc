"""Regenerate the committed stubs from engine.proto and kvpeer.proto: `python -m dsjax.serving.proto.generate`
(needs grpcio-tools).

Each proto is compiled as `dsjax/serving/proto/<name>.proto`, so the stubs import each other as
`dsjax.serving.proto.*` and reflection names the file by its installed path. tests/test_serving_proto.py
checks that the committed stubs are what this writes. protoc runs in a child process: grpc_tools' bundled
protobuf/abseil and nixl_cu13's cannot share a process (importing both crashes it), and a test worker may hold NIXL.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PROTOS = ("engine", "kvpeer")
OUTPUTS = tuple(f"{p}{suffix}" for p in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))


def generate(out_dir: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        pkg = os.path.join(tmp, "dsjax", "serving", "proto")
        os.makedirs(pkg)
        for name in PROTOS:
            shutil.copy(os.path.join(HERE, f"{name}.proto"), pkg)
            args = [sys.executable, "-m", "grpc_tools.protoc", f"-I{tmp}", f"--python_out={tmp}", f"--pyi_out={tmp}",
                    f"--grpc_python_out={tmp}", f"dsjax/serving/proto/{name}.proto"]
            done = subprocess.run(args, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"protoc failed on {name}.proto: {done.stderr.strip()}")
        for name in OUTPUTS:
            shutil.copy(os.path.join(pkg, name), os.path.join(out_dir, name))


if __name__ == "__main__":
    generate(sys.argv[1] if len(sys.argv) > 1 else HERE)
