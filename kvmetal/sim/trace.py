"""Recording simulated kernel calls: traffic and cost counters, per-block options."""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading

from ..chips import THREADS_PER_THREADGROUP_LIMIT

_state = threading.local()

# Watchdog limit per launch when neither the call nor a trace block sets one.
DEFAULT_TIMEOUT_S = 300.0

# Collective ops by kind (what `KernelCall.reductions` / `.shuffles` sum).
REDUCTIONS = ("simd_sum", "simd_product", "simd_max", "simd_min", "simd_and", "simd_or", "simd_xor",
              "quad_sum", "quad_product", "quad_max", "quad_min", "simd_prefix_inclusive_sum",
              "simd_prefix_exclusive_sum", "simd_prefix_inclusive_product", "simd_prefix_exclusive_product")
SHUFFLES = ("simd_shuffle", "simd_shuffle_xor", "simd_shuffle_up", "simd_shuffle_down", "simd_shuffle_rotate_down",
            "simd_shuffle_rotate_up", "simd_broadcast", "quad_shuffle", "quad_shuffle_xor", "quad_shuffle_up",
            "quad_shuffle_down", "quad_broadcast", "simd_broadcast_first")
MMAS = ("simdgroup_multiply_accumulate", "simdgroup_multiply")  # 8x8x8 simdgroup_matrix products
# A simd_shuffle whose lanes name different source lanes (runtime rt.cpp, shuffle_lanes): a
# permutation, an instruction sequence on Apple GPUs; "simd_shuffle" counts the uniform ones.
LANE_SHUFFLES = ("simd_shuffle_lanes",)
VOTES = ("simd_ballot", "simd_any", "simd_all")  # a ballot each


def _per_load(loaded: int, load_ops: int) -> float:
    """Bytes per load instruction (0 when nothing was loaded)."""
    return loaded / load_ops if load_ops else 0.0


