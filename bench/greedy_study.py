"""Greedy decode with quantized K/V against a float16 cache, on small mlx-lm models built in code.

Two models (``--model``): ``copy`` (default), a one-layer llama whose weights are
set by hand to retrieve a token through attention, confidently, with an outlier
channel in its keys (see :func:`build_copy_model`); and ``random``, a seeded
random llama, whose near-tied logits make any perturbation flip greedy decode.
docs/quantization.md explains the choice and holds the results.

For each K/V format (K and V with their own bits) the study runs two things on
the same seeded model and prompt:

* free greedy decode for ``steps`` tokens; counts the positions whose token
  equals the float16-cache run, and the first step where they differ;
* teacher-forced decode over the float16 run's tokens, so every step sees the
  same context; the logit error is measured there (max and mean |delta| over
  all steps and the vocabulary), which keeps it meaningful after a divergence.

Two cache paths (``--path``):

* ``own`` (default): :class:`QuantizedStudyCache` below, an mlx-lm cache that
  stores every K/V row written (prompt and decoded tokens) with
  ``mx.quantize`` at the format's bits and hands mlx-lm's attention the
  dequantized rows. Same numerics as kvmetal's quantized kernels: attention
  over the dequantized cache.
* ``kvmetal``: ``kvmetal.integrations.mlx_lm.use_paged_cache`` (the paged
  cache and kvmetal ops on the current backend), when that module is present.

Usage::

    python bench/greedy_study.py                      # prints the markdown table
    python bench/greedy_study.py --write table.md     # and writes it
    python bench/greedy_study.py --path kvmetal --backend cpu
    python bench/greedy_study.py --model random --seed 3
"""
from __future__ import annotations

import argparse
import contextlib
import sys
import time
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

from kvmetal import quant

# (label, k_bits, v_bits); None = float16 (the reference run).
FORMATS = (
    ("K8/V8", 8, 8),
    ("K8/V4", 8, 4),
    ("K8/V3", 8, 3),
    ("K4/V8", 4, 8),
    ("K4/V4", 4, 4),
    ("K3/V3", 3, 3),
)


@dataclass(frozen=True)
class StudyConfig:
    model: str = "copy"         # "copy": designed retrieval model; "random": random weights
    seed: int = 0
    hidden_size: int = 256
    num_hidden_layers: int = 4   # random model only (the copy model has one layer)
    intermediate_size: int = 1024
    num_attention_heads: int = 8
    num_key_value_heads: int = 2
    head_dim: int = 128
    vocab_size: int = 1024
    prompt_len: int = 32         # the copy model's period
    steps: int = 64
    group_size: int = quant.DEFAULT_GROUP_SIZE
    dtype: str = "float16"
    key_outlier: float = 8.0     # copy model: outlier channel size, in units of the other key channels


@dataclass
class RunResult:
    label: str
    k_bits: int | None
    v_bits: int | None
    tokens: list
    matches: int
    first_divergence: int | None
    max_logit_err: float
    mean_logit_err: float


# ----------------------------------------------------------------------------- models

def _llama(config: StudyConfig, **overrides):
    from mlx_lm.models import llama

    fields = dict(
        model_type="llama",
        hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers,
        intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=1e-5,
        vocab_size=config.vocab_size,
        tie_word_embeddings=False,
    )
    mx.random.seed(config.seed)
    return llama.Model(llama.ModelArgs(**{**fields, **overrides}))


def build_random_model(config: StudyConfig):
    """A seeded random llama (untied embeddings, GQA)."""
    return _llama(config)


# Rotary pairs the copy head's position code uses: the fastest-turning ones, whose
# scores fall off within a token (slow pairs barely change over a few hundred tokens).
COPY_PAIRS = 16
COPY_SCORE = 96.0     # peak score (before the 1/sqrt(head_dim) scale): the attention's sharpness


