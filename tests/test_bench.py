"""`kvmetal bench` runs, and its JSON carries what the benchmark promises."""
from __future__ import annotations

import json

import pytest

from kvmetal import cli

REQUIRED = {"name", "backend", "seconds", "kv_bytes", "gbps", "baseline", "read_gbps"}


def test_bench_json_small(capsys):
    code = cli.main(["bench", "--json", "--backend", "cpu", "--tokens", "300", "--repeat", "1",
                     "--cases", "paged_decode_f32,paged_decode_f16,paged_decode_k8v4,decode_contiguous_f16,"
                                "write_and_gather_f16"])
    captured = capsys.readouterr()
    assert code == 0
    report = json.loads(captured.out)
    assert report["backend"] == "cpu" and report["read_gbps"] > 0
    names = [r["name"] for r in report["results"]]
    assert any(n.startswith("paged_decode_f16") for n in names) and len(names) == 6
    for r in report["results"]:
        assert REQUIRED <= r.keys(), r.keys() ^ REQUIRED
        assert r["seconds"] > 0 and r["kv_bytes"] > 0
        assert r["gbps"] == pytest.approx(r["kv_bytes"] / r["seconds"] / 1e9)
        assert r["baseline"]["seconds"] > 0 and r["baseline"]["name"]
    assert "[1/5]" in captured.err  # a progress line per case


def test_bench_rejects_unknown_case(capsys):
    assert cli.main(["bench", "--cases", "nope"]) == 2
    assert "unknown case" in capsys.readouterr().err


def test_cli_lists_commands(capsys):
    assert cli.main([]) == 2  # no command: help, and the exit status of a usage error
    out = capsys.readouterr().err
    for command in ("bench", "budget", "demo", "generate"):
        assert command in out
    assert cli.main(["frobnicate"]) == 2
