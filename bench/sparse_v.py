"""Sparse V on a real model: skipped V rows, KL and perplexity against exact decode.

SmolLM2-135M-Instruct (the default model, float32 weights; 30 layers, 9 query / 3 kv
heads, head_dim 64) reads the prose of ``pydoc_data.topics`` through kvmetal's paged
cache (``use_paged_cache(model, sparse_v=tau)``, cpu backend). One sequence per tau,
teacher-forced: the text is prefilled in chunks of 512 (exact: ``paged_attention_varlen``
has no sparse V), and at each context C in ``--contexts`` the last ``--window``
positions before C are *decoded* one token at a time (``paged_attention``, the only op
with sparse V), their next-token log-probs compared with the exact run (tau = None,
the same decode path):

* mean KL(exact || sparse) of the next-token distribution and the perplexity of the
  window's text, for each tau and context;
* the fraction of V rows the Metal kernel skips and its V bytes, by the simulator, beside
  the rows the final-max rule would skip in the same calls (the most any kernel can): at
  ``--sim-steps`` decode steps of each window the exact run's ``paged_attention`` calls
  of layers ``--sim-layers`` are captured and replayed on the sim backend with each tau
  (every kv head; V bytes loaded from ``value_data``/``value_scales``/``value_biases``
  over the live V bytes).

Later windows follow the earlier windows of the same run (their K/V were written under
sparse V), as a server's cache would. With ``--one-pass`` every tau decodes each position
over the exact run's cache instead (then forgets it): one prefill for all taus (Gemma's
32K prefill is the cost of a run), and each step's error is sparse V's alone. Results go to ``--json``; ``--report`` prints the
markdown table.

    python bench/sparse_v.py --json bench/sparse_v_smollm2.json [--taus 1e-4,1e-6 --window 64]
    python bench/sparse_v.py --one-pass --model gemma3 --contexts 8192,32768 --window 32 \\
        --sim-layers 5,11,17,8 --sim-steps 0,31 --taus 1e-4,1e-5,1e-6 --json out.json
    python bench/sparse_v.py --json bench/sparse_v_smollm2.json --report
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
# 1e-30 skips nothing on this model: a control that the sparse path alone changes
# nothing (the cpu backend's runs of needed rows are then whole segments).
TAUS = (1e-4, 1e-6, 1e-8, 1e-30)


def pydoc_stream(tokenizer, n: int) -> np.ndarray:
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    return np.array(tokenizer.encode(text, add_special_tokens=False)[:n + 1], dtype=np.int64)


class Capture:
    """Wraps ``kvmetal.ops.paged_attention`` (what the paged cache's decode passes call):
    while ``armed``, the calls of the layers in ``layers`` are kept (arguments only)."""

    def __init__(self, layers):
        from kvmetal import ops

        self.ops, self.original, self.layers = ops, ops.paged_attention, set(layers)
        self.armed, self.layer, self.calls = False, 0, []

    def __enter__(self):
        def wrapped(*args, **kwargs):
            if self.armed and self.layer in self.layers:
                self.calls.append((self.layer, args, dict(kwargs)))
            self.layer += 1
            return self.original(*args, **kwargs)

        self.ops.paged_attention = wrapped
        return self

    def __exit__(self, *exc):
        self.ops.paged_attention = self.original


def prefill(model, stream: np.ndarray, cache, pos: int, stop: int) -> int:
    """Exact prefill of positions [pos, stop) in chunks aligned to CHUNK; returns stop."""
    while pos < stop:
        end = min(stop, (pos // CHUNK + 1) * CHUNK)
        mx.eval(model.model(mx.array(stream[None, pos:end]), cache=cache))
        pos = end
    return pos


def decode_logprobs(model, stream: np.ndarray, cache, pos: int, capture=None, armed: bool = False) -> np.ndarray:
    """Next-token log-probs of one decode pass at ``pos`` (``capture`` keeps its calls when ``armed``)."""
    if capture is not None:
        capture.armed, capture.layer = armed, 0
    logits = model(mx.array(stream[None, pos:pos + 1]), cache=cache)[0, -1].astype(mx.float32)
    lp = logits - mx.logsumexp(logits)
    mx.eval(lp)
    if capture is not None and capture.armed:
        mx.eval([a for _, args, _ in capture.calls for a in args if isinstance(a, mx.array)])
        capture.armed = False
    return np.array(lp)


def decode_run(model, stream: np.ndarray, *, tau, contexts, window, capture=None, sim_steps=()):
    """Log-probs [window, vocab] of the decoded window before each context (one sequence)."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvmetal.integrations.mlx_lm import use_paged_cache

    out = {}
    with use_paged_cache(model, sparse_v=tau):
        cache = make_prompt_cache(model)
        pos = 0
        for ctx in contexts:
            pos = prefill(model, stream, cache, pos, ctx - window)
            rows = []
            for i in range(window):
                rows.append(decode_logprobs(model, stream, cache, pos, capture, i in sim_steps))
                pos += 1
            out[ctx] = np.stack(rows)
    return out


def one_pass_run(model, stream: np.ndarray, *, taus, contexts, window, capture=None, sim_steps=()):
    """Every tau in one exact run: {tau (None = exact): {context: log-probs [window, vocab]}}.

    At each decoded position every tau decodes the next token over the exact cache
    (``PagedModelCache.sparse_v`` set, one forward pass, then ``trim(1)``), and the
    exact pass decodes it again and keeps it. Each step's error is then sparse V's
    alone, without the drift of a cache written under sparse V, and the long prefill
    is paid once instead of once per tau."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvmetal.integrations.mlx_lm import use_paged_cache

    out = {tau: {} for tau in (None, *taus)}
    with use_paged_cache(model):
        cache = make_prompt_cache(model)
        shared = cache[0].model_cache
        pos = 0
        for ctx in contexts:
            pos = prefill(model, stream, cache, pos, ctx - window)
            rows = {tau: [] for tau in out}
            for i in range(window):
                for tau in (*taus, None):  # exact last: its pass is the one kept
                    shared.sparse_v = tau
                    rows[tau].append(decode_logprobs(model, stream, cache, pos, capture,
                                                     tau is None and i in sim_steps))
                    if tau is not None:
                        for c in cache:
                            c.trim(1)
                pos += 1
            for tau in out:
                out[tau][ctx] = np.stack(rows[tau])
        shared.sparse_v = None
    return out


def sim_v_bytes(call, tau, **options) -> tuple[int, int]:
    """(V bytes loaded, live V bytes) of one captured paged_attention call on the sim backend
    (``options`` override the call's keyword arguments, e.g. ``num_splits=1``)."""
    import kvmetal as kv
    from kvmetal.sim import trace
    from kvmetal.sim.traffic import row_bytes

    _, args, kwargs = call
    query, kc, vc, tables, lens = args
    kwargs = dict(kwargs, sparse_v=tau, **options)
    with kv.use_backend("sim"), trace() as t:
        mx.eval(kv.paged_attention(query, kc, vc, tables, lens, **kwargs))
    c = next(c for c in t.calls if "paged_attention_partials" in c.name)
    loaded = sum(c.buffers[n].loaded for n in ("value_data", "value_scales", "value_biases") if n in c.buffers)
    seen = np.array(lens)
    if kwargs.get("sliding_window"):  # a window layer's kernel reads only its window
        seen = np.minimum(seen, kwargs["sliding_window"])
    live = int(seen.sum()) * vc.shape[1] * row_bytes(vc, vc.shape[-1])
    return loaded, live


def final_max_skips(call, tau) -> tuple[int, int]:
    """(V rows skippable, V rows) of one captured call if the rule used each row's final
    maximum (the oracle's rule: the most any kernel can skip), one V row per (kv head,
    key) skippable when every query row of the kv head has exp(s - max s) < tau."""
    from kvmetal import reference

    _, (query, kc, vc, tables, lens), kwargs = call
    q = reference.to_f64(query)[:, -1]  # [S, H, D]: the last (here the only) query token
    keys = reference.to_f64(kc)
    skipped = total = 0
    for s in range(q.shape[0]):
        n = int(np.array(lens)[s])
        rows = reference.sequence_rows(keys, reference.to_int(tables)[s], n)  # [Hkv, n, D]
        window = kwargs.get("sliding_window")
        if window:  # a window layer's row sees only its newest `window` keys
            rows = rows[:, -window:]
        group = q.shape[1] // rows.shape[0]
        softcap = kwargs.get("softcap")
        for h in range(rows.shape[0]):
            scores = q[s, h * group:(h + 1) * group] @ rows[h].T * kwargs.get("scale", q.shape[-1] ** -0.5)
            if softcap:
                scores = softcap * np.tanh(scores / softcap)
            weight = np.exp(scores - scores.max(axis=1, keepdims=True))
            skipped += int((weight < tau).all(axis=0).sum())
            total += rows.shape[1]
    return skipped, total


def skip_study(calls, taus) -> dict:
    """Per context and tau: V rows the sim kernel skips with the backend's split count and
    with one split, and what the final-max rule would skip."""
    out = {}
    for tau in taus:
        for ctx, group in calls.items():
            row = {"default_splits": [0, 0], "one_split": [0, 0], "final_max": [0, 0]}
            for call in group:
                for key, (a, b) in (("default_splits", sim_v_bytes(call, tau)),
                                    ("one_split", sim_v_bytes(call, tau, num_splits=1)),
                                    ("final_max", final_max_skips(call, tau))):
                    row[key][0] += a
                    row[key][1] += b
            out.setdefault(repr(tau), {})[str(ctx)] = {
                "v_rows_skipped_sim": 1 - row["default_splits"][0] / row["default_splits"][1],
                "v_rows_skipped_sim_one_split": 1 - row["one_split"][0] / row["one_split"][1],
                "v_rows_skipped_final_max": row["final_max"][0] / row["final_max"][1]}
            print(tau, ctx, out[repr(tau)][str(ctx)], file=sys.stderr, flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True, help="results file")
    ap.add_argument("--report", action="store_true", help="print the markdown table of --json and exit")
    ap.add_argument("--model", help="mlx-lm model directory or a kvmetal model name, e.g. gemma3 "
                                     "(default: SmolLM2-135M float32)")
    ap.add_argument("--contexts", default="512,2048,8192", help="contexts C (comma-separated)")
    ap.add_argument("--window", type=int, default=128, help="decoded positions before each context")
    ap.add_argument("--sim-layers", default="0,15,29", help="layers replayed on the simulator")
    ap.add_argument("--sim-steps", default="0,127", help="decode steps of each window replayed on the simulator")
    ap.add_argument("--taus", default=",".join(repr(t) for t in TAUS), help="thresholds (comma-separated)")
    ap.add_argument("--one-pass", action="store_true",
                    help="every tau over the exact run's cache, position by position (one_pass_run): one prefill "
                         "for all taus, no drift from a cache written under sparse V")
    ap.add_argument("--skip-only", action="store_true",
                    help="only the skip study (sim with default and one split, and the final-max rule) of the "
                         "captured exact calls; no KL runs")
    args = ap.parse_args(argv)
    if args.report:
        print(report_table(json.loads(Path(args.json).read_text())))
        return 0
    from kvmetal.models.blas import preload_openblas_and_reexec

    preload_openblas_and_reexec()  # float32 models on Linux: MLX's reference BLAS is ~30x slower
    from mlx_lm.utils import load

    from kvmetal.commands.common import resolve_model
    from kvmetal.models import default_model_path

    path = resolve_model(args.model) if args.model else default_model_path(dtype="float32")
    model, tokenizer = load(str(path))
    contexts = [int(c) for c in args.contexts.split(",")]
    stream = pydoc_stream(tokenizer, max(contexts))
    layers = [int(x) for x in args.sim_layers.split(",")]
    steps = {int(x) for x in args.sim_steps.split(",")}
    result = {"model": str(path), "window": args.window, "contexts": contexts, "sim_layers": layers,
              "sim_steps": sorted(steps), "backend": "cpu", "taus": {}}
    taus = [float(t) for t in args.taus.split(",")]
    result["method"] = "one-pass" if args.one_pass else "one run per tau"
    tic = time.perf_counter()
    with Capture(layers) as cap:
        if args.one_pass:
            runs = one_pass_run(model, stream, taus=taus, contexts=contexts, window=args.window, capture=cap,
                                sim_steps=steps)
            exact = runs[None]
        else:
            exact = decode_run(model, stream, tau=None, contexts=contexts, window=args.window, capture=cap,
                               sim_steps=steps)
    calls = cap.calls
    result["exact_seconds"] = time.perf_counter() - tic
    print(f"exact: {result['exact_seconds']:.0f} s, {len(calls)} captured calls", file=sys.stderr, flush=True)
    per_ctx_calls = {}
    for call in calls:
        ctx = next(c for c in contexts if int(np.array(call[1][4]).max()) <= c)
        per_ctx_calls.setdefault(ctx, []).append(call)
    if args.skip_only:
        result = {k: result[k] for k in ("model", "window", "contexts", "sim_layers", "sim_steps")}
        result["skips"] = skip_study(per_ctx_calls, TAUS[:3])
        Path(args.json).write_text(json.dumps(result, indent=1))
        return 0
    exact_ppl = {}
    for ctx in contexts:
        nxt = stream[ctx - args.window + 1:ctx + 1]
        exact_ppl[ctx] = float(np.exp(-exact[ctx][np.arange(args.window), nxt].mean()))
    result["exact"] = {str(c): {"ppl": exact_ppl[c]} for c in contexts}
    for tau in taus:
        tic = time.perf_counter()
        got = runs[tau] if args.one_pass else decode_run(model, stream, tau=tau, contexts=contexts,
                                                         window=args.window)
        seconds = time.perf_counter() - tic
        rows = {}
        for ctx in contexts:
            ref, lp = exact[ctx], got[ctx]
            nxt = stream[ctx - args.window + 1:ctx + 1]
            ppl = float(np.exp(-lp[np.arange(args.window), nxt].mean()))
            loaded = live = skippable = rows_total = 0
            for call in per_ctx_calls.get(ctx, []):
                a, b = sim_v_bytes(call, tau)
                loaded, live = loaded + a, live + b
                a, b = final_max_skips(call, tau)
                skippable, rows_total = skippable + a, rows_total + b
            rows[str(ctx)] = {"kl": float((np.exp(ref) * (ref - lp)).sum(axis=-1).mean()),
                              "kl_max": float((np.exp(ref) * (ref - lp)).sum(axis=-1).max()),
                              "ppl": ppl, "ppl_change": ppl / exact_ppl[ctx] - 1.0,
                              "top1": float((ref.argmax(-1) == lp.argmax(-1)).mean()),
                              "sim_v_loaded": loaded, "sim_v_live": live,
                              "v_rows_skipped": 1.0 - loaded / live if live else None,
                              "v_rows_skipped_final_max": skippable / rows_total if rows_total else None}
        result["taus"][repr(tau)] = {"seconds": seconds, "contexts": rows}
        print(f"tau {tau}: {rows} ({seconds:.0f} s)", file=sys.stderr, flush=True)
        Path(args.json).write_text(json.dumps(result, indent=1))
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(report_table(result))
    return 0


def report_table(result: dict) -> str:
    lines = ["| tau | context | V rows skipped (sim) | final-max rule | sim / final-max | sim V bytes / exact | "
             "KL(exact ‖ sparse) | max KL | ppl exact | ppl change | top-1 agreement |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"
    for tau, entry in result["taus"].items():
        for ctx, r in entry["contexts"].items():
            skipped, final = r["v_rows_skipped"], r.get("v_rows_skipped_final_max")
            share = f"{skipped / final:.2f}" if skipped is not None and final else "n/a"
            ratio = "n/a" if not r["sim_v_live"] else f"{r['sim_v_loaded'] / r['sim_v_live']:.3f}"
            lines.append(f"| {float(tau):.0e} | {ctx} | {pct(skipped)} | {pct(final)} | {share} | {ratio} | "
                         f"{r['kl']:.2e} | {r['kl_max']:.2e} | "
                         f"{result['exact'][ctx]['ppl']:.3f} | {100 * r['ppl_change']:+.4f}% | {r['top1']:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
