"""kvmetal/_macho.py, the Mach-O reader behind `kvmetal selfcheck`'s build lines and
tools/macos_crossbuild: a small arm64 dylib written here, byte by byte."""
from __future__ import annotations

import struct

import pytest

from kvmetal import _macho


def _pad8(b: bytes) -> bytes:
    return b + b"\0" * (-len(b) % 8)


def _lc_str(cmd: int, fixed: bytes, s: str) -> bytes:
    body = _pad8(fixed + s.encode() + b"\0")
    return struct.pack("<II", cmd, 8 + len(body)) + body


def dylib(*, minos=(14, 0), rpath="@loader_path/../mlx/lib", flags=0x80) -> bytes:
    """An arm64 MH_DYLIB: minos, one rpath, two dylibs, three symbols, dyld bind opcodes."""
    syms = [("_mlx_fn", 0x01, 0, 1 << 8), ("_PyFoo", 0x01, 0, 0), ("_ours", 0x0F, 1, 0)]
    strtab = b"\0"
    nlist = b""
    for name, ntype, sect, desc in syms:
        nlist += struct.pack("<IBBHQ", len(strtab), ntype, sect, desc, 0)
        strtab += name.encode() + b"\0"
    binds = (b"\x11\x40_mlx_fn\0\x51\x72\x00\x90"      # ordinal 1, symbol, type, segment 2 +0, bind
             b"\x3e\x40_PyFoo\0\x90\x00")             # special ordinal -2 (flat lookup), bind, done
    cmds = [struct.pack("<IIIIII", 0x32, 24, 1, (minos[0] << 16) | (minos[1] << 8), 0x000F0200, 0),
            _lc_str(0x8000001C, struct.pack("<I", 12), rpath),
            _lc_str(0xC, struct.pack("<IIII", 24, 2, 0x10000, 0x10000), "@rpath/libmlx.dylib"),
            _lc_str(0xC, struct.pack("<IIII", 24, 2, 0x10000, 0x10000), "/usr/lib/libSystem.B.dylib")]
    sizeofcmds = sum(map(len, cmds)) + 24 + 48
    data_at = 32 + sizeofcmds
    symoff, bindoff = data_at, data_at + len(nlist)
    stroff = bindoff + len(binds)
    cmds.append(struct.pack("<6I", 0x2, 24, symoff, len(syms), stroff, len(strtab)))
    cmds.append(struct.pack("<12I", 0x80000022, 48, 0, 0, bindoff, len(binds), 0, 0, 0, 0, 0, 0))
    header = struct.pack("<IiiIIIII", 0xFEEDFACF, 0x0100000C, 0, 6, len(cmds), sizeofcmds, flags, 0)
    return header + b"".join(cmds) + nlist + binds + strtab


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
