"""Agent sessions: long, growing chats that leave and come back, against ``kvmetal serve`` and ``mlx_lm.server``.

    python bench/agent_sessions.py                  # SmolLM2 float32, all four configs (~35 min on 2 busy cores)
    python bench/agent_sessions.py --quick          # tiny sizes: a smoke test of a few minutes
    python bench/agent_sessions.py --configs hot,tier --json out.json

The workload (fixed by --seed): --sessions agent sessions of --turns turns each. Every
session starts with the same system prompt (~400 tokens); each turn appends a user message
of Python's own documentation (``pydoc_data.topics``, a seeded order, no chunk shared
between sessions) and the server's greedy answer (--max-tokens) as the assistant message,
so that the last turn's prompt is about --context-tokens tokens. The shape is an agent's:
the first turn brings the task and its files (most of the context), every later turn a
step of --turn-tokens tokens (256 by default; 0 gives every turn an equal chunk, where a
returning turn's own new tokens, not its history, dominate its time to first token). Turns
run one at a time, round-robin over the sessions (session 0 turn 0, session 1 turn 0, ...,
session 0 turn 1, ...), --idle seconds apart: between two turns of one session the other
sessions' contexts pass through the server, so under a KV cap that holds about one session
(plus the running stream) a returning session's blocks have left the memory pool. One
background completion (--bg-tokens tokens, restarted when it ends) streams all along: its
inter-token gaps are the TPOT of a running stream while sessions come back.

Configurations (--configs; each a fresh server subprocess, same workload):
  hot      kvmetal serve --kv-memory HOT, a pool that holds every session at once: nothing is evicted
           (not "no cap": a pool that grows on demand recycles cached prefix blocks before it grows,
           so it evicts as a capped one does at its peak size)
  no-tier  kvmetal serve --kv-memory CAP: a returning session recomputes its evicted context
  tier     kvmetal serve --kv-memory CAP --prompt-cache-dir <fresh dir> --prompt-cache-max-bytes DISK
           (finished prefixes go to disk; a server that reads evicted blocks back on demand restores them)
  mlx_lm   mlx_lm.server --prompt-cache-bytes CAP, on the same OpenBLAS as kvmetal (serve_load.py)
CAP defaults to the KV bytes of --context-tokens + --max-tokens + the background stream + 256
tokens (per-token bytes from the model's config.json); HOT to every session's context plus
room; DISK to twice every session's context. The round-robin evicts a returning session's
blocks only when the other sessions' new tokens between its two turns overflow CAP: with
--sessions 3 --turns 2 the first turns (half the context each) already do, with --turns 3
the first round still fits (3 x a third) and turn 1 comes back to a warm pool.

mlx_lm 0.32.2's server has ``--prompt-cache-size`` (a count of cached KV caches, default 10)
and ``--prompt-cache-bytes`` (a byte bound: after admitting a request it trims its LRU prompt
cache to the bound minus the running requests' KV bytes, i.e. the bound covers live and cached
KV together, as --kv-memory does); the byte bound is the one comparable to CAP, so it gets
CAP in bytes (its size parser takes no MiB/GiB, so plain bytes) and the count keeps its default.
Its streamed usage reports ``prompt_tokens_details.cached_tokens`` (the prompt-cache hit), so
recomputed tokens are prompt_tokens - cached_tokens for every server.

Reported per configuration: TTFT p50/p95 of first turns, of returning turns and of returning
turns whose prompt has >= 8,000 tokens ("8K": SmolLM2's context is 8,192 tokens, answer
included); per turn index the prompt tokens, TTFT and recomputed prompt tokens; the replay's
wall time; the background stream's inter-token gap p50/p95 (all of it, and the gaps that end
while a returning turn waits for its first token); for kvmetal the /metrics deltas over the
replay (``kvmetal_prompt_cache_restore*`` counters count as n/a on a server that lacks them);
ratios (returning-turn TTFT p50 tier / no-tier and tier / mlx_lm, background TPOT p95
tier / hot, recomputed / restored tokens); and how many turn answers equal the ``hot`` run's
(all turns, and those whose history still equals hot's: greedy decoding should agree there).
--json writes it all, with the command line, model, backend, host and date.

The servers run the kvmetal this process imports (its tree and commit go in the JSON): to
measure another checkout, put it first on PYTHONPATH with the installed extension linked
into it, SKBUILD_EDITABLE_SKIP set to the editable install's build directory (its import
hook wins over PYTHONPATH otherwise) and LD_LIBRARY_PATH to mlx/lib (the extension's RUNPATH
is relative to where it lies).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_load import free_port, mlx_lm_process, one_request, percentile  # noqa: E402

CONFIGS = ("hot", "no-tier", "tier", "mlx_lm")
LONG = 8000  # a returning turn of at least this many prompt tokens is "long" (8K)
TEMPLATE = 8  # chat-template tokens around one message (<|im_start|>role\n ... <|im_end|>\n), a bit over
SYSTEM_HEAD = ("You are a coding agent working in a Python repository. The user pastes documentation as the work "
               "goes on; answer each step in one or two short sentences. Reference material follows.\n\n")
BG_PROMPT = "The history of the Python programming language, told as a long story, begins in"
COUNTERS = ("prompt_tokens", "prompt_tokens_cached", "preemptions", "prompt_cache_saved_blocks",
            "prompt_cache_restores", "prompt_cache_restored_tokens", "prompt_cache_restore_seconds",
            "prompt_cache_restore_bytes", "prompt_cache_restore_misses", "prompt_cache_restore_missed_tokens")
ENV = ("PYTHONPATH", "SKBUILD_EDITABLE_SKIP", "LD_LIBRARY_PATH", "OPENBLAS_NUM_THREADS", "KVMETAL_NO_OPENBLAS")
GAUGES = ("kv_cap_bytes", "kv_peak_pool_bytes", "kv_peak_used_bytes", "prompt_cache_bytes")


# ---- the workload (no server: tests/test_serve_agent_bench.py runs these) ----

def word_count(text: str) -> int:
    """A stand-in token count (tests; no tokenizer needed)."""
    return len(text.split())


def source_lines(seed: int) -> list:
    """Non-blank lines of Python's topic documentation, topics in a seeded order."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    random.Random(seed).shuffle(names)
    return [line.rstrip() for name in names for line in topics[name].splitlines() if line.strip()]


