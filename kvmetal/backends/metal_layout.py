"""How a Metal attention launch is laid out: the tuning constants, splits and windows,
the decode kernels' AttentionLayout (register or shared mode, lanes per key, tiles), their
registers per lane, and the varlen kernel's tiles and plan. Pure arithmetic on shapes: no
kernel is built here (metal_specs.py describes the kernels, metal.py launches them).

Dimension glossary: S sequences, B batch, H query heads, Hkv kv heads, G = H / Hkv,
D head_dim, N cache blocks, BS block size, M block-table width, T tokens.
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .. import chips
from ..quant import QuantizedKV
from . import MIN_TOKENS_PER_SPLIT, VARLEN_SHORT_RUN

# ----------------------------------------------------------------------------- tuning

REGISTER_SIMDGROUPS = 4             # simdgroups per threadgroup in register mode (128 threads)
# Register mode's simdgroups a window (issue 41, P5 as worded): KVMETAL_METAL_WINDOW_SIMDGROUPS
# picks one of these per launch (window_simdgroups). 1: one simdgroup walks the whole window,
# no merge (no barrier, no merge memory), a quarter of the simdgroups of 4 on the same windows.
# The default stays 4: in bench/window_policy.py's MODELLED sweep (div:cap:simdgroups policies)
# 1 loses every batch-1 case, 2K-32K (div 8: a quarter of the simdgroups, 1.5-3.8x slower;
# div 32: 4x the partials, 1.01-1.9x) and wins 64 x 4K and 8 x 32K by 0.1-2.6% (docs/kernels.md,
# "Register-mode merge and shared-mode tiles"); a Mac's `kvmetal bench` settles it.
REGISTER_SIMDGROUP_CHOICES = (1, 2, 4)
ROW_REGISTER_LIMIT = 8              # query rows (G x L) one simdgroup keeps in registers
# Shared mode: at most this many simdgroups (384 threads, chips.PIPELINE_THREAD_LIMIT:
# what M1/M2 allow a register-heavy pipeline); more rows take several passes over the split.
MAX_SHARED_SIMDGROUPS = chips.PIPELINE_THREAD_LIMIT // 32
SHARED_ROW_LIMIT = 16               # shared mode: most query rows one simdgroup serves (registers permitting)
# Register mode is taken at the narrowest key group whose estimate (estimated_registers) stays
# within this: the 128 32-bit registers an Apple GPU thread has (chips.PIPELINE_REGISTER_LIMIT;
# past them the compiler spills the per-pass state to memory). Rows that no key group fits go
# to shared mode, which holds fewer rows per simdgroup (docs/kernels.md, "Register budget rule").
REGISTER_MODE_LIMIT = chips.PIPELINE_REGISTER_LIMIT
LANES_PER_KEY = (4, 8, 16, 32)      # candidate key-group widths, narrowest first
# Shared-mode K/V tiles (double-buffered, scales and biases included), by max head_dim
# (issue 41, P6): 16 KiB gives float16 D 128 tiles of 16 tokens (a barrier per 16 keys;
# before, 7.5 KiB gave 4) and float16 D 256 tiles of 8; 20 KiB (stop 50) keeps those and
# gives a quantized cache, whose tile rows are D centred halves plus scales and biases,
# 16 tokens at D 128 (16.5 KiB; 8 at 16 KiB, twice the barriers) and 8 at D 256 (was 4).
# More threadgroup memory per threadgroup trades occupancy for fewer barriers: a Mac
# settles it, run `kvmetal bench` with KVMETAL_METAL_TILE_KIB set (tile_memory_budget;
# 7.5 / 15.5 were the budgets before P6, 16 before stop 50).
TILE_MEMORY_BUDGET = {128: 20 * 1024, 256: 20 * 1024}
MAX_TILE_MEMORY_KIB = 24             # KVMETAL_METAL_TILE_KIB's cap (Metal allows 32 KiB a threadgroup)
# Register mode's merge (issue 41, P5): simdgroups 1.. publish the accumulators of a chunk
# of rows at once, at most this many floats (6 KiB; attention.metal's KV_MERGE_FLOATS, the
# two must agree): 2 x chunks - 1 barriers a split, one at G 4 and 3 at G 8 (D 128), where
# the merge row by row took 1 + 2 x rows. 6 KiB keeps register mode within issue 9's
# 8 KiB at D <= 128 (its launches are held to a few threadgroups a core by registers).
REGISTER_MERGE_FLOATS = 1536
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
# clamp(pow2ceil(len) / div, SPLIT_TOKENS, SPLIT_WINDOW_MAX) tokens (powers of two;
# KvAttnParams.split_div / split_grow / split_max), where div is SPLIT_WINDOW_DIV while the
# window is SPLIT_TOKENS and SPLIT_WINDOW_DIV x SPLIT_WINDOW_GROWTH once it has grown: a
# function of the sequence and the launch's shape alone, so batch invariance holds, and a long
# sequence writes fewer partials. SPLIT_WINDOW_GROWTH applies to register-mode launches
# (window_growth; shared mode and cascade keep growth 1): at (8, 2) windows of 256 up to 2K
# tokens (at most 8), 512 up to 8K, 1024 up to 16K, 2048 beyond: 8 windows at 4K (64 x 4K's
# partials stay 512-token windows' worth), 16 from 8K to 32K. At growth 1: 256, 512 (4K),
# 1024 (8K), 2048 (16K+). SPLIT_WINDOW_DIV = 0 restores fixed windows of SPLIT_TOKENS. Div 8
# (was 32) won or tied every case of bench/window_policy.py's MODELLED sweep at growth 1 but
# one; growth 2 (stop 50) halves register mode's windows at 4K-16K: on M4 Max 8K and 16K
# decode model 2-4% faster in f16 and 19-24% in K8/V4 (more threadgroups keep more loads in
# flight), on M2 Max 1.3-2.7% slower in f16 (more partials); in shared mode it models 1.4-4.3%
# slower on both (bench/window_policy.json). A 4096 cap modelled slower at 32K on M4 Max, so
# it stays 2048. Fewer partials against fewer threadgroups for small batches
# is only a Mac's to settle: `kvmetal bench` compares windows there with
# KVMETAL_METAL_WINDOW_DIV (window_div; 0 gives fixed windows) and KVMETAL_METAL_WINDOW_GROWTH
# (window_growth; 1 is the rule before stop 50) set.
SPLIT_WINDOW_DIV = 8
SPLIT_WINDOW_GROWTH = 2
WINDOW_GROWTH_CHOICES = (1, 2, 4)
SPLIT_WINDOW_MAX = 2048
MAX_WINDOW_DIV = 1024
# The varlen (prefill) kernel's windows are longer: its partials hold every query row of
# a chunk (rows x splits x D floats), and a row's K/V tiles in one window are already
# independent of its chunk, so windows only add parallelism for chunks of few tiles. At
# 4096 a 2K-token chunk at 32K context writes 8 splits of partials (268 MB at 32 heads,
# D 128; about 1.5% of its K/V traffic).
VARLEN_SPLIT_TOKENS = 4096
SPLIT_POLICIES = ("windows", "occupancy")



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
                  split_div: int = 0, split_grow: int = SPLIT_WINDOW_GROWTH) -> int:
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
        w = split_window(n, split_tokens, split_max, split_div, split_grow)
        reach = w * _window_divisor(w, split_tokens, split_div, split_grow) if w < split_max else work
        # (reach: the longest length with window w)
        most = max(most, -(-min(work, reach) // w))
        if reach >= work:
            break
        n = reach + 1
    return max(1, most + int(misaligned))


def window_div() -> int:
    """The divisor of length-dependent windows: KVMETAL_METAL_WINDOW_DIV if set, else
    SPLIT_WINDOW_DIV (read on every launch; 0: fixed windows of SPLIT_TOKENS). The split
    count and the kernels' params both read it here, so they always agree."""
    div = _env_number("KVMETAL_METAL_WINDOW_DIV", int, lambda v: 0 <= v <= MAX_WINDOW_DIV and not v & (v - 1),
                      f"0 or a power of two up to {MAX_WINDOW_DIV}")
    return SPLIT_WINDOW_DIV if div is None else div


