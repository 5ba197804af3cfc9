"""Which BLAS MLX's float32 matmuls run on (Linux).

MLX's Linux CPU wheel bundles the reference (netlib) BLAS: float32 matmuls run at a few
GFLOPS. Preloading OpenBLAS (``LD_PRELOAD``) replaces those symbols and makes them about
30x faster. float16, bfloat16 and quantized matmuls never go through BLAS. kvmetal does
not switch BLAS on its own (that would change numerics silently); it says so in one line.
"""
from __future__ import annotations

import ctypes
import glob
import os
import sys

_OPENBLAS_GLOBS = ("/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0", "/usr/lib/*/libopenblas.so.0",
                   "/usr/lib64/libopenblas*.so.0")


def openblas_library() -> str | None:
    """The OpenBLAS shared library ``libopenblas0-pthread`` installs, if present."""
    for pattern in _OPENBLAS_GLOBS:
        found = sorted(glob.glob(pattern))
        if found:
            return found[0]
    return None


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p), ("dli_sname", ctypes.c_char_p),
                ("dli_saddr", ctypes.c_void_p)]


def sgemm_provider() -> str | None:
    """The library that serves ``cblas_sgemm`` from the process's global scope (an
    ``LD_PRELOAD`` lands there), or None when none does: then MLX's matmuls resolve to
    the BLAS its wheel bundles (loaded privately, next to libmlx)."""
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


def reference_blas_note() -> str | None:
    """One line when MLX runs on its bundled reference BLAS, with what makes it fast."""
    if fast_blas_loaded() is not False:
        return None
    lib = openblas_library()
    fix = (f"LD_PRELOAD={lib}" if lib else
           "apt-get install libopenblas0-pthread, then LD_PRELOAD= its openblas-pthread/libopenblas.so.0")
    return (f"kvmetal: MLX is using its bundled reference BLAS (float32 matmuls ~30x slower than OpenBLAS); "
            f"for speed run with {fix}")


def preload_openblas_and_reexec(argv: list | None = None) -> None:
    """For benchmark scripts: restart this process with OpenBLAS preloaded when it is
    installed and not yet in use (one line says so; ``KVMETAL_NO_OPENBLAS=1`` opts out).
    Returns only when nothing needs to change."""
    if os.environ.get("KVMETAL_NO_OPENBLAS") == "1" or fast_blas_loaded() is not False:
        return
    lib = openblas_library()
    if lib is None or os.environ.get("_KVMETAL_OPENBLAS_REEXEC") == "1":
        note = reference_blas_note()
        if note:
            print(note, file=sys.stderr, flush=True)
        return
    print(f"kvmetal: restarting with LD_PRELOAD={lib} (OpenBLAS for MLX's float32 matmuls; "
          f"KVMETAL_NO_OPENBLAS=1 keeps the bundled reference BLAS)", file=sys.stderr, flush=True)
    env = dict(os.environ, _KVMETAL_OPENBLAS_REEXEC="1")
    env["LD_PRELOAD"] = lib + (":" + env["LD_PRELOAD"] if env.get("LD_PRELOAD") else "")
    args = [sys.executable] + list(sys.argv if argv is None else argv)
    os.execve(sys.executable, args, env)
