"""The hard KV memory cap: parse ``--kv-memory`` and size the pools under it.

The cap covers every layer group together: each group pool gets the same number of
blocks, and that number times the bytes of one block in every group stays <= the cap.
Fixed pools never grow, so the cap holds for the whole life of the server.
"""
from __future__ import annotations

import os
import re

UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def working_set_bytes() -> tuple[int, str]:
    """(bytes, what they are): the Mac's recommended working set, else physical memory."""
    import mlx.core as mx

    if mx.metal.is_available():
        from ..chips import metal_device_info

        info = metal_device_info()
        return int(info["max_recommended_working_set_size"]), "the GPU's recommended working set"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "physical memory (no Metal device)"


def parse_memory(text: str) -> int:
    """``"8GB"``, ``"512MiB"``, ``"1.5 GiB"`` or a fraction ``"0.5"`` (of ``working_set_bytes``) -> bytes."""
    if not isinstance(text, str):
        raise TypeError(f"[kv-memory] expected a string such as '8GB' or '0.5', got {text!r}")
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in UNITS:
        raise ValueError(f"[kv-memory] {text!r} is not a size: use e.g. 8GB, 512MB, 4GiB, 768MiB, "
                         f"or a fraction such as 0.5 of the working set")
    number, unit = float(match.group(1)), match.group(2).lower()
    if unit == "" and number <= 1:  # a bare number up to 1 is a fraction; above 1 it is bytes
        if number <= 0:
            raise ValueError(f"[kv-memory] a fraction must be in (0, 1], got {text!r}")
        return int(number * working_set_bytes()[0])
    value = int(number * UNITS[unit])
    if value < 1:
        raise ValueError(f"[kv-memory] must be positive, got {text!r}")
    return value


def blocks_under_cap(pool_bytes_of, cap_bytes: int, *, block_size: int) -> int:
    """Blocks per group pool so that the whole cache, fixed overhead included, stays <= ``cap_bytes``.

    ``pool_bytes_of(n)``: the bytes a cache with ``n`` blocks per group pool allocates
    (measured on real caches, so every layout detail is counted)."""
    one, two = pool_bytes_of(1), pool_bytes_of(2)
    per_block, fixed = two - one, 2 * one - two  # fixed: e.g. a reserved padding block per pool
    blocks = (cap_bytes - fixed) // per_block
    if blocks < 1:
        raise ValueError(f"[kv-memory] {cap_bytes} bytes hold no block: one block of {block_size} tokens "
                         f"takes {per_block} bytes across the model's layers (plus {fixed} bytes per cache)")
    return int(blocks)


def model_pool_bytes(model, num_blocks: int, **cache_options) -> int:
    """Bytes of the paged cache ``use_paged_cache(model, num_blocks=..., **cache_options)`` builds."""
    from ..integrations.mlx_lm import use_paged_cache

    with use_paged_cache(model, num_blocks=num_blocks, **cache_options) as handle:
        return handle.new_model_cache().nbytes


def format_bytes(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
