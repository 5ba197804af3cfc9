"""Quantized KV format: MLX affine quantization, K and V with their own bits.

A quantized cache is a :class:`QuantizedKV` passed wherever a float cache goes.
Its arrays follow ``mx.quantize`` along the last (head_dim) axis, so every row
round-trips through ``mx.dequantize``::

    data    uint32 [..., head_dim * bits // 32]
    scales  float  [..., head_dim // group_size]
    biases  float  [..., head_dim // group_size]

The leading axes are those of the float cache it replaces: paged caches are
``[num_blocks, num_kv_heads, block_size, ...]``, contiguous ones
``[B, num_kv_heads, T, ...]``. ``scales.dtype`` is the float dtype the cache
dequantizes to (what gather returns and what attention accumulates from).

The format, from its definition (what the NumPy references below implement):

* Each row of ``head_dim`` values is cut into groups of ``group_size``
  consecutive values; each group has one ``scale`` and one ``bias`` and its
  values are stored as unsigned ``bits``-bit codes ``q``, so that
  ``value = scale * q + bias``.
* The codes of a row form one little-endian bit stream: code ``i`` occupies
  bits ``[i * bits, (i + 1) * bits)``, bit ``j`` of the stream being bit
  ``j % 32`` of word ``j // 32``. For 2, 4 and 8 bits a code never leaves its
  word; 3-, 5- and 6-bit codes straddle word boundaries (the stream is what
  MLX's byte packing gives on a little-endian machine).
* ``mx.quantize`` picks scale and bias so that the group's larger-magnitude
  edge (min or max) is represented exactly; see :func:`quantize_rows`.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
DEFAULT_K_BITS = 8
DEFAULT_GROUP_SIZE = 64
SCALE_DTYPES = (mx.float16, mx.bfloat16, mx.float32)


@dataclass(frozen=True)
class QuantizedKV:
    """One quantized K or V cache (data, scales, biases) with its bits and group size."""

    data: mx.array
    scales: mx.array
    biases: mx.array
    bits: int
    group_size: int

    @property
    def shape(self) -> tuple:
        """Logical (dequantized) shape: the float cache this one stands for."""
        return (*self.data.shape[:-1], self.head_dim)

    @property
    def head_dim(self) -> int:
        return self.data.shape[-1] * 32 // self.bits

    @property
    def dtype(self) -> mx.Dtype:
        return self.scales.dtype

    @property
    def ndim(self) -> int:
        return self.data.ndim

    @property
    def nbytes(self) -> int:
        return self.data.nbytes + self.scales.nbytes + self.biases.nbytes

    def arrays(self) -> tuple:
        return (self.data, self.scales, self.biases)

    def replace(self, data: mx.array, scales: mx.array, biases: mx.array) -> "QuantizedKV":
        return QuantizedKV(data, scales, biases, self.bits, self.group_size)


# ----------------------------------------------------------------------------- validation

def check_bits(bits, *, op: str = "quantize", name: str = "bits") -> int:
    """``bits`` as an int, or ValueError/TypeError naming ``name``."""
    if isinstance(bits, bool) or not isinstance(bits, (int, np.integer)):
        raise TypeError(f"[{op}] {name} must be an int in {SUPPORTED_BITS}, got {type(bits).__name__}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"[{op}] {name} must be one of {SUPPORTED_BITS}, got {bits}")
    return int(bits)


def check_group_size(group_size, *, op: str = "quantize", name: str = "group_size") -> int:
    """``group_size`` as an int, or ValueError/TypeError naming ``name``."""
    if isinstance(group_size, bool) or not isinstance(group_size, (int, np.integer)):
        raise TypeError(f"[{op}] {name} must be an int in {SUPPORTED_GROUP_SIZES}, "
                        f"got {type(group_size).__name__}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"[{op}] {name} must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    return int(group_size)


def check_layout(head_dim: int, *, bits: int, group_size: int, op: str = "quantize") -> None:
    """Raise ValueError unless rows of ``head_dim`` values quantize to whole words and groups."""
    check_bits(bits, op=op)
    check_group_size(group_size, op=op)
    if head_dim <= 0:
        raise ValueError(f"[{op}] head_dim must be positive, got {head_dim}")
    if head_dim % group_size:
        raise ValueError(f"[{op}] head_dim {head_dim} is not a multiple of group_size {group_size}")
    if head_dim * bits % 32:
        raise ValueError(f"[{op}] head_dim {head_dim} * bits {bits} is not a multiple of 32 "
                         f"(rows are packed into whole uint32 words)")


def packed_words(head_dim: int, bits: int) -> int:
    """uint32 words holding one row of ``head_dim`` codes."""
    return head_dim * bits // 32


def row_nbytes(head_dim: int, *, bits: int, group_size: int, scale_bytes: int = 2) -> int:
    """Bytes of one quantized row: packed codes plus one scale and one bias per group."""
    check_layout(head_dim, bits=bits, group_size=group_size, op="row_nbytes")
    return packed_words(head_dim, bits) * 4 + 2 * (head_dim // group_size) * scale_bytes


# ----------------------------------------------------------------------------- MLX path

def quantize(x: mx.array, *, bits: int = DEFAULT_K_BITS, group_size: int = DEFAULT_GROUP_SIZE) -> QuantizedKV:
    """Quantize a float cache (any leading axes, head_dim last) with ``mx.quantize``."""
    if not isinstance(x, mx.array):
        raise TypeError(f"[quantize] x must be an mx.array, got {type(x).__name__}")
    if x.dtype not in SCALE_DTYPES or x.ndim < 1:
        raise TypeError(f"[quantize] x must be a float16, bfloat16 or float32 array with head_dim last, "
                        f"got {x.dtype} of shape {tuple(x.shape)}")
    check_layout(x.shape[-1], bits=bits, group_size=group_size, op="quantize")
    lead = x.shape[:-1]
    d = x.shape[-1]
    w, s, b = mx.quantize(x.reshape(-1, d), group_size=group_size, bits=bits)
    return QuantizedKV(w.reshape(*lead, -1), s.reshape(*lead, -1), b.reshape(*lead, -1), bits, group_size)


def dequantize(q: QuantizedKV) -> mx.array:
    """The float cache a QuantizedKV stands for (``mx.dequantize`` row by row)."""
    if not isinstance(q, QuantizedKV):
        raise TypeError(f"[dequantize] q must be a QuantizedKV, got {type(q).__name__}")
    lead = q.data.shape[:-1]
    flat = lambda a: a.reshape(-1, a.shape[-1])
    out = mx.dequantize(flat(q.data), flat(q.scales), flat(q.biases), group_size=q.group_size, bits=q.bits)
    return out.reshape(*lead, q.head_dim)


def empty_like_layout(shape: tuple, *, bits: int, group_size: int, dtype=mx.float16) -> QuantizedKV:
    """A zero-filled quantized cache with logical float ``shape`` (head_dim last) whose
    scales and biases have ``dtype`` (the dtype it dequantizes to)."""
    *lead, d = shape
    check_layout(d, bits=bits, group_size=group_size, op="quantize")
    return QuantizedKV(
        mx.zeros((*lead, packed_words(d, bits)), dtype=mx.uint32),
        mx.zeros((*lead, d // group_size), dtype=dtype),
        mx.zeros((*lead, d // group_size), dtype=dtype),
        bits,
        group_size,
    )


# ----------------------------------------------------------------------------- NumPy references

def unpack_codes(data: np.ndarray, bits: int) -> np.ndarray:
    """Codes ``[..., words * 32 // bits]`` (uint32) from packed words ``[..., words]``, by hand.

    Code ``i`` is bits ``[i*bits, (i+1)*bits)`` of the row's little-endian bit
    stream; when it straddles two words its high part comes from the next word.
    """
    check_bits(bits, op="unpack_codes")
    words = np.asarray(data, dtype=np.uint32).astype(np.uint64)
    n = words.shape[-1] * 32 // bits
    start = np.arange(n) * bits
    word, offset = start // 32, (start % 32).astype(np.uint64)
    low = words[..., word] >> offset
    # The next word's low bits belong to codes that straddle; clamp the index for the rest.
    nxt = words[..., np.minimum(word + 1, words.shape[-1] - 1)]
    straddles = (offset + bits) > 32
    high = np.where(straddles, nxt << (np.uint64(32) - offset), np.uint64(0))
    return ((low | high) & np.uint64((1 << bits) - 1)).astype(np.uint32)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of :func:`unpack_codes`: ``[..., n]`` codes < 2**bits -> ``[..., n*bits//32]`` uint32."""
    check_bits(bits, op="pack_codes")
    codes = np.asarray(codes).astype(np.uint64)
    n = codes.shape[-1]
    if n * bits % 32:
        raise ValueError(f"[pack_codes] codes last axis {n} * bits {bits} is not a multiple of 32")
    if codes.size and codes.max() >= (1 << bits):
        raise ValueError(f"[pack_codes] codes must be < 2**{bits}, got {int(codes.max())}")
    words = np.zeros((*codes.shape[:-1], n * bits // 32), dtype=np.uint64)
    for i in range(n):
        word, offset = divmod(i * bits, 32)
        words[..., word] |= (codes[..., i] << np.uint64(offset)) & np.uint64(0xFFFFFFFF)
        if offset + bits > 32:
            words[..., word + 1] |= codes[..., i] >> np.uint64(32 - offset)
    return words.astype(np.uint32)


def _to_numpy_f64(x) -> np.ndarray:
    if isinstance(x, mx.array):
        return np.array(x.astype(mx.float32), dtype=np.float64)
    return np.asarray(x, dtype=np.float64)


def dequantize_reference(q: QuantizedKV) -> np.ndarray:
    """The float64 cache a QuantizedKV stands for, unpacked by hand (``scale * q + bias``)."""
    codes = unpack_codes(np.array(q.data), q.bits).astype(np.float64)
    scales = np.repeat(_to_numpy_f64(q.scales), q.group_size, axis=-1)
    biases = np.repeat(_to_numpy_f64(q.biases), q.group_size, axis=-1)
    return codes * scales + biases


def _round_to_dtype(x32: np.ndarray, dtype) -> np.ndarray:
    """float32 values rounded (nearest even) to ``dtype``, returned as float32."""
    if dtype == mx.float32:
        return x32
    if dtype == mx.float16:
        return x32.astype(np.float16).astype(np.float32)
    # bfloat16 keeps the top 16 bits of a float32: round the low half to nearest even.
    u = x32.view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16
    return u.astype(np.uint32).view(np.float32)


def quantize_rows(x, *, bits: int = DEFAULT_K_BITS, group_size: int = DEFAULT_GROUP_SIZE) -> tuple:
    """NumPy reproduction of ``mx.quantize`` (affine mode): ``(data, scales, biases)``.

    ``x``: rows ``[..., head_dim]`` as an ``mx.array`` (float16/bfloat16/float32) or a
    NumPy float16/float32 array. Returns NumPy arrays: ``data`` uint32, ``scales`` and
    ``biases`` float32 holding values of the input's dtype (what ``mx.quantize``
    stores). The arithmetic is float32, step by step as MLX's CPU kernel does it:

    * ``lo, hi`` = min and max of the group; ``s = max((hi - lo) / (2**bits - 1), 1e-7)``.
    * The larger-magnitude edge ``e`` (``lo`` if ``|lo| > |hi|``, else ``hi`` with
      ``s = -s``) is made exact: ``q0 = rint(e / s)``; if ``q0 != 0``, ``s = e / q0``
      and ``bias = e``, else ``bias = 0``.
    * ``q = clip(rint((x - bias) / s), 0, 2**bits - 1)`` (``rint``: half to even).

    Only the stored ``scales``/``biases`` are rounded to the input dtype; codes use
    the float32 scale. That is MLX's CPU behaviour; MLX's Metal kernel may differ
    by rounding in rare ties (not checkable on Linux).
    """
    op = "quantize_rows"
    if isinstance(x, mx.array):
        if x.dtype not in SCALE_DTYPES:
            raise TypeError(f"[{op}] x must be float16, bfloat16 or float32, got {x.dtype}")
        dtype = x.dtype
        rows = np.array(x.astype(mx.float32))
    else:
        rows = np.asarray(x)
        if rows.dtype not in (np.float16, np.float32):
            raise TypeError(f"[{op}] x must be a float16 or float32 NumPy array, got {rows.dtype}")
        dtype = mx.float16 if rows.dtype == np.float16 else mx.float32
        rows = rows.astype(np.float32)
    if rows.ndim < 1:
        raise ValueError(f"[{op}] x must have at least one axis (head_dim last), got a scalar")
    d = rows.shape[-1]
    check_layout(d, bits=bits, group_size=group_size, op=op)

    f32 = np.float32
    n_bins = f32((1 << bits) - 1)
    groups = rows.reshape(*rows.shape[:-1], d // group_size, group_size)
    hi = groups.max(axis=-1, keepdims=True)
    lo = groups.min(axis=-1, keepdims=True)
    low_edge = np.abs(lo) > np.abs(hi)
    scale = np.maximum((hi - lo) / n_bins, f32(1e-7)).astype(f32)
    scale = np.where(low_edge, scale, -scale)
    edge = np.where(low_edge, lo, hi)
    with np.errstate(divide="ignore", invalid="ignore"):
        q0 = np.rint(edge / scale)
        exact = q0 != 0
        scale = np.where(exact, edge / np.where(exact, q0, f32(1)), scale).astype(f32)
    bias = np.where(exact, edge, f32(0)).astype(f32)
    codes = np.clip(np.rint((groups - bias) / scale), 0, n_bins).astype(np.uint32)
    data = pack_codes(codes.reshape(rows.shape), bits)
    return (data, _round_to_dtype(scale[..., 0], dtype), _round_to_dtype(bias[..., 0], dtype))
