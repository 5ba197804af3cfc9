"""The one range a random seed may take, checked once for every entry point.

``mx.random.seed`` and ``mx.random.key`` take an unsigned 64-bit integer: 0 to 2**64 - 1
(nanobind refuses -1 or 2**64 with a TypeError that names neither the flag nor the
field). ``kvmetal generate --seed``, ``kvmetal demo --seed`` and the server's ``seed``
field are checked here before anything runs.
"""
from __future__ import annotations

SEED_MIN, SEED_MAX = 0, 2**64 - 1
SEED_RANGE_TEXT = "an integer in [0, 2**64 - 1] (an unsigned 64-bit integer, what mx.random.seed takes)"


def is_seed(value) -> bool:
    """True for an int (not a bool) in [SEED_MIN, SEED_MAX]."""
    return isinstance(value, int) and not isinstance(value, bool) and SEED_MIN <= value <= SEED_MAX


def check_seed(value, *, name: str = "seed") -> int:
    """``value`` when it is a valid seed; TypeError (not an int) or ValueError (out of
    range) naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be {SEED_RANGE_TEXT}, got {value!r}")
    if not SEED_MIN <= value <= SEED_MAX:
        raise ValueError(f"{name} must be {SEED_RANGE_TEXT}, got {value}")
    return value
