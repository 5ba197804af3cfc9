"""paged_attention_varlen: ragged query runs (prefill chunks and decode rows in one call)
over a paged cache, against the float64 oracle, on every backend in BACKENDS.

A case is a list of runs (seq_len, n_s): sequence s holds seq_len cached tokens and owns
its last n_s of them as query rows. The cache comes from kvcases.paged_case: shuffled
block ids, NaN in every slot no sequence owns, table padding out of range. Errors are
measured per (query row, head): max |out - ref| over D / max |ref| over D, so one bad
row cannot hide behind a large one elsewhere in the batch.

The simulator (and Metal) join by adding their name to BACKENDS; cases marked
``small`` are the ones a slow backend runs.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import reference
from kvcases import TOLERANCE
from paged_cases import VarlenCase, varlen_case

BACKENDS = ["cpu"]
FULL_BACKENDS = {"cpu"}  # backends that run every case; the others run the small ones


def oracle(case: VarlenCase, **opts) -> np.ndarray:
    return reference.paged_attention_varlen(*case.args(), sinks=case.sinks, **opts)


def row_errors(out, ref) -> np.ndarray:
    """[T, H] relative errors: max |out - ref| / max |ref| over each (row, head)."""
    out = np.array(out.astype(mx.float32), dtype=np.float64) if isinstance(out, mx.array) else np.asarray(out)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.isfinite(out).all(), "output has NaN/inf (a kernel read a poisoned slot?)"
    scale = np.abs(ref).max(axis=-1)
    err = np.abs(out - ref).max(axis=-1)
    # A row that sees nothing must be exactly zero.
    assert (err[scale == 0] == 0).all(), "a row that sees no token is not zeros"
    return err / np.where(scale == 0, 1.0, scale)


def assert_rows_close(out, ref, dtype, factor: float = 1.0):
    err = row_errors(out, ref)
    worst = np.unravel_index(np.argmax(err), err.shape) if err.size else None
    assert err.size == 0 or err.max() <= TOLERANCE[dtype] * factor, (
        f"relative error {err.max():.3g} at (row, head) {worst} > {TOLERANCE[dtype] * factor:.3g}")


def run(backend, case: VarlenCase, **opts):
    with kv.use_backend(backend):
        out = kv.paged_attention_varlen(*case.args(), sinks=case.sinks, **opts)
        mx.eval(out)
    assert out.dtype == case.query.dtype and out.shape == case.query.shape
    return out


# (name, runs, small): every n_s of the issue, prefixes before a chunk, lengths off the block size.
MIXES = [
    ("decode_rows", [(5, 1), (17, 1), (1, 1), (40, 1)], True),
    ("ragged", [(9, 0), (1, 1), (23, 7), (8, 8), (30, 9), (33, 33), (0, 0)], True),
    ("prefix_then_chunk", [(75, 33), (50, 9), (16, 1)], True),
    ("long_chunk", [(250, 230), (3, 2), (61, 1)], False),
    ("square_prefill", [(201, 201)], False),
    ("long_context_few_rows", [(1300, 1), (700, 5)], False),  # few query tiles: KV splits merged
]
CASES = [(b, name, runs) for b in BACKENDS for name, runs, small in MIXES if small or b in FULL_BACKENDS]


@pytest.mark.parametrize("backend,name,runs", CASES, ids=[f"{b}-{n}" for b, n, _ in CASES])
@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16], ids=["f32", "f16", "bf16"])
def test_ragged_mixes_match_the_oracle(backend, name, runs, dtype):
    case = varlen_case(runs, dtype=dtype, num_heads=8, num_kv_heads=2)
    assert_rows_close(run(backend, case), oracle(case), dtype)


SHAPES = [  # (num_heads, num_kv_heads, head_dim, block_size)
    (4, 4, 64, 16),    # GQA 1
    (9, 3, 64, 16),    # GQA 3 (SmolLM2-135M)
    (8, 2, 128, 8),    # GQA 4
    (8, 1, 256, 32),   # GQA 8, MQA
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,block_size", SHAPES)
def test_gqa_head_dims_and_block_sizes(backend, num_heads, num_kv_heads, head_dim, block_size):
    runs = [(45, 13), (12, 1), (70, 40)] if backend in FULL_BACKENDS else [(21, 10), (6, 1)]
    case = varlen_case(runs, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=mx.float32, seed=3)
    assert_rows_close(run(backend, case), oracle(case), mx.float32)


OPTIONS = {
    "window": dict(sliding_window=20),
    "window_1": dict(sliding_window=1),
    "softcap": dict(softcap=4.0),
    "scale": dict(scale=0.3),
    "all": dict(sliding_window=37, softcap=10.0),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("option", sorted(OPTIONS))
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_window_softcap_and_sinks(backend, option, sinks):
    runs = [(90, 70), (40, 1), (33, 9), (0, 0)] if backend in FULL_BACKENDS else [(25, 12), (9, 1)]
    case = varlen_case(runs, dtype=mx.float32, sinks=sinks, seed=5)
    assert_rows_close(run(backend, case, **OPTIONS[option]), oracle(case, **OPTIONS[option]), mx.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bits", [(8, 4), (4, 8), (8, 8), (None, 4), (2, None)],
                         ids=["k8v4", "k4v8", "k8v8", "fv4", "k2f"])
@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16], ids=["f16", "bf16"])
def test_quantized_caches(backend, bits, dtype):
    """Against the oracle run on the dequantized cache, at the float budget."""
    runs = [(64, 40), (20, 1), (37, 9)] if backend in FULL_BACKENDS else [(19, 10), (5, 1)]
    case = varlen_case(runs, dtype=dtype, k_bits=bits[0], v_bits=bits[1], seed=7, sinks=True)
    assert_rows_close(run(backend, case, sliding_window=30), oracle(case, sliding_window=30), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quantized", [False, True], ids=["float", "k8v4"])
def test_one_token_runs_equal_paged_attention(backend, quantized):
    """Every n_s = 1: the same numbers as paged_attention on [S, H, D], on the same backend."""
    bits = dict(k_bits=8, v_bits=4) if quantized else {}
    case = varlen_case([(5, 1), (40, 1), (1, 1), (17, 1)], dtype=mx.float32, sinks=True, seed=2, **bits)
    with kv.use_backend(backend):
        paged = kv.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                   case.seq_lens, sinks=case.sinks, sliding_window=9)
    varlen = run(backend, case, sliding_window=9)
    np.testing.assert_allclose(np.array(varlen), np.array(paged), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_short_runs_equal_multi_token_paged_attention(backend):
    """Every n_s = L <= 8: paged_attention's [S, L, H, D] query, row for row."""
    L = 6
    case = varlen_case([(7, L), (30, L), (16, L)], dtype=mx.float32, seed=4)
    query4 = case.query.reshape(3, L, *case.query.shape[1:])
    with kv.use_backend(backend):
        paged = kv.paged_attention(query4, case.key_cache, case.value_cache, case.block_tables, case.seq_lens)
    varlen = run(backend, case)
    np.testing.assert_allclose(np.array(varlen), np.array(paged).reshape(case.query.shape), rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_that_see_nothing_and_empty_calls(backend):
    case = varlen_case([(0, 0), (4, 4), (0, 0)], dtype=mx.float32, sinks=True)
    out = np.array(run(backend, case))
    ref = oracle(case)
    assert_rows_close(out, ref, mx.float32)
    # No query rows at all: zeros of shape [0, H, D].
    empty = varlen_case([(0, 0), (5, 0)], dtype=mx.float16)
    assert run(backend, empty).shape == (0, 8, 64)


def test_cpu_results_do_not_depend_on_the_thread_count():
    """Threads change the KV split count (few query tiles); the result stays within rounding."""
    from kvmetal import _ext

    case = varlen_case([(1500, 1), (1200, 20), (40, 9)], dtype=mx.float32, sinks=True, seed=11)
    ref = oracle(case, sliding_window=1000)
    before = _ext.num_threads()
    try:
        for threads in (1, 3, 8):
            _ext.set_num_threads(threads)
            assert_rows_close(run("cpu", case, sliding_window=1000), ref, mx.float32)
    finally:
        _ext.set_num_threads(before)


_LEVELS = ["portable", "avx2", "avx512"]


@pytest.mark.parametrize("kind", ["f32", "f16", "bf16", "k8v4"])
def test_cpu_every_simd_level_matches_the_oracle(kind):
    """The tile math of every SIMD level this CPU runs (capped from the widest down)."""
    from kvmetal import _ext

    opts = {"f32": dict(dtype=mx.float32), "f16": dict(dtype=mx.float16), "bf16": dict(dtype=mx.bfloat16),
            "k8v4": dict(dtype=mx.float16, k_bits=8, v_bits=4)}[kind]
    case = varlen_case([(70, 45), (9, 1), (30, 9)], num_heads=12, num_kv_heads=2, seed=13, **opts)
    ref = oracle(case, softcap=20.0)
    try:
        for level in _LEVELS[: _LEVELS.index(_ext.simd_level()) + 1]:
            _ext.cap_simd_level(level)
            assert_rows_close(run("cpu", case, softcap=20.0), ref, opts["dtype"])
    finally:
        _ext.cap_simd_level("avx512")


@pytest.mark.parametrize("backend", BACKENDS)
def test_int64_indices(backend):
    case = varlen_case([(30, 11), (9, 1)], dtype=mx.float32)
    ref = run(backend, case)
    wide = VarlenCase(case.query, case.key_cache, case.value_cache, case.block_tables.astype(mx.int64),
                      case.seq_lens.astype(mx.int64), case.query_start_loc.astype(mx.int64))
    np.testing.assert_array_equal(np.array(run(backend, wide)), np.array(ref))


# ---------------------------------------------------------------- the oracle itself

def test_oracle_equals_a_dense_causal_softmax():
    """One sequence, a chunk after a prefix, checked against a masked score matrix."""
    case = varlen_case([(45, 20)], dtype=mx.float32, sinks=True, num_heads=4, num_kv_heads=2)
    keys, values = reference.gather_kv_cache(case.key_cache, case.value_cache, case.block_tables,
                                             case.seq_lens, max_len=45)
    q = np.array(case.query, dtype=np.float64)            # [20, 4, 64]
    k = np.repeat(keys[0], 2, axis=0)                     # [4, 45, 64]
    v = np.repeat(values[0], 2, axis=0)
    window = 11
    scores = np.einsum("thd,hsd->hts", q, k) / 8.0
    pos = 25 + np.arange(20)[:, None]
    visible = (np.arange(45)[None, :] <= pos) & (np.arange(45)[None, :] > pos - window)
    scores = np.where(visible[None], scores, -np.inf)
    sinks = np.array(case.sinks, dtype=np.float64)[:, None, None]
    m = np.maximum(scores.max(-1, keepdims=True), sinks)
    w = np.exp(scores - m)
    dense = np.einsum("hts,hsd->thd", w, v) / (w.sum(-1, keepdims=True) + np.exp(sinks - m)).transpose(1, 0, 2)
    np.testing.assert_allclose(oracle(case, sliding_window=window), dense, rtol=1e-12, atol=1e-12)


def test_oracle_equals_paged_attention_oracle_for_short_runs():
    L = 3
    case = varlen_case([(7, L), (3, L), (20, L)], dtype=mx.float32, seed=9)
    query4 = case.query.reshape(3, L, *case.query.shape[1:])
    ref4 = reference.paged_attention(query4, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                                     softcap=3.0)
    np.testing.assert_array_equal(oracle(case, softcap=3.0), ref4.reshape(case.query.shape))
