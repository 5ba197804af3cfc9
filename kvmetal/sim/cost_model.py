"""A cost model: the simulator's counters of one kernel call -> a *modelled* time on an Apple GPU.

No Mac exists where this runs, so nothing here is measured: every time it returns is an
estimate from published figures (the table FIGURES: Apple's bandwidth and GPU core counts,
Philip Turner's metal-benchmarks measurements of M1/M2 GPUs) and from assumptions (marked
as such, with the reasoning, and kept in :class:`Params` so that a Mac run can calibrate
them). docs/cost_model.md describes the model; tools/cost_model.py prints its table.

The model of one launch::

    time = launch overhead
         + max(memory time, issue time, core data-path time)
         + serial latency per wave (first load, dependent-load chains, barriers)

- memory time: DRAM bytes / min(sustained bandwidth, Little's-law bandwidth), where the
  Little's-law bandwidth is what the resident simdgroups keep in flight
  (simdgroups x 32 lanes x bytes per load x loads in flight / DRAM latency), and
  residency follows from threadgroup memory, registers per lane and the threadgroup count;
- issue time: the simdgroup instructions (FMAs from the shapes, exp2, simd reductions,
  shuffles (per 32-bit word; a simd_shuffle whose lanes read different lanes at the cost of
  the instruction sequence it is), 8x8 MMAs, loads, stores, unpacking of quantized elements) at their measured
  cycles per scheduler, over cores x 4 schedulers x clock, scaled down when too few
  simdgroups are resident to keep a scheduler busy;
- core data-path time: every loaded or stored byte (cache hits included) at 64 B per cycle
  per core;
- serial: per wave of threadgroups, one DRAM latency (the first load), the kernel's chain
  of dependent loads (e.g. the split-KV reduce walking its splits) and its barriers
  (hidden by the other resident threadgroups of a core).

ALU work is not counted by the simulator: callers give it from the shapes (``fma_lanes``:
lane multiply-adds, e.g. 2 x D per query row per key for QK and PV, plus a few softmax
operations per score; ``unpack_lane_cycles``: quantized K/V elements turned into floats, each at
its format's cost, :func:`unpack_cycles`, counted from the kernel's unpack path).
"""
from __future__ import annotations

import dataclasses
import math

from .. import chips

METAL_BENCHMARKS = "github.com/philipturner/metal-benchmarks (README, measured on M1/M2)"
APPLE = "Apple's published specifications (kvmetal/chips.py)"
ASSUMPTION = "assumption"


@dataclasses.dataclass(frozen=True)
class Figure:
    """One number the model uses, with where it comes from."""

    value: float
    unit: str
    source: str            # METAL_BENCHMARKS, APPLE, or ASSUMPTION
    note: str = ""         # what it is; for an assumption, the reasoning


