"""The block allocator behind PagedKVCache, checked against a shadow model.

The shadow keeps, for every block, what each of its slots holds (token ids stand in for
K/V rows) and applies exactly the writes and copy-on-write copies the allocator asks
for. Reading a sequence back through its block table must then give its own tokens:
a sequence never sees another's writes, and prefix sharing only shares equal prefixes.
"""
from __future__ import annotations

import copy

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from kvmetal.cache import HOLE, BlockAllocator, KVCacheFull, _chain_hash

BLOCK_SIZE = 4


class ShadowedAllocator:
    """A BlockAllocator plus the slot contents and token lists it implies."""

    def __init__(self, num_blocks: int, block_size: int = BLOCK_SIZE):
        self.alloc = BlockAllocator(num_blocks, block_size)
        self.bs = block_size
        self.content = {}  # slot -> token id written there
        self.expected = {}  # seq id -> its token ids
        self.block_of_hash = {}  # chain hash -> the token ids of the full block it stands for
        self.next_id = 0

    def _learn_hashes(self, seq):
        """Remember which block tokens every chain hash of ``seq``'s full blocks stands for."""
        tokens, previous = self.expected[seq], b""
        for i in range(len(tokens) // self.bs):
            previous = _chain_hash(previous, tokens[i * self.bs:(i + 1) * self.bs])
            self.block_of_hash[previous] = tokens[i * self.bs:(i + 1) * self.bs]

    # Each op returns False when the allocator reported KVCacheFull (and checks it changed nothing).
    def _guarded(self, fn) -> bool:
        before = self.snapshot()
        try:
            fn()
            return True
        except KVCacheFull:
            assert self.snapshot() == before, "KVCacheFull must leave the allocator unchanged"
            return False

    def snapshot(self):
        a = self.alloc
        return (list(a.refcount), list(a._free), list(a._cached), dict(a._hash_of_block),
                {s: (list(q.blocks), q.num_tokens, copy.copy(q.tokens)) for s, q in a._seqs.items()})

    def _write(self, seq, start, tokens):
        for slot, token in zip(self.alloc.slots(seq, start, start + len(tokens)), tokens):
            self.content[int(slot)] = token

    def add(self, tokens) -> bool:
        seq = self.next_id

        def run():
            cached = self.alloc.add(seq, tokens)
            assert cached % self.bs == 0 and cached <= max(0, len(tokens) - 1)
            self.expected[seq] = list(tokens)
            self._learn_hashes(seq)
            self._write(seq, cached, tokens[cached:])
        ok = self._guarded(run)
        self.next_id += ok
        return ok

    def append(self, seq, tokens) -> bool:
        def run():
            start = self.alloc.num_tokens(seq)
            result = self.alloc.append(seq, tokens)
            for src, dst in result.copies:  # what PagedKVCache does with copy_blocks
                assert self.alloc.refcount[src] >= 1 and self.alloc.refcount[dst] == 1
                for o in range(self.bs):
                    if src * self.bs + o in self.content:
                        self.content[dst * self.bs + o] = self.content[src * self.bs + o]
            assert len(result.slots) == len(tokens)
            for slot in result.slots:  # every written block is owned by this sequence alone
                assert self.alloc.refcount[int(slot) // self.bs] == 1
            self.expected[seq] += list(tokens)
            self._learn_hashes(seq)
            self._write(seq, start, tokens)
        return self._guarded(run)

    def fork(self, parent):
        child = self.next_id
        self.next_id += 1
        self.alloc.fork(parent, child)
        self.expected[child] = list(self.expected[parent])

    def free(self, seq):
        self.alloc.free(seq)
        del self.expected[seq]

    def evict(self, seq, window, keep):
        self.alloc.evict(seq, window=window, keep=keep)

    def truncate(self, seq, n):
        self.alloc.truncate(seq, n)
        del self.expected[seq][n:]

    def check(self):
        a, bs = self.alloc, self.bs
        owners = np.zeros(a.num_blocks, dtype=np.int64)
        for seq in a.sequences():
            table = a.block_table(seq)
            n = a.num_tokens(seq)
            assert len(table) == -(-n // bs)
            assert n == len(self.expected[seq])
            for b in table:
                if b != HOLE:
                    owners[b] += 1
            # Every live token reads back as this sequence's own token.
            for t, token in enumerate(self.expected[seq]):
                b = table[t // bs]
                if b != HOLE:
                    assert self.content.get(b * bs + t % bs) == token, f"seq {seq} token {t} corrupted"
        assert list(owners) == a.refcount, "reference counts must equal table references"
        free, cached = a.free_blocks(), a.cached_blocks()
        assert len(set(free)) == len(free) and not set(free) & set(cached)
        owned = {b for b in range(a.num_blocks) if a.refcount[b] > 0}
        assert not owned & (set(free) | set(cached)), "a block is both owned and free"
        assert owned | set(free) | set(cached) == set(range(a.num_blocks)), "a block leaked"
        for b in cached:
            assert a.block_hash(b) is not None, "a cached block must be findable by its hash"
        hashes = [a.block_hash(b) for b in range(a.num_blocks) if a.block_hash(b) is not None]
        assert len(set(hashes)) == len(hashes), "two blocks registered under one hash"
        # A published block is immutable: it still holds exactly the tokens its hash names,
        # so a later prompt that finds it gets the right K/V (issue 10 item 1).
        for b in range(a.num_blocks):
            h = a.block_hash(b)
            if h is not None:
                held = [self.content.get(b * bs + o) for o in range(bs)]
                assert held == self.block_of_hash[h], f"published block {b} was overwritten"


# A few shared prefixes make prefix hits and copy-on-write common.
PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8, 9], [1, 2, 3, 4, 9, 9, 9, 9], [7] * 12]


def random_prompt(rng) -> list:
    head = list(PREFIXES[rng.integers(len(PREFIXES))])[: rng.integers(0, 13)]
    return head + [int(t) for t in rng.integers(0, 50, rng.integers(0, 7))]


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = ShadowedAllocator(num_blocks=12)

    def _pick(self, data_index):
        seqs = sorted(self.m.expected)
        return seqs[data_index % len(seqs)]

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), cut=st.integers(0, 12),
          tail=st.lists(st.integers(0, 50), max_size=6))
    def add(self, prefix, cut, tail):
        self.m.add(PREFIXES[prefix][:cut] + tail)

    @precondition(lambda self: self.m.expected)
    @rule(i=st.integers(0, 100), tokens=st.lists(st.integers(0, 50), min_size=1, max_size=6))
    def append(self, i, tokens):
        self.m.append(self._pick(i), tokens)

    @precondition(lambda self: self.m.expected)
    @rule(i=st.integers(0, 100))
    def fork(self, i):
        self.m.fork(self._pick(i))

    @precondition(lambda self: self.m.expected)
    @rule(i=st.integers(0, 100))
    def free(self, i):
        self.m.free(self._pick(i))

    @precondition(lambda self: self.m.expected)
    @rule(i=st.integers(0, 100), window=st.integers(0, 10), keep=st.integers(0, 6))
    def evict(self, i, window, keep):
        self.m.evict(self._pick(i), window, keep)

    @precondition(lambda self: self.m.expected)
    @rule(i=st.integers(0, 100), cut=st.integers(0, 40))
    def truncate(self, i, cut):
        seq = self._pick(i)
        table, bs = self.m.alloc.block_table(seq), self.m.bs
        # Only to a length whose last block is still live (evicted tokens cannot come back).
        valid = [n for n in range(self.m.alloc.num_tokens(seq) + 1) if n == 0 or table[(n - 1) // bs] != HOLE]
        self.m.truncate(seq, valid[cut % len(valid)])

    @invariant()
    def consistent(self):
        self.m.check()


TestAllocatorStateful = AllocatorMachine.TestCase
TestAllocatorStateful.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)


def test_ten_thousand_random_operations_end_consistent():
    rng = np.random.default_rng(1234)
    m = ShadowedAllocator(num_blocks=40)
    counts = dict.fromkeys(("add", "append", "fork", "free", "evict", "truncate", "full"), 0)
    for step in range(10_000):
        seqs = sorted(m.expected)
        op = rng.choice(["add", "append", "append", "fork", "free", "evict", "truncate", "truncate"]) if seqs else "add"
        seq = seqs[rng.integers(len(seqs))] if seqs else None
        ok = True
        if op == "add":
            ok = m.add(random_prompt(rng))
        elif op == "append":
            ok = m.append(seq, [int(t) for t in rng.integers(0, 50, rng.integers(1, 6))])
        elif op == "fork":
            m.fork(seq)
        elif op == "free":
            m.free(seq)
        elif op == "evict":
            m.evict(seq, int(rng.integers(0, 12)), int(rng.integers(0, 6)))
        else:
            table = m.alloc.block_table(seq)
            live_from = next((i for i, b in enumerate(table) if b == HOLE), None)
            limit = m.alloc.num_tokens(seq) if live_from is None else 0
            m.truncate(seq, int(rng.integers(0, limit + 1)))
        counts[op] += 1
        counts["full"] += not ok
        if step % 50 == 0:
            m.check()
    m.check()
    # Every kind of operation ran, including ones that found the pool full.
    assert all(counts[k] > 100 for k in counts), counts
    assert m.alloc.prefix_hit_blocks > 0
    # After freeing everything, every block is free or cached: nothing leaked.
    for seq in sorted(m.expected):
        m.free(seq)
    m.check()
    assert sum(m.alloc.refcount) == 0
    assert len(m.alloc.free_blocks()) + len(m.alloc.cached_blocks()) == m.alloc.num_blocks


def test_prefix_sharing_reuses_full_blocks_and_never_the_last_token():
    a = BlockAllocator(16, 4)
    assert a.add("a", list(range(10))) == 0
    assert a.add("b", list(range(10))) == 8  # two full blocks shared
    assert a.block_table("a")[:2] == a.block_table("b")[:2]
    assert a.block_table("a")[2] != a.block_table("b")[2]
    assert a.add("c", list(range(8))) == 4  # block 2 holds the last token: computed again
    assert a.add("d", [0, 1, 2, 3, 9, 9]) == 4  # the chain diverges in block 2
    assert a.add("e", [5, 1, 2, 3, 4, 5, 6, 7, 8]) == 0  # same block 2 tokens, different prefix


def test_freed_blocks_stay_cached_and_are_recycled_least_recent_first():
    a = BlockAllocator(4, 4)
    a.add("x", list(range(9)))  # blocks: 2 full (hashed) + 1 partial
    x_blocks = a.block_table("x")
    a.free("x")
    # Released tail first: the chain's last block is the least recently used, so an
    # eviction shortens a published prefix from its end and its head stays shareable.
    assert a.cached_blocks() == x_blocks[:2][::-1] and x_blocks[2] in a.free_blocks()
    a.add("v", [70] * 12)  # 3 blocks: the 2 free ones and the least recent cached one
    assert a.cached_blocks() == [x_blocks[0]] and a.cached_prefix(list(range(9))) == 4
    a.free("v")
    a.add("x", list(range(9)))  # the tail block is recomputed, the head found again
    x_blocks = a.block_table("x")
    a.free("x")
    assert a.add("y", list(range(9))) == 8  # found again after its owner left
    assert a.block_table("y")[:2] == x_blocks[:2]
    a.free("y")
    a.add("z", [50] * 13)  # needs all 4 blocks: the cached ones are recycled
    assert a.cached_blocks() == [] and a.num_free == 0
    assert sorted(a.block_table("z")) == [0, 1, 2, 3]
    a.free("z")
    assert a.add("w", list(range(9))) == 0  # the old prefix is gone for good


def test_a_prefix_two_chains_continue_is_recycled_after_every_other_cached_block():
    a = BlockAllocator(7, 4)
    system = [7] * 8  # two blocks every conversation starts with
    a.add("turn1", system + [1] * 5)
    a.free("turn1")
    a.add("turn2", system + [1] * 8 + [2])  # the same chain, continued: nothing is shared yet
    a.free("turn2")
    assert a.num_pinned == 0
    a.add("other", system + [3] * 5)  # a second continuation: the system blocks are a shared prefix
    a.free("other")
    assert a.num_pinned == 2
    shared = a.cached_blocks()[-2:]  # recycle order: pinned blocks last
    assert a.add("probe", system + [0]) == 8 and sorted(a.block_table("probe")[:2]) == sorted(shared)
    a.free("probe")
    a.add("long", [9] * 20)  # 5 blocks: every unpinned cached block goes first
    assert sorted(a.cached_blocks()) == sorted(shared)
    assert a.cached_prefix(system + [0]) == 8
    a.free("long")
    a.add("all", [8] * 28)  # only when nothing else is left do pinned blocks go
    assert a.num_pinned == 0 and a.cached_prefix(system + [0]) == 0


def test_fork_copies_on_write_and_parent_is_untouched():
    a = BlockAllocator(8, 4)
    a.add("p", list(range(6)))
    a.fork("p", "c")
    assert a.refcount[a.block_table("p")[1]] == 2
    result = a.append("c", [99])
    assert len(result.copies) == 1
    src, dst = result.copies[0]
    assert src == a.block_table("p")[1] and dst == a.block_table("c")[1]
    assert a.refcount[src] == 1 and a.refcount[dst] == 1
    assert a.block_table("p")[0] == a.block_table("c")[0]  # full blocks stay shared
    assert a.append("p", [7]).copies == []  # parent now owns its block alone


def test_kv_cache_full_leaves_allocator_unchanged():
    m = ShadowedAllocator(num_blocks=3)
    assert m.add(list(range(9)))  # 3 blocks
    before = m.snapshot()
    assert not m.add([1, 2, 3])
    assert not m.append(0, [1, 2, 3, 4])
    assert m.snapshot() == before
    with pytest.raises(KVCacheFull, match=r"\[append\].*needs 1 blocks"):
        m.alloc.append(0, [1, 2, 3, 4])


def test_evict_releases_only_blocks_outside_window_and_keeps_sinks():
    a = BlockAllocator(16, 4)
    a.add("s", num_tokens=30)  # blocks 0..7
    assert a.evict("s", window=10, keep=5) == 3  # blocks 2,3,4 (tokens 8..19); 0,1 hold sinks
    table = a.block_table("s")
    assert [i for i, b in enumerate(table) if b == HOLE] == [2, 3, 4]
    assert a.evict("s", window=10, keep=5) == 0
    with pytest.raises(ValueError, match=r"\[slots\].*evicted"):
        a.slots("s", 8, 12)
    assert list(a.slots("s", 20, 21)) == [table[5] * 4]


def test_bad_arguments_raise_named_errors():
    with pytest.raises(ValueError, match=r"\[BlockAllocator\] num_blocks"):
        BlockAllocator(0, 4)
    a = BlockAllocator(4, 4)
    with pytest.raises(KeyError, match=r"\[append\] unknown sequence"):
        a.append("nope", [1])
    a.add("a", [1, 2])
    with pytest.raises(ValueError, match=r"\[add\] sequence 'a' already exists"):
        a.add("a", [1])
    with pytest.raises(TypeError, match=r"\[add\] pass exactly one"):
        a.add("b")
    with pytest.raises(ValueError, match=r"\[evict\] window"):
        a.evict("a", window=-1)
    with pytest.raises(ValueError, match=r"\[truncate\] num_tokens"):
        a.truncate("a", 5)


def test_a_published_block_is_never_written_in_place():
    # issue 10 item 1: B truncates into a block it shares with A, A leaves, B appends.
    a = BlockAllocator(8, 8)
    prefix = list(range(100, 116))
    a.add("A", prefix + [1])
    assert a.add("B", prefix + [1]) == 16
    shared = a.block_table("B")[1]
    a.truncate("B", 12)
    assert a.is_published(shared)  # its rows are still valid after the truncate
    assert a.add("D", prefix + [3]) == 16  # ... so another prompt may still share it
    a.free("D")
    a.free("A")
    old_hash = a.block_hash(shared)
    result = a.append("B", [7, 7, 7, 7])  # B alone owns it now: it loses its hash before the write
    assert result.copies == [] and a.block_hash(shared) != old_hash  # now published as B's block
    assert a.add("C", prefix + [2]) == 8  # only the first block is a real hit
    assert a.block_table("C")[1] != shared


def test_fork_truncate_then_append_copies_the_shared_published_block():
    a = BlockAllocator(8, 4)
    a.add("p", list(range(9)))
    a.fork("p", "c")
    a.truncate("c", 6)  # into block 1, full and published, shared with p
    block = a.block_table("c")[1]
    result = a.append("c", [50])
    assert result.copies == [(block, a.block_table("c")[1])]
    assert a.is_published(block) and a.block_table("p")[1] == block
    a.free("p")
    assert a.add("q", list(range(9))) == 8  # p's blocks are still found by their prefix


@pytest.mark.parametrize("seed", range(6))
def test_random_walk_of_truncates_and_appends_over_shared_prefixes(seed):
    # Truncate-heavy walks over one prefix: the pattern that exposed the in-place write.
    rng = np.random.default_rng(seed)
    m = ShadowedAllocator(num_blocks=24)
    base = [int(t) for t in rng.integers(0, 4, 12)]
    for _ in range(400):
        seqs = sorted(m.expected)
        op = rng.choice(["add", "append", "truncate", "free", "fork"]) if seqs else "add"
        seq = seqs[rng.integers(len(seqs))] if seqs else None
        if op == "add":
            m.add(base[: rng.integers(4, 13)] + [int(t) for t in rng.integers(0, 4, rng.integers(0, 4))])
        elif op == "append":
            m.append(seq, [int(t) for t in rng.integers(0, 4, rng.integers(1, 5))])
        elif op == "truncate":
            m.truncate(seq, int(rng.integers(0, m.alloc.num_tokens(seq) + 1)))
        elif op == "fork":
            m.fork(seq)
        else:
            m.free(seq)
        m.check()
    assert m.alloc.prefix_hit_blocks > 20


@pytest.mark.parametrize("call,error,match", [
    (lambda a: a.add("x", [1, 2.5]), TypeError, r"\[add\] tokens must be int token ids, got 2.5"),
    (lambda a: a.add("x", [True]), TypeError, r"\[add\] tokens must be int token ids, got True"),
    (lambda a: a.add("x", "abc"), TypeError, r"\[add\] tokens must be a sequence of int token ids"),
    (lambda a: a.add("x", num_tokens=True), ValueError, r"\[add\] num_tokens must be an int >= 0"),
    (lambda a: a.append("a", num_tokens=-1), ValueError, r"\[append\] num_tokens must be an int >= 0"),
    (lambda a: a.truncate("a", True), ValueError, r"\[truncate\] num_tokens"),
    (lambda a: a.evict("a", window=2.0), ValueError, r"\[evict\] window must be an int >= 0"),
    (lambda a: a.slots("a", 0.0, 1), ValueError, r"\[slots\] token range"),
    (lambda a: a.grow(0), ValueError, r"\[grow\] num_new must be an int >= 1"),
    (lambda a: BlockAllocator(4, True), ValueError, r"\[BlockAllocator\] block_size must be an int >= 1"),
])
def test_bad_values_are_named_and_change_nothing(call, error, match):
    a = BlockAllocator(4, 4)
    a.add("a", [1, 2, 3])
    before = (list(a.refcount), a.block_table("a"), a.num_free)
    with pytest.raises(error, match=match):
        call(a)
    assert (list(a.refcount), a.block_table("a"), a.num_free) == before
