"""Shared-prefix decode: ``paged_attention_cascade`` against ``paged_attention`` over the
concatenated block tables (what a server runs without the cascade op).

- :func:`workload`: S sequences sharing one prefix, each with its own tokens after it.
- :func:`sim_traffic`: the K/V bytes each op's kernels load on the simulator, over the
  live bytes "prefix once + every sequence's own tokens" (1.0 = each row once per step).
- :func:`timed_pair`: wall time of both ops on one backend, alternating rounds.

``bench/cascade.py`` prints the issue-21 measurement from these; ``kvmetal bench
--cases cascade_decode`` times the pair on the chosen backend.
"""
from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

from .. import ops, quant
from ..backends import use_backend


def workload(*, num_seqs: int = 16, prefix_tokens: int = 2048, own_min: int = 64, own_max: int = 512,
             num_kv_heads: int = 2, gqa: int = 4, head_dim: int = 128, block_size: int = 16, dtype=mx.float16,
             k_bits: int | None = None, v_bits: int | None = None, group_size: int = 64, seed: int = 0) -> dict:
    """Caches (shuffled block ids) holding one shared prefix and each sequence's own tokens;
    the cascade op's arguments and the plain op's concatenated tables."""
    rng = np.random.default_rng(seed)
    own = rng.integers(own_min, own_max + 1, size=num_seqs)
    prefix_blocks = -(-prefix_tokens // block_size)
    own_blocks = [-(-int(n) // block_size) for n in own]
    num_blocks = prefix_blocks + sum(own_blocks)
    ids = rng.permutation(num_blocks).astype(np.int32)
    prefix_table = ids[:prefix_blocks][None]
    width = max(own_blocks)
    tables = np.zeros((num_seqs, width), np.int32)
    cursor = prefix_blocks
    for s, nb in enumerate(own_blocks):
        tables[s, :nb] = ids[cursor:cursor + nb]
        cursor += nb
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    caches = []
    for bits in (k_bits, v_bits):
        cache = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
        caches.append(quant.quantize(cache, bits=bits, group_size=group_size) if bits else cache)
    query = mx.array(rng.standard_normal((num_seqs, num_kv_heads * gqa, head_dim)).astype(np.float32)).astype(dtype)
    # The plain op: every sequence's table is the prefix blocks then its own (the prefix
    # fills whole blocks when prefix_tokens is a multiple of the block size).
    concat = np.zeros((num_seqs, prefix_blocks + width), np.int32)
    concat[:, :prefix_blocks] = prefix_table
    concat[:, prefix_blocks:] = tables
    out = dict(query=query, key_cache=caches[0], value_cache=caches[1], prefix_block_tables=mx.array(prefix_table),
               prefix_lens=mx.array([prefix_tokens], dtype=mx.int32), prefix_of=mx.zeros((num_seqs,), mx.int32),
               block_tables=mx.array(tables), seq_lens=mx.array(own.astype(np.int32)),
               concat_tables=mx.array(concat), concat_lens=mx.array((own + prefix_tokens).astype(np.int32)))
    mx.eval(*[v.arrays() if isinstance(v, quant.QuantizedKV) else v for v in out.values()])
    return out


def cascade_call(w: dict, **options):
    return ops.paged_attention_cascade(w["query"], w["key_cache"], w["value_cache"], w["prefix_block_tables"],
                                       w["prefix_lens"], w["prefix_of"], w["block_tables"], w["seq_lens"],
                                       validate=False, **options)


def plain_call(w: dict, **options):
    return ops.paged_attention(w["query"], w["key_cache"], w["value_cache"], w["concat_tables"], w["concat_lens"],
                               validate=False, **options)


def live_bytes(w: dict) -> int:
    """K/V bytes of the prefix once plus every sequence's own tokens (all kv heads)."""
    from ..sim.traffic import row_bytes

    head_dim = w["query"].shape[-1]
    num_kv_heads = w["key_cache"].shape[1]
    rows = int(np.array(w["prefix_lens"]).sum()) + int(np.array(w["seq_lens"]).sum())
    return rows * num_kv_heads * (row_bytes(w["key_cache"], head_dim) + row_bytes(w["value_cache"], head_dim))


def sim_traffic(w: dict) -> dict:
    """Bytes both ops' kernels move on the simulator: K/V loaded (over :func:`live_bytes`),
    and everything loaded + stored (partials, queries, tables included)."""
    from .. import sim
    from ..sim.traffic import KV_BUFFERS

    live = live_bytes(w)
    out = {"live_kv_bytes": live}
    for name, call in (("cascade", cascade_call), ("plain", plain_call)):
        with use_backend("sim"), sim.trace() as t:
            mx.eval(call(w))
        kv_loaded = sum(c.buffers[n].loaded for c in t.calls for n in KV_BUFFERS if n in c.buffers)
        out[name] = {"kv_loaded_bytes": kv_loaded, "kv_loaded_over_live": kv_loaded / live,
                     "all_bytes_moved": sum(c.loaded + c.stored for c in t.calls),
                     "kernels": [c.name.split("_tk")[0].split("_tq")[0] for c in t.calls]}
    return out


def timed_pair(w: dict, backend: str, *, rounds: int = 7, inner: int = 3) -> dict:
    """Median seconds per call of the cascade and the plain op on ``backend``, measured in
    alternating rounds (``inner`` calls each) so that a shared host's noise hits both."""
    times = {"cascade": [], "plain": []}
    with use_backend(backend):
        for fn in (cascade_call, plain_call):  # warm-up (kernel builds, pools)
            mx.eval(fn(w))
        for _ in range(rounds):
            for name, fn in (("cascade", cascade_call), ("plain", plain_call)):
                start = time.perf_counter()
                for _ in range(inner):
                    mx.eval(fn(w))
                times[name].append((time.perf_counter() - start) / inner)
    cascade, plain = statistics.median(times["cascade"]), statistics.median(times["plain"])
    return {"backend": backend, "cascade_s": cascade, "plain_s": plain, "plain_over_cascade": plain / cascade,
            "rounds": rounds, "inner": inner}


def bench_case(*, backend, tokens, repeat, baseline, progress):
    """``kvmetal bench`` case ``cascade_decode``: 16 sequences sharing a ``tokens``-token
    prefix (at most 4096), 64-512 own tokens each, f16; the plain op is the baseline."""
    prefix = max(16, min(int(tokens), 4096)) // 16 * 16
    w = workload(prefix_tokens=prefix, num_kv_heads=8)
    pair = timed_pair(w, backend, rounds=max(1, repeat), inner=1)
    kv_bytes = live_bytes(w)
    base = {"name": f"kvmetal paged_attention over the concatenated tables ({backend})", "seconds": pair["plain_s"],
            "min_seconds": pair["plain_s"], "max_seconds": pair["plain_s"], "repeats": pair["rounds"]}
    return [{"name": f"cascade_decode_f16 prefix={prefix} S=16", "backend": backend, "seconds": pair["cascade_s"],
             "min_seconds": pair["cascade_s"], "max_seconds": pair["cascade_s"], "repeats": pair["rounds"],
             "kv_bytes": kv_bytes, "gbps": kv_bytes / pair["cascade_s"] / 1e9, "baseline": base, "baselines": [base],
             "speedup_vs_baseline": pair["plain_over_cascade"],
             "shape": "S=16 H=32 Hkv=8 D=128 bs=16, own tokens 64-512"}]
