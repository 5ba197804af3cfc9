"""KV-cache memory and decode-bandwidth arithmetic: the ``kvmetal budget`` command.

Decode reads every cached K and V byte once per generated token, so two numbers
decide what a machine can serve: the bytes the cache holds at a context and
batch (does it fit next to the weights?) and those bytes divided by memory
bandwidth (the floor on time per token). Per token and layer the cache holds::

    num_kv_heads * (k_row_bytes + v_row_bytes)
    float row:      head_dim * dtype_bytes
    quantized row:  head_dim * bits / 8  +  2 * (head_dim / group_size) * scale_bytes

(scales and biases have the cache's float dtype; see ``kvmetal.quant``).

Sliding-window layers (Gemma 2/3, gpt-oss, Mistral v0.1) hold at most their window,
so at long contexts only the full-attention layers grow. ``--tp N`` reports one device of
N tensor-parallel ranks (mlx-lm's ``model.shard``): its kv heads and its share of weights.

Units: bytes are printed in decimal GB and binary GiB; ``--memory`` is the
unified memory as sold (a "64GB" Mac has 64 GiB); bandwidth is decimal GB/s as
Apple publishes it. Context lengths accept K/M suffixes (32K = 32768 tokens).

The K/V format: ``--kv`` names it in one word (f16, bf16, f32, k8v4, q8 ...), or the K/V
format flags of ``kvmetal generate``, ``serve`` and ``bench -m`` give it (``--kv-bits``,
``--k-bits``, ``--v-bits``, ``--kv-group-size``, ``--k-group-size``, ``--v-group-size``:
``kvmetal.kv_format.add_format_flags``), with their meaning, defaults and errors: the group
size is ``kv_format.default_group_size`` (32) unless given, as serve allocates it.

    kvmetal budget --model llama-3-8b --context 32K --kv f16
    kvmetal budget --model path/to/config.json --context 128K --kv k8v4 --chip m4-max
    kvmetal budget --model qwen2.5-7b --context 64K --batch 4 --memory 64 --bandwidth 400 --json
    kvmetal budget --model gemma-3-12b --context 128K --kv k8v4 --chip m3-ultra --tp 2
    kvmetal budget --model default --context 8K --kv-bits 4 --k-bits 8     # SmolLM2, as serve runs it
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import textwrap
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from . import quant
from .chips import CHIPS
from .kv_format import FLOAT_BYTES, KVFormat, default_group_size, largest_group_size  # noqa: F401  (re-exported)
from .kv_format import FLOAT_NAMES as _FLOAT_NAMES
from .kv_format import FORMAT_FLAGS_HELP, KVFormatError, add_format_flags, format_from_args

OP = "budget"
GIB = 1 << 30
GB = 1e9


def _fail(message: str, error=ValueError):
    raise error(f"[{OP}] {message}")


# ----------------------------------------------------------------------------- model shapes

@dataclass(frozen=True)
class ModelShape:
    """What the KV arithmetic needs from a model (and what estimates its weights)."""

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    num_heads: int = 0
    hidden_size: int = 0
    intermediate_size: int = 0
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    num_experts: int = 1
    moe_intermediate_size: int = 0
    weight_bits: float = 16.0          # bits per weight incl. quantization scales
    weights_bytes: int | None = None   # exact, when read from safetensors files
    source: str = "preset"
    sliding_window: int | None = None  # tokens a sliding-window layer attends to
    num_sliding_layers: int = 0        # layers that attend only to the last sliding_window tokens
    max_position_embeddings: int | None = None  # the context the model was trained for

    @property
    def num_full_layers(self) -> int:
        return self.num_layers - self.num_sliding_layers

    def param_count(self) -> int:
        """Parameters from the shape: embeddings, attention projections, gated MLP (x experts)."""
        if not (self.hidden_size and self.vocab_size and self.num_heads):
            return 0
        h, hd = self.hidden_size, self.head_dim
        attn = h * self.num_heads * hd * 2 + h * self.num_kv_heads * hd * 2     # q, o + k, v
        inter = self.moe_intermediate_size or self.intermediate_size
        mlp = 3 * h * inter * self.num_experts                                  # gate, up, down
        norms = 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * (attn + mlp + norms) + embed + h

    def estimated_weights_bytes(self) -> int:
        if self.weights_bytes is not None:
            return self.weights_bytes
        return int(self.param_count() * self.weight_bits / 8)


def _preset(name, layers, kv_heads, head_dim, heads, hidden, inter, vocab, tied, experts=1, window=None,
            pattern=None, context=None):
    """``window``/``pattern``: every ``pattern``-th layer is global, the others see ``window`` tokens.
    ``context``: the config's max_position_embeddings."""
    sliding = layers - layers // pattern if window else 0
    return ModelShape(name, layers, kv_heads, head_dim, heads, hidden, inter, vocab, tied, experts,
                      sliding_window=window, num_sliding_layers=sliding, max_position_embeddings=context)


