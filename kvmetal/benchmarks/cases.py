"""Benchmark cases. Each returns result dicts: name, backend, seconds (median), min_seconds,
max_seconds, repeats, kv_bytes, gbps, baseline (the main one) and baselines (all of them)."""
from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np

from .. import ops, quant
from .. import backends
from ..backends import use_backend
from .cascade import bench_case as cascade_bench_case
from .prefill import prefill as prefill_chunked
from .timing import time_interleaved, time_stats
from .workloads import BLOCK_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, paged_setup

# A baseline slower than this per call (mlx-lm's quantized SDPA on a CPU takes seconds at
# 32K) is timed fewer times, so that the default `kvmetal bench` stays near a minute.
BASELINE_BUDGET_S = 2.0

def _live_kv_bytes(tokens: int, itemsize_k: float, itemsize_v: float) -> int:
    return int(tokens * NUM_KV_HEADS * HEAD_DIM * (itemsize_k + itemsize_v))


def _result(name, backend, stats, kv_bytes, baselines=None, **extra):
    """One result row; ``baselines`` (a list, or one dict) were measured in this run, the
    first is the main one (``baseline``)."""
    if isinstance(baselines, dict):
        baselines = [baselines]
    baselines = [b for b in baselines or [] if b]
    seconds = stats["seconds"]
    r = {"name": name, "backend": backend, "seconds": seconds, "min_seconds": stats["min"],
         "max_seconds": stats["max"], "repeats": stats["repeats"], "kv_bytes": kv_bytes,
         "gbps": kv_bytes / seconds / 1e9 if seconds else None,
         "baseline": baselines[0] if baselines else None, "baselines": baselines}
    if baselines:
        r["speedup_vs_baseline"] = baselines[0]["seconds"] / seconds
    r.update(extra)
    return r


def _baseline_row(name: str, stats: dict) -> dict:
    return {"name": name, "seconds": stats["seconds"], "min_seconds": stats["min"], "max_seconds": stats["max"],
            "repeats": stats["repeats"]}


def _baseline(name: str, fn, repeat: int, **kwargs) -> dict:
    return _baseline_row(name, time_stats(fn, repeat=repeat, **kwargs))


def _device() -> str:
    return "gpu" if mx.metal.is_available() else "cpu"


def _sdpa_name() -> str:
    return f"mx.fast.scaled_dot_product_attention ({_device()}, contiguous)"


def _sdpa(query, keys, values):
    """MLX's own decode attention over the contiguous K/V: the baseline of the float cases."""
    q4 = query[:, :, None, :]
    return lambda: mx.fast.scaled_dot_product_attention(q4, keys, values, scale=HEAD_DIM ** -0.5)


def _timed_with_baseline(backend: str, kernel, baseline_fn, repeat: int) -> tuple:
    """kvmetal's call and (when given) its baseline timed in turns: (stats, baseline stats or None)."""
    with use_backend(backend):
        if baseline_fn is None:
            return time_stats(kernel, repeat=repeat), None
        both = time_interleaved({"kvmetal": kernel, "baseline": baseline_fn}, repeat=repeat)
    return both["kvmetal"], both["baseline"]


def _mlx_lm_quantized_baseline(query, keys, values, repeat: int, *, bits: int = 8) -> dict | None:
    """mlx-lm's own quantized-cache attention: ``QuantizedKVCache(bits=8)`` layout (mx.quantize
    of the contiguous K and V) through its ``quantized_scaled_dot_product_attention``."""
    try:
        from mlx_lm.models.base import quantized_scaled_dot_product_attention
    except ImportError:
        return None
    qk = mx.quantize(keys, group_size=64, bits=bits)
    qv = mx.quantize(values, group_size=64, bits=bits)
    mx.eval(qk, qv)
    q4 = query[:, :, None, :]
    return _baseline(f"mlx-lm QuantizedKVCache kv_bits={bits} quantized SDPA ({_device()}, contiguous)",
                     lambda: quantized_scaled_dot_product_attention(q4, qk, qv, scale=HEAD_DIM ** -0.5, mask=None,
                                                                    group_size=64, bits=bits),
                     repeat, budget_s=BASELINE_BUDGET_S)


