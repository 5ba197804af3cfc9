"""Sparse V (``sparse_v=tau`` on paged_attention / decode_attention and the drop-in).

The documented bound (docs/kernels.md, "Sparse V"): per output row, |sparse - exact|
<= (weight of the keys with exp(s - max s) < tau) / denominator * max |v|, which the
oracle computes (``reference.*(with_bound=True)``); a kernel compares against its
running max (never above the final one), so it skips a subset of those keys. Checked
on every backend here (cpu, sim) for random and peaked scores, float and quantized
caches; tau = 0 is the exact path bit for bit; the simulator's counters show V rows
really are skipped (V bytes, scales and biases drop; K bytes do not).
"""
import math

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import reference

from kvcases import TOLERANCE, backend_params, paged_attention_inputs, run_on

BACKENDS = backend_params(("cpu", "sim", "metal"))
K8V4 = ((8, 64), (4, 64))


def _paged(rng, *, peak, quant=(None, None), gqa=4, query_len=None, lens=(300, 77)):
    q, kc, vc, tables, lens, _ = paged_attention_inputs(
        rng, lens=list(lens), num_kv_heads=2, gqa=gqa, head_dim=64, block_size=16, dtype=mx.float16,
        k_quant=quant[0], v_quant=quant[1], query_len=query_len)
    return (q * peak).astype(mx.float16), kc, vc, tables, lens


def _check_bound(out, exact, bound, dtype):
    """|out - exact| <= bound + the dtype's budget, per row (bound from the oracle)."""
    out = np.array(out.astype(mx.float32), dtype=np.float64)
    assert np.isfinite(out).all()
    err = np.abs(out - exact).max(axis=-1)
    slack = TOLERANCE[dtype] * np.abs(exact).max(axis=-1)
    assert (err <= bound + slack).all(), f"worst excess {(err - bound - slack).max():.3g}"
    return err


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quantized", [False, True], ids=["f16", "k8v4"])
@pytest.mark.parametrize("peak", [1.0, 6.0], ids=["random", "peaked"])
def test_paged_error_within_the_bound(backend, quantized, peak):
    rng = np.random.default_rng(3)
    args = _paged(rng, peak=peak, quant=K8V4 if quantized else (None, None))
    tau = 1e-3
    exact, bound = reference.paged_attention(*args, sparse_v=tau, with_bound=True)
    with run_on(backend):
        out = kv.paged_attention(*args, sparse_v=tau)
        mx.eval(out)
    _check_bound(out, reference.paged_attention(*args), bound, mx.float16)
    if peak > 1:
        assert bound.max() > 0  # keys really fall under tau: the check is not vacuous


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_attention_error_within_the_bound(backend):
    rng = np.random.default_rng(5)
    q = mx.array((rng.standard_normal((2, 8, 2, 64)) * 5).astype(np.float32)).astype(mx.float16)
    k = mx.array(rng.standard_normal((2, 2, 200, 64)).astype(np.float32)).astype(mx.float16)
    v = mx.array(rng.standard_normal((2, 2, 200, 64)).astype(np.float32)).astype(mx.float16)
    exact, bound = reference.decode_attention(q, k, v, sparse_v=1e-3, with_bound=True)
    with run_on(backend):
        out = kv.decode_attention(q, k, v, sparse_v=1e-3)
        mx.eval(out)
    _check_bound(out, reference.decode_attention(q, k, v), bound, mx.float16)
    assert bound.max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_shared_mode_rows_follow_the_rule(backend):
    # G x L = 16 rows: the Metal kernel's shared-tile mode (V tiles still copied).
    rng = np.random.default_rng(7)
    args = _paged(rng, peak=6.0, query_len=4, lens=(150,))
    exact, bound = reference.paged_attention(*args, sparse_v=1e-3, with_bound=True)
    with run_on(backend):
        out = kv.paged_attention(*args, sparse_v=1e-3)
        mx.eval(out)
    _check_bound(out, reference.paged_attention(*args), bound, mx.float16)