# Per-core facts (Apple GPU families 7 and 8, measured on M1/M2; taken as the same on M3/M4).
FIGURES = {
    "register_file_bytes": Figure(208 * 1024, "B per core", METAL_BENCHMARKS, "register file ~208 KB per core"),
    "threadgroup_memory_bytes": Figure(60 * 1024, "B per core", METAL_BENCHMARKS, "shared memory ~60 KB per core"),
    "max_threads_per_core": Figure(3072, "threads", METAL_BENCHMARKS, "max threads per core 384-3072"),
    "schedulers_per_core": Figure(4, "", METAL_BENCHMARKS, "four schedulers, one instruction per cycle each"),
    "simd_width": Figure(32, "lanes", METAL_BENCHMARKS, "32 threads per simdgroup"),
    "registers_per_thread": Figure(128, "32-bit registers", ASSUMPTION,
                                   "most registers one thread holds before the compiler spills (issue 41, P1); "
                                   "occupancy is modelled at min(estimate, this)"),
    "core_data_bytes_per_cycle": Figure(64, "B/cycle per core", METAL_BENCHMARKS, "on-core data bandwidth per cycle"),
    # Cycles a scheduler spends per simdgroup instruction (the 'throughput' column).
    "ffma32_cycles": Figure(1, "cycles", METAL_BENCHMARKS, "FFMA32 throughput 1 (M1 Max)"),
    "exp2_cycles": Figure(4, "cycles", METAL_BENCHMARKS, "EXP2_32 throughput 4"),
    "simd_reduce_cycles": Figure(14.5, "cycles", METAL_BENCHMARKS, "SUM<F32> 14.54; max/min taken as the same"),
    "simd_shuffle_cycles": Figure(2, "cycles", METAL_BENCHMARKS,
                                  "SHUFFLE/BROADCAST32 2.04 (a broadcast, rotate or up/down; a constant-mask xor "
                                  "taken as the same: our reading, not measured there); per 32-bit word"),
    "simd_vote_cycles": Figure(2, "cycles", METAL_BENCHMARKS, "BALLOT 2.02, FCMP_BALLOT 2.04 (simd_any / simd_all)"),
    "simd_shuffle_lanes_cycles": Figure(32, "cycles", METAL_BENCHMARKS,
                                        "SHUFFLE_RANDOM_DIFF32 32.32: a simd_shuffle whose lanes read different "
                                        "lanes is an instruction sequence (M1 Max); per 32-bit word"),
    "mma_8x8_cycles": Figure(17, "cycles", METAL_BENCHMARKS, "MATMUL<8x8xF16> ~17 (F32 ~18)"),
    # The instructions of a quantized element's unpack (KV_UNPACK_OPS, from the kernel's path).
    "bitwise32_cycles": Figure(1, "cycles", METAL_BENCHMARKS, "BITWISE32 throughput 1.06"),
    "shift32_cycles": Figure(4, "cycles", METAL_BENCHMARKS,
                             "a shift by a compile-time constant: BITEXTRACT32 (a compile-time field) 4.01, "
                             "LSHIFT32 4 in the ALU layout (our reading; RSHIFT32's 7.89 was measured with "
                             "shift amounts unknown at compile time)"),
    "f16_add_cycles": Figure(1, "cycles", METAL_BENCHMARKS, "FADD16 / FFMA16 throughput 1"),
    "load_issue_cycles": Figure(1, "cycles", ASSUMPTION,
                                "a load or store instruction's issue slot; not measured in metal-benchmarks"),
    "full_issue_simdgroups": Figure(8, "simdgroups per core", METAL_BENCHMARKS,
                                    "FFMA at ILP 4 reaches 1.3-1.6 cycles at 8 simds/core, ~11 at 4 at ILP 1: "
                                    "below 8 resident simdgroups a core's issue rate is scaled by n/8 (our reading)"),
}

# ------------------------------------------------------------------ unpacking quantized K/V
# The attention kernels' unpack (kernels/kvmetal_common.h, kv_centred_word and kv_centred; the
# partials call them through KvAtom::centred) builds each BITS-bit value n as the half n - mid
# from its bits: a masked field ORed into 0x6400 is the half 1024 + (field), and one 32-bit AND
# and OR give the two halves of a word; one FADD16 / FFMA16 per value takes off 1024 (+ mid) and
# the field's place. No int -> float CONVERT (4 cycles on the complex pipeline, metal-benchmarks;
# the path before stop 49 took a shift, a mask, a CONVERT and, for K, an FADD32 per element). The float32 products take the half as an operand:
# "Most pipelines can accept 16-bit operands or write 16-bit results, with zero additional cost"
# (metal-benchmarks, ALU layout), so widening is not charged (nor is it for a float16 cache).
# tests/test_cost_model.py checks that the kernel source still has this path and these loops.
UNPACK_WORD_BITS = (1, 2, 4, 8)  # KvPacked<BITS>::WORDS: two values per AND/OR from whole words


