"""Simulator traffic and cost counters of the decode kernels: the one home for what
the simulator measures of them (``kvmetal bench`` on Linux, the traffic tests,
``python -m kvmetal.sim.bench``).

For each decode kernel (``paged_attention_partials``, ``decode_attention_partials``)
one simulated call is measured with ``kvmetal.sim.trace()`` and turned into the
figures that predict speed on an Apple GPU without one:

- bytes loaded from the K/V buffers / the live K/V bytes (1.0 = every row once);
- threadgroup memory per threadgroup;
- threadgroup barriers per 1K K/V rows (token x kv head);
- simd reductions and shuffles per (token x query row), where a query row is one
  (query head, query token) pair, counted per simdgroup execution;
- transcendentals per (token x query row), in simdgroup instructions (lane calls / 32);
- bytes per device load instruction on the K/V buffers.

The kernels are called through the sim backend directly with a 4-D query
[S, L, H, D] (paged) / [B, H, L, D] (contiguous), the backend contract.
"""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np

from .. import quant
from .trace import trace
from .kernel import metal_kernel

KV_BUFFERS = ("key_data", "key_scales", "key_biases", "value_data", "value_scales", "value_biases")


def row_bytes(cache, head_dim: int) -> int:
    """Bytes of one cache row (all its arrays) for one kv head."""
    if isinstance(cache, quant.QuantizedKV):
        return quant.row_nbytes(head_dim, bits=cache.bits, group_size=cache.group_size,
                                scale_bytes=cache.scales.itemsize)
    return head_dim * cache.itemsize


def summarize(call, *, kv_rows: int, query_rows: int, tokens: int, live_bytes: int) -> dict:
    """The cost figures of one traced partials call.

    kv_rows: K/V rows the call attends (tokens x kv heads x sequences); query_rows:
    query rows (query heads x query tokens x sequences); tokens: tokens per sequence.
    Per-(token x row) figures divide by the token x row pairs, ``tokens * query_rows``.
    """
    kv = [n for n in KV_BUFFERS if n in call.buffers]
    loaded = sum(call.buffers[n].loaded for n in kv)
    pairs = tokens * query_rows
    return {
        "kernel": call.name,
        "loaded_bytes": loaded,
        "live_bytes": live_bytes,
        "loaded_over_live": loaded / live_bytes,
        "threadgroup_memory": call.threadgroup_memory,
        "threadgroups": call.threadgroups,
        "barriers": call.barriers,
        "barriers_per_1k_rows": 1000.0 * call.barriers / kv_rows,
        "reductions_per_token_row": call.reductions / pairs,
        "shuffles_per_token_row": call.shuffles / pairs,
        "transcendentals_per_token_row": call.transcendentals / 32.0 / pairs,
        "bytes_per_load": call.bytes_per_load(*kv),
        "data_loaded_once": all(call.buffers[n].loaded == call.buffers[n].distinct_loaded
                                for n in ("key_data", "value_data")),
    }


def _caches(rng, shape, dtype, k_bits, v_bits, group_size):
    k = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    k = quant.quantize(k, bits=k_bits, group_size=group_size) if k_bits else k
    v = quant.quantize(v, bits=v_bits, group_size=group_size) if v_bits else v
    return k, v


