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
    python bench/kv_quality.py --json a.json,b.json --report              # runs split across processes
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


def pool_report(model_cache) -> dict:
    """A paged cache's pools after a pass: bytes held and owned, blocks per layer group."""
    return {"pool_bytes": int(model_cache.nbytes), "used_bytes": int(model_cache.used_bytes),
            "groups": [{"window": w, "layers": model_cache.layer_group.count(g), **p.stats()}
                       for g, (w, p) in enumerate(zip(model_cache.windows, model_cache.pools))]}


def teacher_forced(model, tokens: np.ndarray, config: dict | None, ref_logprobs: dict, *, contexts: list[int],
                   store: bool, pool: dict | None = None) -> dict:
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
        if pool is not None and getattr(cache[0], "model_cache", None) is not None:
            pool.update(pool_report(cache[0].model_cache))
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


def model_path(spec: str | None) -> Path:
    """A model directory, or a named model (``smollm2``, ``gemma3``) converted to float32."""
    from kvmetal.models import named_model_path
    from kvmetal.models.named import MODELS

    if spec is None or spec in MODELS:
        return named_model_path(spec or "smollm2", "float32")
    return Path(spec)


def reference_logprobs(scratch: str | None, path: Path, tokens: np.ndarray, stop: int):
    """The file holding the reference log-probs of the window ending at ``stop`` (or None):
    a run split over processes computes the reference pass once."""
    if not scratch:
        return None
    import hashlib

    key = hashlib.sha256(str(path.resolve()).encode() + tokens[:stop + 1].tobytes()).hexdigest()[:16]
    return Path(scratch) / f"ref-{path.name}-{stop}-{key}.npy"


def run_study(args) -> None:
    from mlx_lm.utils import load

    path = model_path(args.model)
    model, tokenizer = load(str(path))
    texts = pydoc_text()
    # The tokenizer's own specials: Gemma's <bos> first (SmolLM2 adds none). Gemma without
    # <bos> is off its training distribution (no attention sink; perplexity 71 over 0-512).
    stream = np.array(tokenizer.encode("\n\n".join(texts), add_special_tokens=True), dtype=np.int64)
    contexts = [int(c) for c in args.contexts.split(",")]
    long_n, short_n = max(contexts), min(args.short, max(contexts))
    stream = stream[:long_n + 1]  # one more: the next token of the last position
    # Greedy prompts: the first 64 tokens of evenly spaced topics (of those that long).
    encoded = [ids for ids in (tokenizer.encode(t, add_special_tokens=False) for t in texts) if len(ids) >= 64]
    picks = np.linspace(0, len(encoded) - 1, args.prompts).astype(int)
    prompts = np.stack([np.array(encoded[i][:64]) for i in picks])
    assert prompts.shape == (args.prompts, 64), prompts.shape

    out = Path(args.json)
    report = json.loads(out.read_text()) if out.exists() and args.resume else {}
    report.update({"model": str(path), "model_name": path.name, "chunk": CHUNK, "window": WINDOW, "gen": args.gen,
                   "prompts": args.prompts, "contexts": contexts, "results": report.get("results", {})})
    ref_lp: dict = {}  # window end -> reference log-probs [512, vocab] (100 MB each for SmolLM2, 512 MB Gemma)
    tic = time.perf_counter()
    files = {c: reference_logprobs(args.scratch, path, stream, c) for c in contexts if c <= long_n}
    reused = bool(report.get("reference")) and all(f is not None and f.is_file() for f in files.values())
    if reused:
        ref_lp.update({c: np.load(f) for c, f in files.items()})
        print(f"reference log-probs read from {args.scratch}", file=sys.stderr, flush=True)
    else:
        ref_windows = teacher_forced(model, stream[:long_n + 1], None, ref_lp, contexts=contexts, store=True)
        for c, f in files.items():
            if f is not None:
                f.parent.mkdir(parents=True, exist_ok=True)
                np.save(f, ref_lp[c])
    ref_greedy = greedy(model, prompts, None, args.gen) if args.gen else None
    if not reused:
        report["reference"] = {"name": "mlx-lm KVCache (float32)", "windows": ref_windows,
                               "seconds": time.perf_counter() - tic}
    print(f"reference: {report['reference']['windows']} ({report['reference']['seconds']:.0f} s)",
          file=sys.stderr, flush=True)
    long_names = set(args.long.split(",")) if args.long else set(DEFAULT_LONG)
    configs = {c["name"]: c for c in cache_configs()}
    if args.only:
        unknown = [n for n in args.only.split(",") if n not in configs]
        if unknown:
            raise SystemExit(f"--only: unknown cache {unknown[0]!r} (known: {', '.join(configs)})")
    # --only's order, else cache_configs()'s (the most informative first)
    order = [configs[n] for n in args.only.split(",")] if args.only else list(configs.values())
    for config in order:
        name = config["name"]
        n = long_n if name in long_names else short_n
        if name in report["results"] and report["results"][name].get("tokens", 0) >= n:
            continue
        tic = time.perf_counter()
        got = greedy(model, prompts, config, args.gen) if args.gen else None
        pool: dict = {}
        windows = teacher_forced(model, stream[:n + 1], config, ref_lp, contexts=contexts, store=False, pool=pool)
        report["results"][name] = {"config": config, "tokens": n,
                                   "greedy": greedy_metrics(ref_greedy, got) if args.gen else None,
                                   "windows": windows, "pool": pool or None,
                                   "seconds": time.perf_counter() - tic}
        r = report["results"][name]
        print(f"{name}: {r['windows']} greedy {r['greedy']} ({r['seconds']:.0f} s)", file=sys.stderr, flush=True)
        out.write_text(json.dumps(report, indent=1))
    out.write_text(json.dumps(report, indent=1))


