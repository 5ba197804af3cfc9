"""kvmetal.sim crash-proofing (issue 10 item 11): integer division by zero and
infinite loops fail the launch with a SimError naming the kernel instead of
killing or wedging the process; Ctrl-C cancels a running launch."""
from __future__ import annotations

import _thread
import platform
import threading
import time

import mlx.core as mx
import numpy as np
import pytest

import kvmetal.sim as sim
from test_sim_helpers import run1


@pytest.mark.parametrize("op", ["/", "%"])
def test_integer_division_by_zero_is_a_sim_error_naming_the_kernel(op):
    src = f"int i = int(thread_position_in_grid.x); out[i] = float(i {op} int(inp[i]));"
    with pytest.raises(sim.IntegerDivisionError, match=r"\[div_zero\] integer division or modulo by zero"):
        run1(src, [mx.array(np.array([1, 2, 0, 4], np.int32))], (4,), grid=(4, 1, 1), threadgroup=(4, 1, 1),
             names=["inp"], name="div_zero")
    # The process (and the runtime) are fine afterwards: the next launch runs.
    o = run1(src, [mx.array(np.array([1, 2, 3, 4], np.int32))], (4,), grid=(4, 1, 1), threadgroup=(4, 1, 1),
             names=["inp"], name="div_ok")
    expected = [i / d if op == "/" else i % d for i, d in zip(range(4), [1, 2, 3, 4])]
    np.testing.assert_array_equal(np.array(o), np.floor(expected) if op == "/" else expected)


def test_division_by_zero_in_many_threadgroups_and_workers():
    src = "int i = int(thread_position_in_grid.x); out[i] = float(100 / (i % 37 - 5));"
    with pytest.raises(sim.IntegerDivisionError):
        run1(src, [mx.zeros(1)], (4096,), grid=(4096, 1, 1), threadgroup=(64, 1, 1), names=["inp"])


@pytest.mark.parametrize("loop", ["while (inp[0] > -1.0f) { x += 1.0f; }",
                                  "for (int k = 0; k >= 0; k += 0) { x += inp[0]; }",
                                  "do { x += 1.0f; } while (x > -1.0f);"])
def test_watchdog_stops_an_infinite_loop(loop):
    src = f"float x = 0.0f; {loop} out[thread_position_in_grid.x] = x;"
    t0 = time.perf_counter()
    with sim.trace(timeout=0.5):
        with pytest.raises(sim.SimTimeoutError, match=r"\[endless\] watchdog.*0.5 s"):
            run1(src, [mx.ones(1)], (64,), grid=(64, 1, 1), threadgroup=(32, 1, 1), names=["inp"], name="endless")
    assert time.perf_counter() - t0 < 10


def test_watchdog_is_off_with_zero_and_leaves_finite_loops_alone():
    src = "float x = 0.0f; for (int k = 0; k < 200000; k++) { x += inp[0]; } out[thread_position_in_grid.x] = x;"
    with sim.trace(timeout=0) as t:
        o = run1(src, [mx.ones(1)], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1), names=["inp"])
    assert np.array(o)[0] == 200000.0 and len(t.calls) == 1
    with pytest.raises(ValueError, match="timeout"):
        with sim.trace(timeout=-1):
            pass


def test_ctrl_c_cancels_a_running_launch():
    src = "float x = 0.0f; while (inp[0] > -1.0f) { x += 1.0f; } out[thread_position_in_grid.x] = x;"
    timer = threading.Timer(0.5, _thread.interrupt_main)
    t0 = time.perf_counter()
    timer.start()
    try:
        with sim.trace(timeout=60):
            with pytest.raises(KeyboardInterrupt):
                run1(src, [mx.ones(1)], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1), names=["inp"],
                     name="endless_ctrl_c")
    finally:
        timer.cancel()
    assert time.perf_counter() - t0 < 20


@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="only x86 traps on INT_MIN / -1")
def test_int_min_divided_by_minus_one_is_a_sim_error_on_x86():
    src = "int i = int(thread_position_in_grid.x); out[i] = float(int(inp[i]) / int(inp[1]));"
    with pytest.raises(sim.IntegerDivisionError, match=r"\[int_min\].*SIGFPE"):
        run1(src, [mx.array(np.array([-(2**31), -1], np.int32))], (2,), grid=(2, 1, 1), threadgroup=(2, 1, 1),
             names=["inp"], name="int_min")