def paged_call(tokens: int, *, head_dim: int = 128, gqa: int = 4, num_kv_heads: int = 1, query_len: int = 1,
               dtype=mx.float16, k_bits: int | None = None, v_bits: int | None = None, group_size: int = 64,
               block_size: int = 16, sliding_window: int | None = None, num_splits: int | None = None,
               seed: int = 0):
    """One simulated ``paged_attention_partials`` call (one sequence, shuffled block ids):
    (the traced KernelCall, its cost figures as in :func:`summarize`)."""
    from .backend import sim_backend

    rng = np.random.default_rng(seed)
    num_blocks = -(-tokens // block_size)
    k, v = _caches(rng, (num_blocks, num_kv_heads, block_size, head_dim), dtype, k_bits, v_bits, group_size)
    tables = mx.array(rng.permutation(num_blocks).astype(np.int32)[None])
    lens = mx.array([tokens], dtype=mx.int32)
    num_heads = num_kv_heads * gqa
    q = mx.array(rng.standard_normal((1, query_len, num_heads, head_dim)).astype(np.float32)).astype(dtype)
    with trace() as t:
        mx.eval(sim_backend().paged_attention(
            q, k, v, tables, lens, scale=head_dim ** -0.5, softcap=None, sliding_window=sliding_window,
            sinks=None, num_splits=num_splits))
    call = next(c for c in t.calls if "paged_attention_partials" in c.name)
    live_tokens = tokens if sliding_window is None else min(tokens, sliding_window + query_len - 1)
    live = live_tokens * num_kv_heads * (row_bytes(k, head_dim) + row_bytes(v, head_dim))
    return call, summarize(call, kv_rows=live_tokens * num_kv_heads, query_rows=num_heads * query_len,
                           tokens=live_tokens, live_bytes=live)


def paged_costs(tokens: int, **kwargs) -> dict:
    """Cost figures of one simulated ``paged_attention_partials`` call (see :func:`paged_call`)."""
    return paged_call(tokens, **kwargs)[1]


def decode_costs(tokens: int, *, head_dim: int = 128, gqa: int = 4, num_kv_heads: int = 1, query_len: int = 1,
                 dtype=mx.float16, k_bits: int | None = None, v_bits: int | None = None, group_size: int = 64,
                 num_splits: int | None = None, seed: int = 0) -> dict:
    """Cost figures of one simulated ``decode_attention_partials`` call (batch 1)."""
    from .backend import sim_backend

    rng = np.random.default_rng(seed)
    k, v = _caches(rng, (1, num_kv_heads, tokens, head_dim), dtype, k_bits, v_bits, group_size)
    num_heads = num_kv_heads * gqa
    q = mx.array(rng.standard_normal((1, num_heads, query_len, head_dim)).astype(np.float32)).astype(dtype)
    with trace() as t:
        mx.eval(sim_backend().decode_attention(q, k, v, scale=head_dim ** -0.5, softcap=None, sinks=None,
                                                     num_splits=num_splits))
    call = next(c for c in t.calls if "decode_attention_partials" in c.name)
    live = tokens * num_kv_heads * (row_bytes(k, head_dim) + row_bytes(v, head_dim))
    return summarize(call, kv_rows=tokens * num_kv_heads, query_rows=num_heads * query_len, tokens=tokens,
                     live_bytes=live)


# ----------------------------------------------------------------------------- MLX's sdpa_vector

_SDPA_BODY = """
const int n = params[0];
const int gqa = params[1];
const size_t k_head_stride = size_t(params[2]);
const size_t k_seq_stride = size_t(params[3]);
const float scale = as_type<float>(params[4]);
const int unused = 0;
sdpa_vector<T, D, D>(queries, keys, values, out, gqa, n, k_head_stride, k_seq_stride, k_head_stride,
                     k_seq_stride, scale, reinterpret_cast<const device bool*>(params), keys, unused, unused,
                     unused, keys, unused, threadgroup_position_in_grid, threadgroups_per_grid,
                     simdgroup_index_in_threadgroup, thread_index_in_simdgroup);
"""


def mlx_sdpa_path():
    import pathlib

    return pathlib.Path(mx.__file__).parent / "include/mlx/backend/metal/kernels/sdpa_vector.h"


def fix_function_constants(text: str, values: dict | None = None, *, strict: bool = False) -> str:
    """An MLX kernel source with its ``[[function_constant(i)]]`` declarations turned into
    compile-time constants (the simulator has no pipeline constants): ``values[name]``, else
    false / 0 (``strict``: every constant must be in ``values``)."""
    import re

    values = values or {}

    def fixed(m):
        kind, name = m.group(1), m.group(2)
        if strict or name in values:
            value = values[name]
            value = str(value).lower() if isinstance(value, bool) else str(value)
        else:
            value = "false" if kind == "bool" else "0"
        return f"constant constexpr {kind} {name} = {value};"

    return re.sub(r"constant (bool|int) (\w+) \[\[function_constant\(\d+\)\]\];", fixed, text)


def mlx_sdpa_header(values: dict | None = None) -> str:
    """MLX's own sdpa_vector.h from the installed package, read at run time (never
    copied into the project), with its function constants fixed: by default the plain
    decode configuration (no mask, not transposed, not causal, no sinks)."""
    return fix_function_constants(mlx_sdpa_path().read_text(), values)


def mlx_sdpa_vector_costs(tokens: int, *, head_dim: int = 128, gqa: int = 4, num_kv_heads: int = 1,
                          seed: int = 0, return_output: bool = False) -> dict:
    """Cost figures of MLX's one-pass ``sdpa_vector`` kernel on the simulator, launched as
    MLX launches it (one threadgroup of 32 simdgroups per query head), same figures as
    paged_costs. Its loads are per element in the source (the simulator counts them so)."""
    rng = np.random.default_rng(seed)
    num_heads = num_kv_heads * gqa
    q = mx.array(rng.standard_normal((num_heads, head_dim)).astype(np.float32)).astype(mx.float16)
    k = mx.array(rng.standard_normal((num_kv_heads, tokens, head_dim)).astype(np.float32)).astype(mx.float16)
    v = mx.array(rng.standard_normal((num_kv_heads, tokens, head_dim)).astype(np.float32)).astype(mx.float16)
    params = np.array([tokens, gqa, tokens * head_dim, head_dim, 0, 0, 0, 0], np.int32)
    params[4] = np.array(head_dim ** -0.5, np.float32).view(np.int32)
    kernel = metal_kernel("mlx_sdpa_vector", ["queries", "keys", "values", "params"], ["out"], _SDPA_BODY,
                              header=mlx_sdpa_header())
    with trace() as t:
        (out,) = kernel(inputs=[q, k, v, mx.array(params)], template=[("T", mx.float16), ("D", head_dim)],
               grid=(num_heads * 1024, 1, 1), threadgroup=(1024, 1, 1), output_shapes=[(num_heads, head_dim)],
               output_dtypes=[mx.float16])
    call = t.calls[0]
    if return_output:
        return call, (q, k, v, out)
    call = dataclasses.replace(call, buffers={("key_data" if n == "keys" else "value_data" if n == "values" else n): b
                                              for n, b in call.buffers.items()})
    live = tokens * num_kv_heads * 2 * head_dim * 2
    return summarize(call, kv_rows=tokens * num_kv_heads, query_rows=num_heads, tokens=tokens, live_bytes=live)
