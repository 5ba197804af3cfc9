"""Simulator speed: `python -m kvmetal.sim.bench`.

Reports simulated Metal threads per second on a split-KV decode attention
kernel (kvmetal.sim.examples) and the cost of one collective (a fiber
switch into the scheduler and back, per lane).
"""
from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from . import trace
from .examples import split_kv_attention
from .kernel import metal_kernel
from .launch import default_workers


def decode_attention(hq=32, hkv=8, t=2048, d=128, splits=8, repeats=3):
    rng = np.random.default_rng(0)
    q = mx.array(rng.standard_normal((hq, d)).astype(np.float32)).astype(mx.float16)
    k = mx.array(rng.standard_normal((hkv, t, d)).astype(np.float32)).astype(mx.float16)
    v = mx.array(rng.standard_normal((hkv, t, d)).astype(np.float32)).astype(mx.float16)
    split_kv_attention(q, k, v, num_splits=splits)  # compile outside the timing
    best = None
    for _ in range(repeats):
        with trace() as tr:
            split_kv_attention(q, k, v, num_splits=splits)
        part = tr.calls[0]
        if best is None or part.seconds < best.seconds:
            best = part
    collectives = best.threads * (t // splits)  # one simd_sum per token per lane
    return best, collectives


def collective_cost(n_iter=2000, threads=1024):
    src = """
    float x = inp[thread_position_in_grid.x];
    for (int i = 0; i < N; i++) x = simd_sum(x) * 0.03125f;
    out[thread_position_in_grid.x] = x;
    """
    k = metal_kernel("sim_bench_collectives", ["inp"], ["out"], src)
    call = dict(inputs=[mx.ones(threads)], output_shapes=[(threads,)], output_dtypes=[mx.float32],
                grid=(threads, 1, 1), threadgroup=(256, 1, 1), template=[("N", n_iter)])
    k(**call)
    with trace() as tr:
        k(**call)
    return tr.calls[0].seconds / (threads * n_iter)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--tokens", type=int, default=2048)
    args = p.parse_args(argv)
    call, coll = decode_attention(t=args.tokens)
    print(f"workers (OS threads): {default_workers()}")
    print(f"decode attention partials, 32 q heads / 8 kv heads, T={args.tokens}, D=128, 8 splits, float16:")
    print(f"  {call.threads} Metal threads in {call.seconds * 1e3:.1f} ms -> "
          f"{call.threads / call.seconds:,.0f} threads/s, {coll / call.seconds / 1e6:.1f} M lane-collectives/s")
    per = collective_cost()
    print(f"simd_sum round trip per lane (switch out, resolve, switch in): {per * 1e9:.0f} ns")


if __name__ == "__main__":
    main()