def test_oracle_sparse_output_within_its_own_bound():
    rng = np.random.default_rng(9)
    args = _paged(rng, peak=6.0)
    exact = reference.paged_attention(*args)
    sparse, bound = reference.paged_attention(*args, sparse_v=1e-2, with_bound=True)
    err = np.abs(sparse - exact).max(axis=-1)
    assert (err <= bound + 1e-12).all() and err.max() > 0


def test_sim_and_cpu_agree_within_the_bound():
    rng = np.random.default_rng(11)
    args = _paged(rng, peak=6.0, quant=K8V4)
    _, bound = reference.paged_attention(*args, sparse_v=1e-3, with_bound=True)
    outs = {}
    for backend in ("cpu", "sim"):
        with kv.use_backend(backend):
            outs[backend] = np.array(kv.paged_attention(*args, sparse_v=1e-3).astype(mx.float32), np.float64)
    diff = np.abs(outs["cpu"] - outs["sim"]).max(axis=-1)
    slack = 2 * TOLERANCE[mx.float16] * np.abs(outs["cpu"]).max(axis=-1)
    assert (diff <= 2 * bound + slack).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_tau_zero_is_the_exact_path_bit_for_bit(backend):
    rng = np.random.default_rng(13)
    args = _paged(rng, peak=6.0)
    with run_on(backend):
        base = np.array(kv.paged_attention(*args))
        for tau in (0, 0.0, None):
            assert np.array_equal(np.array(kv.paged_attention(*args, sparse_v=tau)), base)


def test_sim_sparse_kernel_that_skips_nothing_reads_every_v_row():
    # tau = 1e-30 compiles SV = 1 but no weight is that small here: every V row is read
    # once, and only the seeded running max (a different rescale order) separates the sums.
    rng = np.random.default_rng(15)
    args = _paged(rng, peak=1.0)
    with run_on("sim") as t:
        base = np.array(kv.paged_attention(*args).astype(mx.float32))
        sparse = np.array(kv.paged_attention(*args, sparse_v=1e-30).astype(mx.float32))
    calls = [c for c in t.calls if "partials" in c.name]
    assert "_sv0_" in calls[0].name and "_sv1_" in calls[1].name
    assert calls[1].buffers["value_data"].loaded == calls[0].buffers["value_data"].loaded
    np.testing.assert_allclose(sparse, base, rtol=0, atol=2e-3 * np.abs(base).max())


def _v_traffic(args, tau, *, call=False):
    with run_on("sim") as t:
        mx.eval(kv.paged_attention(*args, sparse_v=tau))
    c = next(c for c in t.calls if "paged_attention_partials" in c.name)
    return c if call else {n: b.loaded for n, b in c.buffers.items()}


@pytest.mark.parametrize("quantized", [False, True], ids=["f16", "k8v4"])
def test_sim_skips_v_rows_but_not_k(quantized):
    rng = np.random.default_rng(17)
    args = _paged(rng, peak=8.0, quant=K8V4 if quantized else (None, None))
    exact, sparse = _v_traffic(args, None), _v_traffic(args, 1e-3)
    _check_seed_k_reads(_v_traffic(args, None, call=True), _v_traffic(args, 1e-3, call=True))
    assert sparse["value_data"] < 0.75 * exact["value_data"]
    if quantized:  # packed words, scales and biases of skipped rows are all left alone
        for name in ("value_scales", "value_biases"):
            assert sparse[name] < 0.75 * exact[name]
        fraction = lambda t: t["value_data"] / exact["value_data"]
        assert abs(sparse["value_scales"] / exact["value_scales"] - fraction(sparse)) < 0.05
    # A bigger tau skips more.
    assert _v_traffic(args, 1e-1)["value_data"] < sparse["value_data"]


