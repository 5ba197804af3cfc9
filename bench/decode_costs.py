"""Simulator cost counters and MODELLED times of the decode partials (paged_attention_partials
+ attention_reduce), register and shared mode (issue 41, P5 and P6; docs/kernels.md).

    python bench/decode_costs.py [--json out.json] [--quick]

Cases: head_dim 128, f16 and K8/V4 (g64); register mode at GQA 4 and 8 (one query token),
shared mode at GQA 16 (one token) and GQA 4 x 4 query tokens (speculative verify: 16 rows);
batch 1 at 8K and 32K tokens and batch 64 x 4K. The simulator runs one kv head; counts and
modelled times are scaled to 8 kv heads (kvmetal.sim.cost_cases.KV_HEADS), as
tools/cost_model.py does. Per case: barriers (total and per 1K K/V rows read, i.e. per 1024
tokens x kv heads), the partials kernel's threadgroup memory and tile tokens, partials bytes
(part_max + part_sum + part_acc stored), and the modelled time (kvmetal/sim/cost_model.py) on
M2 Max and M4 Max. Every time is MODELLED from published figures and assumptions, not measured.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import mlx.core as mx
import numpy as np

from kvmetal import quant
from kvmetal.backends import metal_layout
from kvmetal.sim import cost_cases as cc
from kvmetal.sim import cost_model as cm
from kvmetal.sim import traffic
from kvmetal.sim.backend import sim_backend
from kvmetal.sim.trace import trace

D, BS = 128, 16
CHIPS = ("m2-max", "m4-max")
FORMATS = {"f16": (0, 0), "K8/V4": (8, 4)}
SHAPES = {"register G4": (4, 1), "register G8": (8, 1), "shared G16": (16, 1), "shared G4xL4": (4, 4)}
SIZES = {"1x8K": (1, 8192), "1x32K": (1, 32768), "64x4K": (64, 4096)}


def run_case(batch, tokens, gqa, qlen, fmt, seed=0):
    k_bits, v_bits = FORMATS[fmt]
    rng = np.random.default_rng(seed)
    nb = -(-tokens // BS)
    shape = (batch * nb, 1, BS, D)
    k = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.float16)
    v = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(mx.float16)
    if k_bits:
        k = quant.quantize(k, bits=k_bits, group_size=64)
        v = quant.quantize(v, bits=v_bits, group_size=64)
    tables = mx.array(rng.permutation(batch * nb).astype(np.int32).reshape(batch, nb))
    q = mx.array(rng.standard_normal((batch, qlen, gqa, D)).astype(np.float32)).astype(mx.float16)
    with trace() as t:
        mx.eval(sim_backend().paged_attention(
            q, k, v, tables, mx.array([tokens] * batch, mx.int32), scale=D ** -0.5, softcap=None,
            sliding_window=None, sinks=None, num_splits=None))
    rows = gqa * qlen
    out = {"launches": [], "works": []}
    for call in t.calls:
        if "partials" in call.name:
            w = cc.partials_work(call, key_rows=batch * tokens, rows_per_key=rows, k_bits=k_bits, v_bits=v_bits,
                                 name="partials")
            partial_bytes = sum(call.buffers[n].distinct_stored for n in ("part_max", "part_sum", "part_acc"))
            out["launches"].append({"kernel": "partials", "grid": list(call.grid), "threadgroup": call.threadgroup[0],
                                    "threadgroup_memory": call.threadgroup_memory,
                                    "register_mode": cm.register_mode(call.name),
                                    "barriers_per_kv_head": call.barriers,
                                    "partials_bytes": partial_bytes * cc.KV_HEADS,
                                    "kv_bytes_loaded": sum(call.buffers[n].loaded for n in traffic.KV_BUFFERS
                                                           if n in call.buffers) * cc.KV_HEADS})
        else:
            w = cc.reduce_work(call, rows=batch * rows, name="reduce")
            out["launches"].append({"kernel": "reduce", "grid": list(call.grid), "barriers_per_kv_head": call.barriers,
                                    "dependent_loads": w.chain_loads,
                                    "partials_bytes_loaded": sum(call.buffers[n].loaded for n in
                                                                 ("part_max", "part_sum", "part_acc")) * cc.KV_HEADS})
        out["works"].append(w.scaled(cc.KV_HEADS))
    return out


def measure(quick=False, progress=lambda s: None):
    layout_kw = dict(head_dim=D, k_group=64, k_itemsize=2, v_group=64, v_itemsize=2, block_size=BS)
    rows = []
    sizes = {"1x8K": SIZES["1x8K"]} if quick else SIZES
    for shape_name, (gqa, qlen) in SHAPES.items():
        for fmt, (kb, vb) in FORMATS.items():
            lay = metal_layout.attention_layout(gqa=gqa, query_len=qlen, k_bits=kb, v_bits=vb, **layout_kw)
            for size_name, (batch, tokens) in sizes.items():
                progress(f"  {shape_name} {fmt} {size_name} ...")
                r = run_case(batch, tokens, gqa, qlen, fmt)
                part = r["launches"][0]
                kv_rows = batch * tokens * cc.KV_HEADS
                barriers = part["barriers_per_kv_head"] * cc.KV_HEADS
                row = {"case": f"{shape_name} {fmt} {size_name}", "mode": shape_name.split()[0], "gqa": gqa,
                       "query_len": qlen, "format": fmt, "batch": batch, "tokens": tokens,
                       "layout": {"simdgroups": lay.simdgroups, "rows_per_simdgroup": lay.rows_per_simdgroup,
                                  "lanes_per_key": lay.lanes_per_key, "tile": lay.tile},
                       "partials_threadgroup_memory": part["threadgroup_memory"],
                       "partials_grid": part["grid"],
                       "partials_barriers": barriers,
                       "barriers_per_1k_kv_rows": round(barriers * 1024 / kv_rows, 2),
                       "partials_bytes": part["partials_bytes"], "modelled_us": {}}
                for chip in CHIPS:
                    est = cm.estimate_launches(r["works"], chip)
                    row["modelled_us"][chip] = round(est["seconds"] * 1e6, 2)
                    row.setdefault("partials_modelled", {})[chip] = {
                        k: (round(v * 1e6, 3) if k.endswith("_s") else v) for k, v in est["launches"][0].items()
                        if k in ("seconds", "memory_s", "issue_s", "serial_s", "bound", "threadgroups_per_core",
                                 "limited_by")}
                rows.append(row)
    return {"label": "simulator counters; times MODELLED (kvmetal/sim/cost_model.py), not measured",
            "tile_memory_budget_d128": metal_layout.tile_memory_budget(D), "rows": rows}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--quick", action="store_true", help="batch 1 at 8K only")
    args = ap.parse_args(argv)
    res = measure(args.quick, progress=lambda s: print(s, file=sys.stderr, flush=True))
    for r in res["rows"]:
        print(f"{r['case']:32s} tile {r['layout']['tile']:2d} tg {r['partials_threadgroup_memory']:6d} "
              f"barriers/1K {r['barriers_per_1k_kv_rows']:7.2f} partials {r['partials_bytes']:9d} "
              + " ".join(f"{c} {r['modelled_us'][c]:8.2f}us" for c in CHIPS))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
