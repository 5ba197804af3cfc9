"""Simulator speed: `python -m kvmetal.sim.bench`.

Reports simulated Metal threads per second on the metal backend's own paged
decode kernel (``paged_attention_partials``, through ``kvmetal.sim.traffic``)
and the cost of one collective (a fiber switch into the scheduler and back,
per lane).
"""
from __future__ import annotations

import argparse

import mlx.core as mx

from .kernel import metal_kernel
from .launch import default_workers
from .trace import trace
from .traffic import paged_call

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, SPLITS = 32, 8, 128, 8


def paged_partials(tokens: int = 2048, repeats: int = 3):
    """The fastest of ``repeats`` simulated paged_attention_partials calls (the first,
    which compiles the kernel, is not timed) and its lane-collectives."""
    shape = dict(head_dim=HEAD_DIM, gqa=NUM_HEADS // NUM_KV_HEADS, num_kv_heads=NUM_KV_HEADS,
                 num_splits=SPLITS)
    paged_call(tokens, **shape)  # compile outside the timing
    best = min((paged_call(tokens, **shape)[0] for _ in range(repeats)), key=lambda call: call.seconds)
    return best, 32 * sum(best.collectives.values())  # collectives count once per simdgroup: x32 lanes


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
    call, lane_collectives = paged_partials(args.tokens)
    print(f"workers (OS threads): {default_workers()}")
    print(f"paged_attention_partials, {NUM_HEADS} q heads / {NUM_KV_HEADS} kv heads, T={args.tokens}, "
          f"D={HEAD_DIM}, block size 16, {SPLITS} splits, float16:")
    print(f"  {call.threads} Metal threads in {call.seconds * 1e3:.1f} ms -> "
          f"{call.threads / call.seconds:,.0f} threads/s, {lane_collectives / call.seconds / 1e6:.1f} M "
          f"lane-collectives/s")
    per = collective_cost()
    print(f"simd_sum round trip per lane (switch out, resolve, switch in): {per * 1e9:.0f} ns")


if __name__ == "__main__":
    main()