def merge_reports(paths: list[str]) -> dict:
    """One report from several runs (split across processes): per cache, the windows of
    the longest pass and any greedy result."""
    merged: dict = {}
    for path in paths:
        report = json.loads(Path(path).read_text())
        results = merged.setdefault("results", {})
        if "reference" not in merged or len(report["reference"]["windows"]) > len(merged["reference"]["windows"]):
            merged.update({k: v for k, v in report.items() if k != "results"})
        for name, r in report["results"].items():
            have = results.setdefault(name, {"windows": {}, "greedy": None, "tokens": 0, "pool": None})
            for c, w in r["windows"].items():
                have["windows"].setdefault(c, w)
            have["greedy"] = have["greedy"] or r.get("greedy")
            if r["tokens"] >= have["tokens"]:
                have["pool"] = r.get("pool") or have["pool"]
            have["tokens"] = max(have["tokens"], r["tokens"])
    order = [c["name"] for c in cache_configs()]
    merged["results"] = dict(sorted(merged["results"].items(), key=lambda kv: order.index(kv[0])
                                    if kv[0] in order else len(order)))
    return merged


def print_report(report: dict, plot: str | None) -> None:
    ref = report["reference"]["windows"]
    contexts = sorted({int(c) for r in report["results"].values() for c in r["windows"]} | {int(c) for c in ref})

    def label(c: int) -> str:
        return f"{c // 1024}K" if c >= 1024 else str(c)

    print("reference (mlx-lm KVCache, float32): perplexity "
          + ", ".join(f"{label(int(c))} {w['ppl']:.2f}" for c, w in sorted(ref.items(), key=lambda kv: int(kv[0]))))
    print()
    print("| cache | " + " | ".join(f"KL {label(c)}" for c in contexts) + " | "
          + " | ".join(f"ppl {label(c)}" for c in contexts) + " | " + " | ".join(f"top-1 {label(c)}" for c in contexts)
          + f" | greedy: tokens before divergence (of {report.get('gen', 128)}) | identical (of "
            f"{report.get('prompts', 20)}) |")
    print("|---|" + "---|" * (3 * len(contexts) + 2))

    def cell(windows, c, key, fmt):
        w = windows.get(str(c))
        return "-" if w is None else format(w[key], fmt)

    for name, r in report["results"].items():
        w, g = r["windows"], r.get("greedy")
        print(f"| {name} | " + " | ".join(cell(w, c, "kl", ".4f") for c in contexts) + " | "
              + " | ".join(cell(w, c, "ppl", ".2f") for c in contexts) + " | "
              + " | ".join(cell(w, c, "top1", ".3f") for c in contexts)
              + (f" | {g['prefix_mean']:.1f} | {g['identical']} |" if g else " | - | - |"))
    pools = {n: r for n, r in report["results"].items() if r.get("pool")}
    if pools:
        print("\n| cache | tokens | pool held | owned | blocks in use per group (window: blocks) |")
        print("|---|---|---|---|---|")
        for name, r in pools.items():
            groups = ", ".join(f"{g['window'] or 'full'}: {g['used_blocks']}" for g in r["pool"]["groups"])
            print(f"| {name} | {r['tokens']} | {r['pool']['pool_bytes'] / 2**20:.1f} MiB | "
                  f"{r['pool']['used_bytes'] / 2**20:.1f} MiB | {groups} |")
    if plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5.5))
        names = [n for n in report["results"] if "2048" in report["results"][n]["windows"]]
        kl2k = [max(report["results"][n]["windows"]["2048"]["kl"], 1e-6) for n in names]
        left.barh(names, kl2k, color=["tab:orange" if n.startswith("mlx-lm") else "tab:blue" for n in names])
        left.set_xscale("log")
        left.set_xlabel("mean KL to the float cache, positions 1.5K-2K (log; 1e-6 = exact)")
        left.invert_yaxis()
        for n, r in report["results"].items():
            if len(r["windows"]) >= 2:
                cs = sorted(int(c) for c in r["windows"])
                right.plot(cs, [max(r["windows"][str(c)]["kl"], 1e-6) for c in cs], marker="o", label=n)
        right.set_xscale("log", base=2)
        right.set_yscale("log")
        right.set_xlabel("context: window of 512 positions ending here (tokens)")
        right.set_ylabel("mean KL to the float cache (log; 1e-6 = exact)")
        right.legend(fontsize=8)
        fig.suptitle(f"{report.get('model_name', 'SmolLM2-135M-Instruct')} (float32 weights), pydoc_data.topics "
                     f"text, teacher-forced")
        fig.tight_layout()
        fig.savefig(plot, dpi=80)
        print(f"\nplot written to {plot}", file=sys.stderr)


