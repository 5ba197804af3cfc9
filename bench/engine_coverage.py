"""The Engine (kvmetal serve / generate's batcher) on every architecture the coverage sweep
finds exact under use_paged_cache (bench/model_coverage.json): greedy tokens of three
prompts run as one batch in small prefill chunks, against mlx-lm's own greedy tokens of
each prompt alone (issue 40, item 4).

    python bench/engine_coverage.py [--json out.json] [--steps 8]

Tiny random-weight models (kvmetal.integrations.arch_sweep), cpu backend. Per architecture:
served (tokens equal), refused (UnsupportedModel at Engine construction, with its reason),
or differs / error.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import mlx.core as mx  # noqa: E402

PROMPTS = [list(range(3, 40)), [7, 1, 9, 4, 4], list(range(100, 121))]


def greedy_alone(model, prompt, steps):
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=steps,
                                            sampler=lambda lp: mx.argmax(lp, axis=-1))]


def check(name: str, steps: int) -> dict:
    from kvmetal.engine.engine import Engine
    from kvmetal.integrations import arch_sweep
    from kvmetal.integrations.mlx_lm import UnsupportedModel

    t0 = time.perf_counter()
    model = arch_sweep.build(name)
    try:
        expected = [greedy_alone(model, p, steps) for p in PROMPTS]
        with Engine(model, block_size=8, max_num_batched_tokens=16) as engine:
            got = engine.run(PROMPTS, steps)
    except UnsupportedModel as exc:
        return {"name": name, "status": "refused", "reason": str(exc).splitlines()[0][:300],
                "seconds": round(time.perf_counter() - t0, 1)}
    except Exception as exc:  # noqa: BLE001 - reported per architecture
        return {"name": name, "status": "error", "reason": f"{type(exc).__name__}: {exc}"[:300],
                "seconds": round(time.perf_counter() - t0, 1)}
    status = "served" if got == expected else "differs"
    return {"name": name, "status": status, "reason": "" if status == "served" else f"got {got} want {expected}"[:300],
            "seconds": round(time.perf_counter() - t0, 1)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--only", help="comma-separated architectures")
    args = ap.parse_args(argv)
    rows = json.loads((ROOT / "bench" / "model_coverage.json").read_text())["rows"]
    names = [r["name"] for r in rows if r["status"] == "exact"]
    if args.only:
        names = [n for n in names if n in args.only.split(",")]
    out = []
    for i, name in enumerate(names):
        r = check(name, args.steps)
        out.append(r)
        print(f"[{i + 1}/{len(names)}] {name:28s} {r['status']:8s} {r['seconds']:6.1f}s {r['reason'][:120]}", flush=True)
    counts = {s: sum(1 for r in out if r["status"] == s) for s in ("served", "refused", "differs", "error")}
    print(f"{len(out)} architectures exact under use_paged_cache: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"steps": args.steps, "prompts": [len(p) for p in PROMPTS],
                                               "counts": counts, "rows": out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