def _gather_sdpa_baseline(query, k_cache, v_cache, tables, lens, backend: str, repeat: int) -> dict:
    """What a paged cache without a fused kernel does: gather (and dequantize) the rows,
    then MLX's SDPA over them."""
    q4 = query[:, :, None, :]

    def run():
        with use_backend(backend):
            keys, values = ops.gather_kv_cache(k_cache, v_cache, tables, lens, validate=False)
        return mx.fast.scaled_dot_product_attention(q4, keys, values, scale=HEAD_DIM ** -0.5)

    return _baseline(f"kvmetal gather_kv_cache (dequantized) + mx.fast.scaled_dot_product_attention ({backend})",
                     run, repeat, budget_s=BASELINE_BUDGET_S)


def paged_decode(dtype_name: str):
    dtype = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}[dtype_name]

    def run(*, backend, tokens, repeat, baseline, progress):
        query, kc, vc, tables, lens, keys, values = paged_setup(tokens, dtype)
        stats, base = _timed_with_baseline(
            backend, lambda: ops.paged_attention(query, kc, vc, tables, lens, validate=False),
            _sdpa(query, keys, values) if baseline else None, repeat)
        base = _baseline_row(_sdpa_name(), base) if base else None
        kv_bytes = _live_kv_bytes(tokens, dtype.size, dtype.size)
        return [_result(f"paged_decode_{dtype_name} T={tokens}", backend, stats, kv_bytes, base,
                        shape=f"H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} bs={BLOCK_SIZE}")]
    return run


def paged_decode_quantized(k_bits: int, v_bits: int):
    def run(*, backend, tokens, repeat, baseline, progress):
        query, kc, vc, tables, lens, keys, values = paged_setup(tokens, mx.float16)
        qk = quant.quantize(kc, bits=k_bits, group_size=64)
        qv = quant.quantize(vc, bits=v_bits, group_size=64)
        mx.eval(*qk.arrays(), *qv.arrays())
        # kvmetal's own float16 kernel over the same cache is timed in turns with the
        # quantized one, so "K8/V4 vs f16" is a ratio of one moment.
        stats, f16 = _timed_with_baseline(
            backend, lambda: ops.paged_attention(query, qk, qv, tables, lens, validate=False),
            (lambda: ops.paged_attention(query, kc, vc, tables, lens, validate=False)) if baseline else None, repeat)
        bases, skipped = [], []
        if baseline:
            # mlx-lm's own quantized path first (the fair comparison), then the gather +
            # SDPA route over the same K8/V4 cache, then kvmetal's own float16 kernel.
            bases.append(_mlx_lm_quantized_baseline(query, keys, values, repeat, bits=8))
            if bases[-1] is None:
                from ..cli_args import install_hint

                skipped.append(f"mlx-lm kv_bits=8 baseline skipped: mlx-lm is not installed: {install_hint('mlx_lm')}")
            bases.append(_gather_sdpa_baseline(query, qk, qv, tables, lens, backend, repeat))
            bases.append(_baseline_row(f"kvmetal paged_decode_f16 ({backend}, timed in turns)", f16))
        live_fraction = tokens / (kc.shape[0] * BLOCK_SIZE)
        kv_bytes = int((qk.nbytes + qv.nbytes) * live_fraction)
        return [_result(f"paged_decode_k{k_bits}v{v_bits} T={tokens}", backend, stats, kv_bytes, bases,
                        skipped_baselines=skipped,
                        bytes_vs_f16=kv_bytes / _live_kv_bytes(tokens, 2, 2))]
    return run


def decode_contiguous(*, backend, tokens, repeat, baseline, progress):
    query, _, _, _, _, keys, values = paged_setup(tokens, mx.float16)
    q4 = query[:, :, None, :]
    stats, base = _timed_with_baseline(backend, lambda: ops.decode_attention(q4, keys, values),
                                       _sdpa(query, keys, values) if baseline else None, repeat)
    base = _baseline_row(_sdpa_name(), base) if base else None
    return [_result(f"decode_attention_f16 T={tokens}", backend, stats, _live_kv_bytes(tokens, 2, 2), base)]


