"""``kvmetal bench --model DIR``: a model end to end, in the style of llama-bench.

For each context length, one prompt of that many tokens (random ids, the same for every
configuration) is prefilled and ``--gen-tokens`` tokens are generated greedily with
mlx-lm's ``generate_step`` under four caches, all in this one process:

    kvmetal f32/f16   use_paged_cache(model)                  (the dtype of the model's K/V)
    kvmetal K8/V4     use_paged_cache(model, kv_format=...)   (K8/V4, or what --kv-bits/--k-bits/... say)
    mlx-lm KVCache    mlx-lm's own cache
    mlx-lm kv_bits=8  mlx-lm's QuantizedKVCache from the first token (quantized_kv_start=0; the
                      kvmetal row's bits where K and V agree, else 8; K's group size)

Reported per cell: prompt tokens/s (prefill through the first token), generation
tokens/s (the remaining tokens), peak memory (``mx.get_peak_memory``, reset before each
run) and the bytes the cache holds at the end. Each cell runs ``--samples`` times (the
configurations take turns, so a slow spell of the machine is spread over all of them):
the table shows the median tokens/s with the min..max of the samples.
"""
from __future__ import annotations

import json
import sys
import time

import mlx.core as mx
import numpy as np

from ..kv_format import KVFormat

DEFAULT_QUANTIZED = KVFormat(k_bits=8, v_bits=4)  # the kvmetal row when no K/V flag is given
# Less those past the model's trained context. Off a Mac the mlx-lm rows run MLX's CPU
# attention, seconds per token past a few thousand (a 2-core machine took 40 minutes for
# 512 and 4K), so the default stops at 2K there.
DEFAULT_CONTEXTS = {"metal": "512,4K,16K", "other": "512,2K"}


def default_contexts(backend: str) -> str:
    return DEFAULT_CONTEXTS["metal" if backend == "metal" else "other"]


def pick_contexts(given: str | None, trained: int | None, gen_tokens: int, *, warn, backend: str = "metal") -> list:
    """Prompt lengths to measure. The default drops those whose prompt and generated tokens do
    not fit the context the model was trained for (SmolLM2: 8K); lengths the user gave are kept,
    with a warning for those past it."""
    from ..budget import parse_tokens

    text = default_contexts(backend) if given is None else given
    contexts = [parse_tokens(c.strip(), name="--contexts") for c in text.split(",") if c.strip()]
    if not contexts:
        raise ValueError("--contexts is empty")
    if not trained:
        return contexts
    past = [c for c in contexts if c + gen_tokens > trained]
    if not past:
        return contexts
    names = ", ".join(f"{c:,}" for c in past)
    if given is None:
        kept = [c for c in contexts if c not in past]
        warn(f"kvmetal bench: context {names} skipped: the model was trained for {trained:,} tokens "
             f"(max_position_embeddings); --contexts chooses others")
        return kept or [max(1, trained - gen_tokens)]
    warn(f"kvmetal bench: warning: context {names} + {gen_tokens} generated tokens is past the {trained:,} "
         f"tokens the model was trained for (max_position_embeddings): timed all the same, quality not assured")
    return contexts


def configs(fmt: KVFormat, head_dim: int) -> list:
    """(name, config) rows: kvmetal float, kvmetal ``fmt`` (its group sizes for head_dim), mlx-lm's
    KVCache and its QuantizedKVCache at ``fmt``'s bits when K and V agree (else 8) and K's group."""
    fmt = fmt.for_head_dim(head_dim)
    mlx_bits = fmt.k_bits if fmt.k_bits == fmt.v_bits else 8
    return [
        ("kvmetal float", dict(paged=True)),  # labelled with the K/V dtype when printed
        (f"kvmetal {fmt.label.split(' ')[0]}", dict(paged=True, kv_format=fmt)),
        ("mlx-lm KVCache", dict(paged=False)),
        (f"mlx-lm kv_bits={mlx_bits}", dict(paged=False, kv_bits=mlx_bits, group_size=fmt.group_size("k"))),
    ]


