"""The cost model's cases: kvmetal's kernels and MLX's in the simulator, turned into Work
(kvmetal/sim/cost_model.py) and modelled per chip. tools/cost_model.py prints them;
``kvmetal bench`` on Linux prints a few as "modelled".

Shapes: batch 1, head_dim 128, 8 kv heads (a Llama-3-8B-like layer at GQA 4), GQA 1/4/8.
Every kernel here gives each kv head its own threadgroups, so one kv head is simulated and
its counters multiplied by 8 (Work.scaled); tests/test_cost_model.py checks that the
counters of 2 kv heads are twice those of 1.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import quant
from . import cost_model as cm
from .trace import trace

D = 128
KV_HEADS = 8
SOFTMAX_OPS = 4          # scale/max/subtract/sum per score, in FMA-equivalent lane ops (estimate)
FORMATS = {"f16": (None, None), "K8/V4": (8, 4)}


def _split_chain(call, buffer: str) -> int:
    """Dependent loads in a row per lane of a reduce: its loads of the per-split max buffer
    per lane (each walked one after another), read from the counters."""
    b = call.buffers.get(buffer)
    return int(round(b.load_ops / max(1, call.threads))) if b is not None else 0


def kvmetal_decode(tokens: int, gqa: int, fmt: str = "f16", *, kv_heads_sim: int = 1, seed: int = 0):
    """kvmetal's paged decode (partials + reduce) for one sequence: [Work, ...] for
    ``kv_heads_sim`` kv heads (not scaled)."""
    from .backend import sim_backend

    k_bits, v_bits = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    bs = 16
    nb = -(-tokens // bs)
    shape = (nb, kv_heads_sim, bs, D)
    k = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.float16)
    v = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.float16)
    if k_bits:
        k = quant.quantize(k, bits=k_bits, group_size=64)
        v = quant.quantize(v, bits=v_bits, group_size=64)
    tables = mx.array(rng.permutation(nb).astype(np.int32)[None])
    q = mx.array(rng.standard_normal((1, 1, kv_heads_sim * gqa, D)).astype(np.float32)).astype(mx.float16)
    with trace() as t:
        mx.eval(sim_backend().paged_attention(
            q, k, v, tables, mx.array([tokens], mx.int32), scale=D ** -0.5, softcap=None, sliding_window=None,
            sinks=None, num_splits=None))
    return [partials_work(call, key_rows=tokens * kv_heads_sim, rows_per_key=gqa, k_bits=k_bits, v_bits=v_bits,
                          name="kvmetal paged_attention_partials") if "partials" in call.name
            else reduce_work(call, rows=kv_heads_sim * gqa, name="kvmetal attention_reduce") for call in t.calls]


def partials_work(call, *, key_rows: int, rows_per_key: int, k_bits: int, v_bits: int, name: str) -> cm.Work:
    """The Work of a decode partials ``call`` that walks ``key_rows`` K/V rows in all (tokens x
    kv heads x sequences), each scored by ``rows_per_key`` query rows (G x L): the QK / PV
    lane FMAs and softmax, the quantized unpack (cost_model.unpack_copies: once a walk) and the
    shared-mode tile's threadgroup accesses (cost_model.shared_tile_accesses)."""
    unpack = key_rows * D * cm.unpack_copies(call.name) * sum(cm.unpack_cycles(b) for b in (k_bits, v_bits) if b)
    return cm.work_from_call(call, fma_lanes=key_rows * rows_per_key * (2 * D + SOFTMAX_OPS),
                             unpack_lane_cycles=unpack, name=name,
                             threadgroup_accesses=cm.shared_tile_accesses(call.name, key_rows))


def reduce_work(call, *, rows: int, name: str) -> cm.Work:
    """The Work of an attention_reduce ``call`` over ``rows`` output rows: D + softmax per
    (row, split), and its dependent-load chain (per split: the sum's test, then the merge's loads)."""
    splits = call.buffers["part_max"].size // 4 // max(1, rows)
    chain = 2 * _split_chain(call, "part_max")
    return cm.work_from_call(call, fma_lanes=rows * splits * (D + SOFTMAX_OPS), chain_loads=chain, name=name)


# Registers per lane of MLX's kernels, estimated from their arrays as kvmetal's estimator does
# (q, o and the K/V values a lane holds, plus 32 for indices and addresses).
MLX_REGISTERS = {"sdpa_vector": 4 + 4 + 4 + 32, "2pass_1": 4 + 4 + 4 + 32, "2pass_1_gqa": 16 + 16 + 8 + 8 + 32,
                 "2pass_2": 4 + 8 + 32}


def mlx_decode(tokens: int, gqa: int, *, arch_suffix: str = "g", kv_heads_sim: int = 1, seed: int = 0):
    """MLX's decode as MLX dispatches it (float16 only): (plan, [Work, ...]) for ``kv_heads_sim``."""
    from .mlx_kernels import mlx_decode_calls

    plan, calls = mlx_decode_calls(tokens, gqa=gqa, num_kv_heads=kv_heads_sim, head_dim=D, arch_suffix=arch_suffix,
                                   seed=seed)
    rows = kv_heads_sim * gqa
    works = []
    for call in calls:
        if "2pass_2" in call.name:
            nb = plan["blocks"]
            works.append(cm.work_from_call(call, fma_lanes=rows * nb * (D + SOFTMAX_OPS),
                                           chain_loads=_split_chain(call, "maxs"), exclude=("params",),
                                           registers=MLX_REGISTERS["2pass_2"], name="MLX sdpa_vector_2pass_2"))
        else:
            kind = "2pass_1_gqa" if "gqa" in call.name else "2pass_1" if "2pass" in call.name else "sdpa_vector"
            works.append(cm.work_from_call(call, fma_lanes=rows * tokens * (2 * D + SOFTMAX_OPS),
                                           registers=MLX_REGISTERS[kind], name=f"MLX {call.name.split('mlx_')[1]}",
                                           exclude=("params",)))
    return plan, works


