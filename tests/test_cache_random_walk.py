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


@pytest.mark.parametrize("seed", range(4))
def test_random_walk_keeps_every_sequences_rows(seed):
    w = Walk(num_blocks=20, seed=seed)
    rng = w.rng
    prefixes = [[int(t) for t in rng.integers(0, 3, 20)] for _ in range(2)]
    for _ in range(250):
        seqs = sorted(w.tokens)
        op = rng.choice(["add", "add", "append", "append", "fork", "free", "truncate", "evict"]) if seqs else "add"
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
        else:
            w.cache.evict(seq, window=int(rng.integers(1, 20)))
        w.check()
    assert w.cache.allocator.prefix_hit_blocks > 10
