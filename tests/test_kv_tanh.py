"""kv_tanh (kernels/kvmetal_common.h), the softcap's tanh, evaluated by the simulator
over the whole float range under each math mode, against float64 tanh; and softcapped
paged attention with caps from 1 to 1e30 against the oracle (issue 41, defect 2: the
(1 - e) / (1 + e) form returned 0 below |x| ~ 3e-8 and lost ~ulp / |x| of relative
precision for small |x|, so a cap far above the scores gave uniform attention)."""
import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import reference as ref
from kvmetal import sim
from kvmetal.backends import metal_specs

from kvcases import SEEDS, assert_close, paged_attention_inputs

ULP_BUDGET = 4


def _float_range() -> np.ndarray:
    """Every binade of float32 (subnormals to the largest finite), dense in [0, 12]
    (the curved part and the saturation), both signs, and 0, inf, NaN."""
    rng = np.random.default_rng(41)
    binades = (rng.random((254, 64)) + 1.0) * np.exp2(np.arange(-126, 128))[:, None]
    subnormal = np.exp2(np.arange(-149, -126, dtype=np.float64))
    dense = np.linspace(0.0, 12.0, 20001)
    near = np.concatenate([np.exp2(np.arange(-30, 4, 0.01))])
    x = np.concatenate([binades.ravel(), subnormal, dense, near]).astype(np.float32)
    x = x[np.isfinite(x)]
    return np.concatenate([x, -x, np.array([0.0, -0.0, np.inf, -np.inf, np.nan], np.float32)])


def _kv_tanh_on_sim(x: np.ndarray, math_mode: str) -> np.ndarray:
    header = metal_specs._find("kvmetal_common.h").read_text()
    kernel = sim.metal_kernel(name=f"kv_tanh_probe_{math_mode}", input_names=["inp"], output_names=["out"],
                              source="uint i = thread_position_in_grid.x;\nout[i] = kv_tanh(inp[i]);",
                              header=header, compile_options={"math_mode": math_mode})
    n = x.size
    pad = (-n) % 256
    xs = np.concatenate([x, np.zeros(pad, np.float32)])
    out = kernel(inputs=[mx.array(xs)], output_shapes=[xs.shape], output_dtypes=[mx.float32],
                 grid=(xs.size, 1, 1), threadgroup=(256, 1, 1))[0]
    return np.array(out)[:n]


def _ulps(got: np.ndarray, want64: np.ndarray) -> np.ndarray:
    """|got - want| in units of the float32 spacing at want (at least the smallest normal's,
    as a fast-math kernel may flush subnormals to zero)."""
    want32 = want64.astype(np.float32)
    spacing = np.maximum(np.spacing(np.abs(want32)).astype(np.float64), np.spacing(np.float32(2.0 ** -126)))
    return np.abs(got.astype(np.float64) - want64) / spacing


@pytest.mark.parametrize("math_mode", ["safe", "relaxed"])
def test_kv_tanh_is_exact_to_a_few_ulp_over_the_float_range(math_mode):
    x = _float_range()
    got = _kv_tanh_on_sim(x, math_mode)
    want = np.tanh(x.astype(np.float64))
    nan = np.isnan(x)
    assert np.isnan(got[nan]).all()                         # NaN in, NaN out
    assert not np.isnan(got[~nan]).any()                    # and nowhere else (no overflow)
    ulps = _ulps(got[~nan], want[~nan])
    print(f"kv_tanh, {math_mode} math: worst {ulps.max():.3g} ulp over {ulps.size} arguments")
    worst = int(np.argmax(ulps))
    assert ulps.max() <= ULP_BUDGET, f"kv_tanh({x[~nan][worst]!r}) = {got[~nan][worst]!r}, " \
                                     f"tanh = {want[~nan][worst]!r}: {ulps.max():.3g} ulp"
    assert (np.sign(got[~nan]) == np.sign(want[~nan])).all() and (np.abs(got[~nan]) <= 1).all()


@pytest.mark.parametrize("softcap", [1.0, 7.0, 50.0, 1e3, 1e6, 1e10, 1e20, 1e30])
def test_paged_attention_softcap_from_1_to_1e30(softcap):
    rng = np.random.default_rng(int(np.log10(softcap)) + 3)
    q, kc, vc, tables, lens, sinks = paged_attention_inputs(
        rng, lens=(37, 5, 130), num_kv_heads=2, gqa=4, head_dim=64, block_size=16, dtype=mx.float32, use_sinks=True)
    q = q * 3.0  # scores of several units: far below the large caps, well into the small ones
    expected = ref.paged_attention(q, kc, vc, tables, lens, softcap=softcap, sinks=sinks)
    for seed in SEEDS:
        with sim.trace(strict=True, seed=seed), kv.use_backend("sim"):
            out = kv.paged_attention(q, kc, vc, tables, lens, softcap=softcap, sinks=sinks)
            mx.eval(out)
        assert_close(out, expected, mx.float32)
    with kv.use_backend("cpu"):
        assert_close(kv.paged_attention(q, kc, vc, tables, lens, softcap=softcap, sinks=sinks), expected, mx.float32)
