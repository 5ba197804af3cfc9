"""Shared test helpers: the tolerance table, the relative-error check, the hostile
paged-cache builder, the backends the kernel tests run on, and a one-kernel runner
for the simulator tests.

The builder poisons what no sequence owns with NaN (unused blocks, the tail of a
sequence's last block, quantized scales included) and fills block-table entries past a
sequence's last used block with an out-of-range id (or, for kernels that must not be
handed ids outside the cache, a spare block that is all NaN), so a kernel that reads
anything it should not fails loudly.
"""
from __future__ import annotations

import contextlib
import socket
from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import quant

# max |out - oracle| / max |oracle| over each output row, per docs/design.md
TOLERANCE = {mx.float32: 1e-5, mx.float16: 3e-3, mx.bfloat16: 2e-2}
DTYPES = (mx.float32, mx.float16, mx.bfloat16)
SEEDS = (0, 1)  # simulator schedule seeds (and data seeds) of the kernel tests


def row_errors(out, ref) -> np.ndarray:
    """max |out - ref| / max |ref| over the last axis, one value per row: per (sequence,
    query row, head) for attention outputs, per (sequence, kv head, token) for gathered or
    cached rows. A batch-wide scale would let a row with small outputs (a long sequence's
    average) hide behind a row with large ones (a one-token sequence). A row whose oracle
    is all zero (nothing to attend, a row past seq_len) must be exactly zero. Fails on
    NaN/inf in ``out`` (a read of a poisoned slot)."""
    out = np.array(out.astype(mx.float32), dtype=np.float64) if isinstance(out, mx.array) else out
    out, ref = np.asarray(out, dtype=np.float64), np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.isfinite(out).all(), "output has NaN/inf (a kernel read a poisoned slot?)"
    if out.ndim == 0:
        out, ref = out[None], ref[None]
    diff = np.abs(out - ref).max(axis=-1)
    scale = np.abs(ref).max(axis=-1)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(scale > 0, diff / np.where(scale > 0, scale, 1.0), np.where(diff > 0, np.inf, 0.0))


def rel_error(out, ref) -> float:
    """The worst row's error (see :func:`row_errors`)."""
    errors = row_errors(out, ref)
    return float(errors.max()) if errors.size else 0.0


def assert_close(out, ref, dtype, factor: float = 1.0):
    errors = row_errors(out, ref)
    budget = TOLERANCE[dtype] * factor
    if errors.size and errors.max() > budget:
        worst = np.unravel_index(int(np.argmax(errors)), errors.shape)
        raise AssertionError(f"relative error {errors.max():.3g} > {budget:.3g} in row {tuple(map(int, worst))} "
                             f"(of {errors.shape}; {int((errors > budget).sum())} rows over budget)")


@dataclass
class PagedCase:
    query: mx.array
    key_cache: object
    value_cache: object
    block_tables: mx.array
    seq_lens: mx.array
    owned: np.ndarray  # bool [N, bs]: slots a sequence owns


def _poison(cache: np.ndarray, owned: np.ndarray) -> np.ndarray:
    cache = cache.copy()
    cache[~owned[:, None, :, None].repeat(cache.shape[1], 1).repeat(cache.shape[3], 3)] = np.nan
    return cache


