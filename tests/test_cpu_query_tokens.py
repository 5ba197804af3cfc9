"""CPU backend: 1 to 8 query tokens per sequence against the float64 oracle (issue 9 item 2).

Paged queries [S, L, H, D] and decode queries [B, H, L, D], causal at the last L
positions, on every SIMD level this CPU has: mixed sequence lengths (one of exactly L
tokens), GQA 1/4/6/8, NaN in every slot no sequence owns, sliding window, softcap, sinks,
float and quantized caches.
"""
from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import _ext, reference
from kvcases import DTYPES, assert_close, paged_case

_LEVELS = ("portable", "avx2", "avx512")
SIMD_LEVELS = _LEVELS[: _LEVELS.index(_ext.simd_level()) + 1]
GQA = (1, 4, 6, 8)
FEATURES = ({}, {"sliding_window": 13}, {"softcap": 4.0}, {"sinks": True}, {"k_bits": 8, "v_bits": 4},
            {"sliding_window": 5, "softcap": 2.0, "sinks": True})


@pytest.fixture(autouse=True)
def _cpu():
    with kv.use_backend("cpu"):
        yield
    _ext.cap_simd_level("avx512")


def _query(num_seqs, rows, num_heads, head_dim, dtype, seed):
    rng = np.random.default_rng(seed)
    return mx.array(rng.standard_normal((num_seqs, rows, num_heads, head_dim)).astype(np.float32)).astype(dtype)


def _paged_rows(rows, gqa, dtype, features, *, head_dim=64, block_size=16, seed=0, group_size=64):
    opts = dict(features)
    bits = {k: opts.pop(k) for k in ("k_bits", "v_bits") if k in opts}
    num_kv_heads = 2
    num_heads = gqa * num_kv_heads
    case = paged_case([rows, block_size + 3, 3 * block_size + rows, 70], num_heads=num_heads,
                      num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype,
                      seed=seed, group_size=group_size, **bits)
    if opts.pop("sinks", False):
        opts["sinks"] = mx.array(np.random.default_rng(seed).standard_normal(num_heads).astype(np.float32))
    query = _query(4, rows, num_heads, head_dim, dtype, seed)
    return case, query, opts


@pytest.mark.parametrize("level", SIMD_LEVELS)
@pytest.mark.parametrize("rows", range(1, 9))
def test_paged_rows_match_the_oracle(level, rows):
    _ext.cap_simd_level(level)
    for i, (gqa, dtype) in enumerate(itertools.product(GQA, DTYPES)):
        features = FEATURES[(i + rows) % len(FEATURES)]
        case, query, opts = _paged_rows(rows, gqa, dtype, features, seed=rows * 31 + i)
        out = kv.paged_attention(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                 num_splits=1 + i % 3, **opts)
        assert out.shape == query.shape and out.dtype == dtype
        ref = reference.paged_attention(query, case.key_cache, case.value_cache, case.block_tables,
                                        case.seq_lens, **opts)
        assert_close(out, ref, dtype)


@pytest.mark.parametrize("head_dim", [96, 128, 256])
@pytest.mark.parametrize("block_size", [8, 32])
def test_paged_rows_other_shapes(head_dim, block_size):
    for rows, features in ((8, {}), (3, {"sliding_window": 9}), (5, {"k_bits": 4, "v_bits": 8})):
        case, query, opts = _paged_rows(rows, 4, mx.float16, features, head_dim=head_dim, block_size=block_size,
                                        group_size=32 if head_dim == 96 else 64)
        out = kv.paged_attention(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, **opts)
        assert_close(out, reference.paged_attention(query, case.key_cache, case.value_cache, case.block_tables,
                                                    case.seq_lens, **opts), mx.float16)


def test_rows_do_not_depend_on_split_count_or_threads():
    case, query, opts = _paged_rows(8, 6, mx.float32, {"sliding_window": 20})
    first = kv.paged_attention(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                               num_splits=1, **opts)
    threads = _ext.num_threads()
    try:
        for splits, n_threads in ((2, 1), (5, 3), (None, 2)):
            _ext.set_num_threads(n_threads)
            out = kv.paged_attention(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                     num_splits=splits, **opts)
            assert_close(out, np.array(first), mx.float32)
    finally:
        _ext.set_num_threads(threads)


