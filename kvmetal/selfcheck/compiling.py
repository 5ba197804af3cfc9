"""Compile: build every kernel specialisation of every family, one at a time.

The kernels are built by the metal backend's own code (``KernelBackend``) with a
``make_kernel`` that wraps MLX's ``mx.fast.metal_kernel`` (or, off a Mac, the
simulator's build of the same call). The wrapper runs each specialisation on its
own: its inputs are evaluated first, then the kernel alone is built and evaluated,
so a failure is caught at that specialisation, recorded with its name and the
compiler's message, and replaced by zero outputs, and the rest of the op (the
reduce kernel after a failed partials kernel, say) and every other family go on.
"""
from __future__ import annotations

import contextlib
import math
import re
import time
import traceback
from dataclasses import dataclass, field
from typing import Callable

import mlx.core as mx

from .. import backends
from ..backends import metal, metal_specs
from .families import Family, flat_arrays

MESSAGE_LIMIT = 4000  # characters of a compiler message kept in the report


def _message(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) <= MESSAGE_LIMIT else text[:MESSAGE_LIMIT] + " ..."


def kernel_of(variant: str) -> str:
    """The SPECS name of a variant name such as ``kvmetal_attention_reduce_tqf16_tpf16_d128_has_sinks1``."""
    for name in sorted(metal_specs.SPECS, key=len, reverse=True):
        if variant.startswith(f"kvmetal_{name}_") or variant == f"kvmetal_{name}":
            return name
    return variant


@dataclass
class Ledger:
    """Per specialisation: the family that first built it, its kernel, status, seconds and error."""

    family: str = ""
    specialisations: dict = field(default_factory=dict)   # variant -> record
    path_errors: list = field(default_factory=list)       # errors outside any kernel

    def record(self, variant: str, *, ok: bool, seconds: float, math_mode: str | None, error: str | None = None,
               threads: int | None = None):
        limit = _THREAD_LIMIT.search(error or "")
        self.specialisations[variant] = {"name": variant, "kernel": kernel_of(variant), "family": self.family,
                                         "status": "ok" if ok else "failed", "seconds": round(seconds, 4),
                                         "math_mode": math_mode, "error": error, "threads": threads,
                                         # The pipeline's maxTotalThreadsPerThreadgroup, where MLX refused the launch.
                                         "max_threads": int(limit.group(2)) if limit else None}

    def failed(self, variant: str) -> bool:
        rec = self.specialisations.get(variant)
        return rec is not None and rec["status"] == "failed"


# MLX's refusal of a launch past the pipeline's maxTotalThreadsPerThreadgroup.
_THREAD_LIMIT = re.compile(r"Thread group size \((\d+)\) is greater than the maximum allowed threads per "
                           r"threadgroup \((\d+)\)")


class IsolatedKernel:
    """One specialisation's kernel object: the first call builds and evaluates it alone."""

    def __init__(self, variant: str, build: Callable, ledger: Ledger, math_mode: str | None = None):
        self.variant = variant
        self.math_mode = math_mode
        self._build = build
        self._kernel = None
        self._ledger = ledger

    def __call__(self, *, inputs, output_shapes, output_dtypes, **kwargs):
        if not self._ledger.failed(self.variant):
            mx.eval(*inputs)  # so that the evaluation below builds and runs this kernel only
            start = time.perf_counter()
            threads = math.prod(kwargs["threadgroup"]) if "threadgroup" in kwargs else None
            try:
                if self._kernel is None:
                    self._kernel = self._build()
                outs = self._kernel(inputs=inputs, output_shapes=output_shapes, output_dtypes=output_dtypes,
                                    **kwargs)
                mx.eval(*outs)
            except Exception as exc:  # noqa: BLE001 - any failure of this one specialisation is the finding
                self._ledger.record(self.variant, ok=False, seconds=time.perf_counter() - start,
                                    math_mode=self.math_mode, error=_message(exc), threads=threads)
            else:
                if self.variant not in self._ledger.specialisations:
                    self._ledger.record(self.variant, ok=True, seconds=time.perf_counter() - start,
                                        math_mode=self.math_mode, threads=threads)
                return outs
        # Stand-in outputs let the rest of the op run (and build its other kernels).
        return [mx.zeros(tuple(shape), dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]


def isolating(make_kernel: Callable, ledger: Ledger, source_hook: Callable | None = None) -> Callable:
    """A ``make_kernel`` for KernelBackend whose kernels record into ``ledger``.

    ``source_hook(variant, source) -> source`` rewrites one specialisation's body
    before it is built (the tests break one kernel on purpose with it)."""
    def make(*, name, source, **kwargs):
        if source_hook is not None:
            source = source_hook(name, source)
        mode = (kwargs.get("compile_options") or {}).get("math_mode")
        return IsolatedKernel(name, lambda: make_kernel(name=name, source=source, **kwargs), ledger, mode)
    return make


@contextlib.contextmanager
def routed_to(kernel_backend):
    """kvmetal.ops dispatch to ``kernel_backend`` inside the block (they call
    ``kvmetal.backends.get()`` at each call): the public ops, with their argument
    checks, run on the isolating kernels. Single-threaded use only."""
    original = backends.get
    backends.get = lambda name=None: kernel_backend
    try:
        yield
    finally:
        backends.get = original


def make_kernel_for(backend: str) -> Callable:
    """MLX's compiler on a Mac; the simulator's build of the same call elsewhere."""
    if backend == "metal":
        return mx.fast.metal_kernel
    from .. import sim

    return sim.metal_kernel


def compile_all(families: list, *, backend: str, source_hook: Callable | None = None, progress=None) -> dict:
    """Build every specialisation of every family on ``backend`` ("metal" or "sim").

    Returns the report's ``compile`` section: families (with the paths traced and the
    specialisations each built), specialisations (name, kernel, status, seconds,
    error) and the count of failures."""
    ledger = Ledger()
    kernels = metal.KernelBackend(f"selfcheck-{backend}", isolating(make_kernel_for(backend), ledger, source_hook))
    start = time.perf_counter()
    families_out = []
    for i, family in enumerate(families, 1):
        family = family if hasattr(family, "paths") else Family.from_params(family)
        ledger.family = family.name
        before = set(ledger.specialisations)
        paths = {}
        try:
            traced = family.paths()
        except Exception as exc:  # noqa: BLE001 - a family whose inputs cannot even be built
            traced = []
            ledger.path_errors.append({"family": family.name, "path": "inputs", "error": _message(exc)})
        for path, thunk in traced:
            try:
                with routed_to(kernels):
                    mx.eval(*flat_arrays(thunk()))
                paths[path] = "ok"
            except Exception as exc:  # noqa: BLE001 - host code between kernels failed: report, go on
                paths[path] = "failed"
                ledger.path_errors.append({"family": family.name, "path": path, "error": _message(exc),
                                           "where": traceback.format_exc(limit=-3)[-MESSAGE_LIMIT:]})
        built = [v for v in ledger.specialisations if v not in before]
        failed = [v for v in built if ledger.failed(v)]
        families_out.append({**family.as_dict(), "paths": paths, "specialisations": built, "failed": failed})
        if progress:
            status = f"{len(failed)} FAILED" if failed else "ok"
            progress(f"  [{i}/{len(families)}] {family.name}: {len(built)} new specialisations, {status}")
    specs = list(ledger.specialisations.values())
    failures = sum(s["status"] == "failed" for s in specs) + len(ledger.path_errors)
    return {"backend": backend, "families": families_out, "specialisations": specs,
            "path_errors": ledger.path_errors, "failed": failures, "seconds": round(time.perf_counter() - start, 3)}

