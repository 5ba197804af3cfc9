"""The ``kvmetal`` command: each subcommand lives in the module that does the work."""
from __future__ import annotations

import importlib
import sys

# subcommand -> (module, one-line help); each module has main(argv) -> int.
COMMANDS = {
    "bench": ("kvmetal.benchmarks", "microbenchmarks of the kernels against MLX baselines"),
    "budget": ("kvmetal.budget", "KV-cache memory and decode-bandwidth arithmetic"),
    "serve": ("kvmetal.serve.cli", "an OpenAI-compatible HTTP server over the paged cache"),
    "demo": ("kvmetal.integrations.demo", "continuous batching over a paged cache on a small random model"),
    "generate": ("kvmetal.integrations.generate", "mlx-lm generate with the paged cache (model directory or Hugging Face repo id)"),
    "selfcheck": ("kvmetal.selfcheck", "compile every kernel, check every op against the oracle, time decode: one report"),
    "convert-gguf": ("kvmetal.models.convert_cli", "convert a llama GGUF file to an mlx-lm model directory"),
}

# optional dependency -> the kvmetal extra that installs it
OPTIONAL_MODULES = {"mlx_lm": "lm", "transformers": "lm", "matplotlib": "plot", "fastapi": "serve",
                    "uvicorn": "serve"}


def _usage() -> str:
    lines = ["usage: kvmetal <command> [options]", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'kvmetal <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(_usage(), file=sys.stderr)  # like argparse without a required argument
        return 2
    if argv[0] in ("-h", "--help"):
        print(_usage())
        return 0
    if argv[0] in ("-V", "--version"):
        from . import __version__

        print(f"kvmetal {__version__}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"kvmetal: unknown command {command!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(COMMANDS[command][0])
    try:
        return int(module.main(rest) or 0)
    except ModuleNotFoundError as exc:
        extra = OPTIONAL_MODULES.get((exc.name or "").split(".")[0])
        if extra is None:
            raise
        print(f"kvmetal {command}: error: this needs {exc.name.split('.')[0]}: pip install \"kvmetal[{extra}]\"",
              file=sys.stderr)
        return 2
    except BrokenPipeError:
        # `kvmetal ... | head`: the reader left. Stop quietly; point stdout at devnull so
        # the interpreter's final flush does not raise again (Python's documented recipe).
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
