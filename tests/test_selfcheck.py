"""``kvmetal selfcheck``: the report's schema, per-specialisation isolation, the
families it compiles, and its command line.

On Linux the selfcheck runs on the simulator (quick); on a Mac the same test runs it
on the GPU."""
from __future__ import annotations

import contextlib
import functools
import io
import json
import math
import re
import sys
from pathlib import Path

import mlx.core as mx
import pytest

import kvmetal
import kvmetal.selfcheck as selfcheck
from kvmetal import cli
from kvmetal.backends import metal, metal_specs
from kvmetal.selfcheck import cases, compiling, correctness, families, report

ROOT = Path(__file__).resolve().parent.parent
ON_MAC = mx.metal.is_available()
CORE_OPS = {"paged_attention", "decode_attention", "reshape_and_cache", "gather_kv_cache", "copy_blocks"}


def _run_cli(argv) -> tuple:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(argv)
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    path = tmp_path_factory.mktemp("selfcheck") / "report.json"
    code, out, err = _run_cli(["selfcheck", "--quick", "--json", str(path)])
    return code, out, err, json.loads(path.read_text())


def test_quick_report_schema(quick_run):
    code, out, err, rep = quick_run
    assert code == 0, out[-4000:] + err[-4000:]
    assert rep["schema"] == report.SCHEMA and rep["ok"] is True and rep["failures"] == []
    assert rep["quick"] is True and rep["backend"] == ("metal" if ON_MAC else "sim")
    prov = rep["provenance"]
    for key in ("chip", "gpu", "macos", "mlx", "kvmetal", "git_revision", "math_mode", "versions", "machine"):
        assert key in prov, key
    assert prov["mlx"] == mx.__version__
    # The math mode is what the compile stage handed to metal_kernel, per kernel.
    assert set(prov["math_mode"]) == set(metal_specs.SPECS)
    assert set(prov["math_mode"].values()) <= {"safe", "relaxed", "fast"}

    comp = rep["compile"]
    fams = families.specialisation_families()
    assert [f["name"] for f in comp["families"]] == [f.name for f in fams]
    for fam in comp["families"]:
        assert fam["paths"] and set(fam["paths"].values()) == {"ok"} and fam["failed"] == [], fam
    traced = CORE_OPS | {op for op in ("paged_attention_varlen", "paged_attention_cascade") if hasattr(kvmetal, op)}
    assert set().union(*(fam["paths"] for fam in comp["families"])) == traced
    names = [s["name"] for s in comp["specialisations"]]
    assert len(names) == len(set(names))
    assert {s["kernel"] for s in comp["specialisations"]} == set(metal_specs.SPECS)
    assert all(s["status"] == "ok" and s["error"] is None and s["seconds"] >= 0 for s in comp["specialisations"])
    assert comp["failed"] == 0 and comp["path_errors"] == []

    corr = rep["correct"]
    ops = {o["op"]: o for o in corr["ops"]}
    assert CORE_OPS <= set(ops)
    for op in ops.values():
        assert op["ok"] and op["failures"] == [] and op["cases"] >= 2, op
        assert isinstance(op["worst_error"], float) and op["worst_error"] <= op["budget"], op
    assert ops["paged_attention"]["sweep_cases"] > 0 and ops["decode_attention"]["sweep_cases"] > 0
    assert corr["sweep"]["cases"] == selfcheck.QUICK_SWEEP == sum(o["sweep_cases"] for o in ops.values())
    assert corr["cases"] == sum(o["cases"] for o in ops.values())
    # Paged decode was checked at every query length 1..8.
    assert ops["paged_attention"]["query_lens"] == list(range(1, 9))
    for skipped in corr["skipped_ops"]:
        assert skipped["op"] in correctness.OPTIONAL_OPS and skipped["reason"]

    fast = rep["fast"]
    if ON_MAC:
        assert fast["skipped"] is None and len(fast["results"]) >= 6
    else:
        assert fast["skipped"] and "simulator" in fast["skipped"] and fast["results"] == []
    summary = rep["summary"]
    assert summary["specialisations"] == len(names) and summary["families"] == len(fams)
    assert summary["ops"] == len(ops) and summary["failures"] == 0 and summary["seconds"] > 0