def unpack_ops(bits: int) -> dict:
    """Instructions per quantized element of ``bits`` bits, counted by walking the kernel's
    unpack as it is written: {"shift", "bitwise", "f16"} (shifts by a constant; ANDs and ORs;
    FADD16/FFMA16). 1/2/4/8 bits (kv_centred_word): per word, the fields at bits 0-7 of each
    16-bit half in place and those at 8-15 after one shift by 8, one AND and one OR per pair of
    values, one f16 op per value. 3/5/6 bits (kv_centred): per value a shift (none at bit 0 of a
    word), a mask, an OR with the magic and one f16 op; a value that straddles two words
    another shift and OR."""
    if not 1 <= bits <= 8:
        raise ValueError(f"[cost_model] bits must be 1..8, got {bits!r}")
    if bits in UNPACK_WORD_BITS:
        values = 32 // bits
        shift = bitwise = f16 = 0
        for s in range(0, 16, 8):       # kv_centred_word: for (s = 0; s < 16; s += 8)
            shift += s != 0
            for _p in range(0, 8, bits):  # for (p = 0; p < 8; p += BITS): one half2
                bitwise += 2            # AND, OR
                f16 += 2                # one FADD16 / FFMA16 per half
        return {"shift": shift / values, "bitwise": bitwise / values, "f16": f16 / values}
    values = 32 // math.gcd(bits, 32)   # a run of whole words
    shift = bitwise = f16 = 0
    for e in range(values):             # kv_centred
        sh = e * bits % 32
        shift += sh != 0
        if sh + bits > 32:              # joins the next word: << and |
            shift += 1
            bitwise += 1
        bitwise += 2                    # & mask, | KV_HALF_MAGIC
        f16 += 1                        # - (1024 + mid)
    return {"shift": shift / values, "bitwise": bitwise / values, "f16": f16 / values}


def unpack_cycles(bits: int) -> float:
    """Scheduler cycles per quantized element of ``bits`` bits (a simdgroup instruction covers
    32 lanes): unpack_ops at the figures' cycles. 8 bits 3.0, 4 bits 2.5."""
    ops = unpack_ops(bits)
    F = {k: f.value for k, f in FIGURES.items()}
    return ops["shift"] * F["shift32_cycles"] + ops["bitwise"] * F["bitwise32_cycles"] + ops["f16"] * F["f16_add_cycles"]


# GPU clocks: metal-benchmarks' table for M1/M2; M3/M4 are not published.
CLOCKS = {
    "m1": Figure(1.278, "GHz", METAL_BENCHMARKS, "M1"),
    "m1-max": Figure(1.296, "GHz", METAL_BENCHMARKS, "M1 Max"),
    "m2": Figure(1.398, "GHz", METAL_BENCHMARKS, "M2"),
    "m2-max": Figure(1.398, "GHz", METAL_BENCHMARKS, "M2 Max"),
    "m3": Figure(1.398, "GHz", ASSUMPTION, "not published; taken as M2's (only issue-bound terms depend on it)"),
    "m3-max": Figure(1.398, "GHz", ASSUMPTION, "not published; taken as M2 Max's"),
    "m4": Figure(1.398, "GHz", ASSUMPTION, "not published; taken as M2's"),
    "m4-max": Figure(1.398, "GHz", ASSUMPTION, "not published; taken as M2 Max's"),
}

# The last letter of the GPU's architecture name, which MLX's decode dispatch reads
# (kvmetal/sim/mlx_kernels.mlx_decode_plan). Assumed: 'g' for base chips, 'c' for Max chips
# (Apple's applegpu_g13g / g13c naming as we understand it); neither is 's' or 'd', so MLX takes
# the same branch on every chip modelled here.
MLX_ARCH_SUFFIX = {"m1": "g", "m1-max": "c", "m2": "g", "m2-max": "c", "m3": "g", "m3-max": "c",
                   "m4": "g", "m4-max": "c"}
MODELLED_CHIPS = ("m1", "m1-max", "m2", "m2-max", "m3", "m3-max", "m4", "m4-max")


