"""GGUF (llama.cpp's file format) to an mlx-lm model directory.

``mx.load(path, return_metadata=True)`` reads a GGUF file: Q4_0, Q4_1 and Q8_0 tensors
arrive as MLX affine quantization with group size 32 (``name.weight`` uint32 plus
``name.scales`` and ``name.biases``), some other types as float16, and the metadata as a
dict. This module renames the tensors to mlx-lm's llama names, writes ``config.json``
(with per-layer ``quantization`` where weights stay quantized), ``model.safetensors``,
and a Hugging Face ``tokenizer.json`` / ``tokenizer_config.json`` built from the GGUF
vocabulary, merges, special tokens and chat template.

llama.cpp stores llama's Q and K projections permuted for interleaved ("traditional")
RoPE; mlx-lm's llama with ``rope_traditional: true`` applies RoPE the same way, so the
tensors are used as stored (no un-permuting).

Supported architectures: llama with a byte-level BPE ("gpt2") tokenizer (here), and
gemma3 (K-quants read through llama.cpp's ``gguf`` package, a SentencePiece vocabulary;
:mod:`kvmetal.models.gemma3_convert`). Anything else raises :class:`GGUFError` with one
line naming what is unsupported.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

from .gguf_base import (_GGUF_ARRAY, _GGUF_SCALARS, _GGUF_STRING, DTYPES, GGUFError, _float32,  # noqa: F401
                        _scalar, hf_tokenizer_config, module_path)
from .gguf_header import read_header

ARCHITECTURES = ("gemma3", "llama")

# GGUF tensor name pieces -> mlx-lm llama module paths
_TOP_LEVEL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_PER_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
# The group size of every quantized type mx.load returns (GGUF blocks of 32 values).
GGUF_GROUP_SIZE = 32

# tokenizer.ggml.pre -> how the text is split before BPE (llama.cpp's names). The split
# regex is the one the Hugging Face tokenizers of llama 3 use.
_LLAMA3_SPLIT = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
PRE_TOKENIZERS = ("default", "gpt2", "smollm", "llama-bpe", "llama3")

# GGUF token types (llama.cpp's llama_token_type)
_CONTROL, _USER_DEFINED = 3, 4


def gguf_architecture(path: str | os.PathLike) -> str:
    """``general.architecture`` from the file's header alone (no tensor is read; the whole
    header is checked against the file, :func:`kvmetal.models.gguf_header.read_header`)."""
    return _architecture(read_header(path))


def _architecture(header) -> str:
    arch = header.meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{header.path.name}: GGUF metadata has no 'general.architecture'"
                        + ("" if arch is None else " string"))
    return arch


def read_gguf(path: str | os.PathLike) -> tuple[dict, dict]:
    """(weights, metadata) as ``mx.load`` returns them, with one-line errors. The header is
    checked against the file first (MLX's reader trusts it: a wrong count can segfault)."""
    import mlx.core as mx

    path = Path(path)
    read_header(path)
    try:
        weights, meta = mx.load(str(path), return_metadata=True)
    except Exception as exc:  # MLX's own message names the tensor type it cannot read
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GGUFError(f"{path.name}: MLX cannot read this GGUF ({reason})") from None
    return weights, meta


def llama_config(meta: dict) -> dict:
    """mlx-lm's llama ``config.json`` fields from the GGUF metadata."""
    arch = _scalar(meta, "general.architecture")
    if arch != "llama":
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (supported: llama)")
    heads = int(_scalar(meta, "llama.attention.head_count"))
    hidden = int(_scalar(meta, "llama.embedding_length"))
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": hidden,
        "num_hidden_layers": int(_scalar(meta, "llama.block_count")),
        "intermediate_size": int(_scalar(meta, "llama.feed_forward_length")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_scalar(meta, "llama.attention.head_count_kv", required=False, default=heads)),
        "rms_norm_eps": _float32(_scalar(meta, "llama.attention.layer_norm_rms_epsilon")),
        "rope_theta": _float32(_scalar(meta, "llama.rope.freq_base", required=False, default=10000.0)),
        "max_position_embeddings": int(_scalar(meta, "llama.context_length")),
        "rope_traditional": True,  # GGUF's permuted Q/K (see the module docstring)
    }
    head_dim = _scalar(meta, "llama.attention.key_length", required=False)
    if head_dim is not None and int(head_dim) != hidden // heads:
        config["head_dim"] = int(head_dim)
    if _scalar(meta, "llama.rope.scaling.type", required=False) not in (None, "none"):
        raise GGUFError(f"GGUF rope scaling {_scalar(meta, 'llama.rope.scaling.type')!r} is not supported")
    if _scalar(meta, "llama.expert_count", required=False):
        raise GGUFError("GGUF mixture-of-experts llama is not supported")
    return config