def test_first_lines_say_which_build_runs(quick_run):
    code, out, _, rep = quick_run
    lines = out.splitlines()
    b = rep["build"]
    assert lines[0].startswith("build: ") and b["mlx"] == mx.__version__ and f"MLX {mx.__version__}" in lines[1]
    metal_sources = sorted(p.name for p in (ROOT / "kernels").glob("*.metal"))
    assert b["metal_sources"]["files"] == metal_sources and f"Metal sources: {len(metal_sources)} found" in out
    ext = b["extension"]
    if ext["path"] is None:
        assert "kvmetal._ext is missing" in out
    elif ON_MAC:
        assert ext["format"] == "Mach-O" and f"minos {ext['minos']}, LC_RPATH " in out
        if b["wheel"]["installed"] and not b["wheel"]["editable"]:
            assert ext["rpaths"] == ["@loader_path/../mlx/lib"] and ext["signed"]
    else:
        assert ext["format"] == "ELF" and "minos and LC_RPATH are macOS-only" in out
    if b["built_against_mlx"]:
        assert f"(built against {b['built_against_mlx']})" in lines[1]


def test_first_line_after_the_build_says_where_it_ran(quick_run):
    code, out, _, rep = quick_run
    first = next(ln for ln in out.splitlines() if not ln.startswith(("build: ", "  ")))
    if ON_MAC:
        assert "Apple GPU" in first
    else:
        assert first == report.SIMULATOR_BANNER and "simulator" in first
    assert "PASS" in out and f"{rep['summary']['specialisations']} specialisations" in out


def _broken(target: str):
    """A source hook that breaks the one specialisation named ``target``."""
    def hook(variant, source):
        return source + "\n    this_is_not_msl(;\n" if variant == target else source
    return hook


def _target(clean: dict) -> dict:
    """The specialisation to break: a paged partials kernel (a bf16 one where there is
    one), which runs before the reduce kernel of the same op."""
    partials = [s for s in clean["specialisations"] if s["kernel"] == "paged_attention_partials"]
    return next((s for s in partials if "_tkbf16_" in s["name"]), partials[0])


def test_a_broken_specialisation_is_named_and_the_rest_keep_running(quick_run):
    clean = quick_run[3]["compile"]
    target = _target(clean)
    broken = compiling.compile_all(families.specialisation_families(), backend="metal" if ON_MAC else "sim",
                                   source_hook=_broken(target["name"]))
    failed = [s for s in broken["specialisations"] if s["status"] == "failed"]
    assert [s["name"] for s in failed] == [target["name"]] and failed[0]["family"] == target["family"]
    assert "this_is_not_msl" in failed[0]["error"] or "compile" in failed[0]["error"].lower(), failed[0]["error"]
    assert broken["failed"] == 1 and broken["path_errors"] == []
    # Every other specialisation was still built, the same ones as in a clean run and
    # family by family: also those its family built after it (the reduce kernel of the
    # same paged_attention call among them).
    assert [s["name"] for s in broken["specialisations"]] == [s["name"] for s in clean["specialisations"]]
    assert [f["specialisations"] for f in broken["families"]] == [f["specialisations"] for f in clean["families"]]
    family = next(f for f in broken["families"] if f["name"] == target["family"])
    assert set(family["paths"].values()) == {"ok"}
    assert family["failed"] == [target["name"]]


def test_a_broken_specialisation_fails_the_command(monkeypatch, tmp_path, quick_run):
    target = _target(quick_run[3]["compile"])["name"]
    monkeypatch.setattr(selfcheck, "run", functools.partial(selfcheck.run, source_hook=_broken(target)))
    path = tmp_path / "report.json"
    code, out, _ = _run_cli(["selfcheck", "--quick", "--sweep", "0", "--json", str(path)])
    rep = json.loads(path.read_text())
    assert code == 1 and rep["ok"] is False
    assert len(rep["failures"]) == 1 and target in rep["failures"][0]
    assert f"FAILED {target}" in out and "FAIL (1 failures)" in out
    # The other stages still ran in full.
    assert all(o["ok"] for o in rep["correct"]["ops"]) and rep["correct"]["cases"] > 10


class _RecordingKernel:
    """A make_kernel whose kernels return zeros: which specialisations would be built, without building."""

    def __init__(self):
        self.names = []

    def __call__(self, *, name, **_):
        self.names.append(name)
        return lambda *, output_shapes, output_dtypes, **__: [mx.zeros(s, d) for s, d in
                                                               zip(output_shapes, output_dtypes)]


def test_families_cover_what_the_clang_check_traces():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import msl_check
    finally:
        sys.path.pop(0)
    traced = {name.split("#")[0] for name in msl_check.generated_sources()}
    recorder = _RecordingKernel()
    backend = metal.KernelBackend("record", recorder)
    for family in families.specialisation_families():
        for _, thunk in family.paths():
            with compiling.routed_to(backend):
                mx.eval(*families.flat_arrays(thunk()))
    assert traced and traced <= set(recorder.names), sorted(traced - set(recorder.names))


