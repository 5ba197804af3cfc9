"""``kvmetal bench``: kernels against MLX baselines measured in the same run.

Each result reports what it measured (median seconds over repeats, after a warm-up),
on which backend, the KV bytes a decode step must read, the effective bandwidth, the
baseline's seconds from this same process, and this machine's single-pass read
bandwidth (``read_gbps``) so a reader can judge the fraction of the memory bound.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys

import mlx.core as mx

from .. import backends, chips
from .cases import CASES, run_case
from .timing import read_bandwidth_gbps


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvmetal bench",
                                description="Kernels against MLX baselines measured in the same run.")
    p.add_argument("--backend", choices=backends.BACKENDS, default=None,
                   help="backend to time (default: metal on a Mac, else cpu)")
    p.add_argument("--cases", default=None,
                   help=f"comma-separated subset of: {', '.join(CASES)} (default: all)")
    p.add_argument("--tokens", type=int, default=32768, help="context length of the decode cases (default 32768)")
    p.add_argument("--repeat", type=int, default=5, help="timed repeats per case (median reported)")
    p.add_argument("--json", action="store_true", help="print one JSON object with a 'results' list")
    p.add_argument("--no-baseline", action="store_true", help="skip the MLX baselines (faster)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    backend = args.backend or backends.current_backend()
    if backend == "metal" and not mx.metal.is_available():
        print("kvmetal bench: the metal backend needs an Apple GPU (try --backend cpu)", file=sys.stderr)
        return 2
    names = list(CASES) if args.cases is None else [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"kvmetal bench: unknown case(s) {unknown}; choose from {list(CASES)}", file=sys.stderr)
        return 2
    if args.tokens < 1 or args.repeat < 1:
        print("kvmetal bench: --tokens and --repeat must be >= 1", file=sys.stderr)
        return 2

    def progress(message: str):
        print(message, file=sys.stderr, flush=True)

    progress("measuring this machine's read bandwidth ...")
    read_gbps = read_bandwidth_gbps()
    progress(f"  single-pass read: {read_gbps:.1f} GB/s")
    # On the metal backend also report the fraction of the chip's published peak.
    chip = chips.from_device_name(mx.metal.device_info().get("device_name", "")) if backend == "metal" else None
    results = []
    for i, name in enumerate(names, 1):
        progress(f"[{i}/{len(names)}] {name} on {backend} ...")
        for result in run_case(name, backend=backend, tokens=args.tokens, repeat=args.repeat,
                               baseline=not args.no_baseline, progress=progress):
            result["read_gbps"] = read_gbps
            if result.get("gbps") is not None:
                result["fraction_of_read"] = result["gbps"] / read_gbps
                if chip is not None:
                    result["chip"] = chip.device_name
                    result["fraction_of_peak"] = result["gbps"] / chip.bandwidth_gbs
            results.append(result)
            progress("  " + _summary(result))
    report = {
        "machine": {"platform": platform.platform(), "processor": platform.machine(),
                    "metal": mx.metal.is_available()},
        "backend": backend,
        "read_gbps": read_gbps,
        "results": results,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(results, read_gbps)
    return 0


def _summary(r: dict) -> str:
    if r.get("seconds") is None:
        return f"{r['name']}: {r.get('note', '')}"
    text = f"{r['name']} [{r['backend']}]: {r['seconds'] * 1e3:.2f} ms"
    if r.get("gbps") is not None:
        text += f", {r['gbps']:.1f} GB/s"
    base = r.get("baseline")
    if base:
        text += f" | baseline {base['name']}: {base['seconds'] * 1e3:.2f} ms ({_ratio(r)})"
    return text


def _ratio(r: dict) -> str:
    speedup = r["baseline"]["seconds"] / r["seconds"]
    return f"kvmetal {speedup:.1f}x faster" if speedup >= 1 else f"kvmetal {1 / speedup:.1f}x slower"


def _print_table(results: list, read_gbps: float):
    print(f"\nsingle-pass read bandwidth of this machine: {read_gbps:.1f} GB/s\n")
    timed = [r for r in results if r.get("seconds") is not None]
    untimed = [r for r in results if r.get("seconds") is None]
    header = f"{'case':<34} {'backend':<7} {'ms':>9} {'GB/s':>7} {'% read':>7}  baseline (same run)"
    print(header)
    print("-" * len(header))
    for r in timed:
        gbps = r.get("gbps")
        base = r.get("baseline")
        base_text = f"{base['name']}: {base['seconds'] * 1e3:.2f} ms; {_ratio(r)}" if base else ""
        if "fraction_of_peak" in r:
            base_text = f"{100 * r['fraction_of_peak']:.0f}% of {r['chip']} peak; " + base_text
        print(f"{r['name']:<34} {r['backend']:<7} {r['seconds'] * 1e3:>9.2f} "
              f"{gbps if gbps is not None else float('nan'):>7.1f} "
              f"{100 * r['fraction_of_read'] if 'fraction_of_read' in r else float('nan'):>6.0f}%  {base_text}")
    if untimed:
        print()
        for r in untimed:
            print(f"{r['name']} [{r['backend']}]: {r.get('note', '')}")
