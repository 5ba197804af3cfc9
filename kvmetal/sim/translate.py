"""MSL -> C++ pre-pass, and the C++ wrapper that binds buffers and attributes.

The pre-pass rewrites only what the compatibility header (runtime/msl.h)
cannot express, and keeps every line where it was, so a compile error points
at the MSL line that caused it:

- comments are blanked, ``#include <metal_*>`` dropped, ``[[...]]`` attributes removed;
- ``threadgroup T x[N];`` becomes a slot in the per-threadgroup arena;
- ``device T*`` / ``constant T*`` become checked pointers (``kmsl::dptr<T>`` /
  ``kmsl::cptr<T>``: distinct types, so a cast from one address space to the
  other fails to compile, as in Metal), ``device T&`` a checked reference,
  ``constant T&`` a ``const T&``;
- every index into a threadgroup array is bounds-checked;
- the remaining address-space keywords are removed;
- ``0.5h`` half literals, ``v.xy`` swizzles and ``reinterpret_cast`` are mapped;
- every barrier/collective call gets a call-site number;
- every `for`/`while` condition calls ``kmsl::tick()`` first (the watchdog's hook).
"""
from __future__ import annotations

import itertools
import re

from .signature import type_string

_TYPE = r"(?:metal::)?[A-Za-z_]\w*(?:::\w+)*(?:\s*<[^<>;()]*(?:<[^<>;()]*>[^<>;()]*)*>)?"

_COMMENT = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_METAL_INCLUDE = re.compile(r"^[ \t]*#[ \t]*include[ \t]*<metal_\w+>[ \t]*$", re.M)
_INSTANTIATION = re.compile(r"^template \[\[host_name\(.*$", re.M)
_ATTRIBUTE = re.compile(r"\[\[[^\[\]]*\]\]")
_DECLARATOR = r"[A-Za-z_]\w*\s*(?:\[[^\];]+\]\s*)*"
_TG_DECL = re.compile(
    r"\bthreadgroup\s+(?P<type>(?:const\s+)?" + _TYPE + r")\s+"
    r"(?P<decls>" + _DECLARATOR + r"(?:,\s*" + _DECLARATOR + r")*);"
)
_ONE_DECLARATOR = re.compile(r"(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\];]+\]\s*)*)")
# A threadgroup variable the rewrite did not turn into arena storage (not a pointer/reference).
_TG_LEFTOVER = re.compile(r"\bthreadgroup\s+(?:const\s+)?" + _TYPE + r"\s+[A-Za-z_]\w*\s*[\[;,=]")
_ADDR_PTR = re.compile(
    r"(?P<pre>\bconst\s+)?\b(?P<space>device|constant)\s+(?P<c1>const\s+)?(?P<vol>volatile\s+)?"
    r"(?P<type>" + _TYPE + r")(?P<c2>\s+const)?\s*(?P<kind>[*&])"
)
_ADDR_WORD = re.compile(r"\b(?:device|constant|threadgroup|thread)\b[ \t]*")
_HALF_LITERAL = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)h\b")
_SWIZZLE = re.compile(r"\.([xyzw]{2,4}|[rgba]{2,4})\b")
_REINTERPRET = re.compile(r"\breinterpret_cast\s*<")
_SYNC_CALL = re.compile(
    r"(?P<prev>[A-Za-z_]\w*\s+)?\b(?:metal::)?(?P<fn>"
    r"simd_(?:sum|product|max|min|and|or|xor|prefix_(?:in|ex)clusive_(?:sum|product)"
    r"|shuffle(?:_xor|_up|_down|_rotate_down|_rotate_up)?|broadcast(?:_first)?|ballot|all|any"
    r"|active_threads_mask|is_first)"
    r"|quad_(?:sum|product|max|min|shuffle(?:_xor|_up|_down)?|broadcast)"
    r"|threadgroup_barrier|simdgroup_barrier"
    r"|simdgroup_(?:load|store|multiply_accumulate|multiply))\s*\((?P<empty>\s*\))?")
_CALL_KEYWORDS = {"return", "else", "case", "do", "co_return", "co_yield", "throw"}

_COMPONENT = {"x": 0, "y": 1, "z": 2, "w": 3, "r": 0, "g": 1, "b": 2, "a": 3}


class UnsupportedMSL(Exception):
    """MSL the pre-pass cannot translate faithfully; `line` is 1-based in the MSL text."""

    def __init__(self, message: str, line: int):
        super().__init__(message)
        self.line = line


def _blank(match: re.Match) -> str:
    # Keep newlines so line numbers survive.
    return re.sub(r"[^\n]", " ", match.group(0))


