"""Binding host buffers and running one launch on the runtime (ctypes side of runtime/abi.h)."""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import threading
import time

import mlx.core as mx
import numpy as np

from . import build
from .errors import BY_KIND, SimError
from .trace import BufferTraffic

NCOLLECTIVE, NMATH = 40, 24  # runtime/abi.h KMSL_NCOLLECTIVE, KMSL_NMATH


class _Stats(ctypes.Structure):  # KmslStats
    _fields_ = [("barriers", ctypes.c_uint64), ("collectives", ctypes.c_uint64 * NCOLLECTIVE),
                ("math", ctypes.c_uint64 * NMATH), ("tick_budget", ctypes.c_int64)]


class _Buf(ctypes.Structure):  # KmslBuf
    _fields_ = [("data", ctypes.c_void_p), ("size", ctypes.c_int64), ("start", ctypes.c_int64),
                ("name", ctypes.c_char_p), ("touched", ctypes.c_void_p), ("written", ctypes.c_void_p)]


class _Launch(ctypes.Structure):  # KmslLaunch
    _fields_ = [("grid", ctypes.c_uint32 * 3), ("threadgroup", ctypes.c_uint32 * 3), ("nbufs", ctypes.c_int32),
                ("bufs", ctypes.POINTER(_Buf)), ("seed", ctypes.c_uint64), ("strict", ctypes.c_int32),
                ("nworkers", ctypes.c_int32), ("kernel_name", ctypes.c_char_p),
                ("loads", ctypes.POINTER(ctypes.c_uint64)), ("stores", ctypes.POINTER(ctypes.c_uint64)),
                ("tg_memory", ctypes.c_uint64), ("err_kind", ctypes.c_int32), ("err_msg", ctypes.c_char * 1024),
                ("load_ops", ctypes.POINTER(ctypes.c_uint64)), ("store_ops", ctypes.POINTER(ctypes.c_uint64)),
                ("stats", _Stats), ("timeout_s", ctypes.c_double), ("cancel", ctypes.c_int32)]


_NP_RAW = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
_MX_RAW = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32, 8: mx.uint64}


def default_workers() -> int:
    """OS threads per launch: KVMETAL_SIM_THREADS, else every core."""
    env = os.environ.get("KVMETAL_SIM_THREADS")
    return max(1, int(env)) if env else max(1, os.cpu_count() or 1)


def host_view(a: mx.array, contiguous: bool) -> np.ndarray:
    """The array's bytes as a NumPy view (same strides unless `contiguous`), any dtype."""
    if a.dtype == mx.complex64:
        raise NotImplementedError("[metal_kernel] the simulator does not support complex64 buffers")
    raw = a if a.dtype == mx.bool_ else a.view(_MX_RAW[a.dtype.size])  # NumPy has no bfloat16
    h = np.asarray(raw)
    return np.ascontiguousarray(h) if contiguous else h


def _span(h: np.ndarray) -> tuple:
    """(lowest address, bytes spanned, offset of element 0) of a strided view."""
    ptr = h.__array_interface__["data"][0]
    if h.size == 0:
        return ptr, 0, 0
    lo = sum(min(0, (n - 1) * s) for n, s in zip(h.shape, h.strides))
    hi = sum(max(0, (n - 1) * s) for n, s in zip(h.shape, h.strides)) + h.itemsize
    return ptr + lo, hi - lo, -lo


def _aligned_bytes(nbytes: int, first: int = 0) -> np.ndarray:
    """nbytes of fresh memory whose byte `first` sits on a 64-byte boundary (as Metal buffers do)."""
    raw = np.empty(nbytes + 128, np.uint8)
    shift = (-(raw.ctypes.data + first)) % 64
    return raw[shift:shift + nbytes]


def new_output(shape, dtype, init_value) -> np.ndarray:
    """A 64-byte aligned output: init_value, else 0xFF bytes (Metal leaves outputs uninitialized)."""
    np_dtype = np.bool_ if dtype == mx.bool_ else _NP_RAW[dtype.size]
    n = int(np.prod(shape, dtype=np.int64))
    out = _aligned_bytes(n * np.dtype(np_dtype).itemsize).view(np_dtype).reshape(shape)
    if init_value is not None:
        ref = mx.full(shape, init_value, dtype=dtype)
        out[...] = np.array(ref if dtype == mx.bool_ else ref.view(_MX_RAW[dtype.size]))
    else:
        out.view(np.uint8)[...] = 0xFF
    return out


def to_mx(h: np.ndarray, dtype) -> mx.array:
    a = mx.array(h)
    return a if dtype == mx.bool_ else a.view(dtype)


