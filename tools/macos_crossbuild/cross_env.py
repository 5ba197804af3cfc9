"""The cross setup around the real build: a stand-in for the Mach-O ``mlx`` package (Linux
cannot import it), stubs of Apple's libc++ and frameworks made from what MLX itself links,
zig wrappers, and the CMake toolchain file. Each stand-in is logged as a rewrite."""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from checks import ACCEPTED_LIBCXX

HERE = Path(__file__).resolve().parent
TARGET_ARCH = "aarch64"
LIBCXX = "/usr/lib/libc++.1.dylib"


def mlx_version(mlx_root: Path) -> str:
    meta = next(mlx_root.glob("mlx-*.dist-info/METADATA")).read_text()
    return next(line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Version:"))


def standin_mlx(work: Path, mlx_root: Path, log) -> Path:
    """A package named mlx that answers what CMakeLists.txt asks (`python -m mlx --cmake-dir`,
    `mlx.core.__version__`) with the real wheel's directory and version."""
    pkg = work / "standin" / "mlx"
    (pkg / "core").mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "__main__.py").write_text(f"print({str(mlx_root / 'mlx')!r})\n")
    (pkg / "core" / "__init__.py").write_text(f"__version__ = {mlx_version(mlx_root)!r}\n")
    log("mlx stand-in", "Linux cannot import the Mach-O mlx.core; a stand-in answers `python -m mlx --cmake-dir` "
                        "and mlx.core.__version__ from the macOS wheels")
    return pkg.parent


def _tbd(install_name: str, symbols) -> str:
    syms = ", ".join(f"'{s}'" for s in sorted(symbols))
    body = f"    symbols: [ {syms} ]\n" if syms else "    symbols: [ ]\n"
    return ("--- !tapi-tbd\ntbd-version: 4\ntargets: [ arm64-macos ]\n"
            f"install-name: '{install_name}'\nexports:\n  - targets: [ arm64-macos ]\n{body}...\n")


def stubs(work: Path, mlx_binaries: list, log) -> tuple:
    """A libc++ stub exporting what MLX's binaries import from Apple's libc++, and empty
    framework stubs under the install names MLX links. Returns (stub dir, that symbol set)."""
    d = work / "stubs"
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    libcxx, frameworks = set(), {}
    for m in mlx_binaries:
        for s in m.undefined():
            if m.linked_from(s) == LIBCXX:
                libcxx.add(s.name)
        for lib in m.dylibs:
            if lib.startswith("/System/Library/Frameworks/"):
                frameworks[lib.split("/")[4].removesuffix(".framework")] = lib
    # Not named libc++: zig takes -lc++ to mean its own static libc++. The few symbols accepted
    # by name (checks.ACCEPTED_LIBCXX) are added, so they bind where they will on a Mac.
    (d / "libcxx-macos.tbd").write_text(_tbd(LIBCXX, libcxx | set(ACCEPTED_LIBCXX)))
    for name, install_name in frameworks.items():
        (d / f"{name}.framework").mkdir()
        (d / f"{name}.framework" / f"{name}.tbd").write_text(_tbd(install_name, ()))
    log("frameworks -> empty stubs", f"{', '.join(sorted(frameworks))} link through stubs that export nothing "
                                     "(kvmetal calls none of them)")
    return d, libcxx


def toolchain(work: Path, *, zig: Path, stubs_dir: Path, deployment_target: str, rewrites: Path,
              install_name_tool: str, zig_cache: Path, log) -> Path:
    """Compiler/archiver wrappers and the CMake toolchain file that selects them."""
    log("CMake probes compile only", "CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY: no macOS executable is "
                                     "linked (none could run here); the Mac build's probes link")
    bindir = work / "bin"
    bindir.mkdir(parents=True, exist_ok=True)
    env = (f"export KVMETAL_XB_ZIG='{zig}' KVMETAL_XB_TARGET='{TARGET_ARCH}-macos.{deployment_target}' "
           f"KVMETAL_XB_STUBS='{stubs_dir}' KVMETAL_XB_REWRITES='{rewrites}' "
           f"ZIG_GLOBAL_CACHE_DIR='{zig_cache}' ZIG_LOCAL_CACHE_DIR='{zig_cache}'\n")
    wrappers = {
        "c++": f"exec '{sys.executable}' '{HERE / 'zigcxx.py'}' \"$@\"\n",
        "ar": f"exec '{zig}' ar \"$@\"\n",
        "ranlib": f"exec '{zig}' ranlib \"$@\"\n",
    }
    for name, line in wrappers.items():
        p = bindir / f"zig-{name}"
        p.write_text("#!/bin/sh\n" + env + line)
        p.chmod(0o755)
    tc = work / "darwin-arm64.cmake"
    tc.write_text(f"""# Written by tools/macos_crossbuild: macOS arm64 through zig's clang and Mach-O linker.
set(CMAKE_SYSTEM_NAME Darwin)
set(CMAKE_SYSTEM_PROCESSOR arm64)
set(CMAKE_OSX_ARCHITECTURES arm64)
set(CMAKE_CXX_COMPILER "{bindir / 'zig-c++'}")
set(CMAKE_AR "{bindir / 'zig-ar'}")
set(CMAKE_RANLIB "{bindir / 'zig-ranlib'}")
set(CMAKE_INSTALL_NAME_TOOL "{install_name_tool}")
# CMake's own probes compile only: linking a macOS executable would build zig's sanitizer
# runtime (a minute, cold) for a program that cannot run here anyway.
set(CMAKE_TRY_COMPILE_TARGET_TYPE STATIC_LIBRARY)
""")
    return tc


def apple_tools(work: Path, log) -> Path:
    """otool, install_name_tool and lipo for delocate: LLVM's, as Debian's llvm installs them.
    llvm-otool has no -m (Apple's "no archive member syntax"), which delocate passes; dropped."""
    d = work / "apple-tools"
    d.mkdir(parents=True, exist_ok=True)
    import shutil as _sh

    for tool, llvm in (("otool", "llvm-otool"), ("install_name_tool", "llvm-install-name-tool"), ("lipo", "llvm-lipo")):
        found = _sh.which(llvm) or _sh.which(f"{llvm}-14")
        if not found:
            continue
        body = (f'for a in "$@"; do shift; [ "$a" = "-m" ] || set -- "$@" "$a"; done\nexec \'{found}\' "$@"\n'
                if tool == "otool" else f'exec \'{found}\' "$@"\n')
        (d / tool).write_text("#!/bin/sh\n" + body)
        (d / tool).chmod(0o755)
    log("delocate's otool/install_name_tool/lipo -> LLVM's", "Apple's tools do not run on Linux; llvm-otool "
                                                            "reads the load commands (its unknown -m flag dropped)")
    return d