def build_copy_model(config: StudyConfig):
    """A one-layer llama whose weights are set by hand to copy the token ``prompt_len`` back.

    Why: random weights give next-token logits whose top-1 margin is a small fraction
    of their spread, so any perturbation flips greedy decode; trained models are
    confident. This model is confident by construction and its decisions run through
    attention, in the two ways a real model's do:

    * which token it attends to is decided by K: queries and keys are constant
      vectors (projection biases) that RoPE turns into a position code peaking at
      ``m - n = prompt_len - 1``; the sharpness is ``COPY_SCORE``;
    * what it copies comes from V: the attended token's embedding, through identity
      V/O projections (one query head per kv head writes it back); the MLP is zero.

    Keys also carry one outlier channel (``key_outlier`` times the others, in the
    slowest rotary pair, so its score contribution is the same at every position and
    cancels in the softmax), as trained models' keys do: it sets the quantization
    range of its group, so low-bit K loses the position code.
    """
    d, hd = config.hidden_size, config.head_dim
    h, hkv = config.num_attention_heads, config.num_key_value_heads
    if hkv * hd != d:
        raise ValueError(f"[greedy_study] copy model needs num_key_value_heads * head_dim == hidden_size, "
                         f"got {hkv} * {hd} != {d}")
    model = _llama(config, num_hidden_layers=1, attention_bias=True)
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    half, period = hd // 2, config.prompt_len
    theta = 10000.0 ** (-2 * np.arange(half) / hd)        # mlx-lm llama RoPE frequencies
    amp = np.sqrt(COPY_SCORE / COPY_PAIRS)
    k0, q0 = np.zeros(hd), np.zeros(hd)
    # As complex pairs z = x[i] + j x[i + half], RoPE multiplies by exp(j * pos * theta_i) and
    # the score is Re(z_q conj(z_k) exp(j (m - n) theta_i)): peak at m - n = period - 1.
    k0[:COPY_PAIRS] = amp
    q0[:COPY_PAIRS] = amp * np.cos((period - 1) * theta[:COPY_PAIRS])
    q0[half:half + COPY_PAIRS] = -amp * np.sin((period - 1) * theta[:COPY_PAIRS])
    k0[half - 1] = config.key_outlier * amp                 # slowest pair: position-independent
    zeros = lambda shape: mx.zeros(shape)
    attn.q_proj.weight, attn.q_proj.bias = zeros((h * hd, d)), mx.array(np.tile(q0, h), dtype=mx.float32)
    attn.k_proj.weight, attn.k_proj.bias = zeros((hkv * hd, d)), mx.array(np.tile(k0, hkv), dtype=mx.float32)
    attn.v_proj.weight, attn.v_proj.bias = mx.eye(d), zeros((d,))
    group = h // hkv
    o = np.zeros((d, h * hd), dtype=np.float32)
    for g in range(hkv):  # the first query head of each kv group writes its kv head's slice back
        o[g * hd:(g + 1) * hd, g * group * hd:(g * group + 1) * hd] = np.eye(hd)
    attn.o_proj.weight, attn.o_proj.bias = mx.array(o), zeros((d,))
    for lin in (mlp.gate_proj, mlp.up_proj, mlp.down_proj):
        lin.weight = mx.zeros_like(lin.weight)
    # Read out with the (unit) embeddings themselves: the copied token's logit stands out.
    emb = model.model.embed_tokens.weight
    model.lm_head.weight = emb / mx.linalg.norm(emb, axis=-1, keepdims=True)
    return model


def build_model(config: StudyConfig):
    if config.model not in ("copy", "random"):
        raise ValueError(f"[greedy_study] model must be 'copy' or 'random', got {config.model!r}")
    model = build_copy_model(config) if config.model == "copy" else build_random_model(config)
    model.set_dtype(getattr(mx, config.dtype))
    mx.eval(model.parameters())
    return model


def make_prompt(config: StudyConfig) -> mx.array:
    rng = np.random.default_rng(config.seed + 1)
    return mx.array(rng.integers(0, config.vocab_size, size=config.prompt_len), dtype=mx.int32)


# ----------------------------------------------------------------------------- the study's own cache

class QuantizedStudyCache:
    """mlx-lm cache storing K and V quantized (independent bits), returning them dequantized.

    Every row written (prompt prefill and each decoded token) is quantized with
    ``mx.quantize`` along head_dim; attention then runs over the dequantized
    cache, as kvmetal's quantized kernels do. ``k_bits``/``v_bits`` None keeps
    that side in float. There is deliberately no ``bits`` attribute: mlx-lm
    would route a cache with one to its own quantized attention (same bits for
    K and V).
    """

    def __init__(self, *, k_bits: int | None, v_bits: int | None, group_size: int = quant.DEFAULT_GROUP_SIZE):
        self.k_bits, self.v_bits, self.group_size = k_bits, v_bits, group_size
        self.keys = None      # QuantizedKV or mx.array [B, Hkv, T, D]
        self.values = None
        self.offset = 0

    def _store(self, stored, rows, bits):
        new = rows if bits is None else quant.quantize(rows, bits=bits, group_size=self.group_size)
        if stored is None:
            return new
        if bits is None:
            return mx.concatenate([stored, new], axis=2)
        return stored.replace(*(mx.concatenate([a, b], axis=2) for a, b in zip(stored.arrays(), new.arrays())))

    @staticmethod
    def _fetch(stored, dtype):
        return stored if isinstance(stored, mx.array) else quant.dequantize(stored).astype(dtype)

    def update_and_fetch(self, keys, values):
        self.keys = self._store(self.keys, keys, self.k_bits)
        self.values = self._store(self.values, values, self.v_bits)
        self.offset += keys.shape[2]
        return self._fetch(self.keys, keys.dtype), self._fetch(self.values, values.dtype)

    def make_mask(self, n: int, *, return_array: bool = False, window_size=None):
        from mlx_lm.models.cache import create_attention_mask

        return create_attention_mask(n, offset=self.offset, return_array=return_array, window_size=window_size)

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.keys is None

    def is_trimmable(self) -> bool:
        return False

    @property
    def state(self):
        return []

    @property
    def nbytes(self) -> int:
        return sum(0 if c is None else c.nbytes for c in (self.keys, self.values))


