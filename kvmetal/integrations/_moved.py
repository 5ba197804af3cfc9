"""The old paths of code that left kvmetal/integrations/ (issue 43: the engine went to
kvmetal.engine, the commands to kvmetal.commands). Importing an old path gives the module it
moved to, under the old name, so old imports, attribute reads and monkeypatching all reach
the code that runs. The new modules are imported only when an old path is: nothing here
ties the mlx-lm adapter to the engine or the commands."""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys
import types

# old module under kvmetal.integrations -> the module(s) it moved to (a split module reads
# and sets each name in the first of its homes that has it)
MOVED = {
    "engine": ("kvmetal.engine.engine",),
    "scheduler": ("kvmetal.engine.scheduler",),
    "forward": ("kvmetal.engine.runner",),
    "sampler": ("kvmetal.engine.sampler",),
    "request": ("kvmetal.engine.request",),
    "draft_model": ("kvmetal.engine.proposers",),
    "speculative": ("kvmetal.engine.proposers", "kvmetal.engine.sampler"),
    "generate": ("kvmetal.commands.generate",),
    "demo": ("kvmetal.commands.demo",),
}


def split_module(name: str, homes: list) -> types.ModuleType:
    """A module ``name`` whose names live in ``homes``: one property per name, so reads are
    live and a set (a monkeypatch and its undo) goes to the home that has the name."""
    owner = {}
    for home in reversed(homes):
        owner.update((n, home) for n in vars(home) if not n.startswith("__"))
    names = {n: property(lambda self, h=h, n=n: getattr(h, n), lambda self, value, h=h, n=n: setattr(h, n, value))
             for n, h in owner.items()}
    module = type("SplitModule", (types.ModuleType,), names)(name)
    module.__doc__ = f"Moved: its names live in {', '.join(h.__name__ for h in homes)}."
    return module


class _OldPathLoader(importlib.abc.Loader):
    def __init__(self, homes: tuple):
        self.homes = homes

    def create_module(self, spec):
        homes = [importlib.import_module(h) for h in self.homes]
        if len(homes) > 1:
            return split_module(spec.name, homes)
        self.home_spec = homes[0].__spec__  # the import system sets __spec__ to the old path's: put it back
        return homes[0]

    def exec_module(self, module):
        if getattr(self, "home_spec", None) is not None:
            module.__spec__ = self.home_spec


class _OldPathFinder(importlib.abc.MetaPathFinder):
    def __init__(self, package: str):
        self.package = package

    def find_spec(self, fullname, path=None, target=None):
        parent, _, leaf = fullname.rpartition(".")
        if parent != self.package or leaf not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _OldPathLoader(MOVED[leaf]))


def install(package: str) -> None:
    """Let ``package``.<old name> import (once per process)."""
    if not any(isinstance(f, _OldPathFinder) and f.package == package for f in sys.meta_path):
        sys.meta_path.insert(0, _OldPathFinder(package))  # before any finder that knows old files (an editable install)
