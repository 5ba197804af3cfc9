"""`kvmetal bench` runs, and its JSON carries what the benchmark promises."""
from __future__ import annotations

import json
import os

import mlx.core as mx
import pytest

from kvmetal import cli

REQUIRED = {"name", "backend", "seconds", "min_seconds", "max_seconds", "repeats", "kv_bytes", "gbps", "baseline",
            "baselines", "read_gbps"}


@pytest.fixture(scope="module")
def small_report():
    import contextlib
    import io

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(["bench", "--json", "--backend", "cpu", "--tokens", "300", "--repeat", "3",
                         "--cases", "paged_decode_f32,paged_decode_f16,paged_decode_k8v4,decode_contiguous_f16,"
                                    "write_and_gather_f16"])
    assert code == 0
    return json.loads(out.getvalue()), err.getvalue()


def test_bench_json_small(small_report):
    report, err = small_report
    assert report["backend"] == "cpu" and report["read_gbps"] > 0
    by_threads = report["read_gbps_by_threads"]  # one core's read, and every core's (the yardstick)
    yardstick = by_threads[str(os.cpu_count() or 1)]
    assert by_threads["1"] > 0 and yardstick == report["read_gbps_probes"][0] <= report["read_gbps"]
    if max(report["read_gbps_probes"]) != report["read_gbps"]:  # a case beat it, so it was measured again
        assert "beats the read bandwidth; measuring it again" in err
    names = [r["name"] for r in report["results"]]
    assert any(n.startswith("paged_decode_f16") for n in names) and len(names) == 6
    for r in report["results"]:
        assert REQUIRED <= r.keys(), r.keys() ^ REQUIRED
        assert r["seconds"] > 0 and r["kv_bytes"] > 0 and r["repeats"] == 3
        assert r["min_seconds"] <= r["seconds"] <= r["max_seconds"]
        assert r["gbps"] == pytest.approx(r["kv_bytes"] / r["seconds"] / 1e9)
        assert r["baseline"]["seconds"] > 0 and r["baseline"]["name"]
        assert r["baseline"] is r["baselines"][0] or r["baseline"] == r["baselines"][0]
    assert "[1/5]" in err  # a progress line per case


def test_no_fraction_of_read_bandwidth_above_one(small_report):
    report, _ = small_report
    for r in report["results"]:
        if r.get("fraction_of_read") is None:
            assert r["noisy"] and "exceeds the measured read bandwidth" in r["note"]
        else:
            assert 0 < r["fraction_of_read"] <= 1.0
            assert r["gbps"] <= r["read_gbps"]


def test_provenance_names_versions_cpu_and_threads(small_report):
    prov = small_report[0]["provenance"]
    assert prov["versions"]["kvmetal"] and prov["versions"]["mlx"] == mx.__version__
    assert "mlx-lm" in prov["versions"]
    assert prov["machine"]["cpu"] and prov["threads"]["kvmetal_cpu"] >= 1 and prov["threads"]["os_cpu_count"] >= 1
    assert prov["tuning"] == {k: v for k, v in os.environ.items() if k.startswith("KVMETAL_METAL_")}


def test_provenance_records_the_metal_tuning_variables(monkeypatch):
    from kvmetal.benchmarks.provenance import provenance

    monkeypatch.setenv("KVMETAL_METAL_WINDOW_SIMDGROUPS", "1")
    monkeypatch.setenv("KVMETAL_METAL_WINDOW_DIV", "32")
    assert provenance("cpu")["tuning"] == {"KVMETAL_METAL_WINDOW_DIV": "32", "KVMETAL_METAL_WINDOW_SIMDGROUPS": "1"}


def test_k8v4_is_compared_with_mlx_lm_quantized_and_gather_sdpa(small_report):
    pytest.importorskip("mlx_lm")
    k8v4 = next(r for r in small_report[0]["results"] if r["name"].startswith("paged_decode_k8v4"))
    names = [b["name"] for b in k8v4["baselines"]]
    assert names[0].startswith("mlx-lm QuantizedKVCache kv_bits=8 quantized SDPA")
    assert any("gather_kv_cache (dequantized) + mx.fast.scaled_dot_product_attention" in n for n in names)
    assert any(n.startswith("kvmetal paged_decode_f16") for n in names)
    assert all(b["seconds"] > 0 and b["repeats"] >= 1 for b in k8v4["baselines"])


