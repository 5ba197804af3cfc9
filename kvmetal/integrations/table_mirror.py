"""A pool's block tables kept as one int32 array across forward passes.

Every pass needs block tables and slot mappings for its sequences. Rebuilding them
from the allocator's Python lists costs a list copy per sequence per layer group per
step; here each live sequence owns a row of a persistent array, and a pass copies only
the entries the allocator marked changed since the previous pass (a decode step: one
new block every ``block_size`` tokens, a copy-on-write, a window eviction). A step's
tables and slots are then two numpy gathers over the rows of its sequences.
"""
from __future__ import annotations

import numpy as np

from ..cache import HOLE

_UNUSED = -1  # entries past a row's blocks, and evicted ones: the pool's null block at gather time


class BlockTableMirror:
    """Rows of one :class:`~kvmetal.PagedKVCache`'s block tables, updated incrementally.

    The only reader of its allocator's change marks (``take_table_changes``): one mirror
    per pool."""

    def __init__(self, pool):
        self.pool = pool
        self._rows: dict = {}  # seq_id -> (row, blocks mirrored)
        self._spare: list = []  # rows of sequences that left
        self._table = np.full((8, 8), _UNUSED, dtype=np.int32)
        self._used = 0  # rows handed out so far

    def rows(self, seq_ids) -> tuple:
        """(row of each sequence [S], its block count [S]), after copying what changed."""
        rows = np.empty(len(seq_ids), dtype=np.intp)
        widths = np.empty(len(seq_ids), dtype=np.intp)
        for i, seq in enumerate(seq_ids):
            rows[i], widths[i] = self._sync(seq)
        if len(self._rows) > 2 * len(seq_ids) + 64:
            self._forget_gone()
        return rows, widths

    def tables(self, rows: np.ndarray, widths: np.ndarray) -> np.ndarray:
        """int32 [S, M] block tables of these rows (M = the widest; the null block where
        a row has no block or a window evicted one)."""
        width = max(1, int(widths.max(initial=0)))
        out = self._table[rows, :width]
        return np.where(out < 0, np.int32(self.pool.null_block), out)

    def slots(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> np.ndarray:
        """int32 slots of tokens ``starts[i] .. starts[i] + counts[i] - 1`` of each row."""
        bs = self.pool.block_size
        total = int(counts.sum())
        first = np.cumsum(counts) - counts  # each row's first entry in the output
        positions = np.repeat(starts, counts) + (np.arange(total) - np.repeat(first, counts))
        blocks = self._table[np.repeat(rows, counts), positions // bs]
        if (blocks < 0).any():
            raise ValueError("[BlockTableMirror] a slot lies in a block the sequence does not hold")
        return (blocks.astype(np.int64) * bs + positions % bs).astype(np.int32)

    def _sync(self, seq_id) -> tuple:
        blocks, first = self.pool.allocator.take_table_changes(seq_id)
        entry = self._rows.get(seq_id)
        if entry is None:
            row, old, first = self._new_row(), 0, 0
        else:
            row, old = entry
        n = len(blocks)
        if n > self._table.shape[1]:
            grown = np.full((self._table.shape[0], max(n, 2 * self._table.shape[1])), _UNUSED, dtype=np.int32)
            grown[:, :self._table.shape[1]] = self._table
            self._table = grown
        if first < n:
            changed = np.asarray(blocks[first:], dtype=np.int32)
            changed[changed == HOLE] = _UNUSED
            self._table[row, first:n] = changed
        if old > n:  # truncated
            self._table[row, n:old] = _UNUSED
        self._rows[seq_id] = (row, n)
        return row, n

    def _new_row(self) -> int:
        if self._spare:
            return self._spare.pop()
        if self._used == self._table.shape[0]:
            grown = np.full((2 * self._used, self._table.shape[1]), _UNUSED, dtype=np.int32)
            grown[:self._used] = self._table
            self._table = grown
        self._used += 1
        return self._used - 1

    def _forget_gone(self) -> None:
        """Rows of sequences the allocator no longer holds go back for reuse. (A sequence
        freed and added again under the same id is copied whole: its marks start at 0.)"""
        allocator = self.pool.allocator
        for seq in [s for s in self._rows if s not in allocator]:
            row, _ = self._rows.pop(seq)
            self._table[row] = _UNUSED
            self._spare.append(row)
