"""The paged KV state of a whole model, and the per-layer cache objects mlx-lm models call.

A model's layers are grouped by what their cache must keep: full-attention layers in
one :class:`~kvmetal.PagedKVCache`, each sliding-window size in another (so a window
group can release blocks the window left behind while full layers keep theirs). Every
group sees the same sequence ids.

:class:`PagedLayerCache` speaks mlx-lm's cache protocol (``offset``,
``update_and_fetch``, ``make_mask``, ``state``, ``trim``...) for one layer and one or
more sequences. Dimension names: B sequences, H query heads, Hkv kv heads, L new
tokens, T cached tokens, D head_dim.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .. import ops, quant
from ..cache import KVCacheFull, PagedKVCache

INITIAL_BLOCKS = 64  # first size of a pool that grows on demand
GROWTH = 0.25  # a full growable pool adds this fraction of its size: held bytes stay near the need


@dataclass(frozen=True)
class LayerSpec:
    """What one attention layer stores: its window (None = full) and K/V row shape."""

    window: int | None
    num_kv_heads: int
    head_dim: int
    dtype: mx.Dtype


@dataclass
class _Plan:
    """Index arrays of one forward pass over one group, shared by all its layers."""

    key: tuple
    slots: mx.array  # int32 [B * L]
    block_tables: mx.array  # int32 [B, M]
    seq_lens: mx.array  # int32 [B], new tokens included
    max_len: int


def _one_group_size(k_group_size, v_group_size) -> int:
    """PagedKVCache quantizes K and V with one group size."""
    sizes = {g for g in (k_group_size, v_group_size) if g is not None}
    if len(sizes) > 1:
        raise NotImplementedError(f"[PagedModelCache] k_group_size {k_group_size} and v_group_size "
                                  f"{v_group_size} differ; the paged cache takes one group size for K and V")
    return sizes.pop() if sizes else quant.DEFAULT_GROUP_SIZE


class PagedModelCache:
    """Paged K/V for every layer of one model, shared by any number of sequences.

    Args:
        specs: one :class:`LayerSpec` per layer.
        block_size: tokens per block.
        num_blocks: blocks per group pool; None starts small and grows on demand.
        k_bits, v_bits: quantize K / V (None keeps them in the model's float dtype).
        k_group_size, v_group_size: quantization group sizes (None: the default, 64).
    """

    def __init__(self, specs, *, block_size: int = 16, num_blocks: int | None = None,
                 k_bits: int | None = None, v_bits: int | None = None,
                 k_group_size: int | None = None, v_group_size: int | None = None):
        group_size = _one_group_size(k_group_size, v_group_size)
        self.specs = list(specs)
        self.growable = num_blocks is None
        group_keys = []
        self.layer_group, self.layer_index = [], []
        for spec in self.specs:
            if spec not in group_keys:
                group_keys.append(spec)
            g = group_keys.index(spec)
            self.layer_group.append(g)
            self.layer_index.append(sum(1 for x in self.layer_group[:-1] if x == g))
        self.windows = [spec.window for spec in group_keys]
        self.pools = [
            PagedKVCache(num_layers=self.layer_group.count(g), num_kv_heads=spec.num_kv_heads,
                         head_dim=spec.head_dim, num_blocks=num_blocks or INITIAL_BLOCKS,
                         block_size=block_size, dtype=spec.dtype, k_bits=k_bits, v_bits=v_bits,
                         group_size=group_size)
            for g, spec in enumerate(group_keys)
        ]
        self.block_size = block_size
        self._version = [0] * len(self.pools)  # bumped on every table change: plans go stale
        self._plans = [None] * len(self.pools)
        self.peak_used_bytes = 0

    # ------------------------------------------------------------------ sequences

    def add_sequence(self, seq_id, tokens=None, *, num_tokens: int | None = None) -> int:
        """Start a sequence in every group; returns the leading tokens already cached in
        all of them (prefix sharing), i.e. where the caller's forward pass must start.
        Checks every group's room first: on ``KVCacheFull`` nothing changed."""
        start = 0
        if tokens is not None:
            start = min(p.allocator.cached_prefix(tokens) for p in self.pools)
        for g, pool in enumerate(self.pools):
            fits = lambda: pool.allocator.can_add(tokens, num_tokens=num_tokens, share_limit=start)
            while not fits():
                if not self.growable:
                    raise KVCacheFull(f"[add_sequence] sequence {seq_id!r} does not fit in the free blocks")
                self._grow(g)
        for pool in self.pools:
            pool.add_sequence(seq_id, tokens, num_tokens=num_tokens, share_limit=start)
        self._touch()
        return start

    def append(self, seq_id, tokens=None, *, num_tokens: int | None = None) -> None:
        """Extend a sequence in every group (window groups first drop what they no longer need).
        Checks every group's room first: on ``KVCacheFull`` only evictions happened."""
        count = len(tokens) if tokens is not None else num_tokens
        for pool, window in zip(self.pools, self.windows):
            if window is not None:
                # The first new query sees the last window - 1 cached tokens and itself.
                pool.evict(seq_id, window=window - 1)
        for g, pool in enumerate(self.pools):
            while pool.allocator.blocks_needed(seq_id, count) > pool.allocator.num_free:
                if not self.growable:
                    raise KVCacheFull(f"[append] sequence {seq_id!r} needs more blocks than are free")
                self._grow(g)
        for pool in self.pools:
            pool.append(seq_id, tokens, num_tokens=num_tokens)
        self._touch()

    def truncate(self, seq_id, num_tokens: int) -> None:
        for pool in self.pools:
            pool.truncate(seq_id, num_tokens)
        self._touch()

    def free(self, seq_id) -> None:
        for pool in self.pools:
            pool.free(seq_id)
        self._touch()

    def fork(self, parent_id, child_id) -> None:
        for pool in self.pools:
            pool.fork(parent_id, child_id)
        self._touch()

    def num_tokens(self, seq_id) -> int:
        return self.pools[0].num_tokens(seq_id)

    def layer_caches(self, seq_ids, offsets=None) -> list:
        """mlx-lm cache objects, one per layer, for a forward pass over ``seq_ids``."""
        seq_ids = list(seq_ids)
        offsets = [self.num_tokens(s) for s in seq_ids] if offsets is None else list(offsets)
        return [PagedLayerCache(self, layer, seq_ids, offsets) for layer in range(len(self.specs))]

    # ------------------------------------------------------------------ accounting

    @property
    def nbytes(self) -> int:
        """Bytes of every pool (allocated memory, used or not)."""
        return sum(p.nbytes for p in self.pools)

    @property
    def used_bytes(self) -> int:
        """Bytes of the blocks live sequences own (every group)."""
        return sum(p.used_bytes for p in self.pools)

    def stats(self) -> dict:
        per_group = [p.stats() for p in self.pools]
        total = {k: sum(s[k] for s in per_group) for k in per_group[0] if k not in ("block_size", "sequences")}
        total["sequences"] = per_group[0]["sequences"]
        total["groups"] = len(self.pools)
        return total

    # ------------------------------------------------------------------ internals

    def _touch(self, group: int | None = None):
        """Tables changed (in ``group``, or all): cached plans are stale."""
        for g in range(len(self._version)) if group is None else (group,):
            self._version[g] += 1
        self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)

    def _grow(self, g: int) -> None:
        pool = self.pools[g]
        pool.grow(max(8, int(pool.allocator.num_blocks * GROWTH)))

    def _extend_group(self, g: int, seq_id, num_new: int) -> None:
        """mlx-lm's path: the first layer of a group to see new tokens makes room for them."""
        pool, window = self.pools[g], self.windows[g]
        if window is not None:
            pool.evict(seq_id, window=window - 1)
        while pool.allocator.blocks_needed(seq_id, num_new) > pool.allocator.num_free:
            if not self.growable:
                raise KVCacheFull(f"[PagedLayerCache] sequence {seq_id!r} needs more blocks than are free")
            self._grow(g)
        pool.append(seq_id, num_tokens=num_new)
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
                key = key[:3] + (self._version[g],)
            elif have != off + num_new:
                raise ValueError(f"[PagedLayerCache] sequence {seq!r} holds {have} tokens in this layer group, "
                                 f"but the layer is at offset {off} with {num_new} new tokens")
        slots = np.concatenate([pool.slots(s, o, o + num_new) for s, o in zip(seq_ids, offsets)])
        tables, lens = pool.block_tables(seq_ids)
        plan = _Plan(key, mx.array(slots.astype(np.int32)), tables, lens, max(offsets) + num_new)
        self._plans[g] = plan
        return plan