# Shapes from the models' published config.json files (weights in 16-bit).
PRESETS = {p.name: p for p in (
    _preset("llama-3-8b", 32, 8, 128, 32, 4096, 14336, 128256, False, context=8192),
    _preset("llama-3-70b", 80, 8, 128, 64, 8192, 28672, 128256, False, context=8192),
    _preset("llama-3.2-1b", 16, 8, 64, 32, 2048, 8192, 128256, True, context=131072),
    _preset("llama-3.2-3b", 28, 8, 128, 24, 3072, 8192, 128256, True, context=131072),
    _preset("mistral-7b", 32, 8, 128, 32, 4096, 14336, 32000, False, context=32768),
    _preset("mixtral-8x7b", 32, 8, 128, 32, 4096, 14336, 32000, False, experts=8, context=32768),
    _preset("qwen2.5-0.5b", 24, 2, 64, 14, 896, 4864, 151936, True, context=32768),
    _preset("qwen2.5-7b", 28, 4, 128, 28, 3584, 18944, 152064, False, context=32768),
    _preset("qwen2.5-14b", 48, 8, 128, 40, 5120, 13824, 152064, False, context=32768),
    _preset("qwen2.5-32b", 64, 8, 128, 40, 5120, 27648, 152064, False, context=32768),
    _preset("qwen2.5-72b", 80, 8, 128, 64, 8192, 29568, 152064, False, context=32768),
    _preset("qwen3-8b", 36, 8, 128, 32, 4096, 12288, 151936, False, context=40960),
    _preset("gemma-2-2b", 26, 4, 256, 8, 2304, 9216, 256000, True, window=4096, pattern=2, context=8192),
    _preset("gemma-2-9b", 42, 8, 256, 16, 3584, 14336, 256000, True, window=4096, pattern=2, context=8192),
    _preset("gemma-2-27b", 46, 16, 128, 32, 4608, 36864, 256000, True, window=4096, pattern=2, context=8192),
    _preset("gemma-3-270m", 18, 1, 256, 4, 640, 2048, 262144, True, window=512, pattern=6, context=32768),
    _preset("gemma-3-1b", 26, 1, 256, 4, 1152, 6912, 262144, True, window=512, pattern=6, context=32768),
    _preset("gemma-3-4b", 34, 4, 256, 8, 2560, 10240, 262208, True, window=1024, pattern=6, context=131072),
    _preset("gemma-3-12b", 48, 8, 256, 16, 3840, 15360, 262208, True, window=1024, pattern=6, context=131072),
    _preset("gemma-3-27b", 62, 16, 128, 32, 5376, 21504, 262208, True, window=1024, pattern=6, context=131072),
    _preset("phi-3-mini", 32, 32, 96, 32, 3072, 8192, 32064, False, context=4096),
)}
# Same shapes as a preset, a longer context: name -> (preset, max_position_embeddings).
ALIASES = {"llama-3.1-8b": ("llama-3-8b", 131072), "llama-3.1-70b": ("llama-3-70b", 131072),
           "llama-3.3-70b": ("llama-3-70b", 131072)}


def _first(cfg: dict, *keys, default=None):
    for key in keys:
        if cfg.get(key) is not None:
            return cfg[key]
    return default


def shape_from_config(cfg: dict, *, name: str = "config", weights_bytes: int | None = None) -> ModelShape:
    """A :class:`ModelShape` from an mlx-lm / Hugging Face ``config.json`` dict."""
    if not isinstance(cfg, dict):
        _fail(f"config must be a JSON object, got {type(cfg).__name__}", TypeError)
    if isinstance(cfg.get("text_config"), dict):       # multimodal wrappers keep the LM inside
        cfg = {**cfg, **cfg["text_config"]}
    if cfg.get("kv_lora_rank"):
        _fail(f"{name}: multi-head latent attention (kv_lora_rank) caches a compressed latent, "
              f"not per-head K/V; this arithmetic does not cover it")
    layers = _first(cfg, "num_hidden_layers", "n_layer", "n_layers", "num_layers")
    heads = _first(cfg, "num_attention_heads", "n_head", "n_heads")
    hidden = _first(cfg, "hidden_size", "n_embd", "d_model", "dim", default=0)
    if layers is None or heads is None:
        _fail(f"{name}: config needs num_hidden_layers and num_attention_heads")
    kv_heads = _first(cfg, "num_key_value_heads", "n_kv_heads", "num_kv_heads", "multi_query_group_num",
                      default=heads)
    head_dim = _first(cfg, "head_dim")
    if head_dim is None:
        if not hidden:
            _fail(f"{name}: config needs head_dim or hidden_size")
        head_dim = hidden // heads
    window, sliding = _sliding_layers(cfg, int(layers))
    q = cfg.get("quantization") or cfg.get("quantization_config") or {}
    weight_bits = 16.0
    if isinstance(q, dict) and q.get("bits"):
        # mlx-lm affine weights: bits per value + a 16-bit scale and bias per group. 64 is the
        # *weight* group size mlx-lm quantizes with when none is given (mlx_lm.utils.quantize_model,
        # mx.quantize's affine default), not the K/V cache's (kv_format.default_group_size).
        weight_bits = q["bits"] + 32 / q.get("group_size", 64)
    elif cfg.get("torch_dtype") == "float32":
        weight_bits = 32.0
    return ModelShape(
        name=name,
        num_layers=int(layers),
        num_kv_heads=int(kv_heads),
        head_dim=int(head_dim),
        num_heads=int(heads),
        hidden_size=int(hidden),
        intermediate_size=int(_first(cfg, "intermediate_size", "ffn_dim", "n_inner", default=4 * hidden)),
        vocab_size=int(_first(cfg, "vocab_size", default=0)),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        num_experts=int(_first(cfg, "num_local_experts", "num_experts", "n_routed_experts", default=1)),
        moe_intermediate_size=int(_first(cfg, "moe_intermediate_size", default=0)),
        weight_bits=float(weight_bits),
        weights_bytes=weights_bytes,
        source="config",
        sliding_window=window,
        num_sliding_layers=sliding,
        max_position_embeddings=_first(cfg, "max_position_embeddings", "n_positions", "max_seq_len"),
    )


