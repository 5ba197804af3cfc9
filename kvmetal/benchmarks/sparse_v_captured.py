"""``kvmetal bench --cases sparse_v_captured``: sparse V against exact decode over a real
model's attention (random data has nothing to skip: its scores are flat).

One decode step of every captured layer (``attention_capture``: each layer's query and
the K/V rows it sees, at the capture's context) through ``paged_attention``, float16
and K8/V4 caches, exact and ``sparse_v=SPARSE_V_TAU``, timed on the chosen backend in
the same run (the sparse row's baseline is the exact one, so ``speedup_vs_baseline`` is
exact / sparse). Where the Metal simulator runs, each row also gets the sparse kernel's
V bytes per token on a sample of layers (the exact kernel loads every live V byte, 1.0x)
and the rows the rule skips there, beside what each row's final maximum would allow.

The capture: ``$KVMETAL_SPARSE_V_CAPTURE`` (a path), else the newest ``.npz`` in
``attention_capture.capture_root()``.
"""
from __future__ import annotations

import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from .. import ops, quant
from ..backends import use_backend
from .attention_capture import capture_root, load_capture
from .timing import time_stats

SPARSE_V_TAU = 1e-4  # the larger of the two thresholds docs/kernels.md measures (skips most)
BLOCK_SIZE = 16
SIM_LAYERS = 6  # layers replayed on the simulator (sim_sample): ~4 s each at 8K


