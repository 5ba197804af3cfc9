"""Which seeds for sparse V's running max: the V rows each rule skips on captured attention.

For every layer and kv head of an attention capture (``kvmetal.benchmarks.attention_capture``)
a (kv head, key) V row counts as skipped when every query row of the kv head has
``exp(s - m) < tau``, with m per rule:

* ``final``: the row's final maximum (the most any kernel can skip);
* ``run``: the running max of a run of ``--run`` keys from -inf (the kernel before seeds:
  each simdgroup of each split starts afresh; 64 keys per run at 8K on the sim backend);
* ``first``, ``newest``, ``first+newest``, ``first4+newest4``, ``first+newestN``: that
  running max, seeded with the best score of those keys (the first live key, an attention
  sink in most models, and the newest one or N); ``first+newest31`` is the kernels' rule.

Key granularity (the kernel folds a pass of up to 8 keys into m at once, so it skips
slightly more). Prints one line per (tau, capture) and writes ``--json``.

    python bench/sparse_v_seed_study.py --json bench/sparse_v_seed_study.json CAPTURE.npz ...
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from kvmetal.benchmarks.attention_capture import load_capture

RULES = {"first": lambda t: [0], "newest": lambda t: [t - 1], "first+newest": lambda t: [0, t - 1],
         "first4+newest4": lambda t: list(range(4)) + list(range(t - 4, t)),
         # the kernels' seeds since (reference.sparse_v_seeds): first + 31 newest; 7 and 15 for the curve
         **{f"first+newest{n}": (lambda n: lambda t: [0] + list(range(max(0, t - n), t)))(n) for n in (7, 15, 31)}}


def skip_rates(rows, tau: float, run: int) -> dict:
    skipped, total = {}, 0
    for _, q, k, _, scale, softcap in rows:
        hkv, t, _ = k.shape
        group = q.shape[0] // hkv
        for h in range(hkv):
            s = (q[h * group:(h + 1) * group].astype(np.float64) @ k[h].astype(np.float64).T) * scale
            if softcap:
                s = softcap * np.tanh(s / softcap)
            runs = -(-t // run)
            padded = np.full((group, runs * run), -np.inf)
            padded[:, :t] = s
            running = np.maximum.accumulate(padded.reshape(group, runs, run), axis=2).reshape(group, -1)[:, :t]
            refs = {"final": s.max(axis=1, keepdims=True), "run": running}
            for name, seeds in RULES.items():
                refs[name] = np.maximum(running, s[:, seeds(t)].max(axis=1, keepdims=True))
            for name, m in refs.items():
                skipped[name] = skipped.get(name, 0) + int((np.exp(s - m) < tau).all(axis=0).sum())
            total += t
    return {name: n / total for name, n in skipped.items()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("captures", nargs="+", help="attention capture .npz files")
    ap.add_argument("--taus", default="1e-4,1e-6")
    ap.add_argument("--run", type=int, default=64, help="keys per run of the unseeded rule")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    out = {"run": args.run, "results": []}
    for path in args.captures:
        meta, rows = load_capture(path)
        for tau in (float(x) for x in args.taus.split(",")):
            rates = skip_rates(rows, tau, args.run)
            out["results"].append({"capture": Path(path).name, "tokens": meta["tokens"], "tau": tau, **rates})
            print(f"{Path(path).name} tau={tau:g} " + " ".join(f"{k}={v:.3f}" for k, v in rates.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
