"""Replay one mixed chat workload against ``kvmetal serve`` and ``mlx_lm.server``, same run.

    python bench/serve_load.py                     # the tiny test model, built offline
    python bench/serve_load.py --model DIR --requests 128 --concurrency 16 --kv-memory 2GB
    python bench/serve_load.py --model DIR --long-prompts 4   # long prompts arrive beside 8 decode streams

The workload (fixed by --seed): chats that share a long system prompt, two-turn chats
whose second turn repeats the first (prefix reuse), and plain completions, with mixed
prompt and output lengths, all greedy. Each server runs as its own subprocess on the
same machine and gets the same requests from ``--concurrency`` streaming clients.

With ``--long-prompts N`` the workload is instead ``--requests`` short completions
decoding ``--max-tokens`` tokens each on ``--concurrency`` clients, while one more
client sends N prompts of ``--long-words`` words (2,000-6,000 tokens on SmolLM2's
tokenizer by default) one after another; the decode streams' TPOT shows how much the
long prefills stall them, the long prompts' TTFT how fast they get in.

Reported per server: requests/s, output tokens/s, p50/p95 time to first token (TTFT)
and time per output token (TPOT), prefix hit rate (cached prompt tokens / prompt
tokens, from the responses' usage), and for kvmetal the peak KV bytes against the cap
(the server's own peak gauges, from /metrics at the end). --json writes the numbers.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import socket
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WORDS = ("the paged cache keeps keys and values in fixed blocks so a long prompt does not need one large buffer "
         "servers batch many requests in one forward pass quantized keys keep eight bits what is the capital "
         "of france write a short poem about the sea summarize the following text").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sentence(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def workload(n: int, seed: int, max_tokens: int) -> list:
    """Request bodies (without "model"/"stream"): shared-system chats, two-turn chats, completions."""
    rng = random.Random(seed)
    system = "You are a helpful assistant. " + sentence(rng, 120)
    first_turns = [sentence(rng, rng.randint(10, 40)) for _ in range(max(1, n // 8))]
    bodies = []
    for i in range(n):
        out = rng.randint(max_tokens // 4, max_tokens)
        kind = i % 4
        if kind in (0, 1):
            question = sentence(rng, rng.randint(5, 30))
            messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
        elif kind == 2:
            turn = rng.choice(first_turns)
            messages = [{"role": "user", "content": turn}, {"role": "assistant", "content": sentence(rng, 30)},
                        {"role": "user", "content": sentence(rng, rng.randint(5, 20))}]
        else:
            prompt = sentence(rng, rng.randint(20, 200))
            bodies.append({"path": "/completions", "prompt": prompt, "max_tokens": out})
            continue
        bodies.append({"path": "/chat/completions", "messages": messages, "max_tokens": out})
    rng.shuffle(bodies)
    return bodies


def long_workload(n_decode: int, n_long: int, seed: int, max_tokens: int, words: tuple) -> tuple:
    """(decode bodies: short prompts, ``max_tokens`` out; long bodies: ``words`` words in, 8 out)."""
    rng = random.Random(seed)
    decode = [{"path": "/completions", "prompt": sentence(rng, rng.randint(10, 30)), "max_tokens": max_tokens}
              for _ in range(n_decode)]
    long = [{"path": "/completions", "prompt": sentence(rng, rng.randint(*words)), "max_tokens": 8}
            for _ in range(n_long)]
    return decode, long


def one_request(url: str, model: str, body: dict, on_text=None) -> dict:
    """Stream one request; returns its timings, usage and text, or the error that ended it
    (a stream silent for 600 s included). ``on_text(now)`` is called at each streamed text
    chunk; when it returns True the stream is closed there (the server sees a disconnect)."""
    import httpx

    try:
        return _stream(url, model, body, on_text)
    except httpx.HTTPError as e:
        return {"error": f"{type(e).__name__}: {e}"}


def _stream(url: str, model: str, body: dict, on_text=None) -> dict:
    import httpx

    payload = {k: v for k, v in body.items() if k != "path"}
    payload.update(model=model, stream=True, temperature=0.0, stream_options={"include_usage": True})
    start = time.perf_counter()
    first = last = None
    usage = None
    pieces = []
    with httpx.stream("POST", url + body["path"], json=payload, timeout=600) as r:
        if r.status_code != 200:
            r.read()
            return {"error": f"{r.status_code} {r.text[:200]}"}
        stop = False
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices") or []:
                text = choice.get("text") or (choice.get("delta") or {}).get("content")
                if text:
                    now = time.perf_counter()
                    first = first or now
                    last = now
                    pieces.append(text)
                    stop = stop or (on_text is not None and bool(on_text(now)))
            if stop:
                break
    end = time.perf_counter()
    usage = usage or {}
    out = usage.get("completion_tokens", 0)
    return {"ttft": (first or end) - start, "tpot": (last - first) / (out - 1) if first and out > 1 else None,
            "prompt_tokens": usage.get("prompt_tokens", 0), "completion_tokens": out,
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) or 0,
            "latency": end - start, "text": "".join(pieces)}


def percentile(values: list, q: float):
    values = sorted(v for v in values if v is not None)
    if not values:
        return None
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def replay(url: str, model: str, bodies: list, concurrency: int, long_bodies: list | None = None) -> dict:
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool, ThreadPoolExecutor(1) as long_pool:
        arriving = long_pool.map(lambda b: one_request(url, model, b), long_bodies or [])
        results = list(pool.map(lambda b: one_request(url, model, b), bodies))
        long_results = list(arriving)
    wall = time.perf_counter() - start
    summary = _summary(results + long_results, wall)
    if long_bodies:
        decode, long = _summary(results, wall), _summary(long_results, wall)
        summary.update(decode_tpot_p50_ms=decode["tpot_p50_ms"], decode_tpot_p95_ms=decode["tpot_p95_ms"],
                       long_ttft_p50_ms=long["ttft_p50_ms"], long_ttft_p95_ms=long["ttft_p95_ms"],
                       long_prompt_tokens=[r["prompt_tokens"] for r in long_results if "error" not in r])
    return summary


def _summary(results: list, wall: float) -> dict:
    ok = [r for r in results if "error" not in r]
    errors = [r["error"] for r in results if "error" in r]
    prompt = sum(r["prompt_tokens"] for r in ok)
    summary = {
        "requests": len(results), "errors": len(errors), "first_error": errors[0] if errors else None,
        "wall_s": wall, "requests_per_s": len(ok) / wall,
        "output_tokens_per_s": sum(r["completion_tokens"] for r in ok) / wall,
        "ttft_p50_ms": _ms(percentile([r["ttft"] for r in ok], 0.5)),
        "ttft_p95_ms": _ms(percentile([r["ttft"] for r in ok], 0.95)),
        "tpot_p50_ms": _ms(percentile([r["tpot"] for r in ok], 0.5)),
        "tpot_p95_ms": _ms(percentile([r["tpot"] for r in ok], 0.95)),
        "prompt_tokens": prompt, "output_tokens": sum(r["completion_tokens"] for r in ok),
        "prefix_hit_rate": sum(r["cached_tokens"] for r in ok) / prompt if prompt else 0.0,
        "mean_latency_s": statistics.mean(r["latency"] for r in ok) if ok else None,
    }
    return summary


def _ms(x):
    return None if x is None else 1e3 * x


def run_server(server, model: str, bodies: list, concurrency: int, metrics: bool, long_bodies=None) -> dict:
    """Start ``server`` (a ``ServerProcess``; it waits for /health), warm it up, replay, stop it.

    With ``metrics`` (kvmetal serve), the peak KV bytes come from the server's own peak
    gauges in one scrape at the end (they include the 4-token warm-up request)."""
    with server:
        one_request(server.url + "/v1", model, {"path": "/completions", "prompt": "warm up", "max_tokens": 4})
        result = replay(server.url + "/v1", model, bodies, concurrency, long_bodies)
        if metrics:
            import httpx

            from kvmetal.serve.metrics import parse

            m = parse(httpx.get(server.url + "/metrics").text)
            result.update(kv_cap_bytes=m["kvmetal_kv_cap_bytes"], preemptions=m["kvmetal_preemptions"],
                          peak_kv_used_bytes=m["kvmetal_kv_peak_used_bytes"],
                          peak_kv_pool_bytes=m["kvmetal_kv_peak_pool_bytes"])
        return result


def mlx_lm_process(model: str, log_path, *options) -> tuple:
    """(``mlx_lm.server`` on a free port as a ``ServerProcess``, the BLAS it runs on)."""
    from kvmetal.models import blas
    from kvmetal.serve.server import ServerProcess

    port = free_port()
    cmd = [sys.executable, "-m", "mlx_lm.server", "--model", model, "--host", "127.0.0.1", "--port", str(port),
           "--log-level", "WARNING", *map(str, options)]
    # The same float32 BLAS as kvmetal serve (which loads OpenBLAS itself, with half the
    # cores: its threads spin between calls): a baseline on MLX's bundled reference
    # BLAS would be ~10x slower at prefill, one with every core to OpenBLAS slower
    # at decode; neither a fair one.
    preload = blas.preload_value()
    if preload:
        cmd = ["env", f"LD_PRELOAD={preload}",
               f"OPENBLAS_NUM_THREADS={os.environ.get('OPENBLAS_NUM_THREADS') or blas.default_threads()}", *cmd]
    label = "openblas (LD_PRELOAD)" if preload else "mlx reference"
    return ServerProcess(model, port, command=cmd, log_path=log_path, start_timeout=300), label


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: build the tiny test model)")
    parser.add_argument("--requests", type=int, default=48, help="requests to replay (default 48)")
    parser.add_argument("--concurrency", type=int, default=8, help="clients at once (default 8)")
    parser.add_argument("--max-tokens", type=int, default=48, help="largest max_tokens in the mix (default 48)")
    parser.add_argument("--kv-memory", default="2MiB", help="kvmetal serve --kv-memory (default 2MiB)")
    parser.add_argument("--kvmetal-args", action="append",
                        help="more kvmetal serve options, e.g. '--k-bits 8 --v-bits 4'; given several times, each "
                             "is its own kvmetal server, all run in turn in every round")
    parser.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--skip-mlx-lm", action="store_true", help="only kvmetal serve")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--long-prompts", type=int, default=0,
                        help="long prompts that arrive one after another beside the decode streams (default 0: "
                             "the chat mix)")
    parser.add_argument("--long-words", default="1900,5650",
                        help="words per long prompt, LOW,HIGH (default 1900,5650: about 2,000-6,000 SmolLM2 tokens)")
    parser.add_argument("--rounds", type=int, default=1,
                        help="run the servers alternately this many times each (a shared host's noise shows)")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = args.model
        if model is None:
            from kvmetal.serve.tiny import build_model_dir

            model = str(build_model_dir(tmp / "tiny-llama", max_position_embeddings=8192))
        from kvmetal.serve.server import ServerProcess

        long_bodies = None
        if args.long_prompts:
            low, high = (int(w) for w in args.long_words.split(","))
            bodies, long_bodies = long_workload(args.requests, args.long_prompts, args.seed, args.max_tokens,
                                                (low, high))
        else:
            bodies = workload(args.requests, args.seed, args.max_tokens)
        results = {}
        variants = args.kvmetal_args or [""]
        for r in range(args.rounds):
            suffix = f" #{r + 1}" if args.rounds > 1 else ""
            for options in variants:
                kvmetal = ServerProcess(model, free_port(), "--log-level", "WARNING", "--kv-memory", args.kv_memory,
                                        *options.split(), log_path=tmp / "kvmetal.log", start_timeout=300)
                name = "kvmetal serve" + (f" [{options}]" if len(variants) > 1 else "")
                results[name + suffix] = run_server(kvmetal, model, bodies, args.concurrency, True, long_bodies)
                _save(results, args)
            if not args.skip_mlx_lm:
                mlx_lm, args.mlx_lm_blas = mlx_lm_process(model, tmp / "mlx_lm.log")
                results["mlx_lm.server" + suffix] = run_server(mlx_lm, model, bodies, args.concurrency, False,
                                                               long_bodies)
                _save(results, args)
    report(results, args)
    return 0


def _save(results: dict, args) -> None:
    """Write what is measured so far (a later server that fails loses nothing)."""
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


def report(results: dict, args) -> None:
    print(f"{args.requests} requests, {args.concurrency} concurrent, greedy, max_tokens <= {args.max_tokens}")
    cols = ["requests_per_s", "output_tokens_per_s", "ttft_p50_ms", "ttft_p95_ms", "tpot_p50_ms", "tpot_p95_ms",
            "prefix_hit_rate", "errors"]
    if args.long_prompts:
        cols += ["decode_tpot_p50_ms", "decode_tpot_p95_ms", "long_ttft_p50_ms", "long_ttft_p95_ms"]
    width = max([18] + [len(name) + 1 for name in results])
    print(f"{'server':<{width}}" + "".join(f"{c:>20}" for c in cols))
    for name, r in results.items():
        print(f"{name:<{width}}" + "".join(f"{_fmt(r.get(c)):>20}" for c in cols))
        if r.get("long_prompt_tokens"):
            print(f"{'':<{width}}long prompts: {r['long_prompt_tokens']} tokens")
    for name, kv in results.items():
        if name.startswith("kvmetal serve"):
            print(f"{name}: peak KV {kv['peak_kv_used_bytes'] / 2**20:.2f} MiB used "
                  f"(pool {kv['peak_kv_pool_bytes'] / 2**20:.2f} MiB) against a cap of "
                  f"{kv['kv_cap_bytes'] / 2**20:.2f} MiB; {int(kv['preemptions'])} preemptions")
    for name, r in results.items():
        if r["errors"]:
            print(f"{name}: first error: {r['first_error']}")


def _fmt(x) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.3f}" if x < 10 else f"{x:.1f}"
    return str(x)


if __name__ == "__main__":
    sys.exit(main())
