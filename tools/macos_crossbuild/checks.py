"""The checks on the cross-built wheel. Each returns a one-line detail or raises Failed with
a one-line reason; main.py prints PASS/FAIL with the check's name and time."""
from __future__ import annotations

import re
import zipfile
from pathlib import Path

LIBCXX = "/usr/lib/libc++.1.dylib"
LIBSYSTEM = "/usr/lib/libSystem.B.dylib"
LIBMLX = "@rpath/libmlx.dylib"
RPATH = "@loader_path/../mlx/lib"
# nanobind's internals key prefix (src/nb_internals.h: NB_PLATFORM_ABI_TAG "_a" major "_v" version):
# two binaries share nanobind types (mx.array arguments) only when these match.
NB_ABI_TAG = re.compile(rb"(?:system|mingw|msvc|gcc_cygwin)_[a-z0-9_]*?_a\d+_v\d+(?:_stable)?(?=\0)")


# Symbols outside MLX's libc++ imports accepted by name, each with why: shown in the PASS line.
ACCEPTED_LIBCXX = {"___dynamic_cast": "the Itanium C++ ABI's dynamic_cast, in libc++abi on every macOS; "
                                      "kvmetal's is_equivalent uses dynamic_cast, MLX's do not"}


class Failed(Exception):
    pass


def cpython_list(nanobind_dir: Path) -> set:
    """The symbols nanobind lets a macOS extension leave undefined (darwin-ld-cpython.sym)."""
    text = (nanobind_dir / "cmake" / "darwin-ld-cpython.sym").read_text()
    return {line.split()[1] for line in text.splitlines() if line.startswith("-U ")}


def _few(names) -> str:
    names = sorted(names)
    return ", ".join(names[:3]) + (f" (+{len(names) - 3} more)" if len(names) > 3 else "")


def symbols(ext, libmlx, cpython: set) -> str:
    """Every undefined symbol binds where macOS will find it: libmlx symbols exist in the pinned
    libmlx.dylib, flat-lookup symbols are CPython's (on nanobind's list), the rest are
    libc++/libSystem (checked by `libcxx`); nothing else."""
    exported = libmlx.exported()
    by_lib = {}
    # zig leaves dead-stripped references in the symbol table without a bind: dyld never looks
    # them up, so they are counted, not judged.
    for s in ext.undefined():
        by_lib.setdefault(ext.library_of(s) if s.name in ext.binds else "unbound", []).append(s.name)
    missing = [n for n in by_lib.get(LIBMLX, []) if n not in exported]
    if missing:
        raise Failed(f"{len(missing)} symbols bound to libmlx are not in the pinned libmlx.dylib: {_few(missing)}")
    flat = [n for n in by_lib.get("dynamic lookup", []) if n not in cpython]
    if flat:
        # (a libc++ symbol MLX does not import lands here too: the libc++ stub lacks it)
        raise Failed(f"{len(flat)} undefined symbols are not exported by the pinned libmlx.dylib, not CPython's "
                     f"(nanobind's list), not among MLX's libc++ imports: {_few(flat)}")
    other = {lib: names for lib, names in by_lib.items()
             if lib not in (LIBMLX, "dynamic lookup", LIBCXX, LIBSYSTEM, "unbound")}
    if other:
        lib, names = next(iter(other.items()))
        raise Failed(f"{len(names)} undefined symbols bind to {lib}, which kvmetal should not need: {_few(names)}")
    counts = ", ".join(f"{len(by_lib.get(k, []))} {label}" for k, label in
                       ((LIBMLX, "libmlx"), ("dynamic lookup", "CPython"), (LIBCXX, "libc++"), (LIBSYSTEM, "libSystem"),
                        ("unbound", "unbound (dead-stripped, never looked up)")))
    return f"{sum(map(len, by_lib.values()))} undefined: {counts}"


def libcxx(ext, mlx_libcxx: set) -> str:
    """What _ext takes from Apple's libc++ is a subset of what MLX (built on macOS against
    the real one, deployment target 14.0) takes from it, so it exists on macOS 14."""
    ours = [s.name for s in ext.undefined() if s.name in ext.binds and ext.library_of(s) == LIBCXX]
    extra = [n for n in ours if n not in mlx_libcxx and n not in ACCEPTED_LIBCXX]
    if extra:
        raise Failed(f"{len(extra)} libc++ symbols are not among those MLX imports from Apple's libc++: {_few(extra)}")
    if LIBCXX not in ext.dylibs:
        raise Failed(f"_ext does not link {LIBCXX} (a libc++ of its own would clash with MLX's)")
    own = [n for n in ext.exported() if n.startswith(("__ZNSt3__1", "__Znw", "__Zdl", "__Zna", "__Zda"))]
    if own:
        raise Failed(f"_ext defines {len(own)} libc++ symbols itself (a static libc++?): {_few(own)}")
    accepted = [n for n in ours if n in ACCEPTED_LIBCXX]
    return (f"{len(ours)} libc++ symbols, {len(ours) - len(accepted)} among the {len(mlx_libcxx)} MLX imports"
            + "".join(f"; {n} accepted by name ({ACCEPTED_LIBCXX[n]})" for n in accepted))


