"""Bad input raises ValueError/TypeError naming the argument, before any kernel runs."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import backends, quant
from kvcases import paged_case


@pytest.fixture(autouse=True)
def no_kernels(monkeypatch):
    """Any backend call inside these tests is a failure: checks must come first."""
    def refuse(name=None):
        raise AssertionError("a backend was reached with bad input")
    monkeypatch.setattr(backends, "get", refuse)


@pytest.fixture
def case():
    return paged_case([5, 30], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=mx.float16)


def attention(case, **overrides):
    args = dict(query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
                block_tables=case.block_tables, seq_lens=case.seq_lens)
    options = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    return kv.paged_attention(args["query"], args["key_cache"], args["value_cache"], args["block_tables"],
                              args["seq_lens"], **options)


def test_wrong_rank(case):
    with pytest.raises(ValueError, match=r"\[paged_attention\] query must have rank 3 .* or rank 4"):
        attention(case, query=case.query[None, None])
    with pytest.raises(ValueError, match=r"key_cache must have rank 4"):
        attention(case, key_cache=case.key_cache[0])
    with pytest.raises(ValueError, match=r"block_tables must have rank 2"):
        attention(case, block_tables=case.block_tables[0])
    with pytest.raises(ValueError, match=r"\[decode_attention\] query must have rank 4"):
        kv.decode_attention(mx.zeros((1, 8, 64)), mx.zeros((1, 2, 4, 64)), mx.zeros((1, 2, 4, 64)))


def test_wrong_dtype(case):
    with pytest.raises(TypeError, match=r"query must have dtype"):
        attention(case, query=case.query.astype(mx.int32))
    with pytest.raises(TypeError, match=r"key_cache and value_cache must have the same dtype"):
        attention(case, value_cache=case.value_cache.astype(mx.float32))
    with pytest.raises(TypeError, match=r"seq_lens must have dtype"):
        attention(case, seq_lens=case.seq_lens.astype(mx.float32))
    with pytest.raises(TypeError, match=r"slot_mapping must have dtype"):
        kv.reshape_and_cache(mx.zeros((1, 2, 64)), mx.zeros((1, 2, 64)), case.key_cache, case.value_cache,
                             mx.zeros((1,), dtype=mx.float32))
    with pytest.raises(TypeError, match=r"key_cache must be an mx.array"):
        attention(case, key_cache=np.zeros((4, 2, 16, 64)))


def test_mismatched_heads(case):
    with pytest.raises(ValueError, match=r"key must have shape \[T, 2, 64\]"):
        kv.reshape_and_cache(mx.zeros((1, 3, 64)), mx.zeros((1, 3, 64)), case.key_cache, case.value_cache,
                             mx.zeros((1,), dtype=mx.int32))
    with pytest.raises(ValueError, match=r"key_cache and value_cache must have the same shape"):
        attention(case, value_cache=case.value_cache[:, :1])
    with pytest.raises(ValueError, match=r"query head_dim 32 does not match"):
        attention(case, query=case.query[..., :32])


def test_gqa_not_divisible(case):
    with pytest.raises(ValueError, match=r"query heads \(7\) must be a multiple of kv heads \(2\)"):
        attention(case, query=case.query[:, :7])
    with pytest.raises(ValueError, match=r"\[decode_attention\] query heads \(3\)"):
        kv.decode_attention(mx.zeros((1, 3, 1, 64)), mx.zeros((1, 2, 4, 64)), mx.zeros((1, 2, 4, 64)))


def test_unsupported_head_dim_and_block_size():
    cache = mx.zeros((4, 2, 16, 72))
    with pytest.raises(ValueError, match=r"head_dim 72 .* not supported"):
        kv.paged_attention(mx.zeros((1, 2, 72)), cache, cache, mx.zeros((1, 2), mx.int32), mx.ones((1,), mx.int32))
    cache = mx.zeros((4, 2, 12, 64))
    with pytest.raises(ValueError, match=r"block_size 12 .* not supported"):
        kv.gather_kv_cache(cache, cache, mx.zeros((1, 2), mx.int32), mx.ones((1,), mx.int32))


def test_block_id_out_of_range(case):
    tables = np.array(case.block_tables)
    tables[1, 1] = case.key_cache.shape[0]  # seq 1 (30 tokens) uses blocks 0 and 1
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = \d+ is out of range"):
        attention(case, block_tables=mx.array(tables))
    tables[1, 1] = -1
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = -1 is out of range"):
        attention(case, block_tables=mx.array(tables))
    with pytest.raises(ValueError, match=r"src\[0\] = 99 is out of range"):
        kv.copy_blocks(case.key_cache, case.value_cache, mx.array([99]), mx.array([0]))
    with pytest.raises(ValueError, match=r"dst names the same block twice"):
        kv.copy_blocks(case.key_cache, case.value_cache, mx.array([0, 1]), mx.array([2, 2]))


def test_slot_out_of_range(case):
    num_slots = case.key_cache.shape[0] * 16
    rows = mx.zeros((2, 2, 64))
    with pytest.raises(ValueError, match=rf"slot_mapping\[1\] = {num_slots} is out of range"):
        kv.reshape_and_cache(rows, rows, case.key_cache, case.value_cache, mx.array([0, num_slots]))
    with pytest.raises(ValueError, match=r"same slot twice"):
        kv.reshape_and_cache(rows, rows, case.key_cache, case.value_cache, mx.array([3, 3]))
    with pytest.raises(ValueError, match=r"one slot per token"):
        kv.reshape_and_cache(rows, rows, case.key_cache, case.value_cache, mx.array([3]))


def test_seq_len_beyond_block_table(case):
    capacity = case.block_tables.shape[1] * 16
    with pytest.raises(ValueError, match=rf"seq_lens\[0\] = {capacity + 1} exceeds its block table capacity"):
        attention(case, seq_lens=mx.array([capacity + 1, 3], dtype=mx.int32))
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = 0"):
        attention(case, seq_lens=mx.array([3, 0], dtype=mx.int32))


def test_bad_options(case):
    with pytest.raises(ValueError, match=r"softcap must be"):
        attention(case, softcap=-1.0)
    with pytest.raises(ValueError, match=r"sliding_window must be"):
        attention(case, sliding_window=0)
    with pytest.raises(ValueError, match=r"num_splits must be"):
        attention(case, num_splits=0)
    with pytest.raises(ValueError, match=r"sinks must have one logit per query head \(8\)"):
        attention(case, sinks=mx.zeros((3,)))
    with pytest.raises(TypeError, match=r"scale must be"):
        attention(case, scale="big")
    with pytest.raises(ValueError, match=r"max_len must be"):
        kv.gather_kv_cache(case.key_cache, case.value_cache, case.block_tables, case.seq_lens, max_len=0)


def test_bad_quantized_cache(case):
    good = quant.quantize(mx.zeros((4, 2, 16, 64)), bits=8, group_size=64)
    with pytest.raises(ValueError, match=r"key_cache.bits must be one of"):
        attention(case, key_cache=quant.QuantizedKV(good.data, good.scales, good.biases, 7, 64))
    with pytest.raises(ValueError, match=r"key_cache.scales must have shape"):
        attention(case, key_cache=good.replace(good.data, good.scales[..., :0], good.biases))


def test_bad_call_leaves_cache_untouched(case):
    before = np.array(case.key_cache)
    rows = mx.ones((2, 2, 64))
    with pytest.raises(ValueError):
        kv.reshape_and_cache(rows, rows, case.key_cache, case.value_cache, mx.array([0, 10**6]))
    np.testing.assert_array_equal(np.isnan(np.array(case.key_cache)), np.isnan(before))
    np.testing.assert_array_equal(np.nan_to_num(np.array(case.key_cache)), np.nan_to_num(before))
