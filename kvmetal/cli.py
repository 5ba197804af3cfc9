"""The ``kvmetal`` command: each subcommand lives in the module that does the work.

Every path ends in an answer or in one line that says what is wrong (``kvmetal CMD:
error: ...``, exit status 2): a bad flag names the flag, a missing optional package
names what to install, an extension built for another MLX says so.
"""
from __future__ import annotations

import importlib
import sys

from .cli_args import OPTIONAL_MODULES, ArgumentParser, checked, install_hint  # noqa: F401  (their old home)

# subcommand -> (module, one-line help); each module has main(argv) -> int.
COMMANDS = {
    "bench": ("kvmetal.benchmarks", "microbenchmarks of the kernels against MLX baselines"),
    "budget": ("kvmetal.budget", "KV-cache memory and decode-bandwidth arithmetic"),
    "serve": ("kvmetal.serve.cli", "an OpenAI-compatible HTTP server over the paged cache"),
    "demo": ("kvmetal.commands.demo", "continuous batching over a paged cache on a small random model"),
    "generate": ("kvmetal.commands.generate", "mlx-lm generate with the paged cache (model directory or Hugging Face repo id)"),
    "selfcheck": ("kvmetal.selfcheck", "compile every kernel, check every op against the oracle, time decode: one report"),
    "convert-gguf": ("kvmetal.models.convert_cli", "convert a llama or gemma3 GGUF file to an mlx-lm model directory"),
}
# Commands that run kvmetal's compiled CPU kernels: an unusable extension stops them at once.
NEEDS_EXTENSION = frozenset({"bench", "serve", "demo", "generate"})

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
        print(f"kvmetal: error: unknown command {command!r}; one of: {', '.join(COMMANDS)} (see kvmetal --help)",
              file=sys.stderr)
        return 2
    # Before anything imports MLX: its float32 matmuls on OpenBLAS (Linux; a no-op elsewhere,
    # or when MLX is already loaded, as in a test calling main()).
    from .models.blas import use_openblas

    use_openblas()
    prog = f"kvmetal {command}"
    if command in NEEDS_EXTENSION and not any(flag in rest for flag in ("-h", "--help")):
        from ._install_check import extension_problem

        problem = extension_problem()
        if problem:
            print(f"{prog}: error: {problem}", file=sys.stderr)
            return 2
    try:
        module = importlib.import_module(COMMANDS[command][0])
        return int(module.main(rest) or 0)
    except SystemExit as exc:  # argparse's exit (--help, a bad flag): a status, for callers in-process too
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except ModuleNotFoundError as exc:
        name = (exc.name or "").split(".")[0]
        if name not in OPTIONAL_MODULES:
            raise
        print(f"{prog}: error: this needs {name}: {install_hint(name)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        # on its own line: the output it cut off (a streamed answer) may have left one open
        sys.stdout.flush()
        print(f"\n{prog}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # `kvmetal ... | head`: the reader left. Stop quietly; point stdout at devnull so
        # the interpreter's final flush does not raise again (Python's documented recipe).
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":
    sys.exit(main())
