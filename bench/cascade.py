"""Issue 21's shared-prefix measurement: 16 sequences sharing a 2,048-token prefix, each with
its own 64-512 tokens, f16 and K8/V4, GQA 4, D 128.

    python bench/cascade.py                  # simulator bytes + CPU time, both cache formats
    python bench/cascade.py --json out.json

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
    args = ap.parse_args()
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


if __name__ == "__main__":
    main()
