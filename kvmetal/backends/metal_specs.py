"""The specialisation table of the Metal kernels: every kernel described once
(:data:`SPECS`: name, family file, inputs, outputs, template parameters, grid and
threadgroup as a function of the shapes), the int32 parameter structs they read, the math
mode they are built with, and their sources (``kernels/<family>.metal``: a helper section,
then one ``//@kernel NAME`` body each). The metal backend and the simulator both build
kernels from these descriptions (metal.py's KernelBackend).
"""
from __future__ import annotations

import functools
import math
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from .metal_layout import largest_pow2_divisor

DTYPE_TAGS = {mx.float16: "f16", mx.bfloat16: "bf16", mx.float32: "f32", mx.uint32: "u32", mx.int32: "i32"}

# ----------------------------------------------------------------------------- kernel parameters

@dataclass(frozen=True)
class ParamStruct:
    """An MSL struct of 4-byte fields read from an int32 buffer (kvmetal_common.h)."""

    name: str
    fields: tuple  # ((name, "i" | "f"), ...) in the struct's order

    def pack(self, **values) -> mx.array:
        """The int32 buffer of the struct (floats bit for bit), at least 8 entries long
        (MLX binds shorter inputs as `constant`). Unset fields are 0."""
        unknown = set(values) - {n for n, _ in self.fields}
        if unknown:
            raise TypeError(f"[metal] {self.name} has no field(s) {sorted(unknown)}")
        words = np.zeros(max(8, len(self.fields)), dtype=np.int32)
        for i, (name, kind) in enumerate(self.fields):
            value = values.get(name, 0)
            words[i] = np.array(value, dtype=np.float32).view(np.int32) if kind == "f" else int(value)
        return mx.array(words)


ATTENTION_PARAMS = ParamStruct("KvAttnParams", (
    ("num_kv_heads", "i"), ("num_heads", "i"), ("query_len", "i"), ("num_splits", "i"), ("max_blocks", "i"),
    ("num_blocks", "i"), ("window", "i"), ("num_tokens", "i"), ("scale", "f"), ("softcap", "f"),
    ("head_div", "i"), ("sparse_v", "f"), ("split_tokens", "i"), ("split_max", "i"), ("split_div", "i"),
    ("split_grow", "i")))
GATHER_PARAMS = ParamStruct("KvGatherParams", (
    ("num_kv_heads", "i"), ("max_blocks", "i"), ("max_len", "i"), ("num_blocks", "i")))


# ----------------------------------------------------------------------------- descriptions

