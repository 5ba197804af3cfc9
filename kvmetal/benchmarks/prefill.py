"""The ``prefill`` case: chunked prefill of one prompt on SmolLM2-135M attention shapes
(9 query / 3 kv heads, D 64, block 16, float16), one layer. Each chunk of 512 tokens
attends to everything cached before it and to itself, causally:

- kvmetal: ``paged_attention_varlen`` on the paged cache;
- baseline: ``gather_kv_cache`` of the chunk's context + ``mx.fast.scaled_dot_product_attention``
  with ``mask="causal"`` (what the mlx-lm drop-in did before varlen).

Time is the whole prefill (every chunk); the peak memory above the cache is MLX's
``get_peak_memory`` after a reset, for one timed run of each.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import ops
from ..backends import use_backend
from .timing import time_stats

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE, CHUNK = 9, 3, 64, 16, 512
MAX_TOKENS = 2048  # the prompt: min(--tokens, this), so the default bench stays short
BASELINE_BUDGET_S = 20.0  # MLX's CPU SDPA takes seconds per prefill: time it fewer times


def _setup(tokens: int, dtype):
    rng = np.random.default_rng(0)
    num_blocks = -(-tokens // BLOCK_SIZE)
    shape = (num_blocks, NUM_KV_HEADS, BLOCK_SIZE, HEAD_DIM)
    kc = mx.random.normal(shape, key=mx.random.key(0)).astype(dtype)
    vc = mx.random.normal(shape, key=mx.random.key(1)).astype(dtype)
    tables = mx.array(rng.permutation(num_blocks).astype(np.int32)[None])
    chunks = [(start, min(tokens, start + CHUNK)) for start in range(0, tokens, CHUNK)]
    queries = [mx.random.normal((b - a, NUM_HEADS, HEAD_DIM), key=mx.random.key(2 + i)).astype(dtype)
               for i, (a, b) in enumerate(chunks)]
    mx.eval(kc, vc, tables, *queries)
    return kc, vc, tables, chunks, queries


def _peak_bytes(fn) -> int:
    mx.synchronize()
    base = mx.get_active_memory()
    mx.reset_peak_memory()
    mx.eval(fn())
    return mx.get_peak_memory() - base


def prefill(*, backend, tokens, repeat, baseline, progress):
    tokens = max(1, min(tokens, MAX_TOKENS))
    kc, vc, tables, chunks, queries = _setup(tokens, mx.float16)
    name = f"prefill_varlen_f16 T={tokens} chunk={CHUNK}"
    shape = f"H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} bs={BLOCK_SIZE}"

    def varlen():
        outs = []
        for (a, b), q in zip(chunks, queries):
            outs.append(ops.paged_attention_varlen(q, kc, vc, tables, mx.array([b], dtype=mx.int32),
                                                   mx.array([0, b - a], dtype=mx.int32), validate=False))
            mx.eval(outs[-1])  # chunk by chunk, as a prefill loop runs them
        return outs

    def gather_sdpa():
        outs = []
        for (a, b), q in zip(chunks, queries):
            keys, values = ops.gather_kv_cache(kc, vc, tables, mx.array([b], dtype=mx.int32), max_len=b,
                                               validate=False)
            out = mx.fast.scaled_dot_product_attention(q.transpose(1, 0, 2)[None], keys, values,
                                                       scale=HEAD_DIM ** -0.5, mask="causal")
            outs.append(out)
            mx.eval(outs[-1])
        return outs

    with use_backend(backend):
        try:
            stats = time_stats(varlen, repeat=repeat)
        except NotImplementedError as exc:
            return [{"name": name, "backend": backend, "seconds": None, "kv_bytes": None, "gbps": None,
                     "note": f"skipped: {exc}", "skipped": True}]
        peak = _peak_bytes(varlen)
        bases = []
        if baseline:
            b = time_stats(gather_sdpa, repeat=repeat, budget_s=BASELINE_BUDGET_S)
            bases.append({"name": f"gather_kv_cache + mx.fast.scaled_dot_product_attention causal ({backend})",
                          "seconds": b["seconds"], "min_seconds": b["min"], "max_seconds": b["max"],
                          "repeats": b["repeats"], "peak_bytes": _peak_bytes(gather_sdpa)})
    # The row of kvmetal.benchmarks.cases (not imported: cases registers this case). No
    # GB/s figure: prefill is bound by arithmetic, not by the cache bytes.
    row = {"name": name, "backend": backend, "seconds": stats["seconds"], "min_seconds": stats["min"],
           "max_seconds": stats["max"], "repeats": stats["repeats"],
           "kv_bytes": sum(b for _, b in chunks) * NUM_KV_HEADS * HEAD_DIM * 2 * 2,  # each chunk's context once
           "gbps": None, "baseline": bases[0] if bases else None, "baselines": bases, "shape": shape,
           "peak_bytes": peak}
    if bases:
        row["speedup_vs_baseline"] = bases[0]["seconds"] / stats["seconds"]
    return [row]