@dataclasses.dataclass(frozen=True)
class Params:
    """What no published figure gives: assumptions, each a parameter a Mac run calibrates
    (docs/cost_model.md, "Calibrating on a Mac")."""

    # Streaming kernels reach 80-90% of a GPU's peak DRAM bandwidth; Apple publishes only peak.
    sustained_fraction: float = 0.85
    # DRAM load latency seen by a GPU core: not published; a few hundred ns is typical of LPDDR5
    # behind a GPU's cache hierarchy.
    dram_latency_ns: float = 600.0
    # A dependent load of data the previous launch wrote (partials sitting in L2/SLC).
    chain_latency_ns: float = 300.0
    # Independent loads a simdgroup keeps in flight (unrolled key loops, K and V loads).
    loads_in_flight: float = 4.0
    # Fixed cost of one dispatch inside a command buffer (encoder, launch, drain).
    launch_overhead_us: float = 3.0
    # Cycles a threadgroup waits at a barrier (not measured in metal-benchmarks).
    barrier_cycles: float = 32.0

    @staticmethod
    def from_json(path: str) -> "Params":
        """Params with the fields a calibration file sets (a JSON object; unknown keys refused)."""
        import json

        with open(path) as f:
            values = json.load(f)
        known = {f.name for f in dataclasses.fields(Params)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"[cost_model] unknown Params field(s) {unknown}; known: {sorted(known)}")
        return Params(**{k: float(v) for k, v in values.items()})

    @staticmethod
    def notes() -> dict:
        return {
            "sustained_fraction": "fraction of Apple's peak DRAM bandwidth a streaming kernel sustains "
                                  "(GPUs typically reach 80-90%; Apple publishes only the peak)",
            "dram_latency_ns": "DRAM load latency seen by a GPU core (not published; few hundred ns typical "
                               "of LPDDR5 behind a GPU cache hierarchy)",
            "chain_latency_ns": "latency of a dependent load of data the previous launch wrote (L2/SLC hit)",
            "loads_in_flight": "independent loads one simdgroup keeps outstanding (Little's law)",
            "launch_overhead_us": "fixed cost of one dispatch inside a command buffer",
            "barrier_cycles": "cycles a threadgroup stalls at a threadgroup_barrier",
        }


@dataclasses.dataclass(frozen=True)
class ChipModel:
    name: str
    bandwidth_gbs: float
    cores: int
    clock_ghz: float

    @staticmethod
    def of(name: str) -> "ChipModel":
        chip = chips.CHIPS[name]
        return ChipModel(name, chip.bandwidth_gbs, chip.gpu_cores, CLOCKS[name].value)


@dataclasses.dataclass(frozen=True)
class Work:
    """What one kernel launch does, as the model reads it (from a KernelCall, or analytic)."""

    name: str
    threadgroups: int
    threads_per_threadgroup: int
    threadgroup_memory: int
    registers: int                 # estimated live 32-bit registers per lane
    dram_bytes: int                # bytes that leave/reach DRAM (distinct loaded + distinct stored)
    core_bytes: int                # every byte loaded or stored (cache hits included)
    dram_bytes_per_load: float     # bytes per lane load on the DRAM-heavy buffers
    load_instructions: float       # simdgroup load instructions (lane loads / 32)
    store_instructions: float
    barriers: int                  # summed over threadgroups
    reductions: int                # simdgroup executions
    shuffles: int
    mma: int
    transcendental_lanes: int
    fma_lanes: float               # from the shapes (the simulator does not count FMAs)
    unpack_lane_cycles: float = 0.0  # quantized elements unpacked x their format's cycles (unpack_cycles)
    chain_loads: int = 0           # dependent loads in a row, per threadgroup
    threadgroup_accesses: float = 0.0  # lane loads/stores of threadgroup memory (shared_tile_accesses)
    lane_shuffles: int = 0         # simd_shuffles whose lanes read different lanes (an instruction sequence)
    votes: int = 0                 # simd_any / simd_all / simd_ballot
    source: str = "sim"            # "sim" (counters) or "analytic"

    def scaled(self, factor: int) -> "Work":
        """The same launch repeated ``factor`` times side by side (e.g. over kv heads): every
        count scales, per-threadgroup figures do not."""
        f = factor
        return dataclasses.replace(
            self, threadgroups=self.threadgroups * f, dram_bytes=self.dram_bytes * f,
            core_bytes=self.core_bytes * f, load_instructions=self.load_instructions * f,
            store_instructions=self.store_instructions * f, barriers=self.barriers * f,
            reductions=self.reductions * f, shuffles=self.shuffles * f, mma=self.mma * f,
            transcendental_lanes=self.transcendental_lanes * f, fma_lanes=self.fma_lanes * f,
            unpack_lane_cycles=self.unpack_lane_cycles * f, threadgroup_accesses=self.threadgroup_accesses * f,
            lane_shuffles=self.lane_shuffles * f, votes=self.votes * f)


