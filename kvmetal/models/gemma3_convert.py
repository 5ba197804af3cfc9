"""A Gemma-3 GGUF (llama.cpp's ``gemma3`` architecture) as an mlx-lm ``gemma3_text`` directory.

The tensors are dequantized by llama.cpp's ``gguf`` package (:mod:`kvmetal.models.gguf_numpy`),
which dequantizes every GGUF type (Q4_K, Q5_0, Q6_K, Q8_0, ...) to float32; they are
then written as float32/float16/bfloat16, or (``dtype="keep"``) quantized again with
MLX's affine format at the bits of their GGUF type and group size 32 (Q4_K -> 4 bits,
Q5_0 -> 5, Q6_K -> 6, Q8_0 -> 8; norms stay float). That re-quantization is not
lossless: Q4_K and Q8_0 groups are affine grids already, but ``mx.quantize`` picks its
own scale and bias from each group's range, and Q6_K's groups are 16 wide.

Two conventions differ between llama.cpp and mlx-lm (and Hugging Face):

* Gemma's RMSNorm multiplies by ``1 + weight``; llama.cpp's converter stores
  ``weight + 1`` (its ``norm_shift``), so every ``*norm.weight`` gets 1 subtracted here.
* llama.cpp does not write what it hard-codes for Gemma 3: every sixth layer global
  (``sliding_window_pattern`` 6), local RoPE base 10000, and the query scale
  1/sqrt(head_dim) (1/sqrt(hidden / heads) for the 62-layer 27B). Keys that newer
  files carry (``gemma3.attention.sliding_window_pattern``,
  ``gemma3.rope.freq_base_swa``) win over those defaults.
"""
from __future__ import annotations

from .gguf_base import GGUFError, _float32, module_path

ARCH = "gemma3"
# GGUF tensor name pieces -> mlx-lm gemma3_text module paths
TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# GGML type -> MLX affine bits for dtype="keep" (group size 32); float types stay float.
KEEP_BITS = {"Q4_0": 4, "Q4_1": 4, "Q4_K": 4, "Q5_0": 5, "Q5_1": 5, "Q5_K": 5, "Q6_K": 6, "Q8_0": 8, "Q8_K": 8,
             "Q3_K": 3, "Q2_K": 2}
FLOAT_TYPES = ("F32", "F16", "BF16")
KEEP_GROUP_SIZE = 32
KEEP_FLOAT_DTYPE = "bfloat16"  # Gemma's activations overflow float16 (mlx-lm clips its residuals)
# llama.cpp's hard-coded Gemma 3 values (src/llama-model.cpp, LLM_ARCH_GEMMA3)
SLIDING_WINDOW_PATTERN = 6
ROPE_LOCAL_BASE = 10000.0


def _get(meta: dict, key: str, default=None, *, required: bool = False):
    value = meta.get(f"{ARCH}.{key}")
    if value is None:
        if required:
            raise GGUFError(f"GGUF metadata has no {f'{ARCH}.{key}'!r}")
        return default
    return value


