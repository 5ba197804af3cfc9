"""Public functional ops: check every argument once, then hand plain arrays to one backend.

Dimension glossary used in shapes below:
    S     sequences in the batch            H    query heads
    Hkv   kv heads (H % Hkv == 0)           D    head_dim
    N     cache blocks                      bs   block_size (tokens per block)
    T     new tokens (writes) or cached tokens (contiguous decode)
    M     max_blocks_per_seq (block table width)

A cache is a float ``mx.array`` [N, Hkv, bs, D] or a :class:`kvmetal.quant.QuantizedKV`
standing for one. Value checks (block ids, slots, lengths) read the index arrays on the
host, before any cast; ``validate=False`` skips only them, for callers that build their
own tables. Even then nothing can crash or touch memory outside the caches: int64
indices are cast to int32 saturating (a value that does not fit stays out of range
instead of wrapping onto a valid one), and the kernels treat an out-of-range slot as a
skipped row and an out-of-range block id or length as padding.
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
SUPPORTED_HEAD_DIMS = (32, 48, 64, 72, 80, 96, 112, 128, 192, 256, 512)
SUPPORTED_BLOCK_SIZES = (8, 16, 32)
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
# The float32 range a scale or softcap must fall in: a value outside it would reach the
# kernels as 0 (softcap 0 means "off"), a denormal (flushed to 0 on GPUs) or inf.
FLOAT32_TINY, FLOAT32_MAX = float(np.finfo(np.float32).tiny), float(np.finfo(np.float32).max)


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
    """Integer index arrays: int32 or int64 accepted (values are checked before any cast)."""
    _check_array(op, name, x, ndim=ndim, dtypes=INDEX_DTYPES, what=what)
    return x


def _as_int32(x: mx.array) -> mx.array:
    """int32 for the backends. int64 saturates: 2**32 + 5 becomes INT32_MAX (out of range,
    so a kernel skips it) instead of wrapping to 5, and a large negative value stays negative."""
    if x.dtype == mx.int32:
        return x
    return mx.clip(x, INT32_MIN, INT32_MAX).astype(mx.int32)


def _check_validate(op: str, validate):
    if not isinstance(validate, (bool, np.bool_)):
        _fail(op, f"validate must be True or False, got {validate!r}", TypeError)


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def _is_real(value) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))


def _float32_positive(op: str, name: str, value) -> float:
    """A positive finite float that float32 holds as a normal number (else an error naming it)."""
    what = f"{name} must be None or a positive finite float"
    if not _is_real(value):
        _fail(op, f"{what}, got {value!r}", TypeError)
    if not math.isfinite(value) or value <= 0:
        _fail(op, f"{what}, got {value!r}")
    if not FLOAT32_TINY <= value <= FLOAT32_MAX:
        with np.errstate(over="ignore"):
            reached = float(np.float32(value))
        _fail(op, f"{what} representable in float32 (between {FLOAT32_TINY:.3g} and {FLOAT32_MAX:.3g}): "
                  f"{value!r} would reach the kernels as {reached!r}")
    return float(value)


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
    """Checks a K/V pair (float or quantized, independently); returns the logical shape.

    A paged cache needs at least one block; every cache needs at least one kv head."""
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
    if kshape[1] == 0:
        _fail(op, f"{kname} must have at least one kv head, got shape {kshape}")
    if paged and kshape[0] == 0:
        _fail(op, f"{kname} must have at least one block, got shape {kshape}")
    head_dim = kshape[3]
    if head_dim not in SUPPORTED_HEAD_DIMS:
        _fail(op, f"head_dim {head_dim} of {kname} is not supported; supported: {SUPPORTED_HEAD_DIMS}")
    if paged and kshape[2] not in SUPPORTED_BLOCK_SIZES:
        _fail(op, f"block_size {kshape[2]} of {kname} is not supported; supported: {SUPPORTED_BLOCK_SIZES}")
    return kshape


def _check_query_heads(op: str, num_heads: int, num_kv_heads: int):
    if num_heads == 0:
        _fail(op, "query must have at least one head, got 0")
    if num_heads % num_kv_heads:
        _fail(op, f"query heads ({num_heads}) must be a multiple of kv heads ({num_kv_heads})")


MAX_QUERY_TOKENS = backends.MAX_QUERY_TOKENS


def _check_query_rows(op: str, num_rows: int):
    if not 1 <= num_rows <= MAX_QUERY_TOKENS:
        _fail(op, f"query must hold 1 to {MAX_QUERY_TOKENS} tokens per sequence, got {num_rows}")


def _int_option(op: str, name: str, value, *, minimum: int) -> int | None:
    if value is None:
        return None
    if not _is_int(value) or value < minimum:
        _fail(op, f"{name} must be None or an int >= {minimum}, got {value!r}")
    return int(value)


def _sliding_window(op: str, sliding_window, *, max_tokens: int) -> int | None:
    """A checked window; one of at least ``max_tokens`` (the table's capacity) hides nothing
    and is passed on as None."""
    sliding_window = _int_option(op, "sliding_window", sliding_window, minimum=1)
    return None if sliding_window is None or sliding_window >= max_tokens else sliding_window


def sparse_v_threshold(op: str, value) -> float | None:
    """The checked sparse-V threshold: None for exact attention (None or 0), else tau as a
    float with FLOAT32_TINY <= tau < 1 (a smaller tau would reach a GPU as 0 anyway)."""
    if value is None:
        return None
    if not _is_real(value):
        _fail(op, f"sparse_v must be None or a float in [0, 1), got {value!r}", TypeError)
    value = float(value)
    if value == 0.0:
        return None
    if not (FLOAT32_TINY <= value < 1.0):  # NaN, negative, >= 1, or below float32's normal range
        _fail(op, f"sparse_v must be None, 0 or a float in [{FLOAT32_TINY:.3g}, 1), got {value!r}")
    return value


def _attention_options(op: str, *, head_dim: int, num_heads: int, scale, softcap, sinks,
                       num_splits, max_splits: int) -> dict:
    """Checked options for the backends.

    ``num_splits`` above ``max_splits`` (one split per token the cache can hold: more
    splits would be empty on any backend) is clamped to it, so an absurd count cannot
    size the partials beyond a small multiple of the cache. Backends may use fewer."""
    scale = head_dim ** -0.5 if scale is None else _float32_positive(op, "scale", scale)
    if softcap is not None:
        softcap = _float32_positive(op, "softcap", softcap)
    num_splits = _int_option(op, "num_splits", num_splits, minimum=1)
    if num_splits is not None:
        num_splits = min(num_splits, max(1, max_splits))
    if sinks is not None:
        _check_array(op, "sinks", sinks, ndim=1, dtypes=FLOAT_DTYPES, what="[H]")
        if sinks.shape[0] != num_heads:
            _fail(op, f"sinks must have one logit per query head ({num_heads}), got shape {tuple(sinks.shape)}")
        sinks = sinks.astype(mx.float32)
    return dict(scale=float(scale), softcap=softcap, sinks=sinks, num_splits=num_splits)


def _host(x: mx.array) -> np.ndarray:
    return np.array(x, copy=False) if x.dtype != mx.bfloat16 else np.array(x.astype(mx.float32))


def _check_tables(op: str, block_tables, seq_lens, *, num_blocks: int, block_size: int, validate: bool,
                  min_len: int = 1, names: tuple = ("block_tables", "seq_lens")):
    """Block ids of every used block in range, seq_len == 0 (an empty batch slot) or
    min_len <= seq_len <= table capacity (on the caller's values, int64 included, before
    any cast). ``names``: the (table, lengths) arguments the errors name."""
    if not validate:
        return
    tname, lname = names
    tables, lens = _host(block_tables), _host(seq_lens).astype(np.int64)
    capacity = tables.shape[1] * block_size
    for s in np.flatnonzero(((lens != 0) & (lens < max(1, min_len))) | (lens > capacity))[:1]:
        n = lens[s]
        if n < 0:
            _fail(op, f"{lname}[{s}] = {n}: a length must be >= 0")
        if n < min_len:
            _fail(op, f"query holds {min_len} tokens per sequence but {lname}[{s}] = {n}: the query "
                      f"tokens are the last {min_len} cached positions, so each sequence needs that many")
        _fail(op, f"{lname}[{s}] = {n} exceeds its block table capacity "
                  f"({tname} has {tables.shape[1]} blocks per row x {block_size} = {capacity})")
    used = np.arange(tables.shape[1])[None, :] < (-(-lens // block_size))[:, None]
    bad = used & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        s, j = (int(i) for i in np.argwhere(bad)[0])
        _fail(op, f"{tname}[{s}, {j}] = {tables[s, j]} is out of range [0, {num_blocks})")


# ----------------------------------------------------------------------------- ops

def reshape_and_cache(key: mx.array, value: mx.array, key_cache, value_cache, slot_mapping: mx.array,
                      *, validate: bool = True):
    """Write new K/V rows into a paged cache (converting or quantizing them).

    Args:
        key, value: [T, Hkv, D] new rows, any float dtype.
        key_cache, value_cache: [N, Hkv, bs, D] float caches or QuantizedKV.
        slot_mapping: int32/int64 [T]; row t goes to slot ``block * bs + offset``;
            a negative slot skips the row (padding). ``validate=True`` checks every slot
            (int64 ones before the cast) and rejects a slot written twice. With
            ``validate=False`` the caller vouches for the slots; a slot out of range is
            then skipped by the kernel, never written; a slot given twice gets unspecified
            contents (one of the rows, or a mix of them).
    Returns:
        (key_cache, value_cache): the updated caches. The write is in place when the
        caller holds no other reference to the cache arrays (MLX buffer donation), so
        rebind the results: ``kc, vc = kv.reshape_and_cache(k, v, kc, vc, slots)``.
    """
    op = "reshape_and_cache"
    _check_validate(op, validate)
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
    if key.shape[0] == 0:
        return key_cache, value_cache
    return backends.get().reshape_and_cache(key, value, key_cache, value_cache, _as_int32(slot_mapping))


def paged_attention(query: mx.array, key_cache, value_cache, block_tables: mx.array, seq_lens: mx.array,
                    *, scale: float | None = None, softcap: float | None = None,
                    sliding_window: int | None = None, sinks: mx.array | None = None,
                    num_splits: int | None = None, sparse_v: float | None = None,
                    validate: bool = True) -> mx.array:
    """Decode attention of the last 1-8 tokens of each sequence over a paged KV cache.

    Args:
        query: [S, H, D] float (one token per sequence) or [S, L, H, D] with 1 <= L <= 8:
            the last L cached positions of each sequence (already written), each attending
            causally: row ``l`` sits at position ``seq_len - L + l``.
        key_cache, value_cache: [N, Hkv, bs, D] float caches or QuantizedKV.
        block_tables: int32/int64 [S, M]; entries past a sequence's last used block are never read.
        seq_lens: int32/int64 [S]; cached tokens per sequence, the current token included.
        scale: score scale, default ``D ** -0.5``; must be a normal float32 number.
        softcap: scores become ``softcap * tanh(s / softcap)``; must be a normal float32 number.
        sliding_window: a query sees only the last ``sliding_window`` tokens.
        sinks: float [H], one logit per query head joining the softmax denominator.
        num_splits: KV splits per (sequence, kv head); None lets the backend choose. A count
            above one split per token of the table (M * bs) is clamped to that (more would be
            empty); a backend may use fewer (the cpu one, one per tile of up to 32 tokens).
        sparse_v: None or 0 (default): exact. A float tau in (0, 1): a key whose weight
            relative to the running maximum, ``exp(s - m_running)``, is below tau for a query
            row is not accumulated into that row (its weight stays in the denominator), and
            its V row is not loaded when no row of the threadgroup (metal) or tile (cpu) needs
            it. Error per output row <= (skipped weight / softmax denominator) * max|v|
            (docs/kernels.md, "Sparse V").
        validate: check block ids and lengths on the host (before any cast). With
            ``validate=False`` the kernels treat a block id outside [0, N) as padding (its
            tokens are not attended) and clamp a length to [0, M * bs].
    Returns:
        The query's shape ([S, H, D] or [S, L, H, D]) in the query's dtype.
    """
    op = "paged_attention"
    _check_validate(op, validate)
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
    max_blocks = block_tables.shape[1]
    options = _attention_options(op, head_dim=head_dim, num_heads=num_heads, scale=scale, softcap=softcap,
                                 sinks=sinks, num_splits=num_splits, max_splits=max_blocks * block_size)
    options["sliding_window"] = _sliding_window(op, sliding_window, max_tokens=max_blocks * block_size)
    tau = sparse_v_threshold(op, sparse_v)
    if tau is not None:  # only then: a backend without the option fails loudly instead of running exact
        options["sparse_v"] = tau
    _check_tables(op, block_tables, seq_lens, num_blocks=num_blocks, block_size=block_size, validate=validate,
                  min_len=num_rows)
    if num_seqs == 0:
        return mx.zeros(query.shape, query.dtype)
    rows = query if query.ndim == 4 else query[:, None]
    out = backends.get().paged_attention(rows, key_cache, value_cache, _as_int32(block_tables),
                                         _as_int32(seq_lens), **options)
    return out if query.ndim == 4 else out[:, 0]


def _check_varlen_indices(op: str, query_start_loc, block_tables, seq_lens, *, num_tokens: int,
                          num_blocks: int, block_size: int):
    """Host checks of a varlen call (on the caller's values, int64 included, before any cast):
    query_start_loc starts at 0, never decreases and ends at T; each sequence owns at most
    its cached tokens (0 <= n_s <= seq_len, so seq_len 0 and n_s 0 are fine); seq_len fits
    its block table; every block a sequence uses is in range."""
    starts = _host(query_start_loc).astype(np.int64)
    lens = _host(seq_lens).astype(np.int64)
    tables = _host(block_tables)
    if starts[0] != 0:
        _fail(op, f"query_start_loc[0] must be 0, got {starts[0]}")
    counts = np.diff(starts)
    if (counts < 0).any():
        s = int(np.argmax(counts < 0))
        _fail(op, f"query_start_loc must not decrease: query_start_loc[{s + 1}] = {starts[s + 1]} < "
                  f"query_start_loc[{s}] = {starts[s]}")
    if starts[-1] != num_tokens:
        _fail(op, f"query_start_loc[-1] must equal the query's {num_tokens} tokens, got {starts[-1]}")
    capacity = tables.shape[1] * block_size
    for s in np.flatnonzero((lens < 0) | (lens > capacity))[:1]:
        if lens[s] < 0:
            _fail(op, f"seq_lens[{s}] = {lens[s]} is negative")
        _fail(op, f"seq_lens[{s}] = {lens[s]} exceeds its block table capacity "
                  f"(block_tables has {tables.shape[1]} blocks per row x {block_size} = {capacity})")
    for s in np.flatnonzero(counts > lens)[:1]:
        _fail(op, f"query_start_loc gives sequence {s} {counts[s]} query tokens but seq_lens[{s}] = {lens[s]}: "
                  f"the query tokens are the last cached positions, so each needs n_s <= seq_len")
    used = np.arange(tables.shape[1])[None, :] < (-(-lens // block_size))[:, None]
    bad = used & ((tables < 0) | (tables >= num_blocks))
    if bad.any():
        s, j = (int(i) for i in np.argwhere(bad)[0])
        _fail(op, f"block_tables[{s}, {j}] = {tables[s, j]} is out of range [0, {num_blocks})")


def paged_attention_varlen(query: mx.array, key_cache, value_cache, block_tables: mx.array, seq_lens: mx.array,
                           query_start_loc: mx.array, *, scale: float | None = None, softcap: float | None = None,
                           sliding_window: int | None = None, sinks: mx.array | None = None,
                           validate: bool = True) -> mx.array:
    """Attention of a ragged batch of query runs over a paged cache: prefill chunks and
    decode rows in one call, read straight from the blocks (no gather, no mask array).

    Args:
        query: [T, H, D] float: the query rows of every sequence, back to back.
        key_cache, value_cache: [N, Hkv, bs, D] float caches or QuantizedKV.
        block_tables: int32/int64 [S, M].
        seq_lens: int32/int64 [S]; cached tokens per sequence, its new ones included (already written).
        query_start_loc: int32/int64 [S + 1]; sequence s owns query rows
            ``[query_start_loc[s], query_start_loc[s + 1])``: its last ``n_s`` cached positions,
            ``n_s = query_start_loc[s + 1] - query_start_loc[s]`` (0 allowed, and seq_len 0 too).
            Row ``i`` of sequence s sits at ``p = seq_len - n_s + i`` and sees ``t <= p`` (and
            ``t > p - sliding_window``).
        scale, softcap, sliding_window, sinks: as in :func:`paged_attention`.
        validate: check query_start_loc, block ids and lengths on the host (before any cast).
            With ``validate=False`` the kernels clamp query_start_loc to [0, T] (rows no
            sequence owns come back as zeros), a length to [0, M * bs], and treat a block id
            outside [0, N) as padding.
    Returns:
        [T, H, D] in the query's dtype; a row that sees no token is zeros.
    """
    op = "paged_attention_varlen"
    _check_validate(op, validate)
    num_blocks, num_kv_heads, block_size, head_dim = _check_kv_pair(op, key_cache, value_cache,
                                                                    what="[N, Hkv, bs, D]", paged=True)
    _check_array(op, "query", query, ndim=3, dtypes=FLOAT_DTYPES, what="[T, H, D]")
    num_tokens, num_heads, q_dim = query.shape
    if q_dim != head_dim:
        _fail(op, f"query head_dim {q_dim} does not match the cache head_dim {head_dim}")
    _check_query_heads(op, num_heads, num_kv_heads)
    block_tables = _check_index(op, "block_tables", block_tables, ndim=2, what="[S, M]")
    seq_lens = _check_index(op, "seq_lens", seq_lens, ndim=1, what="[S]")
    query_start_loc = _check_index(op, "query_start_loc", query_start_loc, ndim=1, what="[S + 1]")
    num_seqs = block_tables.shape[0]
    if seq_lens.shape[0] != num_seqs:
        _fail(op, f"seq_lens must have one entry per block_tables row ({num_seqs}), got {seq_lens.shape[0]}")
    if query_start_loc.shape[0] != num_seqs + 1:
        _fail(op, f"query_start_loc must have S + 1 = {num_seqs + 1} entries (one start per sequence and "
                  f"the end), got {query_start_loc.shape[0]}")
    max_blocks = block_tables.shape[1]
    options = _attention_options(op, head_dim=head_dim, num_heads=num_heads, scale=scale, softcap=softcap,
                                 sinks=sinks, num_splits=None, max_splits=1)
    del options["num_splits"]
    options["sliding_window"] = _sliding_window(op, sliding_window, max_tokens=max_blocks * block_size)
    if validate:
        _check_varlen_indices(op, query_start_loc, block_tables, seq_lens, num_tokens=num_tokens,
                              num_blocks=num_blocks, block_size=block_size)
    if num_seqs == 0 or num_tokens == 0:
        return mx.zeros(query.shape, query.dtype)
    return backends.get().paged_attention_varlen(query, key_cache, value_cache, _as_int32(block_tables),
                                                 _as_int32(seq_lens), _as_int32(query_start_loc), **options)


def gather_kv_cache(key_cache, value_cache, block_tables: mx.array, seq_lens: mx.array, *,
                    max_len: int | None = None, validate: bool = True):
    """Copy each sequence's K/V rows out of a paged cache into contiguous arrays.

    Returns:
        (keys, values): [S, Hkv, max_len, D] in the cache's float dtype (a quantized cache
        is dequantized). ``max_len`` defaults to ``M * bs``; rows past ``seq_len`` are zero
        and tokens past ``max_len`` are not returned. ``validate`` as in :func:`paged_attention`;
        with ``validate=False`` rows of an out-of-range block id come back as zeros.
    """
    op = "gather_kv_cache"
    _check_validate(op, validate)
    num_blocks, _, block_size, _ = _check_kv_pair(op, key_cache, value_cache, what="[N, Hkv, bs, D]", paged=True)
    block_tables = _check_index(op, "block_tables", block_tables, ndim=2, what="[S, M]")
    seq_lens = _check_index(op, "seq_lens", seq_lens, ndim=1, what="[S]")
    if seq_lens.shape[0] != block_tables.shape[0]:
        _fail(op, f"seq_lens must have one entry per block_tables row ({block_tables.shape[0]}), "
                  f"got {seq_lens.shape[0]}")
    if max_len is None:
        max_len = block_tables.shape[1] * block_size
    elif not _is_int(max_len) or not 1 <= max_len <= INT32_MAX:
        _fail(op, f"max_len must be None or an int in [1, {INT32_MAX}], got {max_len!r}")
    _check_tables(op, block_tables, seq_lens, num_blocks=num_blocks, block_size=block_size, validate=validate)
    return backends.get().gather_kv_cache(key_cache, value_cache, _as_int32(block_tables), _as_int32(seq_lens),
                                          max_len=int(max_len))


def decode_attention(query: mx.array, keys, values, *, scale: float | None = None,
                     softcap: float | None = None, sinks: mx.array | None = None,
                     num_splits: int | None = None, sparse_v: float | None = None) -> mx.array:
    """Split-KV decode over a contiguous cache, in ``mx.fast.scaled_dot_product_attention`` layout.

    Args:
        query: [B, H, L, D] float, 1 <= L <= 8; row ``l`` sees keys ``t <= T - L + l`` (the
            bottom-right-aligned causal mask of ``mask="causal"``).
        keys, values: [B, Hkv, T, D] float (strided views are read in place) or QuantizedKV.
        scale, softcap, sinks: as in :func:`paged_attention`.
        num_splits: KV splits per (batch entry, kv head); None lets the backend choose. A
            count above T is clamped to T (more splits would be empty).
        sparse_v: as in :func:`paged_attention`.
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
                                 softcap=softcap, sinks=sinks, num_splits=num_splits,
                                 max_splits=num_tokens)
    tau = sparse_v_threshold(op, sparse_v)
    if tau is not None:
        options["sparse_v"] = tau
    if batch == 0:
        return mx.zeros(query.shape, query.dtype)
    return backends.get().decode_attention(query, keys, values, **options)


