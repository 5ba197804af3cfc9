"""The ``kvmetal`` command line: one consistent surface across subcommands."""
from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kvmetal import cli

PARSERS = {name: importlib.import_module(module)._parser for name, (module, _) in cli.COMMANDS.items()}


def _options(parser: argparse.ArgumentParser):
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_every_flag_has_help_and_no_rst_markup(command):
    parser = PARSERS[command]()
    for action in _options(parser):
        assert action.help and action.help.strip(), f"kvmetal {command} {action.option_strings} has no help"
    text = parser.format_help()
    assert not re.search(r"``|:class:|:func:|:meth:|\.\. ", text), text


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_dash_m_means_model_everywhere(command):
    for action in _options(PARSERS[command]()):
        if "-m" in action.option_strings:
            assert "--model" in action.option_strings, (command, action.option_strings)
        assert "--max-tokens" not in action.option_strings or "-m" not in action.option_strings


def test_no_arguments_prints_help_and_exits_2(capsys):
    assert cli.main([]) == 2
    assert "usage: kvmetal <command>" in capsys.readouterr().err


def test_missing_optional_dependency_names_the_extra(monkeypatch, capsys):
    from kvmetal.integrations import tiny_models

    def no_mlx_lm(*args, **kwargs):  # what importing mlx_lm raises where it is not installed
        raise ModuleNotFoundError("No module named 'mlx_lm'", name="mlx_lm")

    monkeypatch.setattr(tiny_models, "build", no_mlx_lm)
    assert cli.main(["demo", "--requests", "1", "--quiet"]) == 2
    assert 'pip install "mlx-lm>=0.32,<0.33"' in capsys.readouterr().err