def kvmetal_template(call_name: str) -> tuple | None:
    """(kernel, template values) of a kvmetal kernel call, parsed from its specialised name;
    None for a kernel that is not kvmetal's."""
    from ..backends import metal_specs

    if not call_name.startswith("kvmetal_"):
        return None
    for name, spec in metal_specs.SPECS.items():
        prefix = f"kvmetal_{name}_"
        if not call_name.startswith(prefix):
            continue
        parts, values = call_name[len(prefix):].split("_"), {}
        rest = list(parts)
        for key in spec.template:
            tag = key.lower()
            # a key's part: its lowercase name then its value (names may contain '_')
            width = tag.count("_") + 1
            part = "_".join(rest[:width])
            rest = rest[width:]
            if not part.startswith(tag):
                break
            raw = part[len(tag):]
            values[key] = int(raw) if raw.lstrip("-").isdigit() else raw
        else:
            return name, values
    return None


def kvmetal_registers(call_name: str) -> int | None:
    """The metal backend's estimate (estimated_registers) for a kvmetal kernel call, by its
    specialised name; None for a kernel that is not kvmetal's."""
    from ..backends import metal_layout

    parsed = kvmetal_template(call_name)
    return metal_layout.estimated_registers(*parsed) if parsed else None


def _partials_template(call_name: str) -> dict:
    parsed = kvmetal_template(call_name)
    if parsed is None or "RPS" not in parsed[1]:
        raise ValueError(f"[cost_model] call_name must name a kvmetal partials kernel, got {call_name!r}")
    return parsed[1]


