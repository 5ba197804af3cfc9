"""Time the Engine's steps directly (no server): 8 streams decode while a long prompt is
chunked in, for each token budget given.

    python bench/engine_steps.py                          # the tiny random llama
    python bench/engine_steps.py --model DIR --budgets 128,256,512,1024 --long 2000
    python bench/engine_steps.py --budgets 256 --modes sync,async   # pipelined steps against synchronous

Per budget: steps until the long prompt's first token, the mean time of a step that
carried a prefill chunk (what each decode stream waits per token meanwhile), of a
decode-only step, the prefill rate (long-prompt tokens per second of the steps that
carried them), and where step time went: host (scheduling, block reservation, index
arrays, graph build), device (evaluating the pass) and sampling, from
``Engine.step_seconds``. Greedy; one warm-up pass per budget is not timed. ``--modes``
runs each budget with synchronous steps, pipelined ones (``Engine(async_steps=True)``:
then "device" is only the wait that did not overlap the host's work) or both,
alternating.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


def load(model_dir):
    if model_dir is None:
        from kvmetal.integrations import tiny_models

        return tiny_models.build("llama", max_position_embeddings=16384)
    from mlx_lm import load as mlx_load

    return mlx_load(model_dir)[0]


def run_budget(model, budget: int, long_len: int, streams: int, vocab: int, async_steps: bool = False) -> dict:
    import numpy as np

    from kvmetal.engine.engine import Engine

    rng = np.random.default_rng(0)
    with Engine(model, max_num_batched_tokens=budget, async_steps=async_steps) as engine:
        decoders = [engine.add_request([int(t) for t in rng.integers(0, vocab, 24)], max_tokens=10_000)
                    for _ in range(streams)]
        while sum(r.decoding for r in engine.running) < streams:
            engine.step()
        for _ in range(3):  # decode-only steps
            engine.step()
        long = engine.add_request([int(t) for t in rng.integers(0, vocab, long_len)], max_tokens=1)
        before = dict(engine.step_seconds)
        chunk_steps, steps = [], 0
        while not engine.requests[long].finished:
            start = time.perf_counter()
            events = engine.step()
            chunk_steps.append(time.perf_counter() - start)
            steps += 1
            assert {e.request_id for e in events} >= set(decoders), "a stream got no token"
        during = {k: engine.step_seconds[k] - before[k] for k in before}
        decode_steps = []
        for _ in range(5):
            start = time.perf_counter()
            engine.step()
            decode_steps.append(time.perf_counter() - start)
    return {"budget": budget, "mode": "async" if async_steps else "sync", "steps_to_first_token": steps, "chunk_step_ms": 1e3 * statistics.mean(chunk_steps),
            "decode_step_ms": 1e3 * statistics.median(decode_steps),
            "prefill_tokens_per_s": long_len / sum(chunk_steps), "ttft_s": sum(chunk_steps),
            "host_ms_per_step": 1e3 * during["host"] / steps, "device_ms_per_step": 1e3 * during["device"] / steps,
            "sample_ms_per_step": 1e3 * during["sample"] / steps}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: the tiny random llama)")
    parser.add_argument("--budgets", default="128,256,512,1024", help="max_num_batched_tokens values")
    parser.add_argument("--long", type=int, default=2000, help="long prompt tokens (default 2000)")
    parser.add_argument("--streams", type=int, default=8, help="decode streams (default 8)")
    parser.add_argument("--modes", default="sync", help="sync, async or sync,async (default sync)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    model = load(args.model)
    vocab = model.args.vocab_size
    budgets = [int(b) for b in args.budgets.split(",")]
    modes = [m.strip() for m in args.modes.split(",")]
    if not modes or any(m not in ("sync", "async") for m in modes):
        parser.error(f"--modes takes sync and/or async, got {args.modes!r}")
    run_budget(model, budgets[0], min(args.long, 64), args.streams, vocab)  # warm-up
    results = [run_budget(model, b, args.long, args.streams, vocab, m == "async") for b in budgets for m in modes]
    cols = list(results[0])
    print(f"{args.streams} decode streams, a {args.long}-token prompt arrives")
    print("".join(f"{c:>22}" for c in cols))
    for r in results:
        print("".join(f"{r[c]:>22.1f}" if isinstance(r[c], float) else f"{r[c]:>22}" for c in cols))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
