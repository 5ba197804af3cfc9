"""The C++ compiler CMake sees in the macOS cross-build: zig's clang for aarch64-macos.

It rewrites the few arguments zig cannot take for this target and appends one line per
kind of rewrite to $KVMETAL_XB_REWRITES (the tool prints them; docs list them as what
the cross-build cannot show). Everything else reaches clang/zig's Mach-O linker as is.
"""
from __future__ import annotations

import os
import sys

ZIG = os.environ["KVMETAL_XB_ZIG"]
TARGET = os.environ["KVMETAL_XB_TARGET"]          # e.g. aarch64-macos.14.0
STUBS = os.environ["KVMETAL_XB_STUBS"]            # libc++.tbd and framework stubs
LOG = os.environ.get("KVMETAL_XB_REWRITES")


def note(kind: str, why: str):
    if LOG:
        with open(LOG, "a") as f:
            f.write(f"{kind}: {why}\n")


def rewrite(args: list[str]) -> list[str]:
    linking = "-c" not in args and "-E" not in args and "-S" not in args
    out = []
    it = iter(args)
    for a in it:
        if a == "-arch":
            next(it, None)          # zig takes the target from -target
            continue
        if a.startswith("-flto") or a == "-fno-fat-lto-objects":
            note(f"drop {a}", "zig does not do LTO for Mach-O; the Mac build is LTO'd, this one is not")
            continue
        if a == "-bundle":
            note("-bundle -> -shared", "zig cannot write MH_BUNDLE; the Mac build links _ext as a bundle, "
                                       "this one as a dylib")
            out.append("-shared")
            continue
        if a == "-Wl,-x":
            note("drop -Wl,-x", "llvm-install-name-tool crashes on zig's output without local symbols")
            continue
        if a.startswith("-Wl,@") and a.endswith(".sym"):
            note("-Wl,@darwin-ld-cpython.sym -> -undefined dynamic_lookup",
                 "zig's linker takes no -U list; the check afterwards allows flat lookups only for the "
                 "symbols on that list")
            out += ["-Wl,-undefined,dynamic_lookup"]
            continue
        out.append(a)
    # Apple's libc++ headers carry availability annotations (symbols newer than the deployment
    # target are compile errors) and visibility annotations; zig's defaults turn both off.
    pre = ["-target", TARGET,
           "-U_LIBCPP_HAS_VENDOR_AVAILABILITY_ANNOTATIONS", "-D_LIBCPP_HAS_VENDOR_AVAILABILITY_ANNOTATIONS=1",
           "-U_LIBCPP_DISABLE_VISIBILITY_ANNOTATIONS", "-U_LIBCXXABI_DISABLE_VISIBILITY_ANNOTATIONS"]
    # Apple clang does not emit sized operator delete (MLX, built with it, imports none);
    # zig's clang 22 does.
    note("add -fno-sized-deallocation", "Apple clang's default (libmlx imports no sized delete); zig's clang "
                                        "emits __ZdlPvm")
    pre.append("-fno-sized-deallocation")
    if linking:
        note("libc++ -> stub of Apple's", "linked against a stub exporting what MLX imports from "
                                          "/usr/lib/libc++.1.dylib, not zig's static libc++")
        pre += ["-nostdlib++", "-F" + STUBS]
        out += ["-L" + STUBS, "-lcxx-macos"]
    return pre + out


def main() -> int:
    args = rewrite(sys.argv[1:])
    os.execv(ZIG, [ZIG, "c++", *args])


if __name__ == "__main__":
    sys.exit(main())
