"""``kvmetal demo`` end to end on a small workload (the mixed one takes minutes)."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("mlx_lm")
from kvmetal import cli  # noqa: E402
from kvmetal.commands import demo  # noqa: E402


def test_demo_small_workload_reports_both_sides(capsys):
    assert cli.main(["demo", "--workload", "small", "--requests", "4", "--json", "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    ours, theirs = result["kvmetal"], result["mlx_lm"]
    assert ours["tokens"] == theirs["tokens"] > 0
    assert ours["prefix_hit_blocks"] == 3 * 3  # 3 later requests reuse the 48-token system prompt
    assert 0 < ours["peak_used_bytes"] <= ours["peak_pool_bytes"]
    assert result["peak_bytes_ratio"] == ours["peak_pool_bytes"] / theirs["peak_cache_bytes"]
    assert result["same_outputs"] == 4  # greedy, same model, same requests


def test_demo_text_output_and_progress(capsys):
    assert cli.main(["demo", "--requests", "2", "--no-baseline"]) == 0
    captured = capsys.readouterr()
    assert "tokens/s" in captured.out and "peak KV bytes held" in captured.out
    assert "prefix sharing:" in captured.out and "mlx-lm" not in captured.out
    assert "[kvmetal]" in captured.err  # progress goes to stderr


def test_mixed_workload_shape():
    work = demo.make_workload(**demo.WORKLOADS["mixed"], seed=0, vocab_size=512)
    lengths = [len(p) for p in work.prompts]
    assert len(lengths) == 32 and min(lengths) >= 16 and max(lengths) <= 2048
    assert max(lengths) > 1000 and min(lengths) < 100  # log-uniform spans the range
    assert all(16 <= m <= 512 for m in work.max_tokens)
    again = demo.make_workload(**demo.WORKLOADS["mixed"], seed=0, vocab_size=512)
    assert again.prompts == work.prompts  # fixed seed, fixed workload


def test_demo_rejects_bad_options(capsys):
    assert cli.main(["demo", "--requests", "0"]) == 2
    assert "argument --requests: must be >= 1" in capsys.readouterr().err


def test_demo_explains_differing_outputs(capsys):
    assert cli.main(["demo", "--requests", "8", "--dtype", "bfloat16", "--json", "--quiet"]) == 0
    result = json.loads(capsys.readouterr().out)
    found = result["divergences"]
    assert len(found) == 8 - result["same_outputs"]
    for d in found:
        assert d["step"] >= 0 and d["kvmetal_token"] != d["mlx_lm_token"]
        assert d["top2_margin"] >= 0 and d["margin_in_rounding_steps"] >= 0


def test_divergence_finds_the_first_differing_step_and_margin():
    import mlx.core as mx

    from kvmetal.integrations import tiny_models

    model = tiny_models.build("llama")
    prompt = [5, 6, 7]
    logits = model(mx.array([prompt + [1, 2]]))[0, -1]
    top = mx.sort(logits)
    found = demo.divergences(model, [prompt, prompt], [[1, 2, 9, 4], [1, 2]], [[1, 2, 3, 4], [1, 2]])
    assert len(found) == 1 and found[0]["request"] == 0 and found[0]["step"] == 2
    assert (found[0]["kvmetal_token"], found[0]["mlx_lm_token"]) == (9, 3)
    assert found[0]["top2_margin"] == pytest.approx(float(top[-1] - top[-2]), rel=1e-5)
