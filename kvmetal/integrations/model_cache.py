"""The paged KV state of a whole model, and the per-layer cache objects mlx-lm models call.

A model's layers are grouped by what their cache must keep: full-attention layers in
one :class:`~kvmetal.PagedKVCache`, each sliding-window size in another (so a window
group can release blocks the window left behind while full layers keep theirs). Every
group sees the same sequence ids.

:class:`PagedLayerCache` speaks mlx-lm's cache protocol for one layer and one or more
sequences: ``offset``, ``update_and_fetch``, ``keys_and_values``, ``make_mask``,
``state``/``meta_state``/``from_state``, ``trim``, ``to_quantized``, ``copy.deepcopy``, and the batching
operations ``merge``/``extend``/``filter``/``extract``/``prepare``/``finalize`` that
mlx-lm's ``BatchGenerator`` uses. On the pool those are table operations (fork, free,
truncate), never copies of K/V. Dimension names: B sequences, H query heads, Hkv kv
heads, L new tokens, T cached tokens, D head_dim.
"""
from __future__ import annotations

import dataclasses
import weakref
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .. import backends, ops, quant
from ..cache import HOLE, KVCacheFull, PagedKVCache
from ..kv_format import KVFormat
from . import cascade_plan
from .table_mirror import BlockTableMirror

INITIAL_BLOCKS = 64  # first size of a pool that grows on demand
GROWTH = 0.25  # a full growable pool adds this fraction of its size: held bytes stay near the need
MAX_PAGED_QUERY_TOKENS = ops.MAX_QUERY_TOKENS  # passes of up to this many tokens run paged_attention;
                                              # longer ones paged_attention_varlen (neither gathers)
