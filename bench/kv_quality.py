"""Real-text KV-cache quality: quantized caches against the model's own float cache.

On SmolLM2-135M-Instruct (the default model, float32 weights) and the prose of
``pydoc_data.topics`` (on every CPython), for each cache:

* teacher-forced over the text in chunks of 512 tokens (every K/V row written to the
  cache is quantized, the prompt's too), compared position by position with mlx-lm's
  ``KVCache``: mean KL(reference || cache) of the next-token distribution, perplexity of
  the text, and top-1 agreement, each over a window of 512 positions ending at 512, 2K
  and 8K tokens of context;
* greedy continuations: ``--prompts`` text excerpts of 64 tokens, batched, each
  continued for ``--gen`` tokens; tokens equal to the reference's continuation before
  the first divergence, and how many continuations are identical.

Every cache runs the 2K pass; ``--long`` names the caches that run the full 8K pass
(the first 2K positions of an 8K pass are the 2K pass). Results are appended to
``--json`` as each cache finishes, so a long run can be reported part way; ``--report``
prints the markdown tables and draws the plot from that file.

    python bench/kv_quality.py --json kvq.json                # the study (about an hour on 2 shared cores)
    python bench/kv_quality.py --json kvq.json --report --plot docs/kv_quality.png
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

CHUNK = 512
WINDOW = 512
PAIRS = ((8, 8), (8, 4), (4, 8), (4, 4), (8, 2), (3, 3), (2, 2))


def cache_configs() -> list[dict]:
    """Every cache of the study, the most informative first (a cut-short run keeps those)."""
    def paged(k, v, group):
        return {"name": f"kvmetal K{k}/V{v} g{group}", "kind": "paged", "k_bits": k, "v_bits": v, "group": group}

    def mlx(bits):
        return {"name": f"mlx-lm kv_bits={bits} g64", "kind": "mlx-quantized", "bits": bits, "group": 64}

    first = [paged(8, 4, 32), paged(8, 4, 64), paged(4, 4, 64), mlx(8), mlx(4), paged(8, 8, 64), paged(4, 8, 64),
             {"name": "kvmetal f32", "kind": "paged"}]
    rest = [paged(k, v, g) for g in (64, 32) for k, v in PAIRS]
    return first + [c for c in rest if c["name"] not in {f["name"] for f in first}]


DEFAULT_LONG = ("kvmetal K8/V4 g32", "kvmetal K8/V4 g64", "kvmetal K4/V4 g64", "mlx-lm kv_bits=8 g64",
                "mlx-lm kv_bits=4 g64")


def pydoc_text() -> list[str]:
    """The language reference's topics, in a fixed order."""
    from pydoc_data.topics import topics

    return [topics[k] for k in sorted(topics)]


class Caches:
    """Builds the per-layer cache list of one configuration (and undoes its patch)."""

    def __init__(self, model, config: dict | None):
        self.model, self.config, self.handle = model, config, None

    def __enter__(self) -> list:
        from mlx_lm.models.cache import QuantizedKVCache, make_prompt_cache

        from kvmetal.integrations.mlx_lm import use_paged_cache

        c = self.config
        if c is None:
            return make_prompt_cache(self.model)
        if c["kind"] == "mlx-quantized":
            return [QuantizedKVCache(group_size=c["group"], bits=c["bits"]) for _ in self.model.layers]
        self.handle = use_paged_cache(self.model, k_bits=c.get("k_bits"), v_bits=c.get("v_bits"),
                                      k_group_size=c.get("group"), v_group_size=c.get("group"))
        return make_prompt_cache(self.model)

    def __exit__(self, *exc):
        if self.handle is not None:
            self.handle.undo()


