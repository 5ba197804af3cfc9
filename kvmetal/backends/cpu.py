"""The native CPU backend: MLX primitives from ``kvmetal._ext`` (bindings/).

Every op is a lazy MLX op (it only adds a node to the graph, so it also works
under ``mx.compile``); the C++ ``eval_cpu`` runs when the result is evaluated,
multithreaded over (sequence, kv-head chunk, split) work items.

A cache is either a float ``mx.array`` or a :class:`kvmetal.quant.QuantizedKV`.
The primitives take a cache as a list of arrays plus ``bits`` (0 for a float
cache; else ``[data, scales, biases]`` with ``bits`` and ``group_size``), so
this module unpacks containers on the way in and rebuilds them on the way out.
It trusts ``kvmetal.ops``, which has checked and normalised every argument (scale
resolved, sinks float32, ints in range): no re-checks or defaults here.

In-place updates: ``reshape_and_cache`` and ``copy_blocks`` write into the
input cache's buffer when MLX may donate it, i.e. when nothing else holds the
old cache array at evaluation time. Rebind the result to the same name
(``kc, vc = reshape_and_cache(k, v, kc, vc, slots)``) and no copy is made;
keep a reference to the old cache and the op copies it first (the old array
is then left untouched).
"""
from __future__ import annotations

from kvmetal import _ext
from kvmetal.backends import MIN_TOKENS_PER_SPLIT
from kvmetal.quant import QuantizedKV

__all__ = ["reshape_and_cache", "paged_attention", "paged_attention_varlen", "paged_attention_cascade",
           "gather_kv_cache", "decode_attention", "copy_blocks"]


def _unpack(cache):
    """(arrays, bits, group_size) of a float or quantized cache (every bit width of
    kvmetal.quant runs here; ops has checked the format)."""
    if isinstance(cache, QuantizedKV):
        return list(cache.arrays()), cache.bits, cache.group_size
    return [cache], 0, 0


def _repack(template, arrays):
    if isinstance(template, QuantizedKV):
        return template.replace(*arrays)
    return arrays[0]


def reshape_and_cache(key, value, key_cache, value_cache, slot_mapping):
    """Write key/value ``[T, Hkv, D]`` to their slots; negative slots are skipped.

    Rows are converted (or quantized, one row at a time like ``mx.quantize``)
    to each cache's format. Returns ``(key_cache, value_cache)``.
    """
    return _write(key, key_cache, slot_mapping), _write(value, value_cache, slot_mapping)


def _write(rows, cache, slot_mapping):
    arrays, bits, group = _unpack(cache)
    return _repack(cache, _ext.cache_write(rows, arrays, bits, group, slot_mapping))


def paged_attention(query, key_cache, value_cache, block_tables, seq_lens, *, scale, softcap, sliding_window,
                    sinks, num_splits, sparse_v=None):
    """Attention of the last L tokens per sequence over a paged cache: query ``[S, L, H, D]`` -> ``[S, L, H, D]``."""
    k, k_bits, k_group = _unpack(key_cache)
    v, v_bits, v_group = _unpack(value_cache)
    return _ext.paged_attention(
        query, k, k_bits, k_group, v, v_bits, v_group, block_tables, seq_lens,
        scale=scale, softcap=softcap, sliding_window=sliding_window or 0, sinks=sinks, num_splits=num_splits or 0,
        min_tokens_per_split=MIN_TOKENS_PER_SPLIT, sparse_v=sparse_v or 0.0,
    )


def paged_attention_varlen(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *, scale,
                           softcap, sliding_window, sinks):
    """Ragged query runs ``[T, H, D]`` (sequence s owns rows ``[qsl[s], qsl[s + 1])``) over a paged cache."""
    k, k_bits, k_group = _unpack(key_cache)
    v, v_bits, v_group = _unpack(value_cache)
    return _ext.paged_attention_varlen(
        query, k, k_bits, k_group, v, v_bits, v_group, block_tables, seq_lens, query_start_loc,
        scale=scale, softcap=softcap, sliding_window=sliding_window or 0, sinks=sinks,
        min_tokens_per_split=MIN_TOKENS_PER_SPLIT,
    )


def paged_attention_cascade(query, key_cache, value_cache, prefix_block_tables, prefix_lens, prefix_of, block_tables,
                            seq_lens, *, scale, softcap, sinks, sparse_v=None):
    """Query ``[S, H, D]``: sequence s attends to prefix ``prefix_of[s]`` (-1: none), then its own tokens
    (bindings/cascade.h: each prefix block is read once per kv head and split for all its members)."""
    k, k_bits, k_group = _unpack(key_cache)
    v, v_bits, v_group = _unpack(value_cache)
    return _ext.paged_attention_cascade(
        query, k, k_bits, k_group, v, v_bits, v_group, prefix_block_tables, prefix_lens, prefix_of, block_tables,
        seq_lens, scale=scale, softcap=softcap, sinks=sinks, min_tokens_per_split=MIN_TOKENS_PER_SPLIT,
        sparse_v=sparse_v or 0.0,
    )


def gather_kv_cache(key_cache, value_cache, block_tables, seq_lens, *, max_len):
    """Both caches gathered to ``[S, Hkv, max_len, D]`` (dequantized), zero past ``seq_len``."""
    out = []
    for cache in (key_cache, value_cache):
        arrays, bits, group = _unpack(cache)
        out.append(_ext.gather_kv(arrays, bits, group, block_tables, seq_lens, max_len=max_len))
    return tuple(out)


def decode_attention(query, keys, values, *, scale, softcap, sinks, num_splits, sparse_v=None):
    """Query ``[B, H, L, D]`` over contiguous ``[B, Hkv, T, D]`` keys/values (read in place, strides
    honoured), bottom-right causal: row l sees keys t <= T - L + l."""
    k, k_bits, k_group = _unpack(keys)
    v, v_bits, v_group = _unpack(values)
    return _ext.decode_attention(
        query, k, k_bits, k_group, v, v_bits, v_group,
        scale=scale, softcap=softcap, sinks=sinks, num_splits=num_splits or 0,
        min_tokens_per_split=MIN_TOKENS_PER_SPLIT, sparse_v=sparse_v or 0.0,
    )


def copy_blocks(key_cache, value_cache, src, dst):
    """Copy block ``src[i]`` to ``dst[i]`` (all heads) in both caches; every copy reads the caches as they were before the call."""
    k, _, _ = _unpack(key_cache)
    v, _, _ = _unpack(value_cache)
    out = _ext.copy_blocks(k + v, src, dst)
    return _repack(key_cache, out[:len(k)]), _repack(value_cache, out[len(k):])
