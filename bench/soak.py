"""Soak ``kvmetal serve``: many mixed, misbehaving clients against a tight KV cap, then check nothing leaked.

    python bench/soak.py --requests 2000 --concurrency 32        # the long run
    python bench/soak.py --requests 300 --json soak.json          # what CI runs (tests/test_serve_soak.py)

The server (the tiny test model unless --model; 127.0.0.1, a free port, ``--kv-memory``
of a few blocks so requests wait and are preempted, ``--max-queue`` and ``--timeout``
set) gets ``--requests`` requests from ``--concurrency`` client threads, each drawn
(by --seed) from a mix: completions and chats, streaming and not, prompts from a few
to a few hundred tokens (some too long for the cap), 1 to 64 output tokens, stop
strings, clients that disconnect mid-stream, clients that give up (a short read
timeout) while waiting, and invalid requests (malformed JSON, wrong types, an unknown
model, no prompt).

Checked, and reported:

- every request ends before its deadline (``--deadline`` seconds: none hangs);
- every valid request that the client did not abandon gets a complete answer (a
  finish reason, and ``[DONE]`` when streaming) or an OpenAI-style error body
  (``{"error": {"message", "type", ...}}``, also as an SSE event), counted by kind;
- every invalid request gets a 4xx with an OpenAI-style error body;
- once idle, ``/metrics`` shows no running or waiting request and no KV block owned:
  the pool holds nothing but published prefixes (owned 0, cached + free = total);
- the server's RSS after a warm-up phase (``--warmup`` requests, default a quarter of
  ``--requests``: measured, RSS rises fastest over the first few hundred requests,
  then levels off) grows less than ``--rss-tolerance`` (5%); RSS is also sampled every
  second, and its value at each quarter of the main phase is reported;
- SIGTERM then ends the server with exit status 0.

The exit status is 0 when every check passed; ``--json`` writes the figures.
"""
from __future__ import annotations

import argparse
import json
import random
import socket
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

WORDS = ("the paged cache keeps keys and values in fixed blocks so a long prompt does not need one large buffer "
         "servers batch many requests in one forward pass quantized keys keep eight bits what is the capital "
         "of france write a short poem about the sea summarize the following text").split()
