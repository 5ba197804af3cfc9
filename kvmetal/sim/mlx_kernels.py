"""MLX's own decode kernels (``sdpa_vector``, ``sdpa_vector_2pass_1`` / ``_1_gqa`` / ``_2``) run in
the simulator as MLX launches them, for the cost model (kvmetal/sim/cost_model.py).

The kernels come from the installed MLX package's Metal headers, read at run time and never
copied into this project; only their function constants are fixed here (no mask, no sinks,
query not transposed, not causal, and ``blocks`` for the two-pass kernels). Which kernel MLX
picks and with how many blocks follows MLX's dispatch for a decode query
(mlx/backend/metal/scaled_dot_product_attention.cpp, read in MLX's repository; summarised
in :func:`mlx_decode_plan` and docs/cost_model.md). Only float16 caches: MLX has no fused
quantized-cache attention kernel.
"""
from __future__ import annotations

import re

import mlx.core as mx
import numpy as np

from .kernel import metal_kernel
from .trace import trace
from .traffic import mlx_sdpa_path

# Head-per-thread of MLX's duplication-free GQA kernel at D 128 and G 8: the instantiation list
# (scaled_dot_product_attention.metal) is not in the Linux wheel; a third-party reading of it lists
# (D, V, G, HPT) = (128, 128, 8, 4). An assumption until a Mac run names the pipeline.
GQA_HPT = {8: 4}


def mlx_decode_plan(tokens: int, gqa: int, head_dim: int = 128, arch_suffix: str = "g") -> dict:
    """The kernel MLX's dispatch picks for one decode query (L 1, no mask, no sinks):
    {"kernel": "sdpa_vector" | "sdpa_vector_2pass", "blocks": int, "gqa_variant": bool}.

    MLX takes the two-pass kernel when the GPU's architecture name ends in 'd' or 's' and the
    keys number 1024 or more, or when the query heads outnumber the kv heads and the keys
    number 4096 or more. Blocks: 's' 64 (128/256/512/1024 by length when more than 4
    simdgroups), 'd' 128 (256/512/1024 for long runs), otherwise 64 with 4+ simdgroups, else
    32. The duplication-free GQA variant: G 8 (D 64/128) or G 12/16 (D 128), at 8192+ keys.
    ``arch_suffix``: the last letter of the chip's architecture name (an assumption per chip:
    see cost_model.MLX_ARCH_SUFFIX)."""
    n_simds = gqa
    two_pass = (arch_suffix in "ds" and tokens >= 1024) or (gqa > 1 and tokens >= 4096)
    if not two_pass:
        return {"kernel": "sdpa_vector", "blocks": 0, "gqa_variant": False}
    if arch_suffix == "s":
        blocks = 64
        if tokens > 1024 and n_simds > 4:
            blocks = 128 if tokens <= 8192 else 256 if tokens <= 32768 else 512 if tokens <= 65536 else 1024
    elif arch_suffix == "d":
        blocks = 128
        if n_simds <= 2 and tokens > 8192:
            blocks = 256
        elif n_simds >= 6:
            blocks = 512 if 16384 <= tokens < 65536 else 1024 if tokens >= 65536 else 128
    else:
        blocks = 64 if n_simds >= 4 else 32
    gqa_dims = (gqa == 8 and head_dim in (64, 128)) or (gqa in (12, 16) and head_dim == 128)
    gqa_variant = gqa_dims and tokens >= 8192 and gqa in GQA_HPT
    return {"kernel": "sdpa_vector_2pass", "blocks": blocks, "gqa_variant": gqa_variant}


def _header(blocks: int) -> str:
    text = mlx_sdpa_path().read_text()

    def fix(m):
        kind, name = m.group(1), m.group(2)
        value = str(blocks) if name == "blocks" else ("false" if kind == "bool" else "0")
        return f"constant constexpr {kind} {name} = {value};"

    return re.sub(r"constant (bool|int) (\w+) \[\[function_constant\(\d+\)\]\];", fix, text)


_ONE_PASS = """
const int n = params[0];
const size_t hs = size_t(params[1]);
const size_t ss = size_t(params[2]);
const float scale = as_type<float>(params[3]);
const int gqa = params[4];
const int unused = 0;
sdpa_vector<T, D, D>(queries, keys, values, out, gqa, n, hs, ss, hs, ss, scale,
                     reinterpret_cast<const device bool*>(params), keys, unused, unused, unused, keys, unused,
                     threadgroup_position_in_grid, threadgroups_per_grid, simdgroup_index_in_threadgroup,
                     thread_index_in_simdgroup);
"""

