"""The ``kvmetal`` command line: one consistent surface across subcommands."""
from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys

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