def take_tokens(lines: list, start: int, target: int, count) -> tuple:
    """(text of the lines from ``start`` on whose count just reaches ``target``, the next start).
    Lines are added by their own counts (a few % over their share of the joined text),
    then the joined text is counted again until it reaches the target."""
    taken, i = [], start
    while (have := count("\n".join(taken)) if taken else 0) < target:
        added = 0
        while added < target - have:
            if i - start >= len(lines):
                raise ValueError(f"the source text holds fewer than {target} tokens")
            taken.append(lines[i % len(lines)])
            added += count(lines[i % len(lines)] + "\n")
            i += 1
    return "\n".join(taken), i


def build_workload(sessions: int, turns: int, context_tokens: int, answer_tokens: int, seed: int,
                   count=word_count, system_tokens: int = 400, turn_tokens: int = 0) -> dict:
    """The fixed part of the workload: one system prompt, and each session's user messages.

    User messages are sized so that system + every message + every answer (at most
    ``answer_tokens``) + the template stays about ``context_tokens`` at the last turn:
    with ``turn_tokens`` every turn after the first brings a message of that many tokens
    and the first turn the rest (an agent's task and files, then short steps); with 0
    all turns bring equal chunks."""
    lines = source_lines(seed)
    body, at = take_tokens(lines, 0, system_tokens - count(SYSTEM_HEAD), count)
    system = SYSTEM_HEAD + body
    n_system = count(system) + TEMPLATE
    room = context_tokens - n_system - turns * (answer_tokens + 2 * TEMPLATE)
    if turn_tokens:
        chunks = [room - (turns - 1) * turn_tokens] + [turn_tokens] * (turns - 1)
    else:
        chunks = [room // turns] * turns
    if min(chunks) < 16:
        raise ValueError(f"--context-tokens {context_tokens} leaves {min(chunks)} tokens for a user message "
                         f"({turns} turns, a {n_system}-token system prompt, --turn-tokens {turn_tokens})")
    chunk = chunks[0]
    users, user_tokens = [], []
    for s in range(sessions):
        texts, sizes = [], []
        for t in range(turns):
            head = f"Session {s}, step {t + 1}: read this and say what to do next.\n\n"
            text, at = take_tokens(lines, at, chunks[t] - count(head), count)
            text = head + text
            texts.append(text)
            sizes.append(count(text) + TEMPLATE)
        users.append(texts)
        user_tokens.append(sizes)
    return {"system": system, "system_tokens": n_system, "users": users, "user_tokens": user_tokens,
            "answer_tokens": answer_tokens, "chunk_tokens": chunk}


def schedule(sessions: int, turns: int) -> list:
    """Round-robin: every session's turn 0, then every session's turn 1, ..."""
    return [(s, t) for t in range(turns) for s in range(sessions)]


def context_estimate(workload: dict, s: int, t: int) -> int:
    """Prompt tokens of turn ``t`` of session ``s`` by the workload's count, answers at their
    most (the server's prompt_tokens is the real figure)."""
    answers = t * (workload["answer_tokens"] + TEMPLATE)
    return workload["system_tokens"] + sum(workload["user_tokens"][s][:t + 1]) + answers + TEMPLATE


def messages(workload: dict, s: int, t: int, answers: dict) -> list:
    """The chat of turn ``t``: system, then each earlier turn's user message and the answer
    this server gave it, then this turn's user message."""
    out = [{"role": "system", "content": workload["system"]}]
    for k in range(t):
        out += [{"role": "user", "content": workload["users"][s][k]},
                {"role": "assistant", "content": answers[(s, k)]}]
    return out + [{"role": "user", "content": workload["users"][s][t]}]


# ---- the replay ----

class Background:
    """One running completion stream, restarted when it ends, until ``stop()``: its
    inter-token gaps (one streamed chunk per token) are the running streams' TPOT."""

    def __init__(self, url: str, model: str, tokens: int):
        self.body = {"path": "/completions", "prompt": BG_PROMPT, "max_tokens": tokens}
        self.url, self.model = url, model
        self.gaps = []  # (time the gap ended, seconds)
        self.requests, self.errors = 0, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "Background":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            last = [None]

            def on_text(now):
                if last[0] is not None:
                    self.gaps.append((now, now - last[0]))
                last[0] = now
                return self._stop.is_set()  # True closes the stream: the server sees a disconnect

            result = one_request(self.url, self.model, self.body, on_text=on_text)
            self.requests += 1
            if "error" in result:
                self.errors.append(result["error"])
                self._stop.wait(1.0)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=660)


