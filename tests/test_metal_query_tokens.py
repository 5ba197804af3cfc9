"""The decode kernels with 1-8 query tokens per sequence against the float64 oracles,
run by the simulator (strict checks, two schedule seeds) and, on a Mac, by Metal.

Covering matrix, not a product: every L in 1..8 appears; both kernel modes
(register mode, G x L <= 8 rows; shared-tile mode, more rows); every cache
dtype, float and quantized caches (incl. 3/5/6 bits), softcap, sinks, sliding
windows and split counts. Unused cache slots are NaN (kvcases.paged_case).
"""
import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import reference as ref
from kvmetal.backends import metal_layout

from kvcases import kernel_backends, maybe_quantize, paged_attention_inputs, paged_cache, random, run_checked, run_on

f32, f16, bf16 = mx.float32, mx.float16, mx.bfloat16

# dtype, head_dim, block_size, kv heads, GQA, L, seq lens, splits, softcap, sinks, window, K quant, V quant
PAGED = [
    (f16, 128, 16, 2, 4, 2, (37, 100), None, None, False, None, None, None),          # register, 8 rows
    (bf16, 64, 8, 1, 8, 3, (20, 9), 3, 30.0, False, None, None, None),                # shared, 24 rows
    (f32, 96, 32, 2, 1, 8, (8, 70), None, None, True, 13, None, None),                # register, L = 8
    (f16, 256, 16, 1, 16, 5, (50,), 2, None, False, None, (8, 64), (4, 64)),          # shared, 80 rows, K8/V4
    (f16, 128, 8, 2, 2, 7, (33, 64), None, None, True, 20, (3, 32), (6, 32)),         # shared, odd bits
    (bf16, 80, 16, 1, 6, 4, (7, 45), 2, None, True, None, None, None),                # shared, head_dim 80
    (f32, 64, 16, 3, 1, 6, (6, 29), None, 5.0, False, None, (5, 32), None),           # register, L = seq_len
    (f16, 192, 32, 1, 3, 1, (90,), 4, None, False, 40, None, (2, 64)),                # register, L = 1
]


def _ids(cases, view=False):
    return [f"{str(c[0]).split('.')[-1]}-d{c[1]}-g{c[4 if not view else 3]}-l{c[5 if not view else 4]}-{i}"
            for i, c in enumerate(cases)]


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("case", PAGED, ids=_ids(PAGED))
def test_paged_attention_query_tokens(case, backend):
    dtype, head_dim, block_size, num_kv_heads, gqa, L, lens, splits, softcap, use_sinks, window, kq, vq = case
    rng = np.random.default_rng(head_dim * L + gqa)
    query, kc, vc, tables, seq_lens, sinks = paged_attention_inputs(
        rng, lens=lens, num_kv_heads=num_kv_heads, gqa=gqa, head_dim=head_dim, block_size=block_size, dtype=dtype,
        k_quant=kq, v_quant=vq, use_sinks=use_sinks, query_len=L)
    options = dict(softcap=softcap, sinks=sinks, sliding_window=window)
    expected = ref.paged_attention(query, kc, vc, tables, seq_lens, **options)
    layout = metal_layout.layout_for(query, kc, vc, paged=True)
    assert gqa * L <= metal_layout.ROW_REGISTER_LIMIT or layout.rows_per_simdgroup < gqa * L  # past 8 rows: shared
    for call in run_checked(backend, kv.paged_attention, expected, query, kc, vc, tables, seq_lens,
                            num_splits=splits, kernel="paged_attention_partials", **options):
        assert call.threadgroup_memory == layout.threadgroup_bytes
        assert call.reductions == 0  # partial dots meet through shuffles, not simd_sum


# dtype, head_dim, kv heads, GQA, L, tokens, splits, softcap, sinks, view, K quant, V quant
CONTIGUOUS = [
    (f16, 128, 2, 4, 2, 40, None, None, False, "slice_t", None, None),
    (f32, 64, 1, 8, 8, 19, 3, 20.0, True, "transposed", None, None),
    (bf16, 96, 2, 2, 5, 33, None, None, True, "odd_row_stride", None, None),
    (f16, 128, 1, 3, 7, 64, 2, None, False, "slice_t", (8, 64), (4, 64)),
    (f16, 64, 2, 1, 3, 8, None, None, False, "contiguous", (6, 64), (3, 32)),
]


def _view(base, view, tokens, num_kv_heads, head_dim):
    if view == "slice_t":
        return base[:, :num_kv_heads, 3: 3 + tokens]
    if view == "transposed":  # built as [B, T, Hkv, D]
        return base.transpose(0, 2, 1, 3)
    if view == "odd_row_stride":  # rows head_dim + 2 apart: vector loads would be misaligned
        return base[:, :num_kv_heads, :tokens, :head_dim]
    return base


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("case", CONTIGUOUS, ids=_ids(CONTIGUOUS, view=True))
def test_decode_attention_query_tokens(case, backend):
    dtype, head_dim, num_kv_heads, gqa, L, tokens, splits, softcap, use_sinks, view, kq, vq = case
    rng = np.random.default_rng(tokens + L)
    batch, num_heads = 2, num_kv_heads * gqa
    shape = {"transposed": (batch, tokens, num_kv_heads, head_dim),
             "odd_row_stride": (batch, num_kv_heads, tokens, head_dim + 2),
             "contiguous": (batch, num_kv_heads, tokens, head_dim)}.get(view, (batch, num_kv_heads + 1, tokens + 5,
                                                                              head_dim))
    keys, values = (_view(random(rng, shape, dtype), view, tokens, num_kv_heads, head_dim) for _ in range(2))
    keys, values = maybe_quantize(keys, kq), maybe_quantize(values, vq)
    query = random(rng, (batch, num_heads, L, head_dim), dtype)
    sinks = mx.array(rng.standard_normal(num_heads).astype(np.float32)) if use_sinks else None
    expected = ref.decode_attention(query, keys, values, softcap=softcap, sinks=sinks)
    calls = run_checked(backend, kv.decode_attention, expected, query, keys, values, softcap=softcap, sinks=sinks,
                        num_splits=splits, kernel="decode_attention_partials")
    for call in calls if kq is None else ():
        # Alignment guard: vector loads only where the view keeps them aligned
        # (the simulator would raise MisalignedAccessError otherwise).
        per_load = call.bytes_per_load("key_data")
        assert per_load == (dtype.size if view == "odd_row_stride" else 4 * dtype.size)


@pytest.mark.parametrize("L", [3, 8])
def test_rows_without_a_visible_token_are_zero_and_read_nothing_out_of_bounds(L):
    """validate=False with L > seq_len: rows before the sequence start see no token.

    They output zeros; the other rows match one-token oracle calls at their positions."""
    rng = np.random.default_rng(L)
    lens = (2, 11)
    kc, vc, tables, seq_lens = paged_cache(rng, lens=lens, num_kv_heads=1, head_dim=64, block_size=8,
                                           dtype=f32)
    query = random(rng, (2, L, 2, 64), f32)
    with run_on("sim", seed=1):
        out = np.array(kv.paged_attention(query, kc, vc, tables, seq_lens, validate=False))
    for s, n in enumerate(lens):
        for l in range(L):
            position = n - L + l
            if position < 0:
                assert not out[s, l].any()
            else:
                cut = mx.array([position + 1], dtype=mx.int32)
                one = ref.paged_attention(query[s:s + 1, l], kc, vc, tables[s:s + 1], cut)
                np.testing.assert_allclose(out[s, l], one[0], atol=1e-5)
