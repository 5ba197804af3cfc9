"""Fast: paged decode timed next to ``mx.fast.scaled_dot_product_attention`` in the
same run, on the Apple GPU only (the simulator's timings mean nothing).

One sequence of 8K and 32K tokens in the ``kvmetal bench`` workload (32 query heads
over 8 kv heads, head_dim 128, block size 16, shuffled blocks), float16 and K8/V4.
SDPA reads the same rows in float16 from a contiguous cache. Bandwidth is the live
KV bytes a step must read over the median time, as a fraction of the chip's
published peak (``kvmetal/chips.py``), or of a bandwidth measured here when the
chip is not in that table. With ``paged_attention_varlen`` present, a 512-token
prefill chunk is timed against gather + SDPA too.
"""
from __future__ import annotations

import time

import mlx.core as mx

import kvmetal as kv

from .. import chips, quant
from ..benchmarks.timing import time_stats
from ..benchmarks.workloads import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, paged_setup

CONTEXTS = (8192, 32768)
PREFILL_CHUNK = 512
READ_PROBE_BYTES = 1 << 30  # far larger than any cache on the chip


def device_info() -> dict:
    """MLX's description of the GPU ({} without one)."""
    return chips.metal_device_info()


def gpu_read_bandwidth_gbps(nbytes: int | None = None, repeat: int = 5) -> float:
    """One pass of a max-reduction over READ_PROBE_BYTES (the default device's bandwidth)."""
    nbytes = READ_PROBE_BYTES if nbytes is None else nbytes
    x = mx.ones((nbytes // 4,), dtype=mx.float32)
    mx.eval(x)
    stats = time_stats(lambda: mx.max(x), repeat=repeat)
    return nbytes / stats["min"] / 1e9


def _timed(name, fn, repeat, kv_bytes, peak, baseline=None) -> dict:
    stats = time_stats(fn, repeat=repeat)
    gbps = kv_bytes / stats["seconds"] / 1e9
    row = {"name": name, "median_ms": stats["seconds"] * 1e3, "min_ms": stats["min"] * 1e3,
           "max_ms": stats["max"] * 1e3, "repeats": stats["repeats"], "kv_bytes": kv_bytes, "gbps": gbps,
           "fraction_of_peak": gbps / peak if peak else None}
    if baseline is not None:  # measured in this run, just before
        row["baseline"] = baseline["name"]
        row["baseline_ms"] = baseline["median_ms"]
        row["speedup_vs_baseline"] = baseline["median_ms"] / row["median_ms"]
    return row


def time_all(*, quick: bool, progress=None) -> dict:
    """The report's ``fast`` section (``skipped`` with the reason off a Mac)."""
    if not mx.metal.is_available():
        return {"skipped": "no Apple GPU (mx.metal.is_available() is False): the simulator's timings say "
                           "nothing about Metal speed", "results": []}
    start = time.perf_counter()
    device = device_info().get("device_name", "")
    chip = chips.from_device_name(device)
    measured = gpu_read_bandwidth_gbps()
    peak, peak_source = (chip.bandwidth_gbs, f"{chip.device_name} published peak") if chip else \
        (measured, "measured here (chip not in kvmetal/chips.py)")
    repeat = 5 if quick else 20
    results = []
    with kv.use_backend("metal"):
        for tokens in CONTEXTS:
            if progress:
                progress(f"  paged decode at T={tokens} ...")
            query, kc, vc, tables, lens, keys, values = paged_setup(tokens, mx.float16)
            q4 = query[:, :, None, :]
            f16_bytes = 2 * tokens * NUM_KV_HEADS * HEAD_DIM * 2
            sdpa = _timed(f"mx.fast.scaled_dot_product_attention f16 T={tokens}",
                          lambda: mx.fast.scaled_dot_product_attention(q4, keys, values, scale=HEAD_DIM ** -0.5),
                          repeat, f16_bytes, peak)
            results.append(sdpa)
            results.append(_timed(f"kvmetal paged_attention f16 T={tokens}",
                                  lambda: kv.paged_attention(query, kc, vc, tables, lens, validate=False),
                                  repeat, f16_bytes, peak, sdpa))
            qk, qv = quant.quantize(kc, bits=8, group_size=64), quant.quantize(vc, bits=4, group_size=64)
            mx.eval(*qk.arrays(), *qv.arrays())
            live = tokens / (kc.shape[0] * kc.shape[2])
            results.append(_timed(f"kvmetal paged_attention K8/V4 T={tokens}",
                                  lambda: kv.paged_attention(query, qk, qv, tables, lens, validate=False),
                                  repeat, int((qk.nbytes + qv.nbytes) * live), peak, sdpa))
        if hasattr(kv, "paged_attention_varlen"):
            results += _prefill(repeat, peak, progress)
    return {"skipped": None, "device": device, "chip": chip.name if chip else None, "peak_gbps": peak,
            "peak_source": peak_source, "measured_read_gbps": measured, "results": results,
            "seconds": round(time.perf_counter() - start, 3)}


def _prefill(repeat, peak, progress) -> list:
    """A PREFILL_CHUNK-token chunk at the end of an 8K sequence: varlen straight from the
    blocks against gather + causal SDPA."""
    tokens = CONTEXTS[0]
    if progress:
        progress(f"  varlen prefill chunk of {PREFILL_CHUNK} at T={tokens} ...")
    _, kc, vc, tables, lens, _, _ = paged_setup(tokens, mx.float16)
    query = mx.random.normal((PREFILL_CHUNK, NUM_HEADS, HEAD_DIM)).astype(mx.float16)
    starts = mx.array([0, PREFILL_CHUNK], dtype=mx.int32)
    mx.eval(query)
    kv_bytes = 2 * tokens * NUM_KV_HEADS * HEAD_DIM * 2

    def gather_sdpa():
        keys, values = kv.gather_kv_cache(kc, vc, tables, lens, validate=False)
        q = query.transpose(1, 0, 2)[None]
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=HEAD_DIM ** -0.5, mask="causal")

    base = _timed(f"gather_kv_cache + SDPA (causal) prefill {PREFILL_CHUNK} at T={tokens}", gather_sdpa,
                  repeat, kv_bytes, peak)
    varlen = _timed(f"kvmetal paged_attention_varlen prefill {PREFILL_CHUNK} at T={tokens}",
                    lambda: kv.paged_attention_varlen(query, kc, vc, tables, lens, starts, validate=False),
                    repeat, kv_bytes, peak, base)
    return [base, varlen]
