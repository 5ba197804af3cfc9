"""Shared setup for the metal-kernel tests: backends to run, paged caches with
NaN-poisoned unused slots, tolerances, and simulator options."""
from __future__ import annotations

import contextlib

import mlx.core as mx
import numpy as np

import kvmetal as kv
from kvmetal import quant

TOLERANCE = {mx.float32: 1e-5, mx.float16: 3e-3, mx.bfloat16: 2e-2}
SEEDS = (0, 1)


def kernel_backends() -> list:
    """The simulator everywhere; the real Metal backend too on a Mac."""
    return ["sim"] + (["metal"] if mx.metal.is_available() else [])


@contextlib.contextmanager
def run_on(backend: str, *, seed: int = 0):
    """``use_backend(backend)``; for the simulator also strict checks and a schedule seed."""
    with kv.use_backend(backend):
        if backend == "sim":
            from kvmetal import sim

            with sim.trace(strict=True, seed=seed) as t:
                yield t
        else:
            yield None


def rel_err(out, expected) -> float:
    out = np.array(out.astype(mx.float32), dtype=np.float64)
    assert np.isfinite(out).all(), "output holds NaN/inf (a kernel read a poisoned slot?)"
    return float(np.abs(out - expected).max() / max(np.abs(expected).max(), 1e-30))


def random(rng, shape, dtype):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def paged_cache(rng, *, lens, num_kv_heads, head_dim, block_size, dtype, spare_blocks=3):
    """K/V caches whose slots not owned by any sequence (incl. the tail of each last block) are NaN.

    Block ids are shuffled; the tables are padded with -1 past each sequence's blocks
    (never read). Returns (key_cache, value_cache, block_tables, seq_lens) as float arrays.
    """
    needed = [-(-n // block_size) for n in lens]
    num_blocks = sum(needed) + spare_blocks
    max_blocks = max(needed) + 1
    ids = rng.permutation(num_blocks)
    tables = np.full((len(lens), max_blocks), -1, np.int32)
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    caches = []
    for _ in range(2):
        cache = np.full(shape, np.nan, np.float32)
        caches.append(cache)
    used = 0
    for s, n in enumerate(lens):
        blocks = ids[used: used + needed[s]]
        used += needed[s]
        tables[s, : len(blocks)] = blocks
        for t in range(n):
            for cache in caches:
                cache[blocks[t // block_size], :, t % block_size] = rng.standard_normal((num_kv_heads, head_dim))
    # Table entries past the used blocks point at a real (poisoned) block id, so a
    # kernel that read them would not fault but would pick up NaN.
    for s in range(len(lens)):
        tables[s, needed[s]:] = ids[-1]
    return (mx.array(caches[0]).astype(dtype), mx.array(caches[1]).astype(dtype), mx.array(tables),
            mx.array(np.array(lens, np.int32)))


def maybe_quantize(cache, spec):
    """``spec`` None keeps the float cache; (bits, group_size) quantizes it (NaN stays NaN)."""
    if spec is None:
        return cache
    bits, group_size = spec
    return quant.quantize(cache, bits=bits, group_size=group_size)