def own_caches(model, k_bits, v_bits, group_size):
    """One cache per layer: mlx-lm's float KVCache for the reference, ours otherwise."""
    from mlx_lm.models.cache import KVCache

    if k_bits is None and v_bits is None:
        return [KVCache() for _ in model.layers]
    return [QuantizedStudyCache(k_bits=k_bits, v_bits=v_bits, group_size=group_size) for _ in model.layers]


# ----------------------------------------------------------------------------- decoding

def _decode(model, prompt: mx.array, steps: int, caches, forced: list | None = None):
    """Greedy (or teacher-forced) decode; returns (tokens, float32 logits [steps, vocab])."""
    logits = model(prompt[None], cache=caches)[:, -1, :]
    tokens, all_logits = [], []
    for step in range(steps):
        mx.eval(logits)
        row = np.array(logits[0].astype(mx.float32))
        all_logits.append(row)
        tokens.append(int(row.argmax()))
        if step + 1 == steps:
            break
        feed = tokens[-1] if forced is None else forced[step]
        logits = model(mx.array([[feed]], dtype=mx.int32), cache=caches)[:, -1, :]
    return tokens, np.stack(all_logits)


@contextlib.contextmanager
def _kvmetal_caches(model, k_bits, v_bits, group_size):
    """Per-layer caches from kvmetal's mlx-lm integration (paged pools + kvmetal ops)."""
    try:
        from kvmetal.integrations.mlx_lm import use_paged_cache
    except ImportError as exc:
        raise RuntimeError(f"[greedy_study] --path kvmetal needs kvmetal.integrations.mlx_lm: {exc}") from exc
    from mlx_lm.models.cache import make_prompt_cache

    # The handle patches the model's attention and make_cache until it is undone; the study's
    # group size, not kvmetal's default (kvmetal.kv_format.default_group_size).
    groups = dict(k_group_size=group_size if k_bits else None, v_group_size=group_size if v_bits else None)
    with use_paged_cache(model, k_bits=k_bits, v_bits=v_bits, **groups):
        yield make_prompt_cache(model)


def _caches(path, model, k_bits, v_bits, group_size):
    """A context manager giving one run's per-layer caches on ``path``."""
    if path == "own":
        return contextlib.nullcontext(own_caches(model, k_bits, v_bits, group_size))
    if path == "kvmetal":
        return _kvmetal_caches(model, k_bits, v_bits, group_size)
    raise ValueError(f"[greedy_study] path must be 'own' or 'kvmetal', got {path!r}")


def decode_run(model, prompt, config: StudyConfig, k_bits, v_bits, *, path="own", forced=None):
    """(tokens, logits) of one run on fresh caches: greedy, or teacher-forced on ``forced``."""
    with _caches(path, model, k_bits, v_bits, config.group_size) as caches:
        return _decode(model, prompt, config.steps, caches, forced=forced)


def compare_format(model, prompt, config: StudyConfig, label, k_bits, v_bits, reference, *,
                   path="own") -> RunResult:
    """Free greedy decode (token matches) and teacher-forced logit error against ``reference``."""
    ref_tokens, ref_logits = reference
    tokens, _ = decode_run(model, prompt, config, k_bits, v_bits, path=path)
    _, forced_logits = decode_run(model, prompt, config, k_bits, v_bits, path=path, forced=ref_tokens)
    same = [a == b for a, b in zip(tokens, ref_tokens)]
    first = None if all(same) else same.index(False)
    err = np.abs(forced_logits - ref_logits)
    return RunResult(label, k_bits, v_bits, tokens, int(sum(same)), first, float(err.max()), float(err.mean()))