def _mlx_name(gguf_name: str) -> str:
    """``blk.3.attn_q.weight`` -> ``model.layers.3.self_attn.q_proj.weight``."""
    return module_path(gguf_name, top_level=_TOP_LEVEL, per_layer=_PER_LAYER, family="llama")


def _quantized_bits(weight, scales) -> int:
    """Bits of an MLX affine tensor with GGUF's group size 32."""
    in_features = scales.shape[-1] * GGUF_GROUP_SIZE
    bits = weight.shape[-1] * 32 // in_features
    if bits * in_features != weight.shape[-1] * 32 or bits not in (2, 3, 4, 5, 6, 8):
        raise GGUFError(f"quantized tensor with shape {weight.shape} and scales {scales.shape} does not fit "
                        f"group size {GGUF_GROUP_SIZE}")
    return bits


def convert_weights(weights: dict, *, dtype: str) -> tuple[dict, dict]:
    """(mlx-lm weights, per-module quantization) from ``mx.load``'s GGUF tensors.

    ``dtype="keep"`` keeps quantized tensors quantized (and float ones as loaded);
    a float dtype dequantizes everything to it (in float32, then casts).
    """
    import mlx.core as mx

    if dtype not in DTYPES:
        raise GGUFError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    target = None if dtype == "keep" else getattr(mx, dtype)
    out, quantization = {}, {}
    for name, array in weights.items():
        if name.endswith((".scales", ".biases")):
            continue
        mlx_name = _mlx_name(name)
        stem = name[: -len(".weight")] if name.endswith(".weight") else None
        if stem is not None and f"{stem}.scales" in weights:
            scales, biases = weights[f"{stem}.scales"], weights.get(f"{stem}.biases")
            if biases is None:
                raise GGUFError(f"GGUF tensor {name!r} has scales but no biases")
            bits = _quantized_bits(array, scales)
            module = mlx_name[: -len(".weight")]
            if target is None:
                out[mlx_name], out[f"{module}.scales"], out[f"{module}.biases"] = array, scales, biases
                quantization[module] = {"group_size": GGUF_GROUP_SIZE, "bits": bits}
            else:
                full = mx.dequantize(array, scales.astype(mx.float32), biases.astype(mx.float32),
                                     group_size=GGUF_GROUP_SIZE, bits=bits)
                out[mlx_name] = full.astype(target)
            continue
        if not mx.issubdtype(array.dtype, mx.floating):
            raise GGUFError(f"GGUF tensor {name!r} has dtype {array.dtype} that MLX did not dequantize")
        out[mlx_name] = array if target is None else array.astype(target)
    return out, quantization


def _quantization_config(quantization: dict) -> dict | None:
    """mlx-lm's ``quantization`` entry: the most common (bits, group) as the default,
    every other quantized module listed by path; unquantized layers need no entry (mlx-lm
    quantizes only modules whose ``.scales`` are in the weights)."""
    if not quantization:
        return None
    counts: dict = {}
    for q in quantization.values():
        key = (q["bits"], q["group_size"])
        counts[key] = counts.get(key, 0) + 1
    bits, group = max(counts, key=counts.get)
    config = {"group_size": group, "bits": bits}
    for module, q in sorted(quantization.items()):
        if (q["bits"], q["group_size"]) != (bits, group):
            config[module] = dict(q)
    return config


