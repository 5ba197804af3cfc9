"""Correct: every op on the backend against the float64 oracle, over a small shape
matrix and a short randomized sweep; the worst error per op against its budget.

Inputs are hostile in the tests' way: shuffled block ids, ragged lengths that are not
multiples of the block size, NaN in every slot no sequence owns (quantized scales
included) and out-of-range ids past each sequence's blocks, so a kernel that reads
what it should not shows NaN. Each case runs on its own: an exception is that case's
failure, with its message, and the rest go on.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

import kvmetal as kv

from .. import quant, reference
from .cases import describe, matrix, sweep
from .families import DTYPES

# max |out - oracle| / max |oracle|, from docs/design.md ("Numerics and tests"); quantized
# paths are compared with the oracle on the dequantized cache at the same budget.
BUDGETS = {"f32": 1e-5, "f16": 3e-3, "bf16": 2e-2}
EXACT = 0.0  # gather of a float cache and copy_blocks move bits: no error at all


def rel_error(out, ref) -> float:
    """max |out - ref| / max |ref|; inf when ``out`` has NaN/inf (a read of a poisoned slot)."""
    out = reference.to_f64(out) if not isinstance(out, np.ndarray) else out.astype(np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise ValueError(f"output shape {out.shape} != oracle shape {ref.shape}")
    if not np.isfinite(out).all():
        return math.inf
    return float(np.abs(out - ref).max() / max(np.abs(ref).max(), 1e-30)) if out.size else 0.0


# ----------------------------------------------------------------------------- inputs

def _random(rng, shape, dtype) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def paged_layout(rng, lens, block_size, *, spare_blocks=2):
    """(block_tables [S, M + 1] int32, owned [N, bs] bool) for sequences of ``lens``:
    shuffled block ids, and an out-of-range id past each sequence's blocks."""
    per_seq = [-(-n // block_size) for n in lens]
    num_blocks = sum(per_seq) + spare_blocks
    ids = rng.permutation(num_blocks)
    tables = np.full((len(lens), max(per_seq) + 1), num_blocks + 1000, dtype=np.int32)
    owned = np.zeros((num_blocks, block_size), dtype=bool)
    cursor = 0
    for s, (n, nb) in enumerate(zip(lens, per_seq)):
        tables[s, :nb] = ids[cursor:cursor + nb]
        cursor += nb
        for t in range(n):
            owned[tables[s, t // block_size], t % block_size] = True
    return tables, owned


def poisoned_cache(rng, owned, *, num_kv_heads, head_dim, dtype, fmt):
    """A random [N, Hkv, bs, D] cache with NaN in every slot ``owned`` leaves out (for a
    quantized cache, in its scales); ``fmt`` (bits, group_size) or None."""
    num_blocks, block_size = owned.shape
    mask = np.broadcast_to(owned[:, None, :, None], (num_blocks, num_kv_heads, block_size, 1))
    data = rng.standard_normal((num_blocks, num_kv_heads, block_size, head_dim)).astype(np.float32)
    if fmt is None:
        return mx.array(np.where(mask, data, np.nan)).astype(dtype)
    q = quant.quantize(mx.array(data).astype(dtype), bits=fmt[0], group_size=fmt[1])
    scales = np.where(mask, np.array(q.scales.astype(mx.float32)), np.nan)
    return q.replace(q.data, mx.array(scales).astype(dtype), q.biases)


def _caches(rng, c, owned):
    make = lambda fmt: poisoned_cache(rng, owned, num_kv_heads=c["hkv"], head_dim=c["d"],
                                      dtype=DTYPES[c["dtype"]], fmt=fmt)
    return make(c.get("k")), make(c.get("v"))


def _paged_pair(rng, c):
    tables, owned = paged_layout(rng, c["lens"], c["bs"])
    kc, vc = _caches(rng, c, owned)
    return kc, vc, mx.array(tables), mx.array(np.array(c["lens"], np.int32))


def _maybe_quantize(x, fmt):
    return x if fmt is None else quant.quantize(x, bits=fmt[0], group_size=fmt[1])


def _options(rng, c, heads):
    sinks = mx.array(rng.standard_normal(heads).astype(np.float32)) if c.get("sinks") else None
    return dict(softcap=c.get("softcap"), sinks=sinks)


# ----------------------------------------------------------------------------- one case per op

def run_paged(c, rng):
    kc, vc, tables, lens = _paged_pair(rng, c)
    heads = c["hkv"] * c["g"]
    shape = (len(c["lens"]), heads, c["d"]) if c["L"] == 1 and not c.get("four_d") else \
        (len(c["lens"]), c["L"], heads, c["d"])
    query = _random(rng, shape, DTYPES[c["dtype"]])
    opts = _options(rng, c, heads)
    opts["sliding_window"] = c.get("window")
    out = kv.paged_attention(query, kc, vc, tables, lens, num_splits=c.get("splits"), **opts)
    mx.eval(out)
    expected = reference.paged_attention(query, kc, vc, tables, lens, **opts)
    return rel_error(out, expected), BUDGETS[c["dtype"]]


def run_decode(c, rng):
    dtype = DTYPES[c["dtype"]]
    heads = c["hkv"] * c["g"]
    b, t, d = c["b"], c["T"], c["d"]

    def view(fmt):  # an offset view (row 0 skipped) of a longer array, read in place
        base = _maybe_quantize(_random(rng, (b, c["hkv"], t + 1, d), dtype), fmt)
        if isinstance(base, quant.QuantizedKV):
            return base.replace(*(x[:, :, 1:] for x in base.arrays()))
        return base[:, :, 1:]

    keys, values = view(c.get("k")), view(c.get("v"))
    query = _random(rng, (b, heads, c["L"], d), dtype)
    opts = _options(rng, c, heads)
    out = kv.decode_attention(query, keys, values, num_splits=c.get("splits"), **opts)
    mx.eval(out)
    return rel_error(out, reference.decode_attention(query, keys, values, **opts)), BUDGETS[c["dtype"]]


def run_write(c, rng):
    """reshape_and_cache: float caches convert (exact up to the cache dtype's rounding);
    quantized ones must match mx.quantize of each written row alone, within a code step."""
    dtype = DTYPES[c["dtype"]]
    n, hkv, d, bs = 4, c["hkv"], c["d"], c["bs"]
    slots = [1, bs + 3, -1, 3 * bs - 1, 2]
    rows_k = _random(rng, (len(slots), hkv, d), mx.float32)
    rows_v = _random(rng, (len(slots), hkv, d), mx.float32)
    kc0 = _maybe_quantize(_random(rng, (n, hkv, bs, d), dtype), c.get("k"))
    vc0 = _maybe_quantize(_random(rng, (n, hkv, bs, d), dtype), c.get("v"))
    slot_mapping = mx.array(np.array(slots, np.int32))
    kc, vc = kv.reshape_and_cache(rows_k, rows_v, kc0, vc0, slot_mapping)
    mx.eval(*_flat(kc), *_flat(vc))
    worst, worst_budget = 0.0, BUDGETS[c["dtype"]]
    for rows, before, after in ((rows_k, kc0, kc), (rows_v, vc0, vc)):
        want = reference.to_f64(before).copy()
        untouched = np.ones((n, bs), dtype=bool)
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            row = rows[t].astype(dtype)
            if isinstance(after, quant.QuantizedKV):
                row = quant.dequantize(quant.quantize(row, bits=after.bits, group_size=after.group_size))
            want[slot // bs, :, slot % bs] = reference.to_f64(row)
            untouched[slot // bs, slot % bs] = False
        # Slots not written keep their bits exactly ([N, Hkv, bs, W]: slots on axes 0 and 2).
        for b_old, b_new in zip(_flat(before), _flat(after)):
            if not np.array_equal(_slot_bits(b_old)[untouched], _slot_bits(b_new)[untouched]):
                return math.inf, worst_budget
        err, budget = rel_error(after, want), BUDGETS[c["dtype"]]
        if isinstance(after, quant.QuantizedKV):
            # A value on a rounding boundary may land one code away (division rounding):
            # the budget is one quantization step where that exceeds the float budget.
            step = float(np.abs(np.array(after.scales.astype(mx.float32))).max())
            budget = max(budget, 1.01 * step / max(float(np.abs(want).max()), 1e-30))
        if err / budget >= worst / worst_budget:
            worst, worst_budget = err, budget
    return worst, worst_budget


def _slot_bits(a: mx.array) -> np.ndarray:
    """The raw bits of a cache array with the slot axes (block, offset) first."""
    raw = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}[a.dtype.size]
    return np.moveaxis(np.array(a.view(raw)), 2, 1)


def run_gather(c, rng):
    kc, vc, tables, lens = _paged_pair(rng, c)
    keys, values = kv.gather_kv_cache(kc, vc, tables, lens)
    mx.eval(keys, values)
    ek, ev = reference.gather_kv_cache(kc, vc, tables, lens)
    quantized = isinstance(kc, quant.QuantizedKV) or isinstance(vc, quant.QuantizedKV)
    return max(rel_error(keys, ek), rel_error(values, ev)), BUDGETS[c["dtype"]] if quantized else EXACT


def run_copy(c, rng):
    dtype = DTYPES[c["dtype"]]
    n, hkv, d, bs = 6, c["hkv"], c["d"], c["bs"]
    kc0 = _maybe_quantize(_random(rng, (n, hkv, bs, d), dtype), c.get("k"))
    vc0 = _maybe_quantize(_random(rng, (n, hkv, bs, d), dtype), c.get("v"))
    src, dst = mx.array([0, 3, 3], dtype=mx.int32), mx.array([5, 1, 2], dtype=mx.int32)
    kc, vc = kv.copy_blocks(kc0, vc0, src, dst)
    mx.eval(*_flat(kc), *_flat(vc))
    ek, ev = reference.copy_blocks(kc0, vc0, src, dst)
    return max(rel_error(kc, ek), rel_error(vc, ev)), EXACT


def run_varlen(c, rng):
    """paged_attention_varlen (when this kvmetal has it): ragged query runs, one call."""
    kc, vc, tables, lens = _paged_pair(rng, c)
    heads = c["hkv"] * c["g"]
    runs = c["runs"]  # query rows per sequence, each <= its length
    starts = mx.array(np.concatenate([[0], np.cumsum(runs)]).astype(np.int32))
    query = _random(rng, (int(sum(runs)), heads, c["d"]), DTYPES[c["dtype"]])
    opts = _options(rng, c, heads)
    opts["sliding_window"] = c.get("window")
    out = kv.paged_attention_varlen(query, kc, vc, tables, lens, starts, **opts)
    mx.eval(out)
    expected = reference.paged_attention_varlen(query, kc, vc, tables, lens, starts, **opts)
    return rel_error(out, expected), BUDGETS[c["dtype"]]


def run_cascade(c, rng):
    """paged_attention_cascade (when this kvmetal has it): shared prefixes (whole blocks,
    as a prefix-sharing pool publishes them), then each sequence's own tokens; the oracle
    is paged attention over the concatenated table."""
    bs, prefix_lens, prefix_of, own = c["bs"], c["prefix_lens"], c["prefix_of"], c["lens"]
    prefix_blocks = [n // bs for n in prefix_lens]
    own_blocks = [-(-n // bs) for n in own]
    num_blocks = sum(prefix_blocks) + sum(own_blocks) + 2
    ids = iter(rng.permutation(num_blocks).tolist())
    pad = num_blocks + 1000
    prefix_tables = np.full((len(prefix_lens), max(prefix_blocks) + 1), pad, np.int32)
    own_tables = np.full((len(own), max(own_blocks) + 1), pad, np.int32)
    owned = np.zeros((num_blocks, bs), dtype=bool)
    for p, nb in enumerate(prefix_blocks):
        prefix_tables[p, :nb] = [next(ids) for _ in range(nb)]
        owned[prefix_tables[p, :nb]] = True
    for s, (n, nb) in enumerate(zip(own, own_blocks)):
        own_tables[s, :nb] = [next(ids) for _ in range(nb)]
        for t in range(n):
            owned[own_tables[s, t // bs], t % bs] = True
    concat = np.full((len(own), prefix_tables.shape[1] + own_tables.shape[1]), pad, np.int32)
    total = []
    for s, p in enumerate(prefix_of):
        head = prefix_tables[p, :prefix_blocks[p]] if p >= 0 else np.zeros(0, np.int32)
        concat[s, :len(head) + own_blocks[s]] = np.concatenate([head, own_tables[s, :own_blocks[s]]])
        total.append(len(head) * bs + own[s])
    kc, vc = _caches(rng, c, owned)
    heads = c["hkv"] * c["g"]
    query = _random(rng, (len(own), heads, c["d"]), DTYPES[c["dtype"]])
    opts = _options(rng, c, heads)
    i32 = lambda x: mx.array(np.asarray(x, np.int32))
    out = kv.paged_attention_cascade(query, kc, vc, i32(prefix_tables), i32(prefix_lens), i32(prefix_of),
                                     i32(own_tables), i32(own), **opts)
    mx.eval(out)
    expected = reference.paged_attention(query, kc, vc, i32(concat), i32(total), **opts)
    return rel_error(out, expected), BUDGETS[c["dtype"]]


def _flat(x) -> list:
    return list(x.arrays()) if isinstance(x, quant.QuantizedKV) else [x]


RUNNERS = {"paged_attention": run_paged, "decode_attention": run_decode, "reshape_and_cache": run_write,
           "gather_kv_cache": run_gather, "copy_blocks": run_copy, "paged_attention_varlen": run_varlen,
           "paged_attention_cascade": run_cascade}
# Ops that only some versions of kvmetal have: checked when ``kvmetal`` has them at run time.
OPTIONAL_OPS = ("paged_attention_varlen", "paged_attention_cascade")


def available_ops() -> list:
    oracle = {"paged_attention_cascade": "paged_attention"}
    return [op for op in RUNNERS if op not in OPTIONAL_OPS
            or (hasattr(kv, op) and hasattr(reference, oracle.get(op, op)))]


# ----------------------------------------------------------------------------- the stage

@dataclass
class OpResult:
    op: str
    cases: int = 0
    sweep_cases: int = 0
    worst_ratio: float = 0.0      # error / budget of the worst case (exact ops: 0 or inf)
    worst_error: float = 0.0
    worst_budget: float | None = None
    worst_case: str | None = None
    failures: list = field(default_factory=list)
    query_lens: set = field(default_factory=set)   # attention ops: the L (query rows) checked

    def add(self, case: dict, error: float, budget: float, *, is_sweep: bool):
        self.cases += 1
        self.sweep_cases += is_sweep
        if "L" in case:
            self.query_lens.add(case["L"])
        ratio = (0.0 if error == 0 else math.inf) if budget == EXACT else error / budget
        if ratio >= self.worst_ratio or self.worst_case is None:
            self.worst_ratio, self.worst_error, self.worst_budget = ratio, error, budget
            self.worst_case = describe(case)
        if not ratio <= 1.0:
            what = "NaN/inf in the output" if math.isinf(error) else f"error {error:.3g} > budget {budget:.3g}"
            if budget == EXACT and not math.isinf(error):
                what = f"error {error:.3g}, expected exact"
            self.failures.append(f"{self.op} [{describe(case)}]: {what}")

    def as_dict(self) -> dict:
        finite = lambda x: x if x is None or math.isfinite(x) else "inf"
        return {"op": self.op, "cases": self.cases, "sweep_cases": self.sweep_cases,
                "worst_error": finite(self.worst_error), "budget": self.worst_budget,
                "worst_ratio": finite(self.worst_ratio), "worst_case": self.worst_case,
                "query_lens": sorted(self.query_lens), "ok": not self.failures, "failures": self.failures}


@contextlib.contextmanager
def _on(backend: str, seed: int):
    """Run the ops on ``backend``; on the simulator with strict checks (races, OOB) and a schedule seed."""
    with kv.use_backend(backend):
        if backend == "sim":
            from .. import sim

            with sim.trace(strict=True, seed=seed):
                yield
        else:
            yield


def check_all(*, backend: str, quick: bool, sweep_cases: int, seed: int = 0, progress=None) -> dict:
    """The report's ``correct`` section: one entry per op and the sweep's size."""
    start = time.perf_counter()
    ops = available_ops()
    results = {op: OpResult(op) for op in ops}
    skipped = [{"op": op, "reason": f"kvmetal {kv.__version__} has no kvmetal.{op}"}
               for op in OPTIONAL_OPS if op not in ops]
    cases = [(c, False) for c in matrix(quick) if c["op"] in results]
    cases += [(c, True) for c in sweep(sweep_cases, seed, quick)]
    for i, (case, is_sweep) in enumerate(cases):
        rng = np.random.default_rng([seed, i])
        try:
            with _on(backend, seed=i % 2):
                error, budget = RUNNERS[case["op"]](case, rng)
        except Exception as exc:  # noqa: BLE001 - this case failed; report it and go on
            results[case["op"]].cases += 1
            results[case["op"]].sweep_cases += is_sweep
            results[case["op"]].worst_ratio = math.inf
            results[case["op"]].worst_case = describe(case)
            results[case["op"]].failures.append(f"{case['op']} [{describe(case)}]: {type(exc).__name__}: "
                                                f"{str(exc)[:2000]}")
        else:
            results[case["op"]].add(case, error, budget, is_sweep=is_sweep)
        if progress and (i + 1) % 8 == 0:
            progress(f"  {i + 1}/{len(cases)} cases")
    ops_out = [r.as_dict() for r in results.values()]
    return {"backend": backend, "ops": ops_out, "skipped_ops": skipped,
            "cases": len(cases), "sweep": {"cases": sum(s for _, s in cases), "seed": seed},
            "failed": sum(len(r.failures) for r in results.values()),
            "seconds": round(time.perf_counter() - start, 3)}