def capture_path() -> Path | None:
    env = os.environ.get("KVMETAL_SPARSE_V_CAPTURE")
    if env:
        return Path(env).expanduser()
    found = sorted(capture_root().glob("*.npz"), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def sim_sample(rows) -> list:
    """The layers replayed on the simulator, evenly spaced; where some layers see more keys
    than others (Gemma's global layers, whose V bytes dominate a long context), those first."""
    def spaced(ids, n):
        return [ids[int(i)] for i in np.linspace(0, len(ids) - 1, min(n, len(ids)))] if ids and n > 0 else []

    longest = max(r[2].shape[1] for r in rows)
    long = [r[0] for r in rows if r[2].shape[1] == longest]
    if len(long) == len(rows):
        return spaced(long, SIM_LAYERS)
    long = spaced(long, SIM_LAYERS)
    return sorted(long + spaced([r[0] for r in rows if r[0] not in long], SIM_LAYERS - len(long)))


def paged_layer(q, k, v, *, bits=None):
    """One captured layer as paged_attention arguments: query [1, H, D], caches
    [N, Hkv, 16, D] (float16, or K8/V4 with ``bits=(8, 4)``), block table, length."""
    hkv, tokens, head_dim = k.shape
    blocks = -(-tokens // BLOCK_SIZE)

    def cache(x):
        rows = np.zeros((blocks * BLOCK_SIZE, hkv, head_dim), np.float16)
        rows[:tokens] = x.transpose(1, 0, 2)
        return mx.array(rows.reshape(blocks, BLOCK_SIZE, hkv, head_dim).transpose(0, 2, 1, 3))

    kc, vc = cache(k), cache(v)
    if bits:
        group = 64 if head_dim % 64 == 0 else 32
        kc, vc = quant.quantize(kc, bits=bits[0], group_size=group), quant.quantize(vc, bits=bits[1], group_size=group)
    tables = mx.array(np.arange(blocks, dtype=np.int32)[None])
    lens = mx.array([tokens], mx.int32)
    return mx.array(q[None]), kc, vc, tables, lens


def live_bytes(cache, lens=None) -> int:
    """Bytes of the live rows of a one-sequence cache (all its arrays): what exact decode reads."""
    blocks, hkv, block_size, head_dim = cache.shape[0], cache.shape[1], cache.shape[2], cache.shape[-1]
    tokens = blocks * block_size if lens is None else int(np.array(lens).sum())
    if isinstance(cache, quant.QuantizedKV):
        row = quant.row_nbytes(head_dim, bits=cache.bits, group_size=cache.group_size,
                               scale_bytes=cache.scales.itemsize)
    else:
        row = head_dim * cache.itemsize
    return tokens * hkv * row


def _arrays(layer):
    _, kc, vc, tables, lens = layer[0]
    return [a for x in (kc, vc) for a in (x.arrays() if isinstance(x, quant.QuantizedKV) else (x,))]


def _step(layers, tau):
    """One decode step over every layer (their outputs, for mx.eval)."""
    return [ops.paged_attention(*args, scale=scale, softcap=softcap or None, sparse_v=tau, validate=False)
            for args, scale, softcap in layers]


def final_max_skips(q, k, scale, softcap, tau) -> float:
    """Share of (kv head, key) V rows below tau for every query row of the kv head against
    the row's final maximum: what the rule could skip at most."""
    hkv = k.shape[0]
    group = q.shape[0] // hkv
    skipped = 0
    for h in range(hkv):
        s = (q[h * group:(h + 1) * group].astype(np.float64) @ k[h].astype(np.float64).T) * scale
        if softcap:
            s = softcap * np.tanh(s / softcap)
        skipped += int((np.exp(s - s.max(axis=1, keepdims=True)) < tau).all(axis=0).sum())
    return skipped / (hkv * k.shape[1])


def sim_v_bytes(layer, tau) -> tuple[int, int]:
    """(V bytes the sim kernel loads, live V bytes) of one layer's decode."""
    from ..sim import trace

    (query, kc, vc, tables, lens), scale, softcap = layer
    with use_backend("sim"), trace() as t:
        mx.eval(ops.paged_attention(query, kc, vc, tables, lens, scale=scale, softcap=softcap or None, sparse_v=tau))
    call = next(c for c in t.calls if "paged_attention_partials" in c.name)
    loaded = sum(call.buffers[n].loaded for n in ("value_data", "value_scales", "value_biases") if n in call.buffers)
    return loaded, live_bytes(vc, lens)


def run(*, backend, tokens, repeat, baseline, progress, result_row, time_baseline, simulator_missing):
    """The case (cases.py passes its row builders: this module does not import it back)."""
    path = capture_path()
    name = "sparse_v_captured"
    if path is None or not path.is_file():
        return [{"name": name, "backend": backend, "seconds": None, "kv_bytes": None, "gbps": None, "skipped": True,
                 "note": "skipped: no attention capture; make one with `python -m kvmetal.benchmarks."
                         "attention_capture --model default --tokens 8192` (or set KVMETAL_SPARSE_V_CAPTURE)"}]
    meta, rows = load_capture(path)
    context = int(meta["tokens"])
    progress(f"  capture {path.name}: {len(rows)} layers, {meta['tokens']} tokens")
    sample = sim_sample(rows)
    final = [final_max_skips(q, k, scale, softcap, SPARSE_V_TAU) for _, q, k, _, scale, softcap in rows]
    v_rows = [k.shape[0] * k.shape[1] for _, _, k, *_ in rows]  # weights: a layer's share of the V rows

    def skippable(at) -> float:  # V rows the final-max rule skips over layers `at`, as a share of their rows
        return float(np.average([final[i] for i in at], weights=[v_rows[i] for i in at]))

    no_sim = simulator_missing()
    results = []
    for label, bits in (("f16", None), ("k8v4", (8, 4))):
        layers = [(paged_layer(q, k, v, bits=bits), scale, softcap) for _, q, k, v, scale, softcap in rows]
        mx.eval(*[a for layer in layers for a in _arrays(layer)])
        kv_bytes = sum(live_bytes(layer[0][1], layer[0][4]) + live_bytes(layer[0][2], layer[0][4]) for layer in layers)
        with use_backend(backend):
            exact = time_baseline(f"kvmetal paged_attention exact ({backend})", lambda: _step(layers, None), repeat)
            sparse = time_stats(lambda: _step(layers, SPARSE_V_TAU), repeat=repeat)
        extra = {"capture": str(path), "model": meta["model"], "context": meta["tokens"], "layers": len(rows),
                 "tau": SPARSE_V_TAU, "v_rows_skippable_final_max": skippable(range(len(rows)))}
        if no_sim is None:
            progress(f"  {label}: simulator V bytes on layers {sample} ...")
            loaded = live = 0
            for layer_index, layer in zip([r[0] for r in rows], layers):
                if layer_index in sample:
                    a, b = sim_v_bytes(layer, SPARSE_V_TAU)
                    loaded, live = loaded + a, live + b
            at = [i for i, r in enumerate(rows) if r[0] in sample]
            extra.update(sim_layers=sample, sim_v_bytes_per_token=loaded / context,
                         sim_v_bytes_per_token_exact=live / context, sim_v_rows_skipped=1 - loaded / live,
                         v_rows_skippable_final_max_sim_layers=skippable(at))
        else:
            extra["sim_note"] = no_sim
        results.append(result_row(f"{name}_{label} T={context} tau={SPARSE_V_TAU:g}", backend, sparse, kv_bytes,
                               exact, **extra))
    return results
