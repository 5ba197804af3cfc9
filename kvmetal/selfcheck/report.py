"""Report: provenance, the summary table and the JSON a user pastes into an issue."""
from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from pathlib import Path


SCHEMA = "kvmetal-selfcheck/1"
SIMULATOR_BANNER = ("kvmetal selfcheck: running on the Metal simulator (kvmetal.sim, on the CPU): no Apple GPU "
                    "here, so Metal's own compiler, the real GPU and timings are not checked; --quick by default")


def git_revision() -> str | None:
    """The commit kvmetal runs from: $GITHUB_SHA in CI, else ``git rev-parse`` where a
    kvmetal checkout is (the package's parent for an editable install, else the current
    directory), with "+dirty" for local changes; None for an installed wheel."""
    if os.environ.get("GITHUB_SHA"):
        return os.environ["GITHUB_SHA"]
    package_parent = Path(__file__).resolve().parent.parent.parent
    for where in (package_parent, Path.cwd()):
        if not ((where / "kvmetal" / "ops.py").is_file() and (where / "kernels").is_dir()):
            continue
        try:
            rev = subprocess.run(["git", "-C", str(where), "rev-parse", "HEAD"], capture_output=True, text=True,
                                 timeout=10)
            if rev.returncode != 0:
                continue
            dirty = subprocess.run(["git", "-C", str(where), "status", "--porcelain", "--untracked-files=no"],
                                   capture_output=True, text=True, timeout=10).stdout.strip()
            return rev.stdout.strip() + ("+dirty" if dirty else "")
        except (OSError, subprocess.SubprocessError):
            continue
    return None


def math_modes(specialisations: list) -> dict:
    """{kernel: math mode(s) it was built with}, from what the compile stage passed to metal_kernel."""
    modes = {}
    for s in specialisations:
        modes.setdefault(s["kernel"], set()).add(s.get("math_mode") or "default")
    return {k: "/".join(sorted(v)) for k, v in sorted(modes.items())}


def provenance(backend: str, specialisations: list) -> dict:
    from ..benchmarks.provenance import provenance as bench_provenance
    from .. import chips

    base = bench_provenance(backend)
    from .speed import device_info

    info = device_info()
    chip = chips.from_device_name(info.get("device_name", "")) if info else None
    return {
        **base,
        "chip": chip.name if chip else None,
        "gpu": info.get("device_name"),
        "gpu_architecture": info.get("architecture"),
        "gpu_memory_bytes": info.get("memory_size"),
        "macos": platform.mac_ver()[0] or None,
        "kvmetal": base["versions"]["kvmetal"],
        "mlx": base["versions"]["mlx"],
        "git_revision": git_revision(),
        "math_mode": math_modes(specialisations),
    }


# ----------------------------------------------------------------------------- the table

def _fmt_error(x) -> str:
    if x is None:
        return "-"
    if x == "inf" or (isinstance(x, float) and math.isinf(x)):
        return "inf"
    return f"{x:.1e}" if x else "0"


def compile_lines(comp: dict) -> list:
    """The Compile stage's lines: counts, the largest threadgroup launched and any pipeline
    that refused its launch (a Mac's thread limits), then each failure."""
    lines = []
    n_ok = sum(s["status"] == "ok" for s in comp["specialisations"])
    lines.append(f"Compile  {len(comp['families'])} families, {len(comp['specialisations'])} specialisations: "
                 f"{n_ok} ok, {len(comp['specialisations']) - n_ok} failed"
                 + (f", {len(comp['path_errors'])} op errors" if comp["path_errors"] else "")
                 + f"   [{comp['seconds']:.1f} s]")
    threads = [s.get("threads") for s in comp["specialisations"] if s.get("threads")]
    refused = [s for s in comp["specialisations"] if s.get("max_threads")]
    if threads:
        lines.append(f"  threads per threadgroup: at most {max(threads)} launched"
                     + (f"; {len(refused)} specialisations refused by their pipeline's limit (lowest "
                        f"{min(s['max_threads'] for s in refused)}): report them" if refused
                        else "; no pipeline refused its launch"))
    for s in comp["specialisations"]:
        if s["status"] != "ok":
            lines.append(f"  FAILED {s['name']} (family {s['family']}):")
            lines += [f"    {line}" for line in (s["error"] or "").splitlines()[:6]]
    for e in comp["path_errors"]:
        lines.append(f"  FAILED {e['path']} of family {e['family']}: {e['error'].splitlines()[0][:300]}")
    return lines


