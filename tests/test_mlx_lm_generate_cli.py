"""``kvmetal generate`` on local model directories written in the test (no download)."""
from __future__ import annotations

import json
import sys

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm import load, stream_generate  # noqa: E402
from mlx_lm.sample_utils import make_sampler  # noqa: E402
from mlx_lm.utils import save_config, save_model  # noqa: E402

from kvmetal import cli  # noqa: E402
from kvmetal.integrations import tiny_models  # noqa: E402

# A chat template over the tiny word vocabulary: system and user turns become plain words.
TEMPLATE = ("{% for m in messages %}{% if m['role'] == 'system' %}t3 {% endif %}t1 {{ m['content'] }} "
            "{% endfor %}{% if add_generation_prompt %}t2{% endif %}")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3")
    tiny_models.save("qwen3", path, dtype=mx.float32)
    return path


@pytest.fixture(scope="module")
def chat_model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-qwen3-chat")
    tiny_models.save("qwen3", path, dtype=mx.float32)
    config = json.loads((path / "tokenizer_config.json").read_text())
    (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    return path


def _mlx_lm_text(path, prompt, max_tokens, seed=None, **sampling) -> str:
    if seed is not None:
        mx.random.seed(seed)  # before load, as mlx_lm.generate seeds
    model, tokenizer = load(str(path))
    sampler = make_sampler(**sampling) if sampling else None
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=max_tokens, sampler=sampler))


