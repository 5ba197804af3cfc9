"""Apple M-series chips: peak memory bandwidth, unified memory sizes and GPU cores.

One table for everyone who needs chip facts: ``kvmetal budget`` (decode floors and
what fits), the metal backend (split counts from GPU cores) and ``kvmetal bench``
(fraction of peak bandwidth). Figures are Apple's published ones for each
configuration; binned variants that differ in bandwidth are listed separately.
"""
from __future__ import annotations

from dataclasses import dataclass

# Metal's per-threadgroup limits, the same on every M-series GPU. Defined here
# once: the metal backend's launch plans stay within them (tests/test_metal_limits.py)
# and the simulator enforces them (kvmetal/sim/kernel.py; kvmetal/sim/build.py
# passes the memory limit to its runtime, rt.cpp, as a compile-time define).
THREADGROUP_MEMORY_LIMIT = 32 * 1024
THREADS_PER_THREADGROUP_LIMIT = 1024
# What kvmetal's own kernels launch at most. An Apple GPU thread has up to 128 32-bit
# registers (256 16-bit halves); past them the compiler spills to memory. The more
# registers a pipeline's lanes use, the fewer threads a threadgroup may have: Apple lowers
# maxTotalThreadsPerThreadgroup below 1024, M1/M2 report 384 for a pipeline at the full
# 128, and MLX then refuses a larger launch ("Thread group size ... is greater than the
# maximum allowed"). Every specialisation launches at most 384 threads, and the decode
# family's layouts keep every lane's estimated live registers within 128
# (kvmetal/backends/metal_layout.py, docs/kernels.md), so the limit a Mac reports can never
# be below what we launch; the sim backend refuses larger launches as such a pipeline would.
PIPELINE_THREAD_LIMIT = 384
PIPELINE_REGISTER_LIMIT = 128


def max_threads_for_registers(registers: int) -> int:
    """The threads per threadgroup a pipeline of ``registers`` live 32-bit registers per
    lane is assumed to allow: the register file that gives PIPELINE_THREAD_LIMIT (384)
    threads at PIPELINE_REGISTER_LIMIT (128, all a thread has), in whole simdgroups, at
    most Metal's 1024 (1024 threads at up to 48 registers). Past 128 the count keeps
    falling, a conservative stand-in for a pipeline that spills. A model, not Apple's
    formula: ``kvmetal selfcheck`` on a Mac reports the real limit."""
    per_threadgroup = PIPELINE_THREAD_LIMIT * PIPELINE_REGISTER_LIMIT
    return max(32, min(THREADS_PER_THREADGROUP_LIMIT, per_threadgroup // max(registers, 1) // 32 * 32))


def metal_device_info() -> dict:
    """MLX's description of the Apple GPU, {} without one. ``mx.device_info(mx.gpu)`` where MLX
    has it (MLX 0.32.4 says ``mx.metal.device_info`` is deprecated), else the old call."""
    import mlx.core as mx

    if not mx.metal.is_available():
        return {}
    if hasattr(mx, "device_info"):
        return mx.device_info(mx.gpu)
    return mx.metal.device_info()


def _is_core_count(tag: str) -> bool:  # "30c": a binned variant's GPU core count
    return tag.endswith("c") and tag[:-1].isdigit()


@dataclass(frozen=True)
class Chip:
    name: str                   # slug, e.g. "m3-max"; binned parts add the core count
    bandwidth_gbs: float        # peak memory bandwidth, decimal GB/s
    memory_gib: tuple           # unified memory configurations, GiB
    gpu_cores: int

    @property
    def device_name(self) -> str:
        """The name ``metal_device_info()["device_name"]`` reports for this chip."""
        family, *tier = self.name.split("-")
        tier = [t for t in tier if not _is_core_count(t)]
        return " ".join(["Apple", family.upper(), *(t.capitalize() for t in tier)])


CHIPS = {c.name: c for c in (
    Chip("m1", 68.25, (8, 16), 8),
    Chip("m1-pro", 200, (16, 32), 16),
    Chip("m1-max", 400, (32, 64), 32),
    Chip("m1-ultra", 800, (64, 128), 64),
    Chip("m2", 100, (8, 16, 24), 10),
    Chip("m2-pro", 200, (16, 32), 19),
    Chip("m2-max", 400, (32, 64, 96), 38),
    Chip("m2-ultra", 800, (64, 128, 192), 76),
    Chip("m3", 100, (8, 16, 24), 10),
    Chip("m3-pro", 150, (18, 36), 18),
    Chip("m3-max-30c", 300, (36, 96), 30),
    Chip("m3-max", 400, (48, 64, 128), 40),
    Chip("m3-ultra", 819, (96, 256, 512), 80),
    Chip("m4", 120, (16, 24, 32), 10),
    Chip("m4-pro", 273, (24, 48, 64), 20),
    Chip("m4-max-32c", 410, (36,), 32),
    Chip("m4-max", 546, (48, 64, 128), 40),
    Chip("m5", 153, (16, 24, 32), 10),
)}


def from_device_name(device_name: str) -> Chip | None:
    """The full (unbinned) configuration of the chip MLX reports, or None if unknown."""
    wanted = str(device_name).strip()
    for chip in CHIPS.values():
        if chip.device_name == wanted and not _is_core_count(chip.name.split("-")[-1]):
            return chip
    return None
