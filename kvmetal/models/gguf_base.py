"""What every GGUF reader and converter of kvmetal shares: the error, the dtype choices,
metadata scalars, and the header's value-type codes (no converter imports another's module
through ``gguf.py``, which dispatches to them)."""
from __future__ import annotations

DTYPES = ("keep", "float32", "float16", "bfloat16")


class GGUFError(ValueError):
    """A GGUF file this converter cannot turn into an mlx-lm directory (one line)."""


def _scalar(meta: dict, key: str, *, required: bool = True, default=None):
    value = meta.get(key)
    if value is None:
        if required:
            raise GGUFError(f"GGUF metadata has no {key!r}")
        return default
    if hasattr(value, "item"):  # mx.array scalars
        value = value.item() if value.size == 1 else value.tolist()
    return value


def _float32(value) -> float:
    """A GGUF float32 as the shortest decimal that reads back to it (1e-05, not 9.99e-06)."""
    return float(f"{float(value):.7g}")


# GGUF metadata value types -> struct format (strings and arrays are read separately)
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9