def test_op_level_families_adapt():
    """The form of a list derived from specialisation parameters: one op per family,
    with a function building its inputs."""
    from dataclasses import dataclass

    from kvmetal import ops

    @dataclass(frozen=True)
    class Config:
        op: str
        dtype: str
        head_dim: int
        name: str = "decode_attention-float16-d64"

    def inputs(config, seed):
        q = mx.random.normal((1, 4, 1, config.head_dim), key=mx.random.key(seed)).astype(mx.float16)
        k = mx.random.normal((1, 1, 9, config.head_dim)).astype(mx.float16)
        return ops.decode_attention, (q, k, k), {}

    fam = families.OpFamily(Config("decode_attention", "float16", 64), inputs)
    out = compiling.compile_all([fam], backend="metal" if ON_MAC else "sim")
    assert out["families"][0]["name"] == fam.name and out["families"][0]["paths"] == {"decode_attention": "ok"}
    assert out["families"][0]["head_dim"] == 64
    assert fam.point() == dict(dtype="f16", d=64, bs=16, hkv=2, g=4, L=1, k=None, v=None)  # defaults fill in
    assert {s["kernel"] for s in out["specialisations"]} == {"decode_attention_partials", "attention_reduce"}


def test_family_from_params_accepts_other_spellings():
    f = families.Family.from_params(dict(dtype=mx.bfloat16, head_dim=96, block_size=32, k_quant=[3, 32],
                                         v_quant=None, query_len=2, extra="ignored"))
    assert (f.dtype, f.k_quant, f.v_quant, f.gqa) == ("bf16", (3, 32), None, 4)
    assert families.Family.from_params(dict(dtype="float16", head_dim=64, block_size=8, query_len=1)).dtype == "f16"


def test_budgets_are_the_design_docs():
    text = (ROOT / "docs" / "design.md").read_text()
    table = dict(re.findall(r"^\s*\| (float32|float16|bfloat16) \| ([0-9e.-]+) \|", text, re.M))
    assert {k: float(v) for k, v in table.items()} == {
        {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}[k]: v for k, v in correctness.BUDGETS.items()}


def test_rel_error_flags_nan_as_infinite():
    import numpy as np

    assert math.isinf(correctness.rel_error(np.array([1.0, np.nan]), np.array([1.0, 2.0])))
    assert correctness.rel_error(np.array([1.0, 2.1]), np.array([1.0, 2.0])) == pytest.approx(0.05)


@pytest.mark.skipif(ON_MAC, reason="off a Mac only: there is no Apple GPU")
def test_metal_backend_without_a_gpu_is_a_usage_error():
    code, _, err = _run_cli(["selfcheck", "--backend", "metal"])
    assert code == 2 and "needs an Apple GPU" in err and "Traceback" not in err


def test_bad_sweep_count_is_a_usage_error():
    code, _, err = _run_cli(["selfcheck", "--sweep", "-1"])
    assert code == 2 and "--sweep" in err


@pytest.mark.skipif(ON_MAC, reason="a Mac runs the real thing in test_quick_report_schema")
def test_fast_stage_code_runs_on_the_cpu(monkeypatch, quick_run):
    """The timing code runs only on a Mac; here it runs on the cpu backend at small
    contexts, as if on an M2 Max, so that the first Mac run does not meet a typo."""
    import kvmetal as kv
    from kvmetal.selfcheck import speed

    use_backend = kv.use_backend
    monkeypatch.setattr(speed, "CONTEXTS", (256, 512))
    monkeypatch.setattr(speed, "READ_PROBE_BYTES", 1 << 22)
    monkeypatch.setattr(speed, "device_info", lambda: {"device_name": "Apple M2 Max"})
    monkeypatch.setattr(speed.mx.metal, "is_available", lambda: True)
    monkeypatch.setattr(speed.kv, "use_backend", lambda name: use_backend("cpu"))
    fast = speed.time_all(quick=True)
    assert fast["skipped"] is None and fast["chip"] == "m2-max" and fast["peak_gbps"] == 400
    names = [r["name"] for r in fast["results"]]
    for t in (256, 512):
        for name in (f"mx.fast.scaled_dot_product_attention f16 T={t}", f"kvmetal paged_attention f16 T={t}",
                     f"kvmetal paged_attention K8/V4 T={t}"):
            assert name in names
    for r in fast["results"]:
        assert r["median_ms"] > 0 and r["gbps"] > 0 and r["fraction_of_peak"] == pytest.approx(r["gbps"] / 400)
        assert ("speedup_vs_baseline" in r) == r["name"].startswith("kvmetal")
    k8v4 = next(r for r in fast["results"] if "K8/V4 T=512" in r["name"])
    f16 = next(r for r in fast["results"] if "f16 T=512" in r["name"] and r["name"].startswith("kvmetal"))
    assert 0.3 < k8v4["kv_bytes"] / f16["kv_bytes"] < 0.5   # 8 + 4 bits and their scales vs 2 x 16
    lines = report.summary_lines({**quick_run[3], "fast": fast})
    assert any("% peak" in line for line in lines) and any("kvmetal paged_attention K8/V4 T=256" in l for l in lines)


