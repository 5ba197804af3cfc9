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
    assert 'pip install "kvmetal[lm]"' in capsys.readouterr().err


def test_closed_pipe_gives_no_traceback(tmp_path):
    # The reader is gone before the first write (what `| head` does to a long report).
    proc = subprocess.Popen([sys.executable, "-m", "kvmetal", "budget", "-m", "llama-3-8b", "--compare"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp_path)
    proc.stdout.close()
    _, err = proc.communicate(timeout=120)
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()
