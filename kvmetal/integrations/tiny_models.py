"""Small random mlx-lm models built in code (no download), one per supported family.

Head dim is 64 (the smallest kvmetal supports) and embeddings are untied, which keeps
greedy decoding of random weights from collapsing into one repeated token. Window
layers get short windows so that a few dozen decode steps cross them.
"""
from __future__ import annotations

import importlib

import mlx.core as mx
import mlx.nn as nn

COMMON = dict(hidden_size=128, num_hidden_layers=2, intermediate_size=256, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, vocab_size=512, tie_word_embeddings=False)

ARGS = {
    "llama": dict(COMMON, head_dim=64),
    "qwen2": dict(COMMON, hidden_size=256),  # head_dim = hidden / heads = 64
    "qwen3": dict(COMMON, head_dim=64, max_position_embeddings=4096, rope_theta=10000.0),
    "phi3": dict(COMMON, hidden_size=256),
    "gemma3_text": dict(COMMON, head_dim=64, query_pre_attn_scalar=64, sliding_window=24, sliding_window_pattern=2),
    "gpt_oss": dict(COMMON, head_dim=64, num_local_experts=4, num_experts_per_tok=2, sliding_window=24,
                    layer_types=["sliding_attention", "full_attention"]),
}


def build(family: str, *, dtype=mx.float32, seed: int = 0, **overrides) -> nn.Module:
    """A random ``family`` model in ``dtype`` (weights drawn from ``seed``)."""
    if family not in ARGS:
        raise ValueError(f"[tiny_models.build] family must be one of {sorted(ARGS)}, got {family!r}")
    module = importlib.import_module(f"mlx_lm.models.{family}")
    args = module.ModelArgs.from_dict(dict(ARGS[family], model_type=family, **overrides))
    mx.random.seed(seed)
    model = module.Model(args)
    if family == "gpt_oss":
        # Zero-initialised sinks would make the sink path trivial; give them real logits.
        for layer in model.layers:
            layer.self_attn.sinks = mx.random.normal(layer.self_attn.sinks.shape)
    model.set_dtype(dtype)
    if family == "gpt_oss" and dtype != mx.float32 and not mx.metal.is_available():
        # MLX's CPU GatherMM (the experts) runs float32 only: keep the expert blocks in
        # float32 behind a cast; attention and the KV cache stay in ``dtype``.
        for layer in model.layers:
            layer.mlp = Float32Block(layer.mlp)
    # Random normal init of norms/embeddings is fine; make every array real before timing.
    mx.eval(model.parameters())
    return model


class Float32Block(nn.Module):
    """Runs ``inner`` in float32 and returns its output in the input's dtype."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        inner.set_dtype(mx.float32)
        self.inner = inner

    def __call__(self, x: mx.array) -> mx.array:
        return self.inner(x.astype(mx.float32)).astype(x.dtype)


def word_tokenizer(vocab_size: int = COMMON["vocab_size"]):
    """A Hugging Face tokenizer over the words ``t0 .. t{vocab_size - 1}`` (built offline)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="t0", eos_token=f"t{vocab_size - 1}")


def save(family: str, path, *, dtype=mx.float16, seed: int = 0) -> None:
    """Write a random ``family`` model as an mlx-lm model directory (config, weights, tokenizer)."""
    from pathlib import Path

    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model = build(family, dtype=dtype, seed=seed)
    save_model(path, model)
    config = dict(ARGS[family], model_type=family, torch_dtype={mx.float16: "float16", mx.bfloat16: "bfloat16"}.get(dtype, "float32"))
    save_config(config, path / "config.json")
    word_tokenizer(config["vocab_size"]).save_pretrained(path)
