"""Register mode's simdgroups a window (issue 41, P5 as worded; docs/kernels.md,
"Register-mode merge and shared-mode tiles"): KVMETAL_METAL_WINDOW_SIMDGROUPS = 1 gives
each window one simdgroup that walks it whole (no merge: no barrier, no merge memory), 2
two that merge; the default stays 4. On the simulator: every setting matches the oracle
(float16 and K8/V4, sinks, a sliding window, several query tokens, sparse V, the
contiguous decode kernel), a row's bits do not depend on its batch, the layout's
threadgroup bytes are what the kernel declares, and bad values raise naming the variable."""
import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import reference as ref
from kvmetal import sim
from kvmetal.backends import metal_layout

from kvcases import TOLERANCE, assert_close, paged_attention_inputs

ENV = "KVMETAL_METAL_WINDOW_SIMDGROUPS"
K8V4 = ((8, 64), (4, 64))
LENS = (700, 37, 2, 300)
# (gqa, head_dim, query_len, quant, sinks, sliding_window): register mode (<= 8 rows)
CASES = {
    "f16-sinks": (4, 64, None, (None, None), True, None),
    "k8v4": (4, 128, None, K8V4, False, None),
    "f16-sliding": (2, 64, None, (None, None), False, 200),
    "f16-g8-d128": (8, 128, None, (None, None), True, None),  # G 8 at D 128: the merge's 2 chunks at 4
    "k8v4-2-tokens": (2, 64, 2, K8V4, True, None),
}


def _partials(trace):
    return next(c for c in trace.calls if "partials" in c.name)


