"""Timing and bandwidth helpers shared by the benchmark cases."""
from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np


def median_seconds(fn, *, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` (its result is evaluated with ``mx.eval``)."""
    for _ in range(warmup):
        mx.eval(fn())
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth_gbps(nbytes: int = 256 << 20, repeat: int = 5) -> float:
    """This machine's single-pass read bandwidth: best of ``repeat`` NumPy max() passes, GB/s.

    One pass over a buffer much larger than the caches, with a reduction cheap enough that
    memory, not arithmetic, bounds it. The best pass is the fairest yardstick on a shared box.
    """
    buffer = np.ones(nbytes // 4, dtype=np.float32)
    buffer.max()
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        buffer.max()
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9