def scrape(url: str) -> dict:
    """/metrics as {name without kvmetal_: value}; {} when the server has none (mlx_lm.server)."""
    import httpx

    try:
        r = httpx.get(url + "/metrics", timeout=30)
    except httpx.HTTPError:
        return {}
    if r.status_code != 200:
        return {}
    out = {}
    for line in r.text.splitlines():
        if line.startswith("kvmetal_") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            out[name.removeprefix("kvmetal_")] = float(value)
    return out


def replay(url: str, model: str, workload: dict, idle: float, bg_tokens: int) -> dict:
    """Every turn in round-robin order, one at a time, beside the background stream."""
    sessions, turns = len(workload["users"]), len(workload["users"][0])
    answers, records = {}, []
    bg = Background(url, model, bg_tokens).start()
    time.sleep(1.0)  # let the stream get going: the first turn then already meets a running stream
    start = time.perf_counter()
    for i, (s, t) in enumerate(schedule(sessions, turns)):
        if i and idle:
            time.sleep(idle)
        body = {"path": "/chat/completions", "messages": messages(workload, s, t, answers),
                "max_tokens": workload["answer_tokens"]}
        sent = time.perf_counter()
        r = one_request(url, model, body)
        answers[(s, t)] = r.get("text", "")
        rec = {"session": s, "turn": t, "sent_s": sent - start, "estimate": context_estimate(workload, s, t)}
        if "error" in r:
            rec["error"] = r["error"]
        else:
            rec.update(ttft_s=r["ttft"], latency_s=r["latency"], prompt_tokens=r["prompt_tokens"],
                       cached_tokens=r["cached_tokens"], recomputed=r["prompt_tokens"] - r["cached_tokens"],
                       completion_tokens=r["completion_tokens"], answer=r["text"])
            rec["first_token_s"] = rec["sent_s"] + r["ttft"]
        records.append(rec)
        print(f"  session {s} turn {t}: " + (f"error {rec['error']}" if "error" in rec else
              f"{rec['prompt_tokens']} prompt tokens, {rec['cached_tokens']} cached, TTFT {rec['ttft_s']:.2f} s"),
              file=sys.stderr, flush=True)
    wall = time.perf_counter() - start
    bg.stop()
    gaps = [(end - start, gap) for end, gap in bg.gaps if end >= start]
    return {"turns": records, "wall_s": wall, "bg_gaps": gaps, "bg_requests": bg.requests, "bg_errors": bg.errors}


