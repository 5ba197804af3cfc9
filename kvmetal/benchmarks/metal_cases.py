"""The Metal kernels' part of ``kvmetal bench`` where no Apple GPU is present.

On a Mac, ``kvmetal bench`` runs every case on the metal backend itself (timed,
next to ``mx.fast.scaled_dot_product_attention`` on the GPU, with the fraction of
the chip's peak bandwidth). Elsewhere the Metal kernels cannot run, so the
simulator's traffic figures for small cases are reported instead: bytes loaded
from the K/V caches against the live KV bytes, labelled "sim traffic (no timing)".
"""
from __future__ import annotations

import mlx.core as mx

from .. import ops, quant
from ..backends import metal, use_backend
from .cases import paged_setup

SIM_LABEL = "sim traffic (no timing)"


def sim_traffic(tokens: int, *, num_kv_heads: int, num_heads: int, head_dim: int = 64, dtype=mx.float16,
                k_bits: int | None = None, v_bits: int | None = None, group_size: int = 64,
                sliding_window: int | None = None, num_splits: int | None = None) -> dict:
    """Bytes the simulated paged decode loads from the K/V caches vs the live rows' bytes."""
    from .. import sim

    q, kc, vc, tables, lens, _, _ = paged_setup(tokens, dtype, num_kv_heads=num_kv_heads, num_heads=num_heads,
                                           head_dim=head_dim)
    kk = quant.quantize(kc, bits=k_bits, group_size=group_size) if k_bits else kc
    vv = quant.quantize(vc, bits=v_bits, group_size=group_size) if v_bits else vc
    live_tokens = tokens if sliding_window is None else min(tokens, sliding_window)
    live = live_tokens * num_kv_heads * sum(_row_bytes(c, head_dim) for c in (kk, vv))
    with use_backend("sim"), sim.trace() as t:
        mx.eval(ops.paged_attention(q, kk, vv, tables, lens, sliding_window=sliding_window,
                                    num_splits=num_splits, validate=False))
    call = next(c for c in t.calls if "paged_attention_partials" in c.name)
    cache_inputs = [n for n in call.buffers if n.startswith(("key_", "value_"))]
    loaded = sum(call.buffers[n].loaded for n in cache_inputs)
    return {"loaded": loaded, "live_bytes": live, "ratio": loaded / live,
            "threadgroups": metal.Geometry(call.grid, call.threadgroup).threadgroups, "call": call}


def _row_bytes(cache, head_dim) -> int:
    """Bytes of one cache row (all its arrays) for one kv head."""
    if isinstance(cache, quant.QuantizedKV):
        return quant.row_nbytes(head_dim, bits=cache.bits, group_size=cache.group_size,
                                scale_bytes=cache.scales.itemsize)
    return head_dim * cache.itemsize


def run_metal_cases(progress) -> list:
    """Simulator traffic rows for the paged decode kernel (no timing)."""
    results = []
    cases = [
        ("paged_attention f16 GQA 1", dict(num_kv_heads=2, num_heads=2)),
        ("paged_attention f16 GQA 4", dict(num_kv_heads=2, num_heads=8)),
        ("paged_attention f16 GQA 8", dict(num_kv_heads=1, num_heads=8)),
        ("paged_attention f16 sliding_window=256", dict(num_kv_heads=2, num_heads=8, sliding_window=256)),
        ("paged_attention K8/V4", dict(num_kv_heads=2, num_heads=8, k_bits=8, v_bits=4)),
    ]
    for name, kwargs in cases:
        progress(f"sim traffic {name}")
        figures = sim_traffic(1024, **kwargs)
        note = (f"{SIM_LABEL}: loaded {figures['loaded']:,} B from K/V = "
                f"{figures['ratio']:.3f}x the live rows' bytes")
        results.append({"name": f"{name} T=1024 D=64", "backend": "sim", "seconds": None,
                        "kv_bytes": figures["live_bytes"], "gbps": None, "note": note,
                        "loaded_bytes": figures["loaded"], "loaded_over_live": figures["ratio"]})
    return results
