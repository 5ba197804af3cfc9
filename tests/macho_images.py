"""A small arm64 Mach-O dylib written byte by byte, for the tests of kvmetal/_macho.py and
tools/macos_crossbuild's checks."""
from __future__ import annotations

import struct


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
