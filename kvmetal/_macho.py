"""A small Mach-O reader (pure Python, 64-bit little-endian, thin or fat with an arm64 slice).

It reads what the macOS wheel checks need: the deployment target (``minos``), the rpaths,
the linked dylibs, and the symbol table with each undefined symbol's library. Used by
``kvmetal selfcheck`` (which wheel is this?) and by tools/macos_crossbuild on Linux, where
Apple's otool is not available.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path

MH_MAGIC_64, FAT_MAGIC = 0xFEEDFACF, 0xCAFEBABE
CPU_TYPE_ARM64 = 0x0100000C
MH_TWOLEVEL = 0x80
LC_SYMTAB, LC_LOAD_DYLIB, LC_ID_DYLIB, LC_VERSION_MIN_MACOSX = 0x2, 0xC, 0xD, 0x24
LC_BUILD_VERSION, LC_RPATH, LC_CODE_SIGNATURE = 0x32, 0x8000001C, 0x1D
LC_DYLD_INFO, LC_DYLD_INFO_ONLY, LC_DYLD_CHAINED_FIXUPS = 0x22, 0x80000022, 0x80000034
DYLIB_LOADS = {0xC: "load", 0x80000018: "weak", 0x8000001F: "reexport", 0x20: "lazy", 0x80000023: "upward"}
SELF_LIBRARY_ORDINAL, DYNAMIC_LOOKUP_ORDINAL, EXECUTABLE_ORDINAL = 0, 0xFE, 0xFF
SPECIAL_ORDINALS = {0: "self", -1: "executable", -2: "dynamic lookup", -3: "weak lookup"}
PLATFORM_MACOS = 1


class MachOError(ValueError):
    pass


def _version(v: int) -> str:
    """xxxx.yy.zz nibbles, as otool prints them (14.0, not 14.0.0)."""
    major, minor, patch = v >> 16, (v >> 8) & 0xFF, v & 0xFF
    return f"{major}.{minor}" + (f".{patch}" if patch else "")


@dataclass
class Symbol:
    name: str
    defined: bool
    external: bool
    library: int          # library ordinal of an undefined symbol (1-based into dylibs)
    weak_ref: bool


@dataclass
class MachO:
    cputype: int
    filetype: int
    flags: int
    minos: str | None = None
    sdk: str | None = None
    platform: int | None = None
    rpaths: list = field(default_factory=list)
    dylibs: list = field(default_factory=list)    # install names, in ordinal order
    install_name: str | None = None
    code_signature: tuple | None = None           # (offset, size) of the signature blob
    symbols: list = field(default_factory=list)
    binds: dict = field(default_factory=dict)     # symbol -> library ordinal dyld binds it with

    @property
    def two_level(self) -> bool:
        return bool(self.flags & MH_TWOLEVEL)

    def library_of(self, sym: Symbol) -> str:
        """The dylib an undefined symbol binds to, or 'dynamic lookup' / 'self' / 'executable'.
        dyld's bind records decide (the symbol table's ordinal is a linker's note and zig
        leaves 0 there for flat lookups); the symbol table answers for unbound symbols."""
        if not self.two_level:
            return "dynamic lookup"
        ordinal = self.binds.get(sym.name)
        if ordinal is None:
            ordinal = {SELF_LIBRARY_ORDINAL: 0, DYNAMIC_LOOKUP_ORDINAL: -2, EXECUTABLE_ORDINAL: -1}.get(
                sym.library, sym.library)
        if ordinal in SPECIAL_ORDINALS:
            return SPECIAL_ORDINALS[ordinal]
        if 1 <= ordinal <= len(self.dylibs):
            return self.dylibs[ordinal - 1]
        raise MachOError(f"symbol {sym.name} has library ordinal {ordinal}, only {len(self.dylibs)} dylibs")

    def linked_from(self, sym: Symbol) -> str | None:
        """The dylib the static linker found an undefined symbol in (the symbol table's
        ordinal), even where dyld binds it by weak or flat lookup; None if not recorded."""
        if self.two_level and 1 <= sym.library <= len(self.dylibs):
            return self.dylibs[sym.library - 1]
        return None

    def undefined(self) -> list:
        return [s for s in self.symbols if not s.defined and s.external]

    def exported(self) -> set:
        return {s.name for s in self.symbols if s.defined and s.external}


def _cstr(data: bytes, at: int) -> str:
    end = data.index(b"\0", at)
    return data[at:end].decode("utf-8", "replace")


def _slice(data: bytes) -> bytes:
    magic = struct.unpack_from(">I", data, 0)[0]
    if magic != FAT_MAGIC:
        return data
    (n,) = struct.unpack_from(">I", data, 4)
    for i in range(n):
        cputype, _sub, offset, size, _align = struct.unpack_from(">iiIII", data, 8 + 20 * i)
        if cputype == CPU_TYPE_ARM64:
            return data[offset:offset + size]
    raise MachOError("fat Mach-O without an arm64 slice")


def parse(data: bytes) -> MachO:
    data = _slice(data)
    if len(data) < 32 or struct.unpack_from("<I", data, 0)[0] != MH_MAGIC_64:
        raise MachOError("not a 64-bit little-endian Mach-O file")
    _magic, cputype, _sub, filetype, ncmds, _size, flags, _res = struct.unpack_from("<IiiIIIII", data, 0)
    m = MachO(cputype=cputype, filetype=filetype, flags=flags)
    at, symtab = 32, None
    for _ in range(ncmds):
        cmd, cmdsize = struct.unpack_from("<II", data, at)
        if cmd == LC_BUILD_VERSION:
            m.platform, minos, sdk = struct.unpack_from("<III", data, at + 8)
            m.minos, m.sdk = _version(minos), _version(sdk)
        elif cmd == LC_VERSION_MIN_MACOSX and m.minos is None:
            minos, sdk = struct.unpack_from("<II", data, at + 8)
            m.platform, m.minos, m.sdk = PLATFORM_MACOS, _version(minos), _version(sdk)
        elif cmd == LC_RPATH:
            m.rpaths.append(_cstr(data, at + struct.unpack_from("<I", data, at + 8)[0]))
        elif cmd in DYLIB_LOADS:
            m.dylibs.append(_cstr(data, at + struct.unpack_from("<I", data, at + 8)[0]))
        elif cmd == LC_ID_DYLIB:
            m.install_name = _cstr(data, at + struct.unpack_from("<I", data, at + 8)[0])
        elif cmd == LC_SYMTAB:
            symtab = struct.unpack_from("<IIII", data, at + 8)
        elif cmd == LC_CODE_SIGNATURE:
            m.code_signature = struct.unpack_from("<II", data, at + 8)
        elif cmd in (LC_DYLD_INFO, LC_DYLD_INFO_ONLY):
            _rb, _rs, bind_off, bind_size, _wo, _ws, lazy_off, lazy_size = struct.unpack_from("<8I", data, at + 8)
            _bind_opcodes(data, bind_off, bind_size, m.binds)
            _bind_opcodes(data, lazy_off, lazy_size, m.binds)
        elif cmd == LC_DYLD_CHAINED_FIXUPS:
            _chained_imports(data, struct.unpack_from("<I", data, at + 8)[0], m.binds)
        if cmdsize < 8:
            raise MachOError(f"load command {cmd:#x} has size {cmdsize}")
        at += cmdsize
    if symtab:
        symoff, nsyms, stroff, _strsize = symtab
        for i in range(nsyms):
            strx, ntype, _sect, desc, _value = struct.unpack_from("<IBBHQ", data, symoff + 16 * i)
            if ntype & 0xE0:          # N_STAB: debugging entries
                continue
            kind = ntype & 0x0E
            if kind not in (0x0, 0xE, 0x2, 0xA):  # N_UNDF, N_SECT, N_ABS, N_INDR
                continue
            m.symbols.append(Symbol(name=_cstr(data, stroff + strx), defined=kind != 0x0,
                                    external=bool(ntype & 0x01), library=(desc >> 8) & 0xFF,
                                    weak_ref=bool(desc & 0x40)))
    return m


def _uleb(data: bytes, at: int) -> tuple:
    value = shift = 0
    while True:
        b = data[at]
        at += 1
        value |= (b & 0x7F) << shift
        shift += 7
        if not b & 0x80:
            return value, at


def _bind_opcodes(data: bytes, start: int, size: int, binds: dict):
    """dyld's bind opcode stream (LC_DYLD_INFO): the ordinal in force at each DO_BIND."""
    at, end, ordinal, name = start, start + size, 0, None
    while at < end:
        op, imm = data[at] & 0xF0, data[at] & 0x0F
        at += 1
        if op == 0x10:                       # SET_DYLIB_ORDINAL_IMM
            ordinal = imm
        elif op == 0x20:                     # SET_DYLIB_ORDINAL_ULEB
            ordinal, at = _uleb(data, at)
        elif op == 0x30:                     # SET_DYLIB_SPECIAL_IMM: 0, -1, -2, -3
            ordinal = imm - 16 if imm else 0
        elif op == 0x40:                     # SET_SYMBOL_TRAILING_FLAGS_IMM
            stop = data.index(b"\0", at)
            name, at = data[at:stop].decode("utf-8", "replace"), stop + 1
        elif op in (0x60, 0x70, 0x80, 0xA0):  # ADDEND_SLEB, SEGMENT_AND_OFFSET, ADD_ADDR, DO_BIND_ADD_ADDR
            _, at = _uleb(data, at)
        elif op == 0xC0:                     # DO_BIND_ULEB_TIMES_SKIPPING_ULEB
            _, at = _uleb(data, at)
            _, at = _uleb(data, at)
        elif op == 0xD0 and imm == 0:        # THREADED SET_BIND_ORDINAL_TABLE_SIZE_ULEB
            _, at = _uleb(data, at)
        if op in (0x90, 0xA0, 0xB0, 0xC0) and name is not None:
            binds[name] = ordinal


def _chained_imports(data: bytes, start: int, binds: dict):
    """The imports table of LC_DYLD_CHAINED_FIXUPS (formats 1-3)."""
    _ver, _starts, imports_off, symbols_off, count, fmt, _sfmt = struct.unpack_from("<7I", data, start)
    at = start + imports_off
    for _ in range(count):
        if fmt in (1, 2):
            (raw,) = struct.unpack_from("<I", data, at)
            ordinal, name_off = raw & 0xFF, raw >> 9
            ordinal = ordinal - 256 if ordinal >= 0xF0 else ordinal
            at += 4 if fmt == 1 else 8
        elif fmt == 3:
            (raw,) = struct.unpack_from("<Q", data, at)
            ordinal, name_off = raw & 0xFFFF, raw >> 32
            ordinal = ordinal - 65536 if ordinal >= 0xFFF0 else ordinal
            at += 16
        else:
            raise MachOError(f"chained fixups imports format {fmt}")
        binds[_cstr(data, start + symbols_off + name_off)] = ordinal


def read(path) -> MachO:
    return parse(Path(path).read_bytes())
