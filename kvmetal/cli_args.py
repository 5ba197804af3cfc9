"""What every kvmetal command's parser shares: the error contract (one line naming the
flag, exit status 2), checked argument types, and the install hint for an optional
dependency. It imports nothing of kvmetal, so any module with a command line can use it
(kvmetal/cli.py dispatches the commands)."""
from __future__ import annotations

import argparse

# optional dependency -> what installs it (pip names; the same packages as kvmetal's extras)
OPTIONAL_MODULES = {"mlx_lm": ('"mlx-lm>=0.32,<0.33"', "lm"), "transformers": ('"mlx-lm>=0.32,<0.33"', "lm"),
                    "matplotlib": ("matplotlib", "plot"), "fastapi": ("fastapi uvicorn", "serve"),
                    "uvicorn": ("fastapi uvicorn", "serve"), "gguf": ('"gguf>=0.17"', "gguf")}


def install_hint(module: str) -> str:
    """``pip install ...`` for an optional dependency, right for a checkout and for a wheel alike."""
    packages, extra = OPTIONAL_MODULES.get(module, (module, None))
    also = f'; in a kvmetal checkout, pip install ".[{extra}]" also does' if extra else ""
    return f"pip install {packages}{also}"


class ArgumentParser(argparse.ArgumentParser):
    """argparse with kvmetal's error contract: one line naming the flag, exit status 2
    (argparse's own error prints the whole usage first)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def checked(kind, test, requirement: str):
    """An argparse ``type``: ``kind(text)``, refused unless ``test(value)``, with a message
    argparse prefixes with the flag ("argument --temp: must be >= 0, got -1.0")."""

    def parse(text):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if not test(value):
            raise argparse.ArgumentTypeError(f"must be {requirement}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in some messages
    return parse
