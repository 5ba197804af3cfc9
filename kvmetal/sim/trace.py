"""Recording simulated kernel calls: traffic counters and per-block options."""
from __future__ import annotations

import contextlib
import dataclasses
import threading

_state = threading.local()


@dataclasses.dataclass(frozen=True)
class BufferTraffic:
    """Bytes one kernel call moved through one device buffer."""

    loaded: int           # bytes loaded (every access counts)
    stored: int           # bytes stored
    distinct_loaded: int  # distinct bytes loaded at least once
    distinct_stored: int  # distinct bytes stored at least once
    size: int             # bytes the buffer spans


@dataclasses.dataclass(frozen=True)
class KernelCall:
    """One simulated kernel call."""

    name: str
    grid: tuple
    threadgroup: tuple
    buffers: dict          # input/output name -> BufferTraffic
    threadgroup_memory: int
    threads: int
    seconds: float         # wall time of the simulated run (excludes compilation)

    @property
    def loaded(self) -> int:
        return sum(b.loaded for b in self.buffers.values())

    @property
    def stored(self) -> int:
        return sum(b.stored for b in self.buffers.values())


class Trace:
    """Collects every simulated call made inside ``with kvmetal.sim.trace() as t``."""

    def __init__(self, strict, seed):
        self.strict = strict
        self.seed = seed
        self.calls: list = []

    def __repr__(self):
        return f"Trace({len(self.calls)} calls)"


def _stack() -> list:
    if not hasattr(_state, "stack"):
        _state.stack = []
    return _state.stack


@contextlib.contextmanager
def trace(*, strict: bool | None = None, seed: int | None = None):
    """Record simulated kernel calls; optionally set ``strict``/``seed`` for the block.

    Options given to a call override the block's; inner blocks override outer ones.
    """
    if strict is not None and not isinstance(strict, bool):
        raise TypeError(f"[kvmetal.sim.trace] strict must be a bool, got {type(strict).__name__}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or seed < 0):
        raise ValueError(f"[kvmetal.sim.trace] seed must be a non-negative int, got {seed!r}")
    t = Trace(strict, seed)
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


def record(call: KernelCall):
    for t in _stack():
        t.calls.append(call)
