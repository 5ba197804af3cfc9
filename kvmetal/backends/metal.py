"""The metal backend: hand-written kernels in ``kernels/*.metal``, launched with
``mx.fast.metal_kernel``; and the sim backend: the very same launches built with
``kvmetal.sim.metal_kernel`` and run on the CPU.

Every kernel is described once below (:data:`SPECS`: name, family file, inputs,
outputs, template parameters, and grid/threadgroup as a function of the shapes).
A :class:`KernelBackend` turns the descriptions into kernel objects with one
``make_kernel`` function (MLX's or the simulator's), builds each specialisation
once per process and implements the five contract functions of
``kvmetal.backends``. Arguments arrive checked and normalised by ``kvmetal.ops``.

Dimension glossary: S sequences, B batch, H query heads, Hkv kv heads, G = H / Hkv,
D head_dim, N cache blocks, BS block size, M block-table width, T tokens.
"""
from __future__ import annotations

import functools
import math
import os
import platform
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import mlx.core as mx
import numpy as np

from .. import chips
from ..quant import QuantizedKV, packed_words
from . import MIN_TOKENS_PER_SPLIT, VARLEN_SHORT_RUN
from .metal_cascade import plan as cascade_plan

# ----------------------------------------------------------------------------- tuning

REGISTER_SIMDGROUPS = 4             # simdgroups per threadgroup in register mode (128 threads)
ROW_REGISTER_LIMIT = 8              # query rows (G x L) one simdgroup keeps in registers
# Shared mode: at most this many simdgroups (384 threads, chips.PIPELINE_THREAD_LIMIT:
# what M1/M2 allow a register-heavy pipeline); more rows take several passes over the split.
MAX_SHARED_SIMDGROUPS = chips.PIPELINE_THREAD_LIMIT // 32
SHARED_ROW_LIMIT = 16               # shared mode: most query rows one simdgroup serves (registers permitting)
# Register mode: 32-bit registers per lane for the rows' q + accumulators (the launch is 128
# threads, within what chips.max_threads_for_registers allows at any estimate in the table).
REGISTER_BUDGET = 128
# Register mode is taken while the estimate (estimated_registers) stays within this; past
# it (3/5/6-bit atoms at several rows) the rows go to shared mode. The common layouts
# estimate 150-240; whether spilling past Apple's per-thread registers beats shared mode's
# tiles is for a Mac to settle (docs/kernels.md, "Threads and registers").
REGISTER_MODE_LIMIT = 256
LANES_PER_KEY = (4, 8, 16, 32)      # candidate key-group widths, narrowest first
TILE_MEMORY_BUDGET = {128: 8 * 1024 - 512, 256: 16 * 1024 - 512}  # shared-mode K/V tiles, by max head_dim
MAX_TILE_TOKENS = 16
SPLIT_UNIT = 32                     # splits cut the tokens in whole units of this many (kernels: kv_split_range)
# Occupancy model of one Apple GPU core (assumed; Apple documents neither): the
# threadgroup memory and threads resident at once, and a cap on threadgroups.
CORE_THREADGROUP_MEMORY = 64 * 1024
CORE_THREADS = 2048
CORE_MAX_THREADGROUPS = 16
FALLBACK_GPU_CORES = 10             # base M-series GPU; used where Metal reports nothing
MAX_SPLITS = 64
# How automatic splits are cut (docs/kernels.md, "Splits"): "windows" (default) cuts every
# sequence at the multiples of SPLIT_TOKENS, so its partials and their fold never depend
# on the batch (batch invariance by construction); "occupancy" (KVMETAL_METAL_SPLITS=
# occupancy) picks a split count per launch to fill the GPU (choose_num_splits), as
# kvmetal did before: fewer, longer splits for big batches, but a sequence's bits then
# follow its batch. Which is faster on a big batch is for `kvmetal bench` on a Mac to say.
SPLIT_TOKENS = MIN_TOKENS_PER_SPLIT
# Length-dependent windows (issue 41, P4): a sequence of length len is cut into windows of
# clamp(pow2ceil(len) / SPLIT_WINDOW_DIV, SPLIT_TOKENS, SPLIT_WINDOW_MAX) tokens (powers of
# two; KvAttnParams.split_div / split_max): a function of the sequence alone, so batch
# invariance holds, and a long sequence writes fewer partials (32K: 32 windows of 1024, not
# 128 of 256). Up to 8192 tokens nothing changes. SPLIT_WINDOW_DIV = 0 restores fixed
# windows of SPLIT_TOKENS. Which window is fastest (fewer partials against fewer
# threadgroups for small batches) only a Mac can say: `kvmetal bench` compares them there.
SPLIT_WINDOW_DIV = 32
SPLIT_WINDOW_MAX = 2048
# The varlen (prefill) kernel's windows are longer: its partials hold every query row of
# a chunk (rows x splits x D floats), and a row's K/V tiles in one window are already
# independent of its chunk, so windows only add parallelism for chunks of few tiles. At
# 4096 a 2K-token chunk at 32K context writes 8 splits of partials (268 MB at 32 heads,
# D 128; about 1.5% of its K/V traffic).
VARLEN_SPLIT_TOKENS = 4096
SPLIT_POLICIES = ("windows", "occupancy")

DTYPE_TAGS = {mx.float16: "f16", mx.bfloat16: "bf16", mx.float32: "f32", mx.uint32: "u32", mx.int32: "i32"}


def gpu_core_count() -> int:
    """GPU cores from MLX's device info (by chip name), else FALLBACK_GPU_CORES."""
    if not mx.metal.is_available():
        return FALLBACK_GPU_CORES
    info = chips.metal_device_info()
    for key in ("gpu_core_count", "num_gpu_cores", "core_count"):
        if isinstance(info.get(key), int) and info[key] > 0:
            return info[key]
    chip = chips.from_device_name(info.get("device_name", ""))
    return chip.gpu_cores if chip is not None else FALLBACK_GPU_CORES


def threadgroups_per_core(threadgroup_bytes: int, threads: int) -> int:
    """Threadgroups of one kernel resident on a GPU core at once, from what each one
    declares (threadgroup memory) and runs (threads), under the occupancy model above."""
    by_memory = CORE_THREADGROUP_MEMORY // threadgroup_bytes if threadgroup_bytes else CORE_MAX_THREADGROUPS
    by_threads = CORE_THREADS // max(1, threads)
    return max(1, min(by_memory, by_threads, CORE_MAX_THREADGROUPS))


def choose_num_splits(work_tokens: int, parallel_groups: int, *, cores: int | None = None,
                      threadgroup_bytes: int = 0, threads: int = 128) -> int:
    """KV splits per (sequence, kv head) so that the launch fills the GPU.

    Aims at the threadgroups that fit per core (threadgroups_per_core) across
    the ``parallel_groups`` (sequences x kv heads), but never gives a split
    fewer than MIN_TOKENS_PER_SPLIT of the ``work_tokens`` (an upper bound of
    the tokens one sequence attends to).
    """
    cores = gpu_core_count() if cores is None else cores
    resident = threadgroups_per_core(threadgroup_bytes, threads) * cores
    wanted = math.ceil(resident / max(1, parallel_groups))
    useful = math.ceil(work_tokens / MIN_TOKENS_PER_SPLIT)
    return max(1, min(wanted, useful, MAX_SPLITS))


def split_policy() -> str:
    policy = os.environ.get("KVMETAL_METAL_SPLITS", "windows")
    if policy not in SPLIT_POLICIES:
        raise ValueError(f"KVMETAL_METAL_SPLITS must be one of {SPLIT_POLICIES}, got {policy!r}")
    return policy