# ---- the summary ----

def _p(values: list, q: float):
    return percentile(list(values), q)


def _ms(x):
    return None if x is None else 1e3 * x


def summarize(run: dict, before: dict, after: dict) -> dict:
    ok = [r for r in run["turns"] if "error" not in r]
    first = [r["ttft_s"] for r in ok if r["turn"] == 0]
    back = [r for r in ok if r["turn"] > 0]
    long = [r["ttft_s"] for r in back if r["prompt_tokens"] >= LONG]
    # A gap that ends while a returning turn waits for its first token: the stall a returning session causes.
    windows = [(r["sent_s"], r["first_token_s"]) for r in back]
    during = [g for end, g in run["bg_gaps"] if any(a <= end <= b for a, b in windows)]
    gaps = [g for _, g in run["bg_gaps"]]
    out = {
        "wall_s": run["wall_s"], "turns": len(run["turns"]), "errors": len(run["turns"]) - len(ok),
        "first_ttft_p50_s": _p(first, 0.5), "first_ttft_p95_s": _p(first, 0.95),
        "return_ttft_p50_s": _p([r["ttft_s"] for r in back], 0.5),
        "return_ttft_p95_s": _p([r["ttft_s"] for r in back], 0.95),
        "long_return_turns": len(long), "long_return_ttft_p50_s": _p(long, 0.5),
        "long_return_ttft_p95_s": _p(long, 0.95),
        "recomputed_tokens": sum(r["recomputed"] for r in ok),
        "return_recomputed_tokens": sum(r["recomputed"] for r in back),
        "bg_tpot_p50_ms": _ms(_p(gaps, 0.5)), "bg_tpot_p95_ms": _ms(_p(gaps, 0.95)),
        "bg_tpot_p95_during_returns_ms": _ms(_p(during, 0.95)), "bg_gaps": len(gaps),
        "bg_requests": run["bg_requests"], "bg_errors": run["bg_errors"][:3],
        "per_turn": per_turn(ok),
    }
    if before or after:
        out["metrics_delta"] = {name: (after[name] - before[name] if name in after and name in before else None)
                                for name in COUNTERS}
        out["metrics_end"] = {name: after.get(name) for name in GAUGES}
    return out


def per_turn(ok: list) -> list:
    """Per turn index: prompt tokens, TTFT and recomputed tokens over the sessions."""
    rows = []
    for t in sorted({r["turn"] for r in ok}):
        rs = [r for r in ok if r["turn"] == t]
        ttft = [r["ttft_s"] for r in rs]
        rows.append({"turn": t, "prompt_tokens_mean": sum(r["prompt_tokens"] for r in rs) / len(rs),
                     "ttft_p50_s": _p(ttft, 0.5), "ttft_p95_s": _p(ttft, 0.95),
                     "recomputed_mean": sum(r["recomputed"] for r in rs) / len(rs)})
    return rows


def compare_answers(runs: dict) -> dict:
    """Per config: turn answers equal to hot's, of all turns and of the turns whose earlier
    answers (so whose prompt) all equal hot's too."""
    if "hot" not in runs:
        return {}
    hot = {(r["session"], r["turn"]): r.get("answer") for r in runs["hot"]["turns"]}
    out = {}
    for name, run in runs.items():
        equal = same_history = equal_same_history = 0
        diverged = set()
        for r in sorted(run["turns"], key=lambda r: (r["session"], r["turn"])):
            key, same = (r["session"], r["turn"]), r["session"] not in diverged
            hit = r.get("answer") is not None and r.get("answer") == hot.get(key)
            equal += hit
            same_history += same
            equal_same_history += hit and same
            if not hit:
                diverged.add(r["session"])
        out[name] = {"equal": equal, "turns": len(run["turns"]), "equal_same_history": equal_same_history,
                     "same_history": same_history}
    return out


def _ratio(a, b):
    return None if a is None or b is None or not b else a / b


