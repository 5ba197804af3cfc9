"""A GGUF file read in NumPy: metadata, tensor directory, and dequantization through
llama.cpp's own ``gguf`` package.

``mx.load`` reads only the GGUF tensor types that map onto MLX's affine format (Q4_0,
Q4_1, Q8_0) and float ones; K-quants (Q4_K, Q5_K, Q6_K, ...) and Q5_0/Q5_1 it cannot
read. The ``gguf`` package dequantizes every type llama.cpp writes, so the converters
for such files (:mod:`kvmetal.models.gemma3_convert`) read through here. The header is
parsed here rather than with ``gguf.GGUFReader``, which builds an object per array
element (36 s for Gemma's 262,144-piece vocabulary on a busy 2-core host; this: ~1 s).

    f = GGUFFile(path)
    f.meta                                  # {key: int | float | bool | str | list}
    f.tensors["blk.0.attn_q.weight"]        # TensorInfo(type "Q5_0", shape (1024, 640), ...)
    w = f.dequantize("blk.0.attn_q.weight") # float32, PyTorch/MLX [out, in] order
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .gguf_base import _GGUF_ARRAY as _ARRAY
from .gguf_base import _GGUF_SCALARS as _SCALARS
from .gguf_base import _GGUF_STRING as _STRING
from .gguf_base import GGUFError


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str  # GGML type name: "F32", "Q4_K", ...
    type_id: int
    shape: tuple  # row-major [..., out, in] (GGUF lists dimensions fastest first; this is reversed)
    offset: int  # absolute byte offset in the file
    nbytes: int


def _gguf_package():
    try:
        import gguf
    except ImportError:
        raise GGUFError("reading K-quantized GGUF files needs llama.cpp's gguf package (pip install gguf)") from None
    return gguf


class GGUFFile:
    """The metadata and tensor directory of one GGUF file; tensors are read on demand."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise GGUFError(f"{str(self.path)!r}: no such file")
        gguf = _gguf_package()
        with open(self.path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            if m[:4] != b"GGUF":
                raise GGUFError(f"{str(self.path)!r} is not a GGUF file (no GGUF magic)")
            try:
                self.meta, self.tensors = self._parse(m, gguf)
            except (struct.error, IndexError, UnicodeDecodeError):
                raise GGUFError(f"{self.path.name}: the GGUF header is truncated or damaged") from None

    def _parse(self, m, gguf) -> tuple[dict, dict]:
        pos = 4

        def read(fmt):
            nonlocal pos
            value = struct.unpack_from("<" + fmt, m, pos)[0]
            pos += struct.calcsize("<" + fmt)
            return value

        def string():
            nonlocal pos
            n = read("Q")
            s = m[pos:pos + n].decode("utf-8")
            pos += n
            return s

        def value(kind):
            nonlocal pos
            if kind == _STRING:
                return string()
            if kind == _ARRAY:
                inner, count = read("I"), read("Q")
                if inner in _SCALARS:
                    fmt = f"<{count}{_SCALARS[inner]}"
                    out = list(struct.unpack_from(fmt, m, pos))
                    pos += struct.calcsize(fmt)
                    return out
                return [value(inner) for _ in range(count)]
            if kind in _SCALARS:
                return read(_SCALARS[kind])
            raise GGUFError(f"{self.path.name}: unknown GGUF metadata type {kind}")

        version = read("I")
        if version < 2:
            raise GGUFError(f"{self.path.name}: GGUF version {version} is not supported (2 or later)")
        n_tensors, n_kv = read("Q"), read("Q")
        meta = {}
        for _ in range(n_kv):
            key = string()
            meta[key] = value(read("I"))
        infos = []
        for _ in range(n_tensors):
            name = string()
            dims = [read("Q") for _ in range(read("I"))]
            infos.append((name, dims, read("I"), read("Q")))
        alignment = int(meta.get("general.alignment", 32))
        data_start = -(-pos // alignment) * alignment
        tensors = {}
        for name, dims, type_id, offset in infos:
            try:
                kind = gguf.GGMLQuantizationType(type_id)
                block, type_size = gguf.GGML_QUANT_SIZES[kind]
            except (ValueError, KeyError):
                raise GGUFError(f"GGUF tensor {name!r} has type id {type_id}, which the gguf package does not "
                                f"know") from None
            count = 1
            for d in dims:
                count *= int(d)
            tensors[name] = TensorInfo(name, kind.name, type_id, tuple(int(d) for d in reversed(dims)),
                                       data_start + int(offset), count // block * type_size)
        if tensors:
            end = max(t.offset + t.nbytes for t in tensors.values())
            if end > len(m):
                raise GGUFError(f"{self.path.name}: the GGUF file is truncated ({len(m)} bytes, tensors end at {end})")
        return meta, tensors

    def dequantize(self, name: str):
        """One tensor as a float32 NumPy array in row-major ``[..., out, in]`` order."""
        import numpy as np

        gguf = _gguf_package()
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"GGUF has no tensor {name!r}")
        kind = gguf.GGMLQuantizationType(info.type_id)
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
        rows = max(1, int(np.prod(info.shape[:-1])))
        try:
            values = gguf.quants.dequantize(np.array(raw).reshape(rows, info.nbytes // rows), kind)
        except NotImplementedError:
            raise GGUFError(f"GGUF tensor {name!r} has type {info.type}, which the gguf package cannot "
                            f"dequantize") from None
        return np.ascontiguousarray(values, dtype=np.float32).reshape(info.shape)