KINDS = ("whole", "stream", "disconnect", "give_up", "invalid")
WEIGHTS = (0.36, 0.34, 0.1, 0.08, 0.12)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def plan(n: int, seed: int, model: str, max_tokens: int = 64) -> list:
    """``n`` (kind, path, body or raw bytes, extra) tuples."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = rng.choices(KINDS, WEIGHTS)[0]
        chat = rng.random() < 0.5
        words = rng.choice((3, 8, 20, 60, 120, 400 if rng.random() < 0.15 else 40))
        text = " ".join(rng.choice(WORDS) for _ in range(words))
        body = {"model": model, "max_tokens": rng.randint(1, max_tokens), "temperature": rng.choice((0.0, 0.0, 0.8)),
                "seed": i}
        if chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if rng.random() < 0.25:
            body["stop"] = [rng.choice(("e", " the", "s", "\n", "xyz"))]
        path = "/v1/chat/completions" if chat else "/v1/completions"
        if kind == "invalid":
            bad = rng.randrange(5)
            if bad == 0:
                body = b'{"prompt": "unterminated'
            elif bad == 1:
                body["max_tokens"] = "many"
            elif bad == 2:
                body["model"] = "no-such-model"
            elif bad == 3:
                body.pop("messages", None)
                body.pop("prompt", None)
            else:
                body["temperature"] = -1
        body_stream = kind in ("stream", "disconnect") or (kind == "invalid" and rng.random() < 0.5)
        if isinstance(body, dict):
            body["stream"] = body_stream
        extra = {"after_chunks": rng.randint(1, 4), "give_up_s": rng.uniform(0.02, 0.3)}
        out.append((kind, path, body, extra))
    return out


def _is_error(obj) -> bool:
    error = obj.get("error") if isinstance(obj, dict) else None
    return isinstance(error, dict) and isinstance(error.get("message"), str) and isinstance(error.get("type"), str)


def one(client, url: str, item, deadline_s: float) -> dict:
    """Run one planned request; returns {"outcome": ..., "latency": s, ...}."""
    import httpx

    kind, path, body, extra = item
    start = time.monotonic()
    deadline = start + deadline_s
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"content-type": "application/json"}
    timeout = httpx.Timeout(extra["give_up_s"] if kind == "give_up" else deadline_s)
    stream = isinstance(body, dict) and body.get("stream")
    result = {"kind": kind}
    try:
        with client.stream("POST", url + path, content=content, headers=headers, timeout=timeout) as r:
            if r.status_code != 200:
                r.read()
                try:
                    payload = r.json()
                except ValueError:
                    payload = None
                ok = _is_error(payload)
                result["outcome"] = f"http_{r.status_code}" if ok else f"bad_error_body_{r.status_code}"
                if kind == "invalid" and not 400 <= r.status_code < 500:
                    result["outcome"] = f"invalid_got_{r.status_code}"
                if not ok:
                    result["detail"] = r.text[:200]
            elif kind == "invalid":
                result["outcome"] = "invalid_accepted"
            elif not stream:
                r.read()
                payload = r.json()
                finish = (payload.get("choices") or [{}])[0].get("finish_reason")
                result["outcome"] = "complete" if finish in ("stop", "length") and payload.get("usage") else \
                    "incomplete"
            else:
                chunks, finish, done, error = 0, None, False, None
                for line in r.iter_lines():
                    if time.monotonic() > deadline:
                        result["outcome"] = "hang"
                        break
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    chunk = json.loads(line[6:])
                    if _is_error(chunk):
                        error = chunk["error"]["type"]
                        continue
                    chunks += 1
                    for choice in chunk.get("choices") or []:
                        finish = choice.get("finish_reason") or finish
                    if kind == "disconnect" and chunks >= extra["after_chunks"] and finish is None:
                        result["outcome"] = "disconnected"
                        break
                if "outcome" not in result:
                    if error is not None and done:
                        result["outcome"] = f"sse_error_{error}"
                    elif finish in ("stop", "length") and done:
                        result["outcome"] = "complete"
                    else:
                        result["outcome"] = "incomplete"
    except httpx.TimeoutException:
        result["outcome"] = "gave_up" if kind == "give_up" else "hang"
    except httpx.TransportError as e:
        result["outcome"] = "transport_error"
        result["detail"] = repr(e)[:200]
    if kind == "give_up" and result["outcome"] in ("complete", "incomplete"):
        result["outcome"] = "complete"  # it finished before the client gave up
    result["latency"] = time.monotonic() - start
    if result["latency"] > deadline_s + 5:
        result["outcome"] = "hang"
    return result


GOOD = {"complete", "disconnected", "gave_up"}


def _good(outcome: str) -> bool:
    return outcome in GOOD or outcome.startswith("http_") or outcome.startswith("sse_error_")


def run_phase(url: str, items: list, concurrency: int, deadline_s: float) -> list:
    import httpx

    local = threading.local()

    def work(item):
        if not hasattr(local, "client"):
            local.client = httpx.Client()
        return one(local.client, url, item, deadline_s)

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(work, items))


def wait_idle(url: str, timeout: float = 30) -> dict:
    import httpx

    from kvmetal.serve.metrics import parse

    end = time.monotonic() + timeout
    while True:
        m = parse(httpx.get(url + "/metrics", timeout=10).text)
        if (m["kvmetal_requests_running"] == 0 and m["kvmetal_requests_waiting"] == 0
                and m["kvmetal_kv_blocks_owned"] == 0):
            return m
        if time.monotonic() > end:
            return m
        time.sleep(0.05)


def percentile(values: list, q: float):
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))] if values else None


def soak(model_dir, *, requests: int, concurrency: int, seed: int = 0, cap_blocks: int = 24,
         deadline_s: float = 60.0, warmup: int | None = None, rss_tolerance: float = 0.05,
         max_tokens: int = 64, extra_args=(), log_path=None) -> dict:
    """Run the soak against a fresh server; returns the figures and ``failures`` (a list of strings)."""
    from kvmetal.serve.server import ServerProcess

    model_dir = str(model_dir)
    block_bytes = _block_bytes(model_dir)
    warmup = max(64, requests // 4) if warmup is None else warmup
    items = plan(warmup + requests, seed, model_dir, max_tokens)
    server = ServerProcess(model_dir, free_port(), "--log-level", "WARNING", "--kv-memory",
                           f"{cap_blocks * block_bytes}B", "--max-queue", str(4 * concurrency), "--timeout",
                           str(deadline_s / 2), "--shutdown-timeout", "5", *extra_args, log_path=log_path,
                           start_timeout=300)
    failures = []
    with server:
        pid = server.proc.pid
        t0 = time.monotonic()
        warm = run_phase(server.url, items[:warmup], concurrency, deadline_s)
        wait_idle(server.url)
        rss_start = rss_bytes(pid)
        samples, sampling = [], threading.Event()

        def sample():
            while not sampling.wait(1.0):
                samples.append(rss_bytes(pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        main = run_phase(server.url, items[warmup:], concurrency, deadline_s)
        sampling.set()
        sampler.join()
        idle = wait_idle(server.url)
        rss_end = rss_bytes(pid)
        wall = time.monotonic() - t0
        status = server.stop()
    results = warm + main
    outcomes: dict = {}
    for r in results:
        outcomes[r["outcome"]] = outcomes.get(r["outcome"], 0) + 1
    bad = [r for r in results if not _good(r["outcome"])]
    if bad:
        failures.append(f"{len(bad)} requests ended badly, e.g. {bad[:3]}")
    latencies = [r["latency"] for r in results if r["outcome"] == "complete"]
    blocks = {k: int(idle[f"kvmetal_kv_blocks_{k}"]) for k in ("total", "owned", "cached", "free")}
    if idle["kvmetal_requests_running"] or idle["kvmetal_requests_waiting"]:
        failures.append(f"still live at the end: {idle['kvmetal_requests_running']} running, "
                        f"{idle['kvmetal_requests_waiting']} waiting")
    if blocks["owned"] or idle["kvmetal_kv_used_bytes"]:
        failures.append(f"{blocks['owned']} KV blocks still owned at the end ({idle['kvmetal_kv_used_bytes']} bytes)")
    if blocks["cached"] + blocks["free"] != blocks["total"]:
        failures.append(f"block counts disagree: {blocks}")
    growth = rss_end / rss_start - 1
    if growth >= rss_tolerance:
        failures.append(f"RSS grew {100 * growth:.1f}% after warm-up ({rss_start} -> {rss_end} bytes)")
    if status != 0:
        failures.append(f"the server exited {status} on SIGTERM")
    finished = {k.split('"')[1]: int(v) for k, v in idle.items() if k.startswith("kvmetal_requests_finished{")}
    rejected = {k.split('"')[1]: int(v) for k, v in idle.items() if k.startswith("kvmetal_http_rejected{")}
    return {
        "requests": len(results), "warmup_requests": warmup, "concurrency": concurrency, "wall_s": wall,
        "outcomes": dict(sorted(outcomes.items())),
        "latency_p50_s": percentile(latencies, 0.5), "latency_p99_s": percentile(latencies, 0.99),
        "rss_start_bytes": rss_start, "rss_end_bytes": rss_end, "rss_growth": growth,
        "rss_quarters_bytes": [samples[min(len(samples) - 1, (len(samples) * q) // 4)] for q in (1, 2, 3, 4)]
        if samples else [],
        "blocks_at_end": blocks, "preemptions": int(idle["kvmetal_preemptions"]),
        "finished_by_reason": finished, "http_rejected": rejected, "exit_status": status,
        "failures": failures,
    }


def _block_bytes(model_dir: str) -> int:
    """Bytes of one float32 KV block of 16 tokens across the model's layers."""
    config = json.loads((Path(model_dir) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or config["num_attention_heads"]
    return config["num_hidden_layers"] * 2 * kv_heads * 16 * head_dim * 4


def report(figures: dict) -> None:
    f = figures
    print(f"{f['requests']} requests ({f['warmup_requests']} warm-up) from {f['concurrency']} clients "
          f"in {f['wall_s']:.1f} s")
    print("outcomes: " + ", ".join(f"{k} {v}" for k, v in f["outcomes"].items()))
    p50, p99 = f["latency_p50_s"], f["latency_p99_s"]
    if p50 is not None:
        print(f"latency of complete answers: p50 {1e3 * p50:.0f} ms, p99 {1e3 * p99:.0f} ms")
    print(f"RSS after warm-up {f['rss_start_bytes'] / 2**20:.1f} MiB -> end {f['rss_end_bytes'] / 2**20:.1f} MiB "
          f"({100 * f['rss_growth']:+.2f}%); at each quarter of the run: "
          + ", ".join(f"{b / 2**20:.1f}" for b in f["rss_quarters_bytes"]) + " MiB")
    print(f"blocks at the end: {f['blocks_at_end']}; {f['preemptions']} preemptions; "
          f"finished by reason {f['finished_by_reason']}; refused {f['http_rejected']}")
    print(f"exit status on SIGTERM: {f['exit_status']}")
    print("PASS" if not f["failures"] else "FAIL:\n  " + "\n  ".join(f["failures"]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: build the tiny test model)")
    parser.add_argument("--requests", type=int, default=2000, help="requests after the warm-up (default 2000)")
    parser.add_argument("--concurrency", type=int, default=32, help="client threads (default 32)")
    parser.add_argument("--cap-blocks", type=int, default=24, help="--kv-memory in 16-token float32 blocks")
    parser.add_argument("--max-tokens", type=int, default=64, help="largest max_tokens in the mix (default 64)")
    parser.add_argument("--deadline", type=float, default=60.0, help="seconds a request may take (default 60)")
    parser.add_argument("--rss-tolerance", type=float, default=0.05, help="RSS growth allowed (default 0.05)")
    parser.add_argument("--warmup", type=int, help="warm-up requests (default: a quarter of --requests, >= 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from kvmetal.serve.tiny import build_model_dir

            model = build_model_dir(Path(tmp) / "tiny-llama")
        figures = soak(model, requests=args.requests, concurrency=args.concurrency, seed=args.seed,
                       cap_blocks=args.cap_blocks, deadline_s=args.deadline, rss_tolerance=args.rss_tolerance,
                       max_tokens=args.max_tokens, warmup=args.warmup,
                       log_path=Path(tmp) / "server.log")
    report(figures)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    return 0 if not figures["failures"] else 1


if __name__ == "__main__":
    sys.exit(main())
