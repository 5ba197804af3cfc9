"""NumPy float64 oracles, one per op, written from the definitions in docs/design.md.

They walk the block table token by token, so they read nothing a sequence does
not own: NaN-poisoned unused cache slots never reach an oracle's output.
Inputs may be ``mx.array``, NumPy arrays or ``QuantizedKV``; outputs are NumPy
float64 (caches keep their own layout).
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

from .quant import QuantizedKV, dequantize_reference


def to_f64(x) -> np.ndarray:
    """A float64 NumPy copy of an array, or of the float cache a QuantizedKV stands for."""
    if isinstance(x, QuantizedKV):
        return dequantize_reference(x)
    if isinstance(x, mx.array):
        return np.array(x.astype(mx.float32), dtype=np.float64)
    return np.asarray(x, dtype=np.float64)


def to_int(x) -> np.ndarray:
    return np.array(x, dtype=np.int64)


# Sparse-V oracles classify a key as skippable with tau times this margin, so float32
# rounding of a kernel's scores cannot make it skip a key the bound leaves out.
SPARSE_V_BOUND_MARGIN = 1.05
# Sparse V's seeds besides the first key: the newest keys (sparse_v_seeds). 31 + 1 = 32
# seeds reach 0.97 of the final-max skip rate on Gemma-3-270M at 8K (2 seeds: 0.49;
# bench/sparse_v_seed_study.py); the kernels score them once per split, cooperatively.
SPARSE_V_RECENT_SEEDS = 31


def attend(q, keys, values, *, scale, softcap=None, sink=None, sparse_v=None, bound=None) -> np.ndarray:
    """Softmax attention of one query row over ``keys``/``values`` [T, D] in float64.

    ``sparse_v=tau``: keys whose weight relative to the row's maximum score,
    ``exp(s - max s)``, is below tau are left out of the numerator (their weight stays
    in the denominator). A kernel compares against its running maximum, seeded by real
    scores (:func:`sparse_v_seeds`) and so never above the final one: it skips a subset
    of these keys, and a superset of :func:`sparse_v_sure_skips`. ``bound`` (a one-element
    list) receives the sparse-V error bound of the row: the weight of the keys below
    ``tau * SPARSE_V_BOUND_MARGIN`` over the denominator, times max |v| of the row's keys.
    """
    scores = (keys @ q) * scale
    if softcap is not None:
        scores = softcap * np.tanh(scores / softcap)
    m = scores.max() if scores.size else -math.inf
    top = m
    if sink is not None:
        m = max(m, sink)
    weights = np.exp(scores - m)
    denom = weights.sum() + (math.exp(sink - m) if sink is not None else 0.0)
    if bound is not None and sparse_v:
        below = np.exp(scores - top) < (sparse_v or 0.0) * SPARSE_V_BOUND_MARGIN
        bound[0] = weights[below].sum() / denom * (np.abs(values).max() if values.size else 0.0)
    if sparse_v:
        weights = np.where(np.exp(scores - top) < sparse_v, 0.0, weights)
    return (weights @ values) / denom


def sparse_v_seeds(seq_len: int, query_len: int = 1, sliding_window=None) -> tuple:
    """The keys whose scores seed a sparse-V kernel's running max (docs/kernels.md,
    "Sparse V"): the first key the first query row sees (an attention sink in most
    models) and the SPARSE_V_RECENT_SEEDS newest keys every row sees (ending at
    ``seq_len - query_len``: a decode row's largest scores sit mostly among its newest
    keys); each row uses the seeds it sees."""
    newest = seq_len - query_len
    first = 0 if sliding_window is None else max(0, newest + 1 - sliding_window)
    recent = range(max(first, newest - SPARSE_V_RECENT_SEEDS + 1), newest + 1)
    return tuple(sorted({t for t in (first, *recent) if 0 <= t < seq_len}))


def sparse_v_sure_skips(query, key_cache, block_tables, seq_lens, *, sparse_v, scale=None, softcap=None,
                        sliding_window=None) -> list:
    """The V rows every seeded sparse-V kernel skips: per sequence, bool [Hkv, seq_len].

    A kernel's running max is at least the best seed score a row sees, so key t is
    skipped for a row when ``exp(s_t - seed max) < tau / SPARSE_V_BOUND_MARGIN`` (the
    margin covers float32 scores), and its V row is never read when that holds for every
    query row of its kv head that sees it (a key no row sees is never read either).
    ``query`` [S, H, D] or [S, L, H, D], as :func:`paged_attention`.
    """
    q = to_f64(query)
    if q.ndim == 3:
        q = q[:, None]
    kc = to_f64(key_cache)
    tables, lens = to_int(block_tables), to_int(seq_lens)
    num_rows, num_heads, head_dim = q.shape[1], q.shape[2], q.shape[3]
    group = num_heads // kc.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale
    out = []
    for s in range(q.shape[0]):
        n = int(lens[s])
        keys = sequence_rows(kc, tables[s], n)
        seeds = sparse_v_seeds(n, num_rows, sliding_window)
        sure = np.ones((kc.shape[1], n), dtype=bool)
        for i in range(num_rows):
            last = n - num_rows + i
            if last < 0:
                continue
            first = 0 if sliding_window is None else max(0, last + 1 - sliding_window)
            seen = [t for t in seeds if first <= t <= last]
            for h in range(num_heads):
                scores = (keys[h // group, first:last + 1] @ q[s, i, h]) * scale
                if softcap is not None:
                    scores = softcap * np.tanh(scores / softcap)
                top = scores[[t - first for t in seen]].max() if seen else -math.inf  # no seed: no sure skip
                below = np.exp(scores - top) < sparse_v / SPARSE_V_BOUND_MARGIN
                sure[h // group, first:last + 1] &= below
        out.append(sure)
    return out


def sequence_rows(cache: np.ndarray, block_table, seq_len: int) -> np.ndarray:
    """The ``seq_len`` rows of one sequence: [Hkv, seq_len, D], read token by token."""
    block_size = cache.shape[2]
    rows = [cache[block_table[t // block_size], :, t % block_size, :] for t in range(seq_len)]
    if not rows:  # an empty sequence (seq_len 0): no rows, nothing attended
        return np.zeros((cache.shape[1], 0, cache.shape[3]), dtype=cache.dtype)
    return np.stack(rows, axis=1)


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, *,
                    scale=None, softcap=None, sliding_window=None, sinks=None, sparse_v=None,
                    with_bound=False):
    """query [S, H, D] or [S, L, H, D] -> the same shape.

    The L query rows of a sequence are its last L cached positions: row ``l`` sits at
    ``p = seq_len - L + l`` and sees positions ``t <= p`` (and ``t > p - sliding_window``).
    A row that sees no token (seq_len 0, or L > seq_len) outputs zeros, sinks or not.
    ``sparse_v``: see :func:`attend`. ``with_bound=True`` returns ``(out, bound)``, bound
    [S, (L,) H]: each row's sparse-V error bound (:func:`attend`).
    """
    q = to_f64(query)
    single = q.ndim == 3
    if single:
        q = q[:, None]
    kc, vc = to_f64(key_cache), to_f64(value_cache)
    tables, lens = to_int(block_tables), to_int(seq_lens)
    sink_logits = None if sinks is None else to_f64(sinks)
    num_seqs, head_dim = q.shape[0], q.shape[-1]
    scale = head_dim ** -0.5 if scale is None else scale
    out = np.zeros_like(q)
    bounds = np.zeros(q.shape[:-1])
    for s in range(num_seqs):
        out[s] = _last_rows(q[s], kc, vc, tables[s], lens[s], scale=scale, softcap=softcap,
                            sliding_window=sliding_window, sink_logits=sink_logits, sparse_v=sparse_v,
                            bounds=bounds[s])
    if single:
        out, bounds = out[:, 0], bounds[:, 0]
    return (out, bounds) if with_bound else out


def _last_rows(q, kc, vc, table, seq_len, *, scale, softcap, sliding_window, sink_logits, sparse_v=None,
               bounds=None) -> np.ndarray:
    """One sequence's query rows q [n, H, D] as its last n cached positions, each
    attending causally (and within the window); rows that see nothing stay zero.
    ``bounds`` [n, H], if given, receives each row's sparse-V error bound."""
    num_rows, num_heads = q.shape[0], q.shape[1]
    group = num_heads // kc.shape[1]
    keys, values = sequence_rows(kc, table, seq_len), sequence_rows(vc, table, seq_len)
    out = np.zeros_like(q)
    for i in range(num_rows):
        last = int(seq_len) - num_rows + i          # this row's own position
        if last < 0:
            continue
        first = 0 if sliding_window is None else max(0, last + 1 - sliding_window)
        for h in range(num_heads):
            bound = [0.0]
            out[i, h] = attend(q[i, h], keys[h // group, first:last + 1], values[h // group, first:last + 1],
                               scale=scale, softcap=softcap, sink=None if sink_logits is None else sink_logits[h],
                               sparse_v=sparse_v, bound=bound)
            if bounds is not None:
                bounds[i, h] = bound[0]
    return out


def paged_attention_varlen(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *,
                           scale=None, softcap=None, sliding_window=None, sinks=None) -> np.ndarray:
    """query [T, H, D] -> [T, H, D].

    Sequence ``s`` owns query rows ``[qsl[s], qsl[s + 1])``: its last ``n_s`` cached
    positions. Row ``i`` of the run sits at ``p = seq_len - n_s + i`` and sees positions
    ``t <= p`` (and ``t > p - sliding_window``). A row that sees no token outputs zeros.
    """
    q = to_f64(query)
    kc, vc = to_f64(key_cache), to_f64(value_cache)
    tables, lens, starts = to_int(block_tables), to_int(seq_lens), to_int(query_start_loc)
    sink_logits = None if sinks is None else to_f64(sinks)
    head_dim = q.shape[2]
    scale = head_dim ** -0.5 if scale is None else scale
    out = np.zeros_like(q)
    for s in range(tables.shape[0]):
        first_row, num_rows = int(starts[s]), int(starts[s + 1] - starts[s])
        if num_rows == 0:
            continue
        out[first_row:first_row + num_rows] = _last_rows(
            q[first_row:first_row + num_rows], kc, vc, tables[s], lens[s], scale=scale, softcap=softcap,
            sliding_window=sliding_window, sink_logits=sink_logits)
    return out


def paged_attention_cascade(query, key_cache, value_cache, prefix_block_tables, prefix_lens, prefix_of,
                            block_tables, seq_lens, *, scale=None, softcap=None, sinks=None, sparse_v=None,
                            with_bound=False):
    """query [S, H, D] -> [S, H, D]: sequence s attends to its prefix's
    ``prefix_lens[prefix_of[s]]`` tokens (none for prefix_of -1) followed by its own
    ``seq_lens[s]`` tokens, i.e. one query row at the end of the concatenated token list.
    The oracle concatenates the two token lists and runs the per-sequence oracle on them.
    ``sparse_v``/``with_bound`` as in :func:`paged_attention` (bound [S, H])."""
    q = to_f64(query)
    kc, vc = to_f64(key_cache), to_f64(value_cache)
    ptables, plens, owner = to_int(prefix_block_tables), to_int(prefix_lens), to_int(prefix_of)
    tables, lens = to_int(block_tables), to_int(seq_lens)
    sink_logits = None if sinks is None else to_f64(sinks)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    block_size = kc.shape[2]
    out = np.zeros_like(q)
    bounds = np.zeros(q.shape[:-1])
    for s in range(q.shape[0]):
        # Token t of the concatenation, as (block id, offset): prefix tokens, then own ones.
        tokens = [] if owner[s] < 0 else [(ptables[owner[s], t // block_size], t % block_size)
                                          for t in range(plens[owner[s]])]
        tokens += [(tables[s, t // block_size], t % block_size) for t in range(lens[s])]
        # One block per token: the per-sequence oracle walks this table token by token.
        flat_k = np.stack([kc[b, :, o] for b, o in tokens])[:, :, None] if tokens else kc[:0]
        flat_v = np.stack([vc[b, :, o] for b, o in tokens])[:, :, None] if tokens else vc[:0]
        out[s] = _last_rows(q[s][None], flat_k, flat_v, np.arange(len(tokens)), len(tokens), scale=scale,
                            softcap=softcap, sliding_window=None, sink_logits=sink_logits, sparse_v=sparse_v,
                            bounds=bounds[s][None])[0]
    return (out, bounds) if with_bound else out


def decode_attention(query, keys, values, *, scale=None, softcap=None, sinks=None, sparse_v=None,
                     with_bound=False):
    """query [B, H, L, D], keys/values [B, Hkv, T, D] -> [B, H, L, D].

    Bottom-right-aligned causal mask (``mx.fast.scaled_dot_product_attention(mask="causal")``):
    query row ``l`` sees keys ``t <= T - L + l``. ``sparse_v``/``with_bound`` as in
    :func:`paged_attention` (bound [B, H, L]).
    """
    q, k, v = to_f64(query), to_f64(keys), to_f64(values)
    batch, num_heads, num_rows, head_dim = q.shape
    num_tokens = k.shape[2]
    group = num_heads // k.shape[1]
    scale = head_dim ** -0.5 if scale is None else scale
    sink_logits = None if sinks is None else to_f64(sinks)
    out = np.zeros_like(q)
    bounds = np.zeros(q.shape[:-1])
    for b in range(batch):
        for h in range(num_heads):
            for l in range(num_rows):
                visible = num_tokens - num_rows + l + 1
                if visible < 1:
                    continue
                bound = [0.0]
                out[b, h, l] = attend(q[b, h, l], k[b, h // group, :visible], v[b, h // group, :visible],
                                      scale=scale, softcap=softcap,
                                      sink=None if sink_logits is None else sink_logits[h], sparse_v=sparse_v,
                                      bound=bound)
                bounds[b, h, l] = bound[0]
    return (out, bounds) if with_bound else out


def gather_kv_cache(key_cache, value_cache, block_tables, seq_lens, *, max_len=None):
    """[S, Hkv, max_len, D] each; rows past seq_len (all of them for seq_len 0) are zero."""
    kc, vc = to_f64(key_cache), to_f64(value_cache)
    tables, lens = to_int(block_tables), to_int(seq_lens)
    num_seqs = tables.shape[0]
    max_len = tables.shape[1] * kc.shape[2] if max_len is None else max_len
    outs = []
    for cache in (kc, vc):
        out = np.zeros((num_seqs, cache.shape[1], max_len, cache.shape[3]))
        for s in range(num_seqs):
            n = min(lens[s], max_len)
            out[s, :, :n] = sequence_rows(cache, tables[s], n)
        outs.append(out)
    return tuple(outs)


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Float caches only: the caches with each new row written at its slot (float64)."""
    k, v = to_f64(key), to_f64(value)
    kc, vc = to_f64(key_cache).copy(), to_f64(value_cache).copy()
    block_size = kc.shape[2]
    for t, slot in enumerate(to_int(slot_mapping)):
        if slot < 0:
            continue
        kc[slot // block_size, :, slot % block_size] = k[t]
        vc[slot // block_size, :, slot % block_size] = v[t]
    return kc, vc


def copy_blocks(key_cache, value_cache, src, dst):
    """Every copy reads the caches as they were before the call."""
    kc, vc = to_f64(key_cache), to_f64(value_cache)
    new_k, new_v = kc.copy(), vc.copy()
    for s, d in zip(to_int(src), to_int(dst)):
        new_k[d] = kc[s]
        new_v[d] = vc[s]
    return new_k, new_v