@pytest.mark.parametrize("simdgroups", [1, 2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_register_mode_matches_the_oracle_at_each_simdgroup_count(case, simdgroups, monkeypatch):
    gqa, head_dim, query_len, (kq, vq), use_sinks, window = CASES[case]
    monkeypatch.setenv(ENV, str(simdgroups))
    rng = np.random.default_rng(len(case))
    q, kc, vc, tables, lens, sinks = paged_attention_inputs(
        rng, lens=LENS, num_kv_heads=2, gqa=gqa, head_dim=head_dim, block_size=16,
        dtype=mx.float16, k_quant=kq, v_quant=vq, use_sinks=use_sinks, query_len=query_len)
    with sim.trace(strict=True, seed=simdgroups) as t, kv.use_backend("sim"):
        out = kv.paged_attention(q, kc, vc, tables, lens, sinks=sinks, sliding_window=window)
        mx.eval(out)
    assert_close(out, ref.paged_attention(q, kc, vc, tables, lens, sinks=sinks, sliding_window=window), mx.float16)
    partials = _partials(t)
    layout = metal_layout.layout_for(q if query_len else q[:, None], kc, vc, paged=True)
    assert layout.rows_per_simdgroup == layout.rows  # register mode
    assert layout.simdgroups == simdgroups and partials.threadgroup[0] == 32 * simdgroups
    assert partials.threadgroup_memory == layout.threadgroup_bytes  # the host's mirror of the kernel's arrays
    if simdgroups == 1:
        assert partials.barriers == 0  # no merge, no barrier
        assert layout.threadgroup_bytes < 512  # placeholders only: no merge memory
    else:
        # windows of 256 holding a visible key, at each length (the others return early)
        first = [max(0, n - window) if window else 0 for n in LENS]
        live = sum((n - 1) // 256 - f // 256 + 1 for f, n in zip(first, LENS))
        chunks = -(-layout.rows // metal_layout.merge_rows(head_dim, simdgroups, layout.rows))
        assert partials.barriers == 2 * live * (2 * chunks - 1)  # x 2 kv heads


@pytest.mark.parametrize("simdgroups", [1, 2])
@pytest.mark.parametrize("quantized", [False, True], ids=["f16", "k8v4"])
def test_sparse_v_within_its_bound(simdgroups, quantized, monkeypatch):
    monkeypatch.setenv(ENV, str(simdgroups))
    rng = np.random.default_rng(3)
    q, kc, vc, tables, lens, _ = paged_attention_inputs(
        rng, lens=(300, 77), num_kv_heads=2, gqa=4, head_dim=64, block_size=16, dtype=mx.float16,
        k_quant=K8V4[0] if quantized else None, v_quant=K8V4[1] if quantized else None)
    q = (q * 6.0).astype(mx.float16)  # peaked scores: keys really fall under tau
    exact, bound = ref.paged_attention(q, kc, vc, tables, lens, sparse_v=1e-3, with_bound=True)
    with sim.trace(strict=True, seed=0) as t, kv.use_backend("sim"):
        out = kv.paged_attention(q, kc, vc, tables, lens, sparse_v=1e-3)
        mx.eval(out)
    exact = ref.paged_attention(q, kc, vc, tables, lens)
    err = np.abs(np.array(out.astype(mx.float32), dtype=np.float64) - exact).max(axis=-1)
    assert bound.max() > 0 and (err <= bound + TOLERANCE[mx.float16] * np.abs(exact).max(axis=-1)).all()
    partials = _partials(t)
    assert partials.threadgroup[0] == 32 * simdgroups
    # the seeds' max takes one barrier a window with several simdgroups, none with one
    assert (partials.barriers == 0) == (simdgroups == 1)


@pytest.mark.parametrize("simdgroups", [1, 2])
def test_contiguous_decode_matches_the_oracle(simdgroups, monkeypatch):
    monkeypatch.setenv(ENV, str(simdgroups))
    rng = np.random.default_rng(5)
    q = mx.array(rng.standard_normal((2, 8, 2, 64)).astype(np.float32)).astype(mx.float16)
    k = mx.array(rng.standard_normal((2, 2, 600, 64)).astype(np.float32)).astype(mx.float16)
    v = mx.array(rng.standard_normal((2, 2, 600, 64)).astype(np.float32)).astype(mx.float16)
    with sim.trace(strict=True, seed=2) as t, kv.use_backend("sim"):
        out = kv.decode_attention(q, k, v)
        mx.eval(out)
    assert_close(out, ref.decode_attention(q, k, v), mx.float16)
    partials = _partials(t)
    assert partials.threadgroup[0] == 32 * simdgroups and (partials.barriers == 0) == (simdgroups == 1)


@pytest.mark.parametrize("simdgroups", [None, "1"])
def test_a_rows_bits_do_not_depend_on_its_batch(simdgroups, monkeypatch):
    # The setting is per launch and never reads the batch: a 900-token sequence's rows are the
    # same bits alone and next to a 3000-token one (more splits), at 1 and at the default.
    if simdgroups is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, simdgroups)
    rng = np.random.default_rng(9)
    q, kc, vc, tables, lens, sinks = paged_attention_inputs(
        rng, lens=(900, 3000), num_kv_heads=2, gqa=4, head_dim=64, block_size=16, dtype=mx.float16,
        k_quant=K8V4[0], v_quant=K8V4[1], use_sinks=True)
    outs = []
    for batch in (1, 2):
        with sim.trace(strict=True, seed=batch) as t, kv.use_backend("sim"):
            out = kv.paged_attention(q[:batch], kc, vc, tables[:batch], lens[:batch], sinks=sinks)
            mx.eval(out)
        outs.append(np.array(out[0]))
        assert _partials(t).threadgroup[0] == 32 * int(simdgroups or metal_layout.REGISTER_SIMDGROUPS)
    np.testing.assert_array_equal(outs[0], outs[1])


def test_shared_mode_ignores_it(monkeypatch):
    kw = dict(head_dim=128, gqa=16, query_len=1, k_bits=0, k_group=32, k_itemsize=2, v_bits=0, v_group=32,
              v_itemsize=2, block_size=16)
    monkeypatch.delenv(ENV, raising=False)
    default = metal_layout.attention_layout(**kw)
    monkeypatch.setenv(ENV, "1")
    assert metal_layout.attention_layout(**kw) == default and default.tile > 0
    assert metal_layout.attention_layout(**dict(kw, gqa=4)).simdgroups == 1


def test_bad_values_raise_naming_it(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert metal_layout.window_simdgroups() == metal_layout.REGISTER_SIMDGROUPS == 4
    monkeypatch.setenv(ENV, "")
    assert metal_layout.window_simdgroups() == 4  # empty: unset
    rng = np.random.default_rng(1)
    q, kc, vc, tables, lens, _ = paged_attention_inputs(rng, lens=(40,), num_kv_heads=1, gqa=2, head_dim=64,
                                                        block_size=16, dtype=mx.float16)
    for bad in ("0", "3", "8", "-1", "x", "1.0"):
        monkeypatch.setenv(ENV, bad)
        with pytest.raises(ValueError, match=ENV):
            metal_layout.window_simdgroups()
        with pytest.raises(ValueError, match=ENV), kv.use_backend("sim"):
            mx.eval(kv.paged_attention(q, kc, vc, tables, lens))
