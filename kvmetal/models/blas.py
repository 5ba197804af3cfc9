"""Which BLAS MLX's float32 matmuls run on (Linux), and switching them to OpenBLAS.

MLX's Linux CPU wheel links the reference (netlib) BLAS: float32 matmuls run at a few
GFLOPS. float16, bfloat16 and quantized matmuls never go through BLAS.

kvmetal depends on the ``scipy-openblas32`` wheel on Linux (OpenBLAS built for Python
packages, every symbol renamed ``scipy_*``) and builds a small library,
``libkvmetal_openblas.so`` (bindings/blas_shim/), that exports MLX's three ``cblas_*gemm``
symbols and forwards them there. :func:`use_openblas` loads both into the process's
global scope; the dynamic linker looks there before libmlx's own dependencies, so it must
run before ``mlx.core`` is first imported. The ``kvmetal`` command does it before it
imports anything else, for every subcommand (``KVMETAL_NO_OPENBLAS=1`` keeps the
reference BLAS); a script calls it first thing, or runs under ``LD_PRELOAD`` with
:func:`preload_value`.
"""
from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import platform
import sys
from pathlib import Path

SHIM_NAME = "libkvmetal_openblas.so"
OPT_OUT = "KVMETAL_NO_OPENBLAS"
# Debian's libopenblas0-pthread exports the plain cblas names: an LD_PRELOAD of it works alone.
_SYSTEM_OPENBLAS_GLOBS = ("/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0", "/usr/lib/*/libopenblas.so.0",
                          "/usr/lib64/libopenblas*.so.0")


def openblas_library() -> str | None:
    """The OpenBLAS shared library ``libopenblas0-pthread`` installs, if present."""
    for pattern in _SYSTEM_OPENBLAS_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


def wheel_openblas() -> str | None:
    """``libscipy_openblas*.so`` of the installed scipy-openblas32 (else -64) wheel,
    found without importing anything."""
    for package in ("scipy_openblas32", "scipy_openblas64"):
        try:
            spec = importlib.util.find_spec(package)
        except (ImportError, ValueError):
            spec = None
        for where in (spec.submodule_search_locations or []) if spec else []:
            found = sorted(glob.glob(os.path.join(where, "lib", "libscipy_openblas*.so")))
            if found:
                return found[0]
    return None


def shim_library() -> str | None:
    """``libkvmetal_openblas.so``, installed next to kvmetal's extension (or built in a source tree)."""
    places = [Path(__file__).resolve().parent.parent]
    try:
        spec = importlib.util.find_spec("kvmetal._ext")  # an editable install keeps it in site-packages
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin:
        places.insert(0, Path(spec.origin).parent)
    for place in places:
        if (place / SHIM_NAME).is_file():
            return str(place / SHIM_NAME)
    return None


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p), ("dli_sname", ctypes.c_char_p),
                ("dli_saddr", ctypes.c_void_p)]


def sgemm_provider() -> str | None:
    """The library that serves ``cblas_sgemm`` from the process's global scope (an
    ``LD_PRELOAD`` or :func:`use_openblas` puts one there), or None when none does: then
    MLX's matmuls resolve to the BLAS its wheel bundles (loaded privately, next to libmlx)."""
    try:
        libc = ctypes.CDLL(None)
        address = ctypes.cast(libc.cblas_sgemm, ctypes.c_void_p).value
    except (AttributeError, OSError):
        return None
    info = _DlInfo()
    libc.dladdr.argtypes = [ctypes.c_void_p, ctypes.POINTER(_DlInfo)]
    if not libc.dladdr(ctypes.c_void_p(address), ctypes.byref(info)) or not info.dli_fname:
        return None
    return os.fsdecode(info.dli_fname)


