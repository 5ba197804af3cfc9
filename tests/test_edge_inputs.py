"""Valid corner cases through every public op, on every backend here (issue 10).

Empty batches, zero new tokens, empty copy lists, int64 and non-contiguous index
arrays, non-contiguous queries, split counts and windows far past what the cache holds
(clamped: documented in ops), and the smallest softcap float32 holds as a normal number.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import reference
from kvcases import backend_params, assert_close, free_slots, paged_case

BACKENDS = backend_params()  # metal skipped, with the reason, off a Mac


@pytest.fixture(params=BACKENDS)
def backend(request):
    with kv.use_backend(request.param):
        yield request.param


@pytest.fixture
def case():
    return paged_case([5, 30], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=mx.float32, seed=1)


def _oracle(case, **opts):
    return reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                     case.seq_lens, **opts)


def _attend(case, **overrides):
    args = dict(query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
                block_tables=case.block_tables, seq_lens=case.seq_lens)
    options = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    return kv.paged_attention(*args.values(), **options)


def _same(a, b) -> bool:
    a, b = np.array(a), np.array(b)
    return a.shape == b.shape and np.array_equal(np.nan_to_num(a), np.nan_to_num(b)) and \
        np.array_equal(np.isnan(a), np.isnan(b))


def test_empty_batches(backend, case):
    for validate in (True, False):
        out = _attend(case, query=case.query[:0], block_tables=case.block_tables[:0], seq_lens=case.seq_lens[:0],
                      validate=validate)
        assert out.shape == (0, 8, 64) and out.dtype == case.query.dtype
        keys, values = kv.gather_kv_cache(case.key_cache, case.value_cache, case.block_tables[:0],
                                          case.seq_lens[:0], validate=validate)
        assert keys.shape == (0, 2, case.block_tables.shape[1] * 16, 64) and values.shape == keys.shape
        kc, vc = kv.reshape_and_cache(mx.zeros((0, 2, 64)), mx.zeros((0, 2, 64)), case.key_cache,
                                      case.value_cache, mx.zeros((0,), dtype=mx.int64), validate=validate)
        assert _same(kc, case.key_cache) and _same(vc, case.value_cache)
        kc, vc = kv.copy_blocks(case.key_cache, case.value_cache, mx.zeros((0,), dtype=mx.int32),
                                mx.zeros((0,), dtype=mx.int32), validate=validate)
        assert _same(kc, case.key_cache)
    out = kv.decode_attention(mx.zeros((0, 4, 1, 64)), mx.zeros((0, 2, 8, 64)), mx.zeros((0, 2, 8, 64)))
    assert out.shape == (0, 4, 1, 64)


def test_int64_and_non_contiguous_indices(backend, case):
    ref = _oracle(case)
    wide = mx.array(np.repeat(np.array(case.block_tables), 2, axis=1))[:, ::2]  # strided view
    lens = mx.array(np.repeat(np.array(case.seq_lens), 2))[::2]
    assert_close(_attend(case, block_tables=wide, seq_lens=lens), ref, mx.float32)
    assert_close(_attend(case, block_tables=case.block_tables.astype(mx.int64),
                         seq_lens=case.seq_lens.astype(mx.int64)), ref, mx.float32)
    keys, _ = kv.gather_kv_cache(case.key_cache, case.value_cache, wide.astype(mx.int64), lens)
    ref_k, _ = reference.gather_kv_cache(case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    np.testing.assert_array_equal(np.array(keys), ref_k)
    # Strided int64 slots, with padding.
    rows = mx.random.normal((3, 2, 64), key=mx.random.key(3))
    free = free_slots(case, 3)
    slots = mx.array(np.stack([free, -np.ones(3, np.int64)], axis=1).reshape(-1))[::2]
    kc, vc = kv.reshape_and_cache(rows, rows, case.key_cache, case.value_cache, slots)
    ref_kc, _ = reference.reshape_and_cache(rows, rows, case.key_cache, case.value_cache, free)
    np.testing.assert_array_equal(np.array(kc), ref_kc)


def test_non_contiguous_query(backend, case):
    q = mx.array(np.ascontiguousarray(np.array(case.query).transpose(1, 0, 2))).transpose(1, 0, 2)
    assert_close(_attend(case, query=q), _oracle(case), mx.float32)


def test_split_counts_and_windows_past_the_cache_are_clamped(backend, case):
    ref = _oracle(case)
    for splits in (2**31 - 1, 2**40):
        assert_close(_attend(case, num_splits=splits), ref, mx.float32)
    assert_close(_attend(case, sliding_window=2**40), ref, mx.float32)
    assert_close(_attend(case, sliding_window=case.block_tables.shape[1] * 16), ref, mx.float32)
    q, k = mx.random.normal((1, 4, 1, 64), key=mx.random.key(1)), mx.random.normal((1, 2, 40, 64), key=mx.random.key(2))
    assert_close(kv.decode_attention(q, k, k, num_splits=2**40), reference.decode_attention(q, k, k), mx.float32)


def test_smallest_normal_softcap_gives_uniform_attention(backend, case):
    # softcap * tanh(s / softcap) is +-softcap: all scores equal, so attention is uniform.
    tiny = float(np.finfo(np.float32).tiny)
    ref = _oracle(case, softcap=tiny)
    assert_close(_attend(case, softcap=tiny), ref, mx.float32)
    values = reference.to_f64(case.value_cache)
    mean = values[np.array(case.block_tables)[1, 0], 0, :16].mean(0) * 16 + \
        values[np.array(case.block_tables)[1, 1], 0, :14].mean(0) * 14
    np.testing.assert_allclose(ref[1, 0], mean / 30, rtol=1e-9)
