#!/usr/bin/env python3
"""Threads per threadgroup and estimated live registers per lane of every specialisation
family (``kvmetal.backends.specialisations``), the table in docs/kernels.md.

    python tools/kernel_limits.py             # markdown table on stdout
    python tools/kernel_limits.py --check     # exit 1 if a launch passes the limits

Each family's op call runs through a recording backend (no kernel runs): every launch's
threadgroup and template give its threads and, through
``kvmetal.backends.metal_layout.estimated_registers``, its registers. The limits are
``kvmetal.chips.PIPELINE_THREAD_LIMIT`` and what ``chips.max_threads_for_registers``
allows a pipeline of the estimated registers.
"""
from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvmetal import chips  # noqa: E402
from kvmetal.backends import metal, metal_layout, specialisations  # noqa: E402


def launches():
    """(family name, kernel, mode, threads, registers) of every launch of every family."""
    recorder = specialisations._Recorder()
    backend = metal.KernelBackend("limits", recorder, macos=15)
    rows = []
    for family in specialisations.specialisation_families():
        recorder.calls.clear()
        method, args, kwargs = specialisations.backend_call(family)
        getattr(backend, method)(*args, **kwargs)
        for variant, template, _, _, threadgroup in recorder.calls:
            kernel = specialisations._spec_name(variant)
            mode = specialisations._mode(template) if "RPS" in template else "-"
            rows.append((family.name, kernel, mode, math.prod(threadgroup),
                         metal_layout.estimated_registers(kernel, template)))
    return rows


def summary(rows) -> list:
    """Per (kernel, mode): launches, most threads, most registers."""
    table = {}
    for _, kernel, mode, threads, regs in rows:
        n, t, r = table.get((kernel, mode), (0, 0, 0))
        table[(kernel, mode)] = (n + 1, max(t, threads), max(r, regs))
    return [(k, m, *v) for (k, m), v in sorted(table.items())]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="fail if a launch passes the limits")
    args = parser.parse_args(argv)
    rows = launches()
    print("| kernel | mode | launches | most threads | most est. registers / lane |")
    print("|---|---|---|---|---|")
    for kernel, mode, n, threads, regs in summary(rows):
        print(f"| {kernel} | {mode} | {n} | {threads} | {regs} |")
    over = [r for r in rows if r[3] > min(chips.PIPELINE_THREAD_LIMIT, chips.max_threads_for_registers(r[4]))]
    print(f"\n{len(rows)} launches of {len(specialisations.specialisation_families())} families; "
          f"{chips.PIPELINE_THREAD_LIMIT} threads at most, and no more than a pipeline of the estimated "
          f"registers allows (chips.max_threads_for_registers); {len(over)} over")
    for r in over[:20]:
        print("  over:", r)
    return 1 if args.check and over else 0


if __name__ == "__main__":
    sys.exit(main())
