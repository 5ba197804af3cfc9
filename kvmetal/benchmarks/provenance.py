"""Where a benchmark ran: versions, CPU or chip, threads. Goes into every JSON report."""
from __future__ import annotations

import os
import platform
import subprocess
from importlib import metadata

import mlx.core as mx


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cpu_name() -> str:
    """The CPU's marketing name (Linux /proc/cpuinfo, macOS sysctl), else platform's guess."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.lower().startswith(("model name", "hardware", "cpu model")):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    if platform.system() == "Darwin":
        try:
            return subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                  timeout=5).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    return platform.processor() or platform.machine()


def provenance(backend: str) -> dict:
    from .. import __version__

    threads = {"os_cpu_count": os.cpu_count(), "kvmetal_cpu": None, "simd": None}
    try:
        from .. import _ext

        threads["kvmetal_cpu"] = _ext.num_threads()
        threads["simd"] = _ext.simd_level()
    except ImportError:
        pass
    from ..chips import metal_device_info

    gpu = metal_device_info().get("device_name")
    return {
        "versions": {"kvmetal": __version__, "mlx": mx.__version__, "mlx-lm": _version("mlx-lm"),
                     "numpy": _version("numpy"), "python": platform.python_version()},
        "machine": {"platform": platform.platform(), "processor": platform.machine(), "cpu": cpu_name(),
                    "gpu": gpu, "metal": mx.metal.is_available()},
        "threads": threads,
        "backend": backend,
        # The Metal tuning variables this run was given (KVMETAL_METAL_SPLITS, _WINDOW_DIV,
        # _WINDOW_GROWTH, _WINDOW_SIMDGROUPS, _TILE_KIB, _PARTIALS; docs/kernels.md): runs
        # compared on a Mac say which is which.
        "tuning": {k: v for k, v in sorted(os.environ.items()) if k.startswith("KVMETAL_METAL_")},
    }
