"""Compile kernels to shared objects with g++, cached on disk by content hash.

Cache key: the generated C++, the runtime headers, the compiler command and
its version. Default directory ``~/.cache/kvmetal-sim``; set
``KVMETAL_SIM_CACHE`` to move it. The runtime (fibers, scheduler) is one
shared library built once and loaded RTLD_GLOBAL; each kernel .so only holds
the kernel and its wrapper, which keeps a compile around a second.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import re
import shlex
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from ..chips import THREADGROUP_MEMORY_LIMIT
from .errors import CompileError, SimError

RUNTIME_DIR = Path(__file__).resolve().parent / "runtime"
KERNEL_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-w", "-fwrapv", "-fno-strict-aliasing",
                "-ftrivial-auto-var-init=pattern", "-fno-exceptions")
# Keep every barrier/collective call site distinct (a site is a return address):
# no merging of identical calls from different branches.
GCC_SITE_FLAGS = ("-fno-crossjumping", "-fno-tree-tail-merge", "-fno-code-hoisting")
CLANG_SITE_FLAGS = ("-mllvm", "-enable-tail-merge=false")
# Integer division or modulo by zero traps on every CPU (x86 raises SIGFPE by
# itself, aarch64 would silently return 0): the runtime turns the trap into
# IntegerDivisionError. No sanitizer runtime is linked.
GCC_DIV_FLAGS = ("-fsanitize=integer-divide-by-zero", "-fsanitize-undefined-trap-on-error")
CLANG_DIV_FLAGS = ("-fsanitize=integer-divide-by-zero", "-fsanitize-trap=integer-divide-by-zero")
# Metal's threadgroup memory limit comes from kvmetal/chips.py, its one definition.
RUNTIME_DEFINES = (f"-DKMSL_MAX_THREADGROUP_MEMORY={THREADGROUP_MEMORY_LIMIT}",)
RUNTIME_FLAGS = ("-std=c++17", "-O2", "-fPIC", "-shared", "-pthread", *RUNTIME_DEFINES)

_lock = threading.Lock()
_loaded: dict = {}          # kernel cache key -> loaded kernel library
_runtime = None             # the one runtime library of this process


def cache_dir() -> Path:
    d = Path(os.environ.get("KVMETAL_SIM_CACHE") or Path.home() / ".cache" / "kvmetal-sim")
    d.mkdir(parents=True, exist_ok=True)
    return d


def compiler() -> list:
    return shlex.split(os.environ.get("CXX", "g++"))


@functools.lru_cache(maxsize=None)
def _compiler_id(cmd: tuple) -> str:
    try:
        out = subprocess.run([*cmd, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SimError(f"[kvmetal.sim] no working C++ compiler ({' '.join(cmd)}): {e}; install g++ or set CXX") from e
    return out.splitlines()[0] if out else " ".join(cmd)


@functools.lru_cache(maxsize=None)
def _runtime_digest() -> str:
    h = hashlib.sha256()
    for p in sorted(RUNTIME_DIR.iterdir()):
        if p.suffix in (".h", ".cpp"):
            h.update(p.name.encode())
            h.update(p.read_bytes())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _cpu_has_f16c() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return any(line.startswith("flags") and " f16c" in line for line in f)
    except OSError:
        return False


def kernel_flags() -> tuple:
    cmd = compiler()
    ident = _compiler_id(tuple(cmd))
    clang = "clang" in ident.lower()
    extra = (CLANG_SITE_FLAGS + CLANG_DIV_FLAGS) if clang else (GCC_SITE_FLAGS + GCC_DIV_FLAGS)
    if platform.machine() in ("x86_64", "AMD64") and _cpu_has_f16c():
        extra += ("-mf16c",)  # inline half<->float conversions instead of libgcc calls
    if sys.platform == "darwin":
        extra += ("-undefined", "dynamic_lookup")  # runtime symbols come from libkmslrt, loaded first
    return KERNEL_FLAGS + extra


def _digest(*parts: str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p.encode())
        h.update(b"\0")
    return h.hexdigest()[:24]


def _compile(src_text: str, out: Path, flags, *, what: str, file_name: str, msl: str | None):
    cmd = compiler()
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        src = Path(tmp) / "kernel.cpp"
        src.write_text(src_text)
        obj = Path(tmp) / out.name
        proc = subprocess.run([*cmd, *flags, f"-I{RUNTIME_DIR}", str(src), "-o", str(obj)],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise CompileError(_explain(proc.stderr, what, file_name, msl))
        os.replace(obj, out)  # atomic: concurrent processes never see a partial .so


def _explain(stderr: str, what: str, file_name: str, msl: str | None) -> str:
    """Quote the first error that points into the kernel's MSL, with its line."""
    lines = stderr.splitlines()
    pat = re.compile(re.escape(file_name) + r":(\d+):(?:(\d+):)?\s*(error|note|warning)?:?\s*(.*)")
    first_error = next((l for l in lines if ": error:" in l), lines[0] if lines else "")
    loc = None
    for l in lines:
        m = pat.search(l)
        if m:
            loc = m
            if m.group(3) == "error":
                break
    msg = f"[{what}] failed to compile: {first_error.strip()}"
    if loc and msl is not None:
        n = int(loc.group(1))
        src_lines = msl.splitlines()
        if 1 <= n <= len(src_lines):
            msg += f"\n  MSL line {n}: {src_lines[n - 1].strip()}"
    tail = "\n".join(lines[:40])
    return msg + "\n--- compiler output ---\n" + tail


def load_runtime() -> ctypes.CDLL:
    """Build (once per compiler) and load the fiber runtime. Loaded once per process:
    kernels bind to its symbols by name, so a second copy would split its state."""
    global _runtime
    with _lock:
        if _runtime is not None:
            return _runtime
        cmd = compiler()
        key = _digest(_runtime_digest(), " ".join(cmd), _compiler_id(tuple(cmd)), " ".join(RUNTIME_FLAGS))
        path = cache_dir() / f"libkmslrt-{key}.so"
        if not path.exists():
            _compile((RUNTIME_DIR / "rt.cpp").read_text(), path, RUNTIME_FLAGS, what="kvmetal.sim runtime",
                     file_name="rt.cpp", msl=None)
        _runtime = ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
        return _runtime


def load_kernel(cpp: str, *, what: str, file_name: str, msl: str) -> ctypes.CDLL:
    """Compile (or fetch from the caches) one kernel variant and load it."""
    load_runtime()
    cmd = compiler()
    flags = kernel_flags()
    key = _digest(cpp, _runtime_digest(), " ".join(cmd), _compiler_id(tuple(cmd)), " ".join(flags))
    with _lock:
        lib = _loaded.get(key)
    if lib is not None:
        return lib
    path = cache_dir() / f"k-{key}.so"
    if not path.exists():
        _compile(cpp, path, flags, what=what, file_name=file_name, msl=msl)
    lib = ctypes.CDLL(str(path))
    with _lock:
        _loaded[key] = lib
    return lib
