"""kvmetal.sim: run mx.fast.metal_kernel calls on the CPU (Linux CI, no GPU).

``kvmetal.sim.metal_kernel`` has the signature of ``mx.fast.metal_kernel``.
The kernel's MSL is compiled as C++ against a compatibility header; each Metal
thread runs as a fiber, threadgroups are spread over OS threads, simd
collectives and barriers follow Metal's rules, and device accesses are bounds
checked and counted. See docs/simulator.md.
"""
from .errors import (CompileError, DivergentBarrierError, DivergentCollectiveError, IntegerDivisionError,
                     MisalignedAccessError, OutOfBoundsError, SimError, SimTimeoutError, ThreadgroupMemoryError,
                     ThreadgroupSizeError)
from .kernel import SimKernel, metal_kernel
from .trace import BufferTraffic, KernelCall, Trace, trace

__all__ = [
    "metal_kernel", "trace", "SimKernel", "Trace", "KernelCall", "BufferTraffic",
    "SimError", "CompileError", "OutOfBoundsError", "MisalignedAccessError", "DivergentBarrierError",
    "DivergentCollectiveError", "ThreadgroupMemoryError", "ThreadgroupSizeError", "SimTimeoutError",
    "IntegerDivisionError",
]