@dataclass(frozen=True)
class Geometry:
    grid: tuple                 # threads, as mx.fast.metal_kernel counts them
    threadgroup: tuple
    threadgroup_bytes: int = 0  # static threadgroup memory the body declares

    @property
    def threads_per_threadgroup(self) -> int:
        return math.prod(self.threadgroup)

    @property
    def threadgroups(self) -> int:
        return math.prod(-(-g // t) for g, t in zip(self.grid, self.threadgroup))


@dataclass(frozen=True)
class KernelSpec:
    """One kernel, described once for the metal backend and the simulator."""

    name: str
    family: str                 # kernels/<family>.metal
    inputs: tuple
    outputs: tuple
    template: tuple             # template parameter names, in order
    geometry: Callable          # (**shape) -> Geometry
    row_contiguous: bool = True  # False: the body reads <input>_strides
    math_mode: str = "safe"      # mx.fast.metal_kernel compile_options["math_mode"]
    uses: tuple = ()             # families whose helper sections the header includes first

    def variant(self, template_values: dict) -> str:
        """The kernel name spelled with its specialisation (shown by verbose=True and GPU captures)."""
        parts = []
        for key in self.template:
            value = template_values[key]
            if isinstance(value, mx.Dtype):
                parts.append(f"{key.lower()}{DTYPE_TAGS[value]}")
            else:
                parts.append(f"{key.lower()}{int(value)}")
        return "kvmetal_" + self.name + "_" + "_".join(parts)


def _attention_geometry(*, splits, num_kv_heads, num_seqs, layout):
    return Geometry(grid=(splits * layout.threads, num_kv_heads, num_seqs), threadgroup=(layout.threads, 1, 1),
                    threadgroup_bytes=layout.threadgroup_bytes)


# TQ: the query's dtype (its register share keeps it); PF: register mode loads the next pass's
# K/V a pass ahead (1) or in the pass (0: AttentionLayout.prefetch); SV: 1 compiles sparse V
# (kv_pass_sparse; threshold KvAttnParams.sparse_v), 0 the exact path; TP: the part_acc
# output's dtype (float32, or 16-bit normalized: metal_layout.partials_dtype).
_ATTENTION_TEMPLATE = ("TQ", "TK", "TV", "D", "G", "QL", "NSG", "RPS", "LPK", "TT", "KBITS", "KGS", "KAW", "VBITS",
                       "VGS", "VAW", "PF", "SV", "TP")
_KV_INPUTS = ("key_data", "key_scales", "key_biases", "value_data", "value_scales", "value_biases")
_PARTIALS = ("part_max", "part_sum", "part_acc")
# Attention math mode: "relaxed" lets Metal use its fast exp2/tanh and contract
# multiply-adds, while keeping IEEE infinities and NaN. The kernels need no
# infinity (KV_NEG_BIG is finite; masked probabilities are selected to 0), but
# NaN must survive: a NaN-poisoned slot that a kernel wrongly reads then shows
# in the output (the tests' check), where "fast" may assume NaN away. The cache
# write kernels stay "safe" so their rounding matches mx.quantize bit for bit.
# MLX accepts "relaxed" only on macOS 15+; below, the backend builds them "safe"
# (math_mode_for). Under "relaxed" the math functions are Metal's fast ones, so
# the kernels use only guarded forms (kv_tanh: fast tanh is NaN past |x| ~ 44).
ATTENTION_MATH_MODE = "relaxed"
RELAXED_MATH_MIN_MACOS = 15
LINUX_MACOS = 15   # the macOS the metal backend assumes off a Mac (sim, msl_check)


def default_macos_version() -> int:
    """The macOS major version: ``platform.mac_ver()`` on a Mac, LINUX_MACOS elsewhere."""
    release = platform.mac_ver()[0]
    try:
        return int(release.split(".")[0]) if release else LINUX_MACOS
    except ValueError:
        return LINUX_MACOS


def math_mode_for(spec_mode: str, macos: int) -> str:
    """The math mode a kernel is built with on ``macos``: "relaxed" falls back to "safe" below 15."""
    return "safe" if spec_mode == "relaxed" and macos < RELAXED_MATH_MIN_MACOS else spec_mode

SPECS = {
    spec.name: spec
    for spec in (
        KernelSpec("paged_attention_partials", "attention",
                   ("query",) + _KV_INPUTS + ("block_tables", "seq_lens", "params"), _PARTIALS,
                   _ATTENTION_TEMPLATE[:5] + ("BS",) + _ATTENTION_TEMPLATE[5:], _attention_geometry,
                   math_mode=ATTENTION_MATH_MODE),
        KernelSpec("decode_attention_partials", "attention",
                   ("query",) + _KV_INPUTS + ("params",), _PARTIALS,
                   _ATTENTION_TEMPLATE, _attention_geometry, row_contiguous=False, math_mode=ATTENTION_MATH_MODE),
        KernelSpec("attention_reduce", "attention",
                   _PARTIALS + ("sinks", "params"), ("out",), ("TQ", "TP", "D", "HAS_SINKS"),
                   lambda *, rows: Geometry(grid=(rows * 32, 1, 1), threadgroup=(32, 1, 1)),
                   math_mode=ATTENTION_MATH_MODE),
        KernelSpec("cache_rows_convert", "cache_write", ("new_rows",), ("rows_out",),
                   ("TC", "D"),
                   lambda *, tokens, num_kv_heads, head_dim: Geometry(
                       grid=(head_dim // 4, num_kv_heads, tokens), threadgroup=(head_dim // 4, 1, 1))),
        KernelSpec("cache_rows_quantize", "cache_write", ("new_rows",),
                   ("words_out", "scales_out", "biases_out"), ("TC", "D", "BITS", "GS"),
                   lambda *, tokens, num_kv_heads, groups: Geometry(
                       grid=(groups, num_kv_heads, tokens), threadgroup=(groups, 1, 1))),
        KernelSpec("gather_kv_rows", "cache_copy",
                   ("cache_data", "cache_scales", "cache_biases", "block_tables", "seq_lens", "params"),
                   ("rows_out",), ("TE", "D", "BS", "BITS", "GS"),
                   lambda *, tasks, max_len, num_rows: Geometry(
                       grid=(tasks, max_len, num_rows), threadgroup=(tasks, 1, 1))),
        KernelSpec("copy_blocks_gather", "cache_copy", ("blocks", "src"), ("blocks_out",), ("T",),
                   lambda *, width, count: Geometry(grid=(width, count, 1),
                                                    threadgroup=(largest_pow2_divisor(width, 256), 1, 1))),
        # The tiled varlen kernel (kernels/varlen.metal).
        KernelSpec("paged_varlen_partials", "varlen",
                   ("query",) + _KV_INPUTS + ("block_tables", "seq_lens", "tiles", "params"), _PARTIALS,
                   ("TQ", "TK", "TV", "D", "G", "BS", "NSG", "BK", "KT", "RF", "DS", "SKV", "KBITS", "KGS", "VBITS",
                    "VGS"),
                   lambda *, num_tiles, num_kv_heads, splits, tiles, threadgroup_bytes: Geometry(
                       grid=(num_tiles * tiles.threads, num_kv_heads, splits), threadgroup=(tiles.threads, 1, 1),
                       threadgroup_bytes=threadgroup_bytes),
                   math_mode=ATTENTION_MATH_MODE),
        # Shared-prefix decode (kernels/cascade.metal, metal_cascade.py): the partials kernel
        # takes paged_attention_partials' inputs and template; the reduce folds the prefix
        # and own partials of each row.
        KernelSpec("cascade_partials", "cascade",
                   ("query",) + _KV_INPUTS + ("block_tables", "seq_lens", "params"), _PARTIALS,
                   _ATTENTION_TEMPLATE[:5] + ("BS",) + _ATTENTION_TEMPLATE[5:], _attention_geometry,
                   math_mode=ATTENTION_MATH_MODE, uses=("attention",)),
        KernelSpec("cascade_reduce", "cascade",
                   ("prefix_max", "prefix_sum", "prefix_acc", "own_max", "own_sum", "own_acc", "slot_of", "sinks",
                    "params"), ("out",), ("TQ", "TP", "D", "HAS_SINKS"),
                   lambda *, rows: Geometry(grid=(rows * 32, 1, 1), threadgroup=(32, 1, 1)),
                   math_mode=ATTENTION_MATH_MODE, uses=("attention",)),
    )
}


CASCADE_REDUCE_PARAMS = ParamStruct("KvCascadeReduceParams", (
    ("num_heads", "i"), ("prefix_splits", "i"), ("own_splits", "i"), ("prefix_slots", "i"), ("num_seqs", "i"),
    ("pad0", "i"), ("pad1", "i"), ("pad2", "i")))


# ----------------------------------------------------------------------------- sources

def kernel_dirs() -> list:
    """Where the .metal files live: inside the installed package, then the source tree."""
    here = Path(__file__).resolve().parent.parent
    return [here / "kernels", here.parent / "kernels"]


def _find(filename: str) -> Path:
    for directory in kernel_dirs():
        if (directory / filename).is_file():
            return directory / filename
    raise FileNotFoundError(f"[metal] {filename} not found in {[str(d) for d in kernel_dirs()]}")


_KERNEL_MARK = re.compile(r"^//@kernel\s+(\w+)\s*$", re.M)


@functools.lru_cache(maxsize=None)
def family_source(family: str) -> tuple:
    """(helper section, {kernel name: body}) of ``kernels/<family>.metal``."""
    text = _find(f"{family}.metal").read_text()
    marks = list(_KERNEL_MARK.finditer(text))
    helpers = text[: marks[0].start()] if marks else text
    bodies = {}
    for i, mark in enumerate(marks):
        end = marks[i + 1].start() if i + 1 < len(marks) else len(text)
        bodies[mark.group(1)] = text[mark.end():end].strip("\n") + "\n"
    return helpers, bodies


@functools.lru_cache(maxsize=None)
def kernel_text(name: str) -> tuple:
    """(header, body) handed to metal_kernel for the kernel ``name``."""
    spec = SPECS[name]
    helpers, bodies = family_source(spec.family)
    if name not in bodies:
        raise KeyError(f"[metal] kernels/{spec.family}.metal has no '//@kernel {name}' body")
    common = _find("kvmetal_common.h").read_text()
    used = "".join(family_source(family)[0] + "\n" for family in spec.uses)
    return common + "\n" + used + helpers, bodies[name]