def window_splits(work_tokens: int, split_tokens: int, *, misaligned: bool, split_max: int = 0,
                  split_div: int = 0) -> int:
    """Splits a launch needs so that every sequence's windows fit: a live range of at most
    ``work_tokens`` spans that many windows of ``split_tokens`` (with ``split_div`` > 0:
    of each length's own window, split_window), one more when it may start inside one (a
    sliding window's first visible key)."""
    work = max(1, work_tokens)
    if split_div <= 0:
        return max(1, -(-work // split_tokens) + int(misaligned))
    # The most windows over lengths n <= work: for the lengths sharing a window w (those
    # up to the next doubling of w's reach), the longest of them needs the most.
    most, n = 0, 1
    while True:
        w = split_window(n, split_tokens, split_max, split_div)
        reach = w * split_div if w < split_max else work  # longest length with window w
        most = max(most, -(-min(work, reach) // w))
        if reach >= work:
            break
        n = reach + 1
    return max(1, most + int(misaligned))


def _window_fields(split_tokens: int) -> dict:
    """KvAttnParams' split_max / split_div of a launch cut in windows (split_tokens > 0)."""
    if split_tokens <= 0:
        return dict(split_max=0, split_div=0)
    return dict(split_max=SPLIT_WINDOW_MAX, split_div=SPLIT_WINDOW_DIV)


def split_window(length: int, split_tokens: int, split_max: int, split_div: int) -> int:
    """The window of a sequence of ``length`` tokens (attention.metal's kv_split_window)."""
    w = split_tokens
    while split_div > 0 and w < split_max and w * split_div < length:
        w *= 2
    return w


@dataclass(frozen=True)
class AttentionLayout:
    """How a partial kernel maps rows and keys to lanes (template parameters).

    Register mode (rows_per_simdgroup == rows): every simdgroup holds all G x L
    rows and owns a token run of the split. Shared mode: simdgroups split the
    rows and share tiles of ``tile`` tokens through threadgroup memory.
    """

    simdgroups: int
    rows_per_simdgroup: int
    lanes_per_key: int
    tile: int                 # shared mode: tile tokens; 0 in register mode
    key_atom_words: int       # packed words per lane atom (0: float cache)
    value_atom_words: int
    threadgroup_bytes: int
    rows: int = 0             # G x L

    @property
    def threads(self) -> int:
        return self.simdgroups * 32

    def registers(self, *, head_dim: int, k_bits: int, v_bits: int, sparse_v: bool = False) -> int:
        """Estimated live registers per lane (:func:`estimated_registers`) of this layout."""
        return _partials_registers(head_dim, self.rows, self.rows_per_simdgroup, self.lanes_per_key, k_bits,
                                   self.key_atom_words, v_bits, self.value_atom_words, sparse_v)

    @property
    def row_passes(self) -> int:
        """Walks over the split (shared mode past MAX_SHARED_SIMDGROUPS x 8 rows: K/V read that often)."""
        return max(1, -(-self.rows // (self.simdgroups * self.rows_per_simdgroup)))


def _atom_words(head_dim: int, bits: int, group_size: int, lanes_per_key: int) -> int:
    """Packed words per atom: whole words of whole values inside one group; for
    2/4/8 bits up to a uint4 load while each key-group lane still gets an atom."""
    if not bits:
        return 0
    width = head_dim * bits // 32
    group_words = group_size * bits // 32
    if bits in (2, 4, 8):
        for words in (4, 2, 1):
            if width % words == 0 and words <= group_words and width // words >= lanes_per_key:
                return words
        return 1
    values = 32 // math.gcd(bits, 32)  # 3, 5 bits: 32 values; 6 bits: 16
    return values * bits // 32


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def attention_threadgroup_bytes(*, head_dim, rows, simdgroups, rows_per_simdgroup, tile, k_row_bytes, v_row_bytes,
                                k_scale_bytes, v_scale_bytes) -> int:
    """Threadgroup memory the partial kernels declare (mirrors KV_ATTN_THREADGROUP_ARRAYS).

    *_row_bytes: bytes of one cache row's data; *_scale_bytes: of its scales (0: float cache)."""
    shared = rows_per_simdgroup < rows
    merge = not shared and simdgroups > 1
    stats = 4 * (simdgroups * rows_per_simdgroup * 2 if merge else 1)
    acc = 4 * ((simdgroups - 1) * head_dim if merge else 1)

    def tile_bytes(row_bytes):
        return 16 * (-(-2 * tile * row_bytes // 16) if shared else 1)

    total = _round16(stats) + _round16(acc) + tile_bytes(k_row_bytes) + tile_bytes(v_row_bytes)
    total += 2 * (tile_bytes(k_scale_bytes) if k_scale_bytes else 16)
    total += 2 * (tile_bytes(v_scale_bytes) if v_scale_bytes else 16)
    total += _round16(4 * (2 * tile if shared else 1))
    return total


def _partials_registers(head_dim: int, rows: int, per: int, lanes: int, k_bits: int, k_atom_words: int, v_bits: int,
                        v_atom_words: int, sparse_v: bool = False) -> int:
    """:func:`estimated_registers` of a partials kernel serving ``rows`` rows, ``per`` per simdgroup."""
    return estimated_registers("paged_attention_partials", dict(
        D=head_dim, RPS=per, LPK=lanes, KBITS=k_bits, VBITS=v_bits, KAW=k_atom_words, VAW=v_atom_words, G=rows, QL=1,
        SV=int(sparse_v)))


@functools.lru_cache(maxsize=None)  # runs per layer on every decode step; its search costs ~0.1 ms
def attention_layout(*, head_dim: int, gqa: int, query_len: int, k_bits: int, k_group: int, k_itemsize: int,
                     v_bits: int, v_group: int, v_itemsize: int, block_size: int | None = None) -> AttentionLayout:
    """The layout of one partial-kernel specialisation.

    Register mode (up to ROW_REGISTER_LIMIT rows: every one of REGISTER_SIMDGROUPS
    simdgroups holds all rows; 128 threads): the narrowest key group whose query and
    accumulator shares, rows * 2 * head_dim / lanes_per_key floats, fit REGISTER_BUDGET
    (narrow groups score more keys per pass) and whose whole estimate stays within
    REGISTER_MODE_LIMIT (one row: the group of fewest registers, always register mode).

    Shared mode (more rows: simdgroups split the rows and share K/V tiles; up to
    PIPELINE_THREAD_LIMIT threads): every simdgroup's estimated live registers
    (:func:`estimated_registers`) stay within chips.PIPELINE_REGISTER_LIMIT, so that no
    Mac lowers the pipeline's thread limit below what is launched. The fewest
    ``row_passes`` (blocks of simdgroups x rows_per_simdgroup rows; K/V read once a
    block) come first, with up to SHARED_ROW_LIMIT rows per simdgroup where the cap of
    MAX_SHARED_SIMDGROUPS needs it; then the narrowest key group that fits (a wider
    one repeats every key's exp2 and shuffles on more lanes), at the most rows per
    simdgroup (up to 8) it allows.
    """
    rows = gqa * query_len

    def registers(per: int, lanes: int) -> int:
        return _partials_registers(head_dim, rows, per, lanes, k_bits, _atom_words(head_dim, k_bits, k_group, lanes),
                                   v_bits, _atom_words(head_dim, v_bits, v_group, lanes))

    def fitting_lanes(per: int):
        return next((w for w in LANES_PER_KEY if registers(per, w) <= chips.PIPELINE_REGISTER_LIMIT), None)

    lanes = next((w for w in LANES_PER_KEY if rows * 2 * head_dim // w <= REGISTER_BUDGET
                  and registers(rows, w) <= REGISTER_MODE_LIMIT), None)
    if rows == 1 and lanes is None:  # one row with wide atoms: the key group of fewest registers
        lanes = min(LANES_PER_KEY, key=lambda w: registers(rows, w))
    if rows <= ROW_REGISTER_LIMIT and lanes is not None:
        simdgroups, per = REGISTER_SIMDGROUPS, rows
    else:
        # (Few rows land here only with wide atoms: their register-mode copies of q and o
        # pass REGISTER_MODE_LIMIT, so fewer rows per simdgroup.) Fewest passes over K/V
        # first (each pass reads the split again), then up to 8 rows per simdgroup (fewer
        # simdgroups reading each tile) at the narrowest key group that fits.
        cap = min(ROW_REGISTER_LIMIT, rows - 1)
        per, passes = 1, -(-rows // MAX_SHARED_SIMDGROUPS)
        for p in range(1, -(-rows // MAX_SHARED_SIMDGROUPS) + 1):
            least = -(-rows // (MAX_SHARED_SIMDGROUPS * p))
            if least <= cap:  # narrowest key group, then the most rows (fewest simdgroups)
                fits = [(fitting_lanes(r), -r, r) for r in range(least, cap + 1) if fitting_lanes(r)]
            else:  # all simdgroups busy: narrowest key group, then the fewest rows
                fits = [(fitting_lanes(r), r, r) for r in range(least, SHARED_ROW_LIMIT + 1) if fitting_lanes(r)]
            if fits:
                per, passes = min(fits)[2], p
                break
        simdgroups = min(-(-rows // (per * passes)), MAX_SHARED_SIMDGROUPS)
        per = -(-rows // (simdgroups * passes))
        lanes = fitting_lanes(per) or min(LANES_PER_KEY, key=lambda w: registers(per, w))
    k_row = head_dim * k_bits // 8 if k_bits else head_dim * k_itemsize
    v_row = head_dim * v_bits // 8 if v_bits else head_dim * v_itemsize
    k_scales = head_dim // k_group * k_itemsize if k_bits else 0
    v_scales = head_dim // v_group * v_itemsize if v_bits else 0
    tile = 0
    if per < rows:
        budget = TILE_MEMORY_BUDGET[128 if head_dim <= 128 else 256]
        tile = min(MAX_TILE_TOKENS, block_size or MAX_TILE_TOKENS)
        while tile > 1 and 2 * tile * (k_row + v_row + 2 * k_scales + 2 * v_scales) > budget:
            tile //= 2
    tg_bytes = attention_threadgroup_bytes(
        head_dim=head_dim, rows=rows, simdgroups=simdgroups, rows_per_simdgroup=per, tile=tile, k_row_bytes=k_row,
        v_row_bytes=v_row, k_scale_bytes=k_scales, v_scale_bytes=v_scales)
    return AttentionLayout(simdgroups, per, lanes, tile, _atom_words(head_dim, k_bits, k_group, lanes),
                           _atom_words(head_dim, v_bits, v_group, lanes), tg_bytes, rows)


def layout_for(query, keys, values, *, paged: bool) -> AttentionLayout:
    """The layout the backend picks for a 4-D query ([S, L, H, D] paged, [B, H, L, D] contiguous)."""
    def fmt(cache):
        *_, dtype, bits, group_size = _cache_parts(cache)
        return bits, group_size, dtype.size

    kbits, kgs, ksize = fmt(keys)
    vbits, vgs, vsize = fmt(values)
    num_heads, query_len = (query.shape[2], query.shape[1]) if paged else (query.shape[1], query.shape[2])
    num_kv_heads = tuple(keys.shape)[1]
    return attention_layout(head_dim=query.shape[-1], gqa=num_heads // num_kv_heads, query_len=query_len,
                            k_bits=kbits, k_group=kgs, k_itemsize=ksize, v_bits=vbits, v_group=vgs,
                            v_itemsize=vsize, block_size=tuple(keys.shape)[2] if paged else None)


# ----------------------------------------------------------------------------- registers per lane

REGISTER_OVERHEAD = 32  # assumed per lane: indices, loop counters, 64-bit buffer addresses


def _atoms(head_dim: int, bits: int, atom_words: int, lanes_per_key: int) -> tuple:
    """(atoms per lane, elements per atom) of one side's rows (kv_fetch's NA, AE)."""
    per_atom = atom_words * 32 // bits if bits else 4
    return -(-(head_dim // per_atom) // lanes_per_key), per_atom


def estimated_registers(kernel: str, template: dict) -> int:
    """Estimated live 32-bit registers per lane of one specialisation: the arrays a lane
    keeps across its key loop (from the kernel's data layout) plus REGISTER_OVERHEAD.

    An estimate, not the compiler's count: what keeps every layout under
    chips.PIPELINE_REGISTER_LIMIT, where M1/M2 still allow PIPELINE_THREAD_LIMIT threads
    per threadgroup. ``kvmetal selfcheck`` on a Mac reports the real limits. The table
    for every family is in docs/kernels.md ("Threads and registers")."""
    D = int(template.get("D", 0))
    if "RPS" in template:  # decode / paged / cascade partials (kv_attend)
        rps, lanes = int(template["RPS"]), int(template["LPK"])
        kbits, vbits = int(template["KBITS"]), int(template["VBITS"])
        kna, kae = _atoms(D, kbits, int(template["KAW"]), lanes)
        vna, vae = _atoms(D, vbits, int(template["VAW"]), lanes)
        # KvRowState: q and o shares, qsum / ob (quantized), m, l, pos.
        row = kna * kae + vna * vae + 3 + (kna if kbits else 0) + (vna if vbits else 0)
        # KvAtoms: values, and (scale, bias) per atom for a quantized side (dead code for a float one).
        k_atoms = kna * kae + (2 * kna if kbits else 0)
        v_atoms = vna * vae + (2 * vna if vbits else 0)
        shared = rps < int(template["G"]) * int(template["QL"])
        # Register mode keeps the next pass's atoms in flight (software pipeline).
        in_flight = k_atoms + v_atoms if shared else 2 * k_atoms + v_atoms * (1 if template["SV"] else 2)
        words = max(int(template["KAW"]), int(template["VAW"]))  # packed words being unpacked
        return rps * row + in_flight + words + REGISTER_OVERHEAD
    if kernel == "paged_varlen_partials":
        frag = D // 8
        q = 0 if template.get("QTG") else 2 * frag  # Q fragments (in threadgroup memory when QTG)
        # O and S fragments (2 floats a lane each), the K/V fragment being loaded, m, l and the tile's sums.
        return q + 2 * frag + 2 * (int(template["BK"]) // 8) + 4 + 6 + REGISTER_OVERHEAD
    if kernel in ("attention_reduce", "cascade_reduce"):
        return 4 * -(-(D // 4) // 32) + 8 + REGISTER_OVERHEAD  # float4 chunks of the row, m, denom
    if kernel == "cache_rows_quantize":
        return 4 + REGISTER_OVERHEAD  # a group is read twice from memory, not held
    return 8 + REGISTER_OVERHEAD


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
    ("head_div", "i"), ("sparse_v", "f"), ("split_tokens", "i"), ("split_max", "i"), ("split_div", "i")))
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


# SV: 1 compiles sparse V (kv_pass_sparse; threshold KvAttnParams.sparse_v), 0 the exact path.
_ATTENTION_TEMPLATE = ("TK", "TV", "D", "G", "QL", "NSG", "RPS", "LPK", "TT", "KBITS", "KGS", "KAW", "VBITS", "VGS",
                       "VAW", "SV")
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
                   _ATTENTION_TEMPLATE[:4] + ("BS",) + _ATTENTION_TEMPLATE[4:], _attention_geometry,
                   math_mode=ATTENTION_MATH_MODE),
        KernelSpec("decode_attention_partials", "attention",
                   ("query",) + _KV_INPUTS + ("params",), _PARTIALS,
                   _ATTENTION_TEMPLATE, _attention_geometry, row_contiguous=False, math_mode=ATTENTION_MATH_MODE),
        KernelSpec("attention_reduce", "attention",
                   _PARTIALS + ("sinks", "params"), ("out",), ("TQ", "D", "HAS_SINKS"),
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
                                                    threadgroup=(_largest_pow2_divisor(width, 256), 1, 1))),
    )
}


# The tiled varlen kernel (kernels/varlen.metal), next to SPECS' decode kernels.
SPECS["paged_varlen_partials"] = KernelSpec(
    "paged_varlen_partials", "varlen", ("query",) + _KV_INPUTS + ("block_tables", "seq_lens", "tiles", "params"),
    _PARTIALS, ("TQ", "TK", "TV", "D", "G", "BS", "NSG", "BK", "KT", "KBITS", "KGS", "VBITS", "VGS"),
    lambda *, num_tiles, num_kv_heads, splits, tiles, threadgroup_bytes: Geometry(
        grid=(num_tiles * tiles.threads, num_kv_heads, splits), threadgroup=(tiles.threads, 1, 1),
        threadgroup_bytes=threadgroup_bytes),
    math_mode=ATTENTION_MATH_MODE)


# Shared-prefix decode (kernels/cascade.metal, kvmetal/backends/metal_cascade.py): the
# partials kernel takes paged_attention_partials' inputs and template; the reduce folds
# the prefix and own partials of each row.
SPECS["cascade_partials"] = KernelSpec(
    "cascade_partials", "cascade", ("query",) + _KV_INPUTS + ("block_tables", "seq_lens", "params"), _PARTIALS,
    _ATTENTION_TEMPLATE[:4] + ("BS",) + _ATTENTION_TEMPLATE[4:], _attention_geometry,
    math_mode=ATTENTION_MATH_MODE, uses=("attention",))
SPECS["cascade_reduce"] = KernelSpec(
    "cascade_reduce", "cascade",
    ("prefix_max", "prefix_sum", "prefix_acc", "own_max", "own_sum", "own_acc", "slot_of", "sinks", "params"),
    ("out",), ("TQ", "D", "HAS_SINKS"),
    lambda *, rows: Geometry(grid=(rows * 32, 1, 1), threadgroup=(32, 1, 1)),
    math_mode=ATTENTION_MATH_MODE, uses=("attention",))


# A prefix chunk's rows (G x members) stay within one walk over a split: past
# MAX_SHARED_SIMDGROUPS x ROW_REGISTER_LIMIT rows the shared mode walks the split again
# for each further block of rows, and the prefix would be read that often.
CASCADE_CHUNK_ROWS = MAX_SHARED_SIMDGROUPS * ROW_REGISTER_LIMIT
CASCADE_REDUCE_PARAMS = ParamStruct("KvCascadeReduceParams", (
    ("num_heads", "i"), ("prefix_splits", "i"), ("own_splits", "i"), ("prefix_slots", "i"), ("num_seqs", "i"),
    ("pad0", "i"), ("pad1", "i"), ("pad2", "i")))


# ----------------------------------------------------------------------------- varlen prefill tiles

VARLEN_DECODE_ROWS = VARLEN_SHORT_RUN  # sequences with n_s <= this go through the decode partials
assert VARLEN_DECODE_ROWS <= ROW_REGISTER_LIMIT
VARLEN_SIMDGROUPS = 4                    # default simdgroups per tile: BQ = 8 * simdgroups query rows
VARLEN_BLOCK_K = (32, 16, 8)             # candidate K/V tile tokens, largest first
VARLEN_TILE_MEMORY = 20 * 1024           # bytes of the K + V tiles (one buffer each, rows padded)
VARLEN_ROW_PAD = 16                      # bytes added to each tile row (kernels: KvVarlenStride)
VARLEN_TRANSPOSED_PAD = 8                # bytes added to each row of the transposed K tile (KvVarlenStrideT)
VARLEN_TILE_FIELDS = 8                   # int32 per row of the tile table (KvVarlenTile)


@dataclass(frozen=True)
class VarlenTiles:
    """Tile sizes of the tiled varlen kernel (template parameters NSG, BK, KT).

    ``transposed_k`` (KT): the K tile holds dims as rows, so a K fragment's two keys are
    one vector load (and the fill's stores go down columns); False keeps K row-major
    like V (two scalar loads per K fragment, 16-byte stores). The default is the
    pattern of the fast kernels; only a Mac can time the two (``tiles=`` override)."""

    simdgroups: int
    block_k: int
    transposed_k: bool = True

    @property
    def block_q(self) -> int:
        return 8 * self.simdgroups

    @property
    def threads(self) -> int:
        return 32 * self.simdgroups


def varlen_threadgroup_bytes(*, head_dim: int, block_k: int, k_itemsize: int, v_itemsize: int,
                             transposed_k: bool = True) -> int:
    """Threadgroup memory of paged_varlen_partials: K tile (transposed: head_dim rows of
    block_k keys, padded by VARLEN_TRANSPOSED_PAD bytes), V tile (rows padded by
    VARLEN_ROW_PAD bytes; both in the tile element types), ok flags."""
    k_tile = (head_dim * (block_k * k_itemsize + VARLEN_TRANSPOSED_PAD) if transposed_k
              else block_k * (head_dim * k_itemsize + VARLEN_ROW_PAD))
    return _round16(k_tile) + _round16(block_k * (head_dim * v_itemsize + VARLEN_ROW_PAD)) + _round16(4 * block_k)


def varlen_tiles(*, head_dim: int, k_itemsize: int, v_itemsize: int, simdgroups: int | None = None,
                 block_k: int | None = None) -> VarlenTiles:
    """The tile sizes for one head_dim and tile element sizes: the largest BK whose
    padded K + V tiles fit VARLEN_TILE_MEMORY (D = 128 half: 32; D = 256 half: 16)."""
    if block_k is None:
        block_k = next((bk for bk in VARLEN_BLOCK_K
                        if varlen_threadgroup_bytes(head_dim=head_dim, block_k=bk, k_itemsize=k_itemsize,
                                                    v_itemsize=v_itemsize) - _round16(4 * bk) <= VARLEN_TILE_MEMORY),
                       VARLEN_BLOCK_K[-1])
    tiles = VarlenTiles(simdgroups or VARLEN_SIMDGROUPS, block_k)
    if tiles.block_k % 8 or tiles.block_k <= 0 or not 1 <= tiles.simdgroups <= MAX_SHARED_SIMDGROUPS:
        raise ValueError(f"[metal] varlen tiles need BK a multiple of 8 and 1..{MAX_SHARED_SIMDGROUPS} simdgroups "
                         f"(chips.PIPELINE_THREAD_LIMIT threads), got {tiles}")
    used = varlen_threadgroup_bytes(head_dim=head_dim, block_k=tiles.block_k, k_itemsize=k_itemsize,
                                    v_itemsize=v_itemsize, transposed_k=tiles.transposed_k)
    if used > 32 * 1024:
        raise ValueError(f"[metal] varlen tiles {tiles} need {used} bytes of threadgroup memory (> 32 KiB)")
    return tiles


@dataclass(frozen=True)
class VarlenPlan:
    """Host-side schedule of one varlen call (from query_start_loc and seq_lens).

    Row t of the query belongs to sequence seq_of[t]; rows that see nothing (a
    sequence's rows beyond its length) gather the zero row. Long sequences
    (n > VARLEN_DECODE_ROWS) become query tiles; short ones are grouped by n
    for the decode partials.
    """

    lens: np.ndarray          # guarded seq_lens (int32)
    tiles: np.ndarray         # [num_tiles, VARLEN_TILE_FIELDS] int32
    long_tokens: int          # rows of the tiled kernel's output (tokens of long sequences)
    max_work: int             # most keys one query tile attends
    short: dict               # n -> (sequence ids, first query row of each)
    gather: np.ndarray        # [T] row of the stacked outputs each query row takes


def varlen_plan(query_start_loc, seq_lens, *, num_tokens: int, gqa: int, block_q: int, max_len: int,
                sliding_window) -> VarlenPlan:
    qsl = np.asarray(query_start_loc).astype(np.int64)
    lens = np.clip(np.asarray(seq_lens).astype(np.int64), 0, max_len)
    num_seqs = lens.shape[0]
    # Index guards (validate=False): starts/ends inside [0, T] and non-decreasing.
    starts = np.clip(qsl[:num_seqs], 0, num_tokens)
    ends = np.clip(qsl[1:num_seqs + 1], 0, num_tokens)
    ends = np.maximum(ends, starts)
    counts = ends - starts
    # Rows beyond the sequence's length sit at negative positions: they see nothing.
    n_eff = np.minimum(counts, lens)
    first = ends - n_eff
    tiles, long_tokens, max_work = [], 0, 0
    short = {}
    long_rows = {}
    for s in range(num_seqs):
        n = int(n_eff[s])
        if n == 0:
            continue
        if n <= VARLEN_DECODE_ROWS:
            ids, q0s = short.setdefault(n, ([], []))
            ids.append(s)
            q0s.append(int(first[s]))
            continue
        long_rows[s] = long_tokens
        for r0 in range(0, n * gqa, block_q):
            tiles.append((s, r0, int(first[s]), long_tokens, n, 0, 0, 0))
        long_tokens += n
        keys = int(lens[s]) if sliding_window is None else min(int(lens[s]), sliding_window + block_q)
        max_work = max(max_work, keys)
    gather = np.full(num_tokens, -1, dtype=np.int64)
    for s, o0 in long_rows.items():
        gather[first[s]:ends[s]] = o0 + np.arange(n_eff[s])
    base = long_tokens
    for n, (ids, q0s) in sorted(short.items()):
        for k, q0 in enumerate(q0s):
            gather[q0:q0 + n] = base + k * n + np.arange(n)
        base += len(ids) * n
    gather[gather < 0] = base  # the zero row
    table = np.array(tiles, dtype=np.int32).reshape(-1, VARLEN_TILE_FIELDS)
    return VarlenPlan(lens.astype(np.int32), table, long_tokens, max_work, dict(sorted(short.items())), gather)


def _largest_pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


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


# ----------------------------------------------------------------------------- helpers

def _cache_parts(cache):
    """(data, scales, biases, element dtype, bits, group size) of one K or V cache.

    A float cache gets 8-element placeholders for scales/biases: never read, and
    large enough that MLX binds them as `device` buffers like real ones (inputs
    under 8 elements go to `constant`). They are 4-D so that `<name>_strides`
    has the four entries the strided kernels index.
    """
    if isinstance(cache, QuantizedKV):
        return cache.data, cache.scales, cache.biases, cache.scales.dtype, cache.bits, cache.group_size
    placeholder = _placeholder(cache.dtype)
    return cache, placeholder, placeholder, cache.dtype, 0, 32


@functools.lru_cache(maxsize=None)
def _placeholder_cached(dtype_tag: str):
    dtype = {v: k for k, v in DTYPE_TAGS.items()}[dtype_tag]
    return mx.zeros((1, 1, 1, 8), dtype=dtype)


def _placeholder(dtype):
    return _placeholder_cached(DTYPE_TAGS[dtype])


# MLX binds an input with fewer than this many elements as a `constant` buffer, which
# is part of the pipeline's signature (its mangled name ends in "c").
MIN_DEVICE_ELEMENTS = 8


def _device_bound(a: mx.array) -> mx.array:
    """``a``, or ``a`` grown along its first axis with zero rows to at least
    MIN_DEVICE_ELEMENTS elements (an empty one: zeros of its rank; a scalar stays), so that
    MLX binds it `device` whatever the batch: seq_lens, slot_of, prefix_lens, sinks,
    small block tables and partials of a batch of 1-7 would otherwise be `constant` and
    run another compiled pipeline than batch 8+ (under relaxed math the two need not
    give the same bits: issue 41, R1). Kernels index these arrays by row and never read
    their shapes, so the added rows are never read."""
    if a.ndim == 0 or a.size >= MIN_DEVICE_ELEMENTS:
        return a
    row = 1
    for d in a.shape[1:]:
        row *= d
    if row == 0:
        return mx.zeros((MIN_DEVICE_ELEMENTS,) + (1,) * (a.ndim - 1), dtype=a.dtype)
    extra = -(-MIN_DEVICE_ELEMENTS // row) - a.shape[0]
    return mx.concatenate([a, mx.zeros((extra,) + tuple(a.shape[1:]), dtype=a.dtype)], axis=0)


_BITS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}


def _scatter_rows(array: mx.array, row_index: mx.array, rows: mx.array, write: mx.array) -> mx.array:
    """``array`` viewed as [rows, width] with ``rows`` written at ``row_index``.

    MLX scatters: they run in place (buffer donation) when ``array`` has no other
    reference by the time they are evaluated, i.e. when the caller rebinds the result.
    ``write`` (bool per row of ``rows``) masks the writes: two integer scatters on
    the bits, ``old * 0 + new`` where set and ``old * 1 + 0`` where not, exact for
    any value incl. NaN. (Reading the old rows instead would hold a second
    reference to the cache and cost the donation.) Rows written more than once
    must all be masked off but one; ops rejects duplicate slots with validate=True.
    """
    width = array.shape[-1]
    flat = array.reshape(-1, width)
    new = rows.reshape(-1, width)
    bits = _BITS[array.dtype.size]
    keep = mx.where(write, 0, 1).astype(bits)[:, None]
    words = flat.view(bits)
    words = words.at[row_index].multiply(mx.broadcast_to(keep, new.shape))
    words = words.at[row_index].add(new.view(bits) * (1 - keep))
    return words.view(array.dtype).reshape(array.shape)


# ----------------------------------------------------------------------------- backend

class KernelBackend:
    """The five contract functions over SPECS, with kernels made by ``make_kernel``."""

    def __init__(self, name: str, make_kernel: Callable, *, call_options: Callable | None = None,
                 macos: int | None = None):
        self.name = name
        self.macos = default_macos_version() if macos is None else int(macos)
        self._make_kernel = make_kernel
        self._call_options = call_options or (lambda: {})
        self._kernels = {}
        self._lock = threading.Lock()

    # -- building and launching

    def kernel(self, spec: KernelSpec, template_values: dict):
        """The kernel object of one specialisation, built once per process."""
        variant = spec.variant(template_values)
        with self._lock:
            if variant not in self._kernels:
                header, body = kernel_text(spec.name)
                self._kernels[variant] = self._make_kernel(
                    name=variant, input_names=list(spec.inputs), output_names=list(spec.outputs),
                    source=body, header=header, ensure_row_contiguous=spec.row_contiguous,
                    compile_options={"math_mode": math_mode_for(spec.math_mode, self.macos)})
            return self._kernels[variant]

    def launch(self, name: str, template_values: dict, geometry: Geometry, output_shapes: list,
               output_dtypes: list, **inputs) -> list:
        """Run kernel ``name`` with its inputs by name, checked against SPECS first."""
        spec = SPECS[name]
        missing = [n for n in spec.inputs if n not in inputs]
        extra = sorted(set(inputs) - set(spec.inputs))
        if missing or extra:
            raise TypeError(f"[metal] {name} takes inputs {list(spec.inputs)}; missing {missing}, unexpected {extra}")
        for n in spec.inputs:
            if not isinstance(inputs[n], mx.array):
                raise TypeError(f"[metal] {name} input '{n}' must be an mx.array, got {type(inputs[n]).__name__}")
        absent = [k for k in spec.template if k not in template_values]
        if absent:
            raise TypeError(f"[metal] {name} needs template values {absent}")
        if len(output_shapes) != len(spec.outputs) or len(output_dtypes) != len(spec.outputs):
            raise TypeError(f"[metal] {name} has outputs {list(spec.outputs)}")
        kernel = self.kernel(spec, template_values)
        return kernel(inputs=[_device_bound(inputs[n]) for n in spec.inputs],
                      template=[(k, template_values[k]) for k in spec.template],
                      grid=geometry.grid, threadgroup=geometry.threadgroup,
                      output_shapes=output_shapes, output_dtypes=output_dtypes, **self._call_options())

    # -- writes

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return key_cache, value_cache
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        # Index guard: a slot outside [0, N * BS) (negative = padding, or validate=False
        # misuse) writes nothing. Such tokens aim at row 0 with their write masked off
        # (``write`` false, see _scatter_rows), so the scatter needs no host sync.
        valid = (slot_mapping >= 0) & (slot_mapping < num_blocks * block_size)
        slots = mx.where(valid, slot_mapping, 0)
        block, offset = slots // block_size, slots % block_size
        heads = mx.arange(num_kv_heads, dtype=mx.int32)
        row_index = ((block[:, None] * num_kv_heads + heads[None, :]) * block_size + offset[:, None]).reshape(-1)
        write = mx.broadcast_to(valid[:, None], (num_tokens, num_kv_heads)).reshape(-1)
        return (self._write_rows(key, key_cache, row_index, write),
                self._write_rows(value, value_cache, row_index, write))

    def _write_rows(self, rows, cache, row_index, write):
        num_tokens, num_kv_heads, head_dim = rows.shape
        if not isinstance(cache, QuantizedKV):
            template = dict(TC=cache.dtype, D=head_dim)
            geometry = SPECS["cache_rows_convert"].geometry(tokens=num_tokens, num_kv_heads=num_kv_heads,
                                                            head_dim=head_dim)
            (converted,) = self.launch("cache_rows_convert", template, geometry, [rows.shape], [cache.dtype],
                                       new_rows=rows)
            return _scatter_rows(cache, row_index, converted, write)
        groups = head_dim // cache.group_size
        template = dict(TC=cache.dtype, D=head_dim, BITS=cache.bits, GS=cache.group_size)
        geometry = SPECS["cache_rows_quantize"].geometry(tokens=num_tokens, num_kv_heads=num_kv_heads,
                                                         groups=groups)
        words, scales, biases = self.launch(
            "cache_rows_quantize", template, geometry,
            [(num_tokens, num_kv_heads, packed_words(head_dim, cache.bits)), (num_tokens, num_kv_heads, groups),
             (num_tokens, num_kv_heads, groups)],
            [mx.uint32, cache.dtype, cache.dtype], new_rows=rows)
        return cache.replace(_scatter_rows(cache.data, row_index, words, write),
                             _scatter_rows(cache.scales, row_index, scales, write),
                             _scatter_rows(cache.biases, row_index, biases, write))

    def copy_blocks(self, key_cache, value_cache, src, dst):
        if src.shape[0] == 0:
            return key_cache, value_cache
        # Index guard: a pair with src or dst outside [0, N) (validate=False misuse)
        # copies nothing: it reads block 0 and writes it nowhere (a masked write).
        # K and V have the same N (ops checks); src, dst are int32 (the contract).
        num_blocks = key_cache.shape[0]
        valid = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
        src = mx.where(valid, src, 0)
        dst = mx.where(valid, dst, 0)
        return self._copy(key_cache, src, dst, valid), self._copy(value_cache, src, dst, valid)

    def _copy(self, cache, src, dst, valid):
        """``cache`` with block ``src[i]`` copied to ``dst[i]`` where ``valid[i]`` (ids already guarded)."""
        if isinstance(cache, QuantizedKV):
            return cache.replace(*(self._copy(part, src, dst, valid) for part in cache.arrays()))
        blocks = cache.reshape(cache.shape[0], -1)
        width = blocks.shape[1]
        geometry = SPECS["copy_blocks_gather"].geometry(width=width, count=src.shape[0])
        (copied,) = self.launch("copy_blocks_gather", dict(T=cache.dtype), geometry, [(src.shape[0], width)],
                                [cache.dtype], blocks=blocks, src=src)
        return _scatter_rows(blocks, dst, copied, valid).reshape(cache.shape)

    # -- reads

    def gather_kv_cache(self, key_cache, value_cache, block_tables, seq_lens, *, max_len):
        return (self._gather(key_cache, block_tables, seq_lens, max_len),
                self._gather(value_cache, block_tables, seq_lens, max_len))

    def _gather(self, cache, block_tables, seq_lens, max_len):
        _, num_kv_heads, block_size, head_dim = cache.shape
        data, scales, biases, dtype, bits, group_size = _cache_parts(cache)
        num_seqs, max_blocks = block_tables.shape
        tasks = head_dim // group_size if bits else head_dim // 4
        template = dict(TE=dtype, D=head_dim, BS=block_size, BITS=bits, GS=group_size)
        geometry = SPECS["gather_kv_rows"].geometry(tasks=tasks, max_len=max_len,
                                                    num_rows=num_seqs * num_kv_heads)
        (rows,) = self.launch("gather_kv_rows", template, geometry, [(num_seqs, num_kv_heads, max_len, head_dim)],
                              [dtype], cache_data=data, cache_scales=scales, cache_biases=biases,
                              block_tables=block_tables, seq_lens=seq_lens,
                              params=GATHER_PARAMS.pack(num_kv_heads=num_kv_heads, max_blocks=max_blocks,
                                                        max_len=max_len, num_blocks=cache.shape[0]))
        return rows

    # -- attention

    def paged_attention(self, query, key_cache, value_cache, block_tables, seq_lens, *, scale, softcap,
                        sliding_window, sinks, num_splits, sparse_v=None):
        """query [S, L, H, D] -> [S, L, H, D] (ops passes a one-token [S, H, D] query as L = 1).
        ``sparse_v``: None (the exact SV = 0 kernels) or tau in (0, 1) (SV = 1)."""
        num_seqs, query_len, num_heads, head_dim = query.shape
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        max_blocks = block_tables.shape[1]
        work = max_blocks * block_size
        if sliding_window is not None:
            work = min(work, sliding_window + query_len - 1 + SPLIT_UNIT)
        layout = layout_for(query, key_cache, value_cache, paged=True)
        splits, split_tokens = self._splits(num_splits, work, num_seqs * num_kv_heads, layout,
                                            misaligned=sliding_window is not None)
        gqa = num_heads // num_kv_heads
        template, kv_buffers = self._kv_inputs(key_cache, value_cache, head_dim, gqa, query_len, layout, sparse_v)
        template["BS"] = block_size
        params = ATTENTION_PARAMS.pack(num_kv_heads=num_kv_heads, num_heads=num_heads, query_len=query_len,
                                       num_splits=splits, max_blocks=max_blocks, num_blocks=num_blocks,
                                       window=sliding_window or 0, scale=scale, softcap=softcap or 0.0, head_div=1,
                                       sparse_v=sparse_v or 0.0, split_tokens=split_tokens,
                                       **_window_fields(split_tokens))
        geometry = SPECS["paged_attention_partials"].geometry(splits=splits, num_kv_heads=num_kv_heads,
                                                              num_seqs=num_seqs, layout=layout)
        rows = num_seqs * query_len * num_heads
        partials = self.launch("paged_attention_partials", template, geometry,
                               *self._partial_outputs(rows, splits, head_dim),
                               query=mx.contiguous(query), **kv_buffers, block_tables=block_tables,
                               seq_lens=seq_lens, params=params)
        return self._reduce(partials, sinks, params, query.dtype, rows, head_dim).reshape(query.shape)

    def decode_attention(self, query, keys, values, *, scale, softcap, sinks, num_splits, sparse_v=None):
        """query [B, H, L, D] -> [B, H, L, D]; keys/values [B, Hkv, T, D] read in place (any view)."""
        batch, num_heads, query_len, head_dim = query.shape
        _, num_kv_heads, num_tokens, _ = keys.shape
        layout = layout_for(query, keys, values, paged=False)
        splits, split_tokens = self._splits(num_splits, num_tokens, batch * num_kv_heads, layout, misaligned=False)
        template, kv_buffers = self._kv_inputs(keys, values, head_dim, num_heads // num_kv_heads, query_len, layout,
                                               sparse_v)
        params = ATTENTION_PARAMS.pack(num_kv_heads=num_kv_heads, num_heads=num_heads, query_len=query_len,
                                       num_splits=splits, num_tokens=num_tokens, scale=scale,
                                       softcap=softcap or 0.0, head_div=query_len, sparse_v=sparse_v or 0.0,
                                       split_tokens=split_tokens, **_window_fields(split_tokens))
        geometry = SPECS["decode_attention_partials"].geometry(splits=splits, num_kv_heads=num_kv_heads,
                                                               num_seqs=batch, layout=layout)
        rows = batch * num_heads * query_len
        # The kernel reads K/V views in place through their strides; the small
        # query is made row-contiguous here instead.
        partials = self.launch("decode_attention_partials", template, geometry,
                               *self._partial_outputs(rows, splits, head_dim),
                               query=mx.contiguous(query), **kv_buffers, params=params)
        return self._reduce(partials, sinks, params, query.dtype, rows, head_dim).reshape(query.shape)

    def paged_attention_varlen(self, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *,
                               scale, softcap, sliding_window, sinks, tiles: VarlenTiles | None = None,
                               num_splits: int | None = None):
        """query [T, H, D] -> [T, H, D]: sequence s owns rows [qsl[s], qsl[s+1]), its last
        cached positions. Runs of n_s <= VARLEN_DECODE_ROWS go through the decode partials
        (one launch per distinct n_s), longer ones through paged_varlen_partials; both
        reduce with attention_reduce. ``tiles``/``num_splits`` override the defaults
        (tile sweeps, tests). The schedule is planned on the host (one sync)."""
        num_tokens, num_heads, head_dim = query.shape
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        max_blocks = block_tables.shape[1]
        gqa = num_heads // num_kv_heads
        kd, ks, kb, kdt, kbits, kgs = _cache_parts(key_cache)
        vd, vs, vb, vdt, vbits, vgs = _cache_parts(value_cache)
        # A quantized K tile holds float32 rows: K rounded to the scales' 16-bit type moves
        # a score by ~|q||k| 2^-9 sqrt(D) (bfloat16), which an explicit large scale turns
        # into a wrong softmax weight (issue 41, defect 1). V stays in the scales' type.
        ktt = mx.float32 if kbits else kdt
        tiles = tiles or varlen_tiles(head_dim=head_dim, k_itemsize=ktt.size, v_itemsize=vdt.size)
        plan = varlen_plan(query_start_loc, seq_lens, num_tokens=num_tokens, gqa=gqa, block_q=tiles.block_q,
                           max_len=max_blocks * block_size, sliding_window=sliding_window)
        outs = []
        if plan.tiles.shape[0]:
            tg_bytes = varlen_threadgroup_bytes(head_dim=head_dim, block_k=tiles.block_k, k_itemsize=ktt.size,
                                                v_itemsize=vdt.size, transposed_k=tiles.transposed_k)
            useful = max(1, -(-plan.max_work // tiles.block_k))
            split_tokens = 0
            if num_splits is not None:
                splits = int(num_splits)
            elif split_policy() == "windows":  # windows of whole K/V tiles
                split_tokens = -(-VARLEN_SPLIT_TOKENS // tiles.block_k) * tiles.block_k
                splits = window_splits(plan.max_work, split_tokens, misaligned=sliding_window is not None)
            else:
                splits = choose_num_splits(plan.max_work, plan.tiles.shape[0] * num_kv_heads,
                                           threadgroup_bytes=tg_bytes, threads=tiles.threads)
            if not split_tokens:
                splits = max(1, min(splits, useful))
            params = ATTENTION_PARAMS.pack(num_kv_heads=num_kv_heads, num_heads=num_heads,
                                           query_len=plan.long_tokens, num_splits=splits, max_blocks=max_blocks,
                                           num_blocks=num_blocks, window=sliding_window or 0,
                                           num_tokens=num_tokens, scale=scale, softcap=softcap or 0.0, head_div=1,
                                           split_tokens=split_tokens)
            template = dict(TQ=query.dtype, TK=ktt, TV=vdt, D=head_dim, G=gqa, BS=block_size,
                            NSG=tiles.simdgroups, BK=tiles.block_k, KT=int(tiles.transposed_k), KBITS=kbits, KGS=kgs,
                            VBITS=vbits, VGS=vgs)
            geometry = SPECS["paged_varlen_partials"].geometry(
                num_tiles=plan.tiles.shape[0], num_kv_heads=num_kv_heads, splits=splits, tiles=tiles,
                threadgroup_bytes=tg_bytes)
            rows = plan.long_tokens * num_heads
            partials = self.launch("paged_varlen_partials", template, geometry,
                                   *self._partial_outputs(rows, splits, head_dim), query=mx.contiguous(query),
                                   key_data=kd, key_scales=ks, key_biases=kb, value_data=vd, value_scales=vs,
                                   value_biases=vb, block_tables=block_tables, seq_lens=mx.array(plan.lens),
                                   tiles=mx.array(plan.tiles), params=params)
            out = self._reduce(partials, sinks, params, query.dtype, rows, head_dim)
            outs.append(out.reshape(plan.long_tokens, num_heads, head_dim))
        lens = mx.array(plan.lens)
        for n, (ids, q0s) in plan.short.items():
            rows_idx = (np.asarray(q0s)[:, None] + np.arange(n)[None, :]).reshape(-1)
            q = mx.take(query, mx.array(rows_idx.astype(np.int32)), axis=0).reshape(len(ids), n, num_heads,
                                                                                   head_dim)
            sel = mx.array(np.asarray(ids, dtype=np.int32))
            out = self.paged_attention(q, key_cache, value_cache, mx.take(block_tables, sel, axis=0),
                                       mx.take(lens, sel), scale=scale, softcap=softcap,
                                       sliding_window=sliding_window, sinks=sinks, num_splits=None)
            outs.append(out.reshape(len(ids) * n, num_heads, head_dim))
        outs.append(mx.zeros((1, num_heads, head_dim), dtype=query.dtype))
        stacked = mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
        return mx.take(stacked, mx.array(plan.gather.astype(np.int32)), axis=0)

    def paged_attention_cascade(self, query, key_cache, value_cache, prefix_block_tables, prefix_lens, prefix_of,
                                block_tables, seq_lens, *, scale, softcap, sinks, sparse_v=None):
        """query [S, H, D] -> [S, H, D]: one cascade_partials launch over the shared prefix
        chunks (each chunk's member query rows in one threadgroup), one over the sequences'
        own tokens, one cascade_reduce; planned on the host (kvmetal/backends/metal_cascade.py).
        ``sparse_v``: as in paged_attention, for both partials passes."""
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
        schedule = cascade_plan(prefix_lens, prefix_of, gqa=num_heads // num_kv_heads,
                                capacity=prefix_block_tables.shape[1] * block_size, max_rows=CASCADE_CHUNK_ROWS)
        own_work = int(np.clip(np.asarray(seq_lens), 0, block_tables.shape[1] * block_size).max(initial=0))
        own, own_splits = self._cascade_partials(query[:, None], key_cache, value_cache, block_tables, seq_lens,
                                                 work=own_work, scale=scale, softcap=softcap, sparse_v=sparse_v)
        parts, prefix_splits = [], None
        for group in schedule.groups:  # largest QL first: its split count is every group's
            chunk = mx.array(group.chunk_prefix)
            members = mx.take(query, mx.array(group.member_rows), axis=0)
            members = members.reshape(group.chunk_prefix.shape[0], group.query_len, num_heads, head_dim)
            part, prefix_splits = self._cascade_partials(
                members, key_cache, value_cache, mx.take(prefix_block_tables, chunk, axis=0),
                mx.take(prefix_lens, chunk), work=schedule.prefix_work, scale=scale, softcap=softcap,
                sparse_v=sparse_v, splits=prefix_splits)
            parts.append(part)
        if len(parts) > 1:
            prefix = tuple(mx.concatenate([p[i] for p in parts], axis=0) for i in range(3))
        elif parts:
            prefix = parts[0]
        else:  # no sequence has a prefix: placeholders the reduce never reads
            empty = mx.zeros((8,), dtype=mx.float32)
            prefix, prefix_splits = (empty, empty, empty), 1
        params = CASCADE_REDUCE_PARAMS.pack(num_heads=num_heads, prefix_splits=prefix_splits, own_splits=own_splits,
                                            prefix_slots=schedule.prefix_slots, num_seqs=num_seqs)
        rows = num_seqs * num_heads
        template = dict(TQ=query.dtype, D=head_dim, HAS_SINKS=sinks is not None)
        geometry = SPECS["cascade_reduce"].geometry(rows=rows)
        (out,) = self.launch("cascade_reduce", template, geometry, [(rows, head_dim)], [query.dtype],
                             prefix_max=prefix[0], prefix_sum=prefix[1], prefix_acc=prefix[2], own_max=own[0],
                             own_sum=own[1], own_acc=own[2], slot_of=mx.array(schedule.slot_of),
                             sinks=sinks if sinks is not None else _placeholder(mx.float32), params=params)
        return out.reshape(num_seqs, num_heads, head_dim)

    def _cascade_partials(self, query4, key_cache, value_cache, tables, lens, *, work: int, scale, softcap,
                          sparse_v=None, splits: int | None = None):
        """cascade_partials over table rows ``tables``/``lens`` (every row of query [C, QL, H,
        D] sees its whole table row): (part_max, part_sum, part_acc) [C * QL * H, splits(, D)]
        and the split count. ``work``: the most tokens a table row holds; ``splits``: the
        split count to use exactly (launches whose partials are concatenated), else chosen."""
        num_rows, query_len, num_heads, head_dim = query4.shape
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        layout = layout_for(query4, key_cache, value_cache, paged=True)
        split_tokens = SPLIT_TOKENS if split_policy() == "windows" else 0
        if splits is None:
            splits, split_tokens = self._splits(None, max(1, work), num_rows * num_kv_heads, layout,
                                                misaligned=False)
        template, kv_buffers = self._kv_inputs(key_cache, value_cache, head_dim, num_heads // num_kv_heads, query_len,
                                               layout, sparse_v)
        template["BS"] = block_size
        params = ATTENTION_PARAMS.pack(num_kv_heads=num_kv_heads, num_heads=num_heads, query_len=query_len,
                                       num_splits=splits, max_blocks=tables.shape[1], num_blocks=num_blocks, window=0,
                                       scale=scale, softcap=softcap or 0.0, head_div=1, sparse_v=sparse_v or 0.0,
                                       split_tokens=split_tokens, **_window_fields(split_tokens))
        geometry = SPECS["cascade_partials"].geometry(splits=splits, num_kv_heads=num_kv_heads, num_seqs=num_rows,
                                                      layout=layout)
        rows = num_rows * query_len * num_heads
        parts = self.launch("cascade_partials", template, geometry, *self._partial_outputs(rows, splits, head_dim),
                            query=mx.contiguous(query4), **kv_buffers, block_tables=tables, seq_lens=lens,
                            params=params)
        return parts, splits

    @staticmethod
    def _kv_inputs(keys, values, head_dim, gqa, query_len, layout, sparse_v=None) -> tuple:
        """The template parameters and the K/V buffers both partials kernels take."""
        kd, ks, kb, kdt, kbits, kgs = _cache_parts(keys)
        vd, vs, vb, vdt, vbits, vgs = _cache_parts(values)
        template = dict(TK=kdt, TV=vdt, D=head_dim, G=gqa, QL=query_len, NSG=layout.simdgroups,
                        RPS=layout.rows_per_simdgroup, LPK=layout.lanes_per_key, TT=layout.tile, KBITS=kbits,
                        KGS=kgs, KAW=layout.key_atom_words, VBITS=vbits, VGS=vgs, VAW=layout.value_atom_words,
                        SV=int(bool(sparse_v)))
        buffers = dict(key_data=kd, key_scales=ks, key_biases=kb, value_data=vd, value_scales=vs, value_biases=vb)
        return template, buffers

    @staticmethod
    def _splits(requested, work_tokens, parallel_groups, layout, *, misaligned: bool) -> tuple:
        """(splits, split_tokens) of a partials launch over at most ``work_tokens`` live keys
        per sequence: windows of SPLIT_TOKENS (split_tokens > 0), or, for an explicit
        ``requested`` count or the occupancy policy, equal runs (split_tokens = 0)."""
        if requested is None and split_policy() == "windows":
            return window_splits(work_tokens, SPLIT_TOKENS, misaligned=misaligned, split_max=SPLIT_WINDOW_MAX,
                                 split_div=SPLIT_WINDOW_DIV), SPLIT_TOKENS
        # Equal runs cut whole SPLIT_UNIT-token units: more than that many would be empty.
        useful = max(1, -(-work_tokens // SPLIT_UNIT))
        if requested is not None:
            return max(1, min(int(requested), useful)), 0
        return max(1, min(useful, choose_num_splits(work_tokens, parallel_groups,
                                                    threadgroup_bytes=layout.threadgroup_bytes,
                                                    threads=layout.threads))), 0

    @staticmethod
    def _partial_outputs(rows, splits, head_dim):
        return ([(rows, splits), (rows, splits), (rows, splits, head_dim)], [mx.float32, mx.float32, mx.float32])

    def _reduce(self, partials, sinks, params, dtype, rows, head_dim):
        template = dict(TQ=dtype, D=head_dim, HAS_SINKS=sinks is not None)
        geometry = SPECS["attention_reduce"].geometry(rows=rows)
        sink_input = sinks if sinks is not None else _placeholder(mx.float32)
        part_max, part_sum, part_acc = partials
        (out,) = self.launch("attention_reduce", template, geometry, [(rows, head_dim)], [dtype],
                             part_max=part_max, part_sum=part_sum, part_acc=part_acc, sinks=sink_input,
                             params=params)
        return out


# ----------------------------------------------------------------------------- entry points

_backends = {}
_backends_lock = threading.Lock()


def metal_backend(macos: int | None = None) -> KernelBackend:
    """The kernels compiled by MLX for the Apple GPU (built once per process and macOS
    version; default: this machine's, :func:`default_macos_version`)."""
    macos = default_macos_version() if macos is None else int(macos)
    with _backends_lock:
        if ("metal", macos) not in _backends:
            _backends[("metal", macos)] = KernelBackend("metal", mx.fast.metal_kernel, macos=macos)
        return _backends[("metal", macos)]


def sim_backend(macos: int | None = None) -> KernelBackend:
    """The same kernel descriptions run by the CPU simulator (``kvmetal.sim``), standing
    in for ``macos`` (default as for :func:`metal_backend`; 15 off a Mac)."""
    macos = default_macos_version() if macos is None else int(macos)
    with _backends_lock:
        if ("sim", macos) not in _backends:
            from .. import sim

            # Refuses a launch past PIPELINE_THREAD_LIMIT, as an M1 pipeline of that size would.
            make = functools.partial(sim.metal_kernel, macos=macos,
                                     max_threads_per_threadgroup=chips.PIPELINE_THREAD_LIMIT)
            _backends[("sim", macos)] = KernelBackend("sim", make, macos=macos)
        return _backends[("sim", macos)]
