"""kvmetal.sim on a real workload: a split-KV decode attention kernel vs a NumPy oracle,
traffic counters ("K/V read once"), and the on-disk compile cache."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvmetal.sim as sim
from kvmetal.sim import build
from kvcases import assert_close
from split_kv_kernel import attention_oracle, split_kv_attention

RNG = np.random.default_rng(1)


@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
@pytest.mark.parametrize("hq,hkv,t,splits", [(4, 1, 1, 1), (8, 2, 75, 3), (6, 1, 130, 4), (4, 4, 33, 5)])
def test_split_kv_attention_matches_oracle(dtype, hq, hkv, t, splits):
    d = 64
    q = mx.array(RNG.standard_normal((hq, d)).astype(np.float32)).astype(dtype)
    k = mx.array(RNG.standard_normal((hkv, t, d)).astype(np.float32)).astype(dtype)
    v = mx.array(RNG.standard_normal((hkv, t, d)).astype(np.float32)).astype(dtype)
    out = split_kv_attention(q, k, v, num_splits=splits)
    assert out.dtype == dtype and out.shape == (hq, d)
    f32 = lambda a: np.array(a.astype(mx.float32))
    assert_close(out, attention_oracle(f32(q), f32(k), f32(v)), dtype)


def test_split_count_does_not_change_the_result_and_seed_order_is_harmless():
    d, t = 64, 97
    q = mx.array(RNG.standard_normal((8, d)).astype(np.float32))
    k = mx.array(RNG.standard_normal((2, t, d)).astype(np.float32))
    v = mx.array(RNG.standard_normal((2, t, d)).astype(np.float32))
    base = np.array(split_kv_attention(q, k, v, num_splits=1))
    for splits, seed in [(2, 0), (7, 3), (13, 11)]:
        with sim.trace(seed=seed):
            got = np.array(split_kv_attention(q, k, v, num_splits=splits))
        np.testing.assert_allclose(got, base, rtol=1e-5, atol=1e-6)


def test_traffic_shows_kv_read_once_for_all_query_heads():
    hq, hkv, t, d = 8, 2, 100, 64
    q = mx.array(RNG.standard_normal((hq, d)).astype(np.float32))
    k = mx.array(RNG.standard_normal((hkv, t, d)).astype(np.float32))
    v = mx.array(RNG.standard_normal((hkv, t, d)).astype(np.float32))
    with sim.trace() as tr:
        split_kv_attention(q, k, v, num_splits=4)
    partials, reduce = tr.calls
    assert partials.name == "sim_example_attn_partials" and reduce.name == "sim_example_attn_reduce"
    kv_bytes = hkv * t * d * 4
    for name in ("k", "v"):
        b = partials.buffers[name]
        assert b.size == kv_bytes and b.loaded == kv_bytes and b.distinct_loaded == kv_bytes and b.stored == 0
    # The query is re-read by each of the 4 splits: loaded counts that, distinct does not.
    assert partials.buffers["q"].loaded == 4 * hq * d * 4 and partials.buffers["q"].distinct_loaded == hq * d * 4
    assert partials.buffers["pacc"].stored == hq * 4 * d * 4
    assert partials.threadgroup_memory == 2 * 16 * d * 4
    assert partials.grid == (32 * 4, hkv, 4) and partials.threads == 32 * 4 * hkv * 4
    assert reduce.buffers["out"].stored == hq * d * 4 and reduce.buffers["out"].distinct_stored == hq * d * 4
    # Every partial is written exactly once.
    for name in ("pmax", "psum", "pacc"):
        b = partials.buffers[name]
        assert b.stored == b.distinct_stored == b.size


def test_one_mib_read_exactly_once():
    """MUST SHOW: a kernel reading a 1 MiB buffer once reports 1 MiB loaded and 1 MiB distinct."""
    n = (1 << 20) // 4
    src = """
    uint i = thread_position_in_grid.x;
    float4 x = *(device const float4*)(inp + 4 * i);
    float s = simd_sum(x.x + x.y + x.z + x.w);
    if (thread_index_in_simdgroup == 0) out[i / 32] = s;
    """
    k = sim.metal_kernel(name="read_once", input_names=["inp"], output_names=["out"], source=src)
    x = mx.array(RNG.standard_normal(n).astype(np.float32))
    with sim.trace() as tr:
        (o,) = k(inputs=[x], output_shapes=[(n // 128,)], output_dtypes=[mx.float32], grid=(n // 4, 1, 1),
                 threadgroup=(256, 1, 1))
    traffic = tr.calls[0].buffers["inp"]
    assert traffic.loaded == 1 << 20 and traffic.distinct_loaded == 1 << 20 and traffic.stored == 0
    assert tr.calls[0].buffers["out"].stored == n // 128 * 4
    assert tr.calls[0].buffers["out"].distinct_stored == n // 128 * 4
    np.testing.assert_allclose(np.array(o), np.array(x).reshape(-1, 128).sum(1), rtol=1e-4, atol=1e-4)
    # Reading every element twice doubles `loaded` but not `distinct_loaded`.
    k2 = sim.metal_kernel(name="read_twice", input_names=["inp"], output_names=["out"],
                          source="uint i = thread_position_in_grid.x; out[i] = inp[i] + inp[(i + 1) % 1024];")
    with sim.trace() as tr:
        k2(inputs=[x[:1024]], output_shapes=[(1024,)], output_dtypes=[mx.float32], grid=(1024, 1, 1),
           threadgroup=(256, 1, 1))
    assert tr.calls[0].buffers["inp"].loaded == 8192 and tr.calls[0].buffers["inp"].distinct_loaded == 4096


def test_nested_traces_record_calls_and_inner_options_win():
    k = sim.metal_kernel(name="nest", input_names=["a"], output_names=["o"],
                         source="uint i = thread_position_in_grid.x; if (i < 16) o[i] = simd_sum(a[i]); else o[i] = 0.0f;")
    call = dict(inputs=[mx.ones(32)], output_shapes=[(32,)], output_dtypes=[mx.float32], grid=(32, 1, 1),
                threadgroup=(32, 1, 1))
    with sim.trace(strict=True) as outer:
        with pytest.raises(sim.DivergentCollectiveError):
            k(**call)
        with sim.trace(strict=False) as inner:
            (o,) = k(**call)
        assert o[0].item() == 16.0
        (o,) = k(**call, strict=False)
    assert len(inner.calls) == 1 and len(outer.calls) == 2


def test_compiled_variants_are_cached_on_disk(tmp_path, monkeypatch):
    monkeypatch.setenv("KVMETAL_SIM_CACHE", str(tmp_path))
    src = "uint i = thread_position_in_grid.x; out[i] = T(inp[i]) * T(2);"
    k = sim.metal_kernel(name=f"cached_{RNG.integers(1 << 30)}", input_names=["inp"], output_names=["out"], source=src)
    call = dict(inputs=[mx.ones(4)], output_shapes=[(4,)], output_dtypes=[mx.float32], grid=(4, 1, 1),
                threadgroup=(4, 1, 1))
    k(**call, template=[("T", mx.float32)])
    k(**call, template=[("T", mx.float16)])
    sos = sorted(tmp_path.glob("k-*.so"))
    assert len(sos) == 2  # one shared object per (source, template, dtype) variant
    # A fresh kernel object in a fresh process state loads the .so instead of compiling.
    build._loaded.clear()
    monkeypatch.setattr(build, "_compile", lambda *a, **kw: pytest.fail("recompiled a cached variant"))
    k2 = sim.metal_kernel(name=k.name, input_names=["inp"], output_names=["out"], source=src)
    (o,) = k2(**call, template=[("T", mx.float32)])
    assert np.array(o).tolist() == [2.0] * 4
