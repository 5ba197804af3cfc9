"""Exceptions raised by the simulator. Every one derives from SimError."""
from __future__ import annotations


class SimError(RuntimeError):
    """Base class: a simulated kernel call failed."""


class CompileError(SimError):
    """The kernel's MSL did not compile; the message quotes the offending MSL line."""


class OutOfBoundsError(SimError, IndexError):
    """A device or constant buffer was read or written outside its bounds."""


class MisalignedAccessError(SimError):
    """A device access was not aligned to its type (e.g. a half4 load at an odd offset)."""


class DivergentBarrierError(SimError):
    """threadgroup_barrier was not reached by every live thread of a threadgroup."""


class DivergentCollectiveError(SimError):
    """A simd collective was reached by part of a simdgroup under strict=True,
    or read an inactive lane."""


class ThreadgroupMemoryError(SimError):
    """Threadgroup memory exceeds Metal's 32 KiB."""


class ThreadgroupSizeError(SimError, ValueError):
    """A threadgroup has more than 1024 threads (Metal's limit)."""


class SimTimeoutError(SimError, TimeoutError):
    """The watchdog stopped a launch that ran past its time limit (an infinite
    loop?), or the launch was cancelled by Ctrl-C. See kvmetal.sim.trace(timeout=...)."""


class IntegerDivisionError(SimError, ZeroDivisionError):
    """A kernel divided an integer by zero (or INT_MIN by -1): SIGFPE on the CPU,
    undefined on the GPU. The message names the kernel and the thread."""


# Error kinds reported by the runtime (runtime/abi.h, KmslErrorKind).
BY_KIND = {
    1: OutOfBoundsError,
    2: DivergentBarrierError,
    3: DivergentCollectiveError,
    4: ThreadgroupMemoryError,
    5: ThreadgroupSizeError,
    6: MisalignedAccessError,
    7: SimError,
    8: SimTimeoutError,
    9: IntegerDivisionError,
}
