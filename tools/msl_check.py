"""MSL checks that catch on Linux what only Apple's compiler would otherwise catch.

The simulator compiles the kernels as C++, which accepts things Metal rejects.
Two checks close part of that gap:

1. ``lint``: the MSL sources in ``kernels/`` must not use ``double``, ``std::``,
   dynamic allocation, exceptions, function pointers or recursion; and no
   transcendental (``exp2``, ``exp``, ``tanh``, ``log``, ``rsqrt``...) may be
   called outside the one helper of ``kernels/kvmetal_common.h`` that owns it
   (:data:`MATH_OWNERS`). The attention kernels build with relaxed (fast) math on
   macOS 15+, where a bare ``tanh`` is NaN past |x| ~ 44: the guarded forms live
   in the attention variant there, and every kernel, present and future, must
   go through them.
2. ``syntax``: the exact sources MLX would compile (captured from
   ``mx.fast.metal_kernel(..., verbose=True)`` while tracing the metal backend
   over every specialisation family, ``kvmetal.backends.specialisations``:
   element types, quantized formats and atom widths, register / shared /
   multi-pass mode, key-group widths, tile sizes, inputs bound as ``constant``)
   go through ``clang -fsyntax-only`` with
   a stub ``<metal_stdlib>`` that gives device / constant / threadgroup real
   address spaces, so a pointer in the wrong address space is an error here.

Usage: ``python tools/msl_check.py`` (exit status 1 on any finding). Needs clang
(Debian: ``apt-get install clang``) for the second check.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNELS = ROOT / "kernels"
STUB_DIR = Path(__file__).resolve().parent / "msl_stub"

FORBIDDEN = [
    (re.compile(r"\bdouble\b"), "double (Metal has no 64-bit float)"),
    (re.compile(r"\bstd::"), "std:: (no C++ standard library in MSL)"),
    (re.compile(r"\b(new|delete|malloc|calloc|free)\b\s*[\[(]?"), "dynamic allocation"),
    (re.compile(r"\b(throw|try|catch)\b"), "exceptions"),
    (re.compile(r"\(\s*\*\s*\w*\s*\)\s*\("), "function pointer"),
    (re.compile(r"\bvirtual\b"), "virtual functions"),
    (re.compile(r"\bgoto\b"), "goto"),
]


# Transcendentals and the one helper allowed to call each (None: no kernel may call it;
# add a guarded helper to kvmetal_common.h first). Everything else calls the helper.
MATH_OWNERS = {"exp2": "kv_exp2", "exp": None, "tanh": None, "log": None, "log2": None, "rsqrt": None,
               "pow": None, "powr": None, "exp10": None}
_MATH_CALL = re.compile(r"(?<![\w.])(" + "|".join(MATH_OWNERS) + r")\s*\(")


def _closing_brace(code: str, start: int) -> int:
    """The index of the brace closing the one at ``start`` (the end of ``code`` if none)."""
    depth = 0
    for i in range(start, len(code)):
        depth += code[i] == "{"
        depth -= code[i] == "}"
        if depth == 0:
            return i
    return len(code)


def _blank_owner_bodies(code: str) -> str:
    """``code`` with the bodies of the MATH_OWNERS helpers blanked (line numbers kept)."""
    for owner in filter(None, MATH_OWNERS.values()):
        for match in re.finditer(rf"\b{owner}\s*\([^;{{}}]*\)\s*\{{", code):
            end = _closing_brace(code, match.end() - 1)
            body = code[match.end():end]
            code = code[:match.end()] + re.sub(r"[^\n]", " ", body) + code[end:]
    return code


def _math_findings(path, code: str) -> list:
    findings = []
    for lineno, line in enumerate(_blank_owner_bodies(code).splitlines(), 1):
        for match in _MATH_CALL.finditer(line):
            owner = MATH_OWNERS[match.group(1)]
            where = f"call {owner}" if owner else "add a guarded helper to kernels/kvmetal_common.h"
            findings.append(f"{path}:{lineno}: bare {match.group(1)} (fast math; {where}): {line.strip()}")
    return findings


def strip_comments(text: str) -> str:
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def _function_bodies(code: str):
    """(name, body) of every top-level function definition (brace-matched)."""
    for match in re.finditer(r"\b(\w+)\s*\([^;{}]*\)\s*(const\s*)?\{", code):
        name = match.group(1)
        if name in ("if", "for", "while", "switch", "return", "sizeof"):
            continue
        yield name, code[match.end():_closing_brace(code, match.end() - 1)]


def lint(paths=None) -> list:
    """Findings ``path:line: message`` for the MSL rules above."""
    findings = []
    paths = paths or sorted(list(KERNELS.glob("*.metal")) + list(KERNELS.glob("*.h")))
    for path in paths:
        code = strip_comments(Path(path).read_text())
        for lineno, line in enumerate(code.splitlines(), 1):
            for pattern, what in FORBIDDEN:
                if pattern.search(line):
                    findings.append(f"{path}:{lineno}: {what}: {line.strip()}")
        for name, body in _function_bodies(code):
            if re.search(rf"\b{re.escape(name)}\s*(<[^;()]*>)?\s*\(", body):
                findings.append(f"{path}: function {name} calls itself (no recursion in MSL)")
        findings += _math_findings(path, code)
    return findings


# ----------------------------------------------------------------------------- generated sources

_DUMP_SCRIPT = r"""
import os, sys, tempfile
sys.path.insert(0, {root!r})
import mlx.core as mx
from kvmetal import quant
from kvmetal.backends import metal, specialisations
mx.contiguous = lambda x, *a, **k: x          # not exportable; irrelevant to the source
backend = metal.KernelBackend("msl-check", mx.fast.metal_kernel, call_options=lambda: dict(verbose=True))