def paged_case(seq_lens, *, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=mx.float16,
               seed=0, spare_blocks=3, k_bits=None, v_bits=None, group_size=64,
               pad_with_spare_block=False) -> PagedCase:
    """Random paged cache with shuffled block ids for the given sequence lengths.

    ``seed`` is an int or a ``np.random.Generator`` (drawn from in place). Table
    entries past each sequence's blocks hold an id outside the cache, or with
    ``pad_with_spare_block`` a real block no sequence owns (all NaN)."""
    rng = np.random.default_rng(seed)
    blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(blocks_per_seq) + spare_blocks
    max_blocks = max(blocks_per_seq) + 1  # one spare column: never read
    ids = rng.permutation(num_blocks)
    if pad_with_spare_block:
        assert spare_blocks >= 1, "padding with a spare block needs spare_blocks >= 1"
        pad = ids[-1]  # the permutation's tail is never handed to a sequence
    else:
        pad = num_blocks + 1000
    tables = np.full((len(seq_lens), max_blocks), pad, dtype=np.int32)
    owned = np.zeros((num_blocks, block_size), dtype=bool)
    cursor = 0
    for s, (n, nb) in enumerate(zip(seq_lens, blocks_per_seq)):
        tables[s, :nb] = ids[cursor:cursor + nb]
        cursor += nb
        for t in range(n):
            owned[tables[s, t // block_size], t % block_size] = True
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    caches = []
    for bits in (k_bits, v_bits):
        data = rng.standard_normal(shape).astype(np.float32)
        if bits is None:
            caches.append(mx.array(_poison(data, owned)).astype(dtype))
        else:
            q = quant.quantize(mx.array(data).astype(dtype), bits=bits, group_size=group_size)
            scales = np.array(q.scales.astype(mx.float32))
            scales = _poison(scales, owned)
            caches.append(q.replace(q.data, mx.array(scales).astype(dtype), q.biases))
    query = mx.array(rng.standard_normal((len(seq_lens), num_heads, head_dim)).astype(np.float32)).astype(dtype)
    return PagedCase(query, caches[0], caches[1], mx.array(tables), mx.array(np.array(seq_lens, np.int32)), owned)


def free_slots(case: PagedCase, count: int, seed: int = 0) -> np.ndarray:
    """``count`` distinct slots no sequence owns (for writes that must not clobber live rows)."""
    free = np.flatnonzero(~case.owned.reshape(-1))
    rng = np.random.default_rng(seed)
    assert free.size >= count
    return rng.choice(free, size=count, replace=False).astype(np.int32)


def paged_cache(rng, *, lens, num_kv_heads, head_dim, block_size, dtype, spare_blocks=3):
    """Float K/V caches for the kernel tests (``paged_case`` with tables padded by a
    spare all-NaN block). Returns (key_cache, value_cache, block_tables, seq_lens)."""
    case = paged_case(lens, num_heads=num_kv_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      block_size=block_size, dtype=dtype, seed=rng, spare_blocks=spare_blocks,
                      pad_with_spare_block=True)
    return case.key_cache, case.value_cache, case.block_tables, case.seq_lens


def paged_attention_inputs(rng, *, lens, num_kv_heads, gqa, head_dim, block_size, dtype, k_quant=None,
                           v_quant=None, use_sinks=False, query_len=None):
    """One kernel-test row: (query, key_cache, value_cache, block_tables, seq_lens, sinks).

    Caches from :func:`paged_cache`, quantized per ``k_quant``/``v_quant`` ((bits,
    group_size) or None); query [S, H, D], or [S, L, H, D] with ``query_len``; float32
    sinks, one per query head, or None."""
    kc, vc, tables, seq_lens = paged_cache(rng, lens=lens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                           block_size=block_size, dtype=dtype)
    kc, vc = maybe_quantize(kc, k_quant), maybe_quantize(vc, v_quant)
    num_heads = num_kv_heads * gqa
    rows = (len(lens),) if query_len is None else (len(lens), query_len)
    query = random(rng, (*rows, num_heads, head_dim), dtype)
    sinks = mx.array(rng.standard_normal(num_heads).astype(np.float32)) if use_sinks else None
    return query, kc, vc, tables, seq_lens, sinks


def run_checked(backend, op, expected, query, *args, kernel: str, **kwargs) -> list:
    """``op(query, *args, **kwargs)`` on ``backend`` (every schedule seed on the simulator,
    one run elsewhere), checked for query's dtype and shape and against ``expected``
    within query's dtype tolerance. Returns the simulator's ``kernel`` call of each run."""
    calls = []
    for seed in SEEDS if backend == "sim" else SEEDS[:1]:
        with run_on(backend, seed=seed) as trace:
            out = op(query, *args, **kwargs)
            mx.eval(out)
        assert out.dtype == query.dtype and out.shape == query.shape, (out.dtype, out.shape)
        assert_close(out, expected, query.dtype)
        if trace is not None:
            calls.append(next(c for c in trace.calls if kernel in c.name))
    return calls


def maybe_quantize(cache, spec):
    """``spec`` None keeps the float cache; (bits, group_size) quantizes it (NaN stays NaN)."""
    if spec is None:
        return cache
    bits, group_size = spec
    return quant.quantize(cache, bits=bits, group_size=group_size)


def random(rng, shape, dtype):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def skip_unless_available(backend: str) -> tuple:
    """pytest marks that skip ``backend`` where it cannot run, saying why (so ``-ra`` lists
    what did not run instead of the case silently disappearing)."""
    if backend in kv.available_backends():
        return ()
    return (pytest.mark.skip(reason=f"the {backend} backend needs an Apple GPU (mx.metal.is_available() is False)"),)


def backend_params(backends=("metal", "cpu", "sim")) -> list:
    """``backends`` as pytest params, those unavailable here skipped with a reason."""
    return [pytest.param(b, marks=skip_unless_available(b), id=b) for b in backends]


def kernel_backends() -> list:
    """The simulator everywhere and the real Metal backend (skipped, with the reason, off a Mac)."""
    return backend_params(("sim", "metal"))


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


def run1(source, inputs, out_shape, out_dtype=mx.float32, *, grid, threadgroup, names=None, header="",
         template=None, init_value=None, **kw):
    """Build a one-output simulator kernel from ``source`` and run it; returns the output as NumPy."""
    from kvmetal import sim

    names = names or [f"in{i}" for i in range(len(inputs))]
    k = sim.metal_kernel(name=kw.pop("name", "t"), input_names=names, output_names=["out"], source=source,
                         header=header, ensure_row_contiguous=kw.pop("ensure_row_contiguous", True),
                         atomic_outputs=kw.pop("atomic_outputs", False))
    (out,) = k(inputs=inputs, output_shapes=[out_shape], output_dtypes=[out_dtype], grid=grid,
               threadgroup=threadgroup, template=template, init_value=init_value, **kw)
    return np.array(out.astype(mx.float32) if out.dtype == mx.bfloat16 else out)


def run_case_in_subprocess(module: str, backend: str, name: str):
    """Runs ``module.CASES[name]()`` on ``backend`` in a fresh interpreter, so a crash
    (segfault, abort) of a misuse case fails its own test instead of the whole run."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    here = Path(__file__).resolve().parent
    code = (f"import sys; sys.path.insert(0, {str(here)!r})\n"
            f"import kvmetal as kv, {module} as t\n"
            f"with kv.use_backend({backend!r}):\n"
            f"    t.CASES[{name!r}]()\n"
            "print('ok')\n")
    env = dict(os.environ, PYTHONFAULTHANDLER="1")
    # From tests/, not the repo root: `import kvmetal` finds the installed package (with _ext).
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=here, env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), (
        f"{name} on {backend}: exit code {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")


@pytest.fixture(autouse=True)
def no_kernels(monkeypatch):
    """Import into an error-test module: any backend call there is a failure, so every
    check must come before the first kernel."""
    def refuse(name=None):
        raise AssertionError("a backend was reached with bad input")
    monkeypatch.setattr(kv.backends, "get", refuse)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a test's server)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_LAYOUT_MODEL = []


def kv_layout_model():
    """A model with the KV layout of the served tiny model (2 layers, 2 kv heads, head_dim 64,
    float32), built once per process."""
    if not _LAYOUT_MODEL:
        from kvmetal.integrations import tiny_models

        _LAYOUT_MODEL.append(tiny_models.build("llama"))
    return _LAYOUT_MODEL[0]