def _check_seed_k_reads(exact, sparse):
    """K is read whole (scores need every key), plus the seeds: re-reads of at most
    SPARSE_V_RECENT_SEEDS + 1 rows the kernel reads anyway, per threadgroup (register
    mode: its simdgroups score a share of the seeds each)."""
    seeds = reference.SPARSE_V_RECENT_SEEDS + 1
    for name in ("key_data", "key_scales", "key_biases"):
        if name not in exact.buffers or not exact.buffers[name].loaded:  # a float cache's placeholders
            continue
        k_exact, k_sparse = exact.buffers[name], sparse.buffers[name]
        assert k_sparse.distinct_loaded == k_exact.distinct_loaded
        assert 0 < k_sparse.loaded - k_exact.loaded <= seeds * sparse.threadgroups * 64 * 2  # a row: <= D float16s


def _sink_case(rng, query_len):
    """Two sequences (700, 333 tokens), 2 kv heads x G 2, whose key 0 is aligned with
    their queries: an attention sink that puts most keys under tau against it."""
    q, kc, vc, tables, lens = _paged(rng, peak=1.0, query_len=query_len, lens=(700, 333), gqa=2)
    kcf = np.array(kc.astype(mx.float32))
    qf = np.array(q.astype(mx.float32)).reshape(2, -1, 4, 64)
    for s in range(2):
        block = int(np.array(tables)[s, 0])
        for h in range(2):
            kcf[block, h, 0] = 12.0 * qf[s, :, 2 * h:2 * h + 2].mean(axis=(0, 1))
    return q, mx.array(kcf).astype(mx.float16), vc, tables, lens