def teacher_forced(model, tokens: np.ndarray, config: dict | None, ref_logprobs: dict, *, contexts: list[int],
                   store: bool) -> dict:
    """Per-window KL, next-token NLL and top-1 agreement over ``tokens`` (one sequence).

    The text goes through in chunks of 512; only the chunks that are windows (positions
    [C - 512, C) for each context C) compute logits, the others only fill the cache.
    """
    n = len(tokens) - 1  # tokens holds one more: the next token of the last position
    ends = [c for c in contexts if c <= n]
    result = {}
    with Caches(model, config) as cache:
        for start in range(0, n, CHUNK):
            stop = min(n, start + CHUNK)
            x = mx.array(tokens[None, start:stop])
            if stop not in ends:
                mx.eval(model.model(x, cache=cache))  # the backbone alone writes this chunk's K/V
                continue
            logits = model(x, cache=cache)[0].astype(mx.float32)
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            mx.eval(logprobs)
            lp = np.array(logprobs)
            if store:
                ref_logprobs[stop] = lp
            ref = ref_logprobs[stop]
            nxt = tokens[start + 1:stop + 1]
            result[str(stop)] = {"kl": float((np.exp(ref) * (ref - lp)).sum(axis=-1).mean()),
                                 "ppl": float(np.exp(-lp[np.arange(len(nxt)), nxt].mean())),
                                 "top1": float((ref.argmax(-1) == lp.argmax(-1)).mean())}
    return result


def greedy(model, prompts: np.ndarray, config: dict | None, gen: int) -> np.ndarray:
    """[B, gen] greedy continuations of a batch of equal-length prompts."""
    out = []
    with Caches(model, config) as cache:
        x = mx.array(prompts)
        for _ in range(gen):
            logits = model(x, cache=cache)[:, -1]
            x = mx.argmax(logits, axis=-1)[:, None]
            mx.eval(x)
            out.append(np.array(x)[:, 0])
    return np.stack(out, axis=1)


def greedy_metrics(ref: np.ndarray, got: np.ndarray) -> dict:
    same = ref == got
    first = np.where(same.all(axis=1), ref.shape[1], np.argmin(same, axis=1))
    return {"prefix_mean": float(first.mean()), "equal_fraction": float(same.mean()),
            "identical": int(same.all(axis=1).sum()), "prompts": int(ref.shape[0])}


def run_study(args) -> None:
    from mlx_lm.utils import load

    from kvmetal.models import default_model_path

    path = Path(args.model) if args.model else default_model_path(dtype="float32")
    model, tokenizer = load(str(path))
    texts = pydoc_text()
    stream = np.array(tokenizer.encode("\n\n".join(texts), add_special_tokens=False), dtype=np.int64)
    contexts = [int(c) for c in args.contexts.split(",")]
    long_n, short_n = max(contexts), min(2048, max(contexts))
    stream = stream[:long_n + 1]  # one more: the next token of the last position
    # Greedy prompts: the first 64 tokens of evenly spaced topics (of those that long).
    encoded = [ids for ids in (tokenizer.encode(t, add_special_tokens=False) for t in texts) if len(ids) >= 64]
    picks = np.linspace(0, len(encoded) - 1, args.prompts).astype(int)
    prompts = np.stack([np.array(encoded[i][:64]) for i in picks])
    assert prompts.shape == (args.prompts, 64), prompts.shape

    out = Path(args.json)
    report = json.loads(out.read_text()) if out.exists() and args.resume else {}
    report.update({"model": str(path), "chunk": CHUNK, "window": WINDOW, "gen": args.gen,
                   "prompts": args.prompts, "contexts": contexts, "results": report.get("results", {})})
    ref_lp: dict = {}  # window end -> reference log-probs [512, vocab] (100 MB each)
    tic = time.perf_counter()
    ref_windows = teacher_forced(model, stream[:long_n + 1], None, ref_lp, contexts=contexts, store=True)
    ref_greedy = greedy(model, prompts, None, args.gen) if args.gen else None
    report["reference"] = {"name": "mlx-lm KVCache (float32)", "windows": ref_windows,
                           "seconds": time.perf_counter() - tic}
    print(f"reference: {report['reference']['windows']} ({report['reference']['seconds']:.0f} s)",
          file=sys.stderr, flush=True)
    long_names = set(args.long.split(",")) if args.long else set(DEFAULT_LONG)
    selected = [c for c in cache_configs() if not args.only or c["name"] in args.only.split(",")]
    order = selected  # cache_configs() lists the most informative first
    for config in order:
        name = config["name"]
        n = long_n if name in long_names else short_n
        if name in report["results"] and report["results"][name].get("tokens", 0) >= n:
            continue
        tic = time.perf_counter()
        got = greedy(model, prompts, config, args.gen) if args.gen else None
        report["results"][name] = {"config": config, "tokens": n,
                                   "greedy": greedy_metrics(ref_greedy, got) if args.gen else None,
                                   "windows": teacher_forced(model, stream[:n + 1], config, ref_lp,
                                                             contexts=contexts, store=False),
                                   "seconds": time.perf_counter() - tic}
        r = report["results"][name]
        print(f"{name}: {r['windows']} greedy {r['greedy']} ({r['seconds']:.0f} s)", file=sys.stderr, flush=True)
        out.write_text(json.dumps(report, indent=1))
    out.write_text(json.dumps(report, indent=1))