@contextlib.contextmanager
def tuning_variables(values: dict):
    """The KVMETAL_METAL_* tuning variables of ``values`` set for the block (None unsets one),
    each restored after: how a sweep or a benchmark runs launches under a setting a Mac would
    compare (window_div, window_growth, window_simdgroups, ... read them on every launch)."""
    saved = {name: os.environ.get(name) for name in values}
    try:
        for name, value in values.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = str(value)
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def window_growth(register_mode: bool) -> int:
    """The factor on the window divisor once a window has grown past SPLIT_TOKENS:
    KVMETAL_METAL_WINDOW_GROWTH if set (1, 2 or 4), else SPLIT_WINDOW_GROWTH for a register-mode
    launch and 1 for a shared-mode one (read on every launch, with window_div, by both the split
    count and the kernels' params, so they agree). A function of the launch's shape, never of
    its batch: batch invariance holds."""
    g = _env_number("KVMETAL_METAL_WINDOW_GROWTH", int, lambda v: v in WINDOW_GROWTH_CHOICES,
                    " or ".join(map(str, WINDOW_GROWTH_CHOICES)))
    if g is not None:
        return g
    return SPLIT_WINDOW_GROWTH if register_mode else 1


def window_simdgroups() -> int:
    """Register mode's simdgroups per threadgroup, all over one window (merged at its end):
    KVMETAL_METAL_WINDOW_SIMDGROUPS if set (1, 2 or 4), else REGISTER_SIMDGROUPS (read on every
    launch by attention_layout). Shared mode and the windows themselves never read it, and it
    never depends on the batch: a row's bits follow its sequence alone either way."""
    n = _env_number("KVMETAL_METAL_WINDOW_SIMDGROUPS", int, lambda v: v in REGISTER_SIMDGROUP_CHOICES,
                    " or ".join(map(str, REGISTER_SIMDGROUP_CHOICES)))
    return REGISTER_SIMDGROUPS if n is None else n


def _window_fields(split_tokens: int, split_grow: int) -> dict:
    """KvAttnParams' split_max / split_div / split_grow of a launch cut in windows (split_tokens > 0)."""
    if split_tokens <= 0:
        return dict(split_max=0, split_div=0, split_grow=1)
    return dict(split_max=SPLIT_WINDOW_MAX, split_div=window_div(), split_grow=split_grow)


# The decode partials' accumulator type (issue 41, P4's partials goal; attention.metal's
# kv_store_partial4): "auto" stores it in 16 bits where that cannot overflow, normalized
# by its sum (a convex combination of the window's V rows, within max |V|), m and l
# staying float32: half when the output (query) is float16 and V a float16 cache (its
# values fit half), bfloat16 when the output is bfloat16 (float32's range); float32
# otherwise (float32 outputs; float16 outputs over a float32, bfloat16 or quantized V,
# whose values can pass half's range: a window of huge but globally negligible V must
# not turn a finite output into inf). "float32" keeps every launch's partials float32
# (unnormalized, as before). KVMETAL_METAL_PARTIALS selects, read on every launch; a
# choice from dtypes alone, never the batch (batch invariance).
PARTIALS_MODES = ("auto", "float32")


