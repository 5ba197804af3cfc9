"""Benchmark cases. Each returns result dicts: name, backend, seconds, kv_bytes, gbps, baseline."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from .. import ops, quant
from ..backends import use_backend
from .timing import median_seconds

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 32, 8, 128, 16


def paged_setup(tokens: int, dtype, *, num_kv_heads: int = NUM_KV_HEADS, num_heads: int = NUM_HEADS,
                head_dim: int = HEAD_DIM, seed: int = 0):
    """One sequence of ``tokens`` in a paged cache with shuffled block ids, and the same
    keys/values in contiguous SDPA layout for the baselines.

    Returns (query [1, H, D], key_cache, value_cache, block_tables, seq_lens, keys, values)."""
    rng = np.random.default_rng(seed)
    num_blocks = -(-tokens // BLOCK_SIZE)
    shape = (num_blocks, num_kv_heads, BLOCK_SIZE, head_dim)
    key_cache = mx.random.normal(shape, key=mx.random.key(seed)).astype(dtype)
    value_cache = mx.random.normal(shape, key=mx.random.key(seed + 1)).astype(dtype)
    table = rng.permutation(num_blocks).astype(np.int32)
    block_tables = mx.array(table[None])
    seq_lens = mx.array([tokens], dtype=mx.int32)
    query = mx.random.normal((1, num_heads, head_dim), key=mx.random.key(seed + 2)).astype(dtype)

    def contiguous(cache):  # [N, Hkv, bs, D] in table order -> [1, Hkv, T, D]
        rows = cache[mx.array(table)].transpose(1, 0, 2, 3).reshape(num_kv_heads, -1, head_dim)
        return rows[None, :, :tokens]

    keys, values = contiguous(key_cache), contiguous(value_cache)
    mx.eval(key_cache, value_cache, keys, values, query)
    return query, key_cache, value_cache, block_tables, seq_lens, keys, values


def _live_kv_bytes(tokens: int, itemsize_k: float, itemsize_v: float) -> int:
    return int(tokens * NUM_KV_HEADS * HEAD_DIM * (itemsize_k + itemsize_v))


def _result(name, backend, seconds, kv_bytes, baseline=None, **extra):
    r = {"name": name, "backend": backend, "seconds": seconds, "kv_bytes": kv_bytes,
         "gbps": kv_bytes / seconds / 1e9 if seconds else None, "baseline": baseline}
    if baseline:
        r["speedup_vs_baseline"] = baseline["seconds"] / seconds
    r.update(extra)
    return r


def _sdpa_baseline(query, keys, values, repeat: int) -> dict:
    q4 = query[:, :, None, :]
    seconds = median_seconds(lambda: mx.fast.scaled_dot_product_attention(q4, keys, values, scale=HEAD_DIM ** -0.5),
                             repeat=repeat)
    device = "gpu" if mx.metal.is_available() else "cpu"
    return {"name": f"mx.fast.scaled_dot_product_attention ({device}, contiguous)", "seconds": seconds}


def paged_decode(dtype_name: str):
    dtype = {"f32": mx.float32, "f16": mx.float16, "bf16": mx.bfloat16}[dtype_name]

    def run(*, backend, tokens, repeat, baseline, progress):
        query, kc, vc, tables, lens, keys, values = paged_setup(tokens, dtype)
        with use_backend(backend):
            seconds = median_seconds(lambda: ops.paged_attention(query, kc, vc, tables, lens, validate=False),
                                     repeat=repeat)
        base = _sdpa_baseline(query, keys, values, repeat) if baseline else None
        kv_bytes = _live_kv_bytes(tokens, dtype.size, dtype.size)
        return [_result(f"paged_decode_{dtype_name} T={tokens}", backend, seconds, kv_bytes, base,
                        shape=f"H={NUM_HEADS} Hkv={NUM_KV_HEADS} D={HEAD_DIM} bs={BLOCK_SIZE}")]
    return run


def paged_decode_quantized(k_bits: int, v_bits: int):
    def run(*, backend, tokens, repeat, baseline, progress):
        query, kc, vc, tables, lens, _, _ = paged_setup(tokens, mx.float16)
        qk = quant.quantize(kc, bits=k_bits, group_size=64)
        qv = quant.quantize(vc, bits=v_bits, group_size=64)
        mx.eval(*qk.arrays(), *qv.arrays())
        with use_backend(backend):
            seconds = median_seconds(lambda: ops.paged_attention(query, qk, qv, tables, lens, validate=False),
                                     repeat=repeat)
            base = None
            if baseline:
                f16 = median_seconds(lambda: ops.paged_attention(query, kc, vc, tables, lens, validate=False),
                                     repeat=repeat)
                base = {"name": f"kvmetal paged_decode_f16 ({backend})", "seconds": f16}
        live_fraction = tokens / (kc.shape[0] * BLOCK_SIZE)
        kv_bytes = int((qk.nbytes + qv.nbytes) * live_fraction)
        return [_result(f"paged_decode_k{k_bits}v{v_bits} T={tokens}", backend, seconds, kv_bytes, base,
                        bytes_vs_f16=kv_bytes / _live_kv_bytes(tokens, 2, 2))]
    return run


def decode_contiguous(*, backend, tokens, repeat, baseline, progress):
    query, _, _, _, _, keys, values = paged_setup(tokens, mx.float16)
    q4 = query[:, :, None, :]
    with use_backend(backend):
        seconds = median_seconds(lambda: ops.decode_attention(q4, keys, values), repeat=repeat)
    base = _sdpa_baseline(query, keys, values, repeat) if baseline else None
    return [_result(f"decode_attention_f16 T={tokens}", backend, seconds, _live_kv_bytes(tokens, 2, 2), base)]


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
        write = median_seconds(kvmetal_write, repeat=repeat)
        gather = median_seconds(lambda: ops.gather_kv_cache(caches[0], caches[1], tables, lens, validate=False),
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

        write_base = {"name": "MLX indexed assignment (scatter)", "seconds": median_seconds(mlx_write, repeat=repeat)}
        gather_base = {"name": "MLX take + transpose", "seconds": median_seconds(mlx_gather, repeat=repeat)}
    row_bytes = 2 * new * NUM_KV_HEADS * HEAD_DIM * 2
    return [_result(f"reshape_and_cache_f16 {new} rows", backend, write, row_bytes, write_base),
            _result(f"gather_kv_cache_f16 T={tokens}", backend, gather, _live_kv_bytes(tokens, 2, 2), gather_base)]


def metal_kernels(*, backend, tokens, repeat, baseline, progress):
    """Without an Apple GPU: the Metal kernels' simulator traffic. On a Mac the cases
    above already time the metal backend's kernels, so this adds nothing there."""
    if mx.metal.is_available():
        return []
    from .metal_cases import run_metal_cases  # the simulator is loaded only here
    from .sim_costs import cost_rows

    return run_metal_cases(progress) + cost_rows(progress)


CASES = {
    "paged_decode_f32": paged_decode("f32"),
    "paged_decode_f16": paged_decode("f16"),
    "paged_decode_bf16": paged_decode("bf16"),
    "paged_decode_k8v4": paged_decode_quantized(8, 4),
    "decode_contiguous_f16": decode_contiguous,
    "write_and_gather_f16": write_and_gather,
    "metal_kernels": metal_kernels,
}


def run_case(name: str, **kwargs) -> list:
    return CASES[name](**kwargs)