def measure(model, prompt: list, *, gen_tokens: int, config: dict, backend: str, block_size: int = 16) -> dict:
    """One prefill + ``gen_tokens`` greedy tokens under one cache configuration."""
    from mlx_lm.generate import generate_step
    from mlx_lm.models.cache import make_prompt_cache

    from ..backends import use_backend
    from ..integrations.mlx_lm import use_paged_cache

    mx.clear_cache()
    mx.reset_peak_memory()
    kwargs = {}
    handle = None
    if config["paged"]:
        handle = use_paged_cache(model, block_size=block_size, kv_format=config.get("kv_format"))
    elif config.get("kv_bits"):
        kwargs = dict(kv_bits=config["kv_bits"], kv_group_size=config["group_size"], quantized_kv_start=0)
    try:
        with use_backend(backend):
            cache = make_prompt_cache(model)
            tic = time.perf_counter()
            first = None
            count = 0
            for token, _ in generate_step(mx.array(prompt), model, max_tokens=gen_tokens, prompt_cache=cache,
                                          sampler=lambda logits: mx.argmax(logits, axis=-1), **kwargs):
                mx.eval(token)
                count += 1
                if first is None:
                    first = time.perf_counter()
            end = time.perf_counter()
            if config["paged"]:
                kv_bytes = cache[0].model_cache.nbytes
                kv_used = cache[0].model_cache.used_bytes
            else:
                kv_bytes = kv_used = sum(c.nbytes for c in cache)
    finally:
        if handle is not None:
            handle.undo()
    return {
        "prompt_tps": len(prompt) / (first - tic),
        "generation_tps": (count - 1) / (end - first) if count > 1 else None,
        "generated": count,
        "peak_memory_bytes": mx.get_peak_memory(),
        "kv_bytes": kv_bytes,
        "kv_used_bytes": kv_used,
    }


def _fmt(value, kind: str, low=None, high=None) -> str:
    if value is None:
        return "-"
    if kind == "tps":
        spread = f" ({low:,.1f}..{high:,.1f})" if low is not None and high is not None and high > low else ""
        return f"{value:,.1f}{spread}"
    return f"{value / 2**20:,.1f} MiB"


def summarize(samples: list) -> dict:
    """One cell from its runs: the median tokens/s with min and max, the largest peak memory."""
    row = dict(samples[-1])
    for key in ("prompt_tps", "generation_tps"):
        values = sorted(s[key] for s in samples if s.get(key) is not None)
        if values:
            row[key] = float(np.median(values))
            row[f"{key}_min"], row[f"{key}_max"] = values[0], values[-1]
    row["peak_memory_bytes"] = max(s["peak_memory_bytes"] for s in samples)
    row["samples"] = len(samples)
    return row


