"""The command line's subcommands that are not another package's (``kvmetal/cli.py``
dispatches; each module has ``main(argv) -> int``): ``generate`` (mlx-lm's generate on the
paged cache), ``demo`` (the engine next to mlx-lm's BatchGenerator). ``common.py`` holds
what several commands (and the server) share: ``UserError``, ``resolve_model``,
``distributed_group``."""
