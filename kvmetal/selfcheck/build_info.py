"""Which kvmetal build this process runs, read from the installed files: the wheel's tag, the
MLX it was built against and the one running, macOS, the extension's deployment target
(minos) and LC_RPATH from its Mach-O load commands, and where the Metal sources were found.
The selfcheck prints it first, so a user's report says what the cross-build cannot (dyld
loading, Apple's compiler and linker) for one identified wheel."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import platform
from pathlib import Path

import mlx.core as mx


def _wheel() -> dict:
    """The installed distribution's WHEEL tags and whether it is an editable install."""
    try:
        dist = importlib.metadata.distribution("kvmetal")
    except importlib.metadata.PackageNotFoundError:
        return {"installed": False}
    tags = [line.split(":", 1)[1].strip() for line in (dist.read_text("WHEEL") or "").splitlines()
            if line.startswith("Tag:")]
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    editable = bool(direct.get("dir_info", {}).get("editable"))
    here = Path(__file__).resolve().parent.parent
    if not editable and Path(dist.locate_file("kvmetal")).resolve() != here:
        return {"installed": False, "elsewhere": str(dist.locate_file("kvmetal"))}  # a source tree shadows it
    return {"installed": True, "version": dist.version, "tags": tags, "editable": editable}


def _extension() -> dict:
    spec = importlib.util.find_spec("kvmetal._ext")
    if spec is None or not spec.origin:
        return {"path": None}
    path = Path(spec.origin)
    head = path.read_bytes()[:4]
    info = {"path": str(path), "format": "Mach-O" if head in (b"\xcf\xfa\xed\xfe", b"\xca\xfe\xba\xbe")
            else "ELF" if head == b"\x7fELF" else "unknown"}
    if info["format"] == "Mach-O":
        from .. import _macho

        try:
            m = _macho.read(path)
            info.update(minos=m.minos, rpaths=m.rpaths, dylibs=m.dylibs, signed=bool(m.code_signature))
        except (_macho.MachOError, ValueError, IndexError) as e:
            info["error"] = f"cannot read its load commands: {e}"
    return info


def _metal_sources() -> dict:
    from ..backends import metal_specs

    for d in metal_specs.kernel_dirs():
        files = sorted(p.name for p in d.glob("*.metal")) if d.is_dir() else []
        if files:
            return {"dir": str(d), "files": files}
    return {"dir": None, "files": [], "searched": [str(d) for d in metal_specs.kernel_dirs()]}


def describe() -> dict:
    try:
        from .. import _build_info
        built = _build_info.MLX_VERSION
    except ImportError:
        built = None
    return {"package": str(Path(__file__).resolve().parent.parent), "wheel": _wheel(),
            "macos": platform.mac_ver()[0] or None, "system": f"{platform.system()} {platform.machine()}",
            "mlx": mx.__version__, "built_against_mlx": built,
            "extension": _extension(), "metal_sources": _metal_sources()}


def lines(b: dict) -> list:
    w = b["wheel"]
    if not w["installed"]:
        where = "not installed (imported from a source tree" + (
            f"; the installed kvmetal at {w['elsewhere']} is not the one running)" if w.get("elsewhere") else ")")
    elif w["editable"]:
        where = f"kvmetal {w['version']}, editable install"
    else:
        where = f"kvmetal {w['version']}, wheel {'.'.join(w['tags']) or '(no tag recorded)'}"
    os_name = f"macOS {b['macos']}" if b["macos"] else f"{b['system']} (not macOS)"
    out = [f"build: {where} at {b['package']}",
           f"  MLX {b['mlx']} (built against {b['built_against_mlx'] or 'unknown: no _build_info.py'}), {os_name}"]
    e = b["extension"]
    if e["path"] is None:
        out.append("  extension: kvmetal._ext is missing (no compiled build here)")
    elif e["format"] == "Mach-O":
        out.append(f"  extension: {Path(e['path']).name}, Mach-O, "
                   + (e["error"] if "error" in e else
                      f"minos {e['minos']}, LC_RPATH {', '.join(e['rpaths']) or 'none'}"
                      + ("" if e["signed"] else ", NOT signed")))
    else:
        out.append(f"  extension: {Path(e['path']).name}, {e['format']} (minos and LC_RPATH are macOS-only)")
    m = b["metal_sources"]
    out.append(f"  Metal sources: {len(m['files'])} found in {m['dir']}" if m["files"] else
               f"  Metal sources: NOT FOUND (searched {', '.join(m['searched'])})")
    return out