def run_study(config: StudyConfig = StudyConfig(), formats=FORMATS, *, path="own") -> tuple:
    """(reference RunResult, [RunResult per format], summary of the reference logits).

    The reference is the float cache on the same path (``own``: mlx-lm's KVCache).
    """
    model = build_model(config)
    prompt = make_prompt(config)
    ref_tokens, ref_logits = decode_run(model, prompt, config, None, None, path=path)
    top2 = np.sort(ref_logits, axis=-1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    summary = {
        "median_top1_margin": float(np.median(margins)),
        "min_top1_margin": float(margins.min()),
        "logit_std": float(ref_logits.std()),
        "distinct_tokens": len(set(ref_tokens)),
    }
    label = f"{config.dtype} cache" + (", paged" if path == "kvmetal" else "")
    reference = RunResult(label, None, None, ref_tokens, config.steps, None, 0.0, 0.0)
    results = [compare_format(model, prompt, config, label, kb, vb, (ref_tokens, ref_logits), path=path)
               for label, kb, vb in formats]
    return reference, results, summary


# ----------------------------------------------------------------------------- report

def describe_model(config: StudyConfig) -> str:
    heads = (f"{config.num_attention_heads} heads / {config.num_key_value_heads} kv heads, "
             f"head_dim {config.head_dim}, hidden {config.hidden_size}, vocab {config.vocab_size}")
    if config.model == "copy":
        return (f"designed copy model (llama, 1 layer, {heads}; copies the token {config.prompt_len} back; "
                f"key outlier x{config.key_outlier:g}), seed {config.seed}, {config.dtype}")
    return f"random llama ({config.num_hidden_layers} layers, {heads}), seed {config.seed}, {config.dtype}"


def markdown_table(reference: RunResult, results, config: StudyConfig, summary: dict, *, path: str) -> str:
    n = config.steps
    lines = [
        f"| K/V format | tokens equal to the {config.dtype} cache's (of {n}) | first divergence (step) "
        f"| max abs logit error | mean abs logit error |",
        "|---|---|---|---|---|",
        f"| {reference.label} (reference) | {n}/{n} | - | 0 | 0 |",
    ]
    for r in results:
        first = "-" if r.first_divergence is None else str(r.first_divergence)
        lines.append(f"| {r.label} | {r.matches}/{n} | {first} | {r.max_logit_err:.4f} | {r.mean_logit_err:.5f} |")
    lines += [
        "",
        f"Model: {describe_model(config)}. Prompt: {config.prompt_len} random tokens; {n} greedy steps; "
        f"group size {config.group_size}; cache path: `{path}`.",
        f"Reference logits: std {summary['logit_std']:.3f}; top-1 margin median "
        f"{summary['median_top1_margin']:.4f}, min {summary['min_top1_margin']:.4f}; "
        f"{summary['distinct_tokens']} distinct tokens in the reference run.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="greedy_study", description=__doc__.splitlines()[0])
    parser.add_argument("--write", metavar="PATH", help="also write the markdown table to PATH")
    parser.add_argument("--path", choices=("own", "kvmetal"), default="own",
                        help="cache path: this script's quantized mlx-lm cache, or kvmetal's integration")
    parser.add_argument("--backend", choices=("cpu", "sim", "metal"), default=None,
                        help="kvmetal backend for --path kvmetal (default: kvmetal's default)")
    defaults = StudyConfig()
    parser.add_argument("--model", choices=("copy", "random"), default=defaults.model)
    ints = ("seed", "steps", "prompt_len", "num_hidden_layers", "hidden_size", "num_attention_heads",
            "num_key_value_heads", "head_dim", "vocab_size", "group_size")
    for name in ints:
        parser.add_argument(f"--{name.replace('_', '-')}", type=int, default=getattr(defaults, name))
    parser.add_argument("--key-outlier", type=float, default=defaults.key_outlier)
    parser.add_argument("--dtype", choices=("float16", "bfloat16", "float32"), default=defaults.dtype)
    args = parser.parse_args(argv)
    names = ("model", "key_outlier", "dtype") + ints
    config = StudyConfig(**{**asdict(defaults), **{k: getattr(args, k) for k in names}})

    backend = contextlib.nullcontext()
    if args.backend is not None:
        from kvmetal import use_backend

        backend = use_backend(args.backend)
    t0 = time.perf_counter()
    with backend:
        reference, results, summary = run_study(config, path=args.path)
    table = markdown_table(reference, results, config, summary, path=args.path)
    print(table)
    print(f"({time.perf_counter() - t0:.1f} s)", file=sys.stderr)
    if args.write:
        with open(args.write, "w") as f:
            f.write(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
