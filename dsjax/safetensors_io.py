"""A small safetensors reader/writer that knows every dtype DeepSeek checkpoints use (F8_E4M3, F8_E8M0, I8).

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then
raw bytes. Reading memory-maps the file so a checkpoint streams tensor by tensor instead of loading whole.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Iterator

import ml_dtypes
import numpy as np

from dsjax.errors import CheckpointError

DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E8M0": np.uint8, "I64": np.int64, "I32": np.int32,
    "I16": np.int16, "I8": np.int8, "U8": np.uint8, "BOOL": np.bool_,
}
_NAMES = {np.dtype(v): k for k, v in DTYPES.items() if k not in ("F8_E8M0",)}


class SafetensorsFile:
    """One memory-mapped .safetensors file: `.header` maps names to {dtype, shape, data_offsets}."""

    def __init__(self, path: str):
        self.path = path
        try:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                if n > os.path.getsize(path):
                    raise ValueError("header length beyond end of file")
                header = json.loads(f.read(n))
        except (OSError, ValueError, struct.error) as e:
            raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None
        self.metadata = header.pop("__metadata__", {}) or {}
        self.header = header
        self._base = 8 + n
        self._mm = np.memmap(path, dtype=np.uint8, mode="r") if os.path.getsize(path) > self._base else None

    def names(self) -> list[str]:
        return list(self.header)

    def dtype_name(self, name: str) -> str:
        return self.header[name]["dtype"]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.header[name]["shape"])

    def get(self, name: str) -> np.ndarray:
        info = self.header[name]
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{name}: unsupported safetensors dtype {info['dtype']} in {self.path}")
        start, end = info["data_offsets"]
        dtype = np.dtype(DTYPES[info["dtype"]])
        count = int(np.prod(info["shape"])) if info["shape"] else 1
        if end - start != count * dtype.itemsize:
            raise CheckpointError(f"{name}: byte size {end - start} does not match shape {info['shape']} "
                                  f"and dtype {info['dtype']} in {self.path}")
        raw = self._mm[self._base + start: self._base + end] if count else np.zeros(0, np.uint8)
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(info["shape"])


def open_dir(path: str) -> dict[str, SafetensorsFile]:
    """name -> file for every tensor of every *.safetensors in `path`; duplicate names are an error."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files")
    where: dict[str, SafetensorsFile] = {}
    for fn in files:
        sf = SafetensorsFile(os.path.join(path, fn))
        for name in sf.names():
            if name in where:
                raise CheckpointError(f"{name}: appears in both {where[name].path} and {sf.path}")
            where[name] = sf
    return where


def write(path: str, tensors: dict[str, np.ndarray], *, dtype_names: dict[str, str] | None = None,
          metadata: dict[str, str] | None = None) -> None:
    """Write one .safetensors file. `dtype_names` overrides the dtype tag (e.g. 'F8_E8M0' for uint8 scales)."""
    dtype_names = dtype_names or {}
    header: dict = {}
    offset = 0
    arrays = []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name])
        tag = dtype_names.get(name) or _NAMES.get(a.dtype)
        if tag is None:
            raise CheckpointError(f"{name}: cannot store dtype {a.dtype} in safetensors")
        header[name] = {"dtype": tag, "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        offset += a.nbytes
        arrays.append(a)
    if metadata:
        header["__metadata__"] = metadata
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for a in arrays:
            f.write(a.tobytes())
    os.replace(tmp, path)


def iter_tensors(files: dict[str, SafetensorsFile]) -> Iterator[tuple[str, np.ndarray]]:
    for name, sf in files.items():
        yield name, sf.get(name)
