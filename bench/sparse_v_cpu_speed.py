"""CPU decode over captured real attention: exact against sparse V (tau 1e-4), per cache kind.

Every layer of an attention capture (``kvmetal.benchmarks.attention_capture``) as one
paged decode step (``sparse_v_captured.paged_layer``: float16, or K8/V4), all layers per
timed call. Exact and sparse alternate call by call in one process (the machine's load
drifts; alternating makes both see the same drift); printed: their medians and the
median of exact / sparse over adjacent pairs. Also printed: the share of V rows each row's final maximum would let the rule
skip (``final_max_skips``, the ceiling) and the share the CPU walker skips, replayed here
from its rule (seeds, windows of MIN_TOKENS_PER_SPLIT tokens, tiles of 32 keys whose max
joins the running max before the tile's weights are compared with tau).

    python bench/sparse_v_cpu_speed.py [--repeat 15] [--json out.json] CAPTURE.npz ...
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import mlx.core as mx
import numpy as np

from kvmetal import ops, reference
from kvmetal.backends import MIN_TOKENS_PER_SPLIT, use_backend
from kvmetal.benchmarks.attention_capture import load_capture
from kvmetal.benchmarks.sparse_v_captured import SPARSE_V_TAU, final_max_skips, paged_layer

TILE = 32  # keys per CPU tile (bindings/tile_math.h kMaxTileRows)


def cpu_skips(q, k, scale, softcap, tau) -> float:
    """Share of (kv head, key) V rows the CPU walker skips (one query token, no window)."""
    hkv, tokens, _ = k.shape
    group = q.shape[0] // hkv
    recent = min(max(tokens // 128, reference.SPARSE_V_RECENT_SEEDS), 255)  # bindings/sparse_v.h's count
    seeds = sorted({0, *range(max(0, tokens - recent), tokens)})
    skipped = 0
    for h in range(hkv):
        s = (q[h * group:(h + 1) * group].astype(np.float64) @ k[h].astype(np.float64).T) * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        seed = s[:, seeds].max(axis=1)
        for lo in range(0, tokens, MIN_TOKENS_PER_SPLIT):
            m = seed.copy()
            for t in range(lo, min(tokens, lo + MIN_TOKENS_PER_SPLIT), TILE):
                tile = s[:, t:min(t + TILE, lo + MIN_TOKENS_PER_SPLIT, tokens)]
                m = np.maximum(m, tile.max(axis=1))
                skipped += int((np.exp(tile - m[:, None]) < tau).all(axis=0).sum())
    return skipped / (hkv * tokens)


def time_alternating(exact, sparse, repeat: int) -> tuple[float, float, float]:
    """Medians of exact and sparse wall times, and of the ratio of each adjacent pair (the
    machine's load drifts slower than a pair)."""
    mx.eval(exact()), mx.eval(sparse())  # warm-up
    times = {exact: [], sparse: []}
    for i in range(repeat):
        for fn in (exact, sparse) if i % 2 else (sparse, exact):
            start = time.perf_counter()
            mx.eval(fn())
            times[fn].append(time.perf_counter() - start)
    ratios = [e / s for e, s in zip(times[exact], times[sparse])]
    return statistics.median(times[exact]), statistics.median(times[sparse]), statistics.median(ratios)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("captures", nargs="+")
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--tau", type=float, default=SPARSE_V_TAU)
    ap.add_argument("--kinds", default="f16,k8v4")
    ap.add_argument("--no-skips", action="store_true", help="skip the (slow) skip-rate replay")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    results = []
    for path in args.captures:
        meta, rows = load_capture(path)
        context = max(k.shape[1] for _, _, k, _, _, _ in rows)
        rates = {}
        if not args.no_skips:
            total = sum(k.shape[0] * k.shape[1] for _, _, k, _, _, _ in rows)
            weigh = lambda f: sum(f(q, k, sc, cap, args.tau) * k.shape[0] * k.shape[1]
                                  for _, q, k, _, sc, cap in rows) / total
            rates = {"final_max_skips": weigh(final_max_skips), "cpu_skips": weigh(cpu_skips)}
        for label in args.kinds.split(","):
            bits = {"f16": None, "k8v4": (8, 4)}[label]
            layers = [(paged_layer(q, k, v, bits=bits), sc, cap or None) for _, q, k, v, sc, cap in rows]
            mx.eval([layer[0] for layer in layers])

            def step(tau, layers=layers):
                return [ops.paged_attention(*a, scale=sc, softcap=cap, sparse_v=tau, validate=False)
                        for a, sc, cap in layers]

            with use_backend("cpu"):
                exact, sparse, ratio = time_alternating(lambda: step(None), lambda: step(args.tau), args.repeat)
            row = {"capture": str(path), "context": context, "layers": len(rows), "cache": label, "tau": args.tau,
                   "exact_ms": exact * 1e3, "sparse_ms": sparse * 1e3, "exact_over_sparse": ratio,
                   "repeats": args.repeat, **rates}
            results.append(row)
            print(f"T={context} {label}: exact {row['exact_ms']:.2f} ms, sparse {row['sparse_ms']:.2f} ms, "
                  f"exact/sparse x{ratio:.3f} (median of pairs)" + (f"; V rows skipped: cpu {rates['cpu_skips']:.3f}, "
                                                         f"final max {rates['final_max_skips']:.3f}" if rates else ""),
                  flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
