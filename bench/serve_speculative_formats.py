"""Speculative decoding vs plain through ``kvmetal serve``, per K/V format (issue 44, bug 1).

    python bench/serve_speculative_formats.py --json bench/serve_speculative_formats_smollm2.json

For each K/V format, one ``kvmetal serve -m default --speculative ngram`` on loopback (the
default model, SmolLM2-135M-Instruct); every chat prompt is sent twice, one request after
the other, greedy with logprobs (top 2): with ``"speculative": false`` and without it
(speculation on). A pair counts as identical when the tokens, their logprobs and the top
logprobs are equal to the bit (the JSON floats compared as sent) and so is the finish
reason. The raw answers, the server's speculative counters and the counts go to --json.
"""
from __future__ import annotations

import argparse
import json
import platform
import socket
import sys
import time
from pathlib import Path

# (label, serve flags): every bit width on each side, both group sizes SmolLM2's head_dim 64
# takes (32, the default, and 64) on each side, float, and the two commands.
FORMATS = [
    ("float32", []),
    ("K8/V4 g32 (--kv-bits 4 --k-bits 8)", ["--kv-bits", "4", "--k-bits", "8"]),
    ("K8/V8 g32 (--kv-bits 8)", ["--kv-bits", "8"]),
    ("K4/V4 g32", ["--kv-bits", "4"]),
    ("K8/V4 g64", ["--kv-bits", "4", "--k-bits", "8", "--kv-group-size", "64"]),
    ("K2/V3 g32/g64", ["--k-bits", "2", "--v-bits", "3", "--v-group-size", "64"]),
    ("K3/V6 g64/g32", ["--k-bits", "3", "--v-bits", "6", "--k-group-size", "64"]),
    ("K5/V2 g32/g64", ["--k-bits", "5", "--v-bits", "2", "--v-group-size", "64"]),
    ("K6/V5 g64/g32", ["--k-bits", "6", "--v-bits", "5", "--k-group-size", "64"]),
]

# The chat first; then one that copies from its prompt (drafts are accepted) and one
# open question.
PROMPTS = [
    ("Explain why the sky is blue in a few sentences.", 80),
    ("Repeat these sentences exactly: The paged cache keeps keys and values in fixed blocks. A block table "
     "maps every sequence to its blocks.", 48),
    ("List three fruits and their colours.", 48),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _chat(client, model: str, prompt: str, max_tokens: int, speculative: bool) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "logprobs": True, "top_logprobs": 2}
    if not speculative:
        body["speculative"] = False
    started = time.perf_counter()
    reply = client.post("/v1/chat/completions", json=body)
    reply.raise_for_status()
    choice = reply.json()["choices"][0]
    return {"speculative": speculative, "seconds": round(time.perf_counter() - started, 2),
            "finish_reason": choice["finish_reason"], "text": choice["message"]["content"],
            "logprobs": [[e["token"], e["logprob"], [[t["token"], t["logprob"]] for t in e["top_logprobs"]]]
                         for e in choice["logprobs"]["content"]]}


def _first_difference(a: dict, b: dict):
    """Index of the first entry where two answers' (token, logprob, top) differ, else None."""
    for i, (x, y) in enumerate(zip(a["logprobs"], b["logprobs"])):
        if x != y:
            return i
    return None if len(a["logprobs"]) == len(b["logprobs"]) else min(len(a["logprobs"]), len(b["logprobs"]))


def run_format(label: str, flags: list, prompts: list, start_timeout: float) -> dict:
    import httpx

    from kvmetal.serve import metrics
    from kvmetal.serve.server import ServerProcess

    port = _free_port()
    command = [sys.executable, "-m", "kvmetal", "serve", "-m", "default", "--host", "127.0.0.1", "--port", str(port),
               "--log-level", "WARNING", "--speculative", "ngram", *flags]
    pairs = []
    with ServerProcess(None, port, command=command, start_timeout=start_timeout) as server:
        with httpx.Client(base_url=server.url, timeout=1800) as client:
            model = client.get("/v1/models").json()["data"][0]["id"]  # the served name (SmolLM2-135M-Instruct)
            for prompt, max_tokens in prompts:
                plain = _chat(client, model, prompt, max_tokens, speculative=False)
                spec = _chat(client, model, prompt, max_tokens, speculative=True)
                first = _first_difference(plain, spec)
                tokens_same = [e[0] for e in plain["logprobs"]] == [e[0] for e in spec["logprobs"]]
                identical = first is None and plain["finish_reason"] == spec["finish_reason"]
                pairs.append({"prompt": prompt, "max_tokens": max_tokens, "identical": identical,
                              "tokens_identical": tokens_same, "first_difference": first, "plain": plain,
                              "speculative": spec})
                print(f"  {prompt[:40]!r}: {len(plain['logprobs'])} vs {len(spec['logprobs'])} tokens, "
                      f"{'identical' if identical else f'differ from token {first}'} "
                      f"({plain['seconds']} s plain, {spec['seconds']} s speculative)", flush=True)
            seen = metrics.parse(client.get("/metrics").text)
    return {"format": label, "flags": flags, "pairs": pairs,
            "requests": 2 * len(pairs), "identical_pairs": sum(p["identical"] for p in pairs),
            "tokens_identical_pairs": sum(p["tokens_identical"] for p in pairs),
            "drafted_tokens": seen.get("kvmetal_spec_draft_tokens"),
            "accepted_tokens": seen.get("kvmetal_spec_accepted_tokens")}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--formats", help="comma-separated indices into FORMATS (default: all)")
    parser.add_argument("--start-timeout", type=float, default=600)
    args = parser.parse_args(argv)
    chosen = FORMATS if not args.formats else [FORMATS[int(i)] for i in args.formats.split(",")]
    started = time.time()
    results = []
    for label, flags in chosen:
        print(f"{label}: kvmetal serve -m default --speculative ngram {' '.join(flags)}", flush=True)
        results.append(run_format(label, flags, PROMPTS, args.start_timeout))
    print("\n| K/V format | requests (pairs) | tokens identical | tokens and logprobs identical | drafted | accepted |")
    print("|---|---|---|---|---|---|")
    for r in results:
        n = len(r["pairs"])
        print(f"| {r['format']} | {r['requests']} ({n}) | {r['tokens_identical_pairs']}/{n} | "
              f"{r['identical_pairs']}/{n} | {r['drafted_tokens']:.0f} | {r['accepted_tokens']:.0f} |")
    if args.json:
        import kvmetal

        out = {"what": __doc__.split("\n\n")[0], "model": "default (SmolLM2-135M-Instruct, float32)",
               "platform": platform.platform(), "python": sys.version.split()[0],
               "kvmetal": getattr(kvmetal, "__version__", None), "wall_seconds": round(time.time() - started, 1),
               "results": results}
        Path(args.json).write_text(json.dumps(out, separators=(",", ":")) + "\n")  # compact: every token's logprobs
    return 0 if all(r["identical_pairs"] == len(r["pairs"]) for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