def _row_passes(t: dict) -> int:
    """Walks over the split of a shared-mode partials call (AttentionLayout.row_passes); 0 in register mode."""
    rows, rps, nsg = int(t["G"]) * int(t["QL"]), int(t["RPS"]), int(t["NSG"])
    return -(-rows // (nsg * rps)) if rps < rows else 0


def register_mode(call_name: str) -> bool:
    """A decode partials call whose every simdgroup holds all G x QL rows (no shared tiles)."""
    return _row_passes(_partials_template(call_name)) == 0


def unpack_copies(call_name: str) -> int:
    """How many times a decode partials call unpacks each quantized K/V element: once in
    register mode (each simdgroup walks its own tokens); in shared mode (RPS < G x QL) once
    per walk over the split (row_passes: 1 up to NSG x RPS rows), in the tile fill
    (attention.metal's KvTileFill: every element of a tile unpacked once per threadgroup to
    centred halves, which the simdgroups read, shared_tile_accesses)."""
    return max(1, _row_passes(_partials_template(call_name)))


def shared_tile_accesses(call_name: str, tokens: int) -> float:
    """Lane accesses of threadgroup memory a shared-mode decode partials call makes to its K/V
    tiles over ``tokens`` keys of one kv head (0 in register mode), per walk over the split:
    the fill stores each row's data once (a float cache's in 16-byte units, a quantized one's
    D centred halves in half4s: KvTileFill) and each of the NSG simdgroups loads every element
    of both sides: a float side 4 a load (kv_raw4), a quantized side 8 a load (one uint4 of
    halves: KvAtom<.., KvCentredTile>::centred) where its atom's AE4 = AW x 8 / BITS is even,
    else 4. A quantized side's (scale, bias) pairs: the fill stores each group's two
    elements (kv_tile_copy_pairs), and each simdgroup loads one pair an atom, D / AE a row
    (KvGroupScales<KvCentredTile>; AE = AW x 32 / BITS), or, where a key group's LPK atoms
    span one group (tile_pair_loads), two pairs a load."""
    t = _partials_template(call_name)
    passes = _row_passes(t)
    if not passes:
        return 0.0
    d, nsg, lpk = int(t["D"]), int(t["NSG"]), int(t["LPK"])
    per_token = 0.0
    for bits, aw, group, dtype in ((int(t["KBITS"]), int(t["KAW"]), int(t["KGS"]), t.get("TK")),
                                   (int(t["VBITS"]), int(t["VAW"]), int(t["VGS"]), t.get("TV"))):
        per_load = 8 if bits and (aw * 8 // bits) % 2 == 0 else 4
        stores = d / per_load if bits else d * (2 if dtype in ("f16", "bf16") else 4) / 16
        per_token += stores + nsg * d / per_load
        if bits:
            per_token += 2 * d / group + nsg * tile_pair_loads(d, lpk, aw * 32 // bits, group)
    return passes * tokens * per_token


def tile_pair_loads(d: int, lpk: int, ae: int, group: int) -> float:
    """Lane loads of (scale, bias) pairs per row by one shared-mode simdgroup
    (KvGroupScales<KvCentredTile>): one an atom (d / ae), or, where the LPK lanes of a key
    group hold one group's atoms (lpk x ae == group) and each lane an even number of atoms
    (ROW_PAIRS), the row's pairs in order, two a 4-element load: lpk x atoms / 2."""
    atoms = d // ae
    per_lane = -(-atoms // lpk)
    if lpk * ae == group and atoms == lpk * per_lane and per_lane % 2 == 0:
        return lpk * per_lane / 2
    return d / ae


def work_from_call(call, *, fma_lanes: float, unpack_lane_cycles: float = 0.0, chain_loads: int = 0,
                   registers: int | None = None, name: str | None = None, exclude: tuple = (),
                   threadgroup_accesses: float = 0.0) -> Work:
    """A Work from one traced KernelCall (kvmetal.sim.trace) and the ALU work of its shapes.
    ``exclude``: buffers only the simulator harness reads (e.g. the scalars MLX passes as
    constant bytes, which our wrapper reads from a small buffer)."""
    bufs = [b for n, b in call.buffers.items() if n not in exclude]
    distinct = sum(b.distinct_loaded for b in bufs)
    heavy = [b for b in bufs if b.distinct_loaded * 8 >= distinct and b.load_ops]
    bpl = (sum(b.loaded for b in heavy) / sum(b.load_ops for b in heavy)) if heavy else 4.0
    regs = registers if registers is not None else kvmetal_registers(call.name)
    return Work(
        name=name or call.name, threadgroups=call.threadgroups,
        threads_per_threadgroup=math.prod(call.threadgroup), threadgroup_memory=call.threadgroup_memory,
        registers=int(regs if regs is not None else 64),
        dram_bytes=distinct + sum(b.distinct_stored for b in bufs),
        core_bytes=sum(b.loaded + b.stored for b in bufs), dram_bytes_per_load=bpl,
        load_instructions=sum(b.load_ops for b in bufs) / 32.0,
        store_instructions=sum(b.store_ops for b in bufs) / 32.0,
        barriers=call.barriers, reductions=call.reductions, shuffles=call.shuffles, mma=call.mma,
        transcendental_lanes=call.transcendentals, fma_lanes=fma_lanes, unpack_lane_cycles=unpack_lane_cycles,
        chain_loads=chain_loads, threadgroup_accesses=threadgroup_accesses, lane_shuffles=call.lane_shuffles,
        votes=call.votes)


def occupancy(work: Work, chip: ChipModel) -> dict:
    """Threadgroups and simdgroups resident per core, and the waves the launch takes."""
    F = FIGURES
    tpg = max(1, work.threads_per_threadgroup)
    regs = max(1, min(work.registers, int(F["registers_per_thread"].value)))
    threads_by_regs = int(F["register_file_bytes"].value // (4 * regs)) // 32 * 32
    threads_cap = min(int(F["max_threads_per_core"].value), threads_by_regs)
    by_threads = max(1, threads_cap // tpg)
    by_memory = (int(F["threadgroup_memory_bytes"].value // work.threadgroup_memory)
                 if work.threadgroup_memory else by_threads)
    per_core = max(1, min(by_threads, by_memory))
    slots = per_core * chip.cores
    waves = max(1, -(-work.threadgroups // slots))
    resident_tgs = min(work.threadgroups, slots)
    simdgroups_per_tg = -(-tpg // 32)
    busy_cores = min(chip.cores, resident_tgs)
    return {"threadgroups_per_core": per_core, "waves": waves, "resident_threadgroups": resident_tgs,
            "resident_simdgroups": resident_tgs * simdgroups_per_tg,
            "simdgroups_per_busy_core": resident_tgs * simdgroups_per_tg / max(1, busy_cores),
            "busy_cores": busy_cores, "spills": work.registers > F["registers_per_thread"].value,
            "limited_by": "threadgroup memory" if by_memory < by_threads else "registers/threads"}


def issue_cycles(work: Work) -> float:
    """Scheduler cycles of the launch's simdgroup instructions (summed over simdgroups)."""
    F = {k: f.value for k, f in FIGURES.items()}
    return (work.fma_lanes / 32.0 * F["ffma32_cycles"]
            + work.transcendental_lanes / 32.0 * F["exp2_cycles"]
            + work.reductions * F["simd_reduce_cycles"] + work.shuffles * F["simd_shuffle_cycles"]
            + work.lane_shuffles * F["simd_shuffle_lanes_cycles"] + work.votes * F["simd_vote_cycles"]
            + work.mma * F["mma_8x8_cycles"]
            + (work.load_instructions + work.store_instructions + work.threadgroup_accesses / 32.0)
            * F["load_issue_cycles"]
            + work.unpack_lane_cycles / 32.0)


def estimate(work: Work, chip: ChipModel | str, params: Params = Params()) -> dict:
    """The modelled time of one launch on ``chip`` (seconds), with its parts."""
    chip = ChipModel.of(chip) if isinstance(chip, str) else chip
    F = {k: f.value for k, f in FIGURES.items()}
    occ = occupancy(work, chip)
    clock = chip.clock_ghz * 1e9
    sustained = chip.bandwidth_gbs * 1e9 * params.sustained_fraction
    in_flight = occ["resident_simdgroups"] * 32 * max(4.0, work.dram_bytes_per_load) * params.loads_in_flight
    littles = in_flight / (params.dram_latency_ns * 1e-9)
    bandwidth = min(sustained, littles)
    memory_s = work.dram_bytes / bandwidth
    # Issue: the busy cores' schedulers, each at full rate only with enough simdgroups resident.
    efficiency = min(1.0, occ["simdgroups_per_busy_core"] / F["full_issue_simdgroups"])
    issue_rate = occ["busy_cores"] * F["schedulers_per_core"] * clock * efficiency
    issue_s = issue_cycles(work) / issue_rate
    core_s = work.core_bytes / (F["core_data_bytes_per_cycle"] * occ["busy_cores"] * clock)
    barriers_per_tg = work.barriers / max(1, work.threadgroups)
    serial_per_wave = (params.dram_latency_ns * 1e-9 + work.chain_loads * params.chain_latency_ns * 1e-9
                       + barriers_per_tg * params.barrier_cycles / clock / occ["threadgroups_per_core"])
    serial_s = occ["waves"] * serial_per_wave
    launch_s = params.launch_overhead_us * 1e-6
    parts = {"memory": memory_s, "issue": issue_s, "core data path": core_s}
    bound = max(parts, key=parts.get)
    if bound == "memory" and littles < sustained:
        bound = "memory (occupancy: too few loads in flight)"
    total = launch_s + max(parts.values()) + serial_s
    return {"kernel": work.name, "chip": chip.name, "seconds": total, "launch_s": launch_s, "memory_s": memory_s,
            "issue_s": issue_s, "core_data_s": core_s, "serial_s": serial_s, "bound": bound,
            "bandwidth_gbs": bandwidth / 1e9, "littles_law_gbs": littles / 1e9, "sustained_gbs": sustained / 1e9,
            "dram_bytes": work.dram_bytes, "registers": work.registers, "source": work.source, **occ}


def estimate_launches(works: list, chip: ChipModel | str, params: Params = Params()) -> dict:
    """Launches run back to back (e.g. partials then reduce): their modelled times add."""
    parts = [estimate(w, chip, params) for w in works]
    seconds = sum(p["seconds"] for p in parts)
    dram = sum(w.dram_bytes for w in works)
    return {"seconds": seconds, "dram_bytes": dram, "launches": parts}


def figures_table() -> list:
    """Every figure the model uses, with its source: rows of (name, value, unit, source, note)."""
    rows = [(k, f.value, f.unit, f.source, f.note) for k, f in FIGURES.items()]
    rows += [(f"clock {k}", f.value, f.unit, f.source, f.note) for k, f in CLOCKS.items()]
    for name in MODELLED_CHIPS:
        c = chips.CHIPS[name]
        rows.append((f"bandwidth {name}", c.bandwidth_gbs, "GB/s", APPLE, "peak memory bandwidth"))
        rows.append((f"gpu cores {name}", c.gpu_cores, "cores", APPLE, "GPU cores (full configuration)"))
    p, notes = Params(), Params.notes()
    rows += [(k, getattr(p, k), "", ASSUMPTION, notes[k]) for k in notes]
    rows.append(("mlx arch suffix", 0, "", ASSUMPTION, "MLX reads the architecture name's last letter: 'g' "
                 "for base chips, 'c' for Max chips assumed (MLX_ARCH_SUFFIX)"))
    return rows
