"""Simulator cost counters of the varlen prefill chunk and the 16-member cascade, per
kernel launch (issue 30's before/after table; docs/kernels.md).

    python bench/kernel_costs.py [--json out.json]

Cases (head_dim 128, 2 kv heads, GQA 4, float16 and K8/V4 g64):
- varlen: one sequence of 1024 cached tokens whose last 256 are the new rows (a prefill
  chunk: the tiled kernel), no window;
- cascade: 16 sequences sharing a 512-token prefix, each with 1..40 own tokens, next to
  3 sequences of another 512-token prefix.
Per launch: K/V bytes loaded over the live rows' bytes, threadgroup memory, barriers,
simdgroup MMAs and simdgroup loads (collectives), shuffles, transcendental lane calls,
device bytes per load. No timing: the simulator counts causes, a Mac measures time.
"""
from __future__ import annotations

import argparse
import json
import sys

import mlx.core as mx
import numpy as np

import kvmetal as kv
from kvmetal import quant, sim
from kvmetal.sim import traffic

D, HKV, G = 128, 2, 4


def _cache(rng, blocks, bs, bits):
    x = mx.array(rng.standard_normal((blocks, HKV, bs, D)).astype(np.float32)).astype(mx.float16)
    return quant.quantize(x, bits=bits, group_size=64) if bits else x


def varlen_case(rng, k_bits, v_bits):
    bs, length, new = 16, 1024, 256
    blocks = length // bs
    kc, vc = _cache(rng, blocks + 1, bs, k_bits), _cache(rng, blocks + 1, bs, v_bits)
    tables = mx.array(rng.permutation(blocks + 1)[:blocks][None].astype(np.int32))
    q = mx.array(rng.standard_normal((new, HKV * G, D)).astype(np.float32)).astype(mx.float16)
    run = lambda: kv.paged_attention_varlen(q, kc, vc, tables, mx.array([length], mx.int32),
                                            mx.array([0, new], mx.int32))
    live = length * HKV * (traffic.row_bytes(kc, D) + traffic.row_bytes(vc, D))
    return run, live


def cascade_case(rng, k_bits, v_bits):
    bs, prefix = 16, 512
    own = [1 + (7 * s) % 40 for s in range(19)]
    pblocks = prefix // bs
    total = 2 * pblocks + 19 * 3
    kc, vc = _cache(rng, total, bs, k_bits), _cache(rng, total, bs, v_bits)
    ids = rng.permutation(total).astype(np.int32)
    ptables = mx.array(ids[:2 * pblocks].reshape(2, pblocks))
    tables = mx.array(ids[2 * pblocks:].reshape(19, 3))
    q = mx.array(rng.standard_normal((19, HKV * G, D)).astype(np.float32)).astype(mx.float16)
    prefix_of = mx.array([0] * 16 + [1] * 3, mx.int32)
    run = lambda: kv.paged_attention_cascade(q, kc, vc, ptables, mx.array([prefix, prefix], mx.int32), prefix_of,
                                             tables, mx.array(own, mx.int32))
    rows = 2 * prefix + sum(own)  # each prefix row once, each own row once
    live = rows * HKV * (traffic.row_bytes(kc, D) + traffic.row_bytes(vc, D))
    return run, live


def figures(call) -> dict:
    kv_buffers = [n for n in traffic.KV_BUFFERS if n in call.buffers]
    return {"kernel": call.name.split("_t")[0], "threadgroup": call.threadgroup[0],
            "threadgroups": call.threadgroups, "kv_loaded": sum(call.buffers[n].loaded for n in kv_buffers),
            "threadgroup_memory": call.threadgroup_memory, "barriers": call.barriers,
            "mma": call.collectives.get("simdgroup_multiply_accumulate", 0),
            "simdgroup_loads": call.collectives.get("simdgroup_load", 0), "shuffles": call.shuffles,
            "transcendentals": call.transcendentals, "bytes_per_load": round(call.bytes_per_load(*kv_buffers), 2)}


def measure() -> list:
    rows = []
    for case_name, case in (("varlen chunk 256 of 1024", varlen_case), ("cascade 16+3 members", cascade_case)):
        for fmt, (kb, vb) in (("f16", (0, 0)), ("K8/V4", (8, 4))):
            run, live = case(np.random.default_rng(0), kb, vb)
            with kv.use_backend("sim"), sim.trace(strict=False, seed=0) as t:
                mx.eval(run())
            calls = [figures(c) for c in t.calls]
            loaded = sum(c["kv_loaded"] for c in calls)
            rows.append({"case": case_name, "format": fmt, "kv_loaded_over_live": round(loaded / live, 3),
                         "launches": calls})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args(argv)
    rows = measure()
    for r in rows:
        print(f"{r['case']} {r['format']}: K/V loaded / live = {r['kv_loaded_over_live']}")
        for c in r["launches"]:
            print("   ", {k: v for k, v in c.items()})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
