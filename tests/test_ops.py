"""Every public op against its float64 oracle, on every backend available here.

The CPU backend runs the full docs/design.md shape matrix; the simulator (slow: it runs the
Metal kernels thread by thread) runs a covering subset here, and the kernel tests in
test_metal*.py cover its full matrix.
"""
from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

import kvmetal as kv
from kvmetal import ops, quant, reference
from kvcases import DTYPES, assert_close, backend_params, free_slots, paged_case, rel_error, skip_unless_available

BACKENDS = backend_params()  # metal skipped, with the reason, off a Mac
HEAD_DIMS = ops.SUPPORTED_HEAD_DIMS
BLOCK_SIZES = ops.SUPPORTED_BLOCK_SIZES
GQA = (1, 4, 6, 8)


def matrix(backend):
    """(dtype, head_dim, block_size, gqa): the full product on cpu, a covering subset on sim.

    The subset pairs every dtype with every block size (9 cases) and walks the head dims
    and GQA factors along them, so each block size, dtype, head dim and GQA factor appears
    (a plain stride through the product kept one block size only)."""
    full = list(itertools.product(DTYPES, HEAD_DIMS, BLOCK_SIZES))
    cases = [(d, h, b, GQA[i % len(GQA)]) for i, (d, h, b) in enumerate(full)]
    if backend != "sim":
        return cases
    pairs = list(itertools.product(DTYPES, BLOCK_SIZES))
    count = max(len(pairs), len(HEAD_DIMS), len(GQA))  # every head dim, even with more dims than pairs
    return [(pairs[i % len(pairs)][0], HEAD_DIMS[i % len(HEAD_DIMS)], pairs[i % len(pairs)][1], GQA[i % len(GQA)])
            for i in range(count)]


def backend_matrix():
    return [pytest.param(b, *case, marks=skip_unless_available(b),
                         id=f"{b}-{str(case[0]).split('.')[-1]}-d{case[1]}-bs{case[2]}-g{case[3]}")
            for b in ("metal", "cpu", "sim") for case in matrix(b)]


def test_simulator_subset_covers_every_block_size_dtype_and_head_dim():
    sim = matrix("sim")
    assert {c[2] for c in sim} == set(BLOCK_SIZES)
    assert {c[0] for c in sim} == set(DTYPES) and {c[1] for c in sim} == set(HEAD_DIMS)
    assert {c[3] for c in sim} == set(GQA)


@pytest.fixture(autouse=True)
def _seed():
    mx.random.seed(0)


@pytest.mark.parametrize("backend,dtype,head_dim,block_size,gqa", backend_matrix())
def test_paged_attention_matrix(backend, dtype, head_dim, block_size, gqa):
    lens = [1, block_size + 1, 3 * block_size - 5]
    case = paged_case(lens, num_heads=2 * gqa, num_kv_heads=2, head_dim=head_dim, block_size=block_size,
                      dtype=dtype, seed=head_dim + block_size)
    with kv.use_backend(backend):
        out = kv.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    assert out.dtype == dtype and out.shape == case.query.shape
    ref = reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_mixed_lengths_one_call(backend, dtype):
    """Four sequences of lengths 1, 17, 1000, 4099 in one call (issue 2's must-show)."""
    lens = [1, 17, 1000, 4099] if backend != "sim" else [1, 17, 100, 409]
    case = paged_case(lens, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=dtype, seed=7)
    with kv.use_backend(backend):
        out = kv.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    ref = reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("feature", ["softcap", "sinks", "window", "all"])
