"""Shared-prefix ("cascade") decode on the metal and sim backends (kernels/cascade.metal).

Three launches, planned on the host (one sync of the small index arrays):

1. ``cascade_partials`` over the prefixes: one table row per *prefix chunk* (up to
   :func:`max_members` member sequences of one prefix), whose QL query rows are the
   members' queries, gathered here into [C, QL, H, D]. A threadgroup then holds
   G x QL rows and reads each prefix K/V row once per (chunk, kv head, split).
   Prefixes no sequence uses, and empty ones, are not launched at all.
2. ``cascade_partials`` with QL = 1 over the sequences' own tables (their tokens
   after the prefix; a length of 0 reads nothing).
3. ``cascade_reduce``: per (sequence, head), the prefix partials of its member
   slot (if any), its own partials and the sink, folded with kv_softmax_merge.

Sliding windows and multi-token queries are refused by ``kvmetal.ops``.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from . import metal

# A chunk's rows (G x QL) stay within one walk over the split: past
# MAX_SHARED_SIMDGROUPS x ROW_REGISTER_LIMIT rows the shared mode walks the split
# again for each further block of rows, and the prefix would be read that often.
MAX_CHUNK_ROWS = metal.MAX_SHARED_SIMDGROUPS * metal.ROW_REGISTER_LIMIT

CASCADE_REDUCE_PARAMS = metal.ParamStruct("KvCascadeReduceParams", (
    ("num_heads", "i"), ("prefix_splits", "i"), ("own_splits", "i"), ("prefix_slots", "i"), ("num_seqs", "i"),
    ("pad0", "i"), ("pad1", "i"), ("pad2", "i")))


def max_members(gqa: int) -> int:
    """Member sequences one prefix chunk holds: the largest power of two m with
    gqa * m <= MAX_CHUNK_ROWS (at least 1). Powers of two bound the QL specialisations."""
    m = 1
    while gqa * m * 2 <= MAX_CHUNK_ROWS:
        m *= 2
    return m


@dataclass(frozen=True)
class CascadePlan:
    """Host schedule of one cascade call."""

    chunk_prefix: np.ndarray  # [C] int32: the prefix each chunk reads
    query_len: int            # QL: member slots per chunk (a power of two)
    member_rows: np.ndarray   # [C * QL] int32: the query row of each slot (0 for padding slots)
    slot_of: np.ndarray       # [S] int32: chunk * QL + slot of each sequence, -1 without a prefix
    prefix_work: int          # most tokens one chunk reads


def plan(prefix_lens, prefix_of, *, gqa: int, capacity: int) -> CascadePlan:
    """Chunks of members per prefix. Index guards (validate=False): a prefix_of outside
    [0, P) and a prefix length <= 0 mean "no prefix"; lengths are cut to ``capacity``
    (the prefix table's width in tokens), as the kernel cuts them."""
    lens = np.clip(np.asarray(prefix_lens).astype(np.int64), 0, capacity)
    owner = np.asarray(prefix_of).astype(np.int64)
    num_prefixes = lens.shape[0]
    valid = (owner >= 0) & (owner < num_prefixes)
    valid[valid] = lens[owner[valid]] > 0
    limit = max_members(gqa)
    chunks = []  # (prefix, [sequences])
    for prefix in np.unique(owner[valid]):
        members = np.flatnonzero(valid & (owner == prefix))
        for i in range(0, members.size, limit):
            chunks.append((int(prefix), members[i:i + limit]))
    slot_of = np.full(owner.shape[0], -1, dtype=np.int32)
    if not chunks:
        return CascadePlan(np.zeros(0, np.int32), 1, np.zeros(0, np.int32), slot_of, 0)
    most = max(m.size for _, m in chunks)
    query_len = 1
    while query_len < most:
        query_len *= 2
    member_rows = np.zeros(len(chunks) * query_len, dtype=np.int32)
    for c, (_, members) in enumerate(chunks):
        member_rows[c * query_len:c * query_len + members.size] = members
        slot_of[members] = c * query_len + np.arange(members.size)
    chunk_prefix = np.array([p for p, _ in chunks], dtype=np.int32)
    return CascadePlan(chunk_prefix, query_len, member_rows, slot_of, int(lens[chunk_prefix].max()))


def _partials(backend, query4, key_cache, value_cache, tables, lens, *, work: int, scale, softcap):
    """cascade_partials over table rows ``tables``/``lens`` with query [C, QL, H, D]:
    (part_max, part_sum, part_acc) [C * QL * H, splits(, D)] and the split count."""
    num_rows, query_len, num_heads, head_dim = query4.shape
    num_blocks, num_kv_heads, block_size, _ = key_cache.shape
    max_blocks = tables.shape[1]
    layout = metal.layout_for(query4, key_cache, value_cache, paged=True)
    splits = backend._splits(None, max(1, work), num_rows * num_kv_heads, layout)
    gqa = num_heads // num_kv_heads
    template, kv_buffers = backend._kv_inputs(key_cache, value_cache, head_dim, gqa, query_len, layout)
    template["BS"] = block_size
    params = metal.ATTENTION_PARAMS.pack(num_kv_heads=num_kv_heads, num_heads=num_heads, query_len=query_len,
                                         num_splits=splits, max_blocks=max_blocks, num_blocks=num_blocks, window=0,
                                         scale=scale, softcap=softcap or 0.0, head_div=1)
    geometry = metal.SPECS["cascade_partials"].geometry(splits=splits, num_kv_heads=num_kv_heads,
                                                        num_seqs=num_rows, layout=layout)
    rows = num_rows * query_len * num_heads
    parts = backend.launch("cascade_partials", template, geometry, *backend._partial_outputs(rows, splits, head_dim),
                           query=mx.contiguous(query4), **kv_buffers, block_tables=tables, seq_lens=lens,
                           params=params)
    return parts, splits


def paged_attention_cascade(backend, query, key_cache, value_cache, prefix_block_tables, prefix_lens, prefix_of,
                            block_tables, seq_lens, *, scale, softcap, sinks):
    """query [S, H, D] -> [S, H, D] (the backend contract, kvmetal.backends)."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
    gqa = num_heads // num_kv_heads
    schedule = plan(prefix_lens, prefix_of, gqa=gqa, capacity=prefix_block_tables.shape[1] * block_size)
    own_work = int(np.clip(np.asarray(seq_lens), 0, block_tables.shape[1] * block_size).max(initial=0))
    own, own_splits = _partials(backend, query[:, None], key_cache, value_cache, block_tables, seq_lens,
                                work=own_work, scale=scale, softcap=softcap)
    num_chunks = schedule.chunk_prefix.shape[0]
    if num_chunks:
        chunk = mx.array(schedule.chunk_prefix)
        members = mx.take(query, mx.array(schedule.member_rows), axis=0)
        members = members.reshape(num_chunks, schedule.query_len, num_heads, head_dim)
        prefix, prefix_splits = _partials(backend, members, key_cache, value_cache,
                                          mx.take(prefix_block_tables, chunk, axis=0), mx.take(prefix_lens, chunk),
                                          work=schedule.prefix_work, scale=scale, softcap=softcap)
    else:  # no sequence has a prefix: placeholders the reduce never reads
        empty = mx.zeros((8,), dtype=mx.float32)
        prefix, prefix_splits = (empty, empty, empty), 1
    params = CASCADE_REDUCE_PARAMS.pack(num_heads=num_heads, prefix_splits=prefix_splits, own_splits=own_splits,
                                        prefix_slots=num_chunks * schedule.query_len, num_seqs=num_seqs)
    rows = num_seqs * num_heads
    template = dict(TQ=query.dtype, D=head_dim, HAS_SINKS=sinks is not None)
    geometry = metal.SPECS["cascade_reduce"].geometry(rows=rows)
    (out,) = backend.launch("cascade_reduce", template, geometry, [(rows, head_dim)], [query.dtype],
                            prefix_max=prefix[0], prefix_sum=prefix[1], prefix_acc=prefix[2], own_max=own[0],
                            own_sum=own[1], own_acc=own[2], slot_of=mx.array(schedule.slot_of),
                            sinks=sinks if sinks is not None else metal._placeholder(mx.float32), params=params)
    return out.reshape(num_seqs, num_heads, head_dim)
