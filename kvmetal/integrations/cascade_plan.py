"""The decode step's grouping rule for shared-prefix ("cascade") attention.

Given the block tables and lengths of one decode step's sequences, find runs of
leading block ids that several sequences share (the prefix-sharing pool hands every
request that starts with a published prefix the very same blocks) and build the
arguments of ``kvmetal.paged_attention_cascade``: the shared runs as prefixes, each
sequence's remaining blocks as its own table.

The rule (thresholds from docs/cascade.md's measurements): sequences are grouped by
their first block id; a group becomes a prefix when it has at least ``min_members``
sequences and its members' tables agree on at least ``min_blocks`` leading blocks.
Only whole blocks inside every member's tokens count (a shared run always ends on a
block boundary: the blocks a pool shares are full ones), so a member's own tokens
start right after the prefix. Pure Python and NumPy; no MLX.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# Chosen from the measurements in docs/cascade.md ("Grouping rule").
MIN_MEMBERS = 8
MIN_PREFIX_TOKENS = 512


@dataclass(frozen=True)
class CascadeGroups:
    """``paged_attention_cascade``'s index arguments (int32 NumPy arrays) for one step."""

    prefix_block_tables: np.ndarray  # [P, Mp]
    prefix_lens: np.ndarray          # [P]
    prefix_of: np.ndarray            # [S], -1 for a sequence in no group
    block_tables: np.ndarray         # [S, M]: each sequence's blocks after its prefix (0-padded)
    seq_lens: np.ndarray             # [S]: its tokens after its prefix
    shared_tokens: int               # prefix tokens read once instead of once per member, summed


def group_shared_prefixes(block_tables, seq_lens, *, block_size: int, min_members: int | None = None,
                          min_blocks: int | None = None) -> CascadeGroups | None:
    """The cascade arguments for sequences with tables ``block_tables`` [S, M] and
    lengths ``seq_lens`` [S], or None when no group reaches the thresholds (defaults:
    MIN_MEMBERS sequences, the whole blocks holding MIN_PREFIX_TOKENS tokens)."""
    tables = np.asarray(block_tables).astype(np.int64)
    lens = np.asarray(seq_lens).astype(np.int64)
    num_seqs, width = tables.shape
    min_members = MIN_MEMBERS if min_members is None else int(min_members)
    min_blocks = max(1, -(-MIN_PREFIX_TOKENS // block_size) if min_blocks is None else int(min_blocks))
    full = np.minimum(lens // block_size, width)  # whole blocks inside each sequence's tokens
    candidates = np.flatnonzero(full >= min_blocks)
    prefix_rows, prefix_lens = [], []
    prefix_of = np.full(num_seqs, -1, dtype=np.int64)
    shared_blocks = np.zeros(num_seqs, dtype=np.int64)
    for first in np.unique(tables[candidates, 0]):
        members = candidates[tables[candidates, 0] == first]
        if members.size < min_members:
            continue
        span = int(full[members].min())
        rows = tables[members, :span]
        agree = (rows == rows[0]).all(axis=0)
        common = span if agree.all() else int(np.argmin(agree))
        if common < min_blocks:
            continue
        prefix_of[members] = len(prefix_rows)
        shared_blocks[members] = common
        prefix_rows.append(rows[0, :common])
        prefix_lens.append(common * block_size)
    if not prefix_rows:
        return None
    prefix_width = max(len(r) for r in prefix_rows)
    prefix_tables = np.zeros((len(prefix_rows), prefix_width), dtype=np.int32)
    for p, row in enumerate(prefix_rows):
        prefix_tables[p, :len(row)] = row
    own = np.zeros_like(tables, dtype=np.int32)
    for s in range(num_seqs):
        k = int(shared_blocks[s])
        own[s, :width - k] = tables[s, k:]
    own_lens = lens - shared_blocks * block_size
    shared = int(sum((np.count_nonzero(prefix_of == p) - 1) * n for p, n in enumerate(prefix_lens)))
    return CascadeGroups(prefix_tables, np.array(prefix_lens, dtype=np.int32), prefix_of.astype(np.int32), own,
                         own_lens.astype(np.int32), shared)