def gemma3_config(meta: dict) -> dict:
    """mlx-lm's gemma3_text ``config.json`` fields from the GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != ARCH:
        raise GGUFError(f"GGUF architecture {arch!r} is not {ARCH!r}")
    layers = int(_get(meta, "block_count", required=True))
    hidden = int(_get(meta, "embedding_length", required=True))
    heads = int(_get(meta, "attention.head_count", required=True))
    head_dim = int(_get(meta, "attention.key_length", hidden // heads))
    value_dim = int(_get(meta, "attention.value_length", head_dim))
    if value_dim != head_dim:
        raise GGUFError(f"GGUF gemma3 with key length {head_dim} and value length {value_dim} is not supported")
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if _get(meta, key):
            raise GGUFError(f"GGUF gemma3 with {key} is not supported (mlx-lm's gemma3_text has none)")
    config = {
        "model_type": "gemma3_text",
        "architectures": ["Gemma3ForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "intermediate_size": int(_get(meta, "feed_forward_length", required=True)),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_get(meta, "attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "rms_norm_eps": _float32(_get(meta, "attention.layer_norm_rms_epsilon", required=True)),
        "rope_theta": _float32(_get(meta, "rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": _float32(_get(meta, "rope.freq_base_swa", ROPE_LOCAL_BASE)),
        "query_pre_attn_scalar": (hidden // heads) if layers == 62 else head_dim,
        "sliding_window": int(_get(meta, "attention.sliding_window", required=True)),
        "sliding_window_pattern": int(_get(meta, "attention.sliding_window_pattern", SLIDING_WINDOW_PATTERN)),
        "max_position_embeddings": int(_get(meta, "context_length", required=True)),
        "rope_scaling": None,
    }
    if isinstance(meta.get(f"{ARCH}.attention.sliding_window_pattern"), list):
        raise GGUFError("GGUF gemma3 with a per-layer sliding_window_pattern list is not supported")
    scaling = _get(meta, "rope.scaling.type")
    if scaling not in (None, "none"):
        if scaling != "linear":
            raise GGUFError(f"GGUF gemma3 rope scaling {scaling!r} is not supported (supported: linear)")
        config["rope_scaling"] = {"rope_type": "linear",
                                  "factor": _float32(_get(meta, "rope.scaling.factor", required=True))}
    return config


def mlx_name(gguf_name: str) -> str:
    """``blk.3.attn_q_norm.weight`` -> ``model.layers.3.self_attn.q_norm.weight``."""
    return module_path(gguf_name, top_level=TOP_LEVEL, per_layer=PER_LAYER, family="gemma3_text")


def convert_weights(gguf_file, *, dtype: str) -> tuple[dict, dict]:
    """(mlx-lm weights, per-module quantization) from a gemma3 :class:`~kvmetal.models.gguf_numpy.GGUFFile`.

    Float dtypes dequantize everything (in float32, then cast); ``keep`` re-quantizes
    each quantized GGUF tensor to MLX affine at :data:`KEEP_BITS` and group 32."""
    import mlx.core as mx

    from .gguf_base import DTYPES

    if dtype not in DTYPES:
        raise GGUFError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    out, quantization = {}, {}
    for name, info in gguf_file.tensors.items():
        kind = info.type
        target = mlx_name(name)
        if kind not in FLOAT_TYPES and kind not in KEEP_BITS:
            raise GGUFError(f"GGUF tensor {name!r} has type {kind}, which this converter does not support "
                            f"(supported: {', '.join(FLOAT_TYPES + tuple(KEEP_BITS))})")
        values = mx.array(gguf_file.dequantize(name))
        if name.endswith("norm.weight"):
            values = values - 1.0  # llama.cpp stored Gemma's 1 + weight
        if dtype != "keep":
            out[target] = values.astype(getattr(mx, dtype))
        elif kind in KEEP_BITS and values.ndim == 2:
            bits = KEEP_BITS[kind]
            w, scales, biases = mx.quantize(values, group_size=KEEP_GROUP_SIZE, bits=bits)
            module = target[: -len(".weight")]
            float_dtype = getattr(mx, KEEP_FLOAT_DTYPE)
            out[target], out[f"{module}.scales"], out[f"{module}.biases"] = \
                w, scales.astype(float_dtype), biases.astype(float_dtype)
            quantization[module] = {"group_size": KEEP_GROUP_SIZE, "bits": bits}
        else:
            out[target] = values.astype(getattr(mx, KEEP_FLOAT_DTYPE))
        mx.eval(out[target])
    return out, quantization


def convert_gemma3(path, *, dtype: str, header=None) -> tuple[dict, dict, dict, dict, dict]:
    """(config, tokenizer.json, tokenizer_config.json, weights, quantization) for a gemma3 GGUF
    (``header``: its :func:`~kvmetal.models.gguf_header.read_header`, when already read)."""
    from .gguf_numpy import GGUFFile
    from .spm_tokenizer import spm_tokenizer_files

    gguf_file = GGUFFile(path, header=header)
    config = gemma3_config(gguf_file.meta)
    tokenizer, tokenizer_config, token_ids = spm_tokenizer_files(gguf_file.meta)
    weights, quantization = convert_weights(gguf_file, dtype=dtype)
    config.update(token_ids)
    return config, tokenizer, tokenizer_config, weights, quantization