def fast_blas_loaded() -> bool | None:
    """True when an optimised BLAS serves MLX's float32 matmuls; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    provider = sgemm_provider()
    return provider is not None and "mlx_cpu.libs" not in provider


def use_openblas() -> str | None:
    """Make MLX's float32 matmuls run on scipy-openblas32's OpenBLAS, in this process.

    Loads the wheel's library and ``libkvmetal_openblas.so`` into the global scope. Only
    takes effect before ``mlx.core`` is imported (libmlx binds its BLAS when it loads);
    does nothing off Linux, under ``KVMETAL_NO_OPENBLAS=1``, when an optimised BLAS is
    already global (an ``LD_PRELOAD``), or when either library is missing. Returns the
    OpenBLAS library now in use, else None."""
    if not sys.platform.startswith("linux") or os.environ.get(OPT_OUT) == "1" or "mlx.core" in sys.modules:
        return None
    provider = sgemm_provider()
    if provider is not None:
        return provider
    lib, shim = wheel_openblas(), shim_library()
    if lib is None or shim is None:
        return None
    for name, value in invariant_kernel_env().items():
        os.environ.setdefault(name, value)  # read by OpenBLAS when it loads
    try:
        openblas = ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        # Local first: a shim that found no OpenBLAS must never serve libmlx's symbols.
        if not ctypes.CDLL(shim, mode=ctypes.RTLD_LOCAL).kvmetal_openblas_ready():
            return None
        ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL)
    except (OSError, AttributeError):
        return None
    if not any(os.environ.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
        for name in ("scipy_openblas_set_num_threads", "scipy_openblas_set_num_threads64_"):
            if hasattr(openblas, name):
                getattr(openblas, name)(default_threads())
                break
    return lib


def invariant_kernel_env() -> dict:
    """``OPENBLAS_CORETYPE=Sandybridge`` on an x86 CPU without AVX-512, unless set.

    There OpenBLAS picks its Haswell sgemm kernel (Intel AVX2, every AMD Zen), whose
    12-row micro-tile computes rows 0-5 and 6-11 in other instruction orders: a row's
    bits depend on its place in the call (measured on an AMD EPYC: every row of a
    48-row product at an offset of 6 differed), so no padding makes a request's rows
    the same alone and in a batch. The Sandybridge kernel rounds a row the same at every
    place (tests/test_blas.py); the AVX-512 kernel did too, so those CPUs keep it."""
    if os.environ.get("OPENBLAS_CORETYPE") or platform.machine() not in ("x86_64", "AMD64"):
        return {}
    try:
        flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    except OSError:
        return {}
    return {} if " avx512f" in flags else {"OPENBLAS_CORETYPE": "Sandybridge"}


def default_threads() -> int:
    """OpenBLAS threads unless ``OPENBLAS_NUM_THREADS`` says: half the cores. Its threads
    wait for work spinning, and MLX's own thread and kvmetal's attention threads run
    between its calls; with every core to OpenBLAS, a 2-core machine ran a decode step
    several times slower than with one (README, "Fast float32 on Linux")."""
    return max(1, (os.cpu_count() or 1) // 2)


def preload_value() -> str | None:
    """An ``LD_PRELOAD`` value that puts OpenBLAS under MLX: the wheel's library and the
    shim, else Debian's libopenblas0-pthread; None when neither is installed."""
    lib, shim = wheel_openblas(), shim_library()
    if lib is not None and shim is not None:
        return f"{lib}:{shim}"
    return openblas_library()


def reference_blas_note() -> str | None:
    """One line when MLX runs on its bundled reference BLAS, with what makes it fast
    (nothing under ``KVMETAL_NO_OPENBLAS=1``: the reference BLAS was asked for)."""
    if fast_blas_loaded() is not False or os.environ.get(OPT_OUT) == "1":
        return None
    if "mlx.core" in sys.modules and wheel_openblas() and shim_library():
        fix = "kvmetal.models.blas.use_openblas() before the first import of mlx"
    elif shim_library() is None:
        fix = "a kvmetal build with libkvmetal_openblas.so (reinstall kvmetal)"
    else:
        fix = "pip install scipy-openblas32"
    return (f"kvmetal: MLX is using its bundled reference BLAS (float32 matmuls ~30x slower than OpenBLAS); "
            f"for speed: {fix}")


def preload_openblas_and_reexec(argv: list | None = None) -> None:
    """For scripts that imported MLX already: restart this process with OpenBLAS under
    ``LD_PRELOAD`` (:func:`preload_value`; one line says so; ``KVMETAL_NO_OPENBLAS=1``
    opts out). Returns only when nothing needs to change."""
    if os.environ.get(OPT_OUT) == "1" or fast_blas_loaded() is not False:
        return
    value = preload_value()
    if value is None or os.environ.get("_KVMETAL_OPENBLAS_REEXEC") == "1":
        note = reference_blas_note()
        if note:
            print(note, file=sys.stderr, flush=True)
        return
    print(f"kvmetal: restarting with LD_PRELOAD={value} (OpenBLAS for MLX's float32 matmuls; "
          f"{OPT_OUT}=1 keeps the bundled reference BLAS)", file=sys.stderr, flush=True)
    env = dict(os.environ, _KVMETAL_OPENBLAS_REEXEC="1")
    env["LD_PRELOAD"] = value + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    env.update({k: v for k, v in invariant_kernel_env().items() if not env.get(k)})
    if not any(env.get(v) for v in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS")):
        # Preloaded, OpenBLAS starts a spinning thread per core: on 2 shared cores a
        # teacher-forced study ran ~10x slower than with default_threads().
        env["OPENBLAS_NUM_THREADS"] = str(default_threads())
    args = [sys.executable] + list(sys.argv if argv is None else argv)
    os.execve(sys.executable, args, env)
