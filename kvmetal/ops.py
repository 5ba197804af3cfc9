"""Public functional ops: check every argument once, then hand plain arrays to one backend.

Dimension glossary used in shapes below:
    S     sequences in the batch            H    query heads
    Hkv   kv heads (H % Hkv == 0)           D    head_dim
    N     cache blocks                      bs   block_size (tokens per block)
    T     new tokens (writes) or cached tokens (contiguous decode)
    M     max_blocks_per_seq (block table width)

A cache is a float ``mx.array`` [N, Hkv, bs, D] or a :class:`kvmetal.quant.QuantizedKV`
standing for one. Value checks (block ids, slots, lengths) read the index arrays on the
host; ``validate=False`` skips them for callers that build their own tables.
"""
from __future__ import annotations

import math
import numbers

import mlx.core as mx
import numpy as np

from . import backends
from . import quant
from .quant import QuantizedKV

FLOAT_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
INDEX_DTYPES = (mx.int32, mx.int64)
SUPPORTED_HEAD_DIMS = (64, 80, 96, 112, 128, 192, 256)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)


# ----------------------------------------------------------------------------- checks

def _fail(op: str, message: str, error=ValueError):
    raise error(f"[{op}] {message}")


def _dtype_name(dtype) -> str:
    return str(dtype).replace("mlx.core.", "")


def _check_array(op: str, name: str, x, *, ndim: int, dtypes, what: str):
    if not isinstance(x, mx.array):
        _fail(op, f"{name} must be an mx.array {what}, got {type(x).__name__}", TypeError)
    if x.ndim != ndim:
        _fail(op, f"{name} must have rank {ndim} {what}, got shape {tuple(x.shape)}")
    if x.dtype not in dtypes:
        names = ", ".join(_dtype_name(d) for d in dtypes)
        _fail(op, f"{name} must have dtype in ({names}), got {_dtype_name(x.dtype)}", TypeError)


def _check_index(op: str, name: str, x, *, ndim: int, what: str) -> mx.array:
    """Integer index arrays: int32 or int64 accepted, handed to backends as int32."""
    _check_array(op, name, x, ndim=ndim, dtypes=INDEX_DTYPES, what=what)
    return x if x.dtype == mx.int32 else x.astype(mx.int32)


def _check_quantized(op: str, name: str, q: QuantizedKV, ndim: int, what: str):
    quant.check_bits(q.bits, op=op, name=f"{name}.bits")
    quant.check_group_size(q.group_size, op=op, name=f"{name}.group_size")
    _check_array(op, f"{name}.data", q.data, ndim=ndim, dtypes=(mx.uint32,), what=what)
    for part in ("scales", "biases"):
        _check_array(op, f"{name}.{part}", getattr(q, part), ndim=ndim, dtypes=FLOAT_DTYPES, what=what)
    if (q.data.shape[-1] * 32) % q.bits:
        _fail(op, f"{name}.data last axis {q.data.shape[-1]} words do not hold whole {q.bits}-bit values")
    try:
        quant.check_layout(q.head_dim, bits=q.bits, group_size=q.group_size, op=op)
    except ValueError as exc:
        raise ValueError(f"{exc} (in {name})") from None
    lead, groups = tuple(q.data.shape[:-1]), q.head_dim // q.group_size
    for part in ("scales", "biases"):
        arr = getattr(q, part)
        if tuple(arr.shape) != lead + (groups,):
            _fail(op, f"{name}.{part} must have shape {lead + (groups,)}, got {tuple(arr.shape)}")
    if q.biases.dtype != q.scales.dtype:
        _fail(op, f"{name}.biases dtype {_dtype_name(q.biases.dtype)} != scales dtype "
                  f"{_dtype_name(q.scales.dtype)}", TypeError)