CASCADE = True  # PagedModelCache(cascade=...) default; docs/cascade.md ("Grouping rule") says why
TRIM_SLACK = 16  # window layers keep this many tokens beyond their window, so a rewind of that
                 # many (speculative decoding's rejected drafts) still finds the window intact


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer stores: its window (None = full) and K/V row shape;
    ``chunk``: chunked attention (llama4), a token at position p sees only positions
    [floor(p / chunk) * chunk, p], so blocks before its chunk are released; and, not part
    of what a pool is grouped by, how the model reads it (``analyse_model``)."""

    window: int | None
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype
    chunk: int | None = None
    # The model hands attention its fetched K/V with the heads rearranged (plamo tiles them:
    # query head h reads kv head h % Hkv): kvmetal's query head p (grouped p // G) is the
    # model's head head_order[p]. None: the model attends over the fetched heads as they are.
    head_order: tuple | None = field(default=None, compare=False)
    # Other layers' attention calls also read this layer's fetched rows (iquestloopcoder's
    # second loop attends over the first loop's keys): its fetches are findable by
    # ``PagedModelCache.fetch_owner``.
    shared: bool = field(default=False, compare=False)
    # Other layers attend over this layer's rows read with ``keys_and_values()`` (gemma3n's
    # KV-shared layers, afm7's KV-reuse layers): "cache" where every such attention call passes
    # a kvmetal cache, "none" where one passes no cache (see ``read_owner``); None: never read.
    read: str | None = field(default=None, compare=False)


@dataclass
class _Plan:
    """Index arrays of one forward pass over one group, shared by all its layers."""

    key: tuple
    slots: mx.array  # int32 [B * L]
    block_tables: mx.array  # int32 [B, M]
    seq_lens: mx.array  # int32 [B], new tokens included
    max_len: int
    query_start_loc: mx.array  # int32 [B + 1]: sequence i owns query rows [i * L, (i + 1) * L)
    cascade: object = None  # one-token passes: the shared-prefix arguments (a tuple), False for none
    host: tuple = ()  # (tables int32 [B, M], starts [B], counts [B]) on the host, for chunk views
    chunk_views: dict = dataclasses.field(default_factory=dict)  # chunk size -> _ChunkView


class _ChunkView:
    """A pass's index arrays under the chunk rule (chunk C, the block size dividing C).

    Keys are stored rotated, so a query's position matters to the kernels only through
    the causal mask, which they apply relative to the table and length they are given:
    a table that starts at a chunk start's block, with the length reduced by that start,
    shows a query exactly its own chunk. ``block_tables``/``seq_lens``: per sequence, from
    the chunk start of its first query row (right for a sequence whose rows all lie in one
    chunk: ``straddles`` False). ``runs()``: sequences' rows cut at chunk starts into runs,
    each with its own table, for ``paged_attention_varlen`` (built on first use); a
    sequence's runs are consecutive and in order, so the packed query rows need no
    reordering."""

    def __init__(self, plan: "_Plan", chunk: int, block_size: int, null: int):
        tables, starts, counts = plan.host
        self._host = (tables, starts, starts + counts, chunk, block_size, null)
        first = _chunk_start(starts, chunk)
        lens = (starts + counts - first).astype(np.int32)
        self.straddles = _chunk_start(np.maximum(starts + counts - 1, starts), chunk) != first  # bool [B]
        self.block_tables = mx.array(_shifted(tables, first // block_size, lens, block_size, null))  # int32 [B, M']
        self.seq_lens = mx.array(lens)  # int32 [B]
        self._runs = None

    def runs(self, first: int, last: int) -> tuple:
        """(tables [R, M''], lens [R], query_start_loc [R + 1]) of the runs of sequences
        [first, last), query rows counted from the first of them."""
        if self._runs is None:
            self._runs = self._cut()
        tables, lens, starts, run_first = self._runs
        a, b = int(run_first[first]), int(run_first[last])
        return tables[a:b], lens[a:b], mx.array(starts[a:b + 1] - starts[a])

    def _cut(self) -> tuple:
        tables, starts, ends, chunk, block_size, null = self._host
        run_pos, run_end, run_seq, run_first = [], [], [], [0]
        for i, (a, b) in enumerate(zip(starts.tolist(), ends.tolist())):
            cuts = [a] + list(range(_chunk_start(a, chunk) + chunk, b, chunk)) + [b]
            run_pos += cuts[:-1]
            run_end += cuts[1:]
            run_seq += [i] * (len(cuts) - 1)
            run_first.append(len(run_pos))
        run_pos, run_end = np.asarray(run_pos, dtype=np.int64), np.asarray(run_end, dtype=np.int64)
        run_cs = _chunk_start(run_pos, chunk)  # each run's rows see from their chunk start
        run_lens = (run_end - run_cs).astype(np.int32)
        run_tables = _shifted(tables[np.asarray(run_seq, dtype=np.intp)], run_cs // block_size, run_lens,
                              block_size, null)
        run_starts = np.concatenate([[0], np.cumsum(run_end - run_pos)]).astype(np.int32)
        return mx.array(run_tables), mx.array(run_lens), run_starts, np.asarray(run_first)


def _chunk_start(position, chunk: int):
    return position // chunk * chunk


def _shifted(tables: np.ndarray, shift: np.ndarray, lens: np.ndarray, block_size: int, null: int) -> np.ndarray:
    """Rows of ``tables`` starting ``shift`` blocks in, wide enough for ``lens`` tokens."""
    width = max(1, int(-(-lens.max(initial=0) // block_size)))
    index = shift[:, None] + np.arange(width)[None, :]
    inside = index < tables.shape[1]
    out = np.take_along_axis(tables, np.minimum(index, tables.shape[1] - 1), axis=1)
    return np.where(inside, out, np.int32(null)).astype(np.int32)


def _pack_groups(k_group: int, v_group: int) -> int:
    """K's and V's group sizes in ``state``'s one int32 field: K's alone where they agree
    (what saves from before per-side group sizes hold), else K's | V's << 16."""
    return k_group if k_group == v_group else k_group | (v_group << 16)


def _unpack_groups(field: int) -> tuple:
    k_group, v_group = field & 0xFFFF, field >> 16
    return k_group, v_group or k_group


_reads: dict = {}  # id(keys) -> (weakref keys, weakref layer cache): what keys_and_values() returned


def _remember_read(keys: mx.array, cache) -> None:
    """The keys a layer cache's ``keys_and_values()`` returned, and the cache (both held
    weakly: the entry goes with the keys, and never keeps a pool array alive)."""
    key = id(keys)
    _reads[key] = (weakref.ref(keys, lambda _, key=key: _reads.pop(key, None)), weakref.ref(cache))


def read_owner(keys: mx.array):
    """The layer cache (paged or ragged) whose ``keys_and_values()`` returned ``keys``, or
    None. An attention call over such rows runs on that cache's pool, with the plan of the
    pass that last wrote it, whatever cache (or none) the call passes."""
    if not _reads:
        return None
    entry = _reads.get(id(keys))
    return None if entry is None or entry[0]() is not keys else entry[1]()


class PagedModelCache:
    """Paged K/V for every layer of one model, shared by any number of sequences.

    Args:
        specs: one :class:`LayerSpec` per layer.
        block_size: tokens per block.
        num_blocks: blocks per group pool; None starts small and grows on demand.
        kv_format: how K and V are stored (``kvmetal.KVFormat``: bits and group size per side;
            a group size left None is chosen per pool's head_dim, ``kv_format.default_group_size``).
        k_bits, v_bits, group_size, k_group_size, v_group_size: the same as loose arguments
            (instead of ``kv_format``).
        cascade: one-token decode passes of full-attention layers group sequences that share
            leading blocks (kvmetal/integrations/cascade_plan.py) and run
            ``paged_attention_cascade``, which reads each shared prefix once per step;
            ``cascade_steps`` counts those passes. Same tokens as the plain op (within
            rounding); docs/cascade.md has the rule and its thresholds.
        sparse_v: the sparse-V threshold of the decode passes (``ops.paged_attention``'s
            and ``ops.paged_attention_cascade``'s ``sparse_v``); None or 0: exact.
    """

    def __init__(self, specs, *, block_size: int = 16, num_blocks: int | None = None,
                 kv_format: KVFormat | None = None, k_bits: int | None = None, v_bits: int | None = None,
                 group_size: int | None = None, k_group_size: int | None = None, v_group_size: int | None = None,
                 cascade: bool = CASCADE, sparse_v: float | None = None):
        self.kv_format = KVFormat.coerce(kv_format, k_bits=k_bits, v_bits=v_bits, group_size=group_size,
                                         k_group_size=k_group_size, v_group_size=v_group_size,
                                         owner="PagedModelCache")
        self.sparse_v = ops.sparse_v_threshold("PagedModelCache", sparse_v)
        self.specs = list(specs)
        self.growable = num_blocks is None
        self.options = dict(block_size=block_size, num_blocks=num_blocks, kv_format=self.kv_format,
                            cascade=bool(cascade), sparse_v=self.sparse_v)
        self.gathered_attention = 0  # layer calls with a mask array we did not make, or under a chunk rule
                                     # the block size does not divide: rows gathered, MLX's sdpa
        self.cascade_steps = 0  # one-token passes (per full-attention layer group) that ran the cascade op
        group_keys = []
        self.layer_group, self.layer_index = [], []
        for spec in self.specs:
            if spec not in group_keys:
                group_keys.append(spec)
            g = group_keys.index(spec)
            self.layer_group.append(g)
            self.layer_index.append(sum(1 for x in self.layer_group[:-1] if x == g))
        self.windows = [spec.window for spec in group_keys]
        self.chunks = [spec.chunk for spec in group_keys]  # chunked attention (llama4): its chunk size
        self.pools = [
            PagedKVCache(num_layers=self.layer_group.count(g), num_kv_heads=spec.num_kv_heads,
                         head_dim=spec.head_dim, num_blocks=num_blocks or INITIAL_BLOCKS,
                         block_size=block_size, dtype=spec.dtype,
                         **self.kv_format.for_head_dim(spec.head_dim).cache_options())
            for g, spec in enumerate(group_keys)
        ]
        self.block_size = block_size
        self._version = [0] * len(self.pools)  # bumped on every table change: plans go stale
        self._plans = [None] * len(self.pools)
        self._mirrors = [BlockTableMirror(pool) for pool in self.pools]
        self.mutations = 0  # every table change; keys the memos that layers of one call share
        self.peak_used_bytes = 0
        self._next_id = 0
        self._memo: dict = {}  # (kind, args, mutations) -> weak refs every layer of one call shares
        self._masks: list = []  # [(mask object, requested window)] that make_mask handed out
        self._fetched: dict = {}  # id(keys) -> (weakref keys, weakref layer cache): shared layers' fetches

    # ------------------------------------------------------------------ sequences

    def new_seq_id(self):
        """A fresh sequence id for the drop-in caches (the Engine uses its own ids)."""
        while ("kvmetal", self._next_id) in self:
            self._next_id += 1
        self._next_id += 1
        return ("kvmetal", self._next_id - 1)

    def __contains__(self, seq_id) -> bool:
        return seq_id in self.pools[0]

    def add_sequence(self, seq_id, tokens=None, *, num_tokens: int | None = None) -> int:
        """Start a sequence in every group; returns the leading tokens already cached in
        all of them (prefix sharing), i.e. where the caller's forward pass must start.
        Checks every group's room first: on ``KVCacheFull`` nothing changed."""
        start = 0
        if tokens is not None:
            start = min(p.allocator.cached_prefix(tokens) for p in self.pools)
        for g, pool in enumerate(self.pools):
            fits = lambda a=pool.allocator: a.can_add(tokens, num_tokens=num_tokens, share_limit=start)  # noqa: E731
            self._ensure_room(g, fits, f"[add_sequence] sequence {seq_id!r} does not fit in the free blocks")
        for pool in self.pools:
            pool.add_sequence(seq_id, tokens, num_tokens=num_tokens, share_limit=start)
        self._touch()
        return start

    def append(self, seq_id, tokens=None, *, num_tokens: int | None = None, ids_later: bool = False) -> None:
        """Extend a sequence in every group (window groups first drop what they no longer need).
        Checks every group's room first: on ``KVCacheFull`` only evictions happened.
        ``ids_later``: the ids of these ``num_tokens`` are still being sampled on the device;
        the blocks they complete are published when ``provide_ids`` gives them."""
        count = len(tokens) if tokens is not None else num_tokens
        for g in range(len(self.pools)):
            self._evict_behind_window(g, seq_id)
        for g in range(len(self.pools)):
            self._ensure_room_for(g, seq_id, count, "append")
        for pool in self.pools:
            pool.append(seq_id, tokens, num_tokens=num_tokens, ids_later=ids_later)
        self._touch()

    def provide_ids(self, seq_id, tokens) -> None:
        """The ids of tokens appended with ``ids_later``, oldest first."""
        for pool in self.pools:
            pool.provide_ids(seq_id, tokens)

    def truncate(self, seq_id, num_tokens: int) -> None:
        for pool in self.pools:
            pool.truncate(seq_id, num_tokens)
        self._touch()

    def free(self, seq_id) -> None:
        for pool in self.pools:
            pool.free(seq_id)
        self._touch()

    def fork(self, parent_id, child_id) -> None:
        """``child_id`` shares every block of ``parent_id`` (copy-on-write on the next write)."""
        for pool in self.pools:
            pool.fork(parent_id, child_id)
        self._touch()

    def num_tokens(self, seq_id) -> int:
        return self.pools[0].num_tokens(seq_id)

    def layer_caches(self, seq_ids, offsets=None) -> list:
        """mlx-lm cache objects, one per layer, for a forward pass over ``seq_ids``
        (which the caller owns: dropping the caches frees nothing)."""
        seq_ids = list(seq_ids)
        offsets = [self.num_tokens(s) for s in seq_ids] if offsets is None else list(offsets)
        return [PagedLayerCache(self, layer, seq_ids, offsets) for layer in range(len(self.specs))]

    def ragged_layer_caches(self, seq_ids, starts, counts, *, decodes: int = 0) -> list:
        """mlx-lm cache objects for ONE ragged pass: sequence i brings ``counts[i]`` new
        tokens at positions ``starts[i]...``, each token a row of its own (inputs
        ``[T, 1]``, T = sum(counts)), so that unmodified model code runs decodes and
        prefill chunks together: ``offset`` is each row's position (RoPE), attention is
        one ``paged_attention_varlen`` call per layer. The caller (the Engine) already
        holds room for the new tokens (``add_sequence`` / ``append``).

        ``decodes``: the first ``decodes`` sequences are decode steps (one row each, or up
        to ``MAX_PAGED_QUERY_TOKENS`` with speculative drafts, equal counts side by side):
        their rows run ``paged_attention``, exactly as in a pass of decodes only, and
        the others ``paged_attention_varlen``. A token's attention then takes the same
        arithmetic whatever it is batched with (the two kernels round differently)."""
        batch = _RaggedBatch(self, list(seq_ids), [int(s) for s in starts], [int(c) for c in counts],
                             decodes=int(decodes))
        return [RaggedLayerCache(self, layer, batch) for layer in range(len(self.specs))]

    def cached_prefix(self, tokens) -> int:
        """Leading tokens of ``tokens`` every group already holds (what ``add_sequence``
        would share); changes nothing."""
        return min(p.allocator.cached_prefix(tokens) for p in self.pools)

    def owned_layer_caches(self, num_seqs: int = 1) -> list:
        """Layer caches over ``num_seqs`` new empty sequences that live as long as the caches do."""
        refs = [self._new_ref() for _ in range(num_seqs)]
        family = {}  # shared by these layers: a batch they widen to (see PagedLayerCache._widen)
        caches = [PagedLayerCache(self, layer, [r.seq_id for r in refs], [0] * num_seqs, refs=refs)
                  for layer in range(len(self.specs))]
        for c in caches:
            c._family = family
        return caches

    def quantize(self, *, k_bits: int | None, v_bits: int | None, group_size: int | None = None) -> None:
        """Convert every pool's float K and/or V to these bits in place."""
        for pool in self.pools:
            pool.quantize(k_bits=k_bits, v_bits=v_bits, group_size=group_size)
        group = self.pools[0].group_size
        self.kv_format = KVFormat(k_bits=k_bits, v_bits=v_bits, k_group_size=group, v_group_size=group)
        self.options.update(kv_format=self.kv_format)
        self._touch()

    # ------------------------------------------------------------------ accounting

    @property
    def nbytes(self) -> int:
        """Bytes of every pool (allocated memory, used or not)."""
        return sum(p.nbytes for p in self.pools)

    @property
    def free_blocks(self) -> int | None:
        """Blocks every group can still hand out (free or cached), None for pools that grow."""
        return None if self.growable else min(p.allocator.num_free for p in self.pools)

    @property
    def capacity_tokens(self) -> int | None:
        """Tokens the smallest pool holds (None for pools that grow): the most one sequence
        can write into every group at once (a prompt is written whole, window groups too)."""
        return None if self.growable else min(p.allocator.num_blocks for p in self.pools) * self.block_size

    @property
    def full_capacity_tokens(self) -> int | None:
        """Tokens the smallest full-attention pool holds: the most one sequence can reach
        (window and chunk groups release blocks as it moves on). None for pools that grow,
        or none of them."""
        full = [p for p, w, c in zip(self.pools, self.windows, self.chunks) if w is None and c is None]
        if self.growable or not full:
            return None
        return min(p.allocator.num_blocks for p in full) * self.block_size

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks live sequences own (every group)."""
        return sum(p.used_bytes for p in self.pools)

    def stats(self, group=None) -> dict:
        """Block and byte counts of this process's pools, summed over layer groups.

        With an ``mx.distributed`` ``group`` (a collective: every rank must call it) the
        result also holds ``rank``, ``world_size`` and ``all_ranks``: the byte and block
        counts summed over every rank (run after the model's own collectives have
        finished; mlx-lm's generation stream is synchronized here). On a model sharded by kv heads each rank's pools
        hold only its own heads: the same blocks and tables everywhere (the allocator is
        deterministic), a 1/world_size share of the bytes."""
        per_group = [p.stats() for p in self.pools]
        total = {k: sum(s[k] for s in per_group) for k in per_group[0] if k not in ("block_size", "sequences")}
        total["sequences"] = per_group[0]["sequences"]
        total["groups"] = len(self.pools)
        if group is not None:
            _synchronize_model_streams()
            keys = sorted(total)
            summed = mx.distributed.all_sum(mx.array([float(total[k]) for k in keys], dtype=mx.float32),
                                            group=group).tolist()
            total.update(rank=group.rank(), world_size=group.size(),
                         all_ranks={k: int(round(v)) for k, v in zip(keys, summed)})
        return total

    # ------------------------------------------------------------------ internals

    def _new_ref(self, parent=None) -> "_SequenceRef":
        seq_id = self.new_seq_id()
        if parent is None:
            self.add_sequence(seq_id, num_tokens=0)
        else:
            self.fork(parent, seq_id)
        return _SequenceRef(self, seq_id)

    def _shared(self, key: tuple, make) -> list:
        """``make()`` (a list of :class:`_SequenceRef`) once per table state: the layers
        of one mlx-lm call (extract, merge, to_quantized...) each ask, the first one's
        result serves them all. Held weakly: dropped caches still free their blocks."""
        held = self._memo.get(key + (self.mutations,))
        refs = None if held is None else [r() for r in held]
        if refs is None or any(r is None for r in refs):
            refs = make()
            self._memo = {key + (self.mutations,): [weakref.ref(r) for r in refs]}  # older entries are stale
        return refs

    def _touch(self, group: int | None = None):
        """Tables changed (in ``group``, or all): cached plans are stale."""
        for g in range(len(self._version)) if group is None else (group,):
            self._version[g] += 1
        self.mutations += 1
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)

    def _grow(self, g: int) -> None:
        pool = self.pools[g]
        pool.grow(max(8, int(pool.allocator.num_blocks * GROWTH)))

    def _ensure_room(self, g: int, fits, message: str) -> None:
        """Grow group ``g``'s pool until ``fits()``; a fixed pool raises ``KVCacheFull``."""
        while not fits():
            if not self.growable:
                raise KVCacheFull(message)
            self._grow(g)

    def _ensure_room_for(self, g: int, seq_id, num_new: int, op: str) -> None:
        allocator = self.pools[g].allocator
        self._ensure_room(g, lambda: allocator.blocks_needed(seq_id, num_new) <= allocator.num_free,
                          f"[{op}] sequence {seq_id!r} needs more blocks than are free")

    def _evict_behind_window(self, g: int, seq_id) -> None:
        if self.windows[g] is not None:
            # The first new query sees the last window - 1 cached tokens and itself.
            self.pools[g].evict(seq_id, window=self.windows[g] - 1 + TRIM_SLACK)
        elif self.chunks[g] is not None:
            # The first new query (position n) sees its chunk, from floor(n / C) * C; with the
            # same slack as a window, blocks wholly before the chunk start of n - TRIM_SLACK go.
            n = self.pools[g].num_tokens(seq_id)
            keep_from = _chunk_start(max(0, n - TRIM_SLACK), self.chunks[g])
            if keep_from:
                self.pools[g].evict(seq_id, window=n - keep_from)

    def _extend_group(self, g: int, seq_id, num_new: int) -> None:
        """mlx-lm's path: the first layer of a group to see new tokens makes room for them."""
        self._evict_behind_window(g, seq_id)
        self._ensure_room_for(g, seq_id, num_new, "PagedLayerCache")
        self.pools[g].append(seq_id, num_tokens=num_new)
        self._touch(g)

    def _plan(self, g: int, seq_ids: list, offsets: list, num_new: int) -> _Plan:
        """Slots and tables for ``num_new`` tokens after ``offsets``; built once per group and pass."""
        key = (tuple(seq_ids), tuple(offsets), num_new, self._version[g])
        plan = self._plans[g]
        if plan is not None and plan.key == key:
            return plan
        pool = self.pools[g]
        for seq, off in zip(seq_ids, offsets):
            have = pool.num_tokens(seq)
            if have == off:  # first layer of this group in this pass: make room
                self._extend_group(g, seq, num_new)
            elif have != off + num_new:
                raise ValueError(f"[PagedLayerCache] sequence {seq!r} holds {have} tokens in this layer group, "
                                 f"but the layer is at offset {off} with {num_new} new tokens")
        key = key[:3] + (self._version[g],)
        plan = self._index_plan(g, seq_ids, offsets, [num_new] * len(seq_ids), key)
        self._plans[g] = plan
        return plan

    def _index_plan(self, g: int, seq_ids: list, starts: list, counts: list, key=None) -> _Plan:
        """Slots of the new tokens, block tables and lengths for one pass over group ``g``,
        from the group's table mirror (only what changed since the last pass is copied)."""
        mirror = self._mirrors[g]
        rows, widths = mirror.rows(seq_ids)
        starts, counts = np.asarray(starts, dtype=np.int64), np.asarray(counts, dtype=np.int64)
        slots = mirror.slots(rows, starts, counts)
        lens = (starts + counts).astype(np.int32)
        query_starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        tables = mirror.tables(rows, widths)
        return _Plan(key, mx.array(slots), mx.array(tables), mx.array(lens), int(lens.max(initial=0)),
                     mx.array(query_starts), host=(tables, starts, counts))

    def _chunk_view(self, g: int, plan: _Plan, chunk: int) -> _ChunkView:
        """``plan``'s index arrays under the chunk rule (built once per plan, shared by its layers)."""
        view = plan.chunk_views.get(chunk)
        if view is None:
            view = plan.chunk_views[chunk] = _ChunkView(plan, chunk, self.block_size, self.pools[g].null_block)
        return view

    def _chunk_mask(self, chunk: int) -> mx.array:
        """A marker mask meaning "the chunk rule, chunk ``chunk``" (causal, and a query sees
        only its own chunk), which ``attention`` runs on the kernels (see ``_ChunkView``)."""
        if not isinstance(chunk, (int, np.integer)) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"[PagedModelCache] chunk must be an int >= 1, got {chunk!r}")
        marker = mx.zeros((1,), dtype=mx.bool_)
        self._remember_mask(marker, None, chunk=int(chunk))
        return marker

    def _cascade_args(self, plan: _Plan):
        """The cascade op's index arguments for this pass (planned once, shared by the
        group's layers), or None where no group of sequences reaches the thresholds."""
        if plan.cascade is None:
            groups = None
            if plan.seq_lens.shape[0] >= cascade_plan.MIN_MEMBERS:  # fewer sequences never group
                groups = cascade_plan.group_shared_prefixes(np.array(plan.block_tables), np.array(plan.seq_lens),
                                                            block_size=self.block_size)
            plan.cascade = False if groups is None else tuple(
                mx.array(a) for a in (groups.prefix_block_tables, groups.prefix_lens, groups.prefix_of,
                                      groups.block_tables, groups.seq_lens))
            self.cascade_steps += groups is not None
        return plan.cascade or None

    def _remember_fetch(self, keys: mx.array, cache) -> None:
        """The keys a shared layer's ``update_and_fetch`` returned, and its cache (both held
        weakly: the entry goes with the keys, and never keeps a pool array alive)."""
        key = id(keys)
        fetched = self._fetched
        fetched[key] = (weakref.ref(keys, lambda _, key=key: fetched.pop(key, None)), weakref.ref(cache))

    def fetch_owner(self, keys: mx.array):
        """The layer cache whose ``update_and_fetch`` returned ``keys`` (a shared layer's, see
        ``LayerSpec.shared``), or None."""
        entry = self._fetched.get(id(keys))
        return None if entry is None or entry[0]() is not keys else entry[1]()

    def _remember_mask(self, mask, window, *, chunk: int | None = None) -> None:
        """Masks handed out by make_mask (or ``_chunk_mask``), so attention knows what they
        mean (causal plus ``window``, or the chunk rule) and can run its own kernels instead
        of applying them as arrays."""
        if isinstance(mask, mx.array):
            self._masks = self._masks[-7:] + [(mask, window, chunk)]

    def _mask_rule(self, mask) -> tuple:
        """(known, requested window, chunk) of a mask an attention call received."""
        if mask is None or (isinstance(mask, str) and mask == "causal"):
            return True, None, None
        for m, window, chunk in self._masks:
            if m is mask:
                return True, window, chunk
        return False, None, None


class _LayerGroupView:
    """A layer's pool and attention window, for the layer caches below (``_group``)."""

    model_cache: PagedModelCache
    _group: int

    @property
    def pool(self) -> PagedKVCache:
        return self.model_cache.pools[self._group]

    @property
    def window(self) -> int | None:
        return self.model_cache.windows[self._group]


class _RaggedBatch:
    """The rows of one ragged pass and, per layer group, its index arrays: built by the
    group's first layer, shared by the others (one host build per group and step)."""

    def __init__(self, model_cache: PagedModelCache, seq_ids: list, starts: list, counts: list, decodes: int = 0):
        if not (len(seq_ids) == len(starts) == len(counts)) or min(counts, default=1) < 1:
            raise ValueError("[ragged_layer_caches] seq_ids, starts and counts must have one entry per "
                             "sequence, and every count must be >= 1")
        if not 0 <= decodes <= len(seq_ids) or any(c > MAX_PAGED_QUERY_TOKENS for c in counts[:decodes]):
            raise ValueError(f"[ragged_layer_caches] decodes must name leading sequences of 1 to "
                             f"{MAX_PAGED_QUERY_TOKENS} rows each, got {decodes} for counts {counts[:decodes + 1]}")
        self.model_cache = model_cache
        self.seq_ids, self.starts, self.counts = seq_ids, starts, counts
        self.decodes = decodes
        self.decode_rows = sum(counts[:decodes])
        self._parts: dict = {}
        self.num_rows = sum(counts)
        self.positions = mx.array(np.concatenate([np.arange(s, s + c) for s, c in zip(starts, counts)])
                                  .astype(np.int32)) if seq_ids else mx.zeros((0,), dtype=mx.int32)
        self._plans: dict = {}

    def plan(self, g: int) -> _Plan:
        plan = self._plans.get(g)
        if plan is not None:
            return plan
        pool = self.model_cache.pools[g]
        for seq, start, count in zip(self.seq_ids, self.starts, self.counts):
            if pool.num_tokens(seq) != start + count:
                raise ValueError(f"[RaggedLayerCache] sequence {seq!r} holds {pool.num_tokens(seq)} tokens in "
                                 f"layer group {g}, expected {start + count}: reserve room before the pass")
        plan = self.model_cache._index_plan(g, self.seq_ids, self.starts, self.counts)
        self._plans[g] = plan
        return plan

    def parts(self, g: int) -> tuple:
        """(decode runs; prefill tables, lens, query starts) of group ``g``'s plan. The
        decode sequences lead; a run is a stretch of them with equal row counts L (a
        speculative decode row carries drafts): (first row, sequences, L, tables, lens)."""
        got = self._parts.get(g)
        if got is None:
            plan, d = self.plan(g), self.decodes
            runs, s, row = [], 0, 0
            while s < d:
                n = self.counts[s]
                e = s
                while e < d and self.counts[e] == n:
                    e += 1
                runs.append((row, e - s, n, plan.block_tables[s:e], plan.seq_lens[s:e]))
                row += (e - s) * n
                s = e
            got = (runs, plan.block_tables[d:], plan.seq_lens[d:], plan.query_start_loc[d:] - self.decode_rows)
            self._parts[g] = got
        return got

    def chunk_view(self, g: int, chunk: int) -> _ChunkView:
        return self.model_cache._chunk_view(g, self.plan(g), chunk)


class RaggedLayerCache(_LayerGroupView):
    """One layer's view of a ragged pass (see ``PagedModelCache.ragged_layer_caches``).

    The model sees a batch of T one-token rows: ``offset`` is an int32 [T] array of
    positions, ``update_and_fetch`` writes row t's K/V at its slot, ``attention`` runs
    ``paged_attention_varlen`` with each sequence's rows as its last cached positions
    (causal, within the layer's window). Only what a forward pass needs: no state,
    trimming or batching operations."""

    def __init__(self, model_cache: PagedModelCache, layer: int, batch: _RaggedBatch):
        self.model_cache, self.layer, self.batch = model_cache, layer, batch
        self._group = model_cache.layer_group[layer]
        self._index = model_cache.layer_index[layer]
        self._written = None  # (keys, values) of this pass's update_and_fetch

    @property
    def offset(self) -> mx.array:
        return self.batch.positions

    def _check_rows(self, x: mx.array, what: str) -> None:
        if x.ndim != 4 or x.shape[0] != self.batch.num_rows or x.shape[2] != 1:
            raise ValueError(f"[RaggedLayerCache] {what} must be [T, heads, 1, D] with T = {self.batch.num_rows} "
                             f"rows of one token, got {tuple(x.shape)}")

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        self._check_rows(keys, "keys")
        plan = self.batch.plan(self._group)
        self.pool._write_trusted(self._index, keys[:, :, 0], values[:, :, 0], plan.slots)
        if self.model_cache.specs[self.layer].shared:
            self.model_cache._remember_fetch(keys, self)
        self._written = (keys, values)
        return keys, values

    def keys_and_values(self):
        """This pass's rows, [T, Hkv, 1, D], as ``update_and_fetch`` returned them (a ragged
        pass has one row per token: the earlier rows live only in the pool). An attention
        call over them runs on this layer's pool with the pass's plan (``read_owner``)."""
        written = self._written
        if written is None:
            raise NotImplementedError(f"[RaggedLayerCache] keys_and_values() on layer {self.layer} before its "
                                      f"update_and_fetch in this pass: a ragged pass holds only its own rows")
        _remember_read(written[0], self)
        return written

    def check_read(self, queries: mx.array) -> None:
        """Attention over this layer's rows read in this pass (``keys_and_values``): the pass's rows."""
        self._check_rows(queries, "queries")

    def attention(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask=None,
                  sinks: mx.array | None = None, softcap: float | None = None) -> mx.array:
        self._check_rows(queries, "queries")
        known, requested, chunk = self.model_cache._mask_rule(mask)
        if not known:
            raise NotImplementedError("[RaggedLayerCache] a ragged pass takes only the masks its own make_mask "
                                      "returns (causal, optionally windowed) and the chunk rule's marker")
        plan = self.batch.plan(self._group)
        window = _min_window(self.window, requested)
        if chunk is not None:
            return self._chunk_attention(queries, chunk, scale, window, sinks, softcap)
        kc, vc = self.pool.key_caches[self._index], self.pool.value_caches[self._index]
        d = self.batch.decodes
        if d == 0:
            out = ops.paged_attention_varlen(queries[:, :, 0], kc, vc, plan.block_tables, plan.seq_lens,
                                             plan.query_start_loc, scale=scale, softcap=softcap,
                                             sliding_window=window, sinks=sinks, validate=False)
            return out[:, :, None]
        # Decode rows as a pass of decodes only runs them (PagedLayerCache.attention), the rest as
        # prefill. A decode with drafts brings L rows: the decode kernel's L query tokens.
        runs, pre_tables, pre_lens, pre_starts = self.batch.parts(self._group)
        outs = []
        for row, seqs, n, tables, lens in runs:
            q = queries[row:row + seqs * n, :, 0]
            q = q if n == 1 else q.reshape(seqs, n, *q.shape[1:])
            out = ops.paged_attention(q, kc, vc, tables, lens, scale=scale, softcap=softcap, sliding_window=window,
                                      sinks=sinks, sparse_v=self.model_cache.sparse_v, validate=False)
            outs.append(out if n == 1 else out.reshape(seqs * n, *out.shape[2:]))
        if d < len(self.batch.seq_ids):
            r = self.batch.decode_rows
            outs.append(ops.paged_attention_varlen(queries[r:, :, 0], kc, vc, pre_tables, pre_lens, pre_starts,
                                                   scale=scale, softcap=softcap, sliding_window=window, sinks=sinks,
                                                   validate=False))
        return (mx.concatenate(outs) if len(outs) > 1 else outs[0])[:, :, None]

    def _chunk_attention(self, queries, chunk: int, scale, window, sinks, softcap) -> mx.array:
        """The chunk rule on the kernels (``_ChunkView``): decode rows as a pass of decodes
        only runs them (``paged_attention`` over tables shifted to each sequence's chunk
        start), prompt rows cut at chunk starts into runs through ``paged_attention_varlen``."""
        block_size = self.model_cache.block_size
        if chunk % block_size:
            raise NotImplementedError(f"[RaggedLayerCache] the chunk rule (chunk {chunk}) needs a block size that "
                                      f"divides the chunk; this pool's blocks hold {block_size} tokens")
        view = self.batch.chunk_view(self._group, chunk)
        kc, vc = self.pool.key_caches[self._index], self.pool.value_caches[self._index]
        options = dict(scale=scale, softcap=softcap, sliding_window=window, sinks=sinks, validate=False)
        counts, d = self.batch.counts, self.batch.decodes
        outs, s, row = [], 0, 0
        while s < d:  # runs of decodes with equal row counts, as parts() cuts them
            n, e = counts[s], s
            while e < d and counts[e] == n:
                e += 1
            q = queries[row:row + (e - s) * n, :, 0]
            if view.straddles[s:e].any():  # drafts across a chunk start: that run's rows are cut too
                outs.append(ops.paged_attention_varlen(q, kc, vc, *view.runs(s, e), **options))
            else:
                q = q if n == 1 else q.reshape(e - s, n, *q.shape[1:])
                out = ops.paged_attention(q, kc, vc, view.block_tables[s:e], view.seq_lens[s:e],
                                          sparse_v=self.model_cache.sparse_v, **options)
                outs.append(out if n == 1 else out.reshape((e - s) * n, *out.shape[2:]))
            row += (e - s) * n
            s = e
        if d < len(counts):
            outs.append(ops.paged_attention_varlen(queries[row:, :, 0], kc, vc, *view.runs(d, len(counts)), **options))
        return (mx.concatenate(outs) if len(outs) > 1 else outs[0])[:, :, None]

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """None (causal within the layer's window: the kernel's own rule), or for a
        narrower requested window a marker array ``attention`` recognises."""
        if N != 1:
            raise ValueError(f"[RaggedLayerCache.make_mask] a ragged pass has rows of one token, got N={N}")
        own = self.window
        if window_size is None or (own is not None and window_size >= own):
            return None
        marker = mx.zeros((1,), dtype=mx.bool_)
        self.model_cache._remember_mask(marker, window_size)
        return marker

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False


def _synchronize_model_streams() -> None:
    """Wait for the streams mlx-lm runs the model on: a sharded model's collectives
    still in flight there (generate_step computes one token ahead) would interleave with
    ours on the same ring connection."""
    import sys

    mx.synchronize()
    generate = sys.modules.get("mlx_lm.generate")
    if generate is not None and hasattr(generate, "generation_stream"):
        mx.synchronize(generate.generation_stream)


class _SequenceRef:
    """Owns one sequence of a model cache: when the last cache holding it goes, so do its blocks."""

    __slots__ = ("model_cache", "seq_id", "__weakref__")

    def __init__(self, model_cache: PagedModelCache, seq_id):
        self.model_cache, self.seq_id = model_cache, seq_id

    def __del__(self):
        try:
            if self.seq_id in self.model_cache:
                self.model_cache.free(self.seq_id)
        except Exception:  # interpreter shutdown: nothing left to give back to
            pass


def _softcapped_attention(queries, keys, values, scale: float, softcap: float, mask) -> mx.array:
    """Softcapped attention over gathered rows with a mask array: [B, H, L, D] queries,
    [B, Hkv, T, D] keys and values (GQA by head groups)."""
    b, h, n, d = queries.shape
    hkv = keys.shape[1]
    q = (queries * scale).reshape(b, hkv, h // hkv, n, d)
    scores = q @ mx.expand_dims(keys, 2).swapaxes(-1, -2)
    scores = softcap * mx.tanh(scores / softcap)
    if mask is not None:
        if mask.ndim == 4:  # [B, 1, L, T] -> [B, 1, 1, L, T] against [B, Hkv, H / Hkv, L, T]
            mask = mx.expand_dims(mask, 2)
        if mask.dtype == mx.bool_:
            scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, scores.dtype))
        else:
            scores = scores + mask
    out = mx.softmax(scores, axis=-1, precise=True) @ mx.expand_dims(values, 2)
    return out.reshape(b, h, n, d)


def _min_window(a, b):
    return b if a is None else a if b is None else min(a, b)


def _causal_window_mask(offsets: list, num_new: int, total: int, window, *, chunk: int | None = None) -> mx.array:
    """bool [B, 1, L, T]: query l of sequence i (position offsets[i] + l) sees key t when
    t <= that position and, with a window, t > position - window; with a chunk, only keys
    of the query's own chunk (t // chunk == position // chunk)."""
    pos = mx.array(offsets, dtype=mx.int32)[:, None, None, None] + mx.arange(num_new)[None, None, :, None]
    keys = mx.arange(total)[None, None, None, :]
    mask = keys <= pos
    if window is not None:
        mask = mask & (keys > pos - window)
    if chunk is not None:
        mask = mask & (keys // chunk == pos // chunk)
    return mask


class PagedLayerCache(_LayerGroupView):
    """One layer's view of a :class:`PagedModelCache` for a forward pass over ``seq_ids``.

    Implements mlx-lm's cache protocol. ``offset`` is an int while every sequence is at
    the same position (one sequence, or a batch that started together), else an int32
    array (mlx-lm's batched caches do the same). ``refs`` (owned sequences) free their
    blocks when the last cache holding them is dropped; the Engine passes none.
    """

    def __init__(self, model_cache: PagedModelCache, layer: int, seq_ids: list, offsets: list, *, refs=None):
        self.model_cache = model_cache
        self.layer = layer
        self.seq_ids = list(seq_ids)
        self._offsets = [int(o) for o in offsets]
        self._refs = None if refs is None else list(refs)
        self._group = model_cache.layer_group[layer]
        self._index = model_cache.layer_index[layer]
        self._plan = None
        self._right_padding = None
        self._family = None

    # ------------------------------------------------------------------ protocol

    @property
    def offset(self):
        if len(set(self._offsets)) == 1:
            return self._offsets[0]
        return mx.array(self._offsets, dtype=mx.int32)

    # ChunkedKVCache's protocol (llama4 asks before building its chunk mask): positions start
    # at 0 (the rows the gather returns), though a chunk layer releases blocks before its
    # chunk (they read as zeros, and the chunk mask hides them); nothing is trimmed here.
    start_position = 0

    def maybe_trim_front(self) -> None:
        pass

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write the new rows ([B, Hkv, L, D]) into the pool and return every row written
        so far, [B, Hkv, T, D] (mlx-lm's protocol; rows a window layer released, and rows
        past a shorter sequence's end, read as zeros). The returned arrays are a lazy
        gather from the pool: ``attention`` reads the pool itself, so unless the model
        uses them otherwise they are never computed."""
        batch, num_kv_heads, num_new, head_dim = keys.shape
        if batch != len(self.seq_ids):
            self._widen(batch)
        plan = self.model_cache._plan(self._group, self.seq_ids, self._offsets, num_new)
        rows = lambda x: x.transpose(0, 2, 1, 3).reshape(batch * num_new, num_kv_heads, x.shape[-1])
        self.pool._write_trusted(self._index, rows(keys), rows(values), plan.slots)
        self._plan = plan
        self._offsets = [o + num_new for o in self._offsets]
        rows = self._gather(plan)
        if self.model_cache.specs[self.layer].shared:
            self.model_cache._remember_fetch(rows[0], self)
        return rows

    def keys_and_values(self):
        """Every row written so far, [B, Hkv, T, D], as ``update_and_fetch`` last returned
        them (mlx-lm's protocol; gemma3n's KV-shared layers and afm7's KV-reuse layers read
        another layer's rows with it). A lazy gather from the pool: an attention call over
        these rows runs kvmetal's kernels on this layer's pool, with the plan of the pass
        that wrote them (``read_owner``), so unless the model uses them otherwise they are
        never computed."""
        plan = self._current_plan()
        if plan is not None:
            rows = self._gather(plan)
        elif max(self._offsets, default=0) == 0:  # nothing written yet: no rows
            spec = self.model_cache.specs[self.layer]
            empty = mx.zeros((len(self.seq_ids), spec.num_kv_heads, 0, spec.head_dim), dtype=spec.dtype)
            rows = (empty, empty)
        else:  # not written in this pass (a loaded or copied cache): the rows the tables hold
            tables, _ = self.pool.block_tables(self.seq_ids)
            rows = backends.get().gather_kv_cache(
                self.pool.key_caches[self._index], self.pool.value_caches[self._index], tables,
                mx.array(self._offsets, dtype=mx.int32), max_len=max(self._offsets))
        _remember_read(rows[0], self)
        return rows

    def _current_plan(self) -> _Plan | None:
        """The plan of this layer's latest write while it still describes the cache (same
        sequences, offsets just past the write, each sequence still that long in the pool:
        nothing trimmed since), else None. Not the group's table version: another cache
        dropped mid-pass (its sequences freed) bumps it without touching these tables."""
        plan = self._plan
        if plan is None:
            return None
        seqs, before, num_new, _ = plan.key
        if seqs != tuple(self.seq_ids) or [o + num_new for o in before] != self._offsets:
            return None
        if any(self.pool.num_tokens(s) != o for s, o in zip(self.seq_ids, self._offsets)):
            return None
        return plan

    def check_read(self, queries: mx.array) -> None:
        """Attention over rows ``keys_and_values()`` returned runs with the plan of the pass
        that wrote them: the queries must be that pass's new tokens."""
        plan = self._current_plan()
        if plan is None or queries.ndim != 4 or queries.shape[2] != plan.key[2]:
            wrote = "no write in this pass" if plan is None else f"a write of {plan.key[2]} token(s)"
            raise NotImplementedError(f"[use_paged_cache] attention over rows read with keys_and_values() from "
                                      f"layer {self.layer}'s cache after {wrote}, with queries "
                                      f"{tuple(queries.shape)}: kvmetal attends over a cache's rows with the "
                                      f"queries of the pass that wrote them (same new tokens, same positions)")

    def attention(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask=None,
                  sinks: mx.array | None = None, softcap: float | None = None) -> mx.array:
        """Attention of ``queries`` [B, H, L, D] after ``update_and_fetch`` (``softcap``:
        ``c * tanh(s / c)`` on the scores, for families that attend by hand, e.g. gemma2).

        A mask from our own ``make_mask`` (or None / "causal") means causal attention,
        within the layer's window and any window the model asked for. Passes of up to
        ``MAX_PAGED_QUERY_TOKENS`` tokens then run ``paged_attention`` on the pool, longer
        ones (a prompt, a chunk after a cached prefix, a batch of prompts)
        ``paged_attention_varlen``: no gather and no mask array. A mask array we did not
        make is applied as given by ``mx.fast.scaled_dot_product_attention`` over the
        rows gathered from the pool."""
        if self._plan is None:
            raise RuntimeError("[PagedLayerCache] attention called before update_and_fetch")
        batch, num_heads, num_queries, head_dim = queries.shape
        known, requested, chunk = self.model_cache._mask_rule(mask)
        plan = self._plan
        if chunk is not None and chunk % self.block_size:  # the kernels' chunk rule needs whole blocks
            mask = _causal_window_mask([o - num_queries for o in self._offsets], num_queries, max(plan.max_len, 1),
                                       _min_window(self.window, requested), chunk=chunk)
            known = False
        if not known:
            self.model_cache.gathered_attention += 1
            keys, values = self._gather(plan)
            if softcap is not None:
                return _softcapped_attention(queries, keys, values, scale, softcap, mask)
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        window = _min_window(self.window, requested)
        if chunk is not None:
            return self._chunk_attention(queries, plan, chunk, scale, window, sinks, softcap)
        if num_queries == 1 and window is None and self.model_cache.options["cascade"]:
            shared = self.model_cache._cascade_args(plan)
            if shared is not None:
                out = ops.paged_attention_cascade(
                    queries[:, :, 0], self.pool.key_caches[self._index], self.pool.value_caches[self._index],
                    *shared, scale=scale, softcap=softcap, sinks=sinks, sparse_v=self.model_cache.sparse_v,
                    validate=False)
                return out[:, :, None]
        if num_queries <= MAX_PAGED_QUERY_TOKENS:
            out = ops.paged_attention(
                queries.transpose(0, 2, 1, 3),  # [B, L, H, D]
                self.pool.key_caches[self._index], self.pool.value_caches[self._index],
                plan.block_tables, plan.seq_lens, scale=scale, softcap=softcap, sliding_window=window,
                sinks=sinks, sparse_v=self.model_cache.sparse_v, validate=False)  # ops casts sinks to float32
            return out.transpose(0, 2, 1, 3)
        # Sequence i owns query rows [i * L, (i + 1) * L): its last L cached positions.
        out = ops.paged_attention_varlen(
            queries.transpose(0, 2, 1, 3).reshape(batch * num_queries, num_heads, head_dim),
            self.pool.key_caches[self._index], self.pool.value_caches[self._index],
            plan.block_tables, plan.seq_lens, plan.query_start_loc, scale=scale, softcap=softcap,
            sliding_window=window, sinks=sinks, validate=False)
        return out.reshape(batch, num_queries, num_heads, head_dim).transpose(0, 2, 1, 3)

    def _chunk_attention(self, queries, plan: _Plan, chunk: int, scale, window, sinks, softcap) -> mx.array:
        """The chunk rule on the kernels (``_ChunkView``): a pass whose query rows of each
        sequence lie in one chunk (a decode step) runs ``paged_attention`` over tables
        shifted to the chunk start; a longer one, or one whose rows cross a chunk start, runs
        ``paged_attention_varlen`` over the rows cut at chunk starts."""
        batch, num_heads, num_queries, head_dim = queries.shape
        view = self.model_cache._chunk_view(self._group, plan, chunk)
        kc, vc = self.pool.key_caches[self._index], self.pool.value_caches[self._index]
        options = dict(scale=scale, softcap=softcap, sliding_window=window, sinks=sinks, validate=False)
        if num_queries <= MAX_PAGED_QUERY_TOKENS and not view.straddles.any():
            out = ops.paged_attention(queries.transpose(0, 2, 1, 3), kc, vc, view.block_tables, view.seq_lens,
                                      sparse_v=self.model_cache.sparse_v, **options)
            return out.transpose(0, 2, 1, 3)
        q = queries.transpose(0, 2, 1, 3).reshape(batch * num_queries, num_heads, head_dim)
        out = ops.paged_attention_varlen(q, kc, vc, *view.runs(0, batch), **options)
        return out.reshape(batch, num_queries, num_heads, head_dim).transpose(0, 2, 1, 3)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        """What mlx-lm's own cache would return (one sequence), or a per-sequence causal
        mask [B, 1, N, T] (several). ``attention`` honours the requested window."""
        if window_size is not None and (not isinstance(window_size, (int, np.integer)) or window_size < 1):
            raise ValueError(f"[PagedLayerCache.make_mask] window_size must be None or an int >= 1, "
                             f"got {window_size!r}")
        own = self.window
        if N == 1 and (window_size is None or (own is not None and window_size >= own)):
            return None  # decode: paged_attention applies the layer's window itself
        if len(self.seq_ids) == 1:
            from mlx_lm.models.cache import create_attention_mask

            mask = create_attention_mask(N, offset=self._offsets[0], return_array=return_array,
                                         window_size=window_size if window_size is not None else own)
        else:
            mask = _causal_window_mask(self._offsets, N, max(self._offsets) + N, _min_window(own, window_size))
        self.model_cache._remember_mask(mask, window_size)
        return mask

    # ------------------------------------------------------------------ state (save/load, eval)

    @property
    def state(self):
        """(keys, values, info): this layer's stored rows from the first position every
        sequence still holds, [B, Hkv, T, D] for a float pool or (data, scales, biases)
        [B, Hkv, T, *] for a quantized one (saved as stored: a reload is exact). ``info``
        (int32) is [first, window (minus the chunk of a chunk layer, 0 for a full one),
        block_size, k_bits or 0, v_bits or 0, group_size, offset of each sequence...]. What
        mlx-lm evaluates after a prefill chunk and what ``save_prompt_cache`` writes;
        ``from_state`` rebuilds the cache from it."""
        first = self._first_live()
        tables, _ = self.pool.block_tables(self.seq_ids)
        tables = tables[:, first // self.block_size:]
        count = max(1, max(self._offsets) - first)
        keys, values = (_stored_rows(c, tables, count)
                        for c in (self.pool.key_caches[self._index], self.pool.value_caches[self._index]))
        fmt = self.model_cache.kv_format
        groups = _pack_groups(self.pool.k_group_size, self.pool.v_group_size)
        chunk = self.model_cache.chunks[self._group]
        info = [first, self.window or -(chunk or 0), self.block_size, fmt.k_bits or 0, fmt.v_bits or 0, groups]
        return keys, values, mx.array(info + self._offsets, dtype=mx.int32)

    @state.setter
    def state(self, v):
        keys, values, info = v
        info = [int(x) for x in np.array(info).reshape(-1)]
        first, window, block_size, k_bits, v_bits, groups = info[:6]
        k_group, v_group = _unpack_groups(groups)
        meta = dict(first=first, window=window if window > 0 else None, chunk=-window if window < 0 else None,
                    block_size=block_size, k_bits=k_bits or None,
                    v_bits=v_bits or None, k_group_size=k_group, v_group_size=v_group)
        self._restore(keys, values, info[6:], meta)

    @property
    def meta_state(self):
        """Nothing beyond ``state`` (which carries its own layout); newer mlx-lm saves it."""
        return ()

    @meta_state.setter
    def meta_state(self, v):
        pass

    @classmethod
    def from_state(cls, state, meta_state=None):
        """A standalone cache (its own pool, one layer) holding the saved rows, which
        continues exactly where the saved one was; mlx-lm's ``load_prompt_cache`` calls it."""
        obj = cls.__new__(cls)
        obj.state = state
        return obj

    def _restore(self, keys, values, offsets, meta) -> None:
        first = meta["first"]
        sample = keys if isinstance(keys, mx.array) else keys[1]  # float rows, or the scales
        head_dim = keys.shape[-1] if isinstance(keys, mx.array) else keys[1].shape[-1] * meta["k_group_size"]
        dtype = sample.dtype
        spec = LayerSpec(meta["window"], int(sample.shape[1]), int(head_dim), dtype, meta.get("chunk"))
        fmt = KVFormat(k_bits=meta["k_bits"], v_bits=meta["v_bits"], k_group_size=meta["k_group_size"],
                       v_group_size=meta["v_group_size"])
        model_cache = PagedModelCache([spec], block_size=meta["block_size"], kv_format=fmt)
        refs = [model_cache._new_ref() for _ in offsets]
        pool = model_cache.pools[0]
        for i, (ref, total) in enumerate(zip(refs, offsets)):
            model_cache.append(ref.seq_id, num_tokens=total)
            if first:
                pool.evict(ref.seq_id, window=total - first)
            if total > first:
                slots = pool.slots(ref.seq_id, first, total)
                pool.key_caches[0] = _store_rows(pool.key_caches[0], slots, keys, i, total - first)
                pool.value_caches[0] = _store_rows(pool.value_caches[0], slots, values, i, total - first)
        PagedLayerCache.__init__(self, model_cache, 0, [r.seq_id for r in refs], offsets, refs=refs)

    # ------------------------------------------------------------------ copies and batching (table operations)

    def __deepcopy__(self, memo):
        """An independent cache sharing blocks copy-on-write (a fork), like mlx-lm's copy.
        The layers of one deep-copied prompt cache share one fork through ``memo``."""
        key = ("kvmetal-fork", id(self.model_cache), tuple(self.seq_ids))
        if key not in memo:
            memo[key] = [self.model_cache._new_ref(parent=s) for s in self.seq_ids]
        return self._view(memo[key], list(self._offsets))

    def extract(self, idx: int) -> "PagedLayerCache":
        """Sequence ``idx`` as a one-sequence cache (a fork)."""
        seq = self.seq_ids[idx]
        refs = self.model_cache._shared(("extract", seq), lambda: [self.model_cache._new_ref(parent=seq)])
        return self._view(refs, [self._offsets[idx]])

    @classmethod
    def merge(cls, caches) -> "PagedLayerCache":
        """One batched cache over the sequences of ``caches`` (forks; same pool required)."""
        caches = list(caches)
        model_cache = caches[0].model_cache
        if any(c.model_cache is not model_cache for c in caches):
            raise ValueError("[PagedLayerCache.merge] caches from different kvmetal pools cannot be merged "
                             "without copying; make them with one use_paged_cache handle")
        seqs = tuple(s for c in caches for s in c.seq_ids)
        refs = model_cache._shared(("merge", seqs), lambda: [model_cache._new_ref(parent=s) for s in seqs])
        return caches[0]._view(refs, [o for c in caches for o in c._offsets])

    def extend(self, other: "PagedLayerCache") -> None:
        """Append ``other``'s sequences to this batch (forks, so ``other`` stays valid)."""
        if other.model_cache is not self.model_cache:
            raise ValueError("[PagedLayerCache.extend] caches from different kvmetal pools cannot be joined")
        seqs = tuple(other.seq_ids)
        refs = self.model_cache._shared(("extend", seqs), lambda: [self.model_cache._new_ref(parent=s) for s in seqs])
        self._take_refs()
        self.seq_ids += [r.seq_id for r in refs]
        self._refs += refs
        self._offsets += list(other._offsets)
        self._plan = None

    def filter(self, batch_indices) -> None:
        """Keep only these sequences (the others' blocks go back once no cache holds them)."""
        keep = [int(i) for i in (batch_indices.tolist() if isinstance(batch_indices, mx.array) else batch_indices)]
        self.seq_ids = [self.seq_ids[i] for i in keep]
        self._offsets = [self._offsets[i] for i in keep]
        if self._refs is not None:
            self._refs = [self._refs[i] for i in keep]
        self._plan = None

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None) -> None:
        """BatchGenerator's padding: right padding is written, then cut by ``finalize``."""
        if left_padding is not None and max(left_padding) > 0:
            raise NotImplementedError("[PagedLayerCache.prepare] left padding is not supported: paged "
                                      "sequences need no padding; pad on the right (BatchGenerator does)")
        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = [int(p) for p in right_padding]

    def finalize(self) -> None:
        """Forget each sequence's right padding (truncating the sequence in the pool)."""
        if self._right_padding is None:
            return
        for i, (seq, pad) in enumerate(zip(self.seq_ids, self._right_padding)):
            target = self._offsets[i] - pad
            if self.pool.num_tokens(seq) > target:
                self.model_cache.truncate(seq, target)
            self._offsets[i] = target
        self._right_padding = None
        self._plan = None

    # ------------------------------------------------------------------ the rest of mlx-lm's protocol

    def is_trimmable(self) -> bool:
        """Always: unlike mlx-lm's RotatingKVCache, a window layer keeps whole blocks and
        can go back as far as its window stays intact (``trim`` raises past that), which
        covers speculative decoding's rewinds."""
        return True

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens of every sequence (the first layer of a group
        truncates the pool; the others follow)."""
        n = min(min(self._offsets), int(n))
        for i, seq in enumerate(self.seq_ids):
            target = self._offsets[i] - n
            if self.pool.num_tokens(seq) > target:
                self._check_window_intact(seq, target)
                self.pool.truncate(seq, target)
                self.model_cache._touch(self._group)
            self._offsets[i] = target
        return n

    def _check_window_intact(self, seq, target: int) -> None:
        """The next token after ``target`` sees the last window - 1 tokens (a chunk layer:
        its chunk from its start): all still held?"""
        chunk = self.model_cache.chunks[self._group]
        if self.window is None and chunk is None:
            return
        needed = max(0, target - (self.window - 1)) if self.window is not None else _chunk_start(target, chunk)
        table = self.pool.allocator.block_table(seq)
        if any(b == HOLE for b in table[needed // self.block_size: -(-target // self.block_size)]):
            raise ValueError(f"[PagedLayerCache.trim] cannot go back to {target} tokens: this window (or chunk) "
                             f"layer already released tokens its window (chunk) would need there")

    def to_quantized(self, group_size: int = 64, bits: int = 4) -> "PagedLayerCache":
        """mlx-lm's ``kv_bits`` / ``quantized_kv_start``: K and V of every layer move to
        ``bits``. The pool is converted in place when these sequences are all it holds,
        else they are copied into a quantized pool of their own."""
        o = self.model_cache.kv_format
        pool = self.pool
        if o.k_bits == bits and o.v_bits == bits and pool.k_group_size == pool.v_group_size == group_size:
            return self
        if o.quantized:
            raise ValueError(f"[PagedLayerCache.to_quantized] the cache already holds K{o.k_bits}/V{o.v_bits} "
                             f"rows; cannot requantize to {bits} bits")
        model_cache = self.model_cache
        live = set(model_cache.pools[0].allocator.sequences())
        if live <= set(self.seq_ids):
            model_cache.quantize(k_bits=bits, v_bits=bits, group_size=group_size)
            return self
        seqs = tuple(self.seq_ids)
        refs = model_cache._shared(("quantize", seqs, bits, group_size),
                                   lambda: _quantized_copy(model_cache, list(seqs), bits, group_size))
        return PagedLayerCache(refs[0].model_cache, self.layer, [r.seq_id for r in refs], self._offsets, refs=refs)

    def size(self) -> int:
        return max(self._offsets)

    def empty(self) -> bool:
        return all(o == 0 for o in self._offsets)

    @property
    def block_size(self) -> int:
        return self.model_cache.block_size

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's K and V in the blocks these sequences hold."""
        blocks = {b for s in self.seq_ids for b in self.pool.allocator.block_table(s) if b != HOLE}
        return len(blocks) * self.pool.bytes_per_block // self.pool.num_layers

    # ------------------------------------------------------------------ internals

    def _gather(self, plan: _Plan):
        """Every row of the plan's sequences, [B, Hkv, T, D], as a lazy graph. Straight to the
        backend: the plan's indices are ours, and update_and_fetch builds this node on every
        layer and step (the checked op costs about 24 us of host time a layer)."""
        return backends.get().gather_kv_cache(self.pool.key_caches[self._index], self.pool.value_caches[self._index],
                                              plan.block_tables, plan.seq_lens, max_len=max(plan.max_len, 1))

    def _first_live(self) -> int:
        """First token position every sequence still holds (a window layer drops blocks)."""
        return min((_first_live_token(self.pool, seq) for seq in self.seq_ids), default=0)

    def _view(self, refs: list, offsets: list) -> "PagedLayerCache":
        return PagedLayerCache(self.model_cache, self.layer, [r.seq_id for r in refs], offsets, refs=refs)

    def _take_refs(self) -> None:
        if self._refs is None:
            raise ValueError("[PagedLayerCache] this cache serves sequences an Engine owns; batch them there")

    def _widen(self, batch: int) -> None:
        """A fresh ``make_cache()`` cache meeting a batch of B prompts serves B sequences
        (like mlx-lm's KVCache); any other mismatch says how to batch."""
        family = {} if self._family is None else self._family
        joining = batch in family and self._offsets == [0]  # another layer of this pass widened already
        empty = self._offsets == [0] and self.pool.num_tokens(self.seq_ids[0]) == 0
        if self._refs is None or not (joining or empty):
            raise ValueError(f"[PagedLayerCache] keys hold {batch} sequences, the cache serves "
                             f"{len(self.seq_ids)}. A fresh make_cache() cache takes a batch of prompts of one "
                             f"length in its first forward pass; to batch sequences of different lengths or "
                             f"histories use kvmetal's Engine or mlx-lm's BatchGenerator (which merges one "
                             f"cache per sequence)")
        if batch not in family:  # the first layer of the pass adds the sequences, the others join
            family[batch] = [self.model_cache._new_ref() for _ in range(batch - 1)]
        refs = family[batch]
        self.seq_ids += [r.seq_id for r in refs]
        self._refs += refs
        self._offsets = [0] * batch
        self._plan = None


def _pool_arrays(cache) -> list:
    return list(cache.arrays()) if isinstance(cache, quant.QuantizedKV) else [cache]


def _stored_rows(cache, tables: mx.array, count: int):
    """The rows of the blocks in ``tables`` [B, M] as stored, [B, Hkv, count, *]: a float
    array, or (data, scales, biases) of a quantized cache."""
    def rows(a):
        b, m = tables.shape
        x = a[tables]  # [B, M, Hkv, bs, X]
        return x.transpose(0, 2, 1, 3, 4).reshape(b, a.shape[1], m * a.shape[2], a.shape[3])[:, :, :count]
    arrays = [rows(a) for a in _pool_arrays(cache)]
    return arrays[0] if len(arrays) == 1 else tuple(arrays)


def _store_rows(cache, slots: np.ndarray, saved, index: int, count: int):
    """``cache`` with sequence ``index``'s first ``count`` saved rows written at ``slots``."""
    def store(a, rows):
        n, h, bs, x = a.shape
        flat = a.transpose(0, 2, 1, 3).reshape(n * bs, h, x)
        flat[mx.array(slots.astype(np.int32))] = rows[index, :, :count].transpose(1, 0, 2).astype(a.dtype)
        return flat.reshape(n, bs, h, x).transpose(0, 2, 1, 3)
    parts = [saved] if isinstance(saved, mx.array) else list(saved)
    arrays = [store(a, rows) for a, rows in zip(_pool_arrays(cache), parts)]
    return cache.replace(*arrays) if isinstance(cache, quant.QuantizedKV) else arrays[0]


def _first_live_token(pool: PagedKVCache, seq_id) -> int:
    """Position of the first token ``seq_id`` still holds in ``pool`` (evicted blocks are HOLE)."""
    table = pool.allocator.block_table(seq_id)
    return next((i for i, b in enumerate(table) if b != HOLE), len(table)) * pool.block_size


def _quantized_copy(model_cache: PagedModelCache, seq_ids: list, bits: int, group_size: int) -> list:
    """Refs to copies of ``seq_ids``' live rows in a new quantized PagedModelCache."""
    options = dict(model_cache.options, kv_format=KVFormat(k_bits=bits, v_bits=bits, k_group_size=group_size,
                                                           v_group_size=group_size))
    target = PagedModelCache(model_cache.specs, **options)
    refs = [target._new_ref() for _ in seq_ids]
    for src, ref in zip(seq_ids, refs):
        total = model_cache.num_tokens(src)
        target.append(ref.seq_id, num_tokens=total)
        for pool, dst_pool in zip(model_cache.pools, target.pools):
            first = _first_live_token(pool, src)
            if first:
                dst_pool.evict(ref.seq_id, window=total - first)
            if total == first:
                continue
            tables, _ = pool.block_tables([src])
            lens = mx.array([total - first], dtype=mx.int32)
            slots = mx.array(dst_pool.slots(ref.seq_id, first, total).astype(np.int32))
            for layer in range(pool.num_layers):
                k, v = ops.gather_kv_cache(pool.key_caches[layer], pool.value_caches[layer],
                                           tables[:, first // pool.block_size:], lens, max_len=total - first,
                                           validate=False)
                dst_pool._write_trusted(layer, k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2), slots)
    return refs
