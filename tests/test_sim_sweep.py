"""The standing randomized sweep of the attention kernels on the simulator
(kvmetal/sim/sweep.py): a fixed-seed, bounded sample in CI. Longer runs:
``python -m kvmetal.sim.sweep --fuzz N [--seed S]``; every failure prints a
one-line reproducer (``python -m kvmetal.sim.sweep --case '<json>'``)."""
import io

import numpy as np
import pytest

from kvmetal.sim import sweep

CI_CONFIGS = 48   # about a minute of CPU with a cold kernel cache (2-core CI: ~1-2 minutes)
CI_POOL = 24      # kernel shapes they share (each compiled once)
CI_SEED = 2026


def test_fixed_seed_sweep_matches_the_oracle():
    out = io.StringIO()
    result = sweep.sweep(CI_CONFIGS, seed=CI_SEED, pool=CI_POOL, out=out)
    assert result["ran"] == CI_CONFIGS
    assert result["failed"] == 0, out.getvalue()


def test_the_draws_cover_the_space():
    # Over a longer draw (no kernel runs) every axis the issue lists is reached.
    cs = sweep.configs(600, seed=CI_SEED, pool=150)
    # Every attention op of the registry is drawn (the sweep refuses to start otherwise).
    from kvmetal.backends.specialisations import ATTENTION_OPS

    assert {c.op for c in cs} == {sweep.OPS[op] for op in ATTENTION_OPS} == {"paged", "decode", "varlen", "cascade"}
    assert min(c.gqa for c in cs) == 1 and max(c.gqa for c in cs) >= 40
    assert {c.query_len for c in cs if c.op in ("paged", "decode")} == set(range(1, 9))
    varlen = [c for c in cs if c.op == "varlen"]
    assert any(n > 8 for c in varlen for n in c.counts) and any(0 < n <= 8 for c in varlen for n in c.counts)
    cascade = [c for c in cs if c.op == "cascade"]
    assert any(len(c.prefix_of) >= 24 for c in cascade) and any(-1 in c.prefix_of for c in cascade)
    assert any(0 in c.prefix_lens for c in cascade) and any(0 in c.lens for c in cascade)
    assert {c.head_dim for c in cs} == set(sweep.HEAD_DIMS)
    assert {c.block_size for c in cs if c.op == "paged"} == set(sweep.BLOCK_SIZES)
    assert {c.splits for c in cs} >= set(range(1, 8)) | {None}
    assert min(min(c.lens) for c in cs if c.op in ("paged", "decode")) == 1 and any(n % 2 for c in cs for n in c.lens)
    assert {c.view for c in cs if c.op == "decode"} == set(sweep.VIEWS)
    bits = {q[0] for c in cs for q in (c.k_quant, c.v_quant) if q}
    sizes = {q[1] for c in cs for q in (c.k_quant, c.v_quant) if q}
    assert bits == {2, 3, 4, 5, 6, 8} and sizes == {32, 64, 128}
    assert any(c.k_quant and not c.v_quant for c in cs) and any(c.v_quant and not c.k_quant for c in cs)
    assert any(c.window for c in cs) and any(c.softcap for c in cs) and any(c.big_scores for c in cs)
    assert any(c.sinks for c in cs)
    sparse = [c for c in cs if c.sparse_v]
    assert {c.op for c in sparse} == {"paged", "decode", "cascade"} and {c.sparse_v for c in sparse} == {1e-1, 1e-3, 1e-6}
    assert any(c.gqa * c.query_len > 8 for c in sparse)  # shared mode too (each simdgroup seeds its own rows)


def test_a_failure_prints_a_one_line_reproducer(monkeypatch):
    def broken(c, seeds=sweep.SCHEDULE_SEEDS):
        raise AssertionError("relative error 1 > 0.001")

    monkeypatch.setattr(sweep, "run_config", broken)
    out = io.StringIO()
    result = sweep.sweep(2, seed=5, pool=2, out=out)
    assert result["failed"] == 2
    lines = [l for l in out.getvalue().splitlines() if "reproduce:" in l]
    assert len(lines) == 2
    case = lines[0].split("--case '", 1)[1].rstrip("'")
    again = sweep.Config.from_json(case)
    assert again == result["failures"][0][0]  # the line alone rebuilds the configuration


def test_reproducer_runs_one_configuration(capsys):
    c = sweep.Config(op="decode", dtype="float16", head_dim=64, gqa=16, query_len=1, k_quant=None, v_quant=None,
                     lens=(40,), view="offset", pad=4, data_seed=3)
    assert sweep.main(["--case", c.to_json()]) == 0
    assert "ok" in capsys.readouterr().out
