"""A GGUF file's header, parsed and checked against the file before any tensor is read.

``mx.load`` (MLX's C GGUF reader) trusts the header: a tensor or metadata count off by
one, a string length past the end of the file or a tensor whose data lies outside it
ends the process with a segfault. Every converter reads :func:`read_header` first, which
checks every count, length and offset against the file's size and raises one-line
:class:`~kvmetal.models.gguf_base.GGUFError` otherwise:

* each string, array and scalar lies inside the file (a count is checked against the
  bytes left *before* anything is allocated for it);
* metadata value types, tensor types (ggml's table below) and dimension counts (1 to 4)
  are known, dimensions are >= 1, a row is a whole number of the type's blocks;
* ``general.alignment``, when present, is a uint32 power of two (what llama.cpp and MLX
  read; any other type would make them disagree on where the data starts);
* tensor names are unique, offsets aligned, and each tensor's bytes
  ``[data_start + offset, + nbytes)`` lie inside the file without overlapping another's.

    header = read_header("model.gguf")
    header.meta["general.architecture"], header.tensors["token_embd.weight"].shape
"""
from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from .gguf_base import _GGUF_ARRAY, _GGUF_SCALARS, _GGUF_STRING, GGUFError

# ggml type id -> (name, values per block, bytes per block), as ggml.h / gguf-py's
# GGML_QUANT_SIZES define them (tests/test_gguf_header.py checks this table against the
# installed gguf package).
GGML_TYPES = {
    0: ("F32", 1, 4), 1: ("F16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20), 6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24), 8: ("Q8_0", 32, 34), 9: ("Q8_1", 32, 40), 10: ("Q2_K", 256, 84), 11: ("Q3_K", 256, 110),
    12: ("Q4_K", 256, 144), 13: ("Q5_K", 256, 176), 14: ("Q6_K", 256, 210), 15: ("Q8_K", 256, 292),
    16: ("IQ2_XXS", 256, 66), 17: ("IQ2_XS", 256, 74), 18: ("IQ3_XXS", 256, 98), 19: ("IQ1_S", 256, 50),
    20: ("IQ4_NL", 32, 18), 21: ("IQ3_S", 256, 110), 22: ("IQ2_S", 256, 82), 23: ("IQ4_XS", 256, 136),
    24: ("I8", 1, 1), 25: ("I16", 1, 2), 26: ("I32", 1, 4), 27: ("I64", 1, 8), 28: ("F64", 1, 8),
    29: ("IQ1_M", 256, 56), 30: ("BF16", 1, 2), 34: ("TQ1_0", 256, 54), 35: ("TQ2_0", 256, 66),
    39: ("MXFP4", 32, 17),
}
MAX_DIMS = 4  # GGML_MAX_DIMS
DEFAULT_ALIGNMENT = 32
_U32 = 4  # the type code of uint32 in _GGUF_SCALARS
# Fewest bytes one metadata entry / one tensor entry can take: a count larger than the
# bytes left allow is refused before the loop starts.
_MIN_KV_BYTES = 8 + 4 + 1  # key length, value type, a uint8 value
_MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # name length, n_dims, one dimension, type, offset
_MIN_ARRAY_ITEM = {_GGUF_STRING: 8, _GGUF_ARRAY: 4 + 8}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    type: str  # GGML type name: "F32", "Q4_K", ...
    type_id: int
    shape: tuple  # row-major [..., out, in] (GGUF lists dimensions fastest first; this is reversed)
    offset: int  # absolute byte offset in the file
    nbytes: int


@dataclass(frozen=True)
class GGUFHeader:
    path: Path
    version: int
    meta: dict  # {key: int | float | bool | str | list}
    tensors: dict  # {name: TensorInfo}, in file order
    alignment: int
    data_start: int  # absolute offset of the tensor data section
    file_size: int


class _Reader:
    """Bounds-checked little-endian reads from a buffer; every failure is one GGUFError line."""

    def __init__(self, buf, name: str):
        self.buf, self.name, self.pos, self.size = buf, name, 0, len(buf)

    def fail(self, what: str):
        raise GGUFError(f"{self.name}: {what} (the GGUF header is damaged or the file truncated)")

    def need(self, n: int, what: str):
        if n < 0 or n > self.size - self.pos:
            self.fail(f"{what} at byte {self.pos} needs {n} bytes, {self.size - self.pos} are left")

    def scalar(self, fmt: str, what: str):
        size = struct.calcsize("<" + fmt)
        self.need(size, what)
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += size
        return value

    def string(self, what: str) -> str:
        n = self.scalar("Q", f"the length of {what}")
        self.need(n, f"{what} ({n} bytes long)")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            self.fail(f"{what} at byte {self.pos - n} is not UTF-8")

    def value(self, kind: int, what: str, depth: int = 0):
        if kind == _GGUF_STRING:
            return self.string(what)
        if kind in _GGUF_SCALARS:
            return self.scalar(_GGUF_SCALARS[kind], what)
        if kind == _GGUF_ARRAY:
            if depth > 2:
                self.fail(f"{what} nests arrays more than 3 deep")
            inner = self.scalar("I", f"the element type of {what}")
            count = self.scalar("Q", f"the length of {what}")
            if inner in _GGUF_SCALARS:
                fmt = _GGUF_SCALARS[inner]
                width = struct.calcsize("<" + fmt)
                if count > (self.size - self.pos) // width:
                    self.fail(f"{what}: {count} elements of {width} bytes at byte {self.pos} run past the end "
                              f"of the file ({self.size - self.pos} bytes left)")
                out = list(struct.unpack_from(f"<{count}{fmt}", self.buf, self.pos))
                self.pos += count * width
                return out
            if inner not in _MIN_ARRAY_ITEM:
                self.fail(f"{what} has unknown element type {inner}")
            if count > (self.size - self.pos) // _MIN_ARRAY_ITEM[inner]:
                self.fail(f"{what}: {count} elements at byte {self.pos} cannot fit in the "
                          f"{self.size - self.pos} bytes left")
            return [self.value(inner, what, depth + 1) for _ in range(count)]
        self.fail(f"{what} has unknown metadata type {kind}")


def parse_header(buf, name: str = "GGUF", *, path: Path | None = None, file_size: int | None = None) -> GGUFHeader:
    """The checked header of the GGUF bytes ``buf`` (bytes, or an mmap of the whole file).
    ``file_size``: the whole file's size when ``buf`` is only its first part (a GGUF shipped
    in chunks): the header must lie in ``buf``, the tensors within ``file_size``."""
    r = _Reader(buf, name)
    if r.size < 4 or bytes(buf[:4]) != b"GGUF":
        raise GGUFError(f"{name} is not a GGUF file (no GGUF magic)")
    r.pos = 4
    version = r.scalar("I", "the version")
    if version not in (2, 3):
        raise GGUFError(f"{name}: GGUF version {version} is not supported (2 or 3)")
    n_tensors = r.scalar("Q", "the tensor count")
    n_kv = r.scalar("Q", "the metadata count")
    if n_kv > (r.size - r.pos) // _MIN_KV_BYTES:
        r.fail(f"the metadata count {n_kv} cannot fit in a {r.size}-byte file")
    meta: dict = {}
    for i in range(n_kv):
        key = r.string(f"metadata key {i}")
        if key in meta:
            r.fail(f"metadata key {key!r} appears twice")
        kind = r.scalar("I", f"the type of metadata {key!r}")
        meta[key] = r.value(kind, f"metadata {key!r}")
        if key == "general.alignment":
            if kind != _U32:
                r.fail(f"general.alignment has type {kind}, not uint32")
            if meta[key] <= 0 or meta[key] & (meta[key] - 1):
                r.fail(f"general.alignment {meta[key]} is not a power of two")
    alignment = int(meta.get("general.alignment", DEFAULT_ALIGNMENT))
    if n_tensors > (r.size - r.pos) // _MIN_TENSOR_BYTES:
        r.fail(f"the tensor count {n_tensors} cannot fit in the {r.size - r.pos} bytes after the metadata")
    infos = []
    for i in range(n_tensors):
        tname = r.string(f"the name of tensor {i}")
        n_dims = r.scalar("I", f"the dimension count of tensor {tname!r}")
        if not 1 <= n_dims <= MAX_DIMS:
            r.fail(f"tensor {tname!r} has {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = [r.scalar("Q", f"a dimension of tensor {tname!r}") for _ in range(n_dims)]
        type_id = r.scalar("I", f"the type of tensor {tname!r}")
        offset = r.scalar("Q", f"the offset of tensor {tname!r}")
        infos.append((tname, dims, type_id, offset))
    data_start = -(-r.pos // alignment) * alignment
    if file_size is not None:
        r.size = max(r.size, file_size)  # the tensor data may lie in the later parts
    if infos and data_start > r.size:
        r.fail(f"the tensor data would start at byte {data_start}, past the end of the {r.size}-byte file")
    tensors: dict = {}
    for tname, dims, type_id, offset in infos:
        if tname in tensors:
            r.fail(f"tensor {tname!r} appears twice")
        if type_id not in GGML_TYPES:
            raise GGUFError(f"{name}: tensor {tname!r} has unknown ggml type id {type_id}")
        kind, block, type_size = GGML_TYPES[type_id]
        count = 1
        for d in dims:
            if d < 1:
                r.fail(f"tensor {tname!r} has a dimension of {d}")
            count *= d
        if dims[0] % block:
            r.fail(f"tensor {tname!r} of type {kind} has rows of {dims[0]} values, not a multiple of its "
                   f"block of {block}")
        nbytes = count // block * type_size
        if offset % alignment:
            r.fail(f"tensor {tname!r} has offset {offset}, not a multiple of the alignment {alignment}")
        start = data_start + offset
        if nbytes > r.size or start > r.size - nbytes:
            r.fail(f"tensor {tname!r} ({nbytes} bytes at byte {start}) runs past the end of the "
                   f"{r.size}-byte file")
        tensors[tname] = TensorInfo(tname, kind, type_id, tuple(reversed(dims)), start, nbytes)
    ranges = sorted((t.offset, t.offset + t.nbytes, t.name) for t in tensors.values())
    for (_, end, first), (start, _, second) in zip(ranges, ranges[1:]):
        if start < end:
            r.fail(f"the data of tensors {first!r} and {second!r} overlap")
    return GGUFHeader(path or Path(name), version, meta, tensors, alignment, data_start, r.size)


def read_header(path: str | os.PathLike, *, file_size: int | None = None) -> GGUFHeader:
    """The checked header of the GGUF file ``path`` (see the module docstring); with
    ``file_size``, ``path`` is the first of the chunks of a file that long."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{str(path)!r}: no such file")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 4 or f.read(4) != b"GGUF":
            raise GGUFError(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
            return parse_header(m, path.name, path=path, file_size=file_size)
