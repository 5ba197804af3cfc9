"""kvmetal.sim enforces the rules of Apple's compiler and MLX's runtime that the
issue-17 defects broke: one deliberately bad kernel per rule, each caught.

- inputs under 8 elements are `constant` (as MLX binds them), and a cast of a
  constant pointer to device or threadgroup memory does not compile;
- a threadgroup over 1024 threads, or over the pipeline's own maximum, raises;
- under "relaxed"/"fast" math, metal::tanh/exp/exp2/log/rsqrt are the fast forms
  (fast tanh is NaN past |x| ~ 44);
- "relaxed" math needs macOS 15.
"""
import math

import mlx.core as mx
import numpy as np
import pytest

import kvmetal.sim as sim
from kvcases import run1


def kernel(source, names=("inp",), header="", math_mode=None, macos=None, name="rule"):
    options = {"math_mode": math_mode} if math_mode else None
    return sim.metal_kernel(name=name, input_names=list(names), output_names=["out"], source=source, header=header,
                            compile_options=options, macos=macos)


def call(k, inputs, n=1, threads=1):
    (out,) = k(inputs=inputs, output_shapes=[(n,)], output_dtypes=[mx.float32], grid=(threads, 1, 1),
               threadgroup=(threads, 1, 1))
    return np.array(out)


# ------------------------------------------------------------------ constant address space

def test_small_inputs_are_constant_and_cannot_be_cast_to_device():
    src = "out[0] = (*reinterpret_cast<const device float4*>(inp)).x;"
    # 8 elements: a device buffer, the cast is fine.
    assert call(kernel(src), [mx.arange(8).astype(mx.float32) + 1])[0] == 1.0
    # 4 elements: MLX binds it as `constant`; the cast is a compile error, as in Metal.
    with pytest.raises(sim.CompileError, match="constant"):
        call(kernel(src, name="rule_small"), [mx.ones(4)])


def test_constant_pointer_passed_to_a_device_only_helper_does_not_compile():
    header = "inline float first(const device float* p) { return p[0]; }\n"
    with pytest.raises(sim.CompileError, match="first"):
        call(kernel("out[0] = first(inp);", header=header, name="rule_helper"), [mx.ones(3)])
    # With a constant overload (what kvmetal_common.h does) it compiles and runs.
    header += "inline float first(const constant float* p) { return p[0] + 1.0f; }\n"
    assert call(kernel("out[0] = first(inp);", header=header, name="rule_helper2"), [mx.ones(3)])[0] == 2.0
    assert call(kernel("out[0] = first(inp);", header=header, name="rule_helper2"), [mx.ones(9)])[0] == 1.0


def test_constant_pointer_cast_to_threadgroup_does_not_compile():
    src = "out[0] = reinterpret_cast<const threadgroup float*>(inp)[0];"
    with pytest.raises(sim.CompileError, match="threadgroup"):
        call(kernel(src, name="rule_tg"), [mx.ones(2)])


def test_shape_and_strides_buffers_are_constant():
    src = "out[0] = (*reinterpret_cast<const device int4*>(inp_shape)).x;"
    with pytest.raises(sim.CompileError, match="constant"):
        call(kernel(src, name="rule_shape"), [mx.ones((2, 8))])


# ------------------------------------------------------------------ threads per threadgroup

def test_1025_threads_per_threadgroup_raises():
    src = "out[thread_position_in_grid.x] = 1.0f;"
    with pytest.raises(sim.ThreadgroupSizeError, match=r"\(1025\).*\(1024\)"):
        run1(src, [mx.zeros(1)], (1025,), grid=(1025, 1, 1), threadgroup=(1025, 1, 1))
    assert run1(src, [mx.zeros(1)], (1024,), grid=(1024, 1, 1), threadgroup=(1024, 1, 1)).sum() == 1024


