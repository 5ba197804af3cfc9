"""Issue 41's closing tables, one row per kernel family and case: estimated registers per
lane, barriers per 1K K/V rows, partials bytes over K/V bytes at 32K x 1 and 64 x 4K, the
reduce's dependent-load chain, varlen MMAs per fragment load, and modelled time.

    python bench/kernel_tables.py [--json out.json]

Registers: the most any launch of the family estimates over the specialisation registry
(tools/kernel_limits.py; metal_layout.estimated_registers, an estimate from each kernel's
data layout, not a compiler's count). Decode rows: the paged decode partials + reduce in the
simulator (bench/window_policy.py's runner at today's split windows; D 128, block 16,
8 kv heads), register mode at GQA 4 and 8, shared mode at GQA 16 and 4 x 4 rows.
Varlen: one 2K prefill at GQA 4 (bench/varlen_costs.py's runner). Every time is MODELLED
(kvmetal/sim/cost_model.py), never measured.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tools"))

import kernel_limits  # noqa: E402
import window_policy as wp  # noqa: E402

from kvmetal.backends import metal_layout  # noqa: E402


def registers() -> dict:
    """kernel -> (mode -> most estimated registers per lane) over the registry
    (tools/kernel_limits.py's summary)."""
    out: dict = {}
    for kernel, mode, _launches, _threads, regs in kernel_limits.summary(kernel_limits.launches()):
        out.setdefault(kernel, {})[mode] = regs
    return out


def decode_rows() -> list:
    div, cap = metal_layout.window_div(), metal_layout.SPLIT_WINDOW_MAX
    rows = []
    for shape, (gqa, qlen) in wp.SHAPES.items():
        for fmt in wp.dc.FORMATS:
            row = {"case": f"{shape} {fmt}"}
            for size in ("1x32K", "64x4K"):
                batch, sim_batch, tokens = wp.SIZES[size]
                r = wp.run(div, cap, batch, sim_batch, tokens, gqa, qlen, fmt)
                row[size] = r
            rows.append(row)
    return rows


def varlen_rows() -> list:
    import numpy as np
    import varlen_costs as vc

    rows = []
    for fmt in ("f16", "K8/V4"):
        r = vc.case(np.random.default_rng(0), context=0, gqa=4, d=128, fmt=fmt)
        rows.append({"case": f"varlen 2K G4 {fmt}", **{k: r[k] for k in (
            "threadgroup_memory", "barriers", "mma_per_fragment_load", "kv_loads", "loads", "modelled_us")}})
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    regs = registers()
    print("| kernel | mode | most est. registers / lane |\n|---|---|---|")
    for kernel, modes in sorted(regs.items()):
        for mode, r in sorted(modes.items()):
            print(f"| {kernel} | {mode} | {r} |")
    rows = decode_rows()
    print("\nDecode (paged partials + reduce), MODELLED us M2 Max / M4 Max")
    print("| case | barriers / 1K rows | partials 32K x 1 | partials 64 x 4K | reduce dependent loads (32K) "
          "| 1 x 32K us | 64 x 4K us |\n|---|---|---|---|---|---|---|")
    for row in rows:
        a, b = row["1x32K"], row["64x4K"]
        us = lambda r: f"{r['modelled_us']['m2-max']:.1f} / {r['modelled_us']['m4-max']:.1f}"
        print(f"| {row['case']} | {a['barriers_per_1k_rows']} | {a['partials_fraction']:.2%} | "
              f"{b['partials_fraction']:.2%} | {a['reduce_dependent_loads']} | {us(a)} | {us(b)} |")
    vrows = varlen_rows()
    print("\nVarlen prefill (one 2K prompt, GQA 4, D 128), MODELLED us M2 Max / M4 Max")
    print("| case | threadgroup bytes | barriers | MMA per fragment load | loads (K/V) | us |\n|---|---|---|---|---|---|")
    for r in vrows:
        print(f"| {r['case']} | {r['threadgroup_memory']} | {r['barriers']} | {r['mma_per_fragment_load']} | "
              f"{r['loads']} ({r['kv_loads']}) | {r['modelled_us']['m2-max']:.1f} / {r['modelled_us']['m4-max']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"label": "estimates and simulator counters; times MODELLED",
                                               "registers": regs, "decode": rows, "varlen": vrows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