class Bindings:
    """The kernel's buffers in MLX's order, with their traffic byte maps."""

    def __init__(self):
        self._keep: list = []  # host arrays that must outlive the launch
        self.bufs: list = []
        self.traced: list = []  # (name or None, loaded map, stored map, span)

    def add(self, h: np.ndarray, param: str, traced_name: str | None = None):
        lo, span, start = _span(h)
        if (lo + start) % 64:
            # MLX's CPU allocations are only 8-byte aligned; Metal buffers are page aligned.
            copy = _aligned_bytes(span, start)
            ctypes.memmove(copy.ctypes.data, lo, span)
            self._keep.append(copy)
            lo = copy.ctypes.data
        touched = np.zeros(max(span, 1), np.uint8)
        written = np.zeros(max(span, 1), np.uint8)
        name = param.encode()
        self._keep += [h, touched, written, name]
        self.bufs.append(_Buf(lo, span, start, name, touched.ctypes.data, written.ctypes.data))
        self.traced.append((traced_name, touched, written, span))


@dataclasses.dataclass
class LaunchResult:
    traffic: dict          # name -> BufferTraffic
    tg_memory: int
    seconds: float
    barriers: int
    collectives: dict      # op -> simdgroup executions (non-zero only)
    math: dict             # function -> lane calls (non-zero only)


@functools.lru_cache(maxsize=None)
def _stat_names(kind: int, count: int) -> list:
    fn = build.load_runtime().kmsl_rt_stat_name
    fn.argtypes = [ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_char_p
    names = []
    for i in range(count):
        name = fn(kind, i)
        names.append(name.decode() if name else None)
    return names


def run(entry: int, bindings: Bindings, *, grid, threadgroup, seed: int, strict: bool, kernel_name: str,
        timeout: float = 0.0) -> LaunchResult:
    """Run one launch (in a helper thread, so Ctrl-C cancels it); raises a SimError on failure."""
    n = len(bindings.bufs)
    launch = _Launch()
    launch.grid[:] = grid
    launch.threadgroup[:] = threadgroup
    launch.nbufs = n
    buf_array = (_Buf * max(n, 1))(*bindings.bufs)
    counters = [(ctypes.c_uint64 * max(n, 1))() for _ in range(4)]
    loads, stores, load_ops, store_ops = counters
    launch.bufs = buf_array
    launch.loads, launch.stores, launch.load_ops, launch.store_ops = loads, stores, load_ops, store_ops
    launch.seed = seed
    launch.strict = int(strict)
    launch.nworkers = default_workers()
    launch.timeout_s = float(timeout)
    launch.cancel = 0
    name = kernel_name.encode()
    launch.kernel_name = name
    fn = build.load_runtime().kmsl_rt_launch
    fn.argtypes = [ctypes.POINTER(_Launch), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    result = {}

    def go():
        result["rc"] = fn(ctypes.byref(launch), entry)  # ctypes releases the GIL for the call

    t0 = time.perf_counter()
    worker = threading.Thread(target=go, name=f"kvmetal.sim {kernel_name}", daemon=True)
    worker.start()
    try:
        while worker.is_alive():
            worker.join(0.25)
    except KeyboardInterrupt:
        launch.cancel = 1  # the runtime stops at its next loop check
        # Wait for it even through more Ctrl-C: the native launch still writes into
        # buffers this frame owns, so leaving early could free them under it.
        while worker.is_alive():
            try:
                worker.join()
            except KeyboardInterrupt:
                pass
        raise
    seconds = time.perf_counter() - t0
    if result.get("rc", 7) != 0:
        raise BY_KIND.get(launch.err_kind, SimError)(launch.err_msg.decode(errors="replace"))
    traffic = {}
    for k, (tname, touched, written, span) in enumerate(bindings.traced):
        if tname is not None:
            traffic[tname] = BufferTraffic(
                loaded=int(loads[k]), stored=int(stores[k]), distinct_loaded=int(np.count_nonzero(touched[:span])),
                distinct_stored=int(np.count_nonzero(written[:span])), size=span, load_ops=int(load_ops[k]),
                store_ops=int(store_ops[k]))
    collectives = {name: int(v) for name, v in zip(_stat_names(0, NCOLLECTIVE), launch.stats.collectives)
                   if name and v}
    math = {name: int(v) for name, v in zip(_stat_names(1, NMATH), launch.stats.math) if name and v}
    return LaunchResult(traffic, int(launch.tg_memory), seconds, int(launch.stats.barriers), collectives, math)
