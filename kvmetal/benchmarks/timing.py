"""Timing and bandwidth helpers shared by the benchmark cases."""
from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import mlx.core as mx
import numpy as np


def _timed(fn) -> float:
    start = time.perf_counter()
    mx.eval(fn())
    return time.perf_counter() - start


def time_stats(fn, *, repeat: int = 5, warmup: int = 1, budget_s: float | None = None) -> dict:
    """Wall times of ``fn()`` (evaluated with ``mx.eval``) after ``warmup`` calls:
    ``{"seconds": median, "min": ..., "max": ..., "repeats": n}``.

    ``budget_s`` bounds a slow function's cost: the repeats shrink to what fits in it
    (at least one), and when the warm-up call alone exceeds it that call is the one
    sample (``"warmup_as_sample": True``); ``repeats`` always says how many were taken.
    """
    first = [_timed(fn) for _ in range(max(warmup, 1 if budget_s else 0))]
    if budget_s is not None and first and first[-1] >= budget_s:
        t = first[-1]
        return {"seconds": t, "min": t, "max": t, "repeats": 1, "warmup_as_sample": True}
    if budget_s is not None and first:
        repeat = max(1, min(repeat, int(budget_s / max(first[-1], 1e-9))))
    return _stats([_timed(fn) for _ in range(repeat)])


def _stats(times: list) -> dict:
    return {"seconds": statistics.median(times), "min": min(times), "max": max(times), "repeats": len(times)}


def time_interleaved(fns: dict, *, repeat: int = 5, warmup: int = 1) -> dict:
    """``time_stats`` of several functions measured in turns (a, b, a, b, ...): a slow spell
    of a shared machine falls on all of them alike, so their ratios are those of one moment
    (timed one after the other, the same op measured 31.5 and 20.4 ms in one run)."""
    for fn in fns.values():
        for _ in range(warmup):
            _timed(fn)
    times = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            times[name].append(_timed(fn))
    return {name: _stats(t) for name, t in times.items()}


def read_bandwidth_gbps(nbytes: int = 512 << 20, repeat: int = 5, threads: int | None = None) -> float:
    """This machine's read bandwidth: one pass over a buffer far larger than the caller's
    data, split across ``threads`` (default every core; NumPy reductions release the GIL),
    best of ``repeat``.

    The reduction (max) is cheap enough that memory, not arithmetic, bounds it; using all
    cores makes it the same kind of read the kernels do, so fractions of it are honest.
    """
    cores = threads or os.cpu_count() or 1
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
