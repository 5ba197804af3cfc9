"""Which split window should decode use? Partials bytes against MODELLED time, per window
divisor (issue 41, P4 and the <=2% partials goal; docs/kernels.md "Split windows").

    python bench/window_policy.py [--json out.json] [--policies 8/2:2048,8:2048,16:2048,32:2048] [--quick]
                                  [--shapes G4,G8] [--sizes 1x8K,64x4K]

A sequence of ``len`` tokens is cut in windows of clamp(pow2ceil(len) / d, 256, 2048)
tokens, d = div while the window is 256 and div x growth once it has grown
(metal_layout.split_window; KVMETAL_METAL_WINDOW_DIV sets div, KVMETAL_METAL_WINDOW_GROWTH
growth, SPLIT_WINDOW_MAX the cap). A policy is div[/growth]:cap; without /growth the library's
rule (metal_layout.window_growth: 2 in register mode, 1 in shared mode, from stop 50), with it
that growth in every mode (/1: the rule before stop 50). 32/1:2048 was the default before stop
47's sweep, 8/1:2048 after it, 8:2048 from stop 50. Windows depend on
the length alone (batch invariance), so one window serves batch 1, where splits are the
only parallelism, and batch 64, where they only add partials. This runs the paged decode
partials + reduce in the simulator (D 128, block 16; register mode at GQA 4 and 8 with one
query token, shared mode at GQA 16 and at GQA 4 x 4 query tokens) for
each policy, at batch 1 x {2K, 4K, 8K, 16K, 32K, 64K}, 8 x 32K and 64 x 4K, f16 and K8/V4 (g64),
and reports partials bytes as a fraction of K/V bytes and the modelled time
on M2 Max and M4 Max (kvmetal/sim/cost_model.py: published figures plus assumptions;
MODELLED, never measured). Batch 64 (8) is simulated as 4 (2) identical sequences and its counts
scaled by 16 (4) (exact: every sequence runs the same windows), and one kv head scaled to 8.

A policy div:cap:sg also sets register mode's simdgroups a window (KVMETAL_METAL_WINDOW_SIMDGROUPS,
issue 41 P5 as worded: 1 = one simdgroup walks a whole window, no merge; shared mode ignores
it), e.g. ``--shapes G4,G8 --policies 8:2048:4,8:2048:1,32:2048:1`` (docs/kernels.md,
"Register-mode merge and shared-mode tiles").
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout
sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_costs as dc  # noqa: E402  (the same case runner and cost-model calls)

from kvmetal.backends import metal_layout  # noqa: E402
from kvmetal.sim import cost_model as cm  # noqa: E402

SIZES = {"1x2K": (1, 1, 2048), "1x4K": (1, 1, 4096), "1x8K": (1, 1, 8192), "1x16K": (1, 1, 16384),
         "1x32K": (1, 1, 32768), "1x64K": (1, 1, 65536), "8x32K": (8, 2, 32768), "64x4K": (64, 4, 4096)}  # name: (batch, simulated batch, tokens)
SHAPES = {"G4": (4, 1), "G8": (8, 1), "G16": (16, 1), "G4xL4": (4, 4)}  # (GQA, query tokens)


@contextlib.contextmanager
def window_policy(div: int, cap: int, simdgroups: int | None = None, growth: int | None = None):
    """Launches inside cut windows with divisor ``div`` (KVMETAL_METAL_WINDOW_DIV), its
    ``growth`` (KVMETAL_METAL_WINDOW_GROWTH; None: the library's rule), cap ``cap``
    (metal_layout.SPLIT_WINDOW_MAX) and, unless None, register mode's ``simdgroups`` a window
    (KVMETAL_METAL_WINDOW_SIMDGROUPS); all are restored after."""
    variables = {"KVMETAL_METAL_WINDOW_DIV": div, "KVMETAL_METAL_WINDOW_GROWTH": growth}
    if simdgroups is not None:
        variables["KVMETAL_METAL_WINDOW_SIMDGROUPS"] = simdgroups
    saved_cap, metal_layout.SPLIT_WINDOW_MAX = metal_layout.SPLIT_WINDOW_MAX, cap
    try:
        with metal_layout.tuning_variables(variables):
            yield
    finally:
        metal_layout.SPLIT_WINDOW_MAX = saved_cap


def run(div: int, cap: int, batch: int, sim_batch: int, tokens: int, gqa: int, qlen: int, fmt: str,
        simdgroups: int | None = None, growth: int | None = None) -> dict:
    with window_policy(div, cap, simdgroups, growth):
        r = dc.run_case(sim_batch, tokens, gqa, qlen, fmt)
        part, red = r["launches"]
        grow = metal_layout.window_growth(part["register_mode"])  # what the launch used
    scale = batch // sim_batch
    works = [w.scaled(scale) for w in r["works"]]
    partials = (part["partials_bytes"] + red["partials_bytes_loaded"]) * scale  # stored, then loaded by the reduce
    total_kv = part["kv_bytes_loaded"] * scale
    policy = f"{div}" + ("" if growth is None else f"/{growth}") + f":{cap}" + ("" if simdgroups is None else f":{simdgroups}")
    row = {"policy": policy, "window": metal_layout.split_window(tokens, metal_layout.SPLIT_TOKENS, cap, div, grow),
           "partials_fraction": round(partials / total_kv, 4),
           "barriers_per_1k_rows": round(part["barriers_per_kv_head"] * dc.cc.KV_HEADS * 1024
                                         / (sim_batch * tokens * dc.cc.KV_HEADS), 2),
           "threadgroup_memory": part["threadgroup_memory"], "threads": part["threadgroup"],
           "reduce_dependent_loads": red["dependent_loads"], "modelled_us": {}}
    for chip in dc.CHIPS:
        row["modelled_us"][chip] = round(cm.estimate_launches(works, chip)["seconds"] * 1e6, 2)
    return row


def _policy(text: str) -> tuple:
    """(div, growth, cap, simdgroups or None) of a policy "div[/growth]:cap[:simdgroups]"."""
    parts = text.split(":")
    if len(parts) not in (2, 3):
        raise ValueError(text)
    div, _, growth = parts[0].partition("/")
    return int(div), int(growth) if growth else None, int(parts[1]), int(parts[2]) if len(parts) == 3 else None


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--policies", default="8:2048,8/1:2048,8/2:2048,16/1:2048,32/1:2048",
                    help="div[/growth]:cap[:simdgroups],... (growth: KVMETAL_METAL_WINDOW_GROWTH, the "
                         "library's rule when omitted; simdgroups: KVMETAL_METAL_WINDOW_SIMDGROUPS)")
    ap.add_argument("--quick", action="store_true", help="GQA 4 only")
    ap.add_argument("--shapes", default=",".join(SHAPES), help="subset of " + ",".join(SHAPES))
    ap.add_argument("--sizes", default=",".join(SIZES), help="subset of " + ",".join(SIZES))
    args = ap.parse_args(argv)
    try:
        policies = [_policy(p) for p in args.policies.split(",")]
    except ValueError:
        raise SystemExit(f"--policies: div[/growth]:cap[:simdgroups], got {args.policies!r}") from None
    rows = []
    for shape, (gqa, qlen) in ([("G4", SHAPES["G4"])] if args.quick else [(k, SHAPES[k]) for k in args.shapes.split(",")]):
        for fmt in dc.FORMATS:
            for size in args.sizes.split(","):
                batch, sim_batch, tokens = SIZES[size]
                for div, growth, cap, sg in policies:
                    row = dict(case=f"{shape} {fmt} {size}",
                               **run(div, cap, batch, sim_batch, tokens, gqa, qlen, fmt, sg, growth))
                    rows.append(row)
                    print(f"{row['case']:22s} {row['policy']:>10s} window {row['window']:5d} partials "
                          f"{row['partials_fraction']:7.2%} barriers/1K {row['barriers_per_1k_rows']:6.2f} "
                          f"tg {row['threadgroup_memory']:5d} " + " ".join(
                              f"{c} {row['modelled_us'][c]:9.2f}us" for c in dc.CHIPS), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({
            "label": "simulator counters; times MODELLED (kvmetal/sim/cost_model.py), not measured",
            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
