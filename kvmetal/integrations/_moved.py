"""The old paths of code that left kvmetal/integrations/ (issue 43: the engine went to
kvmetal.engine, the commands to kvmetal.commands). An old module becomes its new module
under the old name, so old imports, attribute reads and monkeypatching all reach the code
that runs."""
from __future__ import annotations

import sys
import types


def moved(name: str, *homes: types.ModuleType) -> None:
    """Make module ``name`` (an old path) the module it moved to; one split into several
    modules reads and sets each name in the first of ``homes`` that has it."""
    if len(homes) == 1:
        sys.modules[name] = homes[0]
        return
    owner = {}
    for home in reversed(homes):
        owner.update((n, home) for n in vars(home) if not n.startswith("__"))
    # One property per name: reads are live, and a set (a monkeypatch and its undo) goes to the home.
    names = {n: property(lambda self, h=h, n=n: getattr(h, n), lambda self, value, h=h, n=n: setattr(h, n, value))
             for n, h in owner.items()}
    sys.modules[name].__class__ = type("SplitModule", (types.ModuleType,), names)
