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
import time
from pathlib import Path

TEXT = (
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Several residents "
    "said the lanes made the street safer for children who ride to school, while shop owners worried that "
    "the loss of parking spaces would keep customers away. The council agreed to count the number of "
    "cyclists and cars every week for three months and to ask the shop owners how their sales change. "
    "A final decision will be made in the spring, after the results are published on the city website."
)
TEXT_TYPOS = TEXT.replace("residents", "residnets").replace("customers", "custmers").replace(
    "decision", "decison").replace("published", "publishd")
NOTES = (
    "Meeting notes. Attendees: Anna, Ben, Carla. Anna presented the quarterly budget: spending on servers "
    "rose by ten percent, spending on travel fell by half. Ben asked whether the new storage system will "
    "be ready in March; Carla said the vendor promised delivery by the end of February. Action items: Anna "
    "sends the budget to the board, Ben tests the storage system, Carla schedules the next meeting."
)
CODE = Path(__file__).resolve().parents[1].joinpath("kvmetal", "integrations", "table_mirror.py").read_text()
CODE = CODE[:1800]

GROUNDED = [
    f"Summarize the following text in three sentences.\n\n{TEXT}",
    f"Fix the spelling mistakes in the following text and write it out in full.\n\n{TEXT_TYPOS}",
    f"Rewrite the following notes as a bulleted list, keeping every detail.\n\n{NOTES}",
    f"Continue the following Python file.\n\n{CODE}",
    f"Repeat the following Python code, adding a comment above every method.\n\n{CODE[:1200]}",
    f"Who sends the budget to the board, and what does Ben test? Quote the notes.\n\n{NOTES}",
    f"Rewrite the following text in the past tense.\n\n{TEXT}",
    f"Explain what the following code does, function by function.\n\n{CODE[:1200]}",
]
OPEN_CHAT = [
    "Write a short story about a dragon who learns to bake bread.",
    "What are the main benefits of regular exercise?",
    "Explain how a rainbow forms.",
    "Give me five ideas for a birthday party for a ten-year-old.",
    "Why is the sky blue?",
    "Write a poem about the ocean at night.",
    "What should I pack for a week-long hiking trip?",
    "Describe the life cycle of a butterfly.",
]


EXTRA = [  # with the 16 above: the 20 prompts of the greedy identity run (--identity)
    f"Translate the following text into simple English, sentence by sentence.\n\n{NOTES}",
    f"List every number that appears in the following text.\n\n{TEXT}",
    "How do airplanes stay in the air?",
    "Write a short letter inviting a friend to dinner.",
]


def encode(tokenizer, prompt: str) -> list:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True))


def run(model, tokenizer, prompts: list, *, spec, streams: int, max_tokens: int) -> dict:
    """Generate for ``prompts``, ``streams`` at a time; wall time, tokens and counters."""
    from kvmetal.integrations.engine import Engine

    outputs, seconds, prefill = [], 0.0, 0.0
    drafted = accepted = passes = decode_tokens = 0
    with Engine(model, speculative=spec, tokenizer=tokenizer) as engine:
        for start in range(0, len(prompts), streams):
            group = prompts[start:start + streams]
            begin = time.perf_counter()
            ids = [engine.add_request(p, max_tokens=max_tokens) for p in group]
            out = {i: [] for i in ids}
            started = None  # when every request of the group had its first token
            while engine.has_work():
                for event in engine.step():
                    if event.token is not None:
                        out[event.request_id].append(event.token)
                if started is None and all(out.values()):
                    started = time.perf_counter()
            seconds += time.perf_counter() - begin
            prefill += started - begin
            outputs += [out[i] for i in ids]
        drafted, accepted = engine.drafted_tokens, engine.accepted_tokens
        passes, decode_tokens = engine.decode_passes, engine.decode_tokens
    tokens = sum(len(o) for o in outputs)
    return {"outputs": outputs, "seconds": seconds, "tokens": tokens, "prefill_seconds": prefill,
            "decode_tokens_per_s": (tokens - len(outputs)) / (seconds - prefill),
            "drafted": drafted, "accepted": accepted,
            "decode_passes": passes, "decode_tokens": decode_tokens}


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

    from kvmetal.integrations.generate import resolve_model
    from kvmetal.integrations.speculative import SpeculativeConfig

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
