"""``kvmetal bench --cases prefill``: one prefill chunk after a cached prefix through
``paged_attention_varlen``, against gather + MLX SDPA (causal) measured in the same run.

On the metal (and sim) backend the case sweeps the tiled kernel's tile sizes
(``metal.VarlenTiles``: simdgroups -> BQ = 8 x simdgroups query rows, BK K/V tokens),
one result row per configuration that fits 32 KiB of threadgroup memory; on other
backends it times the backend's own implementation once.
"""
from __future__ import annotations

import mlx.core as mx

from .. import ops
from ..backends import use_backend
from .timing import time_stats
from .workloads import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, paged_setup

CHUNK = 512
MAX_CONTEXT = 4096
TILE_SWEEP = ((4, 32), (4, 16), (2, 32), (8, 16), (2, 16), (8, 8))  # (simdgroups, BK)


def _kernel_backend(backend: str):
    from ..backends import metal

    return {"metal": metal.metal_backend, "sim": metal.sim_backend}.get(backend, lambda: None)()


def prefill(*, backend, tokens, repeat, baseline, progress):
    from ..backends import metal
    from .cases import _baseline, _live_kv_bytes, _result

    context = max(1, min(tokens, MAX_CONTEXT))
    chunk = min(CHUNK, context)
    dtype = mx.float16
    _, kc, vc, tables, lens, keys, values = paged_setup(context, dtype)
    query = mx.random.normal((chunk, NUM_HEADS, HEAD_DIM), key=mx.random.key(7)).astype(dtype)
    qsl = mx.array([0, chunk], dtype=mx.int32)
    mx.eval(query)
    scale = HEAD_DIM ** -0.5
    shape = f"H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} bs={BLOCK_SIZE} chunk={chunk} after {context - chunk}"
    bases = []
    if baseline:
        q4 = query.transpose(1, 0, 2)[None]

        def gather_sdpa():
            with use_backend(backend):
                k, v = ops.gather_kv_cache(kc, vc, tables, lens, validate=False)
            return mx.fast.scaled_dot_product_attention(q4, k, v, scale=scale, mask="causal")

        bases.append(_baseline(f"kvmetal gather_kv_cache + mx.fast.scaled_dot_product_attention causal ({backend})",
                               gather_sdpa, repeat))
    kv_bytes = _live_kv_bytes(context, dtype.size, dtype.size)
    kernels = _kernel_backend(backend)
    results = []
    if kernels is None:
        with use_backend(backend):
            try:
                stats = time_stats(lambda: ops.paged_attention_varlen(query, kc, vc, tables, lens, qsl,
                                                                      validate=False), repeat=repeat)
            except NotImplementedError as e:
                return [{"name": f"prefill_f16 T={context}", "backend": backend, "seconds": None, "kv_bytes": None,
                         "gbps": None, "note": f"skipped: {e}", "skipped": True}]
        return [_result(f"prefill_f16 T={context}", backend, stats, kv_bytes, bases, shape=shape)]
    for simdgroups, block_k in TILE_SWEEP:
        try:
            tiles = metal.varlen_tiles(head_dim=HEAD_DIM, k_itemsize=dtype.size, v_itemsize=dtype.size,
                                       simdgroups=simdgroups, block_k=block_k)
        except ValueError:
            continue  # over 32 KiB of threadgroup memory
        progress(f"  tiles: {simdgroups} simdgroups (BQ {tiles.block_q}), BK {block_k}")
        stats = time_stats(lambda: kernels.paged_attention_varlen(
            query, kc, vc, tables, lens, qsl, scale=scale, softcap=None, sliding_window=None, sinks=None,
            tiles=tiles), repeat=repeat)
        results.append(_result(f"prefill_f16 T={context} nsg={simdgroups} bk={block_k}", backend, stats, kv_bytes,
                               bases, shape=shape, tiles={"simdgroups": simdgroups, "block_q": tiles.block_q,
                                                          "block_k": block_k}))
    return results