def flat(out):
    res = []
    for o in (out if isinstance(out, tuple) else (out,)):
        res.extend(o.arrays() if isinstance(o, quant.QuantizedKV) else [o])
    return res

# One traced call per specialisation family (kvmetal/backends/specialisations.py, the one
# registry: decode, paged, varlen, cascade, cache write/gather/copy): the inputs are zeros
# of the family's shapes (the index arrays hold real values, which the host-planned varlen
# and cascade schedules read), captured as constants (sizes, and so MLX's `constant` vs
# `device` binding, are what they are in a real call).
for family in specialisations.specialisation_families():
    method, args, kwargs = specialisations.backend_call(family)
    print("family:", family.name, flush=True)
    fn = lambda anchor: flat(getattr(backend, method)(*args, **kwargs)) + [anchor]
    mx.export_function(os.path.join(tempfile.mkdtemp(), "f.mlxfn"), fn, mx.zeros((1,)))

"""


def generated_sources() -> dict:
    """{mlx kernel name#n: source} exactly as MLX generates them, one per distinct source,
    for the calls of every specialisation family (``specialisations.specialisation_families``)."""
    result = subprocess.run([sys.executable, "-c", _DUMP_SCRIPT.format(root=str(ROOT))],
                            capture_output=True, text=True, cwd=ROOT)
    if result.returncode != 0:
        raise RuntimeError(f"[msl_check] tracing the metal backend failed:\n{result.stderr[-4000:]}")
    sources, seen = {}, set()
    for match in re.finditer(r"Generated source code for `(\w+)`:\n```\n(.*?)\n```", result.stdout, re.S):
        if match.group(2) not in seen:
            seen.add(match.group(2))
            sources[match.group(1) + f"#{len(sources)}"] = match.group(2)
    return sources


def _clang_ready(source: str) -> str:
    """Rewrites what plain clang cannot read but Metal can.

    - function-scope `threadgroup T x[N];` becomes `static` (clang rejects an
      automatic variable in an address space; Metal allocates it per threadgroup);
    - MLX's explicit instantiation with `[[host_name]]` becomes an address-of,
      which instantiates the same specialisation.
    """
    source = re.sub(r"^(\s*)threadgroup\s+(\w+\s+\w+\s*\[)", r"\1static threadgroup \2", source, flags=re.M)
    source = re.sub(r"template \[\[host_name\(\"\w+\"\)\]\] \[\[kernel\]\] decltype\((\w+<[^;]*>)\) \w+<[^;]*>;",
                    r"static auto* kvcheck_instance = &\1;", source)
    return "#include <metal_stdlib>\n" + source


def syntax(sources: dict, clang: str = "clang") -> list:
    findings = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, source) in enumerate(sources.items()):
            path = Path(tmp) / f"k{i}.cpp"
            path.write_text(_clang_ready(source))
            cmd = [clang, "--target=aarch64-linux-gnu", "-x", "c++", "-std=c++14", "-fsyntax-only", "-fno-exceptions", "-nostdinc",
                   "-nostdinc++", f"-I{STUB_DIR}", "-Wno-unknown-attributes", "-Wno-ignored-attributes",
                   "-ferror-limit=5", str(path)]
            result = subprocess.run(cmd, capture_output=True, text=True)
            if result.returncode != 0:
                findings.append(f"{name}:\n{result.stderr[-3000:]}")
    return findings


def main() -> int:
    findings = lint()
    clang = shutil.which(os.environ.get("CLANG", "clang"))
    if clang is None:
        print("msl_check: clang not found; skipping the address-space syntax pass")
    else:
        sources = generated_sources()
        print(f"msl_check: {len(sources)} generated kernel sources")
        findings += syntax(sources, clang)
    for finding in findings:
        print(finding)
    print(f"msl_check: {len(findings)} finding(s)")
    return 1 if findings else 0


if __name__ == "__main__":
    sys.exit(main())
