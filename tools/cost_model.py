"""Modelled (not measured) times of kvmetal's attention kernels and MLX's on Apple GPUs.

    python tools/cost_model.py [--json out.json] [--quick]

Runs kvmetal's paged decode (partials + reduce) and varlen prefill and MLX's decode kernels
(sdpa_vector / 2pass, as MLX dispatches them) in the simulator, turns each call's counters
into a modelled time per chip (kvmetal/sim/cost_model.py; figures and assumptions in
docs/cost_model.md) and prints the table. MLX's steel attention runs in the simulator
too (its header read from the installed MLX); an analytic model from its tile sizes is kept in
the JSON as a cross-check. Every time printed is MODELLED from published figures and assumptions;
none is measured. --quick: 8K decode at GQA 4 only (what `kvmetal bench` prints).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from kvmetal.sim import cost_cases as cc
from kvmetal.sim import cost_model as cm

TABLE_CHIPS = ("m2", "m2-max", "m4", "m4-max")


def live_kv_bytes(tokens: int, fmt: str) -> int:
    from kvmetal import quant

    if fmt == "f16":
        row = 2 * cc.D * 2
    else:
        k_bits, v_bits = cc.FORMATS[fmt]
        row = (quant.row_nbytes(cc.D, bits=k_bits, group_size=64, scale_bytes=2)
               + quant.row_nbytes(cc.D, bits=v_bits, group_size=64, scale_bytes=2))
    return tokens * cc.KV_HEADS * row


def decode_rows(sizes, gqas, formats, chips, progress, params=cm.Params()) -> list:
    rows, mlx_cache = [], {}
    for tokens in sizes:
        for gqa in gqas:
            plans = {}
            for suffix in sorted({cm.MLX_ARCH_SUFFIX[c] for c in chips}):
                progress(f"  simulating MLX decode T={tokens} G{gqa} (arch '{suffix}') ...")
                plan, works = cc.mlx_decode(tokens, gqa, arch_suffix=suffix)
                plans[suffix] = (plan, [w.scaled(cc.KV_HEADS) for w in works])
            mlx_cache[(tokens, gqa)] = plans
            for fmt in formats:
                progress(f"  simulating kvmetal decode T={tokens} G{gqa} {fmt} ...")
                works = [w.scaled(cc.KV_HEADS) for w in cc.kvmetal_decode(tokens, gqa, fmt)]
                live = live_kv_bytes(tokens, fmt)
                row = {"case": f"decode T={tokens // 1024}K G{gqa} {fmt}", "kind": "decode", "tokens": tokens,
                       "gqa": gqa, "format": fmt, "kv_heads": cc.KV_HEADS, "live_kv_bytes": live, "chips": {}}
                for chip in chips:
                    k = cm.estimate_launches(works, chip, params)
                    plan, mworks = plans[cm.MLX_ARCH_SUFFIX[chip]]
                    m = cm.estimate_launches(mworks, chip, params)
                    sustained = cm.ChipModel.of(chip).bandwidth_gbs * 1e9 * params.sustained_fraction
                    row["chips"][chip] = {
                        "kvmetal_s": k["seconds"], "mlx_f16_s": m["seconds"],
                        "mlx_kernel": plan["kernel"] + (f" blocks {plan['blocks']}" if plan["blocks"] else "")
                        + (" gqa" if plan["gqa_variant"] else ""),
                        "kvmetal_fraction_of_modelled_bw": live / k["seconds"] / sustained,
                        "kvmetal_fraction_of_peak_bw": live / k["seconds"] / (sustained / params.sustained_fraction),
                        "kvmetal_launches": k["launches"], "mlx_launches": m["launches"]}
                rows.append(row)
    # K8/V4 time / f16 time (kvmetal)
    by = {(r["tokens"], r["gqa"], r["format"]): r for r in rows}
    for r in rows:
        f16 = by.get((r["tokens"], r["gqa"], "f16"))
        if f16 is not None and r["format"] != "f16":
            for chip in chips:
                r["chips"][chip]["over_f16"] = r["chips"][chip]["kvmetal_s"] / f16["chips"][chip]["kvmetal_s"]
    return rows


def varlen_rows(tokens, gqa, chips, progress, params=cm.Params()) -> list:
    progress(f"  simulating kvmetal varlen prefill T={tokens} G{gqa} (one kv head, scaled x{cc.KV_HEADS}) ...")
    works = [w.scaled(cc.KV_HEADS) for w in cc.kvmetal_varlen(tokens, gqa)]
    progress(f"  simulating MLX steel attention T={tokens} G{gqa} (one kv head, scaled x{cc.KV_HEADS}) ...")
    steel = cc.steel_attention(tokens, gqa).scaled(cc.KV_HEADS)
    analytic = cc.steel_varlen(tokens, gqa)
    flops = cc.flops_prefill(tokens, cc.KV_HEADS * gqa)
    row = {"case": f"varlen prefill T={tokens // 1024}K G{gqa} f16", "kind": "varlen", "tokens": tokens, "gqa": gqa,
           "format": "f16", "kv_heads": cc.KV_HEADS, "flops": flops, "chips": {}}
    for chip in chips:
        k = cm.estimate_launches(works, chip, params)
        m = cm.estimate_launches([steel], chip, params)
        a = cm.estimate_launches([analytic], chip, params)
        row["chips"][chip] = {"kvmetal_s": k["seconds"], "mlx_steel_s": m["seconds"],
                              "mlx_steel_analytic_s": a["seconds"],
                              "mlx_kernel": "steel_attention (simulated)",
                              "kvmetal_tflops": flops / k["seconds"] / 1e12, "mlx_tflops": flops / m["seconds"] / 1e12,
                              "per_flop_vs_mlx": m["seconds"] / k["seconds"],
                              "kvmetal_launches": k["launches"], "mlx_launches": m["launches"]}
    return [row]


def measure(*, quick: bool = False, chips=cm.MODELLED_CHIPS, progress=lambda s: None, params=cm.Params()) -> dict:
    t0 = time.time()
    if quick:
        rows = decode_rows([8192], [4], ["f16", "K8/V4"], chips, progress, params)
    else:
        rows = decode_rows([8192, 32768], [1, 4, 8], ["f16", "K8/V4"], chips, progress, params)
        rows += varlen_rows(2048, 4, chips, progress, params)
    return {"label": "MODELLED from published figures and assumptions (kvmetal/sim/cost_model.py); not measured",
            "shape": f"batch 1, head_dim {cc.D}, {cc.KV_HEADS} kv heads; decode one token; varlen: one 2K prefill",
            "figures": [dict(zip(("name", "value", "unit", "source", "note"), r)) for r in cm.figures_table()],
            "params": dataclasses.asdict(params), "rows": rows, "simulated_seconds": round(time.time() - t0, 1)}


def sensitivity(tokens: int = 32768, gqa: int = 4, chip: str = "m2-max", progress=lambda s: None) -> list:
    """How the headline ratios move when each assumption is halved or doubled (one at a time):
    rows of (param, factor, kvmetal f16 us, MLX/kvmetal, K8V4/f16, of modelled BW)."""
    progress(f"  sensitivity: simulating T={tokens} G{gqa} once ...")
    f16 = [w.scaled(cc.KV_HEADS) for w in cc.kvmetal_decode(tokens, gqa, "f16")]
    q84 = [w.scaled(cc.KV_HEADS) for w in cc.kvmetal_decode(tokens, gqa, "K8/V4")]
    _, mlx = cc.mlx_decode(tokens, gqa, arch_suffix=cm.MLX_ARCH_SUFFIX[chip])
    mlx = [w.scaled(cc.KV_HEADS) for w in mlx]
    live = live_kv_bytes(tokens, "f16")
    rows = []
    base = cm.Params()
    for field in [None] + [f.name for f in dataclasses.fields(cm.Params)]:
        for factor in ((1.0,) if field is None else (0.5, 2.0)):
            params = base if field is None else dataclasses.replace(
                base, **{field: min(1.0, getattr(base, field) * factor) if field == "sustained_fraction"
                         else getattr(base, field) * factor})
            k = cm.estimate_launches(f16, chip, params)["seconds"]
            q = cm.estimate_launches(q84, chip, params)["seconds"]
            m = cm.estimate_launches(mlx, chip, params)["seconds"]
            bw = cm.ChipModel.of(chip).bandwidth_gbs * 1e9 * params.sustained_fraction
            rows.append({"param": field or "(defaults)", "factor": factor,
                         "value": getattr(params, field) if field else None, "kvmetal_f16_s": k,
                         "mlx_over_kvmetal": m / k, "k8v4_over_f16": q / k, "of_modelled_bw": live / k / bw})
    return rows


def format_sensitivity(rows, tokens=32768, gqa=4, chip="m2-max") -> str:
    lines = [f"sensitivity (MODELLED), decode T={tokens // 1024}K G{gqa} on {chip}: each assumption halved / doubled",
             f"{'assumption':22s} {'value':>8s} {'kvmetal f16 us':>14s} {'MLX/kvm':>8s} {'K8V4/f16':>8s} {'of mod. BW':>10s}"]
    for r in rows:
        value = "default" if r["value"] is None else f"{r['value']:g}"
        lines.append(f"{r['param']:22s} {value:>8s} {r['kvmetal_f16_s'] * 1e6:14.1f} {r['mlx_over_kvmetal']:8.2f} "
                     f"{r['k8v4_over_f16']:8.2f} {r['of_modelled_bw']:10.2f}")
    return "\n".join(lines)


def _us(s: float) -> str:
    return f"{s * 1e6:8.1f}"


def format_table(result: dict, chips=TABLE_CHIPS) -> str:
    chips = [c for c in chips if c in result["rows"][0]["chips"]]
    lines = [f"kvmetal vs MLX, {result['label']}", result["shape"], ""]
    for chip in chips:
        c = cm.ChipModel.of(chip)
        lines.append(f"== {chip}: {c.bandwidth_gbs:g} GB/s peak, {c.cores} GPU cores, {c.clock_ghz:g} GHz "
                     f"(modelled sustained {c.bandwidth_gbs * result['params']['sustained_fraction']:g} GB/s)")
        lines.append(f"{'case':32s} {'kvmetal us':>10s} {'MLX us':>9s} {'MLX/kvm':>7s} {'of mod. BW':>10s} "
                     f"{'K8V4/f16':>8s}  MLX kernel")
        for r in result["rows"]:
            x = r["chips"][chip]
            if r["kind"] == "decode":
                mlx = x["mlx_f16_s"]
                note = x["mlx_kernel"] + (" (MLX f16; no fused quantized kernel)" if r["format"] != "f16" else "")
                over = f"{x['over_f16']:8.2f}" if "over_f16" in x else f"{'':8s}"
                lines.append(f"{r['case']:32s} {_us(x['kvmetal_s']):>10s} {_us(mlx):>9s} {mlx / x['kvmetal_s']:7.2f} "
                             f"{x['kvmetal_fraction_of_modelled_bw']:10.2f} {over}  {note}")
            else:
                lines.append(f"{r['case']:32s} {_us(x['kvmetal_s']):>10s} {_us(x['mlx_steel_s']):>9s} "
                             f"{x['per_flop_vs_mlx']:7.2f} {'':10s} {'':8s}  {x['mlx_kernel']}; kvmetal "
                             f"{x['kvmetal_tflops']:.1f} vs MLX {x['mlx_tflops']:.1f} TFLOP/s")
        lines.append("")
    lines.append("MLX/kvm: MLX's modelled time / kvmetal's (>1: kvmetal faster; for varlen, kvmetal per FLOP vs "
                 "MLX). of mod. BW: live K/V bytes / kvmetal's time / modelled sustained bandwidth. Decode = "
                 "kvmetal's partials + reduce launches, MLX's one or two launches, each with launch overhead.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the full result (every chip, every launch) here")
    parser.add_argument("--quick", action="store_true", help="8K decode at GQA 4 only")
    parser.add_argument("--sensitivity", action="store_true",
                        help="also print how 32K G4 decode on M2 Max moves with each assumption halved/doubled")
    parser.add_argument("--params", help="a JSON object of calibrated Params fields (docs/cost_model.md)")
    args = parser.parse_args(argv)
    params = cm.Params.from_json(args.params) if args.params else cm.Params()
    result = measure(quick=args.quick, progress=lambda s: print(s, file=sys.stderr, flush=True), params=params)
    print(format_table(result))
    if args.sensitivity:
        rows = sensitivity(progress=lambda s: print(s, file=sys.stderr, flush=True))
        result["sensitivity"] = rows
        print()
        print(format_sensitivity(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