def kv_dtype_label(model) -> str:
    """``f32``, ``f16`` or ``bf16``: the dtype the model's K/V rows come out in."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([[0]]), cache=cache))
    dtype = cache[0].state[0].dtype
    return {mx.float32: "f32", mx.float16: "f16", mx.bfloat16: "bf16"}.get(dtype, str(dtype))


def print_table(rows: list, *, header: str) -> None:
    if not rows:
        print(header + "no run finished")
        return
    configs = list(dict.fromkeys(r["config"] for r in rows))
    contexts = list(dict.fromkeys(r["context"] for r in rows))
    cell = {(r["context"], r["config"]): r for r in rows}
    metrics = (("prompt tok/s", "prompt_tps", "tps"), ("gen tok/s", "generation_tps", "tps"),
               ("peak memory", "peak_memory_bytes", "bytes"), ("KV held", "kv_bytes", "bytes"))
    text = {}
    for context in contexts:
        for metric, key, kind in metrics:
            for c in configs:
                r = cell.get((context, c), {})
                text[context, key, c] = _fmt(r.get(key), kind, r.get(f"{key}_min"), r.get(f"{key}_max"))
    width = max(16, *(len(c) + 2 for c in configs), *(len(v) + 2 for v in text.values()))
    print(header)
    print(f"{'context':>8}  {'metric':<16}" + "".join(f"{c:>{width}}" for c in configs))
    print("-" * (26 + width * len(configs)))
    for context in contexts:
        for metric, key, kind in metrics:
            print(f"{context:>8}  {metric:<16}" + "".join(f"{text[context, key, c]:>{width}}" for c in configs))
    samples = max((r.get("samples", 1) for r in rows), default=1)
    if samples > 1:
        print(f"(tokens/s: the median of {samples} runs per cell, min..max in brackets)")
    print("(kvmetal's KV held is its block pool, which grows in steps; the blocks its sequence owned are in the JSON"
          " as kv_used_bytes)")


def main(args, backend: str) -> int:
    from ..budget import shape_from_config
    from ..kv_format import format_from_args
    from ..commands.common import UserError, resolve_model
    from .provenance import provenance

    try:
        fmt = format_from_args(args)
        fmt = fmt if fmt.quantized else DEFAULT_QUANTIZED
        pick_contexts(args.contexts, None, args.gen_tokens, warn=print)  # a bad --contexts fails before loading
        if args.gen_tokens < 2:
            raise ValueError(f"--gen-tokens must be >= 2, got {args.gen_tokens}")
        path = resolve_model(args.model)
    except (ValueError, UserError) as exc:
        print(f"kvmetal bench: error: {exc}", file=sys.stderr)
        return 2
    from mlx_lm.utils import load

    model, tokenizer, config = load(str(path), return_config=True)
    shape = shape_from_config(config, name=path.name)
    try:
        rows_of = configs(fmt, shape.head_dim)
    except ValueError as exc:
        print(f"kvmetal bench: error: {exc}", file=sys.stderr)
        return 2
    contexts = pick_contexts(args.contexts, shape.max_position_embeddings, args.gen_tokens, backend=backend,
                             warn=lambda line: print(line, file=sys.stderr, flush=True))
    rng = np.random.default_rng(0)
    vocab = shape.vocab_size or 1000
    float_label = f"kvmetal {kv_dtype_label(model)}"
    rows = []
    samples = getattr(args, "samples", 1)
    progress = _Progress(total=len(contexts) * samples * len(rows_of))
    interrupted = None
    try:
        for context in contexts:
            prompt = [int(t) for t in rng.integers(0, vocab, context)]
            runs: dict = {}
            try:
                _measure_context(model, prompt, runs, rows_of, float_label=float_label, samples=samples,
                                 gen_tokens=args.gen_tokens, backend=backend, progress=progress)
            finally:  # an interrupted context keeps the runs it finished
                for name, got in runs.items():
                    row = got[0] if "error" in got[0] else summarize(got)
                    rows.append({"context": context, "config": name, **row})
    except KeyboardInterrupt:
        interrupted = f"interrupted after {progress.done - 1} of {progress.total} runs; the finished ones follow"
        print(f"\nkvmetal bench: {interrupted}", file=sys.stderr, flush=True)
    report = {"model": str(path), "family": config.get("model_type"), "backend": backend,
              "gen_tokens": args.gen_tokens, "samples": samples,
              "kv_format": rows_of[1][1]["kv_format"].label,
              "provenance": provenance(backend), "rows": rows}
    if interrupted:
        report["interrupted"] = interrupted
    if getattr(args, "speculative", False) and not interrupted:
        report["speculative"] = speculative_rows(model, tokenizer, gen_tokens=args.gen_tokens, backend=backend)
    if args.plot:
        from .plots import plot_model_results

        try:
            plot_model_results([r for r in rows if "error" not in r], args.plot,
                               title=f"{path.name}: {args.gen_tokens} generated tokens, backend {backend}")
            report["plot"] = args.plot
            print(f"plot written to {args.plot}", file=sys.stderr)
        except (OSError, ValueError) as e:  # the results are still printed
            report["plot_error"] = f"{type(e).__name__}: {e}"
            print(f"kvmetal bench: error: --plot {args.plot}: {report['plot_error']}", file=sys.stderr)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_table(rows, header=f"\n{path.name} ({config.get('model_type')}, head_dim {shape.head_dim}); "
                                 f"{args.gen_tokens} greedy tokens after each prompt; backend {backend}; "
                                 f"kvmetal quantized: {report['kv_format']}\n")
        if report.get("speculative"):
            print_speculative(report["speculative"])
    if interrupted:
        return 130
    return 1 if "plot_error" in report else 0


class _Progress:
    """Progress lines on stderr: which run starts, and each finished run's rates and seconds
    with an estimate of what is left at its context (longer contexts are not guessed)."""

    def __init__(self, total: int):
        self.total, self.done, self.started = total, 0, time.perf_counter()

    def start(self, context: int, name: str, sample: int, samples: int) -> None:
        self.done += 1
        print(f"[{self.done}/{self.total}] {context:,} tokens, {name} (run {sample + 1} of {samples}) ...",
              file=sys.stderr, flush=True)

    def finished(self, run: dict, took: list, left_here: int) -> None:
        gen = run.get("generation_tps")
        line = f"prompt {run['prompt_tps']:,.1f} tok/s" + (f", generation {gen:,.1f} tok/s" if gen else "")
        line += f", {took[-1]:,.1f} s ({time.perf_counter() - self.started:,.0f} s so far"
        line += f"; ~{sum(took) / len(took) * left_here:,.0f} s more at this context)" if left_here else ")"
        print("  " + line, file=sys.stderr, flush=True)


def _measure_context(model, prompt: list, runs: dict, rows_of: list, *, float_label: str, samples: int,
                     gen_tokens: int, backend: str, progress: _Progress) -> None:
    """Every configuration ``samples`` times on one prompt, taking turns, into ``runs``
    (name -> list of runs; filled as they finish, so an interrupt keeps them)."""
    took = []
    for sample in range(samples):  # the configurations take turns
        for j, (name, cfg) in enumerate(rows_of):
            name = float_label if name == "kvmetal float" else name
            if any("error" in run for run in runs.get(name, ())):
                progress.done += 1
                continue  # a configuration this model cannot run: said once
            progress.start(len(prompt), name, sample, samples)
            tic = time.perf_counter()
            try:
                run = measure(model, prompt, gen_tokens=gen_tokens, config=cfg, backend=backend)
            except (NotImplementedError, ValueError) as exc:
                run = {"error": str(exc)}
                print(f"  {name}: {exc}", file=sys.stderr)
            else:
                took.append(time.perf_counter() - tic)
                progress.finished(run, took, samples * len(rows_of) - (sample * len(rows_of) + j + 1))
            runs.setdefault(name, []).append(run)


def speculative_rows(model, tokenizer, *, gen_tokens: int, backend: str) -> list:
    """``--speculative``: plain vs prompt-lookup speculation through the engine, one stream,
    on input-grounded and open-chat prompts (kvmetal/benchmarks/speculative.py)."""
    from ..backends import use_backend
    from .speculative import compare

    if not getattr(tokenizer, "has_chat_template", False):
        print("--speculative: the model's tokenizer has no chat template; skipped", file=sys.stderr)
        return []
    print("speculative decoding (prompt lookup, 1 stream) ...", file=sys.stderr, flush=True)
    with use_backend(backend):
        return compare(model, tokenizer, max_tokens=max(gen_tokens, 16))


def print_speculative(rows: list) -> None:
    print("\nspeculative decoding (prompt lookup), 1 stream, greedy, through the engine:")
    print(f"{'prompts':<11}{'plain tok/s':>13}{'spec tok/s':>12}{'speedup':>9}{'acceptance':>12}{'tok/pass':>10}"
          f"{'identical':>11}")
    for r in rows:
        print(f"{r['prompts']:<11}{r['plain_tokens_per_s']:>13.1f}{r['speculative_tokens_per_s']:>12.1f}"
              f"{r['speculative_tokens_per_s'] / r['plain_tokens_per_s']:>8.2f}x{r['acceptance_rate']:>12.2f}"
              f"{r['tokens_per_pass']:>10.2f}{r['greedy_identical']:>6}/{r['requests']}")
