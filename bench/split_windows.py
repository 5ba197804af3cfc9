"""Partials bytes against K/V bytes with fixed and length-dependent split windows
(issue 41, P4), counted by the simulator on paged decode.

    python bench/split_windows.py [--json out.json]

Cases: one sequence of 32768 tokens, and 16 sequences of 4096 (a slice of 64 x 4K:
the windows depend on the length alone, so the fraction is the batch's), D 128,
1 kv head, GQA 4 and 8, float16 and K8/V4 g64. Per case and policy: splits of the
launch, part_* bytes stored by the partials kernel and loaded by the reduce, K/V
bytes loaded, and their ratio. SPLIT_WINDOW_DIV = 0 is the fixed 256-token window.
"""
from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
import numpy as np

import kvmetal as kv
from kvmetal import quant, sim
from kvmetal.backends import metal_layout
from kvmetal.sim import traffic

D, BS = 128, 32


def run_case(lens, gqa, bits, div):
    rng = np.random.default_rng(0)
    per = [-(-n // BS) for n in lens]
    total = sum(per)
    x = lambda: mx.array(rng.standard_normal((total, 1, BS, D)).astype(np.float32)).astype(mx.float16)
    kc, vc = x(), x()
    if bits:
        kc, vc = quant.quantize(kc, bits=bits[0], group_size=64), quant.quantize(vc, bits=bits[1], group_size=64)
    tables = np.arange(total, dtype=np.int32).reshape(len(lens), per[0])
    q = mx.array(rng.standard_normal((len(lens), gqa, D)).astype(np.float32)).astype(mx.float16)
    old = metal_layout.SPLIT_WINDOW_DIV
    metal_layout.SPLIT_WINDOW_DIV = div
    try:
        with kv.use_backend("sim"), sim.trace(strict=False, seed=0) as t:
            mx.eval(kv.paged_attention(q, kc, vc, mx.array(tables), mx.array(np.array(lens, np.int32))))
    finally:
        metal_layout.SPLIT_WINDOW_DIV = old
    part = next(c for c in t.calls if "partials" in c.name)
    red = next(c for c in t.calls if "reduce" in c.name)
    kv_bytes = sum(part.buffers[n].loaded for n in traffic.KV_BUFFERS if n in part.buffers)
    part_bytes = sum(part.buffers[n].stored for n in ("part_max", "part_sum", "part_acc")) + \
        sum(red.buffers[n].loaded for n in ("part_max", "part_sum", "part_acc"))
    return {"splits": part.grid[0] // part.threadgroup[0], "partials_bytes": part_bytes, "kv_bytes": kv_bytes,
            "fraction": round(part_bytes / kv_bytes, 4)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json")
    args = p.parse_args(argv)
    rows = []
    for name, lens in (("32K x 1", (32768,)), ("4K x 16", (4096,) * 16)):
        for gqa in (4, 8):
            for fmt, bits in (("f16", None), ("K8/V4", (8, 4))):
                for policy, div in (("fixed 256", 0), ("length", metal_layout.SPLIT_WINDOW_DIV)):
                    r = dict(case=name, gqa=gqa, format=fmt, policy=policy, **run_case(lens, gqa, bits, div))
                    print(r, flush=True)
                    rows.append(r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