class PagedLayerCache:
    """One layer's view of a :class:`PagedModelCache` for a forward pass over ``seq_ids``.

    Implements mlx-lm's cache protocol. With one sequence ``offset`` is an int (mlx-lm's
    generate); with several it is an int32 array (batched decode, one token each).
    """

    def __init__(self, model_cache: PagedModelCache, layer: int, seq_ids: list, offsets: list):
        self.model_cache = model_cache
        self.layer = layer
        self.seq_ids = list(seq_ids)
        self._offsets = [int(o) for o in offsets]
        self._group = model_cache.layer_group[layer]
        self._index = model_cache.layer_index[layer]
        self._plan = None

    # ------------------------------------------------------------------ protocol

    @property
    def offset(self):
        if len(self._offsets) == 1:
            return self._offsets[0]
        return mx.array(self._offsets, dtype=mx.int32)

    @property
    def pool(self) -> PagedKVCache:
        return self.model_cache.pools[self._group]

    @property
    def window(self) -> int | None:
        return self.model_cache.windows[self._group]

    def update_and_fetch(self, keys: mx.array, values: mx.array):
        """Write the new rows ([B, Hkv, L, D]) into the pool.

        Returns the layer's keys/values [B, Hkv, T, D] gathered from the pool when L > 1
        (prefill attends over them) and the new rows themselves when L == 1: decode
        attention reads the pool directly (``attention``), so nothing is gathered."""
        batch, num_kv_heads, num_new, head_dim = keys.shape
        if batch != len(self.seq_ids):
            raise ValueError(f"[PagedLayerCache] keys hold {batch} sequences, the cache serves {len(self.seq_ids)}")
        if batch > 1 and num_new != 1:
            raise ValueError("[PagedLayerCache] several sequences at once must each add exactly one token (decode)")
        plan = self.model_cache._plan(self._group, self.seq_ids, self._offsets, num_new)
        rows = lambda x: x.transpose(0, 2, 1, 3).reshape(batch * num_new, num_kv_heads, x.shape[-1])
        self.pool.write(self._index, rows(keys), rows(values), plan.slots)
        self._plan = plan
        self._offsets = [o + num_new for o in self._offsets]
        if num_new == 1:
            return keys, values
        return ops.gather_kv_cache(self.pool.key_caches[self._index], self.pool.value_caches[self._index],
                                   plan.block_tables, plan.seq_lens, max_len=plan.max_len, validate=False)

    def attention(self, queries: mx.array, keys: mx.array, values: mx.array, *, scale: float, mask=None,
                  sinks: mx.array | None = None) -> mx.array:
        """Attention of ``queries`` [B, H, L, D] after ``update_and_fetch``.

        Decode (L == 1) runs one batched ``paged_attention`` over the pool; prefill
        attends over the gathered keys/values with the causal (and window) mask."""
        if self._plan is None:
            raise RuntimeError("[PagedLayerCache] attention called before update_and_fetch")
        batch, num_heads, num_queries, head_dim = queries.shape
        if num_queries > 1:
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        plan = self._plan
        out = ops.paged_attention(
            queries.reshape(batch, num_heads, head_dim),
            self.pool.key_caches[self._index], self.pool.value_caches[self._index],
            plan.block_tables, plan.seq_lens, scale=scale, sliding_window=self.window,
            sinks=None if sinks is None else sinks.astype(mx.float32), validate=False)
        return out.reshape(batch, num_heads, 1, head_dim)

    def make_mask(self, N: int, return_array: bool = False, window_size: int | None = None):
        if N == 1:
            return None  # decode: paged_attention applies the window itself
        if len(self._offsets) != 1:
            raise ValueError("[PagedLayerCache] prefill serves one sequence at a time")
        from mlx_lm.models.cache import create_attention_mask

        return create_attention_mask(N, offset=self._offsets[0], return_array=return_array, window_size=window_size)

    @property
    def state(self):
        """This layer's pool arrays (what ``mx.eval([c.state ...])`` must materialise)."""
        arrays = []
        for c in (self.pool.key_caches[self._index], self.pool.value_caches[self._index]):
            arrays += list(c.arrays()) if hasattr(c, "arrays") else [c]
        return arrays

    def is_trimmable(self) -> bool:
        # Like mlx-lm's RotatingKVCache: a window layer is trimmable until it dropped tokens.
        one = len(self.seq_ids) == 1
        return one and (self.window is None or self._offsets[0] < self.window)

    def trim(self, n: int) -> int:
        """Forget the last ``n`` tokens (the first layer of a group truncates the sequence)."""
        if not self.is_trimmable():
            raise ValueError("[PagedLayerCache] only a one-sequence cache can be trimmed")
        n = min(self._offsets[0], n)
        seq = self.seq_ids[0]
        target = self._offsets[0] - n
        if self.pool.num_tokens(seq) > target:
            self.pool.truncate(seq, target)
            self.model_cache._touch(self._group)
        self._offsets[0] = target
        return n

    def size(self) -> int:
        return self._offsets[0] if len(self._offsets) == 1 else max(self._offsets)

    def empty(self) -> bool:
        return all(o == 0 for o in self._offsets)

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's K and V pools."""
        return sum(a.nbytes for a in self.state)