_PASS_1 = """
const int n = params[0];
const size_t hs = size_t(params[1]);
const size_t ss = size_t(params[2]);
const float scale = as_type<float>(params[3]);
const int unused = 0;
sdpa_vector_2pass_1<T, D, D>(queries, keys, values, out, sums, maxs, n, hs, ss, hs, ss, scale,
                             reinterpret_cast<const device bool*>(params), keys, unused, unused, unused, keys,
                             threads_per_threadgroup, thread_position_in_threadgroup, threadgroup_position_in_grid,
                             threadgroups_per_grid, thread_index_in_simdgroup);
"""

_PASS_1_GQA = """
const int n = params[0];
const size_t hs = size_t(params[1]);
const size_t ss = size_t(params[2]);
const float scale = as_type<float>(params[3]);
sdpa_vector_2pass_1_gqa<T, D, D, G, HPT>(queries, keys, values, out, sums, maxs, n, hs, ss, hs, ss, scale,
                                         threadgroup_position_in_grid, threadgroups_per_grid,
                                         thread_position_in_threadgroup, thread_index_in_simdgroup);
"""

_PASS_2 = """
const int nb = params[0];
sdpa_vector_2pass_2<T, D>(partials, sums, maxs, out, nb, threadgroup_position_in_grid, threadgroups_per_grid,
                          simdgroup_index_in_threadgroup, thread_index_in_simdgroup);
"""


def _params(*values) -> mx.array:
    words = np.zeros(8, np.int32)
    for i, v in enumerate(values):
        words[i] = np.array(v, np.float32).view(np.int32) if isinstance(v, float) else v
    return mx.array(words)


def mlx_decode_calls(tokens: int, *, gqa: int, num_kv_heads: int = 1, head_dim: int = 128,
                     arch_suffix: str = "g", seed: int = 0, return_output: bool = False):
    """Simulate MLX's decode attention (batch 1, one query token, float16) the way MLX dispatches
    it: (plan, [KernelCall, ...]) and, with ``return_output``, also (q, k, v, out)."""
    plan = mlx_decode_plan(tokens, gqa, head_dim, arch_suffix)
    rng = np.random.default_rng(seed)
    H, D = num_kv_heads * gqa, head_dim
    q = mx.array(rng.standard_normal((H, D)).astype(np.float32)).astype(mx.float16)
    k = mx.array(rng.standard_normal((num_kv_heads, tokens, D)).astype(np.float32)).astype(mx.float16)
    v = mx.array(rng.standard_normal((num_kv_heads, tokens, D)).astype(np.float32)).astype(mx.float16)
    scale = D ** -0.5
    T = [("T", mx.float16), ("D", D)]
    with trace() as t:
        if plan["kernel"] == "sdpa_vector":
            kern = metal_kernel("mlx_sdpa_vector", ["queries", "keys", "values", "params"], ["out"], _ONE_PASS,
                                header=_header(0))
            (out,) = kern(inputs=[q, k, v, _params(tokens, tokens * D, D, scale, gqa)], template=T,
                          grid=(H * 1024, 1, 1), threadgroup=(1024, 1, 1), output_shapes=[(H, D)],
                          output_dtypes=[mx.float16])
        else:
            nb = plan["blocks"]
            if plan["gqa_variant"]:
                kern = metal_kernel(f"mlx_sdpa_vector_2pass_1_gqa_{nb}", ["queries", "keys", "values", "params"],
                                    ["out", "sums", "maxs"], _PASS_1_GQA, header=_header(nb))
                template = T + [("G", gqa), ("HPT", GQA_HPT[gqa])]
            else:
                kern = metal_kernel(f"mlx_sdpa_vector_2pass_1_{nb}", ["queries", "keys", "values", "params"],
                                    ["out", "sums", "maxs"], _PASS_1, header=_header(nb))
                template = T
            part, sums, maxs = kern(inputs=[q, k, v, _params(tokens, tokens * D, D, scale)], template=template,
                                    grid=(32 * num_kv_heads, gqa, nb), threadgroup=(32, gqa, 1),
                                    output_shapes=[(H, nb, D), (H, nb), (H, nb)],
                                    output_dtypes=[mx.float16, mx.float32, mx.float32])
            kern2 = metal_kernel(f"mlx_sdpa_vector_2pass_2_{nb}", ["partials", "sums", "maxs", "params"], ["out"],
                                 _PASS_2, header=_header(nb))
            (out,) = kern2(inputs=[part, sums, maxs, _params(nb)], template=T, grid=(H * 1024, 1, 1),
                           threadgroup=(1024, 1, 1), output_shapes=[(H, D)], output_dtypes=[mx.float16])
        mx.eval(out)
    if return_output:
        return plan, list(t.calls), (q, k, v, out)
    return plan, list(t.calls)