def test_one_row_query_equals_the_three_d_call():
    case, query, _ = _paged_rows(1, 4, mx.float32, {})
    four = kv.paged_attention(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    three = kv.paged_attention(query[:, 0], case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    np.testing.assert_array_equal(np.array(four[:, 0]), np.array(three))


@pytest.mark.parametrize("level", SIMD_LEVELS)
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
def test_decode_rows_match_the_oracle_and_mlx_causal_sdpa(level, rows):
    _ext.cap_simd_level(level)
    rng = np.random.default_rng(rows)
    for gqa, dtype, num_tokens in ((1, mx.float32, rows), (4, mx.float16, 45), (6, mx.bfloat16, 100),
                                   (8, mx.float32, 33)):
        shape = (2, 2, num_tokens, 128)
        keys = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
        values = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
        query = mx.array(rng.standard_normal((2, 2 * gqa, rows, 128)).astype(np.float32)).astype(dtype)
        out = kv.decode_attention(query, keys, values, num_splits=2)
        assert out.shape == query.shape
        assert_close(out, reference.decode_attention(query, keys, values), dtype)
        if dtype == mx.float32:
            sdpa = mx.fast.scaled_dot_product_attention(query, keys, values, scale=128 ** -0.5, mask="causal")
            assert_close(out, np.array(sdpa), mx.float32, factor=10)


def test_decode_rows_on_strided_and_quantized_keys():
    from kvmetal import quant
    rng = np.random.default_rng(5)
    big = mx.array(rng.standard_normal((2, 2, 64, 64)).astype(np.float32))
    keys, values = big[:, :, 3:50], big[:, :, 10:57]  # strided views
    query = mx.array(rng.standard_normal((2, 8, 4, 64)).astype(np.float32))
    assert_close(kv.decode_attention(query, keys, values, softcap=3.0),
                 reference.decode_attention(query, keys, values, softcap=3.0), mx.float32)
    qk = quant.quantize(mx.contiguous(keys), bits=8, group_size=64)
    qv = quant.quantize(mx.contiguous(values), bits=4, group_size=32)
    sinks = mx.array(rng.standard_normal(8).astype(np.float32))
    assert_close(kv.decode_attention(query, qk, qv, sinks=sinks),
                 reference.decode_attention(query, qk, qv, sinks=sinks), mx.float32)


# Every K/V format kvmetal serve accepts (bits per side, group sizes; kvmetal.kv_format).
_BITS = (None,) + __import__("kvmetal.quant", fromlist=["SUPPORTED_BITS"]).SUPPORTED_BITS


@pytest.mark.parametrize("level", SIMD_LEVELS)
@pytest.mark.parametrize("int8_k", [False, True], ids=["u8-k", "int8-k"])
def test_each_row_has_the_bits_of_a_one_row_decode_at_its_position(level, int8_k):
    """Speculative decoding's verify pass (issue 44): row l of an L-row query equals, to
    the bit, the one-row query at position len - L + l, in every K/V format, whatever
    the GQA factor (so the rows the kernels block 4 at a time meet the one-row tails)."""
    _ext.cap_simd_level(level)
    was = _ext.int8_k_scores()
    _ext.set_int8_k_scores(int8_k)
    rng = np.random.default_rng(44)
    failures = []
    try:
        for i, (k_bits, v_bits) in enumerate(itertools.product(_BITS, _BITS)):
            if int8_k and k_bits != 8:
                continue
            gqa = (1, 2, 3, 4, 5, 8)[i % 6]
            rows = 2 + i % 7
            head_dim = 128 if i % 2 == 0 else 64
            group = (32, 64, 128)[i // 2 % 3] if head_dim == 128 else (32, 64)[i // 2 % 2]
            dtype = (mx.float32, mx.float16, mx.bfloat16)[i % 3]
            lens = [rows, 19 + rows, 40, 70]
            case = paged_case(lens, num_heads=2 * gqa, num_kv_heads=2, head_dim=head_dim, block_size=(8, 16)[i % 2],
                              dtype=dtype, seed=i, k_bits=k_bits, v_bits=v_bits, group_size=group)
            query = _query(len(lens), rows, 2 * gqa, head_dim, dtype, int(rng.integers(1 << 30)))
            opts = {"sliding_window": 13} if i % 4 == 1 else {}
            if i % 5 == 2:
                opts["sinks"] = mx.array(rng.standard_normal(2 * gqa).astype(np.float32))
            out = kv.paged_attention(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                     **opts)
            for l in range(rows):
                lens_l = mx.array(np.array(lens, np.int32) - (rows - 1 - l))
                one = kv.paged_attention(query[:, l], case.key_cache, case.value_cache, case.block_tables, lens_l,
                                         **opts)
                if not np.array_equal(np.array(out[:, l].astype(mx.float32)), np.array(one.astype(mx.float32))):
                    failures.append(f"K{k_bits}/V{v_bits} g{group} gqa {gqa} {dtype} row {l} of {rows}")
    finally:
        _ext.set_int8_k_scores(was)
    assert not failures, failures