def partials_mode() -> str:
    """KVMETAL_METAL_PARTIALS ("auto" when unset or empty); a ValueError naming it otherwise."""
    mode = os.environ.get("KVMETAL_METAL_PARTIALS") or "auto"
    if mode not in PARTIALS_MODES:
        raise ValueError(f"KVMETAL_METAL_PARTIALS must be one of {PARTIALS_MODES}, got {mode!r}")
    return mode


def partials_dtype(query_dtype, values) -> mx.Dtype:
    """The part_acc dtype (template TP) of a decode partials launch whose output is
    ``query_dtype`` over the V cache ``values`` (an array or QuantizedKV), by the rule
    above; float32 under KVMETAL_METAL_PARTIALS=float32."""
    if partials_mode() == "float32":
        return mx.float32
    if query_dtype == mx.bfloat16:
        return mx.bfloat16
    if query_dtype == mx.float16 and not isinstance(values, QuantizedKV) and values.dtype == mx.float16:
        return mx.float16
    return mx.float32


def split_window(length: int, split_tokens: int, split_max: int, split_div: int,
                 split_grow: int = SPLIT_WINDOW_GROWTH) -> int:
    """The window of a sequence of ``length`` tokens (attention.metal's kv_split_window): the
    divisor is ``split_div`` while the window is ``split_tokens``, ``split_div * split_grow``
    once it has doubled."""
    w = split_tokens
    while split_div > 0 and w < split_max and w * _window_divisor(w, split_tokens, split_div, split_grow) < length:
        w *= 2
    return w


def _window_divisor(window: int, split_tokens: int, split_div: int, split_grow: int) -> int:
    """The divisor that decides whether ``window`` grows: split_div while it is split_tokens,
    split_div * split_grow once it has grown."""
    return split_div if window == split_tokens else split_div * split_grow


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
    # Register mode: the next pass's K/V atoms are loaded a pass ahead (template PF 1, the
    # software pipeline). PF 0 loads them in the pass: only for one row whose pipelined atoms
    # pass REGISTER_MODE_LIMIT at every key group (D 512 with a float32 query and float32 or
    # 3/5/6-bit atoms); shared mode ignores it.
    prefetch: bool = True

    @property
    def threads(self) -> int:
        return self.simdgroups * 32

    @property
    def register_mode(self) -> bool:
        """Every simdgroup holds all rows (no shared K/V tiles)."""
        return self.tile == 0

    def registers(self, *, head_dim: int, k_bits: int, v_bits: int, sparse_v: bool = False, q_itemsize: int = 2,
                  k_itemsize: int = 2, v_itemsize: int = 2) -> int:
        """Estimated live registers per lane (:func:`estimated_registers`) of this layout, for
        a query of ``q_itemsize`` bytes an element and float caches of ``k/v_itemsize``."""
        return _partials_registers(head_dim, self.rows, self.rows_per_simdgroup, self.lanes_per_key, k_bits,
                                   self.key_atom_words, v_bits, self.value_atom_words, sparse_v,
                                   (q_itemsize, k_itemsize, v_itemsize), self.prefetch)

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