def ratios(results: dict) -> dict:
    def get(name, key):
        return (results.get(name) or {}).get(key)

    ttft = "return_ttft_p50_s"
    restored = (get("tier", "metrics_delta") or {}).get("prompt_cache_restored_tokens")
    return {
        "return_ttft_p50_tier_over_no_tier": _ratio(get("tier", ttft), get("no-tier", ttft)),
        "return_ttft_p50_tier_over_mlx_lm": _ratio(get("tier", ttft), get("mlx_lm", ttft)),
        "return_ttft_p50_tier_over_hot": _ratio(get("tier", ttft), get("hot", ttft)),
        "bg_tpot_p95_tier_over_hot": _ratio(get("tier", "bg_tpot_p95_ms"), get("hot", "bg_tpot_p95_ms")),
        # tokens a returning tier turn still computed, per token it read back from disk
        "tier_recomputed_over_restored": _ratio(get("tier", "return_recomputed_tokens"), restored),
        # what no-tier recomputed on return, per token the tier restored instead
        "no_tier_recomputed_over_tier_restored": _ratio(get("no-tier", "return_recomputed_tokens"), restored),
    }


# ---- running the servers ----

def kv_bytes_per_token(model: str) -> int:
    """K and V bytes of one token over every layer (float32 weights: float32 KV, else 16-bit)."""
    c = json.loads((Path(model) / "config.json").read_text())
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    itemsize = 4 if c.get("torch_dtype") == "float32" else 2
    return c["num_hidden_layers"] * c.get("num_key_value_heads", c["num_attention_heads"]) * head_dim * 2 * itemsize


def server_for(name: str, model: str, args, tmp: Path):
    """(a ``ServerProcess`` for configuration ``name``, the BLAS label for mlx_lm.server or None)."""
    from kvmetal.serve.server import ServerProcess

    log = tmp / f"{name}.log"
    if name == "mlx_lm":
        return mlx_lm_process(model, log, "--prompt-cache-bytes", args.kv_memory)
    options = ["--log-level", "WARNING", "--kv-memory", args.hot_memory if name == "hot" else args.kv_memory]
    if name == "tier":
        store = Path(tempfile.mkdtemp(prefix="prompt-cache-", dir=tmp))
        options += ["--prompt-cache-dir", store, "--prompt-cache-max-bytes", args.disk]
    return ServerProcess(model, free_port(), *options, log_path=log, start_timeout=300), None


def run_config(name: str, model: str, workload: dict, args, tmp: Path) -> tuple:
    """(summary, raw replay) of one configuration on a fresh server."""
    server, blas = server_for(name, model, args, tmp)
    print(f"{name}: {' '.join(map(str, server.command))}", file=sys.stderr, flush=True)
    with server:
        url = server.url + "/v1"
        warm = one_request(url, model, {"path": "/completions", "prompt": "warm up", "max_tokens": 4})
        if "error" in warm:
            raise RuntimeError(f"{name}: the warm-up request failed: {warm['error']}")
        before = scrape(server.url)
        run = replay(url, model, workload, args.idle, args.bg_tokens)
        after = scrape(server.url)
    summary = summarize(run, before, after)
    summary["command"] = [str(c) for c in server.command]
    if blas:
        summary["blas"] = blas
    return summary, run


def size_caps(args, per_token: int) -> None:
    """CAP: one session's last prompt and answer, the background stream, a little room.
    HOT: every session's context at once, the same again for the stream's restarts and slack.
    DISK: twice every session's context and the stream. All in bytes (both servers parse those)."""
    from kvmetal.serve.memory import parse_memory

    stream = args.bg_tokens + 64
    one = args.context_tokens + args.max_tokens
    if args.kv_memory is None:
        args.kv_memory = str((one + stream + 256) * per_token)
    args.kv_memory = str(parse_memory(args.kv_memory))
    args.hot_memory = str((args.sessions * (one + 16) + 2 * stream + 1024) * per_token)
    if args.disk is None:
        args.disk = str(2 * (args.sessions * one + stream) * per_token)


def default_model() -> str:
    from kvmetal.models.named import default_dtype, named_model_path

    return str(named_model_path("smollm2", default_dtype()))  # float32 on Linux (OpenBLAS), the GGUF's bits on a Mac


