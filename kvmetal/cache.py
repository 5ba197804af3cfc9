"""PagedKVCache: one block pool for every layer of a model, and the allocator behind it.

Vocabulary (vLLM's, see docs/design.md for the tensor layouts):

    block        ``block_size`` consecutive token slots; block ``b`` of layer ``l`` is
                 ``key_caches[l][b]`` / ``value_caches[l][b]`` ([Hkv, bs, D] each)
    block table  a sequence's list of block ids: token ``t`` lives in slot
                 ``table[t // bs] * bs + t % bs``; the same table serves every layer
    refcount     how many (sequence, table position) pairs point at a block
    prefix hash  chain hash of the token ids of a *full* block and of every block
                 before it, so equal hashes mean equal prefixes, not just equal blocks

A block is always in exactly one of three places:

    free     refcount 0, content meaningless
    cached   refcount 0, content still valid and findable by its prefix hash;
             reused by a new prompt with that prefix, or recycled in LRU order
             when the free list is empty; a block of a *shared prefix* (one that
             two different chains continue, a system prompt) is pinned: recycled
             only after every other cached block
    owned    refcount >= 1

Shared blocks are never written: appending to a sequence whose partly filled last
block is shared first copies that block (copy-on-write, via ``copy_blocks``). Every
operation that needs blocks checks that enough exist before changing anything, so
``KVCacheFull`` leaves the cache exactly as it was.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from . import ops, quant

HOLE = -1  # a table entry whose block was evicted by a sliding window


class KVCacheFull(RuntimeError):
    """Not enough free or recyclable blocks; the cache was left unchanged."""


def _is_int(value) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_int(op: str, name: str, value, minimum: int = 0) -> int:
    if not _is_int(value) or value < minimum:
        raise ValueError(f"[{op}] {name} must be an int >= {minimum}, got {value!r}")
    return int(value)


def _token_count(op: str, tokens, num_tokens) -> tuple:
    """(token ids as ints or None, how many): exactly one of ``tokens`` / ``num_tokens``."""
    if (tokens is None) == (num_tokens is None):
        raise TypeError(f"[{op}] pass exactly one of tokens (ids) or num_tokens")
    if tokens is not None:
        if isinstance(tokens, mx.array):
            tokens = tokens.tolist()
        if isinstance(tokens, (str, bytes)) or not hasattr(tokens, "__iter__"):
            raise TypeError(f"[{op}] tokens must be a sequence of int token ids, got {type(tokens).__name__}")
        tokens = list(tokens)
        bad = next((t for t in tokens if not _is_int(t)), None)
        if bad is not None:
            raise TypeError(f"[{op}] tokens must be int token ids, got {bad!r}")
        bad = next((t for t in tokens if t < 0), None)
        if bad is not None:
            raise ValueError(f"[{op}] tokens must be token ids >= 0, got {bad!r}")
        return [int(t) for t in tokens], len(tokens)
    return None, _check_int(op, "num_tokens", num_tokens)


def _chain_hash(previous: bytes, tokens) -> bytes:
    data = np.asarray(tokens, dtype=np.int64).tobytes()
    return hashlib.blake2b(previous + data, digest_size=16).digest()


@dataclass
class _Sequence:
    blocks: list = field(default_factory=list)  # block ids, HOLE where evicted
    num_tokens: int = 0
    tokens: list | None = field(default_factory=list)  # token ids; None once unknown (no hashing)
    hashes: list = field(default_factory=list)  # chain hash of each full block, in order
    # Lowest table index changed since a table mirror last read this sequence (0: all of it).
    dirty_from: int = 0


@dataclass
class Append:
    """What an append did: the slot of every new token and the copy-on-write copies made."""

    slots: np.ndarray  # int64 [n]
    copies: list  # [(src_block, dst_block)], to be applied to every layer before writing


class BlockAllocator:
    """Block ownership for one pool (pure Python; no tensors).

    Deterministic: which blocks a call hands out depends only on the calls made before
    it (a FIFO free list, an LRU list of cached blocks, no randomness, no ordering by
    object ids). Processes that make the same calls get the same block tables, which
    is what lets every rank of a model sharded by kv heads over ``mx.distributed`` run
    its own allocator without exchanging tables.

    Args:
        num_blocks: blocks in the pool.
        block_size: token slots per block.
    """

    def __init__(self, num_blocks: int, block_size: int):
        for name, value in (("num_blocks", num_blocks), ("block_size", block_size)):
            _check_int("BlockAllocator", name, value, 1)
        self.block_size = int(block_size)
        self.num_blocks = 0
        self.refcount: list = []
        self._free: deque = deque()
        self._cached: OrderedDict = OrderedDict()  # block -> None, least recently freed first
        self._pinned: OrderedDict = OrderedDict()  # cached blocks of a shared prefix, recycled last
        self._child: dict = {}  # published hash -> the first hash seen to extend it
        self._shared_prefix: set = set()  # hashes of blocks that lead to a branch of the chain
        self._hash_of_block: dict = {}
        self._block_of_hash: dict = {}
        self._seqs: dict = {}
        self.prefix_hit_blocks = 0  # blocks a new sequence found already computed
        self.num_owned = 0  # blocks with refcount >= 1, kept current for O(1) accounting
        self.grow(num_blocks)

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks that can be handed out now (free plus cached-and-recyclable)."""
        return len(self._free) + len(self._cached) + len(self._pinned)

    @property
    def num_free_listed(self) -> int:
        """Blocks on the free list (content meaningless)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        """Blocks nobody owns whose content is still findable by prefix hash."""
        return len(self._cached) + len(self._pinned)

    @property
    def num_pinned(self) -> int:
        """Cached blocks of a shared prefix (two chains continue it), recycled last."""
        return len(self._pinned)

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    @property
    def total_tokens(self) -> int:
        """Tokens held by every sequence (shared ones counted per sequence)."""
        return sum(s.num_tokens for s in self._seqs.values())

    @property
    def num_shared(self) -> int:
        """Blocks owned by more than one (sequence, table position)."""
        return sum(1 for r in self.refcount if r > 1)

    def is_published(self, block: int) -> bool:
        """Whether ``block`` can be found by its prefix hash (and so must not be written)."""
        return block in self._hash_of_block

    def sequences(self) -> list:
        return list(self._seqs)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self._seqs

    def num_tokens(self, seq_id) -> int:
        return self._seq("num_tokens", seq_id).num_tokens

    def block_table(self, seq_id) -> list:
        """The sequence's block ids (``HOLE`` where a sliding window evicted one)."""
        return list(self._seq("block_table", seq_id).blocks)

    def tokens(self, seq_id) -> list | None:
        seq = self._seq("tokens", seq_id)
        return None if seq.tokens is None else list(seq.tokens)

    def cached_blocks(self) -> list:
        """Cached blocks in the order they would be recycled (pinned ones last)."""
        return list(self._cached) + list(self._pinned)

    def free_blocks(self) -> list:
        return list(self._free)

    def block_hash(self, block: int) -> bytes | None:
        return self._hash_of_block.get(block)

    def slots(self, seq_id, start: int, stop: int) -> np.ndarray:
        """Slots of tokens ``start..stop-1`` of a sequence."""
        seq = self._seq("slots", seq_id)
        if not (_is_int(start) and _is_int(stop)) or not 0 <= start <= stop <= seq.num_tokens:
            raise ValueError(f"[slots] token range [{start}, {stop}) is outside the sequence's {seq.num_tokens} tokens")
        positions = np.arange(start, stop)
        table = np.asarray(seq.blocks, dtype=np.int64)
        blocks = table[positions // self.block_size] if positions.size else positions
        if (blocks == HOLE).any():
            raise ValueError(f"[slots] tokens in [{start}, {stop}) were evicted by a sliding window")
        return blocks * self.block_size + positions % self.block_size

    def blocks_needed(self, seq_id, num_new: int) -> int:
        """Blocks an append of ``num_new`` tokens would take (copy-on-write included)."""
        seq = self._seq("blocks_needed", seq_id)
        return self._blocks_needed(seq, num_new)

    # ------------------------------------------------------------------ sequence lifecycle

    def add(self, seq_id, tokens=None, *, num_tokens: int | None = None, share_limit: int | None = None) -> int:
        """Start a sequence holding ``tokens`` (ids; enables prefix sharing) or ``num_tokens``.

        Full blocks whose chain hash is already known are shared instead of allocated,
        up to but excluding the block holding the last token (the caller always has at
        least one token to run through the model) and to at most ``share_limit``
        tokens. Returns how many leading tokens were found cached: their K/V are in
        place and need not be written.

        A block's hash is registered as soon as the block is full, before the caller
        writes its K/V: write the tokens of an ``add``/``append`` before the next
        ``add``, or undo them with ``truncate``.
        """
        if seq_id in self._seqs:
            raise ValueError(f"[add] sequence {seq_id!r} already exists")
        tokens, count = _token_count("add", tokens, num_tokens)
        hashes, hits, needed, available = self._plan_add(tokens, count, share_limit)
        if needed > available:
            raise KVCacheFull(f"[add] sequence {seq_id!r} needs {needed} blocks, only {available} are free")
        for b in hits:
            self._acquire(b)
        seq = _Sequence(blocks=hits + self._take(needed), num_tokens=count,
                        tokens=tokens, hashes=hashes[: len(hits)])
        self._seqs[seq_id] = seq
        self.prefix_hit_blocks += len(hits)
        self._register_full_blocks(seq)
        return len(hits) * self.block_size

    def can_add(self, tokens=None, *, num_tokens: int | None = None, share_limit: int | None = None,
                recycle_cached: bool = True) -> bool:
        """Whether ``add`` would find enough blocks (changes nothing).

        With ``recycle_cached=False`` only the free list counts: the add must not evict
        any cached block (a loader filling the prefix cache must not recycle what it
        loaded a moment ago)."""
        tokens, count = _token_count("can_add", tokens, num_tokens)
        _, _, needed, available = self._plan_add(tokens, count, share_limit)
        return needed <= (available if recycle_cached else len(self._free))

    def cached_prefix(self, tokens) -> int:
        """How many leading tokens ``add(tokens)`` would find cached (changes nothing)."""
        return len(self._plan_add([int(t) for t in tokens], len(tokens), None)[1]) * self.block_size

    def append(self, seq_id, tokens=None, *, num_tokens: int | None = None, ids_later: bool = False) -> Append:
        """Extend a sequence by ``tokens`` (ids) or ``num_tokens``; return their slots.

        ``ids_later`` (with ``num_tokens``): the ids are not known yet (a token still being
        sampled on the device); ``provide_ids`` gives them, and hashing of the blocks they
        complete waits until then instead of stopping for good."""
        seq = self._seq("append", seq_id)
        tokens, count = _token_count("append", tokens, num_tokens)
        if ids_later and tokens is not None:
            raise ValueError("[append] ids_later takes num_tokens, not tokens")
        if tokens is not None and seq.tokens is not None and len(seq.tokens) < seq.num_tokens:
            raise ValueError(f"[append] sequence {seq_id!r} still waits for the ids of "
                             f"{seq.num_tokens - len(seq.tokens)} tokens (provide_ids first)")
        needed = self._blocks_needed(seq, count)
        if needed > self.num_free:
            raise KVCacheFull(f"[append] sequence {seq_id!r} needs {needed} blocks for {count} tokens, "
                              f"only {self.num_free} are free")
        copies = []
        bs = self.block_size
        if count and seq.num_tokens % bs:
            copies += self._make_last_block_writable(seq)
        start = seq.num_tokens
        seq.dirty_from = min(seq.dirty_from, len(seq.blocks))
        seq.blocks += self._take(-(-(start + count) // bs) - len(seq.blocks))
        seq.num_tokens += count
        if seq.tokens is not None and not ids_later:
            if tokens is None:
                seq.tokens = None  # ids unknown from here on: stop hashing this sequence
            else:
                seq.tokens += tokens
        self._register_full_blocks(seq)
        return Append(self.slots(seq_id, start, start + count), copies)

    def provide_ids(self, seq_id, tokens) -> None:
        """The ids of tokens appended with ``ids_later``, oldest first; the blocks they
        complete are published now. A sequence that stopped hashing ignores them."""
        seq = self._seq("provide_ids", seq_id)
        tokens, count = _token_count("provide_ids", tokens, None)
        if seq.tokens is None:
            return
        if len(seq.tokens) + count > seq.num_tokens:
            raise ValueError(f"[provide_ids] sequence {seq_id!r} waits for {seq.num_tokens - len(seq.tokens)} ids, "
                             f"got {count}")
        seq.tokens += tokens
        self._register_full_blocks(seq)

    def take_table_changes(self, seq_id) -> tuple:
        """(the sequence's block list, lowest index changed since the last call): what a
        table mirror must copy. Marks the sequence clean; one mirror per allocator."""
        seq = self._seq("take_table_changes", seq_id)
        first, seq.dirty_from = seq.dirty_from, len(seq.blocks)
        return seq.blocks, first

    def fork(self, parent_id, child_id) -> None:
        """``child_id`` starts as a copy of ``parent_id`` sharing every block."""
        parent = self._seq("fork", parent_id)
        if child_id in self._seqs:
            raise ValueError(f"[fork] sequence {child_id!r} already exists")
        for b in parent.blocks:
            if b != HOLE:
                self._acquire(b)
        self._seqs[child_id] = _Sequence(
            blocks=list(parent.blocks), num_tokens=parent.num_tokens,
            tokens=None if parent.tokens is None else list(parent.tokens), hashes=list(parent.hashes))

    def free(self, seq_id) -> None:
        """Drop a sequence; its blocks go back at once (hashed ones stay findable)."""
        seq = self._seq("free", seq_id)
        # Tail first: a prefix's later blocks become the least recently used, so evictions
        # cut a published chain from its end and its leading blocks stay shareable.
        for b in reversed(seq.blocks):
            if b != HOLE:
                self._release(b)
        del self._seqs[seq_id]

    def evict(self, seq_id, *, window: int, keep: int = 0) -> int:
        """Release blocks wholly outside the last ``window`` tokens, except those
        holding the first ``keep`` (sink) tokens. Returns how many were released."""
        seq = self._seq("evict", seq_id)
        window, keep = _check_int("evict", "window", window), _check_int("evict", "keep", keep)
        bs = self.block_size
        first = -(-keep // bs)
        stop = max(0, seq.num_tokens - window) // bs
        released = 0
        for i in range(first, stop):
            if seq.blocks[i] != HOLE:
                self._release(seq.blocks[i])
                seq.blocks[i] = HOLE
                seq.dirty_from = min(seq.dirty_from, i)
                released += 1
        return released

    def unpublish(self, seq_id, first_block: int = 0) -> None:
        """Withdraw the prefix hashes of the sequence's blocks from ``first_block`` on, so
        no later prompt shares them (a loader whose rows never arrived calls this)."""
        for b in self._seq("unpublish", seq_id).blocks[first_block:]:
            if b != HOLE:
                self._unpublish(b)

    def truncate(self, seq_id, num_tokens: int) -> None:
        """Keep only the first ``num_tokens`` tokens of a sequence (releases the rest)."""
        seq = self._seq("truncate", seq_id)
        if not _is_int(num_tokens) or not 0 <= num_tokens <= seq.num_tokens:
            raise ValueError(f"[truncate] num_tokens must be in [0, {seq.num_tokens}], got {num_tokens!r}")
        bs = self.block_size
        keep_blocks = -(-num_tokens // bs)
        if keep_blocks and seq.blocks[keep_blocks - 1] == HOLE:
            raise ValueError("[truncate] cannot truncate into tokens a sliding window evicted")
        for b in seq.blocks[keep_blocks:]:
            if b != HOLE:
                self._release(b)
        del seq.blocks[keep_blocks:]
        seq.dirty_from = min(seq.dirty_from, keep_blocks)
        seq.num_tokens = int(num_tokens)
        del seq.hashes[num_tokens // bs:]
        if seq.tokens is not None:
            del seq.tokens[num_tokens:]
        # A published last block keeps its hash (its rows are still valid): the next
        # append makes it writable first (_make_last_block_writable).

    def grow(self, num_new: int) -> None:
        """Add ``num_new`` free blocks (ids continue after the current ones)."""
        num_new = _check_int("grow", "num_new", num_new, 1)
        start = self.num_blocks
        self.num_blocks += int(num_new)
        self.refcount += [0] * int(num_new)
        self._free.extend(range(start, self.num_blocks))

    # ------------------------------------------------------------------ internals

    def _seq(self, op: str, seq_id) -> _Sequence:
        try:
            return self._seqs[seq_id]
        except KeyError:
            raise KeyError(f"[{op}] unknown sequence {seq_id!r}") from None

    def _plan_add(self, tokens, count: int, share_limit: int | None) -> tuple:
        """(chain hashes of full blocks, cached blocks to share, blocks to take, blocks available)."""
        bs = self.block_size
        hashes, hits = [], []
        if tokens is not None:
            previous = b""
            for i in range(len(tokens) // bs):
                previous = _chain_hash(previous, tokens[i * bs:(i + 1) * bs])
                hashes.append(previous)
            # Share the longest cached run among the first count - 1 tokens.
            limit = count - 1 if share_limit is None else min(count - 1, share_limit)
            for i, h in enumerate(hashes):
                if (i + 1) * bs > limit or h not in self._block_of_hash:
                    break
                hits.append(self._block_of_hash[h])
        needed = -(-count // bs) - len(hits)
        available = self.num_free - sum(1 for b in hits if self.refcount[b] == 0)
        return hashes, hits, needed, available

    def _make_last_block_writable(self, seq: _Sequence) -> list:
        """Before rows go into ``seq``'s partly filled last block: a published block is
        immutable, so a shared one is copied (copy-on-write) and an unshared one loses
        its hash. Returns the copies made, [(src, dst)]."""
        last = seq.blocks[-1]
        if self.refcount[last] > 1:
            fresh = self._take(1)[0]
            self._release(last)
            seq.blocks[-1] = fresh
            seq.dirty_from = min(seq.dirty_from, len(seq.blocks) - 1)
            return [(last, fresh)]
        self._unpublish(last)
        return []

    def _unpublish(self, b: int) -> None:
        h = self._hash_of_block.pop(b, None)
        if h is not None:
            del self._block_of_hash[h]
            self._child.pop(h, None)
            self._shared_prefix.discard(h)

    def _blocks_needed(self, seq: _Sequence, count: int) -> int:
        bs = self.block_size
        new = -(-(seq.num_tokens + count) // bs) - len(seq.blocks)
        cow = count > 0 and seq.num_tokens % bs != 0 and self.refcount[seq.blocks[-1]] > 1
        return new + int(cow)

    def _take(self, n: int) -> list:
        """n blocks with refcount 1: free ones first, then the least recently used cached ones."""
        assert n <= self.num_free, "callers check capacity before changing anything"
        taken = []
        for _ in range(n):
            if self._free:
                b = self._free.popleft()
            else:
                b, _ = (self._cached or self._pinned).popitem(last=False)
                self._unpublish(b)
            self.refcount[b] = 1
            self.num_owned += 1
            taken.append(b)
        return taken

    def _acquire(self, b: int) -> None:
        if self.refcount[b] == 0:
            del (self._cached if b in self._cached else self._pinned)[b]
            self.num_owned += 1
        self.refcount[b] += 1

    def _release(self, b: int) -> None:
        self.refcount[b] -= 1
        if self.refcount[b] == 0:
            self.num_owned -= 1
            if b in self._hash_of_block:  # the most recently used end
                pinned = self._hash_of_block[b] in self._shared_prefix
                (self._pinned if pinned else self._cached)[b] = None
            else:
                self._free.append(b)

    def _note_child(self, hashes: list, i: int) -> None:
        """Block ``i`` of a chain now extends block ``i - 1``; a second, different
        extension makes every block up to ``i - 1`` a shared prefix (pinned when cached)."""
        parent = hashes[i - 1]
        if parent not in self._block_of_hash:
            return
        first = self._child.setdefault(parent, hashes[i])
        if first != hashes[i] and parent not in self._shared_prefix:
            for h in hashes[:i]:
                if h in self._shared_prefix:
                    continue  # its ancestors were marked with it
                self._shared_prefix.add(h)
                b = self._block_of_hash.get(h)
                if b is not None and b in self._cached:  # cached now: move it with its mark
                    del self._cached[b]
                    self._pinned[b] = None

    def _register_full_blocks(self, seq: _Sequence) -> None:
        """Hash every newly full block so later prompts with the same prefix can share it."""
        if seq.tokens is None:
            return
        bs = self.block_size
        while len(seq.hashes) < len(seq.tokens) // bs:  # blocks whose every id is known
            i = len(seq.hashes)
            h = _chain_hash(seq.hashes[-1] if seq.hashes else b"", seq.tokens[i * bs:(i + 1) * bs])
            seq.hashes.append(h)
            if i:
                self._note_child(seq.hashes, i)
            b = seq.blocks[i]
            if b != HOLE and h not in self._block_of_hash and b not in self._hash_of_block:
                self._block_of_hash[h] = b
                self._hash_of_block[b] = h


class PagedKVCache:
    """K/V block pools for every layer of a model, with one allocator and block tables.

    Args:
        num_layers: layers whose K/V live in the pool (each has its own arrays).
        num_kv_heads, head_dim: per-layer K/V shape (docs/design.md: [N, Hkv, bs, D]).
        num_blocks: blocks in the pool (``grow`` adds more).
        block_size: tokens per block (8, 16 or 32).
        dtype: float dtype of the cache (also what a quantized cache dequantizes to).
        k_bits, v_bits: quantize K and/or V to these bits (None keeps them float).
        group_size: quantization group size along head_dim, for K and V;
        k_group_size, v_group_size: one side's own group size (None: ``group_size``).

    Sequence ids are any hashable. Typical use per forward pass::

        cached = cache.add_sequence(seq, prompt_ids)          # prefix sharing
        slots = cache.slots(seq, cached, len(prompt_ids))     # write these tokens
        cache.write(layer, keys, values, slots)               # per layer
        tables, lens = cache.block_tables([seq, ...])
    """

    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, num_blocks: int,
                 block_size: int = 16, dtype=mx.float16, k_bits: int | None = None,
                 v_bits: int | None = None, group_size: int = quant.DEFAULT_GROUP_SIZE,
                 k_group_size: int | None = None, v_group_size: int | None = None):
        for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim), ("num_blocks", num_blocks)):
            _check_int("PagedKVCache", name, value, 1)
        if block_size not in ops.SUPPORTED_BLOCK_SIZES:
            raise ValueError(f"[PagedKVCache] block_size must be one of {ops.SUPPORTED_BLOCK_SIZES}, got {block_size!r}")
        if head_dim not in ops.SUPPORTED_HEAD_DIMS:  # the attention kernels serve these only
            raise ValueError(f"[PagedKVCache] head_dim must be one of {ops.SUPPORTED_HEAD_DIMS}, got {head_dim!r}")
        if dtype not in ops.FLOAT_DTYPES:
            raise TypeError(f"[PagedKVCache] dtype must be one of float16, bfloat16, float32, got {dtype}")
        for name, bits in (("k_bits", k_bits), ("v_bits", v_bits)):
            if bits is not None and bits not in quant.SUPPORTED_BITS:
                raise ValueError(f"[PagedKVCache] {name} must be None or one of {quant.SUPPORTED_BITS}, got {bits!r}")
        k_group_size = group_size if k_group_size is None else k_group_size
        v_group_size = group_size if v_group_size is None else v_group_size
        for name, bits, group in (("k_group_size", k_bits, k_group_size), ("v_group_size", v_bits, v_group_size)):
            if bits and head_dim % group:
                name = name if group != group_size else "group_size"
                raise ValueError(f"[PagedKVCache] head_dim {head_dim} is not a multiple of {name} {group}")
        self.num_layers, self.num_kv_heads, self.head_dim = int(num_layers), int(num_kv_heads), int(head_dim)
        self.block_size, self.dtype = int(block_size), dtype
        self.k_bits, self.v_bits = k_bits, v_bits
        self.k_group_size, self.v_group_size = k_group_size, v_group_size
        self.allocator = BlockAllocator(num_blocks, block_size)
        # One physical block more than the allocator hands out: the zero null block.
        self.key_caches = [self._empty(num_blocks + 1, k_bits, k_group_size) for _ in range(num_layers)]
        self.value_caches = [self._empty(num_blocks + 1, v_bits, v_group_size) for _ in range(num_layers)]

    @property
    def group_size(self) -> int:
        """The group size of K and V (K's, where they differ)."""
        return self.k_group_size

    # ------------------------------------------------------------------ sequences

    def add_sequence(self, seq_id, tokens=None, *, num_tokens: int | None = None,
                     share_limit: int | None = None) -> int:
        """Allocate a sequence for ``tokens`` (ids) or ``num_tokens``; returns the number of
        leading tokens already cached through prefix sharing (skip writing those)."""
        return self.allocator.add(seq_id, tokens, num_tokens=num_tokens, share_limit=share_limit)

    def append(self, seq_id, tokens=None, *, num_tokens: int | None = None, ids_later: bool = False) -> np.ndarray:
        """Extend a sequence; returns the slots of the new tokens (copy-on-write applied).
        ``ids_later``: see ``BlockAllocator.append`` (then ``provide_ids``)."""
        result = self.allocator.append(seq_id, tokens, num_tokens=num_tokens, ids_later=ids_later)
        self._copy(result.copies)
        return result.slots

    def provide_ids(self, seq_id, tokens) -> None:
        self.allocator.provide_ids(seq_id, tokens)

    def fork(self, parent_id, child_id) -> None:
        self.allocator.fork(parent_id, child_id)

    def free(self, seq_id) -> None:
        self.allocator.free(seq_id)

    def evict(self, seq_id, *, window: int, keep: int = 0) -> int:
        return self.allocator.evict(seq_id, window=window, keep=keep)

    def truncate(self, seq_id, num_tokens: int) -> None:
        self.allocator.truncate(seq_id, num_tokens)

    def num_tokens(self, seq_id) -> int:
        return self.allocator.num_tokens(seq_id)

    def slots(self, seq_id, start: int, stop: int) -> np.ndarray:
        return self.allocator.slots(seq_id, start, stop)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self.allocator

    def grow(self, num_new: int) -> None:
        """Add ``num_new`` zeroed blocks to every layer's pool (the null block, zero,
        becomes an ordinary block and a new zero block past them takes its role)."""
        _check_int("grow", "num_new", num_new, 1)
        self.key_caches = [self._extend(c, num_new, self.k_bits, self.k_group_size) for c in self.key_caches]
        self.value_caches = [self._extend(c, num_new, self.v_bits, self.v_group_size) for c in self.value_caches]
        self.allocator.grow(num_new)

    # ------------------------------------------------------------------ tensors

    def write(self, layer: int, keys: mx.array, values: mx.array, slots) -> None:
        """Store rows ``keys``/``values`` [T, Hkv, D] of ``layer`` at ``slots`` [T].

        ``slots`` come from ``add_sequence``/``append``/``slots``; a negative slot skips its
        row. Each slot must lie in a block exactly one sequence owns: a free or cached
        block is nobody's to write, and a shared block is read by several sequences
        (``append`` copies it first). Checked on the host before anything is written."""
        if not _is_int(layer) or not 0 <= layer < self.num_layers:
            raise ValueError(f"[PagedKVCache.write] layer must be an int in [0, {self.num_layers}), got {layer!r}")
        host = np.asarray(slots.tolist() if isinstance(slots, mx.array) else slots)
        if host.ndim != 1 or not (host.size == 0 or np.issubdtype(host.dtype, np.integer)):
            raise ValueError(f"[PagedKVCache.write] slots must be a 1-D array of ints, got {host.dtype} "
                             f"with shape {host.shape}")
        host = host.astype(np.int64, copy=False)
        num_slots = self.allocator.num_blocks * self.block_size
        if host.size and host.max() >= num_slots:
            t = int(np.argmax(host >= num_slots))
            raise ValueError(f"[PagedKVCache.write] slots[{t}] = {host[t]} is out of range [0, {num_slots})")
        live = host[host >= 0]
        refs = np.asarray(self.allocator.refcount, dtype=np.int64)[live // self.block_size]
        if (refs != 1).any():
            t = int(np.flatnonzero(host >= 0)[np.argmax(refs != 1)])
            block = int(host[t] // self.block_size)
            whose = "no sequence owns" if self.allocator.refcount[block] == 0 else "several sequences share"
            raise ValueError(f"[PagedKVCache.write] slots[{t}] = {host[t]} lies in block {block}, which {whose}; "
                             f"write only the slots add_sequence/append returned")
        if np.unique(live).size != live.size:
            raise ValueError("[PagedKVCache.write] slots name the same slot twice; each slot takes one token")
        self._write_trusted(layer, keys, values, mx.array(host.astype(np.int32)))

    def _write_trusted(self, layer: int, keys: mx.array, values: mx.array, slots: mx.array) -> None:
        """``write`` for slots the caller took from this cache's allocator (no host checks)."""
        self.key_caches[layer], self.value_caches[layer] = ops.reshape_and_cache(
            keys, values, self.key_caches[layer], self.value_caches[layer], slots, validate=False)

    @property
    def null_block(self) -> int:
        """The reserved all-zero block that evicted table entries point at (never written)."""
        return self.allocator.num_blocks

    def block_tables(self, seq_ids) -> tuple:
        """(block_tables int32 [S, M], seq_lens int32 [S]) for ``seq_ids`` (S may be 0).

        Entries a sliding window evicted point at the reserved zero ``null_block``;
        attention with the matching ``sliding_window`` never reads them, and a gather
        returns zeros there, never another sequence's rows."""
        seq_ids = list(seq_ids)
        rows = [self.allocator.block_table(s) for s in seq_ids]
        width = max([1] + [len(r) for r in rows])
        table = np.full((len(rows), width), self.null_block, dtype=np.int32)
        for i, row in enumerate(rows):
            table[i, : len(row)] = row
        table[table == HOLE] = self.null_block
        lens = np.array([self.allocator.num_tokens(s) for s in seq_ids], dtype=np.int32)
        return mx.array(table), mx.array(lens)

    def quantize(self, *, k_bits: int | None, v_bits: int | None, group_size: int | None = None) -> None:
        """Convert float K and/or V pools to these bits in place (rows round-trip like
        ``mx.quantize``); what is already quantized must already have these bits."""
        if group_size is None:
            group_size = self.k_group_size
            if self.k_group_size != self.v_group_size:
                raise ValueError(f"[PagedKVCache.quantize] K and V group sizes differ "
                                 f"({self.k_group_size}/{self.v_group_size}): give group_size")
        for name, bits, current in (("k_bits", k_bits, self.k_bits), ("v_bits", v_bits, self.v_bits)):
            if bits is not None and bits not in quant.SUPPORTED_BITS:
                raise ValueError(f"[PagedKVCache.quantize] {name} must be None or one of {quant.SUPPORTED_BITS}, "
                                 f"got {bits!r}")
            if current is not None and bits != current:
                raise ValueError(f"[PagedKVCache.quantize] {name}: the pool already holds {current}-bit rows, "
                                 f"cannot convert to {bits}")
        if (k_bits or v_bits) and self.head_dim % group_size:
            raise ValueError(f"[PagedKVCache.quantize] head_dim {self.head_dim} is not a multiple of "
                             f"group_size {group_size}")
        for bits, current in ((self.k_bits, self.k_group_size), (self.v_bits, self.v_group_size)):
            if bits and group_size != current:
                raise ValueError(f"[PagedKVCache.quantize] group_size must stay {current}, got {group_size}")
        convert = lambda c, bits: c if bits is None or isinstance(c, quant.QuantizedKV) else \
            quant.quantize(c, bits=bits, group_size=group_size)
        self.key_caches = [convert(c, k_bits) for c in self.key_caches]
        self.value_caches = [convert(c, v_bits) for c in self.value_caches]
        self.k_bits, self.v_bits = k_bits, v_bits
        self.k_group_size, self.v_group_size = group_size, group_size

    @property
    def nbytes(self) -> int:
        """Bytes of every layer's K and V pool (what the cache holds, used or not,
        the null block included)."""
        return sum(c.nbytes for c in self.key_caches + self.value_caches)

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks sequences own right now (what a right-sized pool needs)."""
        return self.allocator.num_owned * self.bytes_per_block

    @property
    def bytes_per_block(self) -> int:
        return self.nbytes // (self.allocator.num_blocks + 1)  # the null block included

    def arrays(self) -> list:
        """Every array the pool holds (for ``mx.eval``)."""
        out = []
        for c in self.key_caches + self.value_caches:
            out += list(c.arrays()) if isinstance(c, quant.QuantizedKV) else [c]
        return out

    def stats(self) -> dict:
        a = self.allocator
        owned = a.num_owned
        return {
            "num_blocks": a.num_blocks,
            "block_size": a.block_size,
            "free_blocks": a.num_free_listed,
            "cached_blocks": a.num_cached,
            "used_blocks": owned,
            "shared_blocks": a.num_shared,
            "blocks_saved_by_sharing": sum(a.refcount) - owned,
            "prefix_hit_blocks": a.prefix_hit_blocks,
            "sequences": a.num_sequences,
            "tokens": a.total_tokens,
            "nbytes": self.nbytes,
            "used_bytes": owned * self.bytes_per_block,
        }

    # ------------------------------------------------------------------ internals

    def _shape(self, num_blocks: int) -> tuple:
        return (num_blocks, self.num_kv_heads, self.block_size, self.head_dim)

    def _empty(self, num_blocks: int, bits, group_size: int):
        if bits is None:
            return mx.zeros(self._shape(num_blocks), dtype=self.dtype)
        return quant.empty_like_layout(self._shape(num_blocks), bits=bits, group_size=group_size, dtype=self.dtype)

    def _extend(self, cache, num_new: int, bits, group_size: int):
        extra = self._empty(num_new, bits, group_size)
        if isinstance(cache, quant.QuantizedKV):
            return cache.replace(*(mx.concatenate([a, b]) for a, b in zip(cache.arrays(), extra.arrays())))
        return mx.concatenate([cache, extra])

    def _copy(self, copies: list) -> None:
        if not copies:
            return
        src = mx.array([s for s, _ in copies], dtype=mx.int32)
        dst = mx.array([d for _, d in copies], dtype=mx.int32)
        for layer in range(self.num_layers):
            self.key_caches[layer], self.value_caches[layer] = ops.copy_blocks(
                self.key_caches[layer], self.value_caches[layer], src, dst, validate=False)