def test_simulator_step_without_compiler_prints_a_skip_line(monkeypatch, capsys):
    if mx.metal.is_available():
        pytest.skip("on a Mac the metal kernels are timed, not simulated")
    monkeypatch.setenv("CXX", "no-such-compiler-kvmetal")
    assert cli.main(["bench", "--backend", "cpu", "--cases", "metal_kernels"]) == 0
    out, err = capsys.readouterr()
    assert "metal_kernels on sim" in err
    assert "skipped: the Metal simulator compiles kernels" in out and "no-such-compiler-kvmetal" in out


def test_bench_plot_writes_a_chart(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    assert cli.main(["bench", "--backend", "cpu", "--tokens", "256", "--repeat", "1", "--no-baseline",
                     "--cases", "paged_decode_f16,decode_contiguous_f16", "--plot", str(out)]) == 0
    assert out.stat().st_size > 10_000
    assert "plot written to" in capsys.readouterr().err


def test_bench_model_measures_four_configurations(tmp_path, capsys):
    pytest.importorskip("mlx_lm")
    from kvmetal.integrations import tiny_models

    tiny_models.save("llama", tmp_path, dtype=mx.float32)
    assert cli.main(["bench", "-m", str(tmp_path), "--contexts", "64,200", "--gen-tokens", "4", "--samples", "2",
                     "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    rows = report["rows"]
    assert report["samples"] == 2  # each cell's median, with the spread of its runs
    for r in rows:
        assert r["samples"] == 2 and r["prompt_tps_min"] <= r["prompt_tps"] <= r["prompt_tps_max"]
    assert [(r["context"], r["config"]) for r in rows] == [
        (c, name) for c in (64, 200) for name in ("kvmetal f32", "kvmetal K8/V4", "mlx-lm KVCache",
                                                  "mlx-lm kv_bits=8")]
    for r in rows:
        assert "error" not in r, r
        assert r["prompt_tps"] > 0 and r["generation_tps"] > 0 and r["generated"] == 4
        assert r["peak_memory_bytes"] > 0 and r["kv_bytes"] >= r["kv_used_bytes"] > 0
    by = {(r["context"], r["config"]): r for r in rows}
    # quantized caches hold fewer bytes than float ones at the same context
    assert by[(200, "kvmetal K8/V4")]["kv_used_bytes"] < by[(200, "kvmetal f32")]["kv_used_bytes"]
    assert by[(200, "mlx-lm kv_bits=8")]["kv_bytes"] < by[(200, "mlx-lm KVCache")]["kv_bytes"]


def test_bench_model_reads_the_kv_flags_as_generate_and_serve(tmp_path, capsys):
    """`bench -m` takes the K/V format flags of generate and serve (kvmetal.kv_format): the
    kvmetal row and mlx-lm's kv_bits row follow them; the table names the format."""
    pytest.importorskip("mlx_lm")
    from kvmetal.integrations import tiny_models

    tiny_models.save("llama", tmp_path, dtype=mx.float32)
    assert cli.main(["bench", "-m", str(tmp_path), "--contexts", "64", "--gen-tokens", "3", "--samples", "1",
                     "--kv-bits", "4", "--speculative"]) == 0
    out, err = capsys.readouterr()
    assert "kvmetal K4/V4" in out and "mlx-lm kv_bits=4" in out and "kvmetal quantized: K4/V4 g32" in out
    assert "no chat template; skipped" in err  # the tiny model's tokenizer has none
    assert cli.main(["bench", "-m", str(tmp_path), "--kv-bits", "8", "--k-group-size", "48"]) == 2
    assert "--k-group-size" in capsys.readouterr().err


def test_bench_rejects_unknown_case(capsys):
    assert cli.main(["bench", "--cases", "nope"]) == 2
    assert "unknown case" in capsys.readouterr().err


def test_cli_lists_commands(capsys):
    assert cli.main([]) == 2  # no command: help, and the exit status of a usage error
    out = capsys.readouterr().err
    for command in ("bench", "budget", "demo", "generate"):
        assert command in out
    assert cli.main(["frobnicate"]) == 2


def test_missing_mlx_lm_baseline_is_named_not_silent(monkeypatch):
    import sys

    from kvmetal.benchmarks.cases import run_case

    monkeypatch.setitem(sys.modules, "mlx_lm.models.base", None)
    (r,) = run_case("paged_decode_k8v4", backend="cpu", tokens=64, repeat=1, baseline=True, progress=print)
    assert not any(b["name"].startswith("mlx-lm") for b in r["baselines"])
    assert 'pip install "mlx-lm>=0.32,<0.33"' in r["skipped_baselines"][0]


def test_table_prints_no_nan_and_explains_its_columns(capsys):
    """Issue 35: the prefill row's GB/s was `nan`; the simulator columns had no legend; on
    Linux the table says where Metal speed is measured."""
    from kvmetal import benchmarks
    from kvmetal.benchmarks import model_bench, sim_cases

    timed = {"name": "prefill_chunked", "backend": "cpu", "seconds": 0.01, "min_seconds": 0.009, "max_seconds": 0.012,
             "repeats": 3, "gbps": None, "fraction_of_read": None}
    costs = {"name": "paged f16 G4 L1 T=8192 D=128", "backend": "sim", "seconds": None, "note": "sim costs ...",
             "costs": {"threadgroup_memory": 1024}}
    prov = {"versions": {"mlx": "x"}, "machine": {"cpu": "cpu"}, "threads": {"kvmetal_cpu": 2}}
    benchmarks._print_table([timed, costs], 10.0, prov)
    out = capsys.readouterr().out
    assert "nan" not in out and "prefill_chunked" in out and "bound by arithmetic" in out
    assert sim_cases.LEGEND in out and "tg mem B = threadgroup memory" in out and "transc." in out
    assert ("Metal speed needs an Apple Silicon Mac" in out) == (not mx.metal.is_available())
    rows = [{"context": 64, "config": "kvmetal f32", "prompt_tps": 10.0, "prompt_tps_min": 9.0, "prompt_tps_max": 11.5,
             "generation_tps": 5.0, "peak_memory_bytes": 2**20, "kv_bytes": 2**20, "samples": 3}]
    model_bench.print_table(rows, header="h")
    out = capsys.readouterr().out
    assert "10.0 (9.0..11.5)" in out and "median of 3 runs" in out


def test_the_output_opens_with_what_the_numbers_are_and_are_not(small_report):
    """Issue 44: on Linux the ratios are against MLX's unoptimised CPU paths; say so first."""
    from kvmetal.benchmarks import what_is_measured

    _, err = small_report
    assert err.startswith(what_is_measured("cpu"))
    assert "not how the Metal kernels compare on a Mac" in what_is_measured("cpu")
    assert err.count("paged_decode_f16 on cpu") == 1  # progress names a case once; results go to the table


def test_a_kernel_and_its_baseline_are_timed_in_turns():
    from kvmetal.benchmarks.timing import time_interleaved

    calls = []
    stats = time_interleaved({"a": lambda: calls.append("a") or mx.array(0),
                              "b": lambda: calls.append("b") or mx.array(0)}, repeat=3, warmup=1)
    assert calls == ["a", "b"] + ["a", "b"] * 3  # warm-ups, then turns
    assert stats["a"]["repeats"] == stats["b"]["repeats"] == 3


def test_the_read_bandwidth_is_probed_before_and_after_the_cases(small_report):
    report, _ = small_report
    probes = report["read_gbps_probes"]
    assert len(probes) == 2 and all(p > 0 for p in probes)
    assert report["read_gbps"] >= max(probes)  # the yardstick is the best probe (or a re-measure above it)


def test_default_contexts_stay_within_the_models_trained_context():
    """Issue 44: `bench -m default` ran the 8K-context SmolLM2 at 16K without a word."""
    from kvmetal.benchmarks.model_bench import pick_contexts

    said = []
    assert pick_contexts(None, 8192, 32, warn=said.append, backend="metal") == [512, 4096]
    assert "16,384 skipped" in said[0] and "8,192" in said[0] and "--contexts" in said[0]
    said.clear()
    assert pick_contexts("512,16K", 8192, 32, warn=said.append) == [512, 16384]  # the user's choice is kept
    assert "warning" in said[0] and "16,384" in said[0]
    assert pick_contexts(None, None, 32, warn=said.append) == [512, 4096, 16384]
    assert pick_contexts(None, 8192, 32, warn=said.append, backend="cpu") == [512, 2048]  # MLX's CPU attention
    with pytest.raises(ValueError, match="--contexts"):
        pick_contexts("512,lots", 8192, 32, warn=said.append)


def test_an_interrupted_model_bench_prints_what_finished(tmp_path, capsys, monkeypatch):
    """Issue 44: Ctrl-C threw away every finished result."""
    pytest.importorskip("mlx_lm")
    from kvmetal.benchmarks import model_bench
    from kvmetal.integrations import tiny_models

    tiny_models.save("llama", tmp_path, dtype=mx.float32)
    real, calls = model_bench.measure, []

    def measure(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(model_bench, "measure", measure)
    assert cli.main(["bench", "-m", str(tmp_path), "--contexts", "32,64", "--gen-tokens", "3", "--samples", "1",
                     "--json"]) == 130
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert [r["config"] for r in report["rows"]] == ["kvmetal f32", "kvmetal K8/V4"]
    assert "interrupted after 2 of 8 runs" in err and "s more at this context" in err
