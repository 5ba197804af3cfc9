"""The host plan of shared-prefix ("cascade") decode on the metal and sim backends
(kernels/cascade.metal; ``KernelBackend.paged_attention_cascade`` launches it).

Three launches, planned here from the small index arrays (one sync):

1. ``cascade_partials`` over the prefixes: one table row per *prefix chunk* (up to
   :func:`max_members` member sequences of one prefix), whose QL query rows are the
   members' queries (``member_rows``: the backend gathers them into [C, QL, H, D]).
   A threadgroup holds G x QL rows and reads each prefix K/V row once per (chunk,
   kv head, split). Chunks are sized per prefix: one launch per distinct QL (the
   power of two of a chunk's members), all with the same split count, their partials
   concatenated in the plan's slot order.
   Prefixes no sequence uses, and empty ones, are not launched at all.
2. ``cascade_partials`` with QL = 1 over the sequences' own tables (their tokens
   after the prefix; a length of 0 reads nothing).
3. ``cascade_reduce``: per (sequence, head), the prefix partials of its member
   slot (if any), its own partials and the sink, folded with kv_softmax_merge.

Sliding windows and multi-token queries are refused by ``kvmetal.ops``.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def max_members(gqa: int, max_rows: int) -> int:
    """Member sequences one prefix chunk holds: the largest power of two m with
    gqa * m <= max_rows (at least 1). Powers of two bound the QL specialisations."""
    m = 1
    while gqa * m * 2 <= max_rows:
        m *= 2
    return m


@dataclass(frozen=True)
class ChunkGroup:
    """The prefix chunks of one cascade_partials launch: all padded to ``query_len`` slots."""

    query_len: int            # QL: member slots per chunk (the power of two of its largest chunk)
    chunk_prefix: np.ndarray  # [C] int32: the prefix each chunk reads
    member_rows: np.ndarray   # [C * QL] int32: the query row of each slot (0 for padding slots)


@dataclass(frozen=True)
class CascadePlan:
    """Host schedule of one cascade call."""

    groups: tuple             # ChunkGroup per launch, largest QL first; their slots in that order
    slot_of: np.ndarray       # [S] int32: global slot of each sequence, -1 without a prefix
    prefix_work: int          # most tokens one chunk reads

    @property
    def chunk_prefix(self) -> np.ndarray:
        return np.concatenate([g.chunk_prefix for g in self.groups]) if self.groups else np.zeros(0, np.int32)

    @property
    def prefix_slots(self) -> int:
        """Member slots over all groups (rows of the prefix partials / H)."""
        return sum(g.chunk_prefix.shape[0] * g.query_len for g in self.groups)


def _pow2_at_least(n: int) -> int:
    q = 1
    while q < n:
        q *= 2
    return q


def plan(prefix_lens, prefix_of, *, gqa: int, capacity: int, max_rows: int) -> CascadePlan:
    """Chunks of members per prefix, each of at most ``max_rows`` threadgroup rows (G x
    members), grouped by their own padded size: a chunk of m members takes the launch
    of QL = the power of two >= m, so a one-member prefix beside a 32-member one
    computes no padding rows (one launch per distinct QL; powers of two bound the
    specialisations). Index guards (validate=False): a prefix_of outside [0, P) and a
    prefix length <= 0 mean "no prefix"; lengths are cut to ``capacity`` (the prefix
    table's width in tokens), as the kernel cuts them."""
    lens = np.clip(np.asarray(prefix_lens).astype(np.int64), 0, capacity)
    owner = np.asarray(prefix_of).astype(np.int64)
    num_prefixes = lens.shape[0]
    valid = (owner >= 0) & (owner < num_prefixes)
    valid[valid] = lens[owner[valid]] > 0
    limit = max_members(gqa, max_rows)
    by_size = {}  # QL -> [(prefix, members)]
    for prefix in np.unique(owner[valid]):
        members = np.flatnonzero(valid & (owner == prefix))
        for i in range(0, members.size, limit):
            chunk = members[i:i + limit]
            by_size.setdefault(_pow2_at_least(chunk.size), []).append((int(prefix), chunk))
    slot_of = np.full(owner.shape[0], -1, dtype=np.int32)
    groups, slot0, work = [], 0, 0
    for query_len in sorted(by_size, reverse=True):
        chunks = by_size[query_len]
        member_rows = np.zeros(len(chunks) * query_len, dtype=np.int32)
        for c, (_, members) in enumerate(chunks):
            member_rows[c * query_len:c * query_len + members.size] = members
            slot_of[members] = slot0 + c * query_len + np.arange(members.size)
        chunk_prefix = np.array([p for p, _ in chunks], dtype=np.int32)
        groups.append(ChunkGroup(query_len, chunk_prefix, member_rows))
        slot0 += len(chunks) * query_len
        work = max(work, int(lens[chunk_prefix].max()))
    return CascadePlan(tuple(groups), slot_of, work)