def print_report(report: dict, plot: str | None) -> None:
    ref = report["reference"]["windows"]
    print(f"reference (mlx-lm KVCache, float32): perplexity "
          + ", ".join(f"{int(c) // 1024 or c}{'K' if int(c) >= 1024 else ''} {w['ppl']:.2f}" for c, w in ref.items()))
    print()
    print("| cache | KL 512 | KL 2K | KL 8K | ppl 512 | ppl 2K | ppl 8K | top-1 2K | top-1 8K | greedy prefix "
          f"(of {report['gen']}) | identical (of {report['prompts']}) |")
    print("|---|" + "---|" * 10)

    def cell(windows, c, key, fmt):
        w = windows.get(str(c))
        return "-" if w is None else format(w[key], fmt)

    for name, r in report["results"].items():
        w = r["windows"]
        g = r["greedy"]
        print(f"| {name} | {cell(w, 512, 'kl', '.4f')} | {cell(w, 2048, 'kl', '.4f')} | {cell(w, 8192, 'kl', '.4f')} "
              f"| {cell(w, 512, 'ppl', '.3f')} | {cell(w, 2048, 'ppl', '.3f')} | {cell(w, 8192, 'ppl', '.3f')} "
              f"| {cell(w, 2048, 'top1', '.3f')} | {cell(w, 8192, 'top1', '.3f')} "
              f"| {g['prefix_mean']:.1f} | {g['identical']} |")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5))
        names = list(report["results"])
        kl2k = [report["results"][n]["windows"]["2048"]["kl"] for n in names]
        left.barh(names, kl2k, color=["tab:orange" if n.startswith("mlx-lm") else "tab:blue" for n in names])
        left.set_xscale("log")
        left.set_xlabel("mean KL to the float cache, positions 1.5K-2K (log)")
        left.invert_yaxis()
        for n in names:
            c = report["results"][n]["kl_curve"]
            if len(c) * 256 >= 8192:
                right.plot(np.arange(len(c)) * 256 + 128, np.maximum(c, 1e-6), label=n)
        right.set_yscale("log")
        right.set_xlabel("position in the text (tokens)")
        right.set_ylabel("mean KL per 256 positions (log)")
        right.legend(fontsize=8)
        fig.suptitle("SmolLM2-135M-Instruct (float32), pydoc_data.topics text, teacher-forced")
        fig.tight_layout()
        fig.savefig(plot, dpi=90)
        print(f"\nplot written to {plot}", file=sys.stderr)


def main(argv=None) -> int:
    from kvmetal.models.blas import preload_openblas_and_reexec

    preload_openblas_and_reexec()  # float32 matmuls ~30x faster on Linux (OpenBLAS, when installed)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="an mlx-lm model directory (default: SmolLM2 float32)")
    p.add_argument("--json", default="kv_quality.json", help="results file (written as each cache finishes)")
    p.add_argument("--resume", action="store_true", help="keep the caches already in --json")
    p.add_argument("--long", default=None, help="comma-separated caches that run the 8K pass "
                                                f"(default: {','.join(DEFAULT_LONG)})")
    p.add_argument("--only", default=None, help="comma-separated caches to run (default: all)")
    p.add_argument("--contexts", default="512,2048,4096,8192",
                   help="window ends in tokens (default 512,2048,4096,8192)")
    p.add_argument("--prompts", type=int, default=20, help="greedy prompts (default 20)")
    p.add_argument("--gen", type=int, default=128, help="greedy tokens per prompt (default 128; 0: no greedy)")
    p.add_argument("--scratch", default=None, help="directory for the reference log-probs (1.6 GB)")
    p.add_argument("--report", action="store_true", help="print the tables from --json (no measuring)")
    p.add_argument("--plot", default=None, help="with --report: write a PNG")
    args = p.parse_args(argv)
    if args.report:
        print_report(json.loads(Path(args.json).read_text()), args.plot)
        return 0
    run_study(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