def test_the_pipelines_own_maximum_raises():
    # A pipeline whose maxTotalThreadsPerThreadgroup is 256 (Apple lowers it for
    # register-heavy kernels): MLX refuses a larger threadgroup.
    src = "out[thread_position_in_grid.x] = 1.0f;"
    with sim.trace(max_threads_per_threadgroup=256):
        with pytest.raises(sim.ThreadgroupSizeError, match=r"\(320\).*\(256\)"):
            run1(src, [mx.zeros(1)], (320,), grid=(320, 1, 1), threadgroup=(320, 1, 1))
        assert run1(src, [mx.zeros(1)], (256,), grid=(256, 1, 1), threadgroup=(256, 1, 1)).sum() == 256
    with pytest.raises(ValueError, match="max_threads_per_threadgroup"):
        with sim.trace(max_threads_per_threadgroup=2048):
            pass


# ------------------------------------------------------------------ fast math

UNARY = "uint i = thread_position_in_grid.x; out[i] = {fn}(inp[i]);"


def _unary(fn, values, math_mode):
    x = mx.array(np.array(values, np.float32))
    k = kernel(UNARY.format(fn=fn), math_mode=math_mode, name=f"rule_{fn.replace(':', '_')}_{math_mode}")
    return call(k, [x], n=x.size, threads=x.size)


@pytest.mark.parametrize("mode", ["relaxed", "fast"])
def test_fast_tanh_overflows_to_nan_on_an_unguarded_kernel(mode):
    out = _unary("tanh", [0.5, 50.0, 100.0, -50.0], mode)
    assert np.isnan(out[1]) and np.isnan(out[2])          # (e^2x - 1) / (e^2x + 1) = inf / inf
    assert out[3] == -1.0 and abs(out[0] - math.tanh(0.5)) < 1e-6
    assert (_unary("precise::tanh", [50.0], mode) == 1.0).all()  # the precise form is always precise


def test_safe_math_tanh_is_precise_and_fast_namespace_is_always_fast():
    assert (_unary("tanh", [50.0, 100.0], "safe") == 1.0).all()
    assert np.isnan(_unary("fast::tanh", [50.0], "safe")).all()


def test_fast_exp2_exp_log_rsqrt_follow_the_fast_formulas():
    tiny = 2.0 ** -130  # a float32 denormal: fast math flushes it to zero
    assert _unary("exp2", [-130.0], "relaxed")[0] == 0.0 and _unary("exp2", [-130.0], "safe")[0] > 0.0
    assert _unary("exp", [-90.0], "relaxed")[0] == 0.0 and _unary("exp", [-90.0], "safe")[0] > 0.0
    assert _unary("log", [tiny], "relaxed")[0] == -np.inf and np.isfinite(_unary("log", [tiny], "safe")[0])
    assert _unary("rsqrt", [tiny], "relaxed")[0] == np.inf and np.isfinite(_unary("rsqrt", [tiny], "safe")[0])
    # Normal arguments: the fast forms stay close to the precise ones.
    xs = [0.1, 1.0, 3.7, 20.0]
    for fn in ("exp", "exp2", "log", "rsqrt"):
        fast, safe = _unary(fn, xs, "relaxed"), _unary(fn, xs, "safe")
        assert np.allclose(fast, safe, rtol=1e-5), fn


def test_transcendental_counters_count_both_forms():
    with sim.trace() as t:
        _unary("tanh", [1.0, 2.0], "relaxed")
        _unary("precise::tanh", [1.0, 2.0], "relaxed")
    assert [c.math.get("tanh") for c in t.calls] == [2, 2]


# ------------------------------------------------------------------ macOS version

def test_relaxed_math_needs_macos_15():
    src = "out[0] = inp[0];"
    with pytest.raises(ValueError, match="requires macOS 15"):
        call(kernel(src, math_mode="relaxed", macos=14, name="rule_m14"), [mx.ones(8)])
    assert call(kernel(src, math_mode="safe", macos=14, name="rule_m14s"), [mx.ones(8)])[0] == 1.0
    assert call(kernel(src, math_mode="fast", macos=14, name="rule_m14f"), [mx.ones(8)])[0] == 1.0
    assert call(kernel(src, math_mode="relaxed", macos=15, name="rule_m15"), [mx.ones(8)])[0] == 1.0
    with pytest.raises(ValueError, match="macos"):
        kernel(src, macos=0)