def copy_blocks(key_cache, value_cache, src: mx.array, dst: mx.array, *, validate: bool = True):
    """Copy whole blocks (every kv head): block ``src[i]`` -> block ``dst[i]``.

    Every copy reads the caches as they were before the call; ``dst`` entries must be
    distinct and must not also appear in ``src``. ``validate=True`` checks that (and the
    range of every id, int64 ones before the cast); with ``validate=False`` a pair with an
    id outside [0, N) is skipped by the kernel.
    """
    op = "copy_blocks"
    _check_validate(op, validate)
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
    if src.shape[0] == 0:
        return key_cache, value_cache
    return backends.get().copy_blocks(key_cache, value_cache, _as_int32(src), _as_int32(dst))


def paged_attention_cascade(query: mx.array, key_cache, value_cache, prefix_block_tables: mx.array,
                            prefix_lens: mx.array, prefix_of: mx.array, block_tables: mx.array, seq_lens: mx.array,
                            *, scale: float | None = None, softcap: float | None = None,
                            sinks: mx.array | None = None, sliding_window: int | None = None,
                            sparse_v: float | None = None, validate: bool = True) -> mx.array:
    """Decode attention of sequences that share prefixes ("cascade"): each shared
    prefix is read once for all its member sequences, not once per sequence.

    Args:
        query: [S, H, D] float, one token per sequence.
        key_cache, value_cache: [N, Hkv, bs, D] float caches or QuantizedKV.
        prefix_block_tables: int32/int64 [P, Mp]: the blocks of P shared prefixes (P may be 0).
        prefix_lens: int32/int64 [P]: tokens of each prefix (0 allowed).
        prefix_of: int32/int64 [S]: the prefix of each sequence, or -1 for none.
        block_tables: int32/int64 [S, M]: each sequence's own blocks, after its prefix.
        seq_lens: int32/int64 [S]: each sequence's own tokens, after its prefix (0 allowed).
        scale, softcap, sinks: as in :func:`paged_attention`.
        sliding_window: not supported (a window would cut into the shared prefix
            differently for every sequence); anything but None is a ValueError.
        sparse_v: as in :func:`paged_attention`; the prefix and own-token passes each
            compare against their own running maximum (docs/cascade.md).
        validate: check block ids, lengths and prefix_of on the host (before any cast).
            With ``validate=False`` the kernels clamp lengths to their tables, treat a block id
            outside [0, N) as padding and a prefix_of outside [0, P) as "no prefix".
    Returns:
        [S, H, D] in the query's dtype: sequence s attends to ``prefix_lens[prefix_of[s]]``
        prefix tokens followed by its own ``seq_lens[s]`` tokens, the same as
        :func:`paged_attention` over the concatenated block table (when the prefix fills
        whole blocks). A sequence that sees no token gets zeros.
    """
    op = "paged_attention_cascade"
    _check_validate(op, validate)
    num_blocks, num_kv_heads, block_size, head_dim = _check_kv_pair(op, key_cache, value_cache,
                                                                    what="[N, Hkv, bs, D]", paged=True)
    if isinstance(query, mx.array) and query.ndim == 4:
        _fail(op, f"query must be [S, H, D] (one token per sequence): more than one query token per "
                  f"sequence is not supported, got shape {tuple(query.shape)}")
    _check_array(op, "query", query, ndim=3, dtypes=FLOAT_DTYPES, what="[S, H, D]")
    num_seqs, num_heads, q_dim = query.shape
    if q_dim != head_dim:
        _fail(op, f"query head_dim {q_dim} does not match the cache head_dim {head_dim}")
    _check_query_heads(op, num_heads, num_kv_heads)
    if sliding_window is not None:
        _fail(op, f"sliding_window is not supported by the cascade op (got {sliding_window!r}); "
                  f"use paged_attention for windowed layers")
    prefix_block_tables = _check_index(op, "prefix_block_tables", prefix_block_tables, ndim=2, what="[P, Mp]")
    prefix_lens = _check_index(op, "prefix_lens", prefix_lens, ndim=1, what="[P]")
    prefix_of = _check_index(op, "prefix_of", prefix_of, ndim=1, what="[S]")
    block_tables = _check_index(op, "block_tables", block_tables, ndim=2, what="[S, M]")
    seq_lens = _check_index(op, "seq_lens", seq_lens, ndim=1, what="[S]")
    num_prefixes = prefix_block_tables.shape[0]
    if prefix_lens.shape[0] != num_prefixes:
        _fail(op, f"prefix_lens must have one entry per prefix_block_tables row ({num_prefixes}), "
                  f"got {prefix_lens.shape[0]}")
    for name, arr in (("prefix_of", prefix_of), ("block_tables", block_tables), ("seq_lens", seq_lens)):
        if arr.shape[0] != num_seqs:
            _fail(op, f"{name} must have one row per query sequence ({num_seqs}), got shape {tuple(arr.shape)}")
    options = _attention_options(op, head_dim=head_dim, num_heads=num_heads, scale=scale, softcap=softcap,
                                 sinks=sinks, num_splits=None, max_splits=1)
    del options["num_splits"]
    tau = sparse_v_threshold(op, sparse_v)
    if tau is not None:  # as in paged_attention: a backend without the option fails loudly
        options["sparse_v"] = tau
    if validate:
        _check_tables(op, prefix_block_tables, prefix_lens, num_blocks=num_blocks, block_size=block_size,
                      validate=True, min_len=0, names=("prefix_block_tables", "prefix_lens"))
        _check_tables(op, block_tables, seq_lens, num_blocks=num_blocks, block_size=block_size, validate=True,
                      min_len=0)
        owners = _host(prefix_of).astype(np.int64)
        bad = (owners < -1) | (owners >= num_prefixes)
        if bad.any():
            s = int(np.argmax(bad))
            _fail(op, f"prefix_of[{s}] = {owners[s]} must be -1 (no prefix) or a prefix in [0, {num_prefixes})")
    if num_seqs == 0:
        return mx.zeros(query.shape, query.dtype)
    if num_prefixes == 0:  # nothing shared: one empty prefix row keeps the backends' shapes simple
        prefix_block_tables = mx.zeros((1, 1), dtype=mx.int32)
        prefix_lens = mx.zeros((1,), dtype=mx.int32)
        prefix_of = mx.full((num_seqs,), -1, dtype=mx.int32)
    return backends.get().paged_attention_cascade(
        query, key_cache, value_cache, _as_int32(prefix_block_tables), _as_int32(prefix_lens), _as_int32(prefix_of),
        _as_int32(block_tables), _as_int32(seq_lens), **options)