def test_closed_pipe_gives_no_traceback(tmp_path):
    # The reader is gone before the first write (what `| head` does to a long report).
    proc = subprocess.Popen([sys.executable, "-m", "kvmetal", "budget", "-m", "llama-3-8b", "--compare"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()


# ----------------------------------------------------------------------------- bad flags (issue 35)

def _run(argv, capsys) -> tuple:
    status = cli.main(argv)  # argparse's exit comes back as the status
    return status, capsys.readouterr().err


# (argv, the flag the message must name). generate and serve get no model, or one that
# does not exist: a flag's mistake is reported before any model is looked for or loaded.
BAD_FLAGS = [
    (["generate", "-p", "x", "--kv-bits", "7"], "--kv-bits"),
    (["generate", "-p", "x", "--kv-group-size", "48"], "--kv-group-size"),
    (["generate", "-m", "/nonexistent", "-p", "x", "--temp", "-1"], "--temp"),
    (["generate", "-m", "/nonexistent", "-p", "x", "--top-p", "2"], "--top-p"),
    (["generate", "-m", "/nonexistent", "-p", "x", "--top-k", "-3"], "--top-k"),
    (["generate", "-m", "/nonexistent", "-p", "x", "--min-p", "nan"], "--min-p"),
    (["generate", "-p", "x", "--max-tokens", "0"], "--max-tokens"),
    (["generate", "-p", "x", "--num-blocks", "zero"], "--num-blocks"),
    (["generate", "-m", "/nonexistent", "-p", "x", "--kv-bits", "8", "--k-group-size", "48"], "--k-group-size"),
    (["generate", "-p", "x", "--bogus"], "--bogus"),
    (["generate", "-p", "x", "--seed", "-1"], "--seed"),  # issue 44: mx.random.seed takes 0..2**64-1
    (["generate", "-p", "x", "--seed", str(2**70)], "--seed"),
    (["generate", "-p", "x", "--seed", str(2**64)], "--seed"),
    (["generate"], "--prompt"),
    (["serve", "--port", "99999"], "--port"),
    (["serve", "--temp", "-1"], "--temp"),
    (["serve", "--top-p", "2"], "--top-p"),
    (["serve", "--top-k", "-3"], "--top-k"),
    (["serve", "--kv-bits", "7"], "--kv-bits"),
    (["serve", "--kv-group-size", "48"], "--kv-group-size"),
    (["serve", "--kv-memory", "lots"], "--kv-memory"),
    (["serve", "--max-tokens", "0"], "--max-tokens"),
    (["serve", "--chat-template-args", "[1]"], "--chat-template-args"),
    (["serve", "-m", "/nonexistent"], "--model"),
    (["serve", "--speculative", "/nonexistent"], "--speculative"),
    (["serve", "--num-draft-tokens", "8"], "--num-draft-tokens"),
    (["serve", "--speculative", "ngram", "--ngram-min", "4"], "--ngram-min"),
    (["bench", "--tokens", "0"], "--tokens"),
    (["bench", "--repeat", "x"], "--repeat"),
    (["bench", "--cases", "nope"], "--cases"),
    (["bench", "-m", "/nonexistent", "--gen-tokens", "1"], "--gen-tokens"),
    (["bench", "--plot", "/nonexistent/dir/bench.png"], "--plot"),
    (["budget", "-m", "llama-3-8b", "--context", "lots"], "--context"),
    (["budget", "-m", "llama-3-8b", "--chip", "m9"], "--chip"),
    (["budget", "-m", "llama-3-8b", "--tp", "3"], "--tp"),
    (["budget", "-m", "llama-3-8b", "--k-bits", "7"], "--k-bits"),
    (["budget", "--context", "8K"], "--model"),
    (["demo", "--requests", "0"], "--requests"),
    (["demo", "--k-bits", "7"], "--k-bits"),
    (["demo", "--seed", "-1"], "--seed"),
    (["selfcheck", "--sweep", "-1"], "--sweep"),
    (["selfcheck", "--backend", "cuda"], "--backend"),
    (["selfcheck", "--json", "/nonexistent/dir/r.json"], "--json"),
    (["convert-gguf", "missing.gguf", "out", "--dtype", "int3"], "--dtype"),
]


def test_bad_flags_cover_every_command():
    assert {argv[0] for argv, _ in BAD_FLAGS} == set(cli.COMMANDS)


@pytest.mark.parametrize("argv,flag", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
def test_bad_flag_is_one_line_naming_it_with_status_2(argv, flag, capsys):
    status, err = _run(argv, capsys)
    assert status == 2, err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"kvmetal {argv[0]}: error: ") and flag in err, err
    assert "Traceback" not in err


def test_bench_plot_without_matplotlib_stops_before_the_run(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what importing it raises where it is not installed
    status, err = _run(["bench", "--plot", "out.png", "--cases", "paged_decode_f32"], capsys)
    assert status == 2 and "--plot needs matplotlib: pip install matplotlib" in err
    assert len(err.strip().splitlines()) == 1 and "measuring" not in err


def test_a_subprocess_shows_no_traceback(tmp_path):
    # The console script's own process: argparse's exit and ours, not a traceback.
    for argv in (["generate", "--kv-bits", "7", "-p", "x"], ["serve", "--port", "99999"], ["nope"]):
        run = subprocess.run([sys.executable, "-m", "kvmetal", *argv], capture_output=True, text=True, cwd=tmp_path,
                             timeout=120)
        assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
        assert len(run.stderr.strip().splitlines()) == 1, run.stderr


def test_commands_that_need_no_kernel_run_with_an_extension_for_another_mlx(capsys, monkeypatch):
    """budget and convert-gguf run whatever the extension's state; the commands that need
    it stop at once with the mismatch message (issue 35)."""
    from kvmetal import _install_check

    problem = _install_check.mismatch_message("0.0.1", "9.9.9")
    monkeypatch.setattr(_install_check, "extension_problem", lambda: problem)
    status, err = _run(["budget", "-m", "llama-3-8b", "--context", "8K"], capsys)
    assert status == 0, err
    for command in sorted(cli.NEEDS_EXTENSION):
        status, err = _run([command], capsys)
        assert status == 2 and "built against MLX 0.0.1" in err and "Traceback" not in err, (command, err)


# ----------------------------------------------------------------------------- issue 44

def _tiny_gguf(tmp_path):
    sys.path.insert(0, str(Path(__file__).parent))
    from gguf_fuzz import tiny_llama_gguf

    path = tmp_path / "tiny.gguf"
    path.write_bytes(tiny_llama_gguf()[0])
    return path


def test_convert_gguf_already_exists_names_force(tmp_path, capsys):
    gguf = _tiny_gguf(tmp_path)
    (tmp_path / "out").mkdir()
    status, err = _run(["convert-gguf", str(gguf), str(tmp_path / "out")], capsys)
    assert status == 2 and err.count("\n") == 1 and "already exists" in err and "--force" in err, err
    assert cli.main(["convert-gguf", str(gguf), str(tmp_path / "out"), "--force"]) == 0


def test_convert_gguf_uncreatable_output_is_one_line_before_any_weight(tmp_path, capsys, monkeypatch):
    from kvmetal.models import gguf as gguf_mod

    def no_weights(*args, **kwargs):
        raise AssertionError("converted weights before checking the output directory")

    monkeypatch.setattr(gguf_mod, "convert_weights", no_weights)
    gguf = _tiny_gguf(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    status, err = _run(["convert-gguf", str(gguf), str(blocker / "out")], capsys)
    assert status == 2 and err.count("\n") == 1 and "cannot create" in err and "Traceback" not in err, err


def test_an_uncreatable_model_cache_is_one_line_before_converting(tmp_path, capsys, monkeypatch):
    from kvmetal.models import gguf as gguf_mod
    from kvmetal.models import named

    try:
        named.gguf_parts("smollm2")
    except named.ModelMissing as exc:
        pytest.skip(str(exc))
    monkeypatch.setattr(gguf_mod, "convert_gguf", lambda *a, **k: pytest.fail("converted before the cache check"))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVMETAL_MODEL_CACHE", str(blocker / "models"))
    status, err = _run(["generate", "-p", "hi"], capsys)
    lines = [line for line in err.splitlines() if not line.startswith("kvmetal: note")]  # the BLAS note
    assert status == 2 and "Traceback" not in err, err
    assert lines[-1].startswith("kvmetal generate: error: cannot write the model cache") and \
        "KVMETAL_MODEL_CACHE" in lines[-1], err
    assert "kvmetal: converting" not in err


def test_gemma3_without_the_gguf_package_fails_before_joining(tmp_path, capsys, monkeypatch):
    from kvmetal.models import named

    try:
        named.gguf_parts("gemma3")
    except named.ModelMissing as exc:
        pytest.skip(str(exc))
    monkeypatch.setitem(sys.modules, "gguf", None)  # what importing it does where it is not installed
    monkeypatch.setattr(named, "_joined_gguf", lambda *a, **k: pytest.fail("joined the parts first"))
    monkeypatch.setenv("KVMETAL_MODEL_CACHE", str(tmp_path / "models"))
    status, err = _run(["generate", "-m", "gemma3", "-p", "hi"], capsys)
    assert status == 2 and "Traceback" not in err and "kvmetal: converting" not in err, err
    assert err.splitlines()[-1] == ("kvmetal generate: error: the model gemma3 (gemma-3-270m) needs llama.cpp's gguf "
                                    'package to convert its GGUF: pip install "gguf>=0.17"; in a kvmetal checkout, '
                                    'pip install ".[gguf]" also does'), err


def test_interrupted_starts_on_its_own_line(monkeypatch, capsys):
    from kvmetal import budget

    def interrupted(argv):
        print("a streamed answer with no newline yet", end="")
        raise KeyboardInterrupt

    monkeypatch.setattr(budget, "main", interrupted)
    assert cli.main(["budget"]) == 130
    captured = capsys.readouterr()
    assert captured.err == "\nkvmetal budget: interrupted\n", captured


def test_the_source_tree_hint_names_the_pinned_mlx(monkeypatch):
    from kvmetal import _install_check

    monkeypatch.setattr(_install_check, "_inside_source_checkout", lambda: True)
    # As if imported from this checkout (CI runs the tests against an installed wheel).
    monkeypatch.setattr(_install_check, "PACKAGE_DIR", Path(__file__).resolve().parents[1] / "kvmetal")
    message = _install_check.missing_extension_message(platform="linux")
    pin = _install_check.pinned_mlx_version()
    import mlx.core as mx

    assert pin == mx.__version__  # this environment runs the pinned MLX (test_install checks it too)
    assert f'"mlx[cpu]=={pin}"' in message and "<pinned version>" not in message
    assert f'"mlx=={pin}"' in _install_check.missing_extension_message(platform="darwin")


def test_import_kvmetal_leaks_no_module_it_imported():
    code = ("import types, kvmetal; print(sorted(n for n in dir(kvmetal) if not n.startswith('_') and "
            "isinstance(getattr(kvmetal, n), types.ModuleType))); print(hasattr(kvmetal, 'importlib'))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert run.returncode == 0, run.stderr
    modules, has_importlib = run.stdout.splitlines()
    assert modules == "[]" and has_importlib == "False", run.stdout