def write_and_gather(*, backend, tokens, repeat, baseline, progress):
    """reshape_and_cache of up to 512 new tokens, and gather_kv_cache of the whole sequence.

    The write threads the caches through every call and keeps no other reference, as a
    decode loop does, so both kvmetal and the MLX baseline can update them in place.
    """
    query, kc, vc, tables, lens, _, _ = paged_setup(tokens, mx.float16)
    new = min(512, kc.shape[0] * BLOCK_SIZE)
    rows_k = mx.random.normal((new, NUM_KV_HEADS, HEAD_DIM)).astype(mx.float16)
    rows_v = mx.random.normal((new, NUM_KV_HEADS, HEAD_DIM)).astype(mx.float16)
    slots = mx.array(np.random.default_rng(1).choice(kc.shape[0] * BLOCK_SIZE, new, replace=False).astype(np.int32))
    mx.eval(rows_k, rows_v, slots)
    caches = [kc, vc]
    del kc, vc

    def kvmetal_write():
        k, v = caches
        caches[:] = ops.reshape_and_cache(rows_k, rows_v, k, v, slots, validate=False)
        return caches[0], caches[1]

    with use_backend(backend):
        write = time_stats(kvmetal_write, repeat=repeat)
        gather = time_stats(lambda: ops.gather_kv_cache(caches[0], caches[1], tables, lens, validate=False),
                            repeat=repeat)
    write_base = gather_base = None
    if baseline:
        blocks, offsets = slots // BLOCK_SIZE, slots % BLOCK_SIZE

        def mlx_write():  # MLX's own scatter into the same layout, on the same threaded caches
            k, v = caches
            k[blocks, :, offsets] = rows_k
            v[blocks, :, offsets] = rows_v
            return k, v

        def mlx_gather():
            k, v = caches
            return (k[tables[0]].transpose(1, 0, 2, 3).reshape(NUM_KV_HEADS, -1, HEAD_DIM),
                    v[tables[0]].transpose(1, 0, 2, 3).reshape(NUM_KV_HEADS, -1, HEAD_DIM))

        write_base = _baseline("MLX indexed assignment (scatter)", mlx_write, repeat)
        gather_base = _baseline("MLX take + transpose", mlx_gather, repeat)
    row_bytes = 2 * new * NUM_KV_HEADS * HEAD_DIM * 2
    return [_result(f"reshape_and_cache_f16 {new} rows", backend, write, row_bytes, write_base),
            _result(f"gather_kv_cache_f16 T={tokens}", backend, gather, _live_kv_bytes(tokens, 2, 2), gather_base)]


def simulator_missing() -> str | None:
    """Why the simulator cannot run here (no C++ compiler), or None."""
    import shutil

    from ..sim import build

    cmd = build.compiler()
    if cmd and shutil.which(cmd[0]):
        return None
    return (f"skipped: the Metal simulator compiles kernels with a C++ compiler and {' '.join(cmd) or 'g++'!r} "
            f"is not on PATH (install g++ or clang++, or set CXX)")


def metal_kernels(*, backend, tokens, repeat, baseline, progress):
    """Without an Apple GPU: the Metal kernels' simulator traffic. On a Mac the cases
    above already time the metal backend's kernels, so this adds nothing there."""
    if mx.metal.is_available():
        return []
    missing = simulator_missing()
    if missing:
        return [{"name": "metal kernels (simulator traffic)", "backend": "sim", "seconds": None,
                 "kv_bytes": None, "gbps": None, "note": missing, "skipped": True}]
    from .sim_cases import cost_rows, modelled_rows, traffic_rows  # the simulator is loaded only here

    return traffic_rows(progress) + cost_rows(progress) + modelled_rows(progress)


def _sparse_v_captured(**kwargs):
    from .sparse_v_captured import run  # loads the capture only when asked for

    return run(result_row=_result, time_baseline=_baseline, simulator_missing=simulator_missing, **kwargs)


# ----------------------------------------------------------------------------- prefill (varlen)

PREFILL_CHUNK = 512
PREFILL_MAX_CONTEXT = 4096
PREFILL_TILE_SWEEP = ((4, 32), (4, 16), (2, 32), (8, 16), (2, 16), (8, 8))  # (simdgroups, BK)
PREFILL_ROW_FRAGMENTS = (1, 2)  # RF: 8-row fragments per simdgroup (issue 41 P8; only a Mac can time 1 vs 2)
PREFILL_D_SPLITS = (1, 2, 4)    # DS: simdgroups per row fragment, over D / DS dims each (issue 41 P1: split-D;
                                # D 256 takes 2, D 512 4)
