"""Simulator cost counters of the split partials and their reduce (issue 41, P2/P3):
a ragged decode batch whose short sequences leave most splits empty, and the
cascade case of bench/kernel_costs.py.

    python bench/reduce_costs.py [--json out.json]

Decode case: paged_attention, D 128, 2 kv heads, GQA 4, block size 16, lengths
(4096, 300, 37, 1, 1000, 2048, 17, 600), float16 and K8/V4 g64, the default split
policy (windows of 256 tokens: 16 splits, of which a 37-token sequence fills 1).
Per launch: device bytes loaded and stored (per buffer), barriers, simd
collectives, transcendental lane calls (exp2). No timing: the simulator counts
causes, a Mac measures time.
"""
from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
import numpy as np

import kvmetal as kv
from kvmetal import quant, sim

D, HKV, G, BS = 128, 2, 4, 16
LENS = (4096, 300, 37, 1, 1000, 2048, 17, 600)


def _cache(rng, blocks, bits):
    x = mx.array(rng.standard_normal((blocks, HKV, BS, D)).astype(np.float32)).astype(mx.float16)
    return quant.quantize(x, bits=bits, group_size=64) if bits else x


def decode_case(rng, k_bits, v_bits):
    per = [-(-n // BS) for n in LENS]
    total = sum(per) + 1
    kc, vc = _cache(rng, total, k_bits), _cache(rng, total, v_bits)
    ids = rng.permutation(total).astype(np.int32)
    tables = np.zeros((len(LENS), max(per)), np.int32)
    cur = 0
    for s, p in enumerate(per):
        tables[s, :p] = ids[cur:cur + p]
        cur += p
    q = mx.array(rng.standard_normal((len(LENS), HKV * G, D)).astype(np.float32)).astype(mx.float16)
    sinks = mx.array(rng.standard_normal(HKV * G).astype(np.float32))
    return lambda: kv.paged_attention(q, kc, vc, mx.array(tables), mx.array(np.array(LENS, np.int32)), sinks=sinks)


def cascade_case(rng, k_bits, v_bits):
    from kernel_costs import cascade_case as case  # the same cascade as bench/kernel_costs.py

    return case(rng, k_bits, v_bits)[0]


def figures(call) -> dict:
    return {"kernel": call.name.split("_t")[0], "grid": list(call.grid), "threadgroup": call.threadgroup[0],
            "loaded": call.loaded, "stored": call.stored,
            "loaded_by_buffer": {n: b.loaded for n, b in call.buffers.items() if b.loaded},
            "stored_by_buffer": {n: b.stored for n, b in call.buffers.items() if b.stored},
            "barriers": call.barriers, "collectives": dict(call.collectives), "math": dict(call.math)}


def measure() -> list:
    rows = []
    for case_name, case in (("decode batch 8 ragged", decode_case), ("cascade 16+3 members", cascade_case)):
        for fmt, (kb, vb) in (("f16", (0, 0)), ("K8/V4", (8, 4))):
            run = case(np.random.default_rng(0), kb, vb)
            with kv.use_backend("sim"), sim.trace(strict=False, seed=0) as t:
                mx.eval(run())
            rows.append({"case": case_name, "format": fmt, "launches": [figures(c) for c in t.calls]})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    sys.path.insert(0, __file__.rsplit("/", 1)[0])
    rows = measure()
    for r in rows:
        print(f"{r['case']} {r['format']}:")
        for c in r["launches"]:
            print(f"    {c['kernel']}: grid {c['grid']} loaded {c['loaded']} stored {c['stored']} barriers "
                  f"{c['barriers']} collectives {c['collectives']} math {c['math']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