def token_counter(model: str):
    """The model's own tokenizer, as a count of tokens (no special ones)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model) / "tokenizer.json"))
    return lambda text: len(tok.encode(text, add_special_tokens=False).ids)


def main(argv=None) -> int:
    args = parse_args(argv)
    model = args.model or default_model()
    per_token = kv_bytes_per_token(model)
    size_caps(args, per_token)
    workload = build_workload(args.sessions, args.turns, args.context_tokens, args.max_tokens, args.seed,
                              token_counter(model), turn_tokens=args.turn_tokens)
    meta = describe(args, model, per_token, workload)
    results, raw = {}, {}
    with tempfile.TemporaryDirectory(prefix="agent-sessions-") as tmp:
        for name in args.configs:
            tic = time.perf_counter()
            try:
                results[name], raw[name] = run_config(name, model, workload, args, Path(tmp))
            except Exception as e:  # one failing server loses nothing measured before it
                results[name] = {"error": f"{type(e).__name__}: {e}"[:2000]}
            print(f"{name}: done in {time.perf_counter() - tic:.0f} s", file=sys.stderr, flush=True)
            save(args, meta, results, raw)
    answers = compare_answers(raw)
    for name, a in answers.items():
        results[name]["answers_vs_hot"] = a
    meta["ratios"] = ratios(results)
    save(args, meta, results, raw)
    print(report(meta, results))
    return 0


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="mlx-lm model directory (default: SmolLM2-135M-Instruct, kvmetal's named model)")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    p.add_argument("--sessions", type=int, default=3, help="agent sessions (default 3)")
    p.add_argument("--turns", type=int, default=2, help="turns per session (default 2)")
    p.add_argument("--context-tokens", type=int, default=8100,
                   help="prompt tokens of a session's last turn, about (default 8100; SmolLM2's context is 8192)")
    p.add_argument("--turn-tokens", type=int, default=256,
                   help="tokens of the user message of every turn after the first, the first turn bringing the "
                        "rest of --context-tokens (an agent's task, then short steps; default 256); 0: equal "
                        "chunks every turn")
    p.add_argument("--max-tokens", type=int, default=24, help="answer tokens per turn, greedy (default 24)")
    p.add_argument("--bg-tokens", type=int, default=1000, help="max_tokens of the background stream (default 1000)")
    p.add_argument("--idle", type=float, default=0.0, help="seconds between two turns (default 0)")
    p.add_argument("--kv-memory", help="CAP in bytes (or kvmetal's units; mlx_lm.server takes bytes, MB, GB): "
                                       "default one session's context plus the background stream")
    p.add_argument("--disk", help="--prompt-cache-max-bytes of the tier config (default: twice every context)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--quick", action="store_true", help="3 sessions x 2 turns of ~1,500 tokens: a smoke test")
    p.add_argument("--json", help="write everything here")
    args = p.parse_args(argv)
    if args.quick:
        args.sessions, args.turns, args.context_tokens, args.max_tokens, args.bg_tokens = 3, 2, 1500, 8, 200
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = set(args.configs) - set(CONFIGS)
    if unknown:
        p.error(f"unknown configs {sorted(unknown)}: choose from {','.join(CONFIGS)}")
    return args


def kvmetal_source() -> dict:
    """Where the kvmetal the servers run comes from, and its git commit (servers start
    from the tree this process imported: ServerProcess runs ``-m kvmetal`` there)."""
    import subprocess

    import kvmetal

    root = Path(kvmetal.__file__).resolve().parents[1]

    def git(*a):
        return subprocess.run(["git", "-C", str(root), *a], capture_output=True, text=True).stdout.strip() or None

    return {"path": str(root), "commit": git("rev-parse", "HEAD"),
            "kvmetal_last_change": git("log", "-1", "--format=%H", "--", "kvmetal"),
            "dirty": bool(git("status", "--porcelain", "--", "kvmetal"))}


def describe(args, model: str, per_token: int, workload: dict) -> dict:
    from importlib import metadata

    import mlx.core as mx

    return {"command": [sys.executable, *sys.argv], "args": vars(args), "model": model,
            "backend": "metal" if mx.metal.is_available() else "cpu", "mlx": mx.__version__,
            "mlx_lm": metadata.version("mlx-lm"), "kvmetal": kvmetal_source(),
            "env": {k: os.environ[k] for k in ENV if k in os.environ},
            "host": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "machine": platform.machine()},
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "kv_bytes_per_token": per_token, "system_tokens": workload["system_tokens"],
            "chunk_tokens": workload["chunk_tokens"],
            "estimated_context": [[context_estimate(workload, s, t) for t in range(args.turns)]
                                  for s in range(args.sessions)]}


def save(args, meta: dict, results: dict, raw: dict) -> None:
    if args.json:
        runs = {name: {"turns": run["turns"], "bg_gaps": run["bg_gaps"]} for name, run in raw.items()}
        Path(args.json).write_text(json.dumps({"meta": meta, "results": results, "runs": runs}, indent=1) + "\n")


# ---- the markdown report ----

def _f(x, digits=2) -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return f"{x:.{digits}f}"
    return str(x)


def _pair(r: dict, a: str, b: str) -> str:
    return f"{_f(r.get(a))} / {_f(r.get(b))}"


def report(meta: dict, results: dict) -> str:
    a = meta["args"]
    lines = [f"{a['sessions']} sessions x {a['turns']} turns, last prompt ~{a['context_tokens']} tokens, answers "
             f"<= {a['max_tokens']} tokens, background stream {a['bg_tokens']} tokens, idle {a['idle']} s; "
             f"CAP {int(a['kv_memory']) / 2**20:.0f} MiB, model {Path(meta['model']).name} ({meta['backend']}), "
             f"kvmetal {(meta['kvmetal']['kvmetal_last_change'] or 'n/a')[:10]}", "",
             f"| config | wall s | first TTFT p50/p95 s | returning TTFT p50/p95 s "
             f"| returning >= {LONG} TTFT p50/p95 s "
             "| recomputed tok (returning) | bg TPOT p50/p95 ms | bg TPOT p95 in returns ms | answers = hot |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in results.items():
        if "error" in r:
            lines.append(f"| {name} | error: {r['error'][:200]} |")
            continue
        ans = r.get("answers_vs_hot")
        ans = f"{ans['equal']}/{ans['turns']} ({ans['equal_same_history']}/{ans['same_history']})" if ans else "n/a"
        long = _pair(r, "long_return_ttft_p50_s", "long_return_ttft_p95_s") + f" (n={r['long_return_turns']})"
        lines.append(f"| {name} | {_f(r['wall_s'], 0)} | {_pair(r, 'first_ttft_p50_s', 'first_ttft_p95_s')} "
                     f"| {_pair(r, 'return_ttft_p50_s', 'return_ttft_p95_s')} | {long} "
                     f"| {r['recomputed_tokens']} ({r['return_recomputed_tokens']}) "
                     f"| {_f(r['bg_tpot_p50_ms'], 0)} / {_f(r['bg_tpot_p95_ms'], 0)} "
                     f"| {_f(r['bg_tpot_p95_during_returns_ms'], 0)} | {ans} |")
    lines += ["", "answers = hot: equal turns / all (equal / turns whose earlier answers all equal hot's)", ""]
    lines += metrics_table(results) + [""] + turns_table(results) + [""]
    lines += ["ratios: " + ", ".join(f"{k} {_f(v)}" for k, v in meta.get("ratios", {}).items())]
    return "\n".join(lines)


def metrics_table(results: dict) -> list:
    names = [n for n, r in results.items() if "metrics_delta" in r]
    if not names:
        return []
    out = ["| /metrics delta | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for key in COUNTERS:
        out.append(f"| {key} | " + " | ".join(_f(results[n]["metrics_delta"][key], 3) for n in names) + " |")
    for key in GAUGES:
        vals = [results[n]["metrics_end"].get(key) for n in names]
        out.append(f"| {key} (end, MiB) | " + " | ".join("n/a" if v is None or v < 0 else f"{v / 2**20:.0f}"
                                                       for v in vals) + " |")
    return out


def turns_table(results: dict) -> list:
    out = ["| config | turn | prompt tok (mean) | TTFT p50/p95 s | recomputed tok (mean) |", "|---|---|---|---|---|"]
    for name, r in results.items():
        for row in r.get("per_turn", []):
            out.append(f"| {name} | {row['turn']} | {row['prompt_tokens_mean']:.0f} "
                       f"| {_pair(row, 'ttft_p50_s', 'ttft_p95_s')} | {row['recomputed_mean']:.0f} |")
    return out


if __name__ == "__main__":
    sys.exit(main())
