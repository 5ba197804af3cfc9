"""The decode workload every ``kvmetal bench`` case times: one sequence in a paged
cache of the shape below, with shuffled block ids, and the same rows in contiguous
SDPA layout for the baselines."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def paged_setup(tokens: int, dtype, *, num_kv_heads: int = NUM_KV_HEADS, num_heads: int = NUM_HEADS,
                head_dim: int = HEAD_DIM, seed: int = 0):
    """One sequence of ``tokens`` in a paged cache with shuffled block ids, and the same
    keys/values in contiguous SDPA layout for the baselines.

    Returns (query [1, H, D], key_cache, value_cache, block_tables, seq_lens, keys, values)."""
    rng = np.random.default_rng(seed)
    num_blocks = -(-tokens // BLOCK_SIZE)
    shape = (num_blocks, num_kv_heads, BLOCK_SIZE, head_dim)
    key_cache = mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)
    value_cache = mx.random.normal(shape, key=mx.random.key(seed + 1)).astype(dtype)
    table = rng.permutation(num_blocks).astype(np.int32)
    block_tables = mx.array(table[None])
    seq_lens = mx.array([tokens], dtype=mx.int32)
    query = mx.random.normal((1, num_heads, head_dim), key=mx.random.key(seed + 2)).astype(dtype)

    def contiguous(cache):  # [N, Hkv, bs, D] in table order -> [1, Hkv, T, D]
        rows = cache[mx.array(table)].transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
        return rows[None, :, :tokens]

    keys, values = contiguous(key_cache), contiguous(value_cache)
    mx.eval(key_cache, value_cache, keys, values, query)
    return query, key_cache, value_cache, block_tables, seq_lens, keys, values
