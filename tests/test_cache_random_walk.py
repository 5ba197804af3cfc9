"""PagedKVCache random walks with real tensors, checked against a model of the token contents.

The K/V row of a token stands for its whole prefix (as in a transformer): it is drawn
from the prefix's ids. After every operation each sequence's gathered rows must be the
rows of its own prefixes (zeros where a window evicted them), whatever prefix sharing,
forks, copy-on-write, truncation, eviction and block recycling did (issue 10 item 1).
"""
from __future__ import annotations

import hashlib

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal.cache import HOLE, KVCacheFull, PagedKVCache

BS, D = 8, 64


def prefix_row(prefix: tuple) -> np.ndarray:
    seed = int.from_bytes(hashlib.blake2b(np.asarray(prefix, np.int64).tobytes(), digest_size=8).digest(), "little")
    return np.random.default_rng(seed).standard_normal((1, D)).astype(np.float32)


class Walk:
    def __init__(self, num_blocks: int, seed: int):
        self.cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=D, num_blocks=num_blocks, block_size=BS,
                                  dtype=mx.float32)
        self.rng = np.random.default_rng(seed)
        self.tokens = {}  # seq -> its ids
        self.next_id = 0

    def write(self, seq, start, stop):
        ids = self.tokens[seq]
        rows = np.stack([prefix_row(tuple(ids[: t + 1])) for t in range(start, stop)])
        k = mx.array(rows)
        self.cache.write(0, k, -k, self.cache.slots(seq, start, stop))

    def add(self, ids):
        seq, self.next_id = self.next_id, self.next_id + 1
        try:
            cached = self.cache.add_sequence(seq, ids)
        except KVCacheFull:
            return
        self.tokens[seq] = list(ids)
        self.write(seq, cached, len(ids))

    def append(self, seq, ids):
        start = self.cache.num_tokens(seq)
        try:
            slots = self.cache.append(seq, ids)
        except KVCacheFull:
            return
        self.tokens[seq] += ids
        k = mx.array(np.stack([prefix_row(tuple(self.tokens[seq][: t + 1])) for t in range(start, start + len(ids))]))
        self.cache.write(0, k, -k, slots)

    def check(self):
        for seq, ids in self.tokens.items():
            if not ids:
                continue
            tables, lens = self.cache.block_tables([seq])
            k, v = kv.gather_kv_cache(self.cache.key_caches[0], self.cache.value_caches[0], tables, lens,
                                      max_len=max(1, len(ids)))
            got_k, got_v = np.array(k[0, 0, : len(ids)]), np.array(v[0, 0, : len(ids)])
            table = self.cache.allocator.block_table(seq)
            for t in range(len(ids)):
                want = np.zeros(D, np.float32) if table[t // BS] == HOLE else prefix_row(tuple(ids[: t + 1]))[0]
                assert np.array_equal(got_k[t], want), f"seq {seq} position {t}: wrong K row"
                assert np.array_equal(got_v[t], -want), f"seq {seq} position {t}: wrong V row"


def cut_shared(w: Walk, seq, rng) -> bool:
    """The pattern behind the first reliability defect, as four walk steps: a twin shares
    every block of ``seq``; ``seq`` is truncated into a full (published) shared block; the
    twin is freed (the block is ``seq``'s alone, still published); ``seq`` appends (its
    rows must not land in the published block); a new sequence with the old prefix then
    finds that block by its hash and must read the old rows. False if ``seq`` has no full
    block to cut into."""
    ids = w.tokens[seq]
    full = len(ids) // BS
    table = w.cache.allocator.block_table(seq)
    if full == 0 or HOLE in table:
        return False
    n = int(rng.integers(0, full)) * BS + int(rng.integers(1, BS))  # inside a full block
    twin, w.next_id = w.next_id, w.next_id + 1
    w.cache.fork(seq, twin)
    w.tokens[twin] = list(ids)
    old = list(ids)

    def truncate():
        w.cache.truncate(seq, n)
        del w.tokens[seq][n:]

    def free_twin():
        w.cache.free(twin)
        del w.tokens[twin]

    for step in (truncate, free_twin,
                 lambda: w.append(seq, [int(t) for t in rng.integers(3, 6, int(rng.integers(1, BS)))]),
                 lambda: w.add(old[: (n // BS + 1) * BS] + [int(rng.integers(0, 3))])):
        step()
        w.check()
    return True


def walk(seed: int, steps: int = 250, cut_weight: int = 2) -> Walk:
    """``steps`` random operations, checked after each; ``cut_weight`` (out of 8 + it)
    biases the walk toward :func:`cut_shared`."""
    w = Walk(num_blocks=20, seed=seed)
    w.cuts = 0
    rng = w.rng
    prefixes = [[int(t) for t in rng.integers(0, 3, 20)] for _ in range(2)]
    ops = ["add", "add", "append", "append", "fork", "free", "truncate", "evict"] + ["cut"] * cut_weight
    for _ in range(steps):
        seqs = sorted(w.tokens)
        op = rng.choice(ops) if seqs else "add"
        seq = seqs[rng.integers(len(seqs))] if seqs else None
        if op == "add":
            head = prefixes[rng.integers(2)][: rng.integers(1, 21)]
            w.add(head + [int(t) for t in rng.integers(0, 3, rng.integers(0, 4))])
        elif op == "append":
            w.append(seq, [int(t) for t in rng.integers(0, 3, rng.integers(1, 6))])
        elif op == "fork":
            child, w.next_id = w.next_id, w.next_id + 1
            w.cache.fork(seq, child)
            w.tokens[child] = list(w.tokens[seq])
        elif op == "free":
            w.cache.free(seq)
            del w.tokens[seq]
        elif op == "truncate":
            table = w.cache.allocator.block_table(seq)
            live_from = next((i for i, b in enumerate(table) if b == HOLE), None)
            limit = len(w.tokens[seq]) if live_from is None else 0
            n = int(rng.integers(0, limit + 1))
            w.cache.truncate(seq, n)
            del w.tokens[seq][n:]
        elif op == "cut":
            w.cuts += cut_shared(w, seq, rng)
        else:
            w.cache.evict(seq, window=int(rng.integers(1, 20)))
        w.check()
    return w


@pytest.mark.parametrize("seed", range(4))
def test_random_walk_keeps_every_sequences_rows(seed):
    w = walk(seed)
    assert w.cache.allocator.prefix_hit_blocks > 8 and w.cuts >= 5


def _old_immutability_bug(monkeypatch):
    """Reintroduce the first reliability defect (before commit 52b3f3b): an append into a
    partly filled block copies it only while it is shared and never unpublishes it, and
    truncate unpublishes only a block that is unshared at that moment."""
    from kvmetal.cache import BlockAllocator

    def make_last_block_writable(self, seq):
        last = seq.blocks[-1]
        if self.refcount[last] > 1:
            fresh = self._take(1)[0]
            self._release(last)
            seq.blocks[-1] = fresh
            return [(last, fresh)]
        return []

    truncate = BlockAllocator.truncate

    def old_truncate(self, seq_id, num_tokens):
        truncate(self, seq_id, num_tokens)
        seq = self._seqs[seq_id]
        if num_tokens % self.block_size and seq.blocks and self.refcount[seq.blocks[-1]] == 1:
            self._unpublish(seq.blocks[-1])

    monkeypatch.setattr(BlockAllocator, "_make_last_block_writable", make_last_block_writable)
    monkeypatch.setattr(BlockAllocator, "truncate", old_truncate)


@pytest.mark.parametrize("seed", range(4))
def test_the_walk_catches_the_prefix_sharing_immutability_bug(monkeypatch, seed):
    """A test of the test: with the old allocator behaviour every seed's walk fails."""
    _old_immutability_bug(monkeypatch)
    with pytest.raises(AssertionError, match="wrong K row"):
        walk(seed)