def _declarators(decls: str) -> list:
    """[(name, dims text)] of `a[N], b[M][K], c`."""
    return [(d.group("name"), re.sub(r"\s+", "", d.group("dims"))) for d in _ONE_DECLARATOR.finditer(decls)]


def _threadgroup_decl(counter):
    def sub(m: re.Match) -> str:
        out = []
        for name, dims in _declarators(m.group("decls")):
            slot = next(counter)
            out.append(f'auto& {name} = *kmsl::tg_array<{m.group("type")}{dims}>({slot}, "{name}");')
        return " ".join(out)
    return sub


def _matching(s: str, open_pos: int, open_ch: str = "[", close_ch: str = "]") -> int:
    """Index of the bracket closing the one at ``open_pos`` (-1 if unbalanced)."""
    depth = 0
    for j in range(open_pos, len(s)):
        if s[j] == open_ch:
            depth += 1
        elif s[j] == close_ch:
            depth -= 1
            if depth == 0:
                return j
    return -1


def _check_tg_indices(s: str, arrays: dict) -> str:
    """Wrap every index of a threadgroup array in a bounds check: `buf[i]` ->
    `buf[kmsl::tg_index(i, N, "buf")]`. The array keeps its C++ type, so it
    still decays to a pointer and deduces in templates like the MSL original."""
    if not arrays:
        return s
    pat = re.compile(r"\b(" + "|".join(map(re.escape, arrays)) + r")\s*\[")
    starts = {name: s.find(f"auto& {name} = *kmsl::tg_array") for name in arrays}
    out, i = [], 0
    while True:
        m = pat.search(s, i)
        if not m:
            out.append(s[i:])
            return "".join(out)
        name = m.group(1)
        if m.start() < starts[name]:
            out.append(s[i:m.end()])
            i = m.end()
            continue
        out.append(s[i:m.end() - 1])
        pos, dims = m.end() - 1, arrays[name]
        for k, extent in enumerate(dims):
            close = _matching(s, pos)
            if close < 0:
                break
            inner = _check_tg_indices(s[pos + 1:close], arrays)
            out.append(f'[kmsl::tg_index({inner}, ({extent}), "{name}")]')
            pos = close + 1
            nxt = re.match(r"\s*\[", s[pos:])
            if k + 1 >= len(dims) or not nxt:
                break
            out.append(s[pos:pos + nxt.end() - 1])
            pos += nxt.end() - 1
        i = pos


def _address_space(m: re.Match) -> str:
    const = bool(m.group("pre") or m.group("c1") or m.group("c2")) or m.group("space") == "constant"
    t = m.group("type")
    if m.group("kind") == "*":
        ptr = "cptr" if m.group("space") == "constant" else "dptr"
        return f"kmsl::{ptr}<{'const ' if const else ''}{t}> "
    return f"const {t}& " if const else f"kmsl::dref<{t}> "


def _number_sync_calls(counter):
    """Give every barrier/collective call its own site number: `simd_sum(x)` ->
    `simd_sum(kmsl::site_t(7), x)`. Definitions (`T simd_sum(T x)`) are left alone."""
    def sub(m: re.Match) -> str:
        prev = m.group("prev")
        if prev and prev.strip() not in _CALL_KEYWORDS:
            return m.group(0)
        site = f"kmsl::site_t({next(counter)})"
        head = m.group(0)[: m.group(0).index("(") + 1]
        return head + (site + ")" if m.group("empty") else site + ", ")
    return sub


_LOOP = re.compile(r"\b(for|while)\s*\(")


def _top_level_semicolons(text: str) -> list:
    depth, out = 0, []
    for j, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == ";" and depth == 0:
            out.append(j)
    return out


def _tick_loops(s: str) -> str:
    """`for (a; c; i)` -> `for (a; kmsl::tick() && (c); i)`, `while (c)` -> `while (kmsl::tick() && (c))`:
    a loop that never ends reaches the watchdog. Range-for loops are finite and left alone."""
    out, i = [], 0
    for m in _LOOP.finditer(s):
        if m.start() < i:
            continue
        open_pos = m.end() - 1
        close = _matching(s, open_pos, "(", ")")
        if close < 0:
            continue
        head = s[open_pos + 1:close]
        if m.group(1) == "while":
            new = f"kmsl::tick() && ({head})"
        else:
            semis = _top_level_semicolons(head)
            if len(semis) != 2:
                continue
            cond = head[semis[0] + 1:semis[1]]
            new_cond = f" kmsl::tick() && ({cond})" if cond.strip() else " kmsl::tick()"
            new = head[:semis[0] + 1] + new_cond + head[semis[1]:]
        out.append(s[i:open_pos + 1])
        out.append(_tick_loops(new) if _LOOP.search(new) else new)
        out.append(")")
        i = close + 1
    out.append(s[i:])
    return "".join(out)