def tokenizer_files(meta: dict) -> tuple[dict, dict, dict]:
    """(tokenizer.json, tokenizer_config.json, config.json token ids) from the GGUF metadata."""
    model = _scalar(meta, "tokenizer.ggml.model")
    if model != "gpt2":
        raise GGUFError(f"GGUF tokenizer {model!r} is not supported (supported: gpt2, i.e. byte-level BPE)")
    tokens = meta.get("tokenizer.ggml.tokens")
    merges = meta.get("tokenizer.ggml.merges")
    if not tokens:
        raise GGUFError("GGUF metadata has no 'tokenizer.ggml.tokens'")
    if not merges:
        raise GGUFError("GGUF metadata has no 'tokenizer.ggml.merges'")
    pre = _scalar(meta, "tokenizer.ggml.pre", required=False, default="default")
    if pre not in PRE_TOKENIZERS:
        raise GGUFError(f"GGUF pre-tokenizer {pre!r} is not supported (supported: {', '.join(PRE_TOKENIZERS)})")
    types = _scalar(meta, "tokenizer.ggml.token_type", required=False, default=None) or [1] * len(tokens)
    if len(types) != len(tokens):
        raise GGUFError(f"GGUF has {len(types)} token types for {len(tokens)} tokens")

    def token_id(key):
        value = _scalar(meta, f"tokenizer.ggml.{key}", required=False)
        return None if value is None else int(value)

    bos, eos, pad, unk = token_id("bos_token_id"), token_id("eos_token_id"), token_id("padding_token_id"), \
        token_id("unknown_token_id")
    add_bos = bool(_scalar(meta, "tokenizer.ggml.add_bos_token", required=False, default=False))
    add_eos = bool(_scalar(meta, "tokenizer.ggml.add_eos_token", required=False, default=False))
    if add_bos and bos is None:
        raise GGUFError("GGUF asks to add a bos token but has no 'tokenizer.ggml.bos_token_id'")
    for label, value in (("bos", bos), ("eos", eos), ("padding", pad), ("unknown", unk)):
        if value is not None and not 0 <= value < len(tokens):
            raise GGUFError(f"GGUF {label} token id {value} is outside the vocabulary of {len(tokens)}")

    specials = {i for i, t in enumerate(types) if int(t) in (_CONTROL, _USER_DEFINED)}
    specials |= {i for i in (bos, eos, pad, unk) if i is not None}
    added = [{"id": i, "content": tokens[i], "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": int(types[i]) != _USER_DEFINED or i in (bos, eos, pad, unk)}
             for i in sorted(specials)]

    # GPT-2's split regex is built into ByteLevel (use_regex); llama 3 splits first with its own.
    if pre in ("llama-bpe", "llama3"):
        pre_tokenizers = [{"type": "Split", "pattern": {"Regex": _LLAMA3_SPLIT}, "behavior": "Isolated",
                           "invert": False},
                          {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]
    else:
        pre_tokenizers = [{"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]
    if pre == "smollm":  # SmolLM splits digits one by one before the GPT-2 regex
        pre_tokenizers.insert(0, {"type": "Digits", "individual_digits": True})

    def template(single: bool) -> list:
        seq = [] if single else [{"Sequence": {"id": "B", "type_id": 1}}]
        pieces = [{"Sequence": {"id": "A", "type_id": 0}}]
        if add_bos:
            pieces.insert(0, {"SpecialToken": {"id": tokens[bos], "type_id": 0}})
        if add_eos and eos is not None:
            pieces.append({"SpecialToken": {"id": tokens[eos], "type_id": 0}})
        return pieces + seq

    post = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    if add_bos or add_eos:
        used = [i for i, flag in ((bos, add_bos), (eos, add_eos)) if flag and i is not None]
        post = {"type": "TemplateProcessing", "single": template(True), "pair": template(False),
                "special_tokens": {tokens[i]: {"id": tokens[i], "ids": [i], "tokens": [tokens[i]]} for i in used}}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": pre_tokenizers},
        "post_processor": post,
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None if unk is None else tokens[unk],
                  "continuing_subword_prefix": None, "end_of_word_suffix": None, "fuse_unk": False,
                  "byte_fallback": False, "ignore_merges": False,
                  "vocab": {t: i for i, t in enumerate(tokens)},
                  "merges": list(merges)},
    }
    tokenizer_config, ids = hf_tokenizer_config(meta, tokens, arch="llama", add_bos=add_bos, add_eos=add_eos,
                                                bos=bos, eos=eos, pad=pad, unk=unk)
    return tokenizer, tokenizer_config, ids


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "keep",
                 overwrite: bool = False) -> Path:
    """Write an mlx-lm model directory for a llama or gemma3 GGUF file; returns ``out_dir``.

    The directory is written in a temporary sibling and renamed into place, so a failed
    or interrupted conversion leaves nothing at ``out_dir``. The header is checked against
    the file and the sibling created before any weight is converted.
    """
    if dtype not in DTYPES:
        raise GGUFError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise GGUFError(f"{str(out_dir)!r} already exists (overwrite=True replaces it)")
    header = read_header(gguf_path)  # checked against the file before any reader trusts it
    arch = _architecture(header)  # the architecture first: the clearest error for another model
    if arch not in ARCHITECTURES:
        raise GGUFError(f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHITECTURES)})")
    # Where the result goes, before any weight is converted: the temporary sibling it is
    # written in and renamed from.
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    except OSError as exc:
        raise GGUFError(f"cannot create {str(out_dir)!r}: {exc.strerror or exc}") from None
    try:
        _convert_into(tmp, out_dir, gguf_path, header, arch, dtype=dtype)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir


