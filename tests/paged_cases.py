"""Ragged (varlen) and shared-prefix (cascade) inputs over hostile paged caches, shared by
the op tests, the simulator tests and the kernel mutants."""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from kvcases import maybe_quantize, paged_case, paged_cache, random

f16 = mx.float16


@dataclass
class VarlenCase:
    query: mx.array
    key_cache: object
    value_cache: object
    block_tables: mx.array
    seq_lens: mx.array
    query_start_loc: mx.array
    sinks: mx.array | None = None

    def args(self):
        return (self.query, self.key_cache, self.value_cache, self.block_tables, self.seq_lens,
                self.query_start_loc)


def varlen_case(runs, *, num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=mx.float16, seed=0,
                k_bits=None, v_bits=None, sinks=False) -> VarlenCase:
    """A hostile paged cache for ``runs`` [(seq_len, n_s)] and a random [T, H, D] query."""
    lens = [n for n, _ in runs]
    case = paged_case(lens, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                      block_size=block_size, dtype=dtype, seed=seed, k_bits=k_bits, v_bits=v_bits)
    rng = np.random.default_rng(seed + 100)
    counts = [q for _, q in runs]
    starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    query = mx.array(rng.standard_normal((int(starts[-1]), num_heads, head_dim)).astype(np.float32)).astype(dtype)
    sink_logits = mx.array(rng.standard_normal(num_heads).astype(np.float32)) if sinks else None
    return VarlenCase(query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens,
                      mx.array(starts), sink_logits)


def varlen_inputs(rng, *, lens, counts, num_kv_heads, gqa, head_dim, block_size, dtype, k_quant=None,
                  v_quant=None, use_sinks=False):
    kc, vc, tables, seq_lens = paged_cache(rng, lens=lens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                           block_size=block_size, dtype=dtype)
    kc, vc = maybe_quantize(kc, k_quant), maybe_quantize(vc, v_quant)
    qsl = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
    query = random(rng, (int(qsl[-1]), num_kv_heads * gqa, head_dim), dtype)
    sinks = mx.array(rng.standard_normal(num_kv_heads * gqa).astype(np.float32)) if use_sinks else None
    return query, kc, vc, tables, seq_lens, mx.array(qsl), sinks


def cascade_case(prefix_lens, own_lens, prefix_of, *, num_kv_heads=2, gqa=4, head_dim=64, block_size=16,
                 dtype=f16, k_bits=None, v_bits=None, group_size=64, seed=0, sinks=False):
    """Caches whose first P block-table rows are the prefixes and the next S the sequences'
    own tokens (shuffled block ids, NaN where nothing is owned)."""
    case = paged_case(list(prefix_lens) + list(own_lens), num_heads=num_kv_heads, num_kv_heads=num_kv_heads,
                      head_dim=head_dim, block_size=block_size, dtype=dtype, seed=seed, k_bits=k_bits,
                      v_bits=v_bits, group_size=group_size)
    rng = np.random.default_rng(seed + 100)
    num_prefixes, num_seqs = len(prefix_lens), len(own_lens)
    query = mx.array(rng.standard_normal((num_seqs, num_kv_heads * gqa, head_dim)).astype(np.float32)).astype(dtype)
    sink = mx.array(rng.standard_normal(num_kv_heads * gqa).astype(np.float32)) if sinks else None
    return dict(query=query, key_cache=case.key_cache, value_cache=case.value_cache,
                prefix_block_tables=case.block_tables[:num_prefixes], prefix_lens=case.seq_lens[:num_prefixes],
                prefix_of=mx.array(np.asarray(prefix_of, np.int32)), block_tables=case.block_tables[num_prefixes:],
                seq_lens=case.seq_lens[num_prefixes:]), sink
