"""kvmetal.sim: one deliberately broken kernel per error class, each detected as such."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvmetal.sim as sim
from kvcases import run1


def test_out_of_bounds_read_names_kernel_buffer_and_index():
    src = "uint i = thread_position_in_grid.x; out[i] = inp[i + 1];"
    with pytest.raises(sim.OutOfBoundsError, match=r"\[oob_read\].*load of buffer 'inp' at index 16"):
        run1(src, [mx.zeros(16)], (16,), grid=(16, 1, 1), threadgroup=(16, 1, 1), names=["inp"], name="oob_read")


def test_out_of_bounds_write():
    src = "uint i = thread_position_in_grid.x; out[i * 2] = inp[i];"
    with pytest.raises(sim.OutOfBoundsError, match=r"\[oob_write\].*buffer 'out' at index 16"):
        run1(src, [mx.zeros(16)], (16,), grid=(16, 1, 1), threadgroup=(16, 1, 1), names=["inp"], name="oob_write")


def test_negative_index_and_vector_overrun_are_out_of_bounds():
    src = "int i = int(thread_position_in_grid.x); out[i] = inp[i - 1];"
    with pytest.raises(sim.OutOfBoundsError, match="index -1"):
        run1(src, [mx.zeros(8)], (8,), grid=(8, 1, 1), threadgroup=(8, 1, 1), names=["inp"])
    # A float4 load of elements 8..11 from a 10-element buffer.
    src = "uint i = thread_position_in_grid.x; out[i] = (*(device const float4*)(inp + 4 * i)).x;"
    with pytest.raises(sim.OutOfBoundsError, match="buffer 'inp'"):
        run1(src, [mx.zeros(10)], (3,), grid=(3, 1, 1), threadgroup=(3, 1, 1), names=["inp"])


def test_constant_buffer_overrun_is_out_of_bounds():
    src = "out[0] = small[5];"  # 3 elements: a constant buffer
    with pytest.raises(sim.OutOfBoundsError, match="buffer 'small' at index 5"):
        run1(src, [mx.zeros(3)], (1,), grid=(1, 1, 1), threadgroup=(1, 1, 1), names=["small"])


def test_misaligned_vector_load():
    src = "out[0] = (*(device const float4*)(inp + 1)).x;"
    with pytest.raises(sim.MisalignedAccessError, match="misaligned load of 16 bytes from buffer 'inp'"):
        run1(src, [mx.zeros(16)], (1,), grid=(1, 1, 1), threadgroup=(1, 1, 1), names=["inp"])


def test_divergent_barrier_is_an_error_not_a_hang():
    src = """
    uint l = thread_index_in_threadgroup;
    if (l < 10) threadgroup_barrier(mem_flags::mem_threadgroup);
    out[thread_position_in_grid.x] = 1.0f;
    """
    with pytest.raises(sim.DivergentBarrierError, match=r"divergent threadgroup_barrier.*10 of 64 threads wait"):
        run1(src, [mx.zeros(1)], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1))


def test_barriers_at_different_sites_are_divergent():
    src = """
    uint l = thread_index_in_threadgroup;
    if (l % 2) { threadgroup_barrier(mem_flags::mem_threadgroup); }
    else { threadgroup_barrier(mem_flags::mem_threadgroup); }
    out[thread_position_in_grid.x] = 1.0f;
    """
    with pytest.raises(sim.DivergentBarrierError, match="different barrier"):
        run1(src, [mx.zeros(1)], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1))


def test_early_return_before_barrier_is_divergent():
    src = """
    uint i = thread_position_in_grid.x;
    if (i >= 40) return;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[i] = 1.0f;
    """
    with pytest.raises(sim.DivergentBarrierError, match="exited"):
        run1(src, [mx.zeros(1)], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1))


def test_strict_reports_partial_collective_after_early_return():
    src = """
    uint i = thread_position_in_grid.x;
    if (i >= 40) return;
    out[i] = simd_max(inp[i]);
    """
    x = np.arange(64, dtype=np.float32)
    got = run1(src, [mx.array(x)], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1), names=["inp"], init_value=0.0)
    np.testing.assert_array_equal(got[32:40], np.full(8, 39.0))  # lanes that returned do not take part
    with pytest.raises(sim.DivergentCollectiveError, match="simd_max"):
        run1(src, [mx.array(x)], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1), names=["inp"], strict=True)


def test_strict_via_trace_block_and_shuffle_from_inactive_lane():
    src = """
    uint lane = thread_index_in_simdgroup;
    float v = inp[thread_position_in_grid.x];
    if (lane < 8) v = simd_shuffle_down(v, 4u);
    out[thread_position_in_grid.x] = v;
    """
    x = np.arange(32, dtype=np.float32)
    got = run1(src, [mx.array(x)], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1), names=["inp"])
    np.testing.assert_array_equal(got[:4], x[4:8])
    assert np.isnan(got[4:8]).all()       # lanes 8..11 did not take part: poison
    with sim.trace(strict=True):
        with pytest.raises(sim.DivergentCollectiveError):
            run1(src, [mx.array(x)], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1), names=["inp"])


def test_threadgroup_memory_over_32k():
    src = """
    threadgroup float big[8200];
    big[thread_index_in_threadgroup] = 1.0f;
    out[0] = big[0];
    """
    with pytest.raises(sim.ThreadgroupMemoryError, match="32 KiB"):
        run1(src, [mx.zeros(1)], (1,), grid=(32, 1, 1), threadgroup=(32, 1, 1))
    ok = src.replace("8200", "8192")
    run1(ok, [mx.zeros(1)], (1,), grid=(32, 1, 1), threadgroup=(32, 1, 1))


def test_more_than_1024_threads_per_threadgroup():
    src = "out[0] = 1.0f;"
    with pytest.raises(sim.ThreadgroupSizeError, match=r"\(1056\).*\(1024\)"):
        run1(src, [mx.zeros(1)], (1,), grid=(2048, 1, 1), threadgroup=(32, 33, 1))
    # MLX clamps the threadgroup to the grid only after the check; 1024 is fine.
    run1(src, [mx.zeros(1)], (1,), grid=(2048, 1, 1), threadgroup=(1024, 1, 1))


def test_compile_error_shows_the_offending_msl_line():
    src = "uint i = thread_position_in_grid.x;\nfloat y = undefined_thing(i);\nout[i] = y;"
    with pytest.raises(sim.CompileError, match=r"MSL line \d+: float y = undefined_thing\(i\);"):
        run1(src, [mx.zeros(1)], (1,), grid=(1, 1, 1), threadgroup=(1, 1, 1))


def test_missing_barrier_shows_as_nan_from_poisoned_threadgroup_memory():
    # Each thread reads another thread's slot without a barrier: poison (NaN) for some order.
    src = """
    threadgroup float buf[64];
    uint l = thread_index_in_threadgroup;
    buf[l] = inp[thread_position_in_grid.x];
    {barrier}
    out[thread_position_in_grid.x] = buf[63 - l];
    """
    x = np.arange(64, dtype=np.float32)
    broken = src.replace("{barrier}", "")
    got = run1(broken, [mx.array(x)], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1), names=["inp"])
    assert np.isnan(got).any()
    for seed in range(1, 4):
        got = run1(broken, [mx.array(x)], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1), names=["inp"], seed=seed)
        assert np.isnan(got).any()
    fixed = src.replace("{barrier}", "threadgroup_barrier(mem_flags::mem_threadgroup);")
    for seed in range(0, 4):
        good = run1(fixed, [mx.array(x)], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1), names=["inp"], seed=seed)
        np.testing.assert_array_equal(good, x[::-1])


def test_threadgroup_memory_is_poisoned_for_every_threadgroup():
    # Threadgroup 0 writes its slot; threadgroup 1 must not see that value.
    src = """
    threadgroup float buf[1];
    uint g = threadgroup_position_in_grid.x;
    if (g == 0) { buf[0] = 5.0f; }
    out[g] = buf[0];
    """
    got = run1(src, [mx.zeros(1)], (4,), grid=(4, 1, 1), threadgroup=(1, 1, 1))
    assert got[0] == 5.0 and np.isnan(got[1:]).all()


def test_threadgroup_array_index_out_of_bounds():
    src = """
    threadgroup float buf[4][32];
    uint l = thread_index_in_threadgroup;
    buf[l / 32][l % 32] = 1.0f;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[l] = buf[0][l + 1];
    """
    with pytest.raises(sim.OutOfBoundsError, match=r"\[tgidx\].*threadgroup array 'buf' at index 32 \(it has 32"):
        run1(src, [mx.zeros(1)], (128,), grid=(128, 1, 1), threadgroup=(128, 1, 1), name="tgidx")
    with pytest.raises(sim.OutOfBoundsError, match=r"'buf' at index 4 \(it has 4 elements"):
        run1(src.replace("l / 32", "l / 16"), [mx.zeros(1)], (128,), grid=(128, 1, 1), threadgroup=(128, 1, 1))


def test_threadgroup_overrun_through_a_pointer_is_caught_by_guards():
    src = """
    threadgroup float first[32];
    threadgroup float second[32];
    int l = int(thread_index_in_threadgroup);
    threadgroup float* p = second;
    first[l] = 1.0f;
    p[l + OFF - 1] = 2.0f;  // OFF = 2: the last thread writes one past the end; OFF = 0: one before
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[l] = first[l] + second[l];
    """
    with pytest.raises(sim.OutOfBoundsError, match=r"threadgroup array 'second' \(128 bytes\).*byte 0 past its end"):
        run1(src, [mx.zeros(1)], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1), template=[("OFF", 2)])
    with pytest.raises(sim.OutOfBoundsError, match=r"'second'.*before its start"):
        run1(src, [mx.zeros(1)], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1), template=[("OFF", 0)])
    got = run1(src, [mx.zeros(1)], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1), template=[("OFF", 1)])
    np.testing.assert_array_equal(got, np.full(32, 3.0))


def test_several_threadgroup_arrays_in_one_declaration():
    src = """
    threadgroup float a[32], b[32];
    uint l = thread_index_in_threadgroup;
    a[l] = float(l);
    b[l] = 2.0f * float(l);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    out[l] = a[31 - l] + b[l];
    """
    got = run1(src, [mx.zeros(1)], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1))
    np.testing.assert_array_equal(got, 31 - np.arange(32) + 2 * np.arange(32))


def test_untranslatable_threadgroup_declaration_is_a_compile_error_not_a_silent_local():
    src = "threadgroup float q[2] = {0.0f, 1.0f};\nout[0] = q[1];"
    with pytest.raises(sim.CompileError, match=r"unsupported threadgroup declaration.*\n  MSL line \d+: threadgroup float q"):
        run1(src, [mx.zeros(1)], (1,), grid=(1, 1, 1), threadgroup=(1, 1, 1))
