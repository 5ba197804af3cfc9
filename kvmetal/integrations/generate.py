"""``kvmetal generate``: run a local mlx-lm model directory with kvmetal's paged KV cache.

    kvmetal generate --model ./Qwen3-0.6B-4bit --prompt "Hello" --max-tokens 64 --k-bits 8 --v-bits 4

Text streams to stdout; speeds and KV bytes go to stderr.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="kvmetal generate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="a local mlx-lm model directory (config.json, weights, tokenizer)")
    parser.add_argument("--prompt", required=True, help="prompt text ('-' reads stdin)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--temp", type=float, default=0.0, help="sampling temperature (0 = greedy)")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template")
    parser.add_argument("--block-size", type=int, default=16, choices=(8, 16, 32))
    parser.add_argument("--num-blocks", type=int, help="fixed pool size in blocks (default: grow on demand)")
    parser.add_argument("--k-bits", type=int, help="quantize K to these bits")
    parser.add_argument("--v-bits", type=int, help="quantize V to these bits")
    parser.add_argument("--backend", choices=("metal", "cpu", "sim"), help="kvmetal backend (default: best available)")
    args = parser.parse_args(argv)
    if args.max_tokens < 1:
        parser.error("--max-tokens must be >= 1")
    if not (Path(args.model) / "config.json").is_file():
        print(f"kvmetal generate: --model {args.model!r} is not a model directory (no config.json)", file=sys.stderr)
        return 2

    import contextlib

    from mlx_lm import load, stream_generate
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.sample_utils import make_sampler

    from ..backends import use_backend
    from .mlx_lm import use_paged_cache

    model, tokenizer = load(args.model)
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if args.chat and getattr(tokenizer, "chat_template", None):
        prompt = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    try:
        handle = use_paged_cache(model, block_size=args.block_size, num_blocks=args.num_blocks,
                                 k_bits=args.k_bits, v_bits=args.v_bits)
    except (NotImplementedError, ValueError) as e:
        print(f"kvmetal generate: {e}", file=sys.stderr)
        return 2
    backend = use_backend(args.backend) if args.backend else contextlib.nullcontext()
    with handle, backend:
        cache = make_prompt_cache(model)
        last = None
        for last in stream_generate(model, tokenizer, prompt, max_tokens=args.max_tokens,
                                    sampler=make_sampler(temp=args.temp), prompt_cache=cache):
            print(last.text, end="", flush=True)
        print()
        model_cache = cache[0].model_cache
        if last is not None:
            print(f"prompt: {last.prompt_tokens} tokens, {last.prompt_tps:.1f} tokens/s; "
                  f"generation: {last.generation_tokens} tokens, {last.generation_tps:.1f} tokens/s",
                  file=sys.stderr)
        print(f"kv cache: {model_cache.used_bytes / 2**20:.2f} MiB in blocks owned, pool "
              f"{model_cache.nbytes / 2**20:.2f} MiB ({model_cache.stats()['num_blocks']} blocks of "
              f"{args.block_size} tokens)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
