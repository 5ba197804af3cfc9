"""Speculative decoding by prompt lookup (issue 34): tokens/s with and without, same run.

    python bench/speculative.py                              # SmolLM2-135M-Instruct (the default model)
    python bench/speculative.py --max-tokens 128 --json bench/speculative_smollm2.json

Two prompt sets, chat-templated, greedy: input-grounded (summarise or edit a given text,
continue or edit a given code file: the answer copies from the prompt) and open chat
(questions with no text to copy from). Each set runs with 1 stream (each prompt alone,
one after the other) and 8 streams (all 8 at once), plain and with ``--speculative``,
alternating per repetition. Per cell: generated tokens per second of wall time (prefill
included: the same prompts either way), the same after each group's first tokens (decode
only: what speculation changes), acceptance rate (accepted / drafted), tokens per
decode pass (per request), and whether every output equals the plain greedy output.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path

from kvmetal.benchmarks.speculative import EXTRA, GROUNDED, OPEN_CHAT, encode, run


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=2, help="alternating plain/speculative runs per cell")
    parser.add_argument("--draft", type=int, default=4, help="num_draft_tokens")
    parser.add_argument("--streams", default="1,8")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--identity", action="store_true",
                        help="only check greedy identity over 20 prompts (8 streams), and record it in --json")
    args = parser.parse_args(argv)

    from kvmetal.models.blas import use_openblas

    use_openblas()  # before MLX loads: float32 matmuls on OpenBLAS, as kvmetal's commands run them
    from mlx_lm import load

    from kvmetal.commands.common import resolve_model
    from kvmetal.engine.proposers import SpeculativeConfig

    model_dir = resolve_model(args.model)
    model, tokenizer = load(str(model_dir))
    spec = SpeculativeConfig(num_draft_tokens=args.draft)
    sets = {"grounded": [encode(tokenizer, p) for p in GROUNDED], "open_chat": [encode(tokenizer, p) for p in OPEN_CHAT]}
    if args.identity:
        prompts = [encode(tokenizer, p) for p in GROUNDED + OPEN_CHAT + EXTRA]
        plain = run(model, tokenizer, prompts, spec=None, streams=8, max_tokens=args.max_tokens)
        fast = run(model, tokenizer, prompts, spec=spec, streams=8, max_tokens=args.max_tokens)
        same = [a == b for a, b in zip(plain["outputs"], fast["outputs"])]
        identity = {"prompts": len(prompts), "identical": sum(same), "max_tokens": args.max_tokens,
                    "generated_tokens": fast["tokens"], "acceptance_rate": fast["accepted"] / max(fast["drafted"], 1),
                    "tokens_per_pass": fast["decode_tokens"] / fast["decode_passes"]}
        print(f"greedy identity: {sum(same)}/{len(prompts)} prompts identical", flush=True)
        if args.json:
            path = Path(args.json)
            result = json.loads(path.read_text()) if path.exists() else {}
            result["identity"] = identity
            path.write_text(json.dumps(result, indent=2) + "\n")
        return 0 if all(same) else 1
    run(model, tokenizer, sets["open_chat"][:2], spec=None, streams=2, max_tokens=8)  # warm-up
    cells = []
    for name, prompts in sets.items():
        for streams in [int(s) for s in args.streams.split(",")]:
            runs = {"plain": [], "speculative": []}
            for _ in range(args.repeats):
                for mode, config in (("plain", None), ("speculative", spec)):
                    runs[mode].append(run(model, tokenizer, prompts, spec=config, streams=streams,
                                          max_tokens=args.max_tokens))
            plain, fast = runs["plain"], runs["speculative"]
            rate = {m: statistics.median(r["tokens"] / r["seconds"] for r in rs) for m, rs in runs.items()}
            decode = {m: statistics.median(r["decode_tokens_per_s"] for r in rs) for m, rs in runs.items()}
            last = fast[-1]
            identical = sum(a == b for a, b in zip(plain[-1]["outputs"], last["outputs"]))
            cell = {"prompts": name, "streams": streams, "plain_tokens_per_s": rate["plain"],
                    "speculative_tokens_per_s": rate["speculative"],
                    "speedup": rate["speculative"] / rate["plain"],
                    "plain_decode_tokens_per_s": decode["plain"], "speculative_decode_tokens_per_s": decode["speculative"],
                    "decode_speedup": decode["speculative"] / decode["plain"],
                    "runs": {m: [{k: v for k, v in r.items() if k != "outputs"} for r in rs] for m, rs in runs.items()},
                    "acceptance_rate": last["accepted"] / last["drafted"] if last["drafted"] else 0.0,
                    "drafted": last["drafted"], "accepted": last["accepted"],
                    "tokens_per_pass": last["decode_tokens"] / last["decode_passes"],
                    "generated_tokens": last["tokens"], "greedy_identical": f"{identical}/{len(prompts)}"}
            cells.append(cell)
            print(f"{name:9s} {streams} stream(s): plain {rate['plain']:7.1f} tok/s, speculative "
                  f"{rate['speculative']:7.1f} tok/s (x{cell['speedup']:.2f}); after the first token "
                  f"{decode['plain']:.1f} vs {decode['speculative']:.1f} (x{cell['decode_speedup']:.2f}); acceptance "
                  f"{cell['acceptance_rate']:.2f}, tokens/pass {cell['tokens_per_pass']:.2f}, "
                  f"identical {cell['greedy_identical']}", flush=True)
    result = {"model": str(model_dir), "machine": platform.platform(), "max_tokens": args.max_tokens,
              "repeats": args.repeats, "config": spec.__dict__, "cells": cells}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