def merge_rows(head_dim: int, simdgroups: int, rows_per_simdgroup: int) -> int:
    """Rows the register mode merges per barrier (attention.metal's KV_MERGE_ROWS): as many as
    REGISTER_MERGE_FLOATS floats of simdgroups 1..'s accumulators hold, at least one."""
    if simdgroups <= 1:
        return 1
    return max(1, min(rows_per_simdgroup, REGISTER_MERGE_FLOATS // ((simdgroups - 1) * head_dim)))


def tile_memory_budget(head_dim: int) -> int:
    """Bytes the shared mode's double-buffered K/V tiles (scales and biases included) may
    take: KVMETAL_METAL_TILE_KIB (KiB, any head_dim) if set, else TILE_MEMORY_BUDGET."""
    kib = _env_number("KVMETAL_METAL_TILE_KIB", float, lambda v: 0 < v <= MAX_TILE_MEMORY_KIB,
                      f"a number of KiB in (0, {MAX_TILE_MEMORY_KIB}]")
    return TILE_MEMORY_BUDGET[128 if head_dim <= 128 else 256] if kib is None else int(kib * 1024)


def _env_number(name: str, kind, ok, requirement: str):
    """The tuning variable ``name`` as ``kind`` (None when unset or empty); a ValueError
    naming it when it does not parse or ``ok(value)`` is false."""
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not ok(value):
        raise ValueError(f"{name} must be {requirement}, got {raw!r}")
    return value


def _round16(n: int) -> int:
    return (n + 15) // 16 * 16


def attention_threadgroup_bytes(*, head_dim, rows, simdgroups, rows_per_simdgroup, tile, k_row_bytes, v_row_bytes,
                                k_scale_bytes, v_scale_bytes) -> int:
    """Threadgroup memory the partial kernels declare (mirrors KV_ATTN_THREADGROUP_ARRAYS).

    *_row_bytes: bytes of one tile row's data (a float cache's row; a quantized cache's row as
    centred halves, 2 bytes an element); *_scale_bytes: of its scales (0: float cache)."""
    shared = rows_per_simdgroup < rows
    merge = not shared and simdgroups > 1
    rps = rows_per_simdgroup
    # (m, l) of simdgroups 1.., then every simdgroup's sparse-V seed maxima (KV_MERGE_SEEDS)
    stats = 4 * ((simdgroups - 1) * rps * 2 + simdgroups * rps if merge else 1)
    acc = 4 * ((simdgroups - 1) * merge_rows(head_dim, simdgroups, rps) * head_dim if merge else 1)

    def tile_bytes(row_bytes):
        return 16 * (-(-2 * tile * row_bytes // 16) if shared else 1)

    total = _round16(stats) + _round16(acc) + tile_bytes(k_row_bytes) + tile_bytes(v_row_bytes)
    # A quantized side's scales and biases: one array of (scale, bias) pairs (kv_tile_copy_pairs).
    total += tile_bytes(2 * k_scale_bytes) if k_scale_bytes else 16
    total += tile_bytes(2 * v_scale_bytes) if v_scale_bytes else 16
    total += _round16(4 * (2 * tile if shared else 1))
    return total


def _partials_registers(head_dim: int, rows: int, per: int, lanes: int, k_bits: int, k_atom_words: int, v_bits: int,
                        v_atom_words: int, sparse_v: bool = False, itemsizes: tuple = (2, 2, 2),
                        prefetch: bool = True) -> int:
    """:func:`estimated_registers` of a partials kernel serving ``rows`` rows, ``per`` per simdgroup;
    ``itemsizes``: bytes per element of the query, a float K cache and a float V cache."""
    q, k, v = (_ITEM_DTYPES[n] for n in itemsizes)
    return estimated_registers("paged_attention_partials", dict(
        TQ=q, TK=k, TV=v, D=head_dim, RPS=per, LPK=lanes, KBITS=k_bits, VBITS=v_bits, KAW=k_atom_words,
        VAW=v_atom_words, G=rows, QL=1, SV=int(sparse_v), PF=int(prefetch)))


def attention_layout(*, head_dim: int, gqa: int, query_len: int, k_bits: int, k_group: int, k_itemsize: int,
                     v_bits: int, v_group: int, v_itemsize: int, block_size: int | None = None,
                     q_itemsize: int = 2) -> AttentionLayout:
    """The layout of one partial-kernel specialisation (:func:`_attention_layout`), at the
    tile budget of KVMETAL_METAL_TILE_KIB / TILE_MEMORY_BUDGET and register mode's simdgroups
    of KVMETAL_METAL_WINDOW_SIMDGROUPS / REGISTER_SIMDGROUPS (both read on every call).
    ``q_itemsize``: bytes per query element (2: float16 / bfloat16, 4: float32)."""
    return _attention_layout(head_dim=head_dim, gqa=gqa, query_len=query_len, k_bits=k_bits, k_group=k_group,
                             k_itemsize=k_itemsize, v_bits=v_bits, v_group=v_group, v_itemsize=v_itemsize,
                             block_size=block_size, tile_budget=tile_memory_budget(head_dim), q_itemsize=q_itemsize,
                             register_simdgroups=window_simdgroups())


@functools.lru_cache(maxsize=None)  # runs per layer on every decode step; its search costs ~0.1 ms
def _attention_layout(*, head_dim: int, gqa: int, query_len: int, k_bits: int, k_group: int, k_itemsize: int,
                      v_bits: int, v_group: int, v_itemsize: int, block_size: int | None,
                      tile_budget: int, q_itemsize: int = 2,
                      register_simdgroups: int = REGISTER_SIMDGROUPS) -> AttentionLayout:
    """The layout of one partial-kernel specialisation.

    Register mode (up to ROW_REGISTER_LIMIT rows: every one of ``register_simdgroups``
    simdgroups holds all rows and walks a contiguous run of the window, then they merge;
    4 by default, 128 threads; 1: the simdgroup walks the whole window, no merge): the narrowest key group (narrow groups score
    more keys per pass) whose estimate (:func:`estimated_registers`) stays within
    REGISTER_MODE_LIMIT, the 128 registers of a thread (one row: the group of fewest
    registers, always register mode).

    Shared mode (more rows: simdgroups split the rows and share K/V tiles; up to
    PIPELINE_THREAD_LIMIT threads): every simdgroup's estimated live registers
    (:func:`estimated_registers`) stay within chips.PIPELINE_REGISTER_LIMIT, the 128 a
    thread has (no spilling; a pipeline at 128 still gets 384 threads). The fewest
    ``row_passes`` (blocks of simdgroups x rows_per_simdgroup rows; K/V read once a
    block) come first, with up to SHARED_ROW_LIMIT rows per simdgroup where the cap of
    MAX_SHARED_SIMDGROUPS needs it; then the narrowest key group that fits (a wider
    one repeats every key's exp2 and shuffles on more lanes), at the most rows per
    simdgroup (up to 8) it allows.
    """
    rows = gqa * query_len

    def registers(per: int, lanes: int, prefetch: bool = True) -> int:
        return _partials_registers(head_dim, rows, per, lanes, k_bits, _atom_words(head_dim, k_bits, k_group, lanes),
                                   v_bits, _atom_words(head_dim, v_bits, v_group, lanes), False,
                                   (q_itemsize, k_itemsize, v_itemsize), prefetch)

    def fitting_lanes(per: int):
        return next((w for w in LANES_PER_KEY if registers(per, w) <= chips.PIPELINE_REGISTER_LIMIT), None)

    prefetch = True
    lanes = next((w for w in LANES_PER_KEY if registers(rows, w) <= REGISTER_MODE_LIMIT), None)
    if rows == 1 and lanes is None:
        # One row whose pipelined atoms pass the limit at every key group (D 512: a float32
        # query with float32 or 3/5/6-bit atoms): load each pass's atoms in the pass (PF 0),
        # at the narrowest key group that fits, else the one of fewest registers.
        prefetch = False
        lanes = next((w for w in LANES_PER_KEY if registers(rows, w, False) <= REGISTER_MODE_LIMIT),
                     None) or min(LANES_PER_KEY, key=lambda w: registers(rows, w, False))
    if rows <= ROW_REGISTER_LIMIT and lanes is not None:
        simdgroups, per = register_simdgroups, rows
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
    # A tile row's data (KV_ATTN_THREADGROUP_ARRAYS, KvTileSide): a float cache's row as stored; a
    # quantized one's values unpacked once per threadgroup to centred halves (2 bytes each: 2x an
    # 8-bit row, 4x a 4-bit one), which every simdgroup reads instead of unpacking the words itself.
    k_row = head_dim * 2 if k_bits else head_dim * k_itemsize
    v_row = head_dim * 2 if v_bits else head_dim * v_itemsize
    k_scales = head_dim // k_group * k_itemsize if k_bits else 0
    v_scales = head_dim // v_group * v_itemsize if v_bits else 0
    tile = 0
    if per < rows:
        budget = tile_budget
        tile = min(MAX_TILE_TOKENS, block_size or MAX_TILE_TOKENS)
        while tile > 1 and 2 * tile * (k_row + v_row + 2 * k_scales + 2 * v_scales) > budget:
            tile //= 2
    tg_bytes = attention_threadgroup_bytes(
        head_dim=head_dim, rows=rows, simdgroups=simdgroups, rows_per_simdgroup=per, tile=tile, k_row_bytes=k_row,
        v_row_bytes=v_row, k_scale_bytes=k_scales, v_scale_bytes=v_scales)
    return AttentionLayout(simdgroups, per, lanes, tile, _atom_words(head_dim, k_bits, k_group, lanes),
                           _atom_words(head_dim, v_bits, v_group, lanes), tg_bytes, rows, prefetch)


_ITEM_DTYPES = {2: mx.float16, 4: mx.float32}  # a dtype of each element size (what the estimate reads)


def cache_format(cache) -> tuple:
    """(element dtype, bits, group size) of one K or V cache; a float cache has bits 0 and
    group 32 (placeholders the kernels never read)."""
    if isinstance(cache, QuantizedKV):
        return cache.scales.dtype, cache.bits, cache.group_size
    return cache.dtype, 0, 32


def layout_for(query, keys, values, *, paged: bool) -> AttentionLayout:
    """The layout the backend picks for a 4-D query ([S, L, H, D] paged, [B, H, L, D] contiguous)."""
    kdtype, kbits, kgs = cache_format(keys)
    vdtype, vbits, vgs = cache_format(values)
    ksize, vsize = kdtype.size, vdtype.size
    num_heads, query_len = (query.shape[2], query.shape[1]) if paged else (query.shape[1], query.shape[2])
    num_kv_heads = tuple(keys.shape)[1]
    return attention_layout(head_dim=query.shape[-1], gqa=num_heads // num_kv_heads, query_len=query_len,
                            k_bits=kbits, k_group=kgs, k_itemsize=ksize, v_bits=vbits, v_group=vgs,
                            v_itemsize=vsize, block_size=tuple(keys.shape)[2] if paged else None,
                            q_itemsize=query.dtype.size)


# A prefix chunk's rows (G x members) stay within one walk over a split: past
# MAX_SHARED_SIMDGROUPS x ROW_REGISTER_LIMIT rows the shared mode walks the split again
# for each further block of rows, and the prefix would be read that often.
CASCADE_CHUNK_ROWS = MAX_SHARED_SIMDGROUPS * ROW_REGISTER_LIMIT


# ----------------------------------------------------------------------------- registers per lane

REGISTER_OVERHEAD = 32  # assumed per lane: indices, loop counters, 64-bit buffer addresses


def _atoms(head_dim: int, bits: int, atom_words: int, lanes_per_key: int) -> tuple:
    """(atoms per lane, elements per atom) of one side's rows (kv_fetch's NA, AE)."""
    per_atom = atom_words * 32 // bits if bits else 4
    return -(-(head_dim // per_atom) // lanes_per_key), per_atom


def _element_bytes(dtype) -> int:
    """Bytes per element of a template dtype: an mx.Dtype, or its tag in a kernel name
    ("f16", "bf16", "f32"); 4 when not given."""
    if dtype is None:
        return 4
    if isinstance(dtype, str):
        return 2 if dtype in ("f16", "bf16", "float16", "bfloat16") else 4
    return dtype.size


def estimated_registers(kernel: str, template: dict) -> int:
    """Estimated live 32-bit registers per lane of one specialisation: the arrays a lane
    keeps across its key loop (from the kernel's data layout; a 16-bit value is half a
    register) plus REGISTER_OVERHEAD.

    An estimate, not the compiler's count. Apple GPUs give a thread up to 128 32-bit
    registers (chips.PIPELINE_REGISTER_LIMIT); past them the compiler spills to memory,
    and a pipeline using all 128 still gets 384 threads a threadgroup on M1/M2
    (chips.PIPELINE_THREAD_LIMIT). The decode-family layouts keep every launch within
    128 (metal_layout.attention_layout); ``kvmetal selfcheck`` on a Mac reports the real
    limits. The table for every family is in docs/kernels.md ("Threads and registers")."""
    D = int(template.get("D", 0))
    if "RPS" in template:  # decode / paged / cascade partials (kv_attend)
        rps, lanes = int(template["RPS"]), int(template["LPK"])
        kbits, vbits = int(template["KBITS"]), int(template["VBITS"])
        kaw, vaw = int(template["KAW"]), int(template["VAW"])
        qb = _element_bytes(template.get("TQ"))
        kb, vb = _element_bytes(template.get("TK")), _element_bytes(template.get("TV"))
        kna, kae = _atoms(D, kbits, kaw, lanes)
        vna, vae = _atoms(D, vbits, vaw, lanes)
        # KvRowState, in bytes: the q share in the query's type, q sums (quantized K), the
        # float32 accumulator o, its bias sums (quantized V), m, l, pos.
        row = kna * kae * qb + 4 * ((kna if kbits else 0) + vna * vae + (vna if vbits else 0) + 3)
        # KvAtoms as held until use (KvAtom): a float cache's elements in their type, a
        # quantized one's packed words and each atom's (scale, bias); in shared mode a quantized
        # atom's halves stay in the tile (KvAtom<.., KvCentredTile>: their threadgroup address and
        # a valid flag, 8 bytes, beside the scale and bias).
        shared = rps < int(template["G"]) * int(template["QL"])
        k_atoms = kna * ((8 if shared else 4 * kaw) + 8 if kbits else kae * kb)
        v_atoms = vna * ((8 if shared else 4 * vaw) + 8 if vbits else vae * vb)
        # Register mode keeps the next pass's atoms in flight (software pipeline, PF 1); sparse V
        # reads V in the pass; PF 0 reads both in the pass.
        if shared or not int(template.get("PF", 1)):
            in_flight = k_atoms + v_atoms
        else:
            in_flight = 2 * k_atoms + v_atoms * (1 if int(template["SV"]) else 2)
        # The pass's scores, then weights, a float per row (and a quantized key's per-atom dot
        # products beside them past one atom), and one unpack unit (KvAtom::centred): a group of
        # 4 elements widened to float, or a packed 1/2-bit word's 32 or 16 values as halves.
        unit = max([16] + [64 // b for b in (kbits, vbits) if b in (1, 2)])
        transient = 4 * rps * (2 if kbits and kna > 1 else 1) + unit
        return -(-(rps * row + in_flight + transient) // 4) + REGISTER_OVERHEAD
    if kernel == "paged_varlen_partials":
        return varlen_registers(head_dim=D, block_k=int(template["BK"]), row_fragments=int(template.get("RF", 1)),
                                d_split=int(template.get("DS", 1)))
    if kernel in ("attention_reduce", "cascade_reduce"):
        return 4 * -(-(D // 4) // 32) + 8 + REGISTER_OVERHEAD  # float4 chunks of the row, m, denom
    if kernel == "cache_rows_quantize":
        return 4 + REGISTER_OVERHEAD  # a group is read twice from memory, not held
    return 8 + REGISTER_OVERHEAD


# ----------------------------------------------------------------------------- varlen prefill tiles

def varlen_registers(*, head_dim: int, block_k: int, row_fragments: int = 1, d_split: int = 1) -> int:
    """estimated_registers of paged_varlen_partials: a lane holds 2 floats of each 8x8
    fragment. Q: the DF = head_dim / 8 / d_split fragments of its dims in registers (RF 1),
    or (RF > 1, Q staged in threadgroup memory) the RF of one dim block; O: RF x DF; S: RF x
    BK / 8; per row fragment m, l, the rescale factor and its row flag; the K/V fragment being
    loaded, the tile's max and sum, the loop's key; split-D (d_split 2 or 4) also the
    partners' partial scores being added (two floats at a time)."""
    frag = head_dim // 8 // d_split
    rf = row_fragments
    q = 2 * rf if rf > 1 else 2 * frag
    exchange = 2 if d_split > 1 else 0
    return q + rf * (2 * frag + 2 * (block_k // 8) + 4) + 6 + exchange + REGISTER_OVERHEAD


VARLEN_DECODE_ROWS = VARLEN_SHORT_RUN  # sequences with n_s <= this go through the decode partials
assert VARLEN_DECODE_ROWS <= ROW_REGISTER_LIMIT
VARLEN_SIMDGROUPS = 4                    # default simdgroups per tile: BQ = 8 * simdgroups * RF query rows
VARLEN_ROW_FRAGMENTS = 1                 # default 8-row fragments per simdgroup (RF; 2 where the Q tile fits)
VARLEN_BLOCK_K = (32, 16, 8)             # candidate K/V tile tokens, largest first
VARLEN_TILE_MEMORY = 20 * 1024           # bytes of the K + V tiles (one buffer each, rows padded)
VARLEN_ROW_PAD = 16                      # bytes added to each tile row (kernels: KvVarlenStride)
VARLEN_TRANSPOSED_PAD = 8                # bytes added to each row of the transposed K tile (KvVarlenStrideT)
VARLEN_TILE_FIELDS = 8                   # int32 per row of the tile table (KvVarlenTile)
# Split-D (issue 41 P1): where one simdgroup per row fragment would keep more than this many
# registers a lane (varlen_registers; D 256: 174), two simdgroups share each row fragment, each
# holding the Q and O fragments of half the dims (D 256: 112), at one more barrier per K/V tile
# and the softmax run by both; four where two would still pass it (D 512: 174 at DS 2, 110 at
# DS 4; issue 40). KVMETAL_METAL_VARLEN_REGISTERS sets it for a Mac to compare (a large
# value: never split; `kvmetal bench --cases prefill` times d_split 1 and 2).
VARLEN_SPLIT_D_REGISTERS = chips.PIPELINE_REGISTER_LIMIT  # the 128 registers a thread has
VARLEN_D_SPLITS = (1, 2, 4)              # d_split candidates, fewest first
# Simdgroups of a split-D tile by d_split (3 row fragments x DS, BQ 24: 192 threads at DS 2,
# 384 at DS 4): at D 256 the cost model's best of 4 / 6 / 8 (8, BQ 32: 256 threads at 112
# registers leave one threadgroup a core, and its barriers unhidden;
# bench/varlen_costs_p1.json); at D 512 see bench/varlen_costs_d512.json.
VARLEN_SPLIT_D_SIMDGROUPS = 6
VARLEN_SPLIT_D_SIMDGROUPS_BY_DS = {2: VARLEN_SPLIT_D_SIMDGROUPS, 4: 12}
VARLEN_SCORE_PAD = 16                    # bytes added to each row of the split-D score exchange (tile_s)


@dataclass(frozen=True)
class VarlenTiles:
    """Tile sizes of the tiled varlen kernel (template parameters NSG, BK, KT, RF).

    ``transposed_k`` (KT): the K tile holds dims as rows, so a K fragment's two keys are
    one vector load (and the fill's stores go down columns); False keeps K row-major
    like V (two scalar loads per K fragment, 16-byte stores). The default is the
    pattern of the fast kernels; only a Mac can time the two (``tiles=`` override).

    ``row_fragments`` (RF): 8-row fragments per simdgroup (BQ = 8 x simdgroups x RF / DS). RF 2
    stages the tile's Q rows in threadgroup memory and makes each K and V fragment read
    from the tiles serve two MMAs (issue 41, P8); RF 1 keeps Q in registers.

    ``d_split`` (DS): simdgroups sharing each row fragment, each over head_dim / DS dims of Q
    and O (issue 41, P1: split-D; DS 4 at D 512, issue 40); their partial scores are summed
    through threadgroup memory.

    ``sequential_kv`` (SKV): K and V take turns in one threadgroup buffer (the V tile is
    filled after the scores, one more barrier per K/V tile), where the two tiles side by
    side would pass 32 KiB (D 512 with a float32 K tile: 16 KiB + pads each at BK 8)."""

    simdgroups: int
    block_k: int
    transposed_k: bool = True
    row_fragments: int = 1
    d_split: int = 1
    sequential_kv: bool = False

    def __post_init__(self):
        if self.d_split not in VARLEN_D_SPLITS or self.simdgroups % self.d_split:
            raise ValueError(f"[metal] varlen tiles need a d_split in {VARLEN_D_SPLITS} dividing the simdgroups, "
                             f"got {self}")

    @property
    def block_q(self) -> int:
        return 8 * self.simdgroups * self.row_fragments // self.d_split

    @property
    def threads(self) -> int:
        return 32 * self.simdgroups


def varlen_threadgroup_bytes(*, head_dim: int, block_k: int, k_itemsize: int, v_itemsize: int,
                             transposed_k: bool = True, block_q: int = 8 * VARLEN_SIMDGROUPS, q_itemsize: int = 2,
                             row_fragments: int = 1, simdgroups: int = VARLEN_SIMDGROUPS, d_split: int = 1,
                             sequential_kv: bool = False) -> int:
    """Threadgroup memory of paged_varlen_partials: K tile (transposed: head_dim rows of
    block_k keys, padded by VARLEN_TRANSPOSED_PAD bytes), V tile (rows padded by
    VARLEN_ROW_PAD bytes; both in the tile element types; sequential_kv: one buffer of the
    larger of the two and a 16-byte placeholder), Q tile (row_fragments > 1:
    block_q rows padded by VARLEN_ROW_PAD bytes, in the query type; else a 16-byte
    placeholder), ok flags (block_k + 1 int32), the next tile's block ids (block_k / 8 + 1
    int32: block sizes >= 8), the split-D score exchange (d_split > 1: 8 rows of block_k
    floats, padded by VARLEN_SCORE_PAD bytes, per simdgroup and row fragment; else 16 bytes)."""
    k_tile = (head_dim * (block_k * k_itemsize + VARLEN_TRANSPOSED_PAD) if transposed_k
              else block_k * (head_dim * k_itemsize + VARLEN_ROW_PAD))
    q_tile = block_q * (head_dim * q_itemsize + VARLEN_ROW_PAD) if row_fragments > 1 else 16
    s_tile = simdgroups * row_fragments * 8 * (4 * block_k + VARLEN_SCORE_PAD) if d_split > 1 else 16
    v_tile = block_k * (head_dim * v_itemsize + VARLEN_ROW_PAD)
    kv = _round16(max(k_tile, v_tile)) + 16 if sequential_kv else _round16(k_tile) + _round16(v_tile)
    return (kv + _round16(q_tile) + _round16(4 * (block_k + 1)) + _round16(4 * (block_k // 8 + 1))
            + _round16(s_tile))


def tiles_threadgroup_bytes(tiles: VarlenTiles, *, head_dim: int, k_itemsize: int, v_itemsize: int,
                            q_itemsize: int) -> int:
    """varlen_threadgroup_bytes of one VarlenTiles."""
    return varlen_threadgroup_bytes(head_dim=head_dim, block_k=tiles.block_k, k_itemsize=k_itemsize,
                                    v_itemsize=v_itemsize, transposed_k=tiles.transposed_k, block_q=tiles.block_q,
                                    q_itemsize=q_itemsize, row_fragments=tiles.row_fragments,
                                    simdgroups=tiles.simdgroups, d_split=tiles.d_split,
                                    sequential_kv=tiles.sequential_kv)


def varlen_split_registers() -> int:
    """The registers per lane past which varlen tiles split D (VARLEN_SPLIT_D_REGISTERS, or
    KVMETAL_METAL_VARLEN_REGISTERS: a whole number >= 1; unset: the default; a value that
    does not parse or is out of range: a ValueError naming the variable)."""
    value = _env_number("KVMETAL_METAL_VARLEN_REGISTERS", int, lambda v: v >= 1, "a whole number >= 1")
    return VARLEN_SPLIT_D_REGISTERS if value is None else value


def _varlen_kv_bytes(head_dim: int, block_k: int, k_itemsize: int, v_itemsize: int,
                     sequential_kv: bool = False) -> int:
    """The padded K (transposed) + V tiles of one BK (what VARLEN_TILE_MEMORY bounds;
    sequential_kv: the larger of the two)."""
    k = _round16(head_dim * (block_k * k_itemsize + VARLEN_TRANSPOSED_PAD))
    v = _round16(block_k * (head_dim * v_itemsize + VARLEN_ROW_PAD))
    return max(k, v) if sequential_kv else k + v


def varlen_tiles(*, head_dim: int, k_itemsize: int, v_itemsize: int, simdgroups: int | None = None,
                 block_k: int | None = None, row_fragments: int | None = None, q_itemsize: int = 2,
                 d_split: int | None = None, sequential_kv: bool | None = None) -> VarlenTiles:
    """The tile sizes for one head_dim and tile element sizes: the largest BK whose
    padded K + V tiles fit VARLEN_TILE_MEMORY (D = 128 half: 32; D = 256 half: 16) and,
    with the Q tile (RF > 1) and the score exchange (DS > 1), 32 KiB. ``row_fragments`` None:
    VARLEN_ROW_FRAGMENTS where some BK fits with it, else 1. ``d_split`` None: the fewest of
    VARLEN_D_SPLITS whose tiles estimate at most varlen_split_registers() registers a lane
    (D 192 and 256: 2; D 512: 4), else the most. ``simdgroups`` None: VARLEN_SIMDGROUPS, or
    VARLEN_SPLIT_D_SIMDGROUPS_BY_DS with split-D. ``sequential_kv`` None: K and V side by
    side where they fit 32 KiB at the smallest BK with RF 1, else in turns (D 512 with a
    float32 K tile)."""

    def total(bk, rf, ds, nsg, skv):
        t = VarlenTiles(nsg, bk, True, rf, ds, skv)
        return tiles_threadgroup_bytes(t, head_dim=head_dim, k_itemsize=k_itemsize, v_itemsize=v_itemsize,
                                       q_itemsize=q_itemsize)

    def fits(bk, rf, ds, nsg, skv):
        return (_varlen_kv_bytes(head_dim, bk, k_itemsize, v_itemsize, skv) <= VARLEN_TILE_MEMORY
                and total(bk, rf, ds, nsg, skv) <= 32 * 1024)

    def choose(ds):
        nsg = simdgroups or (VARLEN_SPLIT_D_SIMDGROUPS_BY_DS[ds] if ds > 1 else VARLEN_SIMDGROUPS)
        # K and V in turns only where side by side they pass 32 KiB even at the smallest BK
        skv = (total(VARLEN_BLOCK_K[-1], 1, ds, nsg, False) > 32 * 1024 if sequential_kv is None
               else bool(sequential_kv))
        rf = row_fragments
        if rf is None:
            rf = VARLEN_ROW_FRAGMENTS
            if not any(fits(bk, rf, ds, nsg, skv) for bk in ((block_k,) if block_k else VARLEN_BLOCK_K)):
                rf = 1
        bk = block_k or next((bk for bk in VARLEN_BLOCK_K if fits(bk, rf, ds, nsg, skv)), VARLEN_BLOCK_K[-1])
        return VarlenTiles(nsg, bk, True, rf, ds, skv)

    if d_split is None:
        feasible = [ds for ds in VARLEN_D_SPLITS if head_dim % (8 * ds) == 0 and (simdgroups or ds) % ds == 0]
        d_split = feasible[-1]
        for ds in feasible:
            t = choose(ds)
            if varlen_registers(head_dim=head_dim, block_k=t.block_k, row_fragments=t.row_fragments,
                                d_split=ds) <= varlen_split_registers():
                d_split = ds
                break
    tiles = choose(d_split)
    if (tiles.block_k % 8 or tiles.block_k <= 0 or not 1 <= tiles.simdgroups <= MAX_SHARED_SIMDGROUPS
            or tiles.row_fragments not in (1, 2) or tiles.d_split not in VARLEN_D_SPLITS
            or tiles.simdgroups % tiles.d_split or head_dim % (8 * tiles.d_split)):
        raise ValueError(f"[metal] varlen tiles need BK a multiple of 8, 1..{MAX_SHARED_SIMDGROUPS} simdgroups "
                         f"(chips.PIPELINE_THREAD_LIMIT threads), 1 or 2 row fragments and a d_split in "
                         f"{VARLEN_D_SPLITS} dividing the simdgroups and head_dim / 8, got {tiles} at head_dim "
                         f"{head_dim}")
    used = tiles_threadgroup_bytes(tiles, head_dim=head_dim, k_itemsize=k_itemsize, v_itemsize=v_itemsize,
                                   q_itemsize=q_itemsize)
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


def largest_pow2_divisor(n: int, cap: int) -> int:
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d
