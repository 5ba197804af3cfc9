"""The Metal kernels' part of ``kvmetal bench``.

On a Mac each kernel is timed (median of warm runs) and reported in GB/s of
live KV bytes and as a fraction of the chip's peak memory bandwidth, next to
``mx.fast.scaled_dot_product_attention`` on the same data. Elsewhere the Metal
kernels cannot run, so the simulator's traffic figures for small cases are
reported instead: bytes loaded from the K/V caches against the live KV bytes,
labelled "sim traffic (no timing)".
"""
from __future__ import annotations

import mlx.core as mx

from .. import chips, ops, quant
from ..backends import metal, use_backend
from .cases import HEAD_DIM, NUM_KV_HEADS, paged_setup
from .timing import median_seconds

SIM_LABEL = "sim traffic (no timing)"


def _chip_peak():
    """(device name, peak GB/s of its full configuration or None) from kvmetal.chips."""
    name = str(mx.metal.device_info().get("device_name", "")).strip()
    chip = chips.from_device_name(name)
    return name, chip.bandwidth_gbs if chip is not None else None


def _timed(name, fn, kv_bytes, baseline_fn, peak, repeat):
    seconds = median_seconds(fn, repeat=repeat)
    base = median_seconds(baseline_fn, repeat=repeat) if baseline_fn else None
    gbps = kv_bytes / seconds / 1e9
    return {"name": name, "backend": "metal", "seconds": seconds, "kv_bytes": kv_bytes, "gbps": gbps,
            "peak_fraction": gbps / peak if peak else None,
            "baseline": None if base is None else {"name": "mx.fast.scaled_dot_product_attention (gpu)",
                                                   "seconds": base, "gbps": kv_bytes / base / 1e9},
            "speedup_vs_baseline": None if base is None else base / seconds}


def _metal_results(progress, *, repeat=10):
    chip, peak = _chip_peak()
    results = []
    for tokens in (4096, 32768):
        for dtype, tag in ((mx.float16, "f16"), (mx.bfloat16, "bf16")):
            progress(f"metal paged_attention {tag} T={tokens}")
            q, kc, vc, tables, lens, keys, values = paged_setup(tokens, dtype)
            kv_bytes = 2 * tokens * NUM_KV_HEADS * HEAD_DIM * 2
            sdpa = lambda: mx.fast.scaled_dot_product_attention(q[:, :, None], keys, values, scale=HEAD_DIM ** -0.5)
            with use_backend("metal"):
                results.append(_timed(f"paged_attention_{tag} T={tokens} ({chip})",
                                      lambda: ops.paged_attention(q, kc, vc, tables, lens, validate=False),
                                      kv_bytes, sdpa, peak, repeat))
                results.append(_timed(f"decode_attention_{tag} T={tokens} ({chip})",
                                      lambda: ops.decode_attention(q[:, :, None], keys, values),
                                      kv_bytes, sdpa, peak, repeat))
                results.append(_timed(f"gather_kv_cache_{tag} T={tokens} ({chip})",
                                      lambda: ops.gather_kv_cache(kc, vc, tables, lens, validate=False),
                                      2 * kv_bytes, None, peak, repeat))
        progress(f"metal paged_attention K8/V4 T={tokens}")
        q, kc, vc, tables, lens, keys, values = paged_setup(tokens, mx.float16)
        kq, vq = quant.quantize(kc, bits=8, group_size=64), quant.quantize(vc, bits=4, group_size=64)
        mx.eval(*kq.arrays(), *vq.arrays())
        sdpa = lambda: mx.fast.scaled_dot_product_attention(q[:, :, None], keys, values, scale=HEAD_DIM ** -0.5)
        with use_backend("metal"):
            results.append(_timed(f"paged_attention_k8v4 T={tokens} ({chip})",
                                  lambda: ops.paged_attention(q, kq, vq, tables, lens, validate=False),
                                  kq.nbytes + vq.nbytes, sdpa, peak, repeat))
    return results


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
        groups = head_dim // cache.group_size
        return head_dim * cache.bits // 8 + 2 * groups * cache.scales.itemsize
    return head_dim * cache.itemsize


def _sim_results(progress):
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


def run_metal_cases(progress) -> list:
    """Metal kernel benchmark rows: timings on a Mac, simulator traffic elsewhere."""
    if mx.metal.is_available():
        return _metal_results(progress)
    return _sim_results(progress)