def main(argv=None) -> int:
    from kvmetal.models.blas import preload_openblas_and_reexec

    preload_openblas_and_reexec()  # float32 matmuls ~30x faster on Linux (OpenBLAS, when installed)
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="an mlx-lm model directory, or smollm2 / gemma3 (converted to "
                                                 "float32; default smollm2)")
    p.add_argument("--json", default="kv_quality.json", help="results file (written as each cache finishes)")
    p.add_argument("--resume", action="store_true", help="keep the caches already in --json")
    p.add_argument("--long", default=None, help="comma-separated caches that run the 8K pass "
                                                f"(default: {','.join(DEFAULT_LONG)})")
    p.add_argument("--only", default=None, help="comma-separated caches to run, in this order (default: all)")
    p.add_argument("--short", type=int, default=2048,
                   help="tokens of the caches not named by --long (default 2048)")
    p.add_argument("--contexts", default="512,2048,4096,8192",
                   help="window ends in tokens (default 512,2048,4096,8192)")
    p.add_argument("--prompts", type=int, default=20, help="greedy prompts (default 20)")
    p.add_argument("--gen", type=int, default=128, help="greedy tokens per prompt (default 128; 0: no greedy)")
    p.add_argument("--scratch", default=None,
                   help="directory that keeps the reference log-probs, so later runs (--resume) skip the "
                        "reference pass (512 x vocab float32 per window: 100 MB SmolLM2, 512 MB Gemma)")
    p.add_argument("--report", action="store_true",
                   help="print the tables from --json (comma-separated files are merged; no measuring)")
    p.add_argument("--plot", default=None, help="with --report: write a PNG")
    args = p.parse_args(argv)
    if args.report:
        print_report(merge_reports(args.json.split(",")), args.plot)
        return 0
    run_study(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