def test_paged_attention_features(backend, feature):
    dtype = mx.float32
    lens = [1, 37, 130, 77]
    case = paged_case(lens, num_heads=12, num_kv_heads=2, head_dim=64, block_size=8, dtype=dtype, seed=3)
    opts = {}
    if feature in ("softcap", "all"):
        opts["softcap"] = 2.5
    if feature in ("sinks", "all"):
        opts["sinks"] = mx.array(np.linspace(-2, 3, 12).astype(np.float32))
    if feature in ("window", "all"):
        opts["sliding_window"] = 20
    opts["scale"] = 0.3
    with kv.use_backend(backend):
        out = kv.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                 case.seq_lens, **opts)
    ref = reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                    case.seq_lens, **opts)
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_split_count_invariance(backend, dtype):
    lens = [300, 45]
    case = paged_case(lens, num_heads=8, num_kv_heads=8, head_dim=64, block_size=16, dtype=dtype, seed=11)
    ref = reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    outs = []
    with kv.use_backend(backend):
        for splits in (1, 3, 7):
            out = kv.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                     case.seq_lens, num_splits=splits)
            assert_close(out, ref, dtype)
            outs.append(np.array(out.astype(mx.float32)))
    for other in outs[1:]:
        diff = rel_error(other, outs[0])  # per (sequence, head) row
        assert diff <= 2e-2 if dtype == mx.bfloat16 else diff <= 3e-3


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_reshape_and_cache(backend, dtype):
    case = paged_case([5, 20], num_heads=4, num_kv_heads=4, head_dim=80, block_size=8, dtype=dtype,
                      spare_blocks=4, seed=2)
    num_tokens = 9
    rng = np.random.default_rng(0)
    key = mx.array(rng.standard_normal((num_tokens, 4, 80)).astype(np.float32))  # float32 rows: converted
    value = mx.array(rng.standard_normal((num_tokens, 4, 80)).astype(np.float32))
    slots = free_slots(case, num_tokens)
    slots[3] = -1  # padding token: skipped
    slot_mapping = mx.array(slots)
    ref_k, ref_v = reference.reshape_and_cache(key.astype(dtype), value.astype(dtype), case.key_cache,
                                               case.value_cache, slot_mapping)
    with kv.use_backend(backend):
        kc, vc = kv.reshape_and_cache(key, value, case.key_cache, case.value_cache, slot_mapping)
    assert kc.dtype == dtype and kc.shape == case.key_cache.shape
    for out, ref in ((kc, ref_k), (vc, ref_v)):
        out = np.array(out.astype(mx.float32), dtype=np.float64)
        # NaN slots stay NaN, written and untouched slots equal the oracle exactly
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        np.testing.assert_array_equal(np.nan_to_num(out), np.nan_to_num(ref))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_gather_kv_cache(backend, dtype):
    case = paged_case([1, 17, 40], num_heads=4, num_kv_heads=2, head_dim=96, block_size=16, dtype=dtype, seed=5)
    with kv.use_backend(backend):
        keys, values = kv.gather_kv_cache(case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
        short_k, _ = kv.gather_kv_cache(case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                        max_len=20)
    ref_k, ref_v = reference.gather_kv_cache(case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    assert keys.shape == (3, 2, case.block_tables.shape[1] * 16, 96) and keys.dtype == dtype
    np.testing.assert_array_equal(np.array(keys.astype(mx.float32)), ref_k)
    np.testing.assert_array_equal(np.array(values.astype(mx.float32)), ref_v)
    np.testing.assert_array_equal(np.array(short_k.astype(mx.float32)), ref_k[:, :, :20])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_decode_attention(backend, dtype):
    rng = np.random.default_rng(4)
    batch, heads, kv_heads, tokens, dim = 2, 12, 2, 75 if backend == "sim" else 301, 128
    big = mx.array(rng.standard_normal((batch, kv_heads, tokens + 40, dim)).astype(np.float32)).astype(dtype)
    big_v = mx.array(rng.standard_normal((batch, kv_heads, tokens + 40, dim)).astype(np.float32)).astype(dtype)
    keys, values = big[:, :, :tokens], big_v[:, :, :tokens]  # strided views of a larger cache
    query = mx.array(rng.standard_normal((batch, heads, 1, dim)).astype(np.float32)).astype(dtype)
    sinks = mx.array(rng.standard_normal(heads).astype(np.float32))
    with kv.use_backend(backend):
        out = kv.decode_attention(query, keys, values, num_splits=3)
        out_opts = kv.decode_attention(query, keys, values, softcap=4.0, sinks=sinks, scale=0.1)
    assert out.shape == query.shape and out.dtype == dtype
    assert_close(out, reference.decode_attention(query, keys, values), dtype)
    assert_close(out_opts, reference.decode_attention(query, keys, values, softcap=4.0, sinks=sinks, scale=0.1),
                 dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_attention_matches_mlx_sdpa(backend):
    rng = np.random.default_rng(8)
    q = mx.array(rng.standard_normal((1, 8, 1, 64)).astype(np.float32))
    k = mx.array(rng.standard_normal((1, 2, 50, 64)).astype(np.float32))
    v = mx.array(rng.standard_normal((1, 2, 50, 64)).astype(np.float32))
    expected = mx.fast.scaled_dot_product_attention(q, k, v, scale=64 ** -0.5)
    with kv.use_backend(backend):
        out = kv.decode_attention(q, k, v)
    assert_close(out, np.array(expected), mx.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_copy_blocks(backend, dtype):
    case = paged_case([20, 9], num_heads=2, num_kv_heads=2, head_dim=64, block_size=8, dtype=dtype, spare_blocks=5)
    src = mx.array(np.array(case.block_tables)[0, :3])
    spare = np.flatnonzero(~case.owned.any(axis=1))[:3].astype(np.int32)
    dst = mx.array(spare)
    ref_k, ref_v = reference.copy_blocks(case.key_cache, case.value_cache, src, dst)
    with kv.use_backend(backend):
        kc, vc = kv.copy_blocks(case.key_cache, case.value_cache, src, dst)
    for out, ref in ((kc, ref_k), (vc, ref_v)):
        out = np.array(out.astype(mx.float32), dtype=np.float64)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        np.testing.assert_array_equal(np.nan_to_num(out), np.nan_to_num(ref))


# ----------------------------------------------------------------------------- quantized caches

QUANT_MIXES = [(8, 4), (8, 8), (4, 4), (3, 5), (6, 2)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k_bits,v_bits", QUANT_MIXES)
def test_paged_attention_quantized(backend, k_bits, v_bits):
    """Quantized paths match the oracle run on the dequantized cache, at the float budget."""
    dtype = mx.float16
    case = paged_case([1, 19, 70], num_heads=8, num_kv_heads=2, head_dim=128, block_size=16, dtype=dtype,
                      k_bits=k_bits, v_bits=v_bits, group_size=64, seed=k_bits * 10 + v_bits)
    opts = dict(softcap=5.0, sinks=mx.array(np.linspace(-1, 1, 8).astype(np.float32)))
    with kv.use_backend(backend):
        out = kv.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                 case.seq_lens, **opts)
        out_window = kv.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                        case.seq_lens, sliding_window=24, num_splits=3)
    ref = reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                    case.seq_lens, **opts)
    assert_close(out, ref, dtype)
    ref_w = reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                      case.seq_lens, sliding_window=24)
    assert_close(out_window, ref_w, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("k_bits,v_bits", [(8, 4), (4, 8)])
def test_reshape_and_cache_quantized(backend, k_bits, v_bits):
    """Quantize on write: each row equals what mx.quantize makes of that row; nothing else changes."""
    case = paged_case([10, 3], num_heads=2, num_kv_heads=2, head_dim=64, block_size=8, dtype=mx.float16,
                      k_bits=k_bits, v_bits=v_bits, group_size=32, spare_blocks=3)
    rng = np.random.default_rng(1)
    key = mx.array(rng.standard_normal((6, 2, 64)).astype(np.float16))
    value = mx.array(rng.standard_normal((6, 2, 64)).astype(np.float16))
    slots = free_slots(case, 6)
    with kv.use_backend(backend):
        kc, vc = kv.reshape_and_cache(key, value, case.key_cache, case.value_cache, mx.array(slots))
    for new, old, rows, bits in ((kc, case.key_cache, key, k_bits), (vc, case.value_cache, value, v_bits)):
        fresh = quant.quantize(rows, bits=bits, group_size=32)
        for part, (before, after, written) in enumerate(zip(old.arrays(), new.arrays(), fresh.arrays())):
            expected = np.array(before)
            for t, slot in enumerate(slots):
                block, offset = divmod(int(slot), 8)
                expected[block, :, offset] = np.array(written)[t]
            after = np.array(after)
            np.testing.assert_array_equal(np.isnan(after), np.isnan(expected), err_msg=f"part {part}")
            np.testing.assert_array_equal(np.nan_to_num(after), np.nan_to_num(expected), err_msg=f"part {part}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_and_decode_quantized(backend):
    case = paged_case([33, 8], num_heads=4, num_kv_heads=2, head_dim=64, block_size=8, dtype=mx.float16,
                      k_bits=8, v_bits=4, group_size=64)
    with kv.use_backend(backend):
        keys, values = kv.gather_kv_cache(case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    ref_k, ref_v = reference.gather_kv_cache(case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    assert keys.dtype == mx.float16
    assert_close(keys, ref_k, mx.float16)
    assert_close(values, ref_v, mx.float16)

    rng = np.random.default_rng(3)
    dense_k = mx.array(rng.standard_normal((2, 2, 50, 64)).astype(np.float16))
    dense_v = mx.array(rng.standard_normal((2, 2, 50, 64)).astype(np.float16))
    qk, qv = quant.quantize(dense_k, bits=8, group_size=64), quant.quantize(dense_v, bits=4, group_size=64)
    query = mx.array(rng.standard_normal((2, 4, 1, 64)).astype(np.float16))
    with kv.use_backend(backend):
        out = kv.decode_attention(query, qk, qv)
    assert_close(out, reference.decode_attention(query, qk, qv), mx.float16)


# ----------------------------------------------------------------------------- generated shapes

@pytest.mark.parametrize("backend", backend_params(("metal", "cpu")))
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_paged_attention_generated(backend, data):
    dtype = data.draw(st.sampled_from(DTYPES))
    block_size = data.draw(st.sampled_from(BLOCK_SIZES))
    head_dim = data.draw(st.sampled_from(HEAD_DIMS))
    kv_heads = data.draw(st.integers(1, 3))
    gqa = data.draw(st.integers(1, 9))
    lens = data.draw(st.lists(st.integers(1, 150), min_size=1, max_size=4))
    splits = data.draw(st.one_of(st.none(), st.integers(1, 9)))
    window = data.draw(st.one_of(st.none(), st.integers(1, 160)))
    case = paged_case(lens, num_heads=kv_heads * gqa, num_kv_heads=kv_heads, head_dim=head_dim,
                      block_size=block_size, dtype=dtype, seed=data.draw(st.integers(0, 10**6)))
    with kv.use_backend(backend):
        out = kv.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                 case.seq_lens, num_splits=splits, sliding_window=window)
    ref = reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                    case.seq_lens, sliding_window=window)
    assert_close(out, ref, dtype)
