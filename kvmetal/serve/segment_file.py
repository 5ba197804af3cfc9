"""Read a prefix-store segment file with one read, off the engine thread, without MLX.

A segment is a safetensors file (``mx.save_safetensors`` writes it): an 8-byte
little-endian header length, a JSON header naming each array's dtype, shape and byte
range, then the data. Each array (one layer's K or V part for the segment's blocks,
the pool's own format as is) is one contiguous run of bytes, so the whole file is read
into one buffer and every array is a NumPy view of it: no per-row work, no copy until
the engine thread hands the views to MLX.

MLX stays on the engine thread (see ``worker``), which is why this reader uses NumPy
only: a restore thread calls ``read_segment``, the engine thread ``to_mlx``.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import threading
from dataclasses import dataclass
import zlib

import mlx.core as mx
import numpy as np

# safetensors dtype -> (NumPy dtype the bytes are read as, MLX dtype they become)
DTYPES = {
    "F32": (np.float32, mx.float32), "F16": (np.float16, mx.float16), "BF16": (np.uint16, mx.bfloat16),
    "U32": (np.uint32, mx.uint32), "I32": (np.int32, mx.int32), "U8": (np.uint8, mx.uint8),
    "I64": (np.int64, mx.int64), "U16": (np.uint16, mx.uint16),
}
_MAX_HEADER = 1 << 24  # a header past 16 MB is not one this store wrote
_PAGE = 4096


def checksum(arrays: dict) -> str:
    """A digest of the bytes of ``arrays`` ({name: (NumPy array, dtype name)}, as
    ``read_segment`` and ``to_numpy`` give them), taken in name order, at memory speed.

    Per array, the 64-bit words of each 4 KB page are summed, and the page sums folded
    twice: plainly and weighted by page number (Fletcher's scheme, pages for bytes), so
    a flipped bit, a torn, zeroed or misplaced page and a short array all change it; the
    bytes past the last whole page go through CRC-32. Not a cryptographic hash (the
    directory is the user's own): ``zlib.crc32`` or ``hashlib`` would detect no more
    damage of this kind and run 4-8x slower here (2 and 1 GB/s vs ~10), which a restore
    would pay on every read."""
    digest = hashlib.blake2b(digest_size=16)
    for name in sorted(arrays):
        data = np.ascontiguousarray(arrays[name][0]).reshape(-1).view(np.uint8)
        whole = data.size // _PAGE * _PAGE
        sums = np.add.reduce(data[:whole].view(np.uint64).reshape(-1, _PAGE // 8), axis=1, dtype=np.uint64)
        weights = np.arange(1, sums.size + 1, dtype=np.uint64)
        folded = (int(np.add.reduce(sums, dtype=np.uint64)), int(np.add.reduce(sums * weights, dtype=np.uint64)))
        digest.update(f"{name}:{data.size}:{folded[0]:x}:{folded[1]:x}:{zlib.crc32(data[whole:]):x};".encode())
    return digest.hexdigest()


class SegmentError(ValueError):
    """The file is not a whole, well-formed segment (the message says why)."""


class Buffers:
    """Read buffers kept for reuse (thread-safe). A fresh buffer costs a page fault per
    4 KB on first touch, which here is slower than the disk; reused ones are warm. Up to
    ``keep_bytes`` of idle buffers stay allocated."""

    def __init__(self, keep_bytes: int = 256 << 20):
        self.keep_bytes = keep_bytes
        self._idle: list = []
        self._lock = threading.Lock()

    def take(self, size: int) -> np.ndarray:
        with self._lock:
            fits = [i for i, b in enumerate(self._idle) if b.size >= size]
            if fits:
                return self._idle.pop(min(fits, key=lambda i: self._idle[i].size))
        return np.empty(size, dtype=np.uint8)

    def give(self, buffers) -> None:
        """Return buffers whose views nobody uses any more."""
        with self._lock:
            self._idle += list(buffers)
            self._idle.sort(key=lambda b: -b.size)
            while self._idle and sum(b.size for b in self._idle) > self.keep_bytes:
                self._idle.pop(0)  # the largest goes first


@dataclass
class SegmentData:
    """A segment file read into ``buffer``: ``arrays`` maps each name to (NumPy view of
    the buffer, safetensors dtype name)."""

    arrays: dict
    buffer: np.ndarray


def read_segment(path, expected_size: int, buffers: Buffers | None = None) -> SegmentData:
    """Every array in ``path``, read in one go into a buffer from ``buffers`` (or a new
    one; give it back once the views are no longer used).

    Raises ``SegmentError`` when the file's size differs from ``expected_size`` (what the
    index recorded) or its header does not describe its bytes; ``OSError`` when it cannot
    be read. The buffer goes back to ``buffers`` then."""
    buffers = buffers if buffers is not None else Buffers(keep_bytes=0)
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size != expected_size:
            raise SegmentError(f"its file is {size} bytes, the index says {expected_size}")
        whole = buffers.take(size)
        try:
            buffer = whole[:size]
            view, done = memoryview(buffer), 0
            while done < size:  # one read; the loop only resumes a short read
                got = os.readv(fd, [view[done:]])
                if got == 0:
                    raise SegmentError(f"its file ended after {done} of {size} bytes")
                done += got
            return SegmentData(parse(buffer), whole)
        except BaseException:
            buffers.give([whole])
            raise
    finally:
        os.close(fd)


def parse(buffer: np.ndarray) -> dict:
    """The arrays of a safetensors file held in ``buffer`` (uint8), as views of it."""
    if buffer.size < 8:
        raise SegmentError("its file is shorter than a safetensors header")
    (length,) = struct.unpack("<Q", buffer[:8].tobytes())
    if length > min(_MAX_HEADER, buffer.size - 8):
        raise SegmentError(f"its header claims {length} bytes")
    try:
        header = json.loads(buffer[8:8 + length].tobytes())
    except ValueError as e:
        raise SegmentError(f"its header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise SegmentError("its header is not a table")
    data, out = buffer[8 + length:], {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        try:
            kind, shape, (begin, end) = meta["dtype"], tuple(int(n) for n in meta["shape"]), meta["data_offsets"]
            np_dtype = DTYPES[kind][0]
        except (KeyError, TypeError, ValueError):
            raise SegmentError(f"its header entry {name!r} is malformed") from None
        count = int(np.prod(shape, dtype=np.int64))
        if not (0 <= begin <= end <= data.size) or end - begin != count * np.dtype(np_dtype).itemsize:
            raise SegmentError(f"array {name!r}: bytes [{begin}, {end}) do not hold {shape} {kind}")
        out[name] = (data[begin:end].view(np_dtype).reshape(shape), kind)
    return out


def write_segment(path, arrays: dict) -> int:
    """Write ``arrays`` ({name: (NumPy array, safetensors dtype name)}) as a safetensors
    file (what ``mx.load`` reads); returns the bytes of array data. NumPy only, so a
    writer thread can run it."""
    header, offset = {}, 0
    for name, (array, kind) in arrays.items():
        header[name] = {"dtype": kind, "shape": list(array.shape), "data_offsets": [offset, offset + array.nbytes]}
        offset += array.nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, struct.pack("<Q", len(text)) + text)
        for array, _ in arrays.values():
            _write_all(fd, np.ascontiguousarray(array).reshape(-1).view(np.uint8))
    finally:
        os.close(fd)
    return offset


def _write_all(fd: int, data) -> None:
    view, done = memoryview(data), 0
    while done < len(view):
        done += os.write(fd, view[done:])


def kind_of(dtype: mx.Dtype) -> str:
    """The safetensors dtype name of an MLX dtype."""
    for kind, (_, mlx_dtype) in DTYPES.items():
        if mlx_dtype == dtype:
            return kind
    raise ValueError(f"no safetensors dtype for {dtype}")


def to_numpy(array: mx.array) -> tuple:
    """(NumPy view of an evaluated MLX array's bytes, safetensors dtype name): what
    ``write_segment`` and ``checksum`` take, ``to_mlx``'s inverse (bfloat16 as uint16)."""
    view = np.asarray(array.view(mx.uint16) if array.dtype == mx.bfloat16 else array)
    return view, kind_of(array.dtype)


def to_mlx(array: np.ndarray, kind: str) -> mx.array:
    """An MLX array of the bytes (on the engine thread); bfloat16 travels as uint16."""
    result = mx.array(array)
    return result.view(mx.bfloat16) if kind == "BF16" else result