@dataclasses.dataclass(frozen=True)
class BufferTraffic:
    """Bytes one kernel call moved through one device buffer."""

    loaded: int           # bytes loaded (every access counts)
    stored: int           # bytes stored
    distinct_loaded: int  # distinct bytes loaded at least once
    distinct_stored: int  # distinct bytes stored at least once
    size: int             # bytes the buffer spans
    load_ops: int = 0     # load instructions (one per access, whatever its width)
    store_ops: int = 0    # store instructions

    @property
    def bytes_per_load(self) -> float:
        return _per_load(self.loaded, self.load_ops)


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One simulated kernel call with its cost counters.

    Counting units: ``barriers`` counts each threadgroup_barrier once per
    threadgroup that executes it; ``collectives`` counts each simd/quad
    collective once per simdgroup execution and 32-bit word of its value (an
    instruction issue: a float2 shuffle is two, a float4 sum four), by op name;
    ``math`` counts transcendental calls once per lane and vector component,
    by function (divide by 32 for simdgroup instructions at full occupancy);
    load/store instructions are counted per lane access.
    """

    name: str
    grid: tuple
    threadgroup: tuple
    buffers: dict          # input/output name -> BufferTraffic
    threadgroup_memory: int
    threads: int
    seconds: float         # wall time of the simulated run (excludes compilation)
    barriers: int = 0
    collectives: dict = dataclasses.field(default_factory=dict)  # op name -> simdgroup executions
    math: dict = dataclasses.field(default_factory=dict)         # function name -> lane calls

    @property
    def loaded(self) -> int:
        return sum(b.loaded for b in self.buffers.values())

    @property
    def stored(self) -> int:
        return sum(b.stored for b in self.buffers.values())

    @property
    def threadgroups(self) -> int:
        count = 1
        for g, t in zip(self.grid, self.threadgroup):
            count *= -(-g // t) if g else 0
        return count

    @property
    def reductions(self) -> int:
        """simd_sum-class reductions (incl. prefix scans), simdgroup executions."""
        return sum(self.collectives.get(k, 0) for k in REDUCTIONS)

    @property
    def shuffles(self) -> int:
        """Shuffles and broadcasts, simdgroup executions."""
        return sum(self.collectives.get(k, 0) for k in SHUFFLES)

    @property
    def lane_shuffles(self) -> int:
        """simd_shuffles whose lanes read different lanes (LANE_SHUFFLES), simdgroup executions."""
        return sum(self.collectives.get(k, 0) for k in LANE_SHUFFLES)

    @property
    def votes(self) -> int:
        """simd_any / simd_all / simd_ballot (VOTES), simdgroup executions."""
        return sum(self.collectives.get(k, 0) for k in VOTES)

    @property
    def mma(self) -> int:
        """8x8x8 simdgroup_matrix multiplies (with or without accumulate), simdgroup executions."""
        return sum(self.collectives.get(k, 0) for k in MMAS)

    @property
    def transcendentals(self) -> int:
        """Transcendental calls, lane count (see the class doc)."""
        return sum(self.math.values())

    def bytes_per_load(self, *names: str) -> float:
        """Bytes per load instruction over the named buffers (all buffers if none given)."""
        bufs = [self.buffers[n] for n in names] if names else list(self.buffers.values())
        return _per_load(sum(b.loaded for b in bufs), sum(b.load_ops for b in bufs))


class Trace:
    """Collects every simulated call made inside ``with kvmetal.sim.trace() as t``."""

    def __init__(self, strict, seed, timeout=None, max_threads_per_threadgroup=None):
        self.strict = strict
        self.seed = seed
        self.timeout = timeout
        self.max_threads_per_threadgroup = max_threads_per_threadgroup
        self.calls: list = []

    def __repr__(self):
        return f"Trace({len(self.calls)} calls)"


def _stack() -> list:
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


@contextlib.contextmanager
def trace(*, strict: bool | None = None, seed: int | None = None, timeout: float | None = None,
          max_threads_per_threadgroup: int | None = None):
    """Record simulated kernel calls; optionally set ``strict``/``seed``/``timeout`` for the block.

    ``timeout`` is the watchdog's limit in seconds per launch: a launch that runs
    longer (an infinite loop) raises ``SimTimeoutError``. Default: the
    ``KVMETAL_SIM_TIMEOUT`` environment variable, else DEFAULT_TIMEOUT_S; 0 turns it off.
    ``max_threads_per_threadgroup`` models a pipeline whose
    ``maxTotalThreadsPerThreadgroup`` is below the device's 1024 (Apple lowers it
    for register-heavy kernels): a launch with a larger threadgroup raises
    ``ThreadgroupSizeError``, as MLX does. Options given to a call override the
    block's; inner blocks override outer ones.
    """
    if strict is not None and not isinstance(strict, bool):
        raise TypeError(f"[kvmetal.sim.trace] strict must be a bool, got {type(strict).__name__}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"[kvmetal.sim.trace] seed must be a non-negative int, got {seed!r}")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                or not timeout >= 0):
        raise ValueError(f"[kvmetal.sim.trace] timeout must be a number of seconds >= 0, got {timeout!r}")
    if max_threads_per_threadgroup is not None and (
            isinstance(max_threads_per_threadgroup, bool) or not isinstance(max_threads_per_threadgroup, int)
            or not 1 <= max_threads_per_threadgroup <= THREADS_PER_THREADGROUP_LIMIT):
        raise ValueError(f"[kvmetal.sim.trace] max_threads_per_threadgroup must be an int in "
                         f"[1, {THREADS_PER_THREADGROUP_LIMIT}], got {max_threads_per_threadgroup!r}")
    t = Trace(strict, seed, timeout, max_threads_per_threadgroup)
    _stack().append(t)
    try:
        yield t
    finally:
        _stack().remove(t)


def options(strict, seed) -> tuple:
    """The effective (strict, seed): the call's own, else the innermost trace block's."""
    for t in reversed(_stack()):
        if strict is None and t.strict is not None:
            strict = t.strict
        if seed is None and t.seed is not None:
            seed = t.seed
    return bool(strict), int(seed or 0)


def timeout() -> float:
    """The effective watchdog limit in seconds (0: none)."""
    for t in reversed(_stack()):
        if t.timeout is not None:
            return float(t.timeout)
    env = os.environ.get("KVMETAL_SIM_TIMEOUT")
    return float(env) if env else DEFAULT_TIMEOUT_S


def max_threads_per_threadgroup() -> int:
    """The simulated pipeline's maxTotalThreadsPerThreadgroup: the innermost block's, else Metal's 1024."""
    for t in reversed(_stack()):
        if t.max_threads_per_threadgroup is not None:
            return t.max_threads_per_threadgroup
    return THREADS_PER_THREADGROUP_LIMIT


def record(call: KernelCall):
    for t in _stack():
        t.calls.append(call)
