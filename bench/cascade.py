"""Issue 21's shared-prefix measurement: 16 sequences sharing a 2,048-token prefix, each with
its own 64-512 tokens, f16 and K8/V4, GQA 4, D 128.

    python bench/cascade.py                  # simulator bytes + CPU time, both cache formats
    python bench/cascade.py --json out.json
    python bench/cascade.py --sweep          # members x prefix length: the grouping thresholds

Per cache format:
- simulator: K/V bytes the kernels load over the live bytes (prefix once + own tokens),
  for the cascade op and for paged_attention over the concatenated tables;
- CPU backend: median wall time of both ops, alternating rounds in the same run.
"""
from __future__ import annotations

import argparse
import json
import os
import platform

import mlx.core as mx

from kvmetal.benchmarks import cascade


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sim-kv-heads", type=int, default=2,
                    help="kv heads of the simulator run (bytes ratios do not depend on it; the simulator is slow)")
    ap.add_argument("--cpu-kv-heads", type=int, default=8, help="kv heads of the CPU timing run")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", type=str, default=None)
    ap.add_argument("--sweep", action="store_true",
                    help="members {2, 4, 8, 16} x prefix {32, 128, 512, 2048} tokens, 128 own tokens each, f16: "
                         "simulator K/V bytes (1 kv head) and CPU time (8 kv heads) of both ops")
    args = ap.parse_args()
    if args.sweep:
        return sweep(args)
    results = []
    for label, bits in (("f16", (None, None)), ("K8/V4", (8, 4))):
        common = dict(num_seqs=16, prefix_tokens=2048, own_min=64, own_max=512, gqa=4, head_dim=128,
                      dtype=mx.float16, k_bits=bits[0], v_bits=bits[1])
        sim = cascade.sim_traffic(cascade.workload(num_kv_heads=args.sim_kv_heads, **common))
        cpu = cascade.timed_pair(cascade.workload(num_kv_heads=args.cpu_kv_heads, **common), "cpu",
                                 rounds=args.rounds)
        results.append({"cache": label, "sim": sim, "cpu": cpu, "sim_kv_heads": args.sim_kv_heads,
                        "cpu_kv_heads": args.cpu_kv_heads})
        print(f"{label}: sim K/V loaded / live: cascade {sim['cascade']['kv_loaded_over_live']:.3f}, "
              f"plain {sim['plain']['kv_loaded_over_live']:.3f}; all bytes moved cascade/plain "
              f"{sim['cascade']['all_bytes_moved'] / sim['plain']['all_bytes_moved']:.3f}; "
              f"cpu cascade {cpu['cascade_s'] * 1e3:.2f} ms, plain {cpu['plain_s'] * 1e3:.2f} ms "
              f"(plain / cascade {cpu['plain_over_cascade']:.2f}x)", flush=True)
    if args.json:
        meta = {"machine": platform.machine(), "cpus": os.cpu_count()}
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=1)


def sweep(args) -> None:
    rows = []
    print("| members | prefix tokens | sim K/V loaded plain / cascade | CPU plain / cascade |")
    print("|---|---|---|---|")
    for members in (2, 4, 8, 16):
        for prefix in (32, 128, 512, 2048):
            common = dict(num_seqs=members, prefix_tokens=prefix, own_min=128, own_max=128, gqa=4, head_dim=128,
                          dtype=mx.float16)
            sim = cascade.sim_traffic(cascade.workload(num_kv_heads=1, **common))
            cpu = cascade.timed_pair(cascade.workload(num_kv_heads=args.cpu_kv_heads, **common), "cpu",
                                     rounds=args.rounds)
            ratio = sim["plain"]["kv_loaded_bytes"] / sim["cascade"]["kv_loaded_bytes"]
            rows.append({"members": members, "prefix": prefix, "sim_plain_over_cascade": ratio, "cpu": cpu})
            print(f"| {members} | {prefix} | {ratio:.2f} | {cpu['plain_over_cascade']:.2f} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"sweep": rows}, f, indent=1)


if __name__ == "__main__":
    main()
