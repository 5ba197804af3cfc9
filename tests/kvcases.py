"""Builders for hostile paged-attention test cases, shared by the test modules.

Every builder poisons what no sequence owns with NaN (unused blocks, the tail of a
sequence's last block, quantized scales included) and fills block-table entries past a
sequence's last used block with an out-of-range id, so a kernel that reads anything it
should not fails loudly.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

import kvmetal as kv
from kvmetal import quant

# max |out - oracle| / max |oracle|, per docs/design.md
TOLERANCE = {mx.float32: 1e-5, mx.float16: 3e-3, mx.bfloat16: 2e-2}
DTYPES = (mx.float32, mx.float16, mx.bfloat16)


def rel_error(out, ref) -> float:
    out = np.array(out.astype(mx.float32), dtype=np.float64) if isinstance(out, mx.array) else out
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.isfinite(out).all(), "output has NaN/inf"
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30))


def assert_close(out, ref, dtype, factor: float = 1.0):
    err = rel_error(out, ref)
    assert err <= TOLERANCE[dtype] * factor, f"relative error {err:.3g} > {TOLERANCE[dtype] * factor:.3g}"


@dataclass
class PagedCase:
    query: mx.array
    key_cache: object
    value_cache: object
    block_tables: mx.array
    seq_lens: mx.array
    owned: np.ndarray  # bool [N, bs]: slots a sequence owns


def _poison(cache: np.ndarray, owned: np.ndarray) -> np.ndarray:
    cache = cache.copy()
    cache[~owned[:, None, :, None].repeat(cache.shape[1], 1).repeat(cache.shape[3], 3)] = np.nan
    return cache


def paged_case(seq_lens, *, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=mx.float16,
               seed=0, spare_blocks=3, k_bits=None, v_bits=None, group_size=64) -> PagedCase:
    """Random paged cache with shuffled block ids for the given sequence lengths."""
    rng = np.random.default_rng(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq) + 1  # one spare column: never read
    ids = rng.permutation(num_blocks)
    tables = np.full((len(seq_lens), max_blocks), num_blocks + 1000, dtype=np.int32)
    owned = np.zeros((num_blocks, block_size), dtype=bool)
    cursor = 0
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[s, :nb] = ids[cursor:cursor + nb]
        cursor += nb
        for t in range(n):
            owned[tables[s, t // block_size], t % block_size] = True
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    caches = []
    for bits in (k_bits, v_bits):
        data = rng.standard_normal(shape).astype(np.float32)
        if bits is None:
            caches.append(mx.array(_poison(data, owned)).astype(dtype))
        else:
            q = quant.quantize(mx.array(data).astype(dtype), bits=bits, group_size=group_size)
            scales = np.array(q.scales.astype(mx.float32))
            scales = _poison(scales, owned)
            caches.append(q.replace(q.data, mx.array(scales).astype(dtype), q.biases))
    query = mx.array(rng.standard_normal((len(seq_lens), num_heads, head_dim)).astype(np.float32)).astype(dtype)
    return PagedCase(query, caches[0], caches[1], mx.array(tables), mx.array(np.array(seq_lens, np.int32)), owned)


def free_slots(case: PagedCase, count: int, seed: int = 0) -> np.ndarray:
    """``count`` distinct slots no sequence owns (for writes that must not clobber live rows)."""
    block_size = case.owned.shape[1]
    free = np.flatnonzero(~case.owned.reshape(-1))
    rng = np.random.default_rng(seed)
    assert free.size >= count
    return rng.choice(free, size=count, replace=False).astype(np.int32)
