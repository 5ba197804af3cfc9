"""``kvmetal selfcheck``: one run that tells whether kvmetal works on this machine.

- Compile: every kernel specialisation family built through ``mx.fast.metal_kernel``
  (off a Mac, the simulator's build of the same calls), each on its own, so a failure
  names its specialisation and quotes the compiler while the rest go on (compiling.py).
- Correct: every op against the float64 oracle over a shape matrix and a randomized
  sweep, worst error per op against its budget (correctness.py).
- Fast: paged decode at 8K and 32K, f16 and K8/V4, next to MLX's SDPA, as a fraction
  of the chip's bandwidth; on a Mac only (speed.py).
- Report: first which build runs (wheel tag, MLX, macOS, the extension's minos and rpath,
  the Metal sources: build_info.py), then a summary table, and with ``--json`` the whole
  report with provenance (report.py). The exit status is 1 when anything failed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import mlx.core as mx

QUICK_SWEEP, FULL_SWEEP = 24, 200


def _parser() -> argparse.ArgumentParser:
    from ..cli_args import ArgumentParser, checked

    p = ArgumentParser(
        prog="kvmetal selfcheck",
        description="Compile every kernel specialisation, check every op against the float64 oracle, time paged "
                    "decode against MLX's SDPA, and report it all (exit status 1 when something failed). On a Mac "
                    "it runs on the GPU; elsewhere on the Metal simulator, --quick by default, without timings.")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true",
                      help=f"the short run: the shape matrix at the families' points and {QUICK_SWEEP} randomized "
                           "cases, 5 timing repeats (the default off a Mac)")
    size.add_argument("--full", action="store_true",
                      help=f"the long run: more GQA factors and {FULL_SWEEP} randomized cases over the whole space "
                           "(the default on a Mac)")
    p.add_argument("--json", metavar="REPORT.json", default=None,
                   help="also write the whole report as JSON to this file ('-' for stdout; the table then goes "
                        "to stderr)")
    p.add_argument("--backend", choices=("metal", "sim"), default=None,
                   help="where the kernels run (default: metal on a Mac, else sim)")
    p.add_argument("--sweep", type=checked(int, lambda v: v >= 0, ">= 0"), default=None, metavar="N",
                   help=f"randomized cases (default {QUICK_SWEEP} quick, {FULL_SWEEP} full)")
    p.add_argument("--seed", type=int, default=0, help="seed of the randomized sweep (default 0)")
    return p


def run(*, backend: str, quick: bool, sweep: int, seed: int = 0, source_hook=None, progress=None) -> dict:
    """All four parts; returns the report (see report.py for its layout)."""
    from . import build_info, compiling, correctness, families, report as report_mod, speed

    start = time.perf_counter()
    say = progress or (lambda message: None)
    fams = families.specialisation_families()
    say(f"compile: {len(fams)} specialisation families on {backend} ...")
    compile_section = compiling.compile_all(fams, backend=backend, source_hook=source_hook, progress=say)
    say(f"correct: ops against the float64 oracle on {backend} ...")
    correct_section = correctness.check_all(backend=backend, quick=quick, sweep_cases=sweep, seed=seed,
                                            progress=say)
    if backend == "metal":
        say("fast: paged decode next to mx.fast.scaled_dot_product_attention ...")
        fast_section = speed.time_all(quick=quick, progress=say)
    else:
        fast_section = {"skipped": "the simulator runs on the CPU: its timings say nothing about Metal speed "
                                   "(run kvmetal selfcheck on a Mac)", "results": []}
    failures = [f"compile {s['name']} (family {s['family']}): {(s['error'] or '').splitlines()[0][:300]}"
                for s in compile_section["specialisations"] if s["status"] != "ok"]
    failures += [f"compile {e['path']} of family {e['family']}: {e['error'].splitlines()[0][:300]}"
                 for e in compile_section["path_errors"]]
    failures += [f for op in correct_section["ops"] for f in op["failures"]]
    report = {
        "schema": report_mod.SCHEMA,
        "ok": not failures,
        "backend": backend,
        "simulator": backend == "sim",
        "quick": quick,
        "provenance": report_mod.provenance(backend, compile_section["specialisations"]),
        "build": build_info.describe(),
        "compile": compile_section,
        "correct": correct_section,
        "fast": fast_section,
        "failures": failures,
    }
    report["summary"] = {
        "families": len(compile_section["families"]),
        "specialisations": len(compile_section["specialisations"]),
        "ops": len(correct_section["ops"]),
        "cases": correct_section["cases"],
        "sweep_cases": correct_section["sweep"]["cases"],
        "failures": len(failures),
        "seconds": round(time.perf_counter() - start, 3),
    }
    return report


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    from . import report as report_mod

    on_mac = mx.metal.is_available()
    backend = args.backend or ("metal" if on_mac else "sim")
    if backend == "metal" and not on_mac:
        print("kvmetal selfcheck: error: --backend metal needs an Apple GPU (this machine has none; the default, "
              "sim, runs the same kernels on the simulator)", file=sys.stderr)
        return 2
    if backend == "sim":
        from ..benchmarks.cases import simulator_missing

        missing = simulator_missing()
        if missing:
            print(f"kvmetal selfcheck: error: the simulator cannot run here ({missing})", file=sys.stderr)
            return 2
    quick = args.quick or (not args.full and backend == "sim")
    sweep = args.sweep if args.sweep is not None else (QUICK_SWEEP if quick else FULL_SWEEP)
    if sweep < 0:
        print(f"kvmetal selfcheck: error: --sweep must be >= 0, got {sweep}", file=sys.stderr)
        return 2
    if args.json not in (None, "-") and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        print(f"kvmetal selfcheck: error: --json {args.json}: no such directory", file=sys.stderr)
        return 2
    out = sys.stderr if args.json == "-" else sys.stdout
    from . import build_info

    print("\n".join(build_info.lines(build_info.describe())), file=out, flush=True)
    if backend == "sim":
        print(report_mod.SIMULATOR_BANNER if quick else report_mod.SIMULATOR_BANNER.replace(
            "; --quick by default", "; --full run"), file=out, flush=True)
    else:
        from .speed import device_info

        print(f"kvmetal selfcheck: on the Apple GPU ({device_info().get('device_name', '?')}), "
              f"{'quick' if quick else 'full'} run", file=out, flush=True)

    def progress(message: str):
        print(message, file=sys.stderr, flush=True)

    report = run(backend=backend, quick=quick, sweep=sweep, seed=args.seed, progress=progress)
    print("\n".join(report_mod.summary_lines(report)), file=out, flush=True)
    if args.json:
        report_mod.write_json(report, args.json)
        if args.json != "-":
            print(f"report written to {args.json}", file=out)
    if not report["ok"]:
        print("Something failed: please open an issue with the JSON report attached (kvmetal selfcheck --json "
              "report.json).", file=out)
    return 0 if report["ok"] else 1
