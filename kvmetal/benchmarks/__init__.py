"""``kvmetal bench``: kernels against MLX baselines measured in the same run.

Each result reports what it measured (median, min and max seconds over its repeats,
after a warm-up), on which backend, the KV bytes a decode step must read, the effective
bandwidth, the baselines' seconds from this same process, and this machine's
single-pass read bandwidth (``read_gbps``) so a reader can judge the fraction of the
memory bound. ``--model DIR`` instead measures a whole model end to end
(``kvmetal.benchmarks.model_bench``).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import mlx.core as mx

from .. import backends, chips
from .cases import CASES, OPT_IN, run_case
from .provenance import provenance
from .timing import read_bandwidth_gbps


def _parser() -> argparse.ArgumentParser:
    from ..cli_args import ArgumentParser, checked
    from ..kv_format import add_format_flags

    at_least = lambda low: checked(int, lambda v: v >= low, f">= {low}")
    p = ArgumentParser(prog="kvmetal bench",
                                description="Kernels against MLX baselines measured in the same run; with "
                                            "--model, a model end to end next to mlx-lm.")
    p.add_argument("-m", "--model", default=None,
                   help="an mlx-lm model directory, Hugging Face repo id or 'default' (SmolLM2): prompt and generation "
                        "tokens/s, "
                        "peak memory and KV bytes at several contexts, for kvmetal f32/f16 (the model's K/V dtype), "
                        "kvmetal quantized (K8/V4 unless the K/V flags below say otherwise), mlx-lm "
                        "KVCache and mlx-lm kv_bits (8, or --kv-bits)")
    p.add_argument("--contexts", default=None,
                   help="with --model: prompt lengths to measure (default 512,4K,16K on a Mac, 512,2K elsewhere, "
                        "where MLX's CPU attention is slow; less those past the model's trained context)")
    p.add_argument("--gen-tokens", type=at_least(2), default=32,
                   help="with --model: tokens generated per run (default 32)")
    p.add_argument("--samples", type=at_least(1), default=3,
                   help="with --model: runs per cell; the median is shown with min..max (default 3)")
    p.add_argument("--backend", choices=backends.BACKENDS, default=None,
                   help="backend to time (default: metal on a Mac, else cpu)")
    p.add_argument("--cases", default=None,
                   help=f"comma-separated subset of: {', '.join(CASES)} (default: all but {', '.join(OPT_IN)})")
    p.add_argument("--tokens", type=at_least(1), default=32768,
                   help="context length of the decode cases (default 32768)")
    p.add_argument("--repeat", type=at_least(1), default=5,
                   help="timed repeats per case (median, min and max reported; default 5)")
    p.add_argument("--json", action="store_true", help="print one JSON object with a 'results' list")
    p.add_argument("--plot", metavar="PNG", default=None,
                   help="draw the results: GB/s per case with the read bandwidth (or chip peak) as a line; "
                        "with --model, tokens/s against context")
    p.add_argument("--no-baseline", action="store_true", help="skip the MLX baselines (faster)")
    p.add_argument("--speculative", action="store_true",
                   help="with --model: also prompt-lookup speculation through the engine, plain vs speculative on "
                        "input-grounded and open-chat prompts: tokens/s, acceptance rate, tokens per decode pass")
    group = p.add_argument_group("with --model, kvmetal's quantized cache",
                                 "the K/V format flags of kvmetal generate and serve, read the same way")
    add_format_flags(group)
    return p


def plot_problem(path: str | None) -> str | None:
    """Why ``--plot PATH`` could not be written after the run (checked before it), or None."""
    if path is None:
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        from ..cli_args import install_hint

        return f"--plot needs matplotlib: {install_hint('matplotlib')}"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"--plot {path}: no such directory {folder}"
    return None


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    backend = args.backend or backends.current_backend()
    if backend == "metal" and not mx.metal.is_available():
        print("kvmetal bench: error: the metal backend needs an Apple GPU (try --backend cpu)", file=sys.stderr)
        return 2
    problem = plot_problem(args.plot)
    if problem:
        print(f"kvmetal bench: error: {problem}", file=sys.stderr)
        return 2
    if args.model is not None:
        from .model_bench import main as model_main

        return model_main(args, backend)
    names = [n for n in CASES if n not in OPT_IN] if args.cases is None else [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"kvmetal bench: error: --cases: unknown case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}",
              file=sys.stderr)
        return 2

    def progress(message: str):
        print(message, file=sys.stderr, flush=True)

    progress(what_is_measured(backend))
    progress("measuring this machine's read bandwidth ...")
    # Per thread count too: one core's read shows whether a kernel on fewer threads
    # than cores is bounded by memory or by its own issue rate.
    cores = os.cpu_count() or 1
    read_by_threads = {n: read_bandwidth_gbps(threads=n) for n in sorted({1, cores})}
    probes = [read_by_threads[cores]]
    progress("  single-pass read: " + ", ".join(f"{g:.1f} GB/s on {n} thread{'s' if n > 1 else ''}"
                                                  for n, g in read_by_threads.items()))
    # On the metal backend also report the fraction of the chip's published peak.
    chip = chips.from_device_name(chips.metal_device_info().get("device_name", "")) if backend == "metal" else None
    results, interrupted = [], None
    try:
        for i, name in enumerate(names, 1):
            where = "sim" if name == "metal_kernels" and not mx.metal.is_available() else backend
            progress(f"[{i}/{len(names)}] {name} on {where} ...")
            start = time.perf_counter()
            results += run_case(name, backend=backend, tokens=args.tokens, repeat=args.repeat,
                                baseline=not args.no_baseline, progress=progress)
            progress(f"  done in {time.perf_counter() - start:.1f} s")
        # A second probe after the cases: a shared machine's bandwidth moves between runs (14.5
        # and 26.4 GB/s were seen), so the yardstick is the best of both and both are reported.
        progress("measuring the read bandwidth again ...")
        probes.append(read_bandwidth_gbps(threads=cores))
    except KeyboardInterrupt:
        interrupted = f"interrupted after {len(results)} result(s); the finished ones follow"
        print(f"\nkvmetal bench: {interrupted}", file=sys.stderr, flush=True)
    read_gbps = max(probes)
    for result in results:
        read_gbps = _attach_fractions(result, read_gbps, chip, progress)
    report = {
        "provenance": provenance(backend),
        "backend": backend,
        "read_gbps": read_gbps,
        "read_gbps_by_threads": read_by_threads,
        "read_gbps_probes": probes,
        "results": results,
    }
    if interrupted:
        report["interrupted"] = interrupted
    report["machine"] = report["provenance"]["machine"]  # kept for readers of older reports
    if args.plot:
        from .plots import plot_kernel_results

        peak = (chip.bandwidth_gbs, f"{chip.device_name} peak") if chip else None
        try:
            plot_kernel_results(results, read_gbps, args.plot, peak=peak)
            report["plot"] = args.plot
            progress(f"plot written to {args.plot}")
        except (OSError, ValueError) as e:  # the results are still printed
            report["plot_error"] = f"{type(e).__name__}: {e}"
            progress(f"kvmetal bench: error: --plot {args.plot}: {report['plot_error']}")
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_table(results, read_gbps, report["provenance"], read_by_threads, probes=probes, backend=backend)
    if interrupted:
        return 130
    return 1 if "plot_error" in report else 0


def what_is_measured(backend: str) -> str:
    """The first lines of the output: what the numbers are, and what they are not."""
    if backend == "metal":
        return ("kvmetal bench: kvmetal's Metal kernels against MLX's own Metal ops, timed on this GPU in the "
                "same run (each kernel and its baseline in turns).")
    return ("kvmetal bench: kvmetal's C++ CPU backend against MLX's own CPU ops, timed in the same run (each "
            "kernel and its baseline in turns).\n"
            "  MLX's CPU attention is not optimised (its quantized SDPA least of all), so the 'x faster' ratios "
            "say what kvmetal saves an MLX user on this CPU, not how the Metal kernels compare on a Mac; Metal "
            "speed needs an Apple Silicon Mac (run kvmetal bench there). Here the Metal kernels run on the "
            "simulator: bytes and costs, no time.")


def _attach_fractions(result: dict, read_gbps: float, chip, progress) -> float:
    """Fraction of the read bandwidth (and of the chip's peak). A case faster than the
    yardstick re-measures it; still faster means noise or cache-resident data, and no
    fraction is reported. Returns the (possibly re-measured) read bandwidth."""
    result["read_gbps"] = read_gbps
    gbps = result.get("gbps")
    if gbps is None:
        return read_gbps
    if gbps > read_gbps:
        progress(f"  {result['name']}: {gbps:.1f} GB/s beats the read bandwidth; measuring it again ...")
        read_gbps = max(read_gbps, read_bandwidth_gbps())
        result["read_gbps"] = read_gbps
    if gbps <= read_gbps:
        result["fraction_of_read"] = gbps / read_gbps
    else:
        result["fraction_of_read"] = None
        result["noisy"] = True
        result["note"] = (f"{gbps:.1f} GB/s exceeds the measured read bandwidth ({read_gbps:.1f} GB/s): the data "
                          f"was cache-resident or the timing noisy; no fraction reported")
    if chip is not None:
        result["chip"] = chip.device_name
        result["fraction_of_peak"] = gbps / chip.bandwidth_gbs if gbps <= chip.bandwidth_gbs else None
    return read_gbps


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def _ratio(r: dict, base: dict) -> str:
    speedup = base["seconds"] / r["seconds"]
    return f"kvmetal {speedup:.1f}x faster" if speedup >= 1 else f"kvmetal {1 / speedup:.1f}x slower"


def _print_table(results: list, read_gbps: float, prov: dict, read_by_threads: dict | None = None, *,
                 probes: list | None = None, backend: str | None = None):
    if backend is not None:  # the long form opened the progress output
        print(what_is_measured(backend).split("\n")[0])
    versions = ", ".join(f"{k} {v}" for k, v in prov["versions"].items() if v)
    print(f"\n{versions}; {prov['machine']['cpu']}, {prov['threads']['kvmetal_cpu']} kvmetal threads")
    spread = (f" (best of {len(probes)} probes: " + ", ".join(f"{g:.1f}" for g in probes) + " GB/s)"
              if probes and len(probes) > 1 else "")
    print(f"single-pass read bandwidth of this machine: {read_gbps:.1f} GB/s{spread}")
    if read_by_threads and len(read_by_threads) > 1:
        print("  by threads: " + ", ".join(f"{n}: {g:.1f} GB/s" for n, g in read_by_threads.items()))
    print()
    timed = [r for r in results if r.get("seconds") is not None]
    untimed = [r for r in results if r.get("seconds") is None]
    header = (f"{'case':<34} {'backend':<7} {'median ms':>9} {'min..max ms':>15} {'n':>2} {'GB/s':>7} "
              f"{'% read':>7}")
    print(header)
    print("-" * len(header))
    for r in timed:
        gbps = r.get("gbps")
        fraction = r.get("fraction_of_read")
        pct = f"{100 * fraction:>6.0f}%" if fraction is not None else ("  noisy" if r.get("noisy") else "      -")
        spread = f"{r['min_seconds'] * 1e3:.2f}..{r['max_seconds'] * 1e3:.2f}"
        rate = f"{gbps:>7.1f}" if gbps is not None else f"{'-':>7}"  # prefill: bound by arithmetic, no GB/s
        print(f"{r['name']:<34} {r['backend']:<7} {r['seconds'] * 1e3:>9.2f} {spread:>15} {r['repeats']:>2} "
              f"{rate} {pct}")
        if r.get("fraction_of_peak") is not None:
            print(f"{'':<36}{100 * r['fraction_of_peak']:.0f}% of {r['chip']} peak")
        for base in r.get("baselines") or []:
            runs = f", {base['repeats']} run{'s' if base['repeats'] != 1 else ''}"
            print(f"{'':<36}vs {base['name']}: {_ms(base['seconds'])}{runs}; {_ratio(r, base)}")
        for note in r.get("skipped_baselines") or []:
            print(f"{'':<36}({note})")
    if any(r.get("gbps") is None for r in timed):
        print("(GB/s '-': a prefill is bound by arithmetic, not by the bytes of the cache it reads)")
    if untimed:
        print()
        for r in untimed:
            print(f"{r['name']} [{r['backend']}]: {r.get('note', '')}")
        if any(r.get("costs") for r in untimed):
            from .sim_cases import LEGEND

            print(LEGEND)
    if not mx.metal.is_available():
        print("\nMetal speed needs an Apple Silicon Mac: there `kvmetal bench` times the Metal kernels next to "
              "MLX's SDPA and `kvmetal selfcheck` compiles and checks every kernel; here the Metal kernels "
              "ran on the simulator (traffic and costs, no timing).")