def rpath(ext) -> str:
    if ext.rpaths != [RPATH]:
        raise Failed(f"LC_RPATH is {ext.rpaths}, expected [{RPATH!r}] (libmlx from the mlx wheel next to kvmetal)")
    if LIBMLX not in ext.dylibs:
        raise Failed(f"_ext does not load {LIBMLX}; it loads {ext.dylibs}")
    return f"LC_RPATH {RPATH}, loads {LIBMLX}"


def minos(ext, libmlx, wheel_name: str) -> str:
    tag = re.search(r"macosx_(\d+)_(\d+)_arm64\.whl$", wheel_name)
    if not tag:
        raise Failed(f"wheel {wheel_name} is not tagged macosx_*_arm64")
    wheel_os = f"{tag.group(1)}.{tag.group(2)}"
    if ext.minos != libmlx.minos:
        raise Failed(f"_ext minos is {ext.minos}, libmlx.dylib's is {libmlx.minos} "
                     f"(set MACOSX_DEPLOYMENT_TARGET={libmlx.minos} in [tool.cibuildwheel.macos])")
    if wheel_os != ext.minos:
        raise Failed(f"the wheel is tagged macOS {wheel_os}, its _ext needs {ext.minos}")
    return f"minos {ext.minos} (libmlx.dylib's), wheel tag macosx_{tag.group(1)}_{tag.group(2)}_arm64"


def abi_tag(ext_bytes: bytes, core_bytes: bytes) -> str:
    ours, mlx = set(NB_ABI_TAG.findall(ext_bytes)), set(NB_ABI_TAG.findall(core_bytes))
    if len(mlx) != 1:
        raise Failed(f"found {len(mlx)} nanobind ABI tags in mlx.core ({sorted(mlx)})")
    if ours != mlx:
        raise Failed(f"nanobind ABI tag of _ext {sorted(t.decode() for t in ours)} != mlx.core's "
                     f"{next(iter(mlx)).decode()} (mx.array arguments would be rejected)")
    return f"nanobind ABI tag {next(iter(mlx)).decode()} (= mlx.core's)"


def wheel_contents(wheel: Path, repo: Path, mlx_version: str) -> str:
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        info = z.read("kvmetal/_build_info.py").decode() if "kvmetal/_build_info.py" in names else None
    if info is None:
        raise Failed("kvmetal/_build_info.py is missing from the wheel")
    if f'MLX_VERSION = "{mlx_version}"' not in info:
        raise Failed(f"kvmetal/_build_info.py does not record MLX {mlx_version}: {info.strip()!r}")
    want = {f"kvmetal/kernels/{p.name}" for p in (repo / "kernels").iterdir() if p.suffix in (".metal", ".h")}
    if want - names:
        raise Failed(f"Metal sources missing from the wheel: {_few(want - names)}")
    exts = [n for n in names if re.fullmatch(r"kvmetal/_ext\.cpython-\d+-darwin\.so", n)]
    if len(exts) != 1:
        raise Failed(f"expected one kvmetal/_ext.cpython-3XX-darwin.so in the wheel, found {exts}")
    vendored = [n for n in names if "libmlx" in n]
    if vendored:
        raise Failed(f"the wheel vendors libmlx ({vendored[0]}): two copies in one process break MLX")
    return f"{exts[0]}, _build_info.py (MLX {mlx_version}), {len(want)} Metal sources, no libmlx"


def signature(data: bytes, ext) -> str:
    """The ad-hoc signature's page hashes match the file: arm64 macOS refuses to map code
    whose signature does not (install_name_tool's edits must re-sign)."""
    import hashlib
    import struct

    if not ext.code_signature:
        raise Failed("_ext has no LC_CODE_SIGNATURE (arm64 macOS loads only signed code)")
    off, _size = ext.code_signature
    magic, _len, count = struct.unpack_from(">III", data, off)
    if magic != 0xFADE0CC0:
        raise Failed(f"code signature superblob magic {magic:#x}")
    for i in range(count):
        slot_type, blob = struct.unpack_from(">II", data, off + 12 + 8 * i)
        cd = off + blob
        if slot_type != 0 or struct.unpack_from(">I", data, cd)[0] != 0xFADE0C02:
            continue
        (_m, _l, _v, _f, hash_off, _ident, _ns, n_code, code_limit, hash_size, hash_type, _p,
         page_log2) = struct.unpack_from(">IIIIIIIIIBBBB", data, cd)
        if hash_type != 2 or hash_size != 32:
            raise Failed(f"code directory hash type {hash_type}, expected SHA-256")
        page = 1 << page_log2
        for k in range(n_code):
            want = data[cd + hash_off + 32 * k: cd + hash_off + 32 * (k + 1)]
            got = hashlib.sha256(data[k * page: min((k + 1) * page, code_limit)]).digest()
            if got != want:
                raise Failed(f"code signature page {k} (of {n_code}) does not match the file: the binary was "
                             f"changed after signing")
        return f"code signature: {n_code} pages of {page} bytes match their SHA-256 hashes"
    raise Failed("no code directory in the code signature")