def _swizzle(m: re.Match) -> str:
    idx = ",".join(str(_COMPONENT[c]) for c in m.group(1))
    return f".swz(kmsl::sw<{idx}>{{}})"


def translate(msl: str) -> str:
    """Rewrite MLX-generated Metal source into C++ for runtime/msl.h (same line count)."""
    s = _COMMENT.sub(_blank, msl)
    s = _METAL_INCLUDE.sub("", s)
    s = _INSTANTIATION.sub("", s)
    s = _ATTRIBUTE.sub("", s)
    arrays = {name: re.findall(r"\[([^\]]+)\]", dims)
              for m in _TG_DECL.finditer(s) for name, dims in _declarators(m.group("decls"))}
    s = _TG_DECL.sub(_threadgroup_decl(itertools.count()), s)
    left = _TG_LEFTOVER.search(s)
    if left:
        line = s.count("\n", 0, left.start()) + 1
        raise UnsupportedMSL("unsupported threadgroup declaration (use `threadgroup T name[N];`)", line)
    s = _check_tg_indices(s, {name: dims for name, dims in arrays.items() if dims})
    s = _ADDR_PTR.sub(_address_space, s)
    s = _ADDR_WORD.sub("", s)
    s = _HALF_LITERAL.sub(r"((metal::half)(\1))", s)
    s = _SWIZZLE.sub(_swizzle, s)
    s = _REINTERPRET.sub("kmsl::kmsl_cast<", s)
    s = _SYNC_CALL.sub(_number_sync_calls(itertools.count()), s)
    s = _tick_loops(s)
    return s


def _attr_value(attr: str, msl_type: str) -> str:
    src = {"grid_size": "threads_per_grid"}.get(attr, attr)
    if attr == "grid_origin":
        return "metal::uint3(0u, 0u, 0u)"
    if attr == "thread_execution_width":
        return "32u"
    if msl_type == "uint3":
        return f"metal::uint3(a->{src}[0], a->{src}[1], a->{src}[2])"
    return f"a->{src}"


def cpp_source(msl: str, func_name: str, params, template, attrs, *, file_name: str,
               fast_math: bool = False) -> str:
    """The whole C++ translation unit: header include, translated kernel, C entry point.

    ``params`` lists the buffer parameters in MLX's order as (kind, c_type) with
    kind in {"ptr", "cptr", "scalar", "out"} (cptr: a `constant` buffer); counter
    index = position in this list. ``fast_math``: metal::tanh/exp/exp2/log/rsqrt
    follow Metal's fast formulas (runtime/msl_math.h), as under a "relaxed" or
    "fast" math mode.
    """
    args = []
    for k, (kind, ctype) in enumerate(params):
        if kind == "scalar":
            args.append(f"*(const {ctype}*)(c[{k}].buf->data + c[{k}].buf->start)")
        elif kind == "out":
            args.append(f"kmsl::dptr<{ctype}>(&c[{k}])")
        elif kind == "cptr":
            args.append(f"kmsl::cptr<const {ctype}>(&c[{k}])")
        else:
            args.append(f"kmsl::dptr<const {ctype}>(&c[{k}])")
    args += [_attr_value(a, t) for a, t in attrs]
    targs = ""
    if template:
        vals = []
        for _, v in template:
            if isinstance(v, bool):
                vals.append("true" if v else "false")
            elif isinstance(v, int):
                vals.append(str(v))
            else:
                vals.append(type_string(v))
        targs = "<" + ", ".join(vals) + ">"
    call_args = ",\n      ".join(args)
    return (
        ("#define KMSL_FAST_MATH 1\n" if fast_math else "")
        + '#include "msl.h"\n'
        "using namespace metal;\n"
        "namespace kmsl_user {\n"
        "using namespace metal;\n"
        f'#line 1 "{file_name}"\n'
        f"{translate(msl)}\n"
        "}  // namespace kmsl_user\n"
        '#line 100000 "kvmetal-sim-wrapper.cpp"\n'
        'extern "C" void kmsl_entry(const KmslAttrs* a, KmslCounter* c) {\n'
        f"  kmsl_user::{func_name}{targs}(\n      {call_args});\n"
        "}\n"
    )
