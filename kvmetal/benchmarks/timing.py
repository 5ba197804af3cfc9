"""Timing and bandwidth helpers shared by the benchmark cases."""
from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

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


def read_bandwidth_gbps(nbytes: int = 512 << 20, repeat: int = 5) -> float:
    """This machine's read bandwidth: one pass over a buffer far larger than the caller's
    data, split across every core (NumPy reductions release the GIL), best of ``repeat``.

    The reduction (max) is cheap enough that memory, not arithmetic, bounds it; using all
    cores makes it the same kind of read the kernels do, so fractions of it are honest.
    """
    cores = os.cpu_count() or 1
    buffer = np.ones(nbytes // 4, dtype=np.float32)
    parts = np.array_split(buffer, cores)
    with ThreadPoolExecutor(cores) as pool:
        def one_pass():
            list(pool.map(np.max, parts))

        one_pass()
        best = float("inf")
        for _ in range(repeat):
            start = time.perf_counter()
            one_pass()
            best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9
