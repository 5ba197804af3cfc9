"""The sim backend: the metal backend's kernel descriptions and launches (KernelBackend),
each kernel built by this simulator's ``metal_kernel`` instead of MLX's and run on the CPU.
``kvmetal.backends.get("sim")`` is :func:`sim_backend`."""
from __future__ import annotations

import functools
import threading

from .. import chips
from ..backends import metal_specs
from ..backends.metal import KernelBackend
from .kernel import metal_kernel

_backends = {}
_backends_lock = threading.Lock()


def sim_backend(macos: int | None = None) -> KernelBackend:
    """The kernels run by the CPU simulator, standing in for ``macos`` (default: this
    machine's, ``metal_specs.default_macos_version``; 15 off a Mac). Built once per
    process and macOS version."""
    macos = metal_specs.default_macos_version() if macos is None else int(macos)
    with _backends_lock:
        if macos not in _backends:
            # Refuses a launch past PIPELINE_THREAD_LIMIT, as an M1 pipeline of that size would.
            make = functools.partial(metal_kernel, macos=macos, max_threads_per_threadgroup=chips.PIPELINE_THREAD_LIMIT)
            _backends[macos] = KernelBackend("sim", make, macos=macos)
        return _backends[macos]