def _sub_chunks(lens, starts):
    """(sequence, first query row, rows, last position + 1) for runs of at most 8 rows."""
    for s in range(len(lens)):
        n = starts[s + 1] - starts[s]
        for first in range(0, n, 8):
            rows = min(8, n - first)
            yield s, starts[s] + first, rows, lens[s] - n + first + rows


def test_varlen_and_cascade_checks_run_when_kvmetal_has_them(monkeypatch):
    """The two optional ops are checked once they exist; here stand-ins built from
    paged_attention take their place, which exercises the checks' own code."""
    import numpy as np

    import kvmetal as kv
    from kvmetal import reference

    def varlen(paged, cat):
        def op(query, kc, vc, tables, lens, starts, **kw):
            kw.pop("validate", None)
            t, n, st = np.array(tables), np.array(lens), np.array(starts)
            outs = [paged(query[a:a + r][None], kc, vc, mx.array(t[s:s + 1]), mx.array(np.array([e], np.int32)),
                          **kw)[0] for s, a, r, e in _sub_chunks(n, st)]
            return cat(outs)
        return op

    def cascade(query, kc, vc, prefix_tables, prefix_lens, prefix_of, tables, lens, **kw):
        bs = kc.shape[2]
        pt, pl, po, t, n = (np.array(x) for x in (prefix_tables, prefix_lens, prefix_of, tables, lens))
        width = pt.shape[1] + t.shape[1]
        rows, total = [], []
        for s, p in enumerate(po):
            head = pt[p, :pl[p] // bs] if p >= 0 else np.zeros(0, np.int32)
            row = np.concatenate([head, t[s]])
            rows.append(np.pad(row, (0, width - len(row)), constant_values=row[-1]))
            total.append(len(head) * bs + n[s])
        return kv.paged_attention(query, kc, vc, mx.array(np.stack(rows).astype(np.int32)),
                                  mx.array(np.array(total, np.int32)), **kw)

    monkeypatch.setattr(kv, "paged_attention_varlen", varlen(kv.paged_attention, mx.concatenate), raising=False)
    monkeypatch.setattr(reference, "paged_attention_varlen",
                        varlen(reference.paged_attention, np.concatenate), raising=False)
    monkeypatch.setattr(kv, "paged_attention_cascade", cascade, raising=False)
    assert set(correctness.OPTIONAL_OPS) <= set(correctness.available_ops())
    optional = [c for c in cases.matrix(True) if c["op"] in correctness.OPTIONAL_OPS]
    assert {c["op"] for c in optional} == set(correctness.OPTIONAL_OPS)
    for i, case in enumerate(optional):
        with kv.use_backend("cpu"):
            error, budget = correctness.RUNNERS[case["op"]](case, np.random.default_rng(i))
        assert error <= budget, (case, error)


def test_a_pipeline_thread_limit_refusal_is_recorded_and_reported():
    # What MLX raises on a Mac when a launch passes the pipeline's maxTotalThreadsPerThreadgroup.
    def refuse():
        def kernel(**_):
            raise ValueError("[metal_kernel] Thread group size (512) is greater than the maximum allowed threads "
                             "per threadgroup (384).")
        return kernel

    ledger = compiling.Ledger(family="f")
    k = compiling.IsolatedKernel("kvmetal_paged_attention_partials_x", refuse, ledger)
    k(inputs=[mx.zeros((1,))], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(512, 1, 1),
      threadgroup=(512, 1, 1))
    rec = ledger.specialisations["kvmetal_paged_attention_partials_x"]
    assert rec["status"] == "failed" and rec["threads"] == 512 and rec["max_threads"] == 384
    ok = dict(rec, name="kvmetal_attention_reduce_y", status="ok", threads=32, max_threads=None, error=None)
    comp = {"families": [], "specialisations": [rec, ok], "path_errors": [], "seconds": 0.0}
    from kvmetal.selfcheck import report

    lines = report.compile_lines(comp)
    assert any("at most 512 launched; 1 specialisations refused by their pipeline's limit (lowest 384)" in line
               for line in lines), lines
    assert any("FAILED kvmetal_paged_attention_partials_x" in line for line in lines)