def test_generate_prints_what_mlx_lm_generates(model_dir, capsys):
    prompt = "t5 t7 t9 t11 t13"
    expected = _mlx_lm_text(model_dir, prompt, 12)
    assert cli.main(["generate", "--model", str(model_dir), "--prompt", prompt, "--max-tokens", "12",
                     "--block-size", "8"]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == expected.strip()
    assert "generation: 12 tokens" in err and "kv cache:" in err and "blocks of 8 tokens" in err
    assert "peak memory:" in err and " GB" in err


def test_chat_template_is_applied_by_default(chat_model_dir, capsys):
    _, tokenizer = load(str(chat_model_dir))
    templated = tokenizer.apply_chat_template([{"role": "system", "content": "t40"},
                                               {"role": "user", "content": "t5 t6"}],
                                              tokenize=False, add_generation_prompt=True)
    assert templated.startswith("t3 t1 t40") and templated.endswith("t2")
    assert cli.main(["generate", "-m", str(chat_model_dir), "-p", "t5 t6", "--system-prompt", "t40",
                     "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip() == _mlx_lm_text(chat_model_dir, templated, 6).strip()
    assert cli.main(["generate", "-m", str(chat_model_dir), "-p", "t5 t6", "--ignore-chat-template",
                     "--max-tokens", "6"]) == 0
    assert capsys.readouterr().out.strip() == _mlx_lm_text(chat_model_dir, "t5 t6", 6).strip()


def test_seeded_sampling_is_reproducible_and_matches_mlx_lm(model_dir, capsys):
    args = ["generate", "-m", str(model_dir), "-p", "t5 t7", "--max-tokens", "10", "--temp", "1.0",
            "--top-p", "0.9", "--top-k", "50", "--min-p", "0.01", "--seed", "7"]
    assert cli.main(args) == 0
    first = capsys.readouterr().out
    assert cli.main(args) == 0
    assert capsys.readouterr().out == first
    expected = _mlx_lm_text(model_dir, "t5 t7", 10, seed=7, temp=1.0, top_p=0.9, top_k=50, min_p=0.01)
    assert first.strip() == expected.strip()


def test_kv_bits_means_both_sides(model_dir, capsys):
    base = ["generate", "-m", str(model_dir), "-p", "t1 t2 t3", "--max-tokens", "6"]
    assert cli.main(base + ["--kv-bits", "8", "--kv-group-size", "32"]) == 0
    both = capsys.readouterr().out
    assert cli.main(base + ["--k-bits", "8", "--v-bits", "8", "--k-group-size", "32", "--v-group-size", "32"]) == 0
    assert capsys.readouterr().out == both and len(both.split()) == 6
    # A per-side flag wins for its side, as in serve and bench (kvmetal.kv_format): K4/V8.
    assert cli.main(base + ["--kv-bits", "8", "--k-bits", "4", "--kv-group-size", "32"]) == 0
    mixed = capsys.readouterr().out
    assert cli.main(base + ["--k-bits", "4", "--v-bits", "8", "--kv-group-size", "32"]) == 0
    assert capsys.readouterr().out == mixed


def test_head_dim_96_runs_at_the_default_group_size_32(tmp_path, capsys):
    model = tiny_models.build("phi3", hidden_size=384)  # 4 heads of 96
    save_model(tmp_path, model)
    save_config(dict(tiny_models.ARGS["phi3"], hidden_size=384, model_type="phi3"), tmp_path / "config.json")
    tiny_models.word_tokenizer().save_pretrained(tmp_path)
    assert cli.main(["generate", "-m", str(tmp_path), "-p", "t1 t2", "--max-tokens", "4", "--k-bits", "8",
                     "--v-bits", "4"]) == 0
    out, err = capsys.readouterr()
    assert len(out.split()) == 4
    assert "not a multiple" not in err  # 32, the default at every head_dim, divides 96: no fallback note
    assert cli.main(["generate", "-m", str(tmp_path), "-p", "t1", "--kv-bits", "8", "--kv-group-size", "64"]) == 2
    assert "try --kv-group-size 32" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--prompt", "  "], "the prompt is empty"),
    (["--k-bits", "7"], "argument --k-bits: invalid choice: 7"),
    (["--num-blocks", "1", "--max-tokens", "40"], "raise --num-blocks, or omit it"),
])
def test_user_errors_are_one_line(model_dir, capsys, args, message):
    argv = ["generate", "-m", str(model_dir), "-p", "t1 t2"] + args
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_model_errors_are_one_line(tmp_path, capsys, monkeypatch):
    assert cli.main(["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"]) == 2
    assert "no such directory" in capsys.readouterr().err
    (tmp_path / "config.json").write_text("{}")
    assert cli.main(["generate", "--model", str(tmp_path), "--prompt", "x"]) == 2
    assert "no weights" in capsys.readouterr().err
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert cli.main(["generate", "--model", "kvmetal-test/not-a-repo", "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert "could not be fetched from the Hugging Face Hub (HF_HUB_OFFLINE is set)" in err
    assert len(err.strip().splitlines()) == 1


def test_missing_mlx_lm_names_the_extra(model_dir, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mlx_lm", None)
    assert cli.main(["generate", "-m", str(model_dir), "-p", "t1"]) == 2
    assert 'pip install "mlx-lm>=0.32,<0.33"' in capsys.readouterr().err


@pytest.mark.skipif(mx.metal.is_available(), reason="the metal backend is available here")
def test_metal_backend_unavailable_is_reported_before_loading(capsys):
    assert cli.main(["generate", "-m", "/nonexistent", "-p", "t1", "--backend", "metal"]) == 2
    assert "needs an Apple GPU" in capsys.readouterr().err


def test_generate_under_mlx_launch_shards_and_prints_on_rank_0_only(model_dir, tmp_path, capsys):
    import subprocess
    from pathlib import Path

    launcher = Path(sys.executable).parent / "mlx.launch"
    if not launcher.exists():
        pytest.skip("mlx.launch is not installed next to this Python")
    argv = ["generate", "-m", str(model_dir), "-p", "t5 t7 t9 t11", "--max-tokens", "12"]
    assert cli.main(argv) == 0
    single = capsys.readouterr().out
    script = tmp_path / "gen.py"
    script.write_text(f"import sys\nfrom kvmetal.cli import main\nsys.exit(main({argv!r}))\n")
    run = subprocess.run([str(launcher), "-n", "2", "--backend", "ring", "--python", sys.executable, str(script)],
                         capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.count("\n") == single.count("\n")  # one rank printed
    assert run.stdout.strip() == single.strip()           # the sharded model generates the same tokens
    assert "sharded over 2 ranks" in run.stderr and "kv cache per rank" in run.stderr