def _convert_into(tmp: Path, out_dir: Path, gguf_path, header, arch: str, *, dtype: str) -> None:
    import mlx.core as mx

    if arch == "gemma3":
        from .gemma3_convert import convert_gemma3

        config, tokenizer, tokenizer_config, mlx_weights, quantization = convert_gemma3(gguf_path, dtype=dtype,
                                                                                        header=header)
    else:
        weights, meta = read_gguf(gguf_path)
        config = llama_config(meta)
        tokenizer, tokenizer_config, token_ids = tokenizer_files(meta)
        mlx_weights, quantization = convert_weights(weights, dtype=dtype)
        config.update(token_ids)
    missing = [n for n in ("model.embed_tokens.weight", "model.norm.weight",
                           "model.layers.0.self_attn.q_proj.weight") if n not in mlx_weights]
    if missing:
        raise GGUFError(f"GGUF has no tensor for {missing[0]!r}")
    config["vocab_size"] = int(mlx_weights["model.embed_tokens.weight"].shape[0])
    if config["vocab_size"] != len(tokenizer["model"]["vocab"]):
        raise GGUFError(f"GGUF embedding has {config['vocab_size']} rows for {len(tokenizer['model']['vocab'])} "
                        f"tokens")
    config["tie_word_embeddings"] = "lm_head.weight" not in mlx_weights
    quant_config = _quantization_config(quantization)
    if quant_config is not None:
        config["quantization"] = quant_config
    float_dtypes = {str(a.dtype).rsplit(".", 1)[-1] for a in mlx_weights.values()
                    if mx.issubdtype(a.dtype, mx.floating)}
    config["torch_dtype"] = dtype if dtype != "keep" else ("float16" if "float16" in float_dtypes else
                                                           sorted(float_dtypes)[0])

    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the result is an ordinary directory
    mx.save_safetensors(str(tmp / "model.safetensors"), mlx_weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False) + "\n", encoding="utf-8")
    (tmp / "tokenizer_config.json").write_text(json.dumps(tokenizer_config, indent=2, ensure_ascii=False) + "\n",
                                               encoding="utf-8")
    if out_dir.exists():  # overwrite: move the old one aside only once the new one is complete
        shutil.rmtree(out_dir)
    os.replace(tmp, out_dir)
