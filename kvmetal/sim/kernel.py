"""kvmetal.sim.metal_kernel: a drop-in for mx.fast.metal_kernel that runs on the CPU."""
from __future__ import annotations

import ctypes

import mlx.core as mx
import numpy as np

from . import build, launch, signature, trace as trace_mod, translate
from .errors import CompileError, ThreadgroupSizeError
from ..chips import THREADS_PER_THREADGROUP_LIMIT

_MATH_MODES = ("safe", "relaxed", "fast")
# The macOS version the simulator stands in for unless a kernel is given one:
# MLX's "relaxed" math mode needs macOS 15 (MTLCompileOptions.mathMode).
DEFAULT_MACOS = 15
RELAXED_MATH_MIN_MACOS = 15


def _as_input(x, name: str) -> mx.array:
    if isinstance(x, mx.array):
        return x
    if isinstance(x, (bool, int, float)):
        return mx.array(x)
    raise TypeError(f"[metal_kernel] input '{name}' must be an mx.array or a Python scalar, got {type(x).__name__}")


def _triple(v, what: str, minimum: int) -> tuple:
    if not isinstance(v, (tuple, list)) or len(v) != 3 or not all(
            isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise TypeError(f"[metal_kernel] {what} must be a tuple of 3 ints, got {v!r}")
    if any(x < minimum for x in v):
        raise ValueError(f"[metal_kernel] {what} entries must be >= {minimum}, got {v!r}")
    return tuple(v)


def _check_template(template) -> list:
    out = []
    for item in template or []:
        if not isinstance(item, (tuple, list)) or len(item) != 2 or not isinstance(item[0], str):
            raise ValueError(f"[metal_kernel] template entries must be (name, value) pairs, got {item!r}")
        name, value = item
        if not isinstance(value, (bool, int, mx.Dtype)):
            raise ValueError("[metal_kernel] Invalid template argument. Must be `mlx.core.Dtype`, `int` or `bool`.")
        out.append((name, value))
    return out


class SimKernel:
    """What kvmetal.sim.metal_kernel returns; call it like an mx.fast.metal_kernel object."""

    def __init__(self, name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None, *, macos=None, max_threads_per_threadgroup=None):
        if not isinstance(name, str) or not name:
            raise ValueError("[metal_kernel] name must be a non-empty string")
        if not output_names:
            raise ValueError("[metal_kernel] Must specify at least one output.")
        mode = dict(compile_options or {}).get("math_mode", "safe")
        if mode not in _MATH_MODES:
            raise ValueError(f"[metal_kernel] Invalid Metal math mode {mode!r}")
        if macos is not None and (isinstance(macos, bool) or not isinstance(macos, int) or macos < 1):
            raise ValueError(f"[metal_kernel] macos must be a positive int (a macOS major version), got {macos!r}")
        if max_threads_per_threadgroup is not None and (
                isinstance(max_threads_per_threadgroup, bool) or not isinstance(max_threads_per_threadgroup, int)
                or not 1 <= max_threads_per_threadgroup <= THREADS_PER_THREADGROUP_LIMIT):
            raise ValueError(f"[metal_kernel] max_threads_per_threadgroup must be an int in "
                             f"[1, {THREADS_PER_THREADGROUP_LIMIT}], got {max_threads_per_threadgroup!r}")
        self.math_mode = mode
        self.macos = DEFAULT_MACOS if macos is None else macos
        self.max_threads_per_threadgroup = max_threads_per_threadgroup or THREADS_PER_THREADGROUP_LIMIT
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.ensure_row_contiguous = bool(ensure_row_contiguous)
        self.atomic_outputs = bool(atomic_outputs)
        self.compile_options = compile_options
        self._shape_infos = signature.shape_infos(source, self.input_names)
        self._attrs = signature.attributes(source)
        self._variants: dict = {}

    # -- source generation -------------------------------------------------
    def metal_source(self, specs, output_dtypes, template) -> tuple:
        """(kernel function name, the Metal source MLX would compile) for one variant."""
        fname = signature.kernel_name(self.name, specs, output_dtypes, template)
        src = signature.write_source(fname, self.header, self.source, specs, self.output_names, output_dtypes,
                                     template, self._attrs, self._shape_infos, self.atomic_outputs)
        return fname, src

    def _params(self, specs, output_dtypes) -> list:
        params = []
        for spec, info in zip(specs, self._shape_infos):
            ctype = signature.type_string(spec.dtype)
            # MLX binds inputs under 8 elements, and the shape/strides buffers, as `constant`.
            params.append(("scalar" if spec.is_scalar else "cptr" if spec.is_constant else "ptr", ctype))
            if spec.ndim > 0:
                if info[0]:
                    params.append(("cptr", "int"))
                if info[1]:
                    params.append(("cptr", "int64_t"))
                if info[2]:
                    params.append(("scalar", "int"))
        for dt in output_dtypes:
            t = signature.type_string(dt)
            params.append(("out", f"metal::atomic<{t}>" if self.atomic_outputs else t))
        return params

    def _variant(self, specs, output_dtypes, template):
        fname, msl = self.metal_source(specs, output_dtypes, template)
        hit = self._variants.get(fname)
        if hit is None:
            if self.math_mode == "relaxed" and self.macos < RELAXED_MATH_MIN_MACOS:
                # What MLX does when it builds the library on an older macOS.
                raise ValueError(f"[metal_kernel {self.name}] math_mode 'relaxed' requires macOS "
                                 f"{RELAXED_MATH_MIN_MACOS} or newer (simulating macOS {self.macos})")
            file_name = f"{fname}.metal"
            try:
                # Under "relaxed" and "fast" Metal's math functions are the fast ones.
                cpp = translate.cpp_source(msl, fname, self._params(specs, output_dtypes), template, self._attrs,
                                           file_name=file_name, fast_math=self.math_mode != "safe")
            except translate.UnsupportedMSL as e:
                raise CompileError(f"[metal_kernel {self.name}] {e}\n  MSL line {e.line}: "
                                   f"{msl.splitlines()[e.line - 1].strip()}") from None
            lib = build.load_kernel(cpp, what=f"metal_kernel {self.name}", file_name=file_name, msl=msl)
            hit = (fname, msl, ctypes.cast(lib.kmsl_entry, ctypes.c_void_p).value, lib)
            self._variants[fname] = hit
        return hit

    # -- the call ----------------------------------------------------------
    def __call__(self, *, inputs, output_shapes, output_dtypes, grid, threadgroup, template=None, init_value=None,
                 verbose=False, stream=None, strict=None, seed=None):
        if len(inputs) != len(self.input_names):
            raise ValueError(f"[metal_kernel] Expected `inputs` to have size {len(self.input_names)} "
                             f"but got size {len(inputs)}.")
        if len(output_shapes) != len(self.output_names):
            raise ValueError(f"[metal_kernel] Expected `output_shapes` to have size {len(self.output_names)} "
                             f"but got size {len(output_shapes)}.")
        if len(output_dtypes) != len(self.output_names):
            raise ValueError(f"[metal_kernel] Expected `output_dtypes` to have size {len(self.output_names)} "
                             f"but got size {len(output_dtypes)}.")
        grid = _triple(grid, "grid", 0)
        threadgroup = _triple(threadgroup, "threadgroup", 1)
        template = _check_template(template)
        strict, seed = trace_mod.options(strict, seed)
        arrays = [_as_input(x, n) for x, n in zip(inputs, self.input_names)]
        specs = [signature.InputSpec(n, a.dtype, a.ndim, a.size) for n, a in zip(self.input_names, arrays)]
        output_dtypes = list(output_dtypes)
        fname, msl, entry, _lib = self._variant(specs, output_dtypes, template)
        if verbose:
            print(f"Generated source code for `{self.name}`:\n```\n{msl}\n```", flush=True)

        tg_threads = threadgroup[0] * threadgroup[1] * threadgroup[2]
        # The pipeline's maxTotalThreadsPerThreadgroup: the kernel's own, lowered by a trace block's.
        limit = min(self.max_threads_per_threadgroup, trace_mod.max_threads_per_threadgroup())
        if tg_threads > limit:
            raise ThreadgroupSizeError(
                f"[metal_kernel] Thread group size ({tg_threads}) is greater than the maximum allowed threads per "
                f"threadgroup ({limit}) in kernel {self.name}.")
        group = tuple(min(t, g) if g > 0 else t for t, g in zip(threadgroup, grid))

        # Bind buffers in MLX's order: each input, then its shape/strides/ndim, then outputs.
        bindings = launch.Bindings()
        for a, spec, info in zip(arrays, specs, self._shape_infos):
            h = launch.host_view(a, self.ensure_row_contiguous)
            bindings.add(h, spec.name, spec.name)
            if spec.ndim > 0:
                if info[0]:
                    bindings.add(np.asarray(h.shape, np.int32), spec.name + "_shape")
                if info[1]:
                    bindings.add(np.asarray([s // h.itemsize for s in h.strides], np.int64), spec.name + "_strides")
                if info[2]:
                    bindings.add(np.asarray(h.ndim, np.int32), spec.name + "_ndim")
        outs = []
        for oname, shape, dt in zip(self.output_names, output_shapes, output_dtypes):
            h = launch.new_output(tuple(int(s) for s in shape), dt, init_value)
            outs.append((h, dt))
            bindings.add(h, oname, oname)

        res = launch.run(entry, bindings, grid=grid, threadgroup=group, seed=seed, strict=strict,
                         kernel_name=self.name, timeout=trace_mod.timeout())
        trace_mod.record(trace_mod.KernelCall(
            name=self.name, grid=grid, threadgroup=group, buffers=res.traffic, threadgroup_memory=res.tg_memory,
            threads=grid[0] * grid[1] * grid[2], seconds=res.seconds, barriers=res.barriers,
            collectives=res.collectives, math=res.math))
        return [launch.to_mx(h, dt) for h, dt in outs]


def metal_kernel(name, input_names, output_names, source, header="", ensure_row_contiguous=True,
                 atomic_outputs=False, compile_options=None, *, macos=None,
                 max_threads_per_threadgroup=None) -> SimKernel:
    """Same signature as ``mx.fast.metal_kernel``; the kernel runs on the CPU simulator.

    Calling the result takes MLX's keyword arguments (``inputs, output_shapes,
    output_dtypes, grid, threadgroup, template, init_value, verbose, stream``)
    plus the simulator's ``strict`` and ``seed`` (defaults from
    ``kvmetal.sim.trace``), and returns a list of ``mx.array``. ``macos`` (a
    simulator extension) is the macOS major version to stand in for (default
    DEFAULT_MACOS): below 15 ``math_mode="relaxed"`` fails as it does in MLX.
    ``max_threads_per_threadgroup`` (also a simulator extension; default Metal's 1024)
    is the pipeline's maxTotalThreadsPerThreadgroup: a larger launch raises
    ``ThreadgroupSizeError`` as MLX does.
    """
    return SimKernel(name, input_names, output_names, source, header, ensure_row_contiguous, atomic_outputs,
                     compile_options, macos=macos, max_threads_per_threadgroup=max_threads_per_threadgroup)
