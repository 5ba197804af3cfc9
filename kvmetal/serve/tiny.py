"""A tiny but complete model directory for tests and the load script, built offline.

A random-weight llama (head_dim 64) saved with mlx-lm's own utilities, and a real
byte-level BPE tokenizer trained here with the ``tokenizers`` library, saved in
Hugging Face format with a chat template. ``mlx_lm.load`` and ``mlx_lm.server`` read it
like any downloaded model.
"""
from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIAL_TOKENS = ["<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]

_CORPUS = """\
The paged cache keeps keys and values in fixed blocks, so a long prompt does not need one large buffer.
A block table maps every sequence to its blocks; sequences that start with the same system prompt share them.
When the pool runs out of blocks the newest request is preempted and later recomputed from its tokens.
Quantized keys keep eight bits and values four, which halves the memory a long conversation needs.
You are a helpful assistant. Answer the question briefly and say when you do not know.
What is the capital of France? Paris is the capital of France, and Lyon is its third city.
Write a short poem about the sea: the waves come in, the waves go out, the gulls are loud.
Summarize the following text in one sentence, keeping the numbers that matter most.
Servers batch many requests in one forward pass; each step decodes one token for every running request.
"""


def train_tokenizer(vocab_size: int = 384):
    """A byte-level BPE tokenizer trained on a small built-in corpus; returns the HF fast tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(_CORPUS.splitlines() * 4, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|end|>")
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_model_dir(path, *, seed: int = 0, num_layers: int = 2, dtype: str = "float32",
                    max_position_embeddings: int = 2048) -> Path:
    """Write the tiny llama and its tokenizer to ``path``; returns the path."""
    import mlx.core as mx
    from mlx_lm.models import llama

    tokenizer = train_tokenizer()
    config = dict(model_type="llama", hidden_size=128, num_hidden_layers=num_layers, intermediate_size=256,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, rms_norm_eps=1e-5,
                  vocab_size=len(tokenizer), tie_word_embeddings=False, rope_theta=10000.0,
                  max_position_embeddings=max_position_embeddings, torch_dtype=dtype)
    mx.random.seed(seed)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    model.set_dtype(getattr(mx, dtype))
    mx.eval(model.parameters())
    return _save_dir(path, model, config, tokenizer)


def build_arch_dir(path, name: str, *, seed: int = 0) -> Path:
    """Write a tiny random model of mlx-lm architecture ``name`` (``arch_sweep.build``, its
    config from ``arch_sweep.tiny_args``, float32) with the tokenizer above to ``path``;
    returns the path."""
    from ..integrations.arch_sweep import build, tiny_args

    tokenizer = train_tokenizer()
    config = dict(tiny_args(name), vocab_size=len(tokenizer), torch_dtype="float32")
    if isinstance(config.get("text_config"), dict):  # a wrapper (llama4): its text model reads its own vocab_size
        config["text_config"] = dict(config["text_config"], vocab_size=len(tokenizer))
    return _save_dir(path, build(name, seed=seed, config=config), config, tokenizer)


def _save_dir(path, model, config: dict, tokenizer) -> Path:
    """``model``, its ``config`` and ``tokenizer`` as a model directory ``mlx_lm.load`` reads."""
    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_model(path, model)
    save_config(config, path / "config.json")
    tokenizer.save_pretrained(path)
    return path