def _poison_sure_skips(args, tau, **kw):
    """args with NaN in the V rows every seeded kernel skips (reference.sparse_v_sure_skips)
    and how many rows that is: a kernel that reads one of them returns NaN."""
    q, kc, vc, tables, lens = args
    sure = reference.sparse_v_sure_skips(q, kc, tables, lens, sparse_v=tau, **kw)
    v = np.array(vc)
    bs = v.shape[2]
    table = np.array(tables)
    for s, mask in enumerate(sure):
        for h, t in zip(*np.nonzero(mask)):
            v[table[s, t // bs], h, t % bs] = np.nan
    return (q, kc, mx.array(v), tables, lens), sum(int(m.sum()) for m in sure)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("query_len", [None, 3], ids=["L1", "L3"])
def test_seeded_running_max_never_reads_sure_skips(backend, query_len):
    # The keys below tau against the seeds' scores (the first live key, here a sink with
    # a high score, and the newest) are skipped in every split and simdgroup, from the
    # first key of each on: with a running max from -inf, each run's first keys were read.
    args = _sink_case(np.random.default_rng(21), query_len)
    tau = 1e-3
    poisoned, count = _poison_sure_skips(args, tau)
    assert count > 0.3 * 2 * (700 + 333)  # most rows: the check is not vacuous
    _, bound = reference.paged_attention(*args, sparse_v=tau, with_bound=True)
    with run_on(backend):
        out = kv.paged_attention(*poisoned, sparse_v=tau, num_splits=4)
        mx.eval(out)
    _check_bound(out, reference.paged_attention(*args), bound, mx.float16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_seeds_stay_within_the_bound(backend):
    # With a window the first seed is the first key row 0 sees (not key 0); rows that do
    # not see a seed mask it. A seed outside a row's window would break the bound.
    rng = np.random.default_rng(25)
    args = _paged(rng, peak=6.0, query_len=3, gqa=2)
    tau = 1e-3
    exact = reference.paged_attention(*args, sliding_window=40)
    _, bound = reference.paged_attention(*args, sparse_v=tau, with_bound=True, sliding_window=40)
    with run_on(backend):
        out = kv.paged_attention(*args, sparse_v=tau, sliding_window=40, num_splits=3)
        mx.eval(out)
    _check_bound(out, exact, bound, mx.float16)
    assert bound.max() > 0


def test_oracle_seeds_are_the_first_seen_and_the_newest_keys():
    recent = reference.SPARSE_V_RECENT_SEEDS
    assert reference.sparse_v_seeds(100) == (0, *range(100 - recent, 100))
    assert reference.sparse_v_seeds(100, 3) == (0, *range(98 - recent, 98))  # row 0 of 3 sits at 97
    assert reference.sparse_v_seeds(100, 1, sliding_window=40) == (60, *range(100 - recent, 100))
    assert reference.sparse_v_seeds(100, 1, sliding_window=10) == tuple(range(90, 100))  # none before the window
    assert reference.sparse_v_seeds(10) == tuple(range(10))
    assert reference.sparse_v_seeds(1) == (0,)
    assert reference.sparse_v_seeds(2, 3) == (0,)  # row 0 sees nothing; no negative position
    assert reference.sparse_v_seeds(0) == ()


def test_oracle_sure_skips_lie_inside_the_final_max_set():
    # seed max <= final max: every sure skip is also below tau against the final max.
    q, kc, vc, tables, lens = _sink_case(np.random.default_rng(23), 2)
    tau = 1e-3
    sure = reference.sparse_v_sure_skips(q, kc, tables, lens, sparse_v=tau)
    qf, keys = reference.to_f64(q), reference.to_f64(kc)
    for s, mask in enumerate(sure):
        n = int(np.array(lens)[s])
        rows = reference.sequence_rows(keys, reference.to_int(tables)[s], n)
        for h in range(rows.shape[0]):
            for i in range(2):
                last = n - 2 + i
                scores = rows[h, :last + 1] @ qf[s, i, 2 * h:2 * h + 2].T * 64 ** -0.5  # [t, G]
                final = np.exp(scores - scores.max(axis=0)) < tau
                assert final.all(axis=1)[mask[h, :last + 1]].all()
        assert mask.any()


@pytest.mark.parametrize("bad,error", [(-1e-3, ValueError), (float("nan"), ValueError), (1.0, ValueError),
                                       (2, ValueError), (1e-45, ValueError), ("1e-6", TypeError),
                                       (True, TypeError), (mx.array(1e-6), TypeError)],
                         ids=["negative", "nan", "one", "two", "denormal", "str", "bool", "array"])
def test_bad_sparse_v_is_refused_naming_it(bad, error):
    rng = np.random.default_rng(19)
    args = _paged(rng, peak=1.0)
    with kv.use_backend("cpu"):
        with pytest.raises(error, match=r"\[paged_attention\] sparse_v"):
            kv.paged_attention(*args, sparse_v=bad)
        q = mx.zeros((1, 4, 1, 64), mx.float16)
        k = mx.zeros((1, 1, 8, 64), mx.float16)
        with pytest.raises(error, match=r"\[decode_attention\] sparse_v"):
            kv.decode_attention(q, k, k, sparse_v=bad)


def test_drop_in_passes_tau_to_the_decode_calls(monkeypatch):
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    from kvmetal import ops
    from kvmetal.integrations.mlx_lm import use_paged_cache

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=256, num_hidden_layers=2,
                                        intermediate_size=256, num_attention_heads=4, num_key_value_heads=2,
                                        rms_norm_eps=1e-5, vocab_size=512, tie_word_embeddings=False))
    with pytest.raises(ValueError, match=r"\[use_paged_cache\] sparse_v"):
        use_paged_cache(model, sparse_v=1.5)
    seen = []
    original = ops.paged_attention
    monkeypatch.setattr(ops, "paged_attention", lambda *a, **kw: seen.append(kw.get("sparse_v")) or original(*a, **kw))
    with kv.use_backend("cpu"):
        outs = {}
        for tau in (None, 1e-6):
            with use_paged_cache(model, sparse_v=tau):
                cache = make_prompt_cache(model)
                model(mx.array([list(range(1, 13))]), cache=cache)  # a 12-token prefill: varlen, exact
                outs[tau] = np.array(model(mx.array([[9]]), cache=cache))  # decode: paged_attention
    assert seen == [None, None, 1e-6, 1e-6]  # one decode pass, two layers, per tau
    assert np.abs(outs[None] - outs[1e-6]).max() < 1e-2 * np.abs(outs[None]).max()
    assert math.isfinite(float(outs[1e-6].sum()))
