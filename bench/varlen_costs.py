"""Simulator cost counters and modelled times of the varlen prefill kernel (issue 41, P7/P8).

    python bench/varlen_costs.py [--json out.json] [--quick] [--head-dim D] [--tiles NSG,BK,KT,RF,DS,SKV]

Cases: one sequence whose last 2048 tokens are new rows (a 2K prefill chunk) over 0 or
8K cached tokens, one kv head (the modelled time scales it to cost_cases.KV_HEADS), float16
and K8/V4 g64, GQA 1/4/8, head_dim 64/128 (--quick: context 0, GQA 4, D 128 only; --head-dim:
that head_dim instead, e.g. 256, where the default tiles split D, issue 41 P1; 512: DS 4,
issue 40).

Per case, for the paged_varlen_partials launch (the reduce is listed in the modelled time):
- measured by the simulator: loads and bytes per load of each device buffer, K/V bytes
  loaded, barriers, 8x8 MMAs, shuffles, transcendental lanes, threadgroups, threadgroup memory;
- derived from the kernel's index maps (the simulator records no addresses): the distinct
  128-byte cache lines one simdgroup load instruction of the K/V tile fill touches, and the
  fraction of those lines' bytes it uses; the threadgroup fragment loads per K/V tile and
  MMAs per fragment load;
- modelled (kvmetal/sim/cost_model.py, not measured): the partials + reduce time on M2 Max and
  M4 Max, and for float16 D 128 over no context MLX's steel attention (simulated) beside it.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import mlx.core as mx
import numpy as np

import kvmetal as kv
from kvmetal import quant, sim
from kvmetal.backends import metal_layout
from kvmetal.sim import cost_cases as cc
from kvmetal.sim import cost_model as cm
from kvmetal.sim.backend import sim_backend

CHIPS = ("m2-max", "m4-max")
NEW = 2048
LINE = 128  # bytes per cache line (assumed)
OLD_FILL = False  # --old-fill: the kernel before P7 (the KT fill gave lane i key i % BK)


def _cache(rng, blocks, bs, d, bits):
    x = mx.array(rng.standard_normal((blocks, 1, bs, d)).astype(np.float32)).astype(mx.float16)
    return quant.quantize(x, bits=bits, group_size=64) if bits else x


def _tiles_of(call_name: str) -> dict:
    vals = {}
    for part in call_name.split("_"):
        for key in ("nsg", "bk", "kt", "rf", "ds", "skv", "kbits", "vbits"):
            if part.startswith(key) and part[len(key):].isdigit():
                vals.setdefault(key, int(part[len(key):]))
    return vals


def fill_lines(*, d, bits, bk, nt, mapping, group=64, per_thread=None):
    """(cache lines, fraction of their bytes used, bytes per lane) of one simdgroup load
    instruction of the tile fill: lanes 0..31 of the first simdgroup, their first load.
    ``mapping``: "key" (lane i takes key i % BK: the old KT fill) or "row" (lane i takes
    task i % TASKS of key i / TASKS: consecutive lanes along one row). Keys of one block are
    consecutive rows (BS >= 16 here)."""
    width = d * bits // 8 if bits else d * 2                     # bytes per row
    if bits:
        run = 32 if 32 % bits else max(32 // bits, 8)
        task = group
        pt = per_thread if per_thread is not None else d * bk // nt
        for _ in range(4):
            if task // 2 >= run and task > pt:
                task //= 2
        tbytes = task * bits // 8
    else:
        task, tbytes = 8, 16
    tasks = d // task
    vec = 16 if (not bits or (width % 16 == 0 and tbytes % 16 == 0)) else (8 if width % 8 == 0 and tbytes % 8 == 0 else 4)
    if mapping == "key" and bits:
        vec = 4  # the old fill read packed words one by one
    lines = set()
    for lane in range(32):
        r, t = (lane % bk, lane // bk) if mapping == "key" else (lane // tasks, lane % tasks)
        start = r * width + t * tbytes
        lines.add(start // LINE)
        lines.add((start + vec - 1) // LINE)
    return len(lines), round(32 * vec / (len(lines) * LINE), 3), vec


def case(rng, *, context, gqa, d, fmt, tiles=None):
    kb, vb = (0, 0) if fmt == "f16" else (8, 4)
    bs = 16
    length = context + NEW
    blocks = length // bs
    kc, vc = _cache(rng, blocks + 1, bs, d, kb), _cache(rng, blocks + 1, bs, d, vb)
    tables = mx.array(rng.permutation(blocks + 1)[:blocks][None].astype(np.int32))
    q = mx.array(rng.standard_normal((NEW, gqa, d)).astype(np.float32)).astype(mx.float16)
    t0 = time.time()
    with kv.use_backend("sim"), sim.trace(strict=False, seed=0) as t:
        mx.eval(sim_backend().paged_attention_varlen(
            q, kc, vc, tables, mx.array([length], mx.int32), mx.array([0, NEW], mx.int32),
            scale=d ** -0.5, softcap=None, sliding_window=None, sinks=None, tiles=tiles)
            if tiles is not None else
            kv.paged_attention_varlen(q, kc, vc, tables, mx.array([length], mx.int32), mx.array([0, NEW], mx.int32)))
    secs = time.time() - t0
    scores = gqa * NEW * (context + (NEW + 1) / 2)
    works, out = [], None
    for call in t.calls:
        if "varlen" in call.name:
            works.append(cm.work_from_call(call, fma_lanes=scores * cc.SOFTMAX_OPS, name="varlen"))
            tv = _tiles_of(call.name.split("kvmetal_paged_varlen_partials_")[1])
            bufs = {n: {"loads": b.load_ops, "bytes_per_load": round(b.bytes_per_load, 2)}
                    for n, b in call.buffers.items() if b.load_ops}
            kvn = [n for n in ("key_data", "key_scales", "key_biases", "value_data", "value_scales", "value_biases")
                   if n in call.buffers]
            nsg, bk, rf, ds = tv.get("nsg", 4), tv.get("bk", 32), tv.get("rf", 1), tv.get("ds", 1)
            kf, df = bk // 8, d // 8 // ds
            # Threadgroup fragment loads per K/V tile per simdgroup: K and V fragments (one
            # each per (key block, dim block) of its dims), Q fragments when Q is staged (RF
            # per dim block); split-D adds the DS partial scores it sums (RF x KF x DS float2 loads).
            frag_loads = 2 * kf * df + (rf * df if rf > 1 else 0) + (rf * kf * ds if ds > 1 else 0)
            mma_tile = 2 * rf * kf * df
            ttk = 4 if kb else 2
            out = {"kernel": call.name, "threadgroups": call.threadgroups, "threads": call.threadgroup[0],
                   "threadgroup_memory": call.threadgroup_memory, "barriers": call.barriers,
                   "mma": call.mma, "reductions": call.reductions, "shuffles": call.shuffles, "transcendentals": call.transcendentals,
                   "kv_loaded": sum(call.buffers[n].loaded for n in kvn),
                   "kv_loads": sum(call.buffers[n].load_ops for n in kvn),
                   "kv_bytes_per_load": round(call.bytes_per_load(*kvn), 2),
                   "query_loads": call.buffers["query"].load_ops,
                   "loads": sum(b.load_ops for b in call.buffers.values()), "buffers": bufs,
                   "fill_k_lines": fill_lines(d=d, bits=kb, bk=bk, nt=32 * nsg,
                                              mapping="key" if tv.get("kt") and OLD_FILL else "row"),
                   "fill_v_lines": fill_lines(d=d, bits=vb, bk=bk, nt=32 * nsg, mapping="row"),
                   "fragment_loads_per_tile": frag_loads, "mma_per_tile": mma_tile,
                   "mma_per_fragment_load": round(mma_tile / frag_loads, 3),
                   "k_tile_bytes_type": ttk, "block_table_loads": call.buffers["block_tables"].load_ops,
                   "registers": metal_layout.varlen_registers(head_dim=d, block_k=bk, row_fragments=rf, d_split=ds)}
        else:
            rows = NEW * gqa
            works.append(cm.work_from_call(call, fma_lanes=rows * (d + cc.SOFTMAX_OPS), name="reduce"))
    out["modelled_us"] = {chip: round(cm.estimate_launches([w.scaled(cc.KV_HEADS) for w in works], chip)["seconds"]
                                      * 1e6, 2) for chip in CHIPS}
    out["simulated_seconds"] = round(secs, 1)
    return out


def measure(quick=False, tiles=None, steel=True, progress=print, head_dim=None) -> list:
    rows = []
    # (8K context only at GQA 4, D 128: the simulator takes minutes per such case.)
    grid = [(0, 4, head_dim or 128, "f16")] if quick else [(0, g, head_dim, f) for f in ("f16", "K8/V4")
                                                           for g in (1, 4, 8)] if head_dim else (
        [(0, g, d, f) for f in ("f16", "K8/V4") for g in (1, 4, 8) for d in (64, 128)]
        + [(8192, 4, 128, f) for f in ("f16", "K8/V4")])
    for context, gqa, d, fmt in grid:
        progress(f"context {context} G{gqa} D{d} {fmt} ...")
        r = {"context": context, "new": NEW, "gqa": gqa, "head_dim": d, "format": fmt}
        r.update(case(np.random.default_rng(0), context=context, gqa=gqa, d=d, fmt=fmt, tiles=tiles))
        if steel and context == 0 and fmt == "f16" and d == cc.D:
            w = cc.steel_attention(NEW, gqa).scaled(cc.KV_HEADS)
            r["mlx_steel_modelled_us"] = {chip: round(cm.estimate_launches([w], chip)["seconds"] * 1e6, 2)
                                          for chip in CHIPS}
        progress("   " + json.dumps({k: v for k, v in r.items() if k != "buffers"}))
        rows.append(r)
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--no-steel", action="store_true")
    parser.add_argument("--head-dim", type=int, default=None,
                        help="this head_dim only (context 0; with --quick: GQA 4 f16 only)")
    parser.add_argument("--tiles", help="NSG,BK[,KT[,RF[,DS[,SKV]]]]: a VarlenTiles override")
    parser.add_argument("--old-fill", action="store_true", help="index map of the fill before issue 41 P7")
    args = parser.parse_args(argv)
    global OLD_FILL
    OLD_FILL = args.old_fill
    tiles = None
    if args.tiles:
        vals = [int(x) for x in args.tiles.split(",")]
        tiles = metal_layout.VarlenTiles(*vals[:2], *(bool(v) if i in (0, 3) else v for i, v in enumerate(vals[2:])))
    rows = measure(args.quick, tiles, steel=not args.no_steel, head_dim=args.head_dim)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"label": "simulator counters (measured); fill lines and fragment loads from the kernel's "
                                "index maps; times MODELLED by kvmetal/sim/cost_model.py, not measured",
                       "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
