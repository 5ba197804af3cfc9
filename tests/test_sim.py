"""kvmetal.sim: one micro-kernel with a known answer per MSL feature."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvmetal.sim as sim
from kvcases import run1

RNG = np.random.default_rng(0)


def test_factory_is_drop_in_and_returns_mx_arrays():
    k = sim.metal_kernel(name="myexp", input_names=["inp"], output_names=["out"],
                         source="uint elem = thread_position_in_grid.x;\nT tmp = inp[elem];\nout[elem] = metal::exp(tmp);")
    a = mx.array(RNG.standard_normal((4, 16)).astype(np.float32))
    outs = k(inputs=[a], template=[("T", mx.float32)], grid=(a.size, 1, 1), threadgroup=(256, 1, 1),
             output_shapes=[a.shape], output_dtypes=[a.dtype], verbose=False, stream=None)
    assert isinstance(outs, list) and len(outs) == 1 and isinstance(outs[0], mx.array)
    assert outs[0].shape == a.shape and outs[0].dtype == mx.float32
    np.testing.assert_allclose(np.array(outs[0]), np.exp(np.array(a)), rtol=1e-6)


def test_call_argument_errors_match_mlx():
    k = sim.metal_kernel(name="e", input_names=["a"], output_names=["o"], source="o[0] = a[0];")
    with pytest.raises(ValueError, match="Expected `inputs` to have size 1"):
        k(inputs=[], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1, 1), threadgroup=(1, 1, 1))
    with pytest.raises(ValueError, match="Invalid template argument"):
        k(inputs=[mx.ones(2)], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1, 1),
          threadgroup=(1, 1, 1), template=[("T", 2.5)])
    with pytest.raises(TypeError, match="grid"):
        k(inputs=[mx.ones(2)], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1), threadgroup=(1, 1, 1))
    with pytest.raises(ValueError, match="at least one output"):
        sim.metal_kernel(name="e", input_names=["a"], output_names=[], source="")


def test_thread_position_attributes_with_non_uniform_threadgroups():
    # grid 10x3x2 with threadgroups 4x2x2: edge threadgroups are smaller, as with dispatchThreads.
    src = """
    uint3 g = thread_position_in_grid;
    uint i = (g.z * threads_per_grid.y + g.y) * threads_per_grid.x + g.x;
    device int* o = out + i * 16;
    o[0] = thread_position_in_threadgroup.x; o[1] = thread_position_in_threadgroup.y;
    o[2] = threadgroup_position_in_grid.x; o[3] = threadgroup_position_in_grid.y;
    o[4] = threads_per_threadgroup.x; o[5] = threads_per_threadgroup.y;
    o[6] = thread_index_in_threadgroup; o[7] = thread_index_in_simdgroup;
    o[8] = simdgroup_index_in_threadgroup; o[9] = simdgroups_per_threadgroup;
    o[10] = threadgroups_per_grid.x; o[11] = dispatch_threads_per_threadgroup.x;
    o[12] = thread_execution_width; o[13] = threads_per_simdgroup;
    o[14] = quadgroup_index_in_threadgroup * 10 + thread_index_in_quadgroup; o[15] = grid_size.z + grid_origin.x;
    """
    gx, gy, gz, tx, ty, tz = 10, 3, 2, 4, 2, 2
    got = run1(src, [mx.zeros(1)], (gz * gy * gx * 16,), mx.int32, grid=(gx, gy, gz),
               threadgroup=(tx, ty, tz)).reshape(gz, gy, gx, 16)
    for z in range(gz):
        for y in range(gy):
            for x in range(gx):
                sx, sy = min(tx, gx - x // tx * tx), min(ty, gy - y // ty * ty)
                sz = min(tz, gz - z // tz * tz)
                px, py, pz = x % tx, y % ty, z % tz
                lin = (pz * sy + py) * sx + px
                want = [px, py, x // tx, y // ty, sx, sy, lin, lin % 32, lin // 32, (sx * sy * sz + 31) // 32,
                        -(-gx // tx), tx, 32, 32, (lin // 4) * 10 + lin % 4, gz]
                assert list(got[z, y, x]) == want, (x, y, z)


def test_constant_and_device_address_spaces_and_scalar_inputs():
    # 3 elements -> constant, 20 -> device, Python float -> constant reference.
    src = """
    uint i = thread_position_in_grid.x;
    constant float* c = coeffs;
    device const float* d = data;
    thread float acc = c[0] + c[1] * d[i] + c[2] * d[i] * d[i];
    out[i] = acc * scale;
    """
    coeffs = mx.array([1.0, 2.0, 3.0])
    data = mx.array(RNG.standard_normal(20).astype(np.float32))
    got = run1(src, [coeffs, data, 0.5], (20,), grid=(20, 1, 1), threadgroup=(8, 1, 1),
               names=["coeffs", "data", "scale"])
    d = np.array(data)
    np.testing.assert_allclose(got, 0.5 * (1 + 2 * d + 3 * d * d), rtol=1e-6)


def test_threadgroup_memory_reduction_with_barriers():
    src = """
    threadgroup float buf[64];
    uint l = thread_index_in_threadgroup;
    buf[l] = inp[thread_position_in_grid.x];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    for (uint s = 32; s > 0; s >>= 1) {
        if (l < s) buf[l] += buf[l + s];
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    if (l == 0) out[threadgroup_position_in_grid.x] = buf[0];
    """
    x = RNG.standard_normal(256).astype(np.float32)
    got = run1(src, [mx.array(x)], (4,), grid=(256, 1, 1), threadgroup=(64, 1, 1), names=["inp"])
    np.testing.assert_allclose(got, x.reshape(4, 64).sum(1), rtol=1e-5)


@pytest.mark.parametrize("dtype,tol", [(mx.float32, 1e-6), (mx.float16, 2e-3), (mx.bfloat16, 1e-2)])
def test_float_dtypes_and_template_dtype(dtype, tol):
    src = """
    uint i = thread_position_in_grid.x;
    T x = inp[i];
    T y = x * T(2) + T(1);
    out[i] = static_cast<float>(y) + float(x);
    """
    x = RNG.standard_normal(40).astype(np.float32)
    a = mx.array(x).astype(dtype)
    xr = np.array(a.astype(mx.float32))
    got = run1(src, [a], (40,), grid=(40, 1, 1), threadgroup=(32, 1, 1), names=["inp"], template=[("T", dtype)])
    np.testing.assert_allclose(got, 3 * xr + 1, rtol=tol, atol=tol)


def test_half_and_bfloat_rounding():
    # half: IEEE binary16; bfloat: round-to-nearest-even of the top 16 bits of a float.
    src = """
    uint i = thread_position_in_grid.x;
    half h = half(inp[i]);
    bfloat b = bfloat(inp[i]);
    out[2 * i] = float(h);
    out[2 * i + 1] = float(b);
    """
    x = np.array([1.0 + 2**-11, 1.0 + 3 * 2**-11, 1.0 + 2**-8, 1.0 + 3 * 2**-8, 65519.0, 1e-8, -3.3, 0.1], np.float32)
    got = run1(src, [mx.array(x)], (16,), grid=(8, 1, 1), threadgroup=(8, 1, 1), names=["inp"]).reshape(8, 2)
    np.testing.assert_array_equal(got[:, 0], x.astype(np.float16).astype(np.float32))
    want_bf = np.array(mx.array(x).astype(mx.bfloat16).astype(mx.float32))
    np.testing.assert_array_equal(got[:, 1], want_bf)
    assert got[0, 0] == 1.0 and got[1, 0] == 1.0 + 4 * 2**-11  # ties to even


def test_integer_types_and_conversions():
    src = """
    uint i = thread_position_in_grid.x;
    int v = inp[i];
    short s = short(v);
    ushort us = ushort(v);
    char c = char(v);
    uchar uc = uchar(v);
    bool b = v;
    uint u = uint(v);
    long l = long(v) * 3000000000L;
    out[i * 8 + 0] = s; out[i * 8 + 1] = us; out[i * 8 + 2] = c; out[i * 8 + 3] = uc;
    out[i * 8 + 4] = b; out[i * 8 + 5] = int(u >> 1); out[i * 8 + 6] = int(l / 1000000000L);
    out[i * 8 + 7] = int(7.9f) + int(-7.9f) * 10;
    """
    x = np.array([-70000, -200, -1, 0, 1, 200, 300, 70000], np.int32)
    got = run1(src, [mx.array(x)], (64,), mx.int32, grid=(8, 1, 1), threadgroup=(8, 1, 1), names=["inp"]).reshape(8, 8)
    np.testing.assert_array_equal(got[:, 0], x.astype(np.int16))
    np.testing.assert_array_equal(got[:, 1], x.astype(np.uint16))
    np.testing.assert_array_equal(got[:, 2], x.astype(np.int8))
    np.testing.assert_array_equal(got[:, 3], x.astype(np.uint8))
    np.testing.assert_array_equal(got[:, 4], (x != 0).astype(np.int32))
    np.testing.assert_array_equal(got[:, 5], (x.astype(np.uint32) >> 1).astype(np.int32))
    np.testing.assert_array_equal(got[:, 6], (x.astype(np.int64) * 3000000000 // 1000000000).astype(np.int32))
    np.testing.assert_array_equal(got[:, 7], np.full(8, 7 - 70))


def test_vectors_swizzles_and_conversion_rules():
    src = """
    uint i = thread_position_in_grid.x;
    float4 v = *(device const float4*)(inp + 4 * i);    // vector load through a pointer cast
    float2 lo = v.xy, hi = v.zw;
    float4 w = float4(hi, lo);                          // built from pieces
    w.xy = w.yx;                                        // swizzle assignment
    int4 iv = int4(v);                                  // value conversion, truncation
    uint4 bits = as_type<uint4>(v);                     // bit cast
    half4 h = half4(v);
    float3 f3 = v.rgb * 2.0f;
    bool4 m = v > 0.0f;
    out[i * 12 + 0] = w.x; out[i * 12 + 1] = w.y; out[i * 12 + 2] = w.z; out[i * 12 + 3] = w.w;
    out[i * 12 + 4] = float(iv.x + iv.w);
    out[i * 12 + 5] = as_type<float>(bits.y);
    out[i * 12 + 6] = float(h.z);
    out[i * 12 + 7] = f3.b + dot(v, float4(1.0f));
    out[i * 12 + 8] = float(all(m)) + 2.0f * float(any(m));
    out[i * 12 + 9] = select(v, float4(-1.0f), m).x;
    out[i * 12 + 10] = float(sizeof(float3) + sizeof(half4) * 100 + alignof(half3) * 10000);
    out[i * 12 + 11] = (v * 2.0f + 1.0f).w;
    """
    x = RNG.uniform(-5, 5, 32).astype(np.float32)
    got = run1(src, [mx.array(x)], (8 * 12,), grid=(8, 1, 1), threadgroup=(8, 1, 1), names=["inp"]).reshape(8, 12)
    v = x.reshape(8, 4)
    np.testing.assert_allclose(got[:, 0:4], np.stack([v[:, 3], v[:, 2], v[:, 0], v[:, 1]], 1))
    np.testing.assert_allclose(got[:, 4], np.trunc(v[:, 0]) + np.trunc(v[:, 3]))
    np.testing.assert_array_equal(got[:, 5], v[:, 1])
    np.testing.assert_allclose(got[:, 6], v[:, 2].astype(np.float16).astype(np.float32))
    np.testing.assert_allclose(got[:, 7], 2 * v[:, 2] + v.sum(1), rtol=1e-5)
    np.testing.assert_array_equal(got[:, 8], (v > 0).all(1) + 2.0 * (v > 0).any(1))
    np.testing.assert_array_equal(got[:, 9], np.where(v[:, 0] > 0, -1.0, v[:, 0]))
    np.testing.assert_array_equal(got[:, 10], np.full(8, 16 + 8 * 100 + 8 * 10000))
    np.testing.assert_allclose(got[:, 11], 2 * v[:, 3] + 1)


def test_half_literals_and_math_namespaces():
    src = """
    uint i = thread_position_in_grid.x;
    float x = inp[i];
    half hx = half(x) * 0.5h;
    out[i * 10 + 0] = metal::exp(x);
    out[i * 10 + 1] = fast::exp2(x);
    out[i * 10 + 2] = precise::log(abs(x) + 1.0f);
    out[i * 10 + 3] = metal::rsqrt(abs(x) + 1.0f);
    out[i * 10 + 4] = metal::tanh(x);
    out[i * 10 + 5] = float(hx);
    out[i * 10 + 6] = metal::max(x, 0.25f) + metal::min(x, -0.25f);
    out[i * 10 + 7] = clamp(x, -1.0f, 1.0f) + fma(x, 2.0f, 1.0f);
    out[i * 10 + 8] = float(metal::exp(half(x)));
    out[i * 10 + 9] = metal::precise::pow(abs(x), 1.5f) + floor(x) + fract(x);
    """
    x = RNG.uniform(-2, 2, 16).astype(np.float32)
    got = run1(src, [mx.array(x)], (160,), grid=(16, 1, 1), threadgroup=(16, 1, 1), names=["inp"]).reshape(16, 10)
    want = np.stack([np.exp(x), np.exp2(x), np.log(abs(x) + 1), 1 / np.sqrt(abs(x) + 1), np.tanh(x),
                     (x.astype(np.float16) * np.float16(0.5)).astype(np.float32),
                     np.maximum(x, 0.25) + np.minimum(x, -0.25), np.clip(x, -1, 1) + 2 * x + 1,
                     np.exp(x.astype(np.float16).astype(np.float32)),
                     np.abs(x) ** 1.5 + np.floor(x) + (x - np.floor(x))], 1)
    np.testing.assert_allclose(got, want, rtol=2e-3, atol=2e-3)


SIMD_CASES = {
    "simd_sum": ("simd_sum(x)", lambda v: np.repeat(v.reshape(-1, 32).sum(1), 32)),
    "simd_max": ("simd_max(x)", lambda v: np.repeat(v.reshape(-1, 32).max(1), 32)),
    "simd_min": ("simd_min(x)", lambda v: np.repeat(v.reshape(-1, 32).min(1), 32)),
    "simd_product": ("simd_product(x * 0.1f + 1.0f)",
                     lambda v: np.repeat((v * np.float32(0.1) + 1).reshape(-1, 32).prod(1), 32)),
    "simd_shuffle": ("simd_shuffle(x, (lane * 7) % 32)",
                     lambda v: v.reshape(-1, 32)[:, (np.arange(32) * 7) % 32].ravel()),
    "simd_shuffle_xor": ("simd_shuffle_xor(x, 5)", lambda v: v.reshape(-1, 32)[:, np.arange(32) ^ 5].ravel()),
    "simd_shuffle_up": ("simd_shuffle_up(x, 3)",
                        lambda v: v.reshape(-1, 32)[:, np.where(np.arange(32) < 3, np.arange(32), np.arange(32) - 3)].ravel()),
    "simd_shuffle_down": ("simd_shuffle_down(x, 3)",
                          lambda v: v.reshape(-1, 32)[:, np.where(np.arange(32) > 28, np.arange(32), np.arange(32) + 3)].ravel()),
    "simd_broadcast": ("simd_broadcast(x, 9)", lambda v: np.repeat(v.reshape(-1, 32)[:, 9], 32)),
    "simd_prefix_inclusive_sum": ("simd_prefix_inclusive_sum(x)", lambda v: np.cumsum(v.reshape(-1, 32), 1).ravel()),
    "simd_prefix_exclusive_sum": ("simd_prefix_exclusive_sum(x)",
                                  lambda v: (np.cumsum(v.reshape(-1, 32), 1) - v.reshape(-1, 32)).ravel()),
    "simd_ballot": ("float(uint64_t(simd_ballot(x > 0.0f)) & 0xffffu)",
                    lambda v: np.repeat([(sum(1 << i for i in range(16) if r[i] > 0)) for r in v.reshape(-1, 32)], 32)),
    "simd_all": ("float(simd_all(x > -10.0f)) + 2.0f * float(simd_all(x > 0.0f))",
                 lambda v: np.repeat(1 + 2 * (v.reshape(-1, 32) > 0).all(1), 32)),
    "simd_any": ("float(simd_any(x > 2.5f))", lambda v: np.repeat((v.reshape(-1, 32) > 2.5).any(1), 32)),
}


@pytest.mark.parametrize("op", sorted(SIMD_CASES))
def test_simd_collectives(op):
    expr, oracle = SIMD_CASES[op]
    src = f"""
    uint i = thread_position_in_grid.x;
    uint lane = thread_index_in_simdgroup;
    float x = inp[i];
    out[i] = {expr};
    """
    x = RNG.standard_normal(128).astype(np.float32)
    got = run1(src, [mx.array(x)], (128,), grid=(128, 1, 1), threadgroup=(64, 1, 1), names=["inp"])
    np.testing.assert_allclose(got, oracle(x).astype(np.float32), rtol=1e-5, atol=1e-5)


def test_simd_sum_on_vectors_and_ints():
    src = """
    uint i = thread_position_in_grid.x;
    float4 s = simd_sum(float4(inp[i], 1.0f, 2.0f, 3.0f));
    int n = simd_sum(int(i));
    out[i] = s.x + s.w * 1000.0f + float(n) * 1e6f;
    """
    x = RNG.standard_normal(32).astype(np.float32)
    got = run1(src, [mx.array(x)], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1), names=["inp"])
    np.testing.assert_allclose(got, np.full(32, x.sum() + 96 * 1000 + 496 * 1e6, np.float32), rtol=1e-6)


SUM_SOURCE = """
uint i = thread_position_in_grid.x;
uint lane = thread_index_in_simdgroup;
float x = inp[i];
float s = -1.0f;
{guard} s = simd_sum(x);
out[i] = s;
"""


def test_simd_sum_in_branch_combines_only_active_lanes():
    """MUST SHOW: simd_sum inside `if (lane < 16)` sums those 16 lanes; strict raises."""
    x = RNG.standard_normal(64).astype(np.float32)
    src = SUM_SOURCE.format(guard="if (lane < 16)")
    got = run1(src, [mx.array(x)], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1), names=["inp"])
    groups = x.reshape(2, 32)
    want = np.concatenate([np.where(np.arange(32) < 16, g[:16].sum(), -1.0) for g in groups]).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    with pytest.raises(sim.DivergentCollectiveError, match=r"simd_sum reached by only part of simdgroup"):
        run1(src, [mx.array(x)], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1), names=["inp"], strict=True)


def test_simd_sum_without_branch_matches_numpy_also_under_strict():
    x = RNG.standard_normal(64).astype(np.float32)
    src = SUM_SOURCE.format(guard="")
    got = run1(src, [mx.array(x)], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1), names=["inp"], strict=True)
    np.testing.assert_allclose(got, np.repeat(x.reshape(2, 32).sum(1), 32), rtol=1e-5)


def test_collectives_in_both_branches_are_separate():
    src = """
    uint i = thread_position_in_grid.x;
    uint lane = thread_index_in_simdgroup;
    float x = inp[i];
    float s;
    if (lane % 2 == 0) { s = simd_sum(x); } else { s = simd_max(x); }
    out[i] = s;
    """
    x = RNG.standard_normal(32).astype(np.float32)
    got = run1(src, [mx.array(x)], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1), names=["inp"])
    want = np.where(np.arange(32) % 2 == 0, x[::2].sum(), x[1::2].max()).astype(np.float32)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_simdgroup_barrier_and_quad_ops():
    src = """
    uint i = thread_position_in_grid.x;
    float x = inp[i];
    simdgroup_barrier(mem_flags::mem_none);
    out[i] = quad_sum(x) + 100.0f * quad_shuffle_xor(x, 1);
    """
    x = RNG.standard_normal(32).astype(np.float32)
    got = run1(src, [mx.array(x)], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1), names=["inp"])
    want = np.repeat(x.reshape(8, 4).sum(1), 4) + 100 * x[np.arange(32) ^ 1]
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_device_atomics_with_atomic_outputs_and_init_value():
    src = """
    uint i = thread_position_in_grid.x;
    int bin = bins[i];
    atomic_fetch_add_explicit(&out[bin], 1.0f, memory_order_relaxed);
    """
    bins = RNG.integers(0, 10, 3000).astype(np.int32)
    got = run1(src, [mx.array(bins)], (10,), grid=(3000, 1, 1), threadgroup=(256, 1, 1), names=["bins"],
               atomic_outputs=True, init_value=0.0)
    np.testing.assert_array_equal(got, np.bincount(bins, minlength=10).astype(np.float32))


def test_threadgroup_atomics():
    src = """
    threadgroup atomic_uint counter[1];
    if (thread_index_in_threadgroup == 0) atomic_store_explicit(&counter[0], 0u, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    atomic_fetch_add_explicit(&counter[0], 2u, memory_order_relaxed);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = atomic_load_explicit(&counter[0], memory_order_relaxed);
    """
    got = run1(src, [mx.zeros(1)], (96,), mx.uint32, grid=(96, 1, 1), threadgroup=(48, 1, 1))
    np.testing.assert_array_equal(got, np.full(96, 96))


def test_templates_int_bool_dtype_and_header_helpers():
    header = """
    template <typename T, int N>
    METAL_FUNC float sum_n(device const T* p) {
        float s = 0.0f;
        for (int k = 0; k < N; k++) s += float(p[k]);
        return s;
    }
    """
    src = """
    uint i = thread_position_in_grid.x;
    float s = sum_n<T, N>(inp + i * N);
    out[i] = NEG ? -s : s;
    """
    x = RNG.standard_normal(24).astype(np.float32)
    for neg in (True, False):
        got = run1(src, [mx.array(x).astype(mx.float16)], (6,), grid=(6, 1, 1), threadgroup=(6, 1, 1),
                   names=["inp"], header=header, template=[("T", mx.float16), ("N", 4), ("NEG", neg)])
        want = x.astype(np.float16).astype(np.float32).reshape(6, 4).sum(1)
        np.testing.assert_allclose(got, -want if neg else want, rtol=1e-3)


@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.uint32, mx.int32, mx.int64, mx.uint8, mx.bool_])
def test_input_dtypes(dtype):
    src = "uint i = thread_position_in_grid.x; out[i] = float(inp[i]) * 2.0f;"
    x = np.arange(12) % 5
    a = mx.array(x).astype(dtype)
    got = run1(src, [a], (12,), grid=(12, 1, 1), threadgroup=(4, 1, 1), names=["inp"])
    np.testing.assert_array_equal(got, np.array(a.astype(mx.float32)) * 2)


@pytest.mark.parametrize("dtype", [mx.float16, mx.bfloat16, mx.int64, mx.bool_, mx.uint16])
def test_output_dtypes(dtype):
    src = "uint i = thread_position_in_grid.x; out[i] = inp[i];"
    a = mx.array(np.arange(10) % 3).astype(dtype)
    k = sim.metal_kernel(name="copy", input_names=["inp"], output_names=["out"], source=src)
    (o,) = k(inputs=[a], output_shapes=[(10,)], output_dtypes=[dtype], grid=(10, 1, 1), threadgroup=(10, 1, 1))
    assert o.dtype == dtype
    assert mx.array_equal(o, a).item()


def test_strided_inputs_without_row_contiguous_use_real_strides():
    # A non-contiguous view: the kernel walks it with <name>_shape/_strides through elem_to_loc.
    base = mx.array(RNG.standard_normal((6, 10)).astype(np.float32))
    view = base[1:5, ::3]                        # shape (4, 4), strides (10, 3)
    src = """
    uint i = thread_position_in_grid.x;
    out[i] = inp[elem_to_loc(i, inp_shape, inp_strides, inp_ndim)];
    """
    k = sim.metal_kernel(name="strided", input_names=["inp"], output_names=["out"], source=src,
                         ensure_row_contiguous=False)
    with sim.trace() as t:
        (o,) = k(inputs=[view], output_shapes=[(16,)], output_dtypes=[mx.float32], grid=(16, 1, 1),
                 threadgroup=(16, 1, 1))
    np.testing.assert_array_equal(np.array(o), np.array(view).ravel())
    # The buffer spans the view's extent in the base array, not a compact copy.
    assert t.calls[0].buffers["inp"].size == (3 * 10 + 3 * 3 + 1) * 4
    k2 = sim.metal_kernel(name="strided", input_names=["inp"], output_names=["out"], source=src)
    (o2,) = k2(inputs=[view], output_shapes=[(16,)], output_dtypes=[mx.float32], grid=(16, 1, 1),
               threadgroup=(16, 1, 1))
    np.testing.assert_array_equal(np.array(o2), np.array(view).ravel())


def test_mlx_prelude_names():
    src = """
    uint i = thread_position_in_grid.x;
    out[0] = Limits<float>::finite_max;
    out[1] = Limits<float>::min;
    out[2] = float(Limits<int>::max);
    out[3] = float(ceildiv(10, 4));
    out[4] = float(numeric_limits<half>::max());
    out[5] = metal::numeric_limits<float>::infinity();
    """
    got = run1(src, [mx.zeros(1)], (6,), grid=(1, 1, 1), threadgroup=(1, 1, 1))
    np.testing.assert_array_equal(got, np.array([np.finfo(np.float32).max, -np.inf, 2**31 - 1, 3, 65504, np.inf],
                                                np.float32))


def test_init_value_and_uninitialized_outputs_are_poisoned():
    src = "uint i = thread_position_in_grid.x; if (i % 2 == 0) out[i] = 1.0f;"
    got = run1(src, [mx.zeros(1)], (8,), grid=(8, 1, 1), threadgroup=(8, 1, 1), init_value=3.0)
    np.testing.assert_array_equal(got, [1, 3, 1, 3, 1, 3, 1, 3])
    got = run1(src, [mx.zeros(1)], (8,), grid=(8, 1, 1), threadgroup=(8, 1, 1))
    assert np.isnan(got[1::2]).all() and (got[::2] == 1).all()


def test_seeded_order_gives_the_same_answer_for_a_correct_kernel():
    src = """
    threadgroup float buf[32];
    uint l = thread_index_in_threadgroup;
    buf[l] = inp[thread_position_in_grid.x];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = buf[31 - l];
    """
    x = RNG.standard_normal(128).astype(np.float32)
    for seed in (0, 1, 7):
        got = run1(src, [mx.array(x)], (128,), grid=(128, 1, 1), threadgroup=(32, 1, 1), names=["inp"], seed=seed)
        np.testing.assert_array_equal(got, x.reshape(4, 32)[:, ::-1].ravel())


@pytest.mark.parametrize("make", ["broadcast", "transpose_f32", "transpose_f16"])
def test_broadcast_and_transposed_views_keep_their_strides(make):
    view = {
        "broadcast": lambda: mx.broadcast_to(mx.arange(4, dtype=mx.float32), (3, 4)),         # strides (0, 1)
        "transpose_f32": lambda: mx.arange(12, dtype=mx.float32).reshape(3, 4).T,             # strides (1, 4)
        "transpose_f16": lambda: mx.arange(12, dtype=mx.float16).reshape(3, 4).T,
    }[make]()
    src = """
    uint i = thread_position_in_grid.x;
    out[i] = float(inp[elem_to_loc(i, inp_shape, inp_strides, inp_ndim)]) + float(inp_strides[0]) * 1000.0f;
    """
    k = sim.metal_kernel(name="views", input_names=["inp"], output_names=["out"], source=src,
                         ensure_row_contiguous=False)
    with sim.trace() as t:
        (o,) = k(inputs=[view], output_shapes=[(12,)], output_dtypes=[mx.float32], grid=(12, 1, 1),
                 threadgroup=(12, 1, 1))
    stride0 = 0 if make == "broadcast" else 1
    np.testing.assert_array_equal(np.array(o), np.array(view.astype(mx.float32)).ravel() + 1000.0 * stride0)
    assert t.calls[0].buffers["inp"].size == (4 if make == "broadcast" else 12) * view.dtype.size


def test_reading_back_written_vector_outputs():
    src = """
    uint i = thread_position_in_grid.x;
    device float4* o = (device float4*)out;
    o[i] = float4(inp[i]);
    o[i] = o[i] * 2.0f + 1.0f;          // read the element back through the writable pointer
    o[i] += float4(0.0f, 1.0f, 2.0f, 3.0f);
    float4 v = o[i];
    out[4 * i] = 0.5f * v.x + out[4 * i + 1] - 1.0f;
    """
    x = RNG.standard_normal(8).astype(np.float32)
    got = run1(src, [mx.array(x)], (32,), grid=(8, 1, 1), threadgroup=(8, 1, 1), names=["inp"]).reshape(8, 4)
    want = 2 * x[:, None] + 1 + np.arange(4, dtype=np.float32)
    want[:, 0] = 0.5 * want[:, 0] + want[:, 1] - 1
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_atomics_through_a_cast_plain_output_and_fences():
    src = """
    uint i = thread_position_in_grid.x;
    device atomic_uint* counter = (device atomic_uint*)&out[0];
    atomic_fetch_add_explicit(counter, i, memory_order_relaxed);
    atomic_thread_fence(mem_flags::mem_device, memory_order_seq_cst, thread_scope_device);
    atomic_fetch_max_explicit((device atomic_uint*)&out[1], i * 3u, memory_order_relaxed);
    """
    got = run1(src, [mx.zeros(1)], (2,), mx.uint32, grid=(100, 1, 1), threadgroup=(32, 1, 1), init_value=0)
    np.testing.assert_array_equal(got, [sum(range(100)), 297])
