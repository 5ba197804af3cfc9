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
from .traffic import fix_function_constants, mlx_sdpa_header

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
    return mlx_sdpa_header({"blocks": blocks})


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


# ----------------------------------------------------------------------------- steel attention (prefill)

def mlx_include_root():
    import pathlib

    return pathlib.Path(mx.__file__).parent / "include"


STEEL_HEADER = "mlx/backend/metal/kernels/steel/attn/kernels/steel_attention.h"

# What the simulator's MSL runtime lacks of Metal's <metal_type_traits>, written here from the
# C++ standard's definitions (the steel headers use them through namespace metal).
_STEEL_PRELUDE = """
namespace metal {
using namespace ::metal;
template <bool B> struct bool_constant { static constexpr bool value = B; };
template <class T> struct remove_cv { using type = T; };
template <class T> struct remove_cv<const T> { using type = T; };
template <class T> struct remove_cv<volatile T> { using type = T; };
template <class T> struct remove_cv<const volatile T> { using type = T; };
template <class T> using remove_cv_t = typename remove_cv<T>::type;
template <class T> using remove_addrspace_t = remove_cv_t<T>;
template <class T> struct is_integral : bool_constant<false> {};
#define KMSL_INTEGRAL(t) template <> struct is_integral<t> : bool_constant<true> {};
KMSL_INTEGRAL(bool) KMSL_INTEGRAL(char) KMSL_INTEGRAL(signed char) KMSL_INTEGRAL(unsigned char)
KMSL_INTEGRAL(short) KMSL_INTEGRAL(unsigned short) KMSL_INTEGRAL(int) KMSL_INTEGRAL(unsigned int)
KMSL_INTEGRAL(long) KMSL_INTEGRAL(unsigned long) KMSL_INTEGRAL(long long) KMSL_INTEGRAL(unsigned long long)
template <bool B, class T, class F> struct conditional { using type = T; };
template <class T, class F> struct conditional<false, T, F> { using type = F; };
template <bool B, class T, class F> using conditional_t = typename conditional<B, T, F>::type;
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { using type = T; };
template <bool B, class T = void> using enable_if_t = typename enable_if<B, T>::type;
template <class A, class B> struct is_same : bool_constant<false> {};
template <class A> struct is_same<A, A> : bool_constant<true> {};
}
template <class A, class B> constexpr bool is_same_v = metal::is_same<A, B>::value;
"""


def _inline_includes(root, rel: str, seen: list) -> str:
    path = root / rel
    if path in seen:
        return ""
    seen.append(path)
    out = []
    for line in path.read_text().splitlines():
        m = re.match(r'\s*#\s*include\s*"(mlx/[^"]+)"', line)
        if m:
            out.append(_inline_includes(root, m.group(1), seen))
        elif not re.match(r"\s*#\s*pragma once", line):
            out.append(line)
    return "\n".join(out)


def steel_header(*, causal: bool, align_q: bool, align_k: bool) -> str:
    """MLX's steel attention header with its includes inlined, read from the installed MLX at run
    time (never copied into this project), adapted to the simulator: function constants fixed,
    the params structs bound from device memory (the harness has no constant-space bytes), and
    one pointer_element specialisation for the simulator's pointer type in place of Metal's
    per-address-space ones (which coincide there)."""
    text = _inline_includes(mlx_include_root(), STEEL_HEADER, [])
    consts = {"align_Q": align_q, "align_K": align_k, "has_mask": False, "do_causal": causal, "has_sinks": False,
              "save_lse": False}
    text = fix_function_constants(text, consts, strict=True)
    text = text.replace("const constant AttnParams* params", "const device AttnParams* params")
    text = text.replace("const constant AttnMaskParams* mask_params", "const device AttnMaskParams* mask_params")
    for space in ("device", "constant", "threadgroup"):
        text = text.replace(f"template <typename T>\nstruct pointer_element<{space} T*> {{\n"
                            f"  using type = remove_cv_t<T>;\n}};\n", "")
    text = text.replace("using pointer_element_t = typename pointer_element<remove_cv_t<T>>::type;",
                        "using pointer_element_t = typename pointer_element<remove_cv_t<T>>::type;\n"
                        "template <class T, int AS> struct pointer_element<::kmsl::dptr<T, AS>> "
                        "{ using type = remove_cv_t<T>; };", 1)
    return _STEEL_PRELUDE + text


_STEEL_BODY = """
attention<T, BQ, BK, BD, BD, WM, WN, T, float>(
    Q, K, V, O, reinterpret_cast<const device AttnParams*>(params),
    reinterpret_cast<const device AttnMaskParams*>(params), Q, Q, reinterpret_cast<device float*>(O),
    thread_index_in_simdgroup, simdgroup_index_in_threadgroup, threadgroup_position_in_grid,
    thread_position_in_threadgroup);
"""

# MLX's tile choice for its (non-NAX) steel attention at D 128 (scaled_dot_product_attention.cpp):
# bq 32, bk 16 (32 below D 128), wm 4, wn 1.
STEEL_TILES = {"BQ": 32, "BK": 16, "WM": 4, "WN": 1}


def mlx_steel_attention_call(tokens: int, *, gqa: int, num_kv_heads: int = 1, head_dim: int = 128, seed: int = 0,
                             return_output: bool = False):
    """Simulate MLX's steel attention on one causal prefill of ``tokens`` queries over as many
    keys (batch 1, float16), launched as MLX launches it: the KernelCall (and (q, k, v, out))."""
    bq, bk, wm, wn = (STEEL_TILES[k] for k in ("BQ", "BK", "WM", "WN"))
    if head_dim < 128:
        bk = 32
    H, D, L = num_kv_heads * gqa, head_dim, tokens
    rng = np.random.default_rng(seed)
    q = mx.array(rng.standard_normal((1, H, L, D)).astype(np.float32)).astype(mx.float16)
    k = mx.array(rng.standard_normal((1, num_kv_heads, L, D)).astype(np.float32)).astype(mx.float16)
    v = mx.array(rng.standard_normal((1, num_kv_heads, L, D)).astype(np.float32)).astype(mx.float16)
    nq, nk = -(-L // bq), -(-L // bk)
    words = np.zeros(38, np.int32)  # AttnParams: 14 x 4-byte fields, then 12 int64 strides
    words[:14] = [1, H, D, L, L, gqa, 0, nq, nk, L // bq, L // bk, L - (L // bq) * bq, L - (L // bk) * bk, 0]
    words[6] = np.array(D ** -0.5, np.float32).view(np.int32)
    strides = np.array([H * L * D, L * D, D, num_kv_heads * L * D, L * D, D, num_kv_heads * L * D, L * D, D,
                        H * L * D, L * D, D], np.int64)
    words[14:] = strides.view(np.int32)
    header = steel_header(causal=True, align_q=L % bq == 0, align_k=L % bk == 0)
    kern = metal_kernel(f"mlx_steel_attention_{int(L % bq == 0)}{int(L % bk == 0)}", ["Q", "K", "V", "params"], ["O"],
                        _STEEL_BODY, header=header)
    with trace() as t:
        (out,) = kern(inputs=[q, k, v, mx.array(words)],
                      template=[("T", mx.float16), ("BQ", bq), ("BK", bk), ("BD", D), ("WM", wm), ("WN", wn)],
                      grid=(32 * nq, wm * H, wn), threadgroup=(32, wm, wn), output_shapes=[(1, H, L, D)],
                      output_dtypes=[mx.float16])
        mx.eval(out)
    call = t.calls[0]
    if return_output:
        return call, (q, k, v, out)
    return call
