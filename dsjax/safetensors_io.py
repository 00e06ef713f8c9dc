"""A small safetensors reader/writer that knows every dtype DeepSeek checkpoints use (F8_E4M3, F8_E8M0, I8).

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then
raw bytes. Reading memory-maps the file so a checkpoint streams tensor by tensor instead of loading whole;
`read` fetches a slice with pread instead, for loaders that must not keep the file's pages resident.
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

    def _spec(self, name: str) -> tuple[np.dtype, tuple[int, ...], int]:
        """(dtype, shape, absolute byte offset) of a tensor, once its header entry is known to be consistent."""
        info = self.header[name]
        if info["dtype"] not in DTYPES:
            raise CheckpointError(f"{name}: unsupported safetensors dtype {info['dtype']} in {self.path}")
        start, end = info["data_offsets"]
        dtype = np.dtype(DTYPES[info["dtype"]])
        count = int(np.prod(info["shape"])) if info["shape"] else 1
        if end - start != count * dtype.itemsize:
            raise CheckpointError(f"{name}: byte size {end - start} does not match shape {info['shape']} "
                                  f"and dtype {info['dtype']} in {self.path}")
        return dtype, tuple(info["shape"]), self._base + start

    def get(self, name: str) -> np.ndarray:
        """The whole tensor as a read-only view of the memory map (no copy; its pages stay resident once read)."""
        dtype, shape, start = self._spec(name)
        count = int(np.prod(shape)) if shape else 1
        raw = self._mm[start: start + count * dtype.itemsize] if count else np.zeros(0, np.uint8)
        return np.frombuffer(raw, dtype=dtype, count=count).reshape(shape)

    def read(self, name: str, index: tuple = ()) -> np.ndarray:
        """tensor[index] (ints and step-1 slices over the leading dims) as a fresh array, read with pread.

        Only the bytes the slice needs are read, into memory the caller owns: unlike `get`, no file page stays
        mapped into the process afterwards, so a sharded load's resident memory does not grow with the file."""
        dtype, shape, start = self._spec(name)
        index = tuple(index) + (slice(None),) * (len(shape) - len(index))
        if len(index) != len(shape):
            raise IndexError(f"{name}: index {index} has more dimensions than shape {shape}")
        ranges = [range(i % n, i % n + 1) if isinstance(i, (int, np.integer)) else range(*i.indices(n))
                  for i, n in zip(index, shape)]
        if any(r.step != 1 for r in ranges if len(r) > 1):
            raise IndexError(f"{name}: only step-1 slices are supported, got {index}")
        out_shape = tuple(len(r) for r, i in zip(ranges, index) if not isinstance(i, (int, np.integer)))
        out = np.empty(out_shape, dtype)
        if out.size == 0:
            return out
        strides = [int(np.prod(shape[d + 1:])) for d in range(len(shape))]  # in elements
        partial = [d for d, (r, n) in enumerate(zip(ranges, shape)) if len(r) != n]
        j = partial[-1] if partial else -1  # the last dimension not read whole: runs are contiguous from there on
        run = (len(ranges[j]) * strides[j] if j >= 0 else out.size) * dtype.itemsize
        offsets = np.zeros(1, np.int64)
        for d in range(j):
            offsets = (offsets[:, None] + np.asarray(ranges[d], np.int64) * strides[d]).ravel()
        offsets = start + (offsets + (ranges[j].start * strides[j] if j >= 0 else 0)) * dtype.itemsize
        flat = memoryview(out.reshape(-1).view(np.uint8))
        fd = os.open(self.path, os.O_RDONLY)
        try:
            if len(offsets) == 1 or run >= 1024:  # one read per contiguous run, straight into `out`
                for k, off in enumerate(offsets.tolist()):
                    _pread_into(fd, flat[k * run:(k + 1) * run], off, self.path)
                return out
            # many tiny runs: one read of the span covering them, then a strided copy
            span = np.empty(int(offsets[-1] - offsets[0]) + run, np.uint8)
            _pread_into(fd, memoryview(span), int(offsets[0]), self.path)
        finally:
            os.close(fd)
        box = tuple(len(r) for r in ranges)
        view = np.lib.stride_tricks.as_strided(span.view(dtype), box, [s * dtype.itemsize for s in strides])
        out[...] = view.reshape(out_shape)
        return out


def _pread_into(fd: int, buf: memoryview, offset: int, path: str) -> None:
    while buf.nbytes:
        n = os.preadv(fd, [buf], offset)
        if n <= 0:
            raise CheckpointError(f"{path}: file ends before the tensor data the header describes")
        buf, offset = buf[n:], offset + n


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