def _sliding_layers(cfg: dict, layers: int) -> tuple:
    """(window, number of sliding-window layers) from a config, as the model families define them."""
    window = cfg.get("sliding_window")
    model_type = str(cfg.get("model_type", ""))
    if not window:
        return None, 0
    if isinstance(cfg.get("layer_types"), list):          # gpt-oss, newer Gemma/Qwen configs
        return int(window), sum(t == "sliding_attention" for t in cfg["layer_types"])
    if model_type.startswith("gemma3"):                   # every sliding_window_pattern-th layer is global
        pattern = int(cfg.get("sliding_window_pattern") or 6)
        return int(window), layers - layers // pattern
    if model_type.startswith("gemma2"):                   # local and global layers alternate
        return int(window), layers - layers // 2
    if model_type == "mistral" or cfg.get("use_sliding_window"):
        # Mistral v0.1 windows every layer; Qwen2 only with use_sliding_window, from max_window_layers on
        first = int(cfg.get("max_window_layers") or 0) if cfg.get("use_sliding_window") else 0
        return int(window), max(layers - first, 0)
    return None, 0


def _named_model(spec: str) -> ModelShape | None:
    """A named model of ``kvmetal generate``/``serve`` (``default``, ``smollm2``, ``gemma3``,
    optionally ``NAME:DTYPE``) from its GGUF header, as those commands would convert it;
    None when ``spec`` is no such name (or a local path of that name exists)."""
    from .models.named import DEFAULT, MODELS, ModelMissing, named_config

    name, _, dtype = spec.partition(":")
    name = DEFAULT if name.lower() == "default" else name.lower()
    if name not in MODELS or Path(spec).exists():
        return None
    try:
        cfg = named_config(name, dtype or None)
    except ModelMissing as exc:
        _fail(str(exc))
    except ValueError as exc:  # a bad dtype, a damaged GGUF (one line either way)
        _fail(f"--model {spec!r}: {str(exc).removeprefix('[named_config] ')}")
    return shape_from_config(cfg, name=MODELS[name].name)  # weights estimated from the config


def load_model(spec: str) -> ModelShape:
    """A preset name, a named model (``default``/``smollm2``/``gemma3``, read from its GGUF
    header), a ``config.json`` path, or a model directory holding one.

    For a directory with ``*.safetensors`` files the weights are their total size.
    """
    named = _named_model(spec)
    if named is not None:
        return named
    key = spec.lower()
    if key in ALIASES:
        preset, context = ALIASES[key]
        return replace(PRESETS[preset], name=key, max_position_embeddings=context)
    if key in PRESETS:
        return PRESETS[key]
    path = Path(spec)
    if path.is_dir():
        config_path = path / "config.json"
        tensors = sorted(path.glob("*.safetensors"))
        weights = sum(p.stat().st_size for p in tensors) if tensors else None
    else:
        config_path, weights = path, None
    if not config_path.is_file() and (spec.endswith(".json") or "/" in spec or "\\" in spec):
        _fail(f"{spec}: file not found" if not path.is_dir() else f"{spec}: no config.json in this directory")
    if not config_path.is_file():
        known = ", ".join(sorted(PRESETS))
        _fail(f"model {spec!r} is neither a preset ({known}) nor a config.json path / model directory")
    try:
        cfg = json.loads(config_path.read_text())
    except json.JSONDecodeError as exc:
        _fail(f"model config {str(config_path)!r} is not valid JSON: {exc}")
    name = path.name if path.is_dir() else (config_path.parent.name or config_path.name)
    shape = shape_from_config(cfg, name=name, weights_bytes=weights)
    return replace(shape, source="safetensors" if weights is not None else "config")


# ----------------------------------------------------------------------------- K/V formats


def parse_kv(spec: str, *, dtype: str | None = None) -> KVFormat:
    """``f16``/``bf16``/``f32``, ``k8v4`` (either side may be a float name: ``k8vf16``), ``q8`` (both)."""
    s = spec.strip().lower().replace("/", "")
    base = _FLOAT_NAMES.get(dtype.lower(), None) if dtype else "f16"
    if dtype and base is None:
        _fail(f"dtype must be one of f16, bf16, f32, got {dtype!r}")
    if s in _FLOAT_NAMES:
        return KVFormat(dtype=_FLOAT_NAMES[s])
    side = r"(\d+|f16|bf16|f32|fp16|fp32|float16|bfloat16|float32)"
    m = re.fullmatch(rf"k{side}v{side}", s) or re.fullmatch(r"(?:q|int|kv)(\d+)", s)
    if not m:
        _fail(f"--kv must look like f16, bf16, f32, k8v4 or q8, got {spec!r}")
    parts = m.groups() if len(m.groups()) == 2 else m.groups() * 2
    bits = []
    for part in parts:
        if part in _FLOAT_NAMES:
            if _FLOAT_NAMES[part] != base and dtype:
                _fail(f"--kv {spec!r} mixes float {part} with --dtype {dtype}")
            base = _FLOAT_NAMES[part]
            bits.append(None)
        else:
            bits.append(quant.check_bits(int(part), op=OP, name="--kv bits"))
    return KVFormat(k_bits=bits[0], v_bits=bits[1], dtype=base)