# SKV: K and V take turns in one threadgroup buffer (D 512 takes it where the two tiles side
# by side pass 32 KiB); timed also where both fit, on the sweep's first tile size, RF 1.
PREFILL_SEQUENTIAL_KV = (False, True)


def prefill(*, backend, tokens, repeat, baseline, progress):
    """One prefill chunk after a cached prefix through ``paged_attention_varlen``, against
    gather + MLX SDPA (causal) measured in the same run. On the metal (and sim) backend it
    sweeps the tiled kernel's tile sizes (``metal_layout.VarlenTiles``: simdgroups per row
    group, row fragments RF -> BQ = 8 x simdgroups x RF query rows, BK K/V tokens, and
    split-D DS: DS x the simdgroups, each over D / DS dims, the same BQ), one row per
    configuration that fits 32 KiB of threadgroup memory and the thread limit; on other
    backends it times the backend's own implementation once."""
    from ..backends import metal_layout

    context = max(1, min(tokens, PREFILL_MAX_CONTEXT))
    chunk = min(PREFILL_CHUNK, context)
    dtype = mx.float16
    _, kc, vc, tables, lens, _, _ = paged_setup(context, dtype)
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
    kernels = backends.get(backend) if backend in ("metal", "sim") else None
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
    for (simdgroups, block_k), rf, ds, skv in itertools.product(PREFILL_TILE_SWEEP, PREFILL_ROW_FRAGMENTS,
                                                                PREFILL_D_SPLITS, PREFILL_SEQUENTIAL_KV):
        if skv and ((simdgroups, block_k) != PREFILL_TILE_SWEEP[0] or rf != 1):
            continue
        try:
            tiles = metal_layout.varlen_tiles(head_dim=HEAD_DIM, k_itemsize=dtype.size, v_itemsize=dtype.size,
                                              simdgroups=simdgroups * ds, block_k=block_k, row_fragments=rf,
                                              d_split=ds, sequential_kv=skv)
        except ValueError:
            continue  # over 32 KiB of threadgroup memory or the thread limit
        progress(f"  tiles: {simdgroups} simdgroups x RF {rf} (BQ {tiles.block_q}), BK {block_k}, DS {ds}, "
                 f"SKV {int(skv)}")
        stats = time_stats(lambda: kernels.paged_attention_varlen(
            query, kc, vc, tables, lens, qsl, scale=scale, softcap=None, sliding_window=None, sinks=None,
            tiles=tiles), repeat=repeat)
        results.append(_result(f"prefill_f16 T={context} nsg={simdgroups} rf={rf} bk={block_k} ds={ds} skv={int(skv)}",
                               backend, stats, kv_bytes, bases, shape=shape,
                               tiles={"simdgroups": tiles.simdgroups, "row_fragments": rf, "block_q": tiles.block_q,
                                      "block_k": block_k, "d_split": ds, "sequential_kv": skv}))
    return results


CASES = {
    "paged_decode_f32": paged_decode("f32"),
    "paged_decode_f16": paged_decode("f16"),
    "paged_decode_bf16": paged_decode("bf16"),
    "paged_decode_k8v4": paged_decode_quantized(8, 4),
    "decode_contiguous_f16": decode_contiguous,
    "write_and_gather_f16": write_and_gather,
    "prefill_chunked": prefill_chunked,  # a 2K prompt in 512-token chunks, SmolLM2 shapes, peak memory
    "metal_kernels": metal_kernels,
    "prefill": prefill,  # one chunk after a prefix; the tile-size sweep on metal/sim (opt-in)
    "cascade_decode": cascade_bench_case,  # 16 sequences over one shared prefix vs the plain op (opt-in)
    "sparse_v_captured": _sparse_v_captured,  # exact vs sparse V over a real model's captured attention (opt-in)
}
# Cases only an explicit --cases runs: the tile sweep is for a Mac's tuning session; the
# cascade pair is issue 21's measurement (bench/cascade.py has the simulator's bytes); the
# sparse-V case needs an attention capture (kvmetal.benchmarks.attention_capture).
OPT_IN = ("prefill", "cascade_decode", "sparse_v_captured")


def run_case(name: str, **kwargs) -> list:
    return CASES[name](**kwargs)