def _check_kv_pair(op: str, key_cache, value_cache, *, what: str, paged: bool) -> tuple:
    """Checks a K/V pair (float or quantized, independently); returns the logical shape."""
    for name, cache in (("key_cache" if paged else "keys", key_cache),
                        ("value_cache" if paged else "values", value_cache)):
        if isinstance(cache, QuantizedKV):
            _check_quantized(op, name, cache, 4, what)
        else:
            _check_array(op, name, cache, ndim=4, dtypes=FLOAT_DTYPES, what=what)
    kname, vname = ("key_cache", "value_cache") if paged else ("keys", "values")
    kshape, vshape = tuple(key_cache.shape), tuple(value_cache.shape)
    if kshape != vshape:
        _fail(op, f"{kname} and {vname} must have the same shape, got {kshape} and {vshape}")
    if not isinstance(key_cache, QuantizedKV) and not isinstance(value_cache, QuantizedKV):
        if key_cache.dtype != value_cache.dtype:
            _fail(op, f"{kname} and {vname} must have the same dtype, got "
                      f"{_dtype_name(key_cache.dtype)} and {_dtype_name(value_cache.dtype)}", TypeError)
    head_dim = kshape[3]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        _fail(op, f"head_dim {head_dim} of {kname} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if paged and kshape[2] not in SUPPORTED_BLOCK_SIZES:
        _fail(op, f"block_size {kshape[2]} of {kname} is not supported; supported: {SUPPORTED_BLOCK_SIZES}")
    return kshape


def _check_query_heads(op: str, num_heads: int, num_kv_heads: int):
    if num_heads % num_kv_heads:
        _fail(op, f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")


MAX_QUERY_TOKENS = 8


def _check_query_rows(op: str, num_rows: int):
    if not 1 <= num_rows <= MAX_QUERY_TOKENS:
        _fail(op, f"query must hold 1 to {MAX_QUERY_TOKENS} tokens per sequence, got {num_rows}")


def _multi_query(op: str, name: str, query, *, axis: int):
    """The backend's op for a query with L rows on ``axis``.

    Backends that declare ``MULTI_QUERY`` take the L axis as is; the others only serve
    L = 1 in the one-token layout (query squeezed on the way in, output expanded back).
    """
    backend = backends.get()
    fn = getattr(backend, name)
    if getattr(backend, "MULTI_QUERY", False):
        return fn
    if query.shape[axis] != 1:
        raise NotImplementedError(f"[{op}] the {backends.current_backend()} backend serves one query "
                                  f"token per sequence; got {query.shape[axis]}")
    if axis == 2:  # decode_attention's one-token layout is [B, H, 1, D] already
        return fn
    return lambda q, *args, **kw: fn(q[:, 0], *args, **kw)[:, None]


def _attention_options(op: str, *, head_dim: int, num_heads: int, scale, softcap, sinks,
                       num_splits, sliding_window=None) -> dict:
    if scale is None:
        scale = head_dim ** -0.5
    elif not isinstance(scale, numbers.Real) or not math.isfinite(scale) or scale <= 0:
        _fail(op, f"scale must be a positive finite float, got {scale!r}",
              TypeError if not isinstance(scale, numbers.Real) else ValueError)
    if softcap is not None and (not isinstance(softcap, numbers.Real) or not math.isfinite(softcap) or softcap <= 0):
        _fail(op, f"softcap must be None or a positive finite float, got {softcap!r}")
    if sliding_window is not None and (not isinstance(sliding_window, numbers.Integral) or sliding_window < 1):
        _fail(op, f"sliding_window must be None or an int >= 1, got {sliding_window!r}")
    if num_splits is not None and (not isinstance(num_splits, numbers.Integral) or num_splits < 1):
        _fail(op, f"num_splits must be None or an int >= 1, got {num_splits!r}")
    if sinks is not None:
        _check_array(op, "sinks", sinks, ndim=1, dtypes=FLOAT_DTYPES, what="[H]")
        if sinks.shape[0] != num_heads:
            _fail(op, f"sinks must have one logit per query head ({num_heads}), got shape {tuple(sinks.shape)}")
        sinks = sinks.astype(mx.float32)
    options = dict(scale=float(scale), softcap=None if softcap is None else float(softcap),
                   sinks=sinks, num_splits=None if num_splits is None else int(num_splits))
    if op == "paged_attention":
        options["sliding_window"] = None if sliding_window is None else int(sliding_window)
    return options


def _host(x: mx.array) -> np.ndarray:
    return np.array(x, copy=False) if x.dtype != mx.bfloat16 else np.array(x.astype(mx.float32))


def _check_tables(op: str, block_tables, seq_lens, *, num_blocks: int, block_size: int, validate: bool,
                  min_len: int = 1):
    """Block ids of every used block in range, min_len <= seq_len <= table capacity."""
    if not validate:
        return
    tables, lens = _host(block_tables), _host(seq_lens)
    capacity = tables.shape[1] * block_size
    for s, n in enumerate(lens):
        if n < 1:
            _fail(op, f"seq_lens[{s}] = {n}: every sequence needs at least one cached token")
        if n < min_len:
            _fail(op, f"query holds {min_len} tokens per sequence but seq_lens[{s}] = {n}: the query "
                      f"tokens are the last {min_len} cached positions, so each sequence needs that many")
        if n > capacity:
            _fail(op, f"seq_lens[{s}] = {n} exceeds its block table capacity "
                      f"({tables.shape[1]} blocks x {block_size} = {capacity})")
        used = tables[s, : -(-int(n) // block_size)]
        bad = (used < 0) | (used >= num_blocks)
        if bad.any():
            j = int(np.argmax(bad))
            _fail(op, f"block_tables[{s}, {j}] = {used[j]} is out of range [0, {num_blocks})")


# ----------------------------------------------------------------------------- ops

def reshape_and_cache(key: mx.array, value: mx.array, key_cache, value_cache, slot_mapping: mx.array,
                      *, validate: bool = True):
    """Write new K/V rows into a paged cache (converting or quantizing them).

    Args:
        key, value: [T, Hkv, D] new rows, any float dtype.
        key_cache, value_cache: [N, Hkv, bs, D] float caches or QuantizedKV.
        slot_mapping: int32/int64 [T]; row t goes to slot ``block * bs + offset``;
            a negative slot skips the row (padding). With ``validate=False`` the caller
            vouches for the slots: in range, distinct, and at least one non-negative.
    Returns:
        (key_cache, value_cache): the updated caches. The write is in place when the
        caller holds no other reference to the cache arrays (MLX buffer donation), so
        rebind the results: ``kc, vc = kv.reshape_and_cache(k, v, kc, vc, slots)``.
    """
    op = "reshape_and_cache"
    num_blocks, num_kv_heads, block_size, head_dim = _check_kv_pair(op, key_cache, value_cache,
                                                                    what="[N, Hkv, bs, D]", paged=True)
    for name, rows in (("key", key), ("value", value)):
        _check_array(op, name, rows, ndim=3, dtypes=FLOAT_DTYPES, what="[T, Hkv, D]")
        if tuple(rows.shape[1:]) != (num_kv_heads, head_dim):
            _fail(op, f"{name} must have shape [T, {num_kv_heads}, {head_dim}] to match the cache, "
                      f"got {tuple(rows.shape)}")
    if key.shape != value.shape:
        _fail(op, f"key and value must have the same shape, got {tuple(key.shape)} and {tuple(value.shape)}")
    slot_mapping = _check_index(op, "slot_mapping", slot_mapping, ndim=1, what="[T]")
    if slot_mapping.shape[0] != key.shape[0]:
        _fail(op, f"slot_mapping must have one slot per token ({key.shape[0]}), got {slot_mapping.shape[0]}")
    if validate:
        slots = _host(slot_mapping)
        live = slots[slots >= 0]
        num_slots = num_blocks * block_size
        if live.size and live.max() >= num_slots:
            t = int(np.argmax(slots >= num_slots))
            _fail(op, f"slot_mapping[{t}] = {slots[t]} is out of range [0, {num_slots})")
        if np.unique(live).size != live.size:
            _fail(op, "slot_mapping writes the same slot twice; each slot takes one token")
        if live.size == 0:  # all padding: nothing to write
            return key_cache, value_cache
    return backends.get().reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


def paged_attention(query: mx.array, key_cache, value_cache, block_tables: mx.array, seq_lens: mx.array,
                    *, scale: float | None = None, softcap: float | None = None,
                    sliding_window: int | None = None, sinks: mx.array | None = None,
                    num_splits: int | None = None, validate: bool = True) -> mx.array:
    """Decode attention of the last 1-8 tokens of each sequence over a paged KV cache.

    Args:
        query: [S, H, D] float (one token per sequence) or [S, L, H, D] with 1 <= L <= 8:
            the last L cached positions of each sequence (already written), each attending
            causally: row ``l`` sits at position ``seq_len - L + l``.
        key_cache, value_cache: [N, Hkv, bs, D] float caches or QuantizedKV.
        block_tables: int32 [S, M]; entries past a sequence's last used block are never read.
        seq_lens: int32 [S]; cached tokens per sequence, the current token included.
        scale: score scale, default ``D ** -0.5``.
        softcap: scores become ``softcap * tanh(s / softcap)``.
        sliding_window: a query sees only the last ``sliding_window`` tokens.
        sinks: float [H], one logit per query head joining the softmax denominator.
        num_splits: KV splits per (sequence, kv head); None lets the backend choose.
    Returns:
        The query's shape ([S, H, D] or [S, L, H, D]) in the query's dtype.
    """
    op = "paged_attention"
    num_blocks, num_kv_heads, block_size, head_dim = _check_kv_pair(op, key_cache, value_cache,
                                                                    what="[N, Hkv, bs, D]", paged=True)
    if isinstance(query, mx.array) and query.ndim not in (3, 4):
        _fail(op, f"query must have rank 3 [S, H, D] or rank 4 [S, L, H, D], got shape {tuple(query.shape)}")
    four_d = isinstance(query, mx.array) and query.ndim == 4
    _check_array(op, "query", query, ndim=4 if four_d else 3, dtypes=FLOAT_DTYPES,
                 what="[S, L, H, D]" if four_d else "[S, H, D]")
    num_seqs, num_rows, num_heads, q_dim = query.shape if four_d else (query.shape[0], 1, *query.shape[1:])
    _check_query_rows(op, num_rows)
    if q_dim != head_dim:
        _fail(op, f"query head_dim {q_dim} does not match the cache head_dim {head_dim}")
    _check_query_heads(op, num_heads, num_kv_heads)
    block_tables = _check_index(op, "block_tables", block_tables, ndim=2, what="[S, M]")
    seq_lens = _check_index(op, "seq_lens", seq_lens, ndim=1, what="[S]")
    if block_tables.shape[0] != num_seqs or seq_lens.shape[0] != num_seqs:
        _fail(op, f"block_tables {tuple(block_tables.shape)} and seq_lens {tuple(seq_lens.shape)} "
                  f"must have one row per query sequence ({num_seqs})")
    options = _attention_options(op, head_dim=head_dim, num_heads=num_heads, scale=scale, softcap=softcap,
                                 sinks=sinks, num_splits=num_splits, sliding_window=sliding_window)
    _check_tables(op, block_tables, seq_lens, num_blocks=num_blocks, block_size=block_size, validate=validate,
                  min_len=num_rows)
    rows = query if query.ndim == 4 else query[:, None]
    out = _multi_query(op, "paged_attention", rows, axis=1)(rows, key_cache, value_cache, block_tables,
                                                              seq_lens, **options)
    return out if query.ndim == 4 else out[:, 0]


def gather_kv_cache(key_cache, value_cache, block_tables: mx.array, seq_lens: mx.array, *,
                    max_len: int | None = None, validate: bool = True):
    """Copy each sequence's K/V rows out of a paged cache into contiguous arrays.

    Returns:
        (keys, values): [S, Hkv, max_len, D] in the cache's float dtype (a quantized cache
        is dequantized). ``max_len`` defaults to ``M * bs``; rows past ``seq_len`` are zero
        and tokens past ``max_len`` are not returned.
    """
    op = "gather_kv_cache"
    num_blocks, _, block_size, _ = _check_kv_pair(op, key_cache, value_cache, what="[N, Hkv, bs, D]", paged=True)
    block_tables = _check_index(op, "block_tables", block_tables, ndim=2, what="[S, M]")
    seq_lens = _check_index(op, "seq_lens", seq_lens, ndim=1, what="[S]")
    if seq_lens.shape[0] != block_tables.shape[0]:
        _fail(op, f"seq_lens must have one entry per block_tables row ({block_tables.shape[0]}), "
                  f"got {seq_lens.shape[0]}")
    if max_len is None:
        max_len = block_tables.shape[1] * block_size
    elif not isinstance(max_len, numbers.Integral) or max_len < 1:
        _fail(op, f"max_len must be None or an int >= 1, got {max_len!r}")
    _check_tables(op, block_tables, seq_lens, num_blocks=num_blocks, block_size=block_size, validate=validate)
    return backends.get().gather_kv_cache(key_cache, value_cache, block_tables, seq_lens, max_len=int(max_len))


def decode_attention(query: mx.array, keys, values, *, scale: float | None = None,
                     softcap: float | None = None, sinks: mx.array | None = None,
                     num_splits: int | None = None) -> mx.array:
    """Split-KV decode over a contiguous cache, in ``mx.fast.scaled_dot_product_attention`` layout.

    Args:
        query: [B, H, L, D] float, 1 <= L <= 8; row ``l`` sees keys ``t <= T - L + l`` (the
            bottom-right-aligned causal mask of ``mask="causal"``).
        keys, values: [B, Hkv, T, D] float (strided views are read in place) or QuantizedKV.
    Returns:
        [B, H, L, D] in the query's dtype.
    """
    op = "decode_attention"
    batch, num_kv_heads, num_tokens, head_dim = _check_kv_pair(op, keys, values, what="[B, Hkv, T, D]",
                                                               paged=False)
    _check_array(op, "query", query, ndim=4, dtypes=FLOAT_DTYPES, what="[B, H, L, D]")
    if query.shape[0] != batch or query.shape[3] != head_dim:
        _fail(op, f"query must have shape [{batch}, H, L, {head_dim}] to match keys, got {tuple(query.shape)}")
    _check_query_rows(op, query.shape[2])
    if num_tokens < 1:
        _fail(op, "keys must hold at least one token (T >= 1)")
    if query.shape[2] > num_tokens:
        _fail(op, f"query holds {query.shape[2]} tokens but keys only {num_tokens}: the query tokens are "
                  f"the last L positions of keys, so L <= T")
    _check_query_heads(op, query.shape[1], num_kv_heads)
    options = _attention_options(op, head_dim=head_dim, num_heads=query.shape[1], scale=scale,
                                 softcap=softcap, sinks=sinks, num_splits=num_splits)
    return _multi_query(op, "decode_attention", query, axis=2)(query, keys, values, **options)


def copy_blocks(key_cache, value_cache, src: mx.array, dst: mx.array, *, validate: bool = True):
    """Copy whole blocks (every kv head): block ``src[i]`` -> block ``dst[i]``.

    Every copy reads the caches as they were before the call; ``dst`` entries must be
    distinct and must not also appear in ``src``.
    """
    op = "copy_blocks"
    num_blocks = _check_kv_pair(op, key_cache, value_cache, what="[N, Hkv, bs, D]", paged=True)[0]
    src = _check_index(op, "src", src, ndim=1, what="[n]")
    dst = _check_index(op, "dst", dst, ndim=1, what="[n]")
    if src.shape != dst.shape:
        _fail(op, f"src and dst must have the same length, got {src.shape[0]} and {dst.shape[0]}")
    if validate:
        s, d = _host(src), _host(dst)
        for name, ids in (("src", s), ("dst", d)):
            bad = (ids < 0) | (ids >= num_blocks)
            if bad.any():
                i = int(np.argmax(bad))
                _fail(op, f"{name}[{i}] = {ids[i]} is out of range [0, {num_blocks})")
        if np.unique(d).size != d.size:
            _fail(op, "dst names the same block twice")
        if np.intersect1d(s, d).size:
            _fail(op, "a block appears in both src and dst")
    return backends.get().copy_blocks(key_cache, value_cache, src, dst)
