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
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

SUPPORTED_BITS = (2, 3, 4, 5, 6, 8)
SUPPORTED_GROUP_SIZES = (32, 64, 128)
DEFAULT_K_BITS = 8
DEFAULT_V_BITS = 4
DEFAULT_GROUP_SIZE = 64


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


def quantize(x: mx.array, *, bits: int = DEFAULT_K_BITS, group_size: int = DEFAULT_GROUP_SIZE) -> QuantizedKV:
    """Quantize a float cache (any leading axes, head_dim last) with ``mx.quantize``."""
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"[quantize] bits must be one of {SUPPORTED_BITS}, got {bits}")
    if group_size not in SUPPORTED_GROUP_SIZES:
        raise ValueError(f"[quantize] group_size must be one of {SUPPORTED_GROUP_SIZES}, got {group_size}")
    if x.shape[-1] % group_size:
        raise ValueError(f"[quantize] head_dim {x.shape[-1]} is not a multiple of group_size {group_size}")
    lead = x.shape[:-1]
    d = x.shape[-1]
    w, s, b = mx.quantize(x.reshape(-1, d), group_size=group_size, bits=bits)
    return QuantizedKV(w.reshape(*lead, -1), s.reshape(*lead, -1), b.reshape(*lead, -1), bits, group_size)


def dequantize(q: QuantizedKV) -> mx.array:
    """The float cache a QuantizedKV stands for (``mx.dequantize`` row by row)."""
    lead = q.data.shape[:-1]
    flat = lambda a: a.reshape(-1, a.shape[-1])
    out = mx.dequantize(flat(q.data), flat(q.scales), flat(q.biases), group_size=q.group_size, bits=q.bits)
    return out.reshape(*lead, q.head_dim)


def empty_like_layout(shape: tuple, *, bits: int, group_size: int, dtype=mx.float16) -> QuantizedKV:
    """A zero-filled quantized cache with logical float ``shape`` (head_dim last)."""
    *lead, d = shape
    if d * bits % 32:
        raise ValueError(f"[quantize] head_dim {d} * bits {bits} is not a multiple of 32")
    return QuantizedKV(
        mx.zeros((*lead, d * bits // 32), dtype=mx.uint32),
        mx.zeros((*lead, d // group_size), dtype=dtype),
        mx.zeros((*lead, d // group_size), dtype=dtype),
        bits,
        group_size,
    )
