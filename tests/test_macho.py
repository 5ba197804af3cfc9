"""kvmetal/_macho.py, the Mach-O reader behind `kvmetal selfcheck`'s build lines and
tools/macos_crossbuild, over a small arm64 dylib written byte by byte (tests/macho_images.py)."""
from __future__ import annotations

import struct

import pytest

from kvmetal import _macho

from macho_images import dylib



def test_load_commands():
    m = _macho.parse(dylib())
    assert (m.minos, m.sdk, m.platform) == ("14.0", "15.2", _macho.PLATFORM_MACOS)
    assert m.rpaths == ["@loader_path/../mlx/lib"]
    assert m.dylibs == ["@rpath/libmlx.dylib", "/usr/lib/libSystem.B.dylib"]
    assert _macho.parse(dylib(minos=(11, 0))).minos == "11.0"


def test_symbols_bind_where_dyld_binds_them():
    m = _macho.parse(dylib())
    und = {s.name: s for s in m.undefined()}
    assert set(und) == {"_mlx_fn", "_PyFoo"} and m.exported() == {"_ours"}
    assert m.library_of(und["_mlx_fn"]) == "@rpath/libmlx.dylib"
    # The symbol table says 0 (what zig writes); the bind opcodes say flat lookup, and win.
    assert m.library_of(und["_PyFoo"]) == "dynamic lookup" and m.linked_from(und["_PyFoo"]) is None
    assert m.linked_from(und["_mlx_fn"]) == "@rpath/libmlx.dylib"
    flat = _macho.parse(dylib(flags=0))  # no MH_TWOLEVEL: every lookup is flat
    assert {flat.library_of(s) for s in flat.undefined()} == {"dynamic lookup"}


def test_fat_file_reads_its_arm64_slice():
    thin = dylib()
    fat = struct.pack(">II", _macho.FAT_MAGIC, 2) + struct.pack(">iiIII", 0x01000007, 3, 4096, 16, 12) \
        + struct.pack(">iiIII", 0x0100000C, 0, 8192, len(thin), 14)
    fat = fat.ljust(8192, b"\0") + thin
    assert _macho.parse(fat).rpaths == ["@loader_path/../mlx/lib"]


def test_other_files_are_refused():
    with pytest.raises(_macho.MachOError, match="not a 64-bit little-endian Mach-O"):
        _macho.parse(b"\x7fELF" + b"\0" * 60)


def test_selfcheck_build_lines_read_the_extension(monkeypatch, tmp_path):
    """The Mach-O branch of `kvmetal selfcheck`'s first lines, on the dylib above."""
    import importlib.util
    from types import SimpleNamespace

    from kvmetal.selfcheck import build_info

    ext = tmp_path / "_ext.cpython-311-darwin.so"
    ext.write_bytes(dylib(minos=(11, 0)))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: SimpleNamespace(origin=str(ext)))
    info = build_info.describe()
    assert info["extension"]["minos"] == "11.0" and info["extension"]["rpaths"] == ["@loader_path/../mlx/lib"]
    text = "\n".join(build_info.lines(info))
    assert "_ext.cpython-311-darwin.so, Mach-O, minos 11.0, LC_RPATH @loader_path/../mlx/lib, NOT signed" in text
    ext.write_bytes(b"\xcf\xfa\xed\xfe" + b"\0" * 8)     # truncated: said, not raised
    assert "cannot read its load commands" in "\n".join(build_info.lines(build_info.describe()))
