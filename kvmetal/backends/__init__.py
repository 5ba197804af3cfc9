"""Backend registry and selection.

A backend is a module exposing the seven functions below. ``kvmetal.ops`` has
already checked and normalised every argument, so backends trust their inputs
and never re-check; a configuration a backend cannot run raises
``NotImplementedError`` naming it (no silent fallbacks).

Contract (shapes per docs/design.md; ``KV`` is a float ``mx.array`` or a
``kvmetal.quant.QuantizedKV``; K and V may differ in kind and bits)::

    reshape_and_cache(key, value, key_cache: KV, value_cache: KV, slot_mapping)
        key, value   [T, Hkv, D] float (any float dtype; converted/quantized to the cache's)
        slot_mapping int32 [T], negative = skip
        -> (key_cache, value_cache)   new arrays; in place where MLX donation allows

    paged_attention(query, key_cache, value_cache, block_tables, seq_lens, *,
                    scale: float, softcap: float | None, sliding_window: int | None,
                    sinks: mx.array | None, num_splits: int | None)
        query [S, L, H, D], 1 <= L <= 8 (ops reshapes a one-token [S, H, D] query);
        block_tables int32 [S, max_blocks]; seq_lens int32 [S] (>= 0; 0 is an empty
        slot: its table row is never read and its rows are zero, sinks or not)
        sinks float32 [H] or None -> out in the query's shape and dtype
        query row l sits at position seq_len - L + l and sees t <= that position
        (and t > position - sliding_window)

    paged_attention_varlen(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *,
                           scale: float, softcap: float | None, sliding_window: int | None,
                           sinks: mx.array | None)
        query [T, H, D] (T >= 1); block_tables int32 [S, M] (S >= 1); seq_lens int32 [S] (>= 0);
        query_start_loc int32 [S + 1]: sequence s owns query rows [qsl[s], qsl[s + 1]),
        its last n_s = qsl[s + 1] - qsl[s] cached positions (n_s may be 0, any size above)
        -> out [T, H, D] in the query's dtype
        row i of sequence s sits at p = seq_len - n_s + i and sees t <= p (and
        t > p - sliding_window); a row that sees nothing is zeros. Under validate=False
        ops passes the caller's values on: a backend clamps qsl to [0, T] (rows no
        sequence owns are zeros) and lengths to [0, M * bs], and treats block ids
        outside [0, N) as padding.

    paged_attention_cascade(query, key_cache, value_cache, prefix_block_tables, prefix_lens, prefix_of,
                            block_tables, seq_lens, *, scale: float, softcap: float | None,
                            sinks: mx.array | None, sparse_v: float | None = None)
        query [S, H, D] (S >= 1); prefix_block_tables int32 [P, Mp] (P >= 1), prefix_lens
        int32 [P]; prefix_of int32 [S] (-1: no prefix); block_tables int32 [S, M], seq_lens
        int32 [S]: each sequence's own tokens after its prefix (>= 0)
        -> out [S, H, D] in the query's dtype
        sequence s's one query row sees all of its prefix's tokens, then all of its own;
        a row that sees nothing is zeros. Under validate=False a backend clamps lengths to
        their tables, treats block ids outside [0, N) as padding and a prefix_of outside
        [0, P) as "no prefix".

    gather_kv_cache(key_cache, value_cache, block_tables, seq_lens, *, max_len: int)
        -> (keys, values) [S, Hkv, max_len, D] in the cache's float dtype
           (QuantizedKV.dtype for a quantized cache); rows past seq_len are zero
           (every row for seq_len 0)

    decode_attention(query, keys, values, *, scale, softcap, sinks, num_splits)
        query [B, H, L, D], 1 <= L <= 8; keys, values [B, Hkv, T, D]
        (may be strided views); row l sees keys t <= T - L + l
        -> out [B, H, L, D] in query dtype

    copy_blocks(key_cache, value_cache, src, dst)
        src, dst int32 [n]: block src[i] is copied to block dst[i] (all heads)
        -> (key_cache, value_cache)
"""
from __future__ import annotations

import contextlib
import importlib
import threading

import mlx.core as mx

BACKENDS = ("metal", "cpu", "sim")

# Split-KV of every backend: automatic splits are windows of this many tokens, cut at
# its multiples of each sequence's keys (below it a split's partials and merge cost
# more than the parallelism it buys). Windows, not a split count chosen per launch,
# make a sequence's attention the same bits in any batch (docs/serve.md, "Batch
# invariance"). The CPU backend passes it to the C++ planner; the Metal kernels
# take it as KvAttnParams.split_tokens.
MIN_TOKENS_PER_SPLIT = 256
# The most query rows per sequence the decode kernels take (paged_attention and
# decode_attention with L rows, a speculative verify pass). The one definition: ops,
# the model cache, the proposers and selfcheck read it under this name.
MAX_QUERY_TOKENS = 8
# A varlen sequence with at most that many query rows may run another kernel than a longer
# one (Metal sends it to the decode partials), so its rows' bits differ from the same rows
# in a longer run: the engine's scheduler never cuts a prompt into such a run unless it is
# the whole prompt left (batch invariance, docs/serve.md).
VARLEN_SHORT_RUN = MAX_QUERY_TOKENS

_state = threading.local()


def default_backend() -> str:
    """metal where MLX has a Metal device, else the native CPU backend."""
    return "metal" if mx.metal.is_available() else "cpu"


def current_backend() -> str:
    return getattr(_state, "name", None) or default_backend()


def available_backends() -> list:
    """Backends that can run on this machine (the simulator runs anywhere g++ does)."""
    names = ["cpu", "sim"]
    if mx.metal.is_available():
        names.insert(0, "metal")
    return names


@contextlib.contextmanager
def use_backend(name: str):
    """Run kvmetal ops on ``name`` ("metal", "cpu" or "sim") inside the block."""
    if name not in BACKENDS:
        raise ValueError(f"[use_backend] name must be one of {BACKENDS}, got {name!r}")
    if name == "metal" and not mx.metal.is_available():
        raise NotImplementedError("[use_backend] the metal backend needs an Apple GPU; use 'sim' to run its kernels on the CPU")
    previous = getattr(_state, "name", None)
    _state.name = name
    try:
        yield name
    finally:
        _state.name = previous


def get(name: str | None = None):
    """The backend module for ``name`` (default: the current one)."""
    name = name or current_backend()
    if name == "cpu":
        return importlib.import_module("kvmetal.backends.cpu")
    if name == "metal":
        return importlib.import_module("kvmetal.backends.metal").metal_backend()
    if name == "sim":
        return importlib.import_module("kvmetal.sim.backend").sim_backend()
    raise ValueError(f"unknown backend {name!r}")
