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
    "generate": ("kvmetal.integrations.generate", "generate with a local mlx-lm model using the paged cache"),
}


def _usage() -> str:
    lines = ["usage: kvmetal <command> [options]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "Run 'kvmetal <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
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
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