def parse_tokens(text, *, name: str = "--context") -> int:
    """``32768``, ``32K``, ``32k``, ``1M`` -> tokens (K = 1024)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kKmM]?)\s*", str(text))
        if not m:
            _fail(f"{name} must be a token count like 8192, 32K or 1M, got {text!r}")
        value = float(m.group(1)) * {"": 1, "k": 1024, "m": 1024 * 1024}[m.group(2).lower()]
        if value != int(value):
            _fail(f"{name} must be a whole number of tokens, got {text!r}")
        value = int(value)
    if value <= 0:
        _fail(f"{name} must be positive, got {text!r}")
    return value


# ----------------------------------------------------------------------------- chips

# The chip table lives in kvmetal.chips (shared with the metal backend and the benchmarks).


def default_usable_fraction(memory_gib: float) -> float:
    """Share of unified memory the GPU may wire by default (about Metal's recommended working set)."""
    return 2 / 3 if memory_gib <= 36 else 3 / 4


# ----------------------------------------------------------------------------- arithmetic

def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def _row_bytes(fmt: KVFormat, head_dim: int, which: str) -> int:
    """KVFormat.row_bytes, its error as the budget's one-line message with a group size that fits."""
    try:
        return fmt.row_bytes(head_dim, which)
    except ValueError as exc:
        group = fmt.group_size(which)
        fit = largest_group_size(head_dim)
        hint = f"; try --kv-group-size {fit}" if head_dim % group and fit else ""
        _fail(f"{which.upper()} format {fmt.label}: {str(exc).split('] ', 1)[-1]}{hint}")


def bytes_per_token_per_layer(model: ModelShape, fmt: KVFormat) -> dict:
    k = model.num_kv_heads * _row_bytes(fmt, model.head_dim, "k")
    v = model.num_kv_heads * _row_bytes(fmt, model.head_dim, "v")
    return {"k": k, "v": v, "total": k + v}


def bytes_per_token(model: ModelShape, fmt: KVFormat) -> int:
    """Cache bytes one token adds, all layers, K and V."""
    return model.num_layers * bytes_per_token_per_layer(model, fmt)["total"]


def tokens_held(model: ModelShape, *, context: int, block_size: int = 1) -> tuple:
    """Tokens one sequence keeps per (full-attention layer, sliding-window layer).

    A paged cache allocates whole blocks, so tokens round up to ``block_size``; a window
    layer keeps its window plus the partly used block at the window's start."""
    full = _round_up(context, block_size)
    if not model.num_sliding_layers:
        return full, 0
    return full, min(full, _round_up(model.sliding_window + block_size - 1, block_size))


def cache_bytes(model: ModelShape, fmt: KVFormat, *, context: int, batch: int = 1, block_size: int = 1) -> int:
    """Bytes of the cache holding ``context`` tokens for each of ``batch`` sequences
    (sliding-window layers at their window)."""
    layer = bytes_per_token_per_layer(model, fmt)["total"]
    full, windowed = tokens_held(model, context=context, block_size=block_size)
    return layer * (model.num_full_layers * full + model.num_sliding_layers * windowed) * batch


def max_context(model: ModelShape, fmt: KVFormat, *, free_bytes: int, batch: int, block_size: int,
                limit: int = 1 << 30) -> int:
    """The largest context (whole blocks) whose cache for ``batch`` sequences fits ``free_bytes``;
    ``limit`` when the cache stops growing (every layer windowed)."""
    fits = lambda blocks: cache_bytes(model, fmt, context=blocks * block_size, batch=batch,
                                      block_size=block_size) <= free_bytes
    if free_bytes <= 0 or not fits(1):
        return 0
    lo, hi = 1, max(1, limit // block_size)
    if fits(hi):
        return hi * block_size
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo * block_size


def shard(model: ModelShape, tp: int) -> tuple:
    """One device's share of ``model`` split over ``tp`` tensor-parallel ranks, and whether its
    KV is replicated (fewer kv heads than ranks: each rank keeps the kv head its query heads read)."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        _fail(f"--tp must be an int >= 1, got {tp!r}")
    if tp == 1:
        return model, False
    heads, kv = model.num_heads or model.num_kv_heads, model.num_kv_heads
    if heads % tp:
        _fail(f"--tp {tp} must divide the {heads} query heads of {model.name}")
    if kv >= tp and kv % tp:
        _fail(f"--tp {tp} must divide the {kv} kv heads of {model.name} (or exceed them)")
    replicated = kv < tp
    if replicated and tp % kv:
        _fail(f"--tp {tp} must be a multiple of the {kv} kv heads of {model.name} to replicate them")
    weights = model.estimated_weights_bytes()
    return replace(model, num_kv_heads=max(kv // tp, 1), num_heads=heads // tp, weights_bytes=-(-weights // tp),
                   name=f"{model.name} (1 of {tp} devices)"), replicated


def budget(model: ModelShape, fmt: KVFormat, *, context: int, batch: int = 1, block_size: int = 16,
           memory_gib: float | None = None, bandwidth_gbs: float | None = None,
           weights_bytes: int | None = None, usable_fraction: float | None = None,
           overhead_bytes: int = 0, chip: str | None = None) -> dict:
    """Everything ``kvmetal budget`` prints, as a JSON-ready dict (bytes are ints)."""
    for name, value in (("context", context), ("batch", batch), ("block_size", block_size)):
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            _fail(f"{name} must be a positive int, got {value!r}")
    per_layer = bytes_per_token_per_layer(model, fmt)
    per_token = per_layer["total"] * model.num_layers
    total = cache_bytes(model, fmt, context=context, batch=batch, block_size=block_size)
    weights = model.estimated_weights_bytes() if weights_bytes is None else int(weights_bytes)
    report = {
        "model": {**asdict(model), "params": model.param_count()},
        "format": {**asdict(fmt), "label": fmt.label},
        "context": context,
        "batch": batch,
        "block_size": block_size,
        "bytes_per_token": per_token,
        "bytes_per_token_per_layer": per_layer["total"],
        "k_bytes_per_token": per_layer["k"] * model.num_layers,
        "v_bytes_per_token": per_layer["v"] * model.num_layers,
        "f16_bytes_per_token": bytes_per_token(model, KVFormat()),
        "cache_bytes": total,
        "cache_bytes_if_no_window": bytes_per_token(model, fmt) * _round_up(context, block_size) * batch,
        "tokens_held_per_layer": dict(zip(("full", "sliding_window"),
                                          tokens_held(model, context=context, block_size=block_size))),
        "weights_bytes": weights,
        "weights_source": "given" if weights_bytes is not None else model.source,
        "chip": chip,
        "memory": None,
        "decode_floor": None,
        "notes": [],
    }
    trained = model.max_position_embeddings
    if trained and context > trained:
        report["notes"].append(f"context {context:,} exceeds the model's trained context "
                               f"(max_position_embeddings {trained:,}); quality past it is not assured")
    if memory_gib is not None:
        if memory_gib <= 0:
            _fail(f"memory must be positive GiB, got {memory_gib}")
        fraction = default_usable_fraction(memory_gib) if usable_fraction is None else usable_fraction
        if not 0 < fraction <= 1:
            _fail(f"usable fraction must be in (0, 1], got {fraction}")
        usable = int(memory_gib * GIB * fraction)
        free = usable - weights - int(overhead_bytes)
        seq_bytes = cache_bytes(model, fmt, context=context, block_size=block_size)
        longest = max_context(model, fmt, free_bytes=free, batch=batch, block_size=block_size)
        # Past the model's own maximum the memory is no use: report that maximum, and say so.
        by_memory = longest
        if trained and longest > trained:
            longest = trained
        report["memory"] = {
            "memory_bytes": int(memory_gib * GIB),
            "usable_fraction": fraction,
            "usable_bytes": usable,
            "overhead_bytes": int(overhead_bytes),
            "free_for_cache_bytes": free,
            "weights_fit": weights + int(overhead_bytes) <= usable,
            "fits": free >= total,
            "max_context_at_batch": int(longest),
            "max_context_by_memory": int(by_memory),  # before the cap at max_position_embeddings
            "max_context_is_model_limit": bool(trained) and by_memory >= trained,
            "context_unbounded": model.num_full_layers == 0 and longest > 0 and not trained,
            "max_batch_at_context": int(max(free, 0) // seq_bytes),
        }
    if bandwidth_gbs is not None and bandwidth_gbs <= 0:
        _fail(f"bandwidth must be positive GB/s, got {bandwidth_gbs}")
    # A configuration whose weights cannot even load has no decode speed to speak of.
    if bandwidth_gbs is not None and (report["memory"] is None or report["memory"]["weights_fit"]):
        bw = bandwidth_gbs * GB
        cache_s, full_s = total / bw, (total + weights) / bw
        report["decode_floor"] = {
            "bandwidth_bytes_per_s": bw,
            "cache_ms_per_step": cache_s * 1e3,
            "cache_tokens_per_s_per_seq": 1 / cache_s,
            "cache_tokens_per_s_total": batch / cache_s,
            "with_weights_ms_per_step": full_s * 1e3,
            "with_weights_tokens_per_s_per_seq": 1 / full_s,
            "with_weights_tokens_per_s_total": batch / full_s,
        }
    return report


# ----------------------------------------------------------------------------- text output

def human_bytes(n: float) -> str:
    """``21.47 GB (20.00 GiB)``; small sizes in KiB/MiB."""
    if n < GIB / 4:
        return f"{n / 1024:,.1f} KiB" if n < (1 << 20) else f"{n / (1 << 20):,.1f} MiB"
    return f"{n / GB:,.2f} GB ({n / GIB:,.2f} GiB)"


def format_report(r: dict) -> str:
    m, f = r["model"], r["format"]
    heads = f", {m['num_heads']} query heads" if m["num_heads"] else ""
    lines = [
        f"model       {m['name']}: {m['num_layers']} layers, {m['num_kv_heads']} kv heads, "
        f"head_dim {m['head_dim']}{heads}",
        f"KV format   {f['label']}" + ("" if f["k_bits"] is None and f["v_bits"] is None
                                       else f" ({f['dtype']} scales and biases)"),
        f"per token   {human_bytes(r['bytes_per_token'])} = {m['num_layers']} layers x "
        f"{r['bytes_per_token_per_layer']:,} B (K {r['k_bytes_per_token'] // m['num_layers']:,} B + "
        f"V {r['v_bytes_per_token'] // m['num_layers']:,} B)"
        + ("" if r["bytes_per_token"] == r["f16_bytes_per_token"] else
           f"; {r['bytes_per_token'] / r['f16_bytes_per_token']:.3f} x f16"),
        f"cache       {human_bytes(r['cache_bytes'])} for {r['context']:,} tokens x batch {r['batch']}",
    ]
    if m["num_sliding_layers"]:
        held = r["tokens_held_per_layer"]["sliding_window"]
        lines.insert(1, f"windows     {m['num_sliding_layers']} of {m['num_layers']} layers see the last "
                        f"{m['sliding_window']:,} tokens and hold at most {held:,}; only "
                        f"{m['num_layers'] - m['num_sliding_layers']} grow with the context")
        if r["cache_bytes_if_no_window"] != r["cache_bytes"]:
            lines[-1] += (f" ({r['cache_bytes'] / r['cache_bytes_if_no_window']:.2f} x the "
                          f"{human_bytes(r['cache_bytes_if_no_window'])} of full-context layers)")
    tp = r.get("tp")
    if tp and tp["devices"] > 1:
        how = ("KV is replicated: fewer kv heads than devices, so each keeps the kv head its query heads read"
               if tp["kv_replicated"] else f"{tp['kv_heads_per_device']} of {tp['kv_heads_total']} kv heads each")
        lines.insert(1, f"per device  1 of {tp['devices']} tensor-parallel devices: {how}; weights and cache "
                        f"below are per device")
    if r["weights_bytes"]:
        how = {"given": "given", "safetensors": "safetensors files",
               "config": f"estimated: {m['params'] / 1e9:.2f} B params x {m['weight_bits']:g} bits",
               "preset": f"estimated: {m['params'] / 1e9:.2f} B params x {m['weight_bits']:g} bits"}
        share = f"1/{r['tp']['devices']} of the whole model, " if r.get("tp") and r["tp"]["devices"] > 1 else ""
        lines.append(f"weights     {human_bytes(r['weights_bytes'])} ({share}{how[r['weights_source']]})")
    mem = r["memory"]
    if mem and not mem["weights_fit"]:
        chip = f"{r['chip']}, " if r["chip"] else ""
        lines.append(f"memory      {chip}{mem['memory_bytes'] / GIB:g} GiB x {mem['usable_fraction']:.2f} usable "
                     f"= {human_bytes(mem['usable_bytes'])}")
        lines.append(f"fits        NO: the weights alone ({human_bytes(r['weights_bytes'])}"
                     + (" + overhead" if mem["overhead_bytes"] else "") + ") exceed usable memory; this "
                     "configuration cannot run here (no decode floor). Try a smaller or more quantized model"
                     + (", or --tp to split it over devices" if not r.get("tp") or r["tp"]["devices"] == 1 else ""))
    elif mem:
        chip = f"{r['chip']}, " if r["chip"] else ""
        lines.append(f"memory      {chip}{mem['memory_bytes'] / GIB:g} GiB x {mem['usable_fraction']:.2f} usable "
                     f"= {human_bytes(mem['usable_bytes'])}; free for the cache after weights"
                     + (" and overhead" if mem["overhead_bytes"] else "") + f": {human_bytes(max(mem['free_for_cache_bytes'], 0))}")
        verdict = "fits" if mem["fits"] else "does NOT fit"
        if mem["context_unbounded"]:
            longest = "unbounded (every layer is windowed)"
        elif mem.get("max_context_is_model_limit"):
            room = ("memory holds more" if mem["max_context_by_memory"] >= (1 << 30)
                    else f"memory would hold {mem['max_context_by_memory']:,}")
            longest = (f"{mem['max_context_at_batch']:,} tokens, the model's maximum "
                       f"(max_position_embeddings; {room})")
        else:
            longest = f"{mem['max_context_at_batch']:,} tokens"
        lines.append(f"fits        this cache {verdict}; largest context at batch {r['batch']}: "
                     f"{longest}; largest batch at {r['context']:,} tokens: {mem['max_batch_at_context']:,}")
    floor = r["decode_floor"]
    if floor:
        bw = floor["bandwidth_bytes_per_s"] / GB
        lines.append(f"decode floor at {bw:g} GB/s: cache alone {floor['cache_ms_per_step']:.2f} ms/step "
                     f"({floor['cache_tokens_per_s_per_seq']:,.1f} tok/s per sequence, "
                     f"{floor['cache_tokens_per_s_total']:,.1f} total); with weights "
                     f"{floor['with_weights_ms_per_step']:.2f} ms/step "
                     f"({floor['with_weights_tokens_per_s_per_seq']:,.1f} tok/s per sequence, "
                     f"{floor['with_weights_tokens_per_s_total']:,.1f} total)")
    if not mem and not floor:
        lines.append("(give --chip, or --memory and --bandwidth, for what fits and the decode floor)")
    lines += [f"note        {n}" for n in r.get("notes", [])]
    return "\n".join(lines)


COMPARE_FORMATS = ("f16", "k8v8", "k8v4", "k4v4", "k4v2")


def compare_formats(fmt: KVFormat, head_dim: int, resolve) -> list:
    """``COMPARE_FORMATS`` in ``fmt``'s float dtype, then ``fmt`` unless it is one of them:
    ``(format, error)`` pairs, each format ``resolve(spec)`` (its group sizes chosen for
    ``head_dim`` as ``fmt``'s were), or, where ``resolve`` refused it, the spec at the group
    sizes asked for and the one-line reason."""
    pairs = []
    for spec in (parse_kv(s, dtype=fmt.dtype) for s in COMPARE_FORMATS):
        try:
            pairs.append((resolve(spec), None))
        except ValueError as exc:
            asked = replace(spec, k_group_size=fmt.k_group_size or default_group_size(head_dim),
                            v_group_size=fmt.v_group_size or default_group_size(head_dim))
            pairs.append((asked, str(exc).split("] ", 1)[-1]))
    if all(f != fmt for f, _ in pairs):
        pairs.append((fmt, None))
    return pairs


def compare_rows(model: ModelShape, formats: list, *, context: int, batch: int, block_size: int) -> list:
    """Per-token and cache bytes of each ``(format, error)`` of ``compare_formats``, or why not."""
    rows = []
    for s, error in formats:
        row = {"label": s.label, "format": asdict(s), "bytes_per_token": None, "cache_bytes": None, "error": error}
        if error is None:
            try:
                row["bytes_per_token"] = bytes_per_token(model, s)
                row["cache_bytes"] = cache_bytes(model, s, context=context, batch=batch, block_size=block_size)
            except ValueError as exc:
                row["error"] = str(exc).split("] ", 1)[-1]
        rows.append(row)
    return rows


def compare_table(rows: list) -> str:
    lines = ["format          per token      cache"]
    for row in rows:
        if row["error"]:
            lines.append(f"{row['label']:<15} {row['error']}")
        else:
            lines.append(f"{row['label']:<15} {human_bytes(row['bytes_per_token']):<14} "
                         f"{human_bytes(row['cache_bytes'])}")
    return "\n".join(lines)


# ----------------------------------------------------------------------------- plot

def _token_label(n: int) -> str:
    return f"{n >> 20}M" if n >= 1 << 20 else f"{n >> 10}K" if n >= 1024 else str(n)


def plot_cache_sizes(model: ModelShape, formats, path: str, *, batch: int = 1, max_context: int = 131072,
                     free_bytes: int | None = None, context: int | None = None, chosen: KVFormat | None = None,
                     block_size: int = 16) -> None:
    """Cache bytes against context for several formats, log-log, saved to ``path``.

    Ticks read 1K ... 1M; the requested context and format are marked, and the free-memory
    line is drawn only when it falls inside the plotted range."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    except ImportError as exc:
        raise ImportError(f"[{OP}] --plot needs matplotlib: pip install matplotlib ({exc})") from exc
    contexts = [1 << k for k in range(10, max(11, math.ceil(math.log2(max_context))) + 1)]
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    lows, highs = [], []
    for fmt in formats:
        ys = [cache_bytes(model, fmt, context=c, batch=batch, block_size=block_size) / GIB for c in contexts]
        lows.append(min(ys))
        highs.append(max(ys))
        mine = fmt == chosen
        ax.plot(contexts, ys, marker="o", markersize=4 if mine else 2.5, linewidth=2.6 if mine else 1.2,
                label=f"{fmt.label} ({bytes_per_token(model, fmt) / 1024:.1f} KiB/token)" + (" (chosen)" if mine else ""))
        if mine and context is not None:
            here = cache_bytes(model, fmt, context=context, batch=batch, block_size=block_size) / GIB
            ax.plot([context], [here], marker="*", markersize=14, color="black", zorder=5,
                    label=f"{_token_label(context) if context % 1024 == 0 else f'{context:,}'} tokens, "
                          f"{fmt.label}: {here:.2f} GiB")
    if context is not None:
        ax.axvline(context, color="gray", linestyle=":", linewidth=1)
    if free_bytes is not None and min(lows) <= free_bytes / GIB <= max(highs):
        ax.axhline(free_bytes / GIB, color="black", linestyle="--", linewidth=1, label="free memory after weights")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.xaxis.set_major_locator(FixedLocator(contexts))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: _token_label(int(x))))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
    ax.set_xlabel("context (tokens per sequence)")
    ax.set_ylabel("KV cache (GiB, log scale)")
    windows = f", {model.num_sliding_layers} sliding-window layers" if model.num_sliding_layers else ""
    ax.set_title(f"{model.name}: KV cache at batch {batch}{windows}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ----------------------------------------------------------------------------- command

def _parser() -> argparse.ArgumentParser:
    from .cli_args import ArgumentParser

    p = ArgumentParser(
        prog="kvmetal budget",
        description="KV-cache bytes, what fits next to the weights, and the bandwidth floor on decode.",
        epilog=f"presets: {', '.join(sorted(PRESETS))}\nchips: {', '.join(CHIPS)}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", "-m", required=True,
                   help="preset name, named model (default, smollm2, gemma3; NAME:DTYPE as in generate), "
                        "config.json path, or model directory")
    p.add_argument("--context", "-c", default="32K", help="tokens per sequence, e.g. 8192, 32K, 1M (default 32K)")
    p.add_argument("--batch", "-b", type=int, default=1, help="sequences (default 1)")
    p.add_argument("--kv", default=None,
                   help="K/V storage in one word: a float dtype (f16, bf16, f32) or bits such as k8v4, k4v4, "
                        "k8vf16, q8 (default f16); a quantized one takes the group-size flags below, not the "
                        "bits flags")
    p.add_argument("--dtype", default=None, help="float dtype of the cache / of scales and biases (default f16)")
    flags = p.add_argument_group("K/V format (the flags of kvmetal generate, serve and bench -m, read the same way)",
                                 textwrap.fill(FORMAT_FLAGS_HELP, 90))
    add_format_flags(flags)
    # budget's name for --kv-group-size before it took the shared flags; kept for old scripts
    flags.add_argument("--group-size", dest="kv_group_size", type=int, choices=quant.SUPPORTED_GROUP_SIZES,
                       default=None, help=argparse.SUPPRESS)
    p.add_argument("--block-size", type=int, default=16, help="paged-cache block size: contexts round up to it")
    p.add_argument("--chip", default=None, help=f"Apple chip: {', '.join(CHIPS)}")
    p.add_argument("--memory", type=float, default=None, help="unified memory in GiB (default: the chip's largest)")
    p.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth in GB/s (default: the chip's)")
    p.add_argument("--usable-fraction", type=float, default=None,
                   help="share of memory the GPU may use (default 2/3 up to 36 GiB, else 3/4)")
    p.add_argument("--weights-gb", type=float, default=None, help="weights in GB, instead of the estimate")
    p.add_argument("--overhead-gb", type=float, default=0.0, help="other memory to reserve (activations...), GB")
    p.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel devices (mlx.launch + model.shard): report one device's kv heads, "
                        "weights and cache (default 1)")
    p.add_argument("--compare", action="store_true", help="also list common K/V formats side by side")
    p.add_argument("--plot", metavar="PNG", default=None, help="plot cache size against context for several formats")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _with_group_flags(args, spec: KVFormat, head_dim: int) -> KVFormat:
    """``spec``'s bits and float dtype with the group sizes of ``args``'s K/V format flags,
    chosen and checked for ``head_dim`` by kv_format as generate and serve choose theirs
    (KVFormat.for_head_dim: default_group_size unless given; a KVFormatError names the flag)."""
    flags = argparse.Namespace(**{**vars(args), "kv_bits": None, "k_bits": spec.k_bits, "v_bits": spec.v_bits})
    return replace(format_from_args(flags).for_head_dim(head_dim), dtype=spec.dtype)


def _format_from_args(args, head_dim: int) -> KVFormat:
    """The KV format of budget's flags: ``--kv`` (and ``--dtype``), or the shared K/V format
    flags read as generate and serve read them (``kv_format.format_from_args``)."""
    spec = parse_kv(args.kv or (args.dtype or "f16"), dtype=args.dtype)
    given = format_from_args(args)
    if given.quantized:
        if spec.quantized:
            bits = [flag for flag, value in (("--kv-bits", args.kv_bits), ("--k-bits", args.k_bits),
                                             ("--v-bits", args.v_bits)) if value is not None]
            _fail(f"give either --kv {args.kv} or {'/'.join(bits)}, not both")
        spec = replace(spec, k_bits=given.k_bits, v_bits=given.v_bits)
    try:
        return _with_group_flags(args, spec, head_dim)
    except KVFormatError as exc:
        _fail(str(exc))


def run(argv: list[str] | None = None) -> tuple:
    """Parse ``argv`` and compute: ``(report, text)``; raises ValueError on bad input."""
    args = _parser().parse_args(argv)
    model = load_model(args.model)
    fmt = _format_from_args(args, model.head_dim)
    context = parse_tokens(args.context)
    if args.batch <= 0:
        _fail(f"--batch must be positive, got {args.batch}")
    if args.block_size <= 0:
        _fail(f"--block-size must be positive, got {args.block_size}")
    memory, bandwidth = args.memory, args.bandwidth
    chip = None
    if args.chip is not None:
        chip = CHIPS.get(args.chip.lower().replace(" ", "-"))
        if chip is None:
            _fail(f"--chip must be one of {', '.join(CHIPS)}, got {args.chip!r}")
        memory = max(chip.memory_gib) if memory is None else memory
        bandwidth = chip.bandwidth_gbs if bandwidth is None else bandwidth
    whole = model
    model, replicated = shard(model, args.tp)
    weights = None if args.weights_gb is None else int(args.weights_gb * GB / args.tp)
    report = budget(model, fmt, context=context, batch=args.batch, block_size=args.block_size,
                    memory_gib=memory, bandwidth_gbs=bandwidth, weights_bytes=weights,
                    usable_fraction=args.usable_fraction, overhead_bytes=int(args.overhead_gb * GB),
                    chip=chip.name if chip else None)
    report["model"]["params"] = whole.param_count()
    report["tp"] = {"devices": args.tp, "kv_heads_total": whole.num_kv_heads,
                    "kv_heads_per_device": model.num_kv_heads, "kv_replicated": replicated}
    text = format_report(report)
    others = (compare_formats(fmt, model.head_dim, lambda spec: _with_group_flags(args, spec, model.head_dim))
              if args.compare or args.plot else [])
    if args.compare:
        report["compare"] = compare_rows(model, others, context=context, batch=args.batch,
                                         block_size=args.block_size)
        text += "\n\n" + compare_table(report["compare"])
    if args.plot:
        formats = [f for f, error in others if error is None]  # those the head_dim can hold
        free = report["memory"]["free_for_cache_bytes"] if report["memory"] else None
        plot_cache_sizes(model, formats, args.plot, batch=args.batch, max_context=max(4 * context, 1 << 20),
                         free_bytes=free, context=context, chosen=fmt, block_size=args.block_size)
        report["plot"] = args.plot
        text += f"\n\nplot written to {args.plot}"
    return report, text


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    as_json = "--json" in argv
    try:
        report, text = run(argv)
    except (ValueError, TypeError, ImportError) as exc:
        print(f"kvmetal budget: error: {str(exc).removeprefix(f'[{OP}] ')}", file=sys.stderr)
        return 2
    print(json.dumps(report, indent=2) if as_json else text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