def kvmetal_varlen(tokens: int = 2048, gqa: int = 4, *, kv_heads_sim: int = 1, seed: int = 0):
    """kvmetal's paged_attention_varlen over one prefill of ``tokens`` new tokens (no cache before),
    float16: [Work, ...] for ``kv_heads_sim`` kv heads."""
    import kvmetal as kv

    rng = np.random.default_rng(seed)
    bs = 16
    nb = -(-tokens // bs)
    shape = (nb + 1, kv_heads_sim, bs, D)
    kc = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.float16)
    vc = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.float16)
    tables = mx.array(rng.permutation(nb + 1)[:nb][None].astype(np.int32))
    q = mx.array(rng.standard_normal((tokens, kv_heads_sim * gqa, D)).astype(np.float32)).astype(mx.float16)
    with kv.use_backend("sim"), trace(strict=False, seed=0) as t:
        mx.eval(kv.paged_attention_varlen(q, kc, vc, tables, mx.array([tokens], mx.int32),
                                          mx.array([0, tokens], mx.int32)))
    scores = kv_heads_sim * gqa * tokens * (tokens + 1) // 2
    works = []
    for call in t.calls:
        if "varlen" in call.name:
            works.append(cm.work_from_call(call, fma_lanes=scores * SOFTMAX_OPS, name="kvmetal paged_varlen_partials"))
        else:
            rows = tokens * kv_heads_sim * gqa
            works.append(cm.work_from_call(call, fma_lanes=rows * (D + SOFTMAX_OPS),
                                           chain_loads=2 * _split_chain(call, "part_max"),
                                           name=f"kvmetal {call.name.split('kvmetal_')[1].split('_t')[0]}"))
    return works


def steel_attention(tokens: int = 2048, gqa: int = 4, *, kv_heads_sim: int = 1, seed: int = 0) -> cm.Work:
    """MLX's steel attention run in the simulator (causal prefill, float16): its Work for
    ``kv_heads_sim`` kv heads (not scaled). Registers: STEEL_REGISTERS."""
    from .mlx_kernels import mlx_steel_attention_call

    call = mlx_steel_attention_call(tokens, gqa=gqa, num_kv_heads=kv_heads_sim, head_dim=D, seed=seed)
    scores = kv_heads_sim * gqa * tokens * (tokens + 1) // 2
    return cm.work_from_call(call, fma_lanes=scores * SOFTMAX_OPS, registers=STEEL_REGISTERS,
                             name="MLX steel_attention", exclude=("params",))


# Registers per lane of steel attention (D 128, BQ 32, BK 16, one 8-row fragment per simdgroup), from
# its arrays: the O tile (16 fragments x 2), the S tile (2 x 2), the K/V fragment being loaded,
# row max/sum, plus 32 for indices and addresses.
STEEL_REGISTERS = 2 * (D // 8) + 2 * (16 // 8) + 16 + 32


def steel_varlen(tokens: int = 2048, gqa: int = 4, *, kv_heads: int = KV_HEADS) -> cm.Work:
    """MLX's steel attention (causal prefill, float16, D 128), modelled analytically from its tile
    sizes (the simulator does not run it; docs/cost_model.md): BQ 32, BK 16, 4 simdgroups of one
    8-row fragment each, Q in threadgroup memory, K and V tiles through one shared buffer, 4
    barriers per K/V tile, 2 x (BK/8) x (D/8) 8x8 MMAs per simdgroup per tile (QK and PV)."""
    bq, bk, sg = 32, 16, 4
    heads = kv_heads * gqa
    nq = -(-tokens // bq)
    # causal: query block i visits key tiles up to its last row
    tiles = sum(-(-min(tokens, (i + 1) * bq) // bk) for i in range(nq)) * heads
    tg_mem = 2 * (bq * (D + 8) + max((bk + 8) * D, bk * (D + 8)))
    mma = tiles * sg * 2 * (bk // 8) * (D // 8)
    scores = heads * tokens * (tokens + 1) // 2
    kv_tile_bytes = 2 * bk * D * 2
    q_bytes = heads * tokens * D * 2
    out_bytes = q_bytes
    kv_bytes = 2 * kv_heads * tokens * D * 2
    loaded = tiles * kv_tile_bytes + q_bytes
    return cm.Work(
        name="MLX steel_attention (analytic)", threadgroups=nq * heads, threads_per_threadgroup=32 * sg,
        threadgroup_memory=tg_mem, registers=STEEL_REGISTERS,
        dram_bytes=kv_bytes + q_bytes + out_bytes, core_bytes=loaded + out_bytes, dram_bytes_per_load=16.0,
        load_instructions=loaded / 16 / 32, store_instructions=out_bytes / 8 / 32 + loaded / 16 / 32,
        barriers=tiles * 4 + nq * heads, reductions=0, shuffles=tiles * sg * 2 * 2,
        mma=mma, transcendental_lanes=tiles * (bq * bk + bq), fma_lanes=scores * SOFTMAX_OPS, source="analytic")


def flops_prefill(tokens: int, heads: int) -> float:
    """Causal attention FLOPs (QK and PV, 2 per multiply-add) over the visible pairs."""
    return 4.0 * D * heads * tokens * (tokens + 1) / 2
