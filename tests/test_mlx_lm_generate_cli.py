"""``kvmetal generate`` on a local model directory written in the test (no download)."""
from __future__ import annotations

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm import load, stream_generate  # noqa: E402

from kvmetal import cli  # noqa: E402
from kvmetal.integrations import tiny_models  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_models.save("qwen3", path, dtype=mx.float32)
    return path


def test_generate_prints_what_mlx_lm_generates(model_dir, capsys):
    model, tokenizer = load(str(model_dir))
    prompt = "t5 t7 t9 t11 t13"
    expected = "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=12))
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", prompt, "--max-tokens", "12",
                     "--block-size", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == expected.strip()
    assert "generation: 12 tokens" in err and "kv cache:" in err and "blocks of 8 tokens" in err


def test_generate_with_quantized_kv_runs(model_dir, capsys):
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", "t1 t2 t3", "--max-tokens", "4",
                     "--k-bits", "8", "--v-bits", "4"]) == 0
    out, _ = capsys.readouterr()
    assert len(out.split()) == 4


def test_generate_rejects_a_missing_model_dir(tmp_path, capsys):
    assert cli.main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "is not a model directory" in capsys.readouterr().err


def test_generate_rejects_bad_bits(model_dir, capsys):
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", "t1", "--k-bits", "7"]) == 2
    assert "[use_paged_cache] k_bits must be None or one of" in capsys.readouterr().err