def summary_lines(report: dict) -> list:
    lines = []
    prov = report["provenance"]
    rev = prov["git_revision"][:12] + ("+dirty" if prov["git_revision"].endswith("+dirty") else "") \
        if prov.get("git_revision") else "no git revision"
    where = prov.get("gpu") or prov["machine"]["cpu"]
    lines.append(f"kvmetal {prov['kvmetal']} ({rev}), MLX {prov['mlx']}, {prov['machine']['platform']}, "
                 f"{where}; backend {report['backend']}" + (f", macOS {prov['macos']}" if prov.get("macos") else ""))
    lines.append("math mode: " + ", ".join(f"{k} {v}" for k, v in prov["math_mode"].items()))
    lines.append("")
    lines += compile_lines(report["compile"])
    corr = report["correct"]
    lines.append(f"Correct  {len(corr['ops'])} ops, {corr['cases']} cases ({corr['sweep']['cases']} randomized, "
                 f"seed {corr['sweep']['seed']})   [{corr['seconds']:.1f} s]")
    lines.append(f"  {'op':<26} {'cases':>5} {'sweep':>5} {'worst err':>9} {'budget':>8}  result")
    for op in corr["ops"]:
        budget = "exact" if op["budget"] == 0 else _fmt_error(op["budget"])
        lines.append(f"  {op['op']:<26} {op['cases']:>5} {op['sweep_cases']:>5} {_fmt_error(op['worst_error']):>9} "
                     f"{budget:>8}  {'ok' if op['ok'] else 'FAILED'}")
        for failure in op["failures"][:5]:
            lines.append(f"    {failure[:400]}")
        if len(op["failures"]) > 5:
            lines.append(f"    ... {len(op['failures']) - 5} more in the JSON report")
    for skipped in corr["skipped_ops"]:
        lines.append(f"  {skipped['op']:<26} not checked: {skipped['reason']}")
    fast = report["fast"]
    if fast.get("skipped"):
        lines.append(f"Fast     skipped: {fast['skipped']}")
    else:
        lines.append(f"Fast     {fast['device']}: peak {fast['peak_gbps']:.0f} GB/s ({fast['peak_source']}); "
                     f"measured read {fast['measured_read_gbps']:.0f} GB/s   [{fast['seconds']:.1f} s]")
        lines.append(f"  {'case':<58} {'median ms':>9} {'GB/s':>7} {'% peak':>6}  vs baseline")
        for r in fast["results"]:
            pct = f"{100 * r['fraction_of_peak']:.0f}%" if r.get("fraction_of_peak") is not None else "-"
            vs = f"{r['speedup_vs_baseline']:.2f}x" if "speedup_vs_baseline" in r else ""
            lines.append(f"  {r['name']:<58} {r['median_ms']:>9.3f} {r['gbps']:>7.1f} {pct:>6}  {vs}")
    s = report["summary"]
    verdict = "PASS" if report["ok"] else f"FAIL ({len(report['failures'])} failures)"
    lines.append("")
    lines.append(f"{verdict}: {s['specialisations']} specialisations in {s['families']} families, {s['ops']} ops, "
                 f"{s['cases']} cases ({s['sweep_cases']} randomized) in {s['seconds']:.0f} s")
    return lines


def write_json(report: dict, path: str):
    text = json.dumps(report, indent=2, default=str) + "\n"
    if path == "-":
        print(text, end="")
    else:
        Path(path).write_text(text)
