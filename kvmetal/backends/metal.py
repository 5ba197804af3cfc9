"""The metal backend: hand-written kernels in ``kernels/*.metal``, launched with
``mx.fast.metal_kernel``. A :class:`KernelBackend` turns the kernel descriptions of
metal_specs.py into kernel objects with one ``make_kernel`` function (MLX's here; the
simulator's in ``kvmetal.sim.backend``), lays each launch out with metal_layout.py, builds
each specialisation once per process and implements the contract functions of
``kvmetal.backends``. Arguments arrive checked and normalised by ``kvmetal.ops``.

Dimension glossary: S sequences, B batch, H query heads, Hkv kv heads, G = H / Hkv,
D head_dim, N cache blocks, BS block size, M block-table width, T tokens.
"""
from __future__ import annotations

import functools
import threading
from typing import Callable

import mlx.core as mx
import numpy as np

from ..quant import QuantizedKV, packed_words
from .metal_cascade import plan as cascade_plan
from . import metal_layout, metal_specs
from .metal_layout import (CASCADE_CHUNK_ROWS, SPLIT_TOKENS, SPLIT_UNIT,
                           VARLEN_SPLIT_TOKENS, VarlenTiles, _window_fields, cache_format, choose_num_splits,
                           layout_for, split_policy, tiles_threadgroup_bytes, varlen_plan, varlen_tiles,
                           window_div, window_growth, window_splits)
from .metal_specs import (ATTENTION_PARAMS, CASCADE_REDUCE_PARAMS, DTYPE_TAGS, GATHER_PARAMS, Geometry, KernelSpec,
                          SPECS, kernel_text, math_mode_for)

# ----------------------------------------------------------------------------- helpers

def _cache_parts(cache):
    """(data, scales, biases, element dtype, bits, group size) of one K or V cache.

    A float cache gets 8-element placeholders for scales/biases: never read, and
    large enough that MLX binds them as `device` buffers like real ones (inputs
    under 8 elements go to `constant`). They are 4-D so that `<name>_strides`
    has the four entries the strided kernels index.
    """
    dtype, bits, group_size = cache_format(cache)
    if isinstance(cache, QuantizedKV):
        return cache.data, cache.scales, cache.biases, dtype, bits, group_size
    placeholder = _placeholder(cache.dtype)
    return cache, placeholder, placeholder, dtype, bits, group_size


@functools.lru_cache(maxsize=None)
def _placeholder_cached(dtype_tag: str):
    dtype = {v: k for k, v in DTYPE_TAGS.items()}[dtype_tag]
    return mx.zeros((1, 1, 1, 8), dtype=dtype)


def _placeholder(dtype):
    return _placeholder_cached(DTYPE_TAGS[dtype])


# MLX binds an input with fewer than this many elements as a `constant` buffer, which
# is part of the pipeline's signature (its mangled name ends in "c").
MIN_DEVICE_ELEMENTS = 8


def _device_bound(a: mx.array) -> mx.array:
    """``a``, or ``a`` grown along its first axis with zero rows to at least
    MIN_DEVICE_ELEMENTS elements (an empty one: zeros of its rank; a scalar stays), so that
    MLX binds it `device` whatever the batch: seq_lens, slot_of, prefix_lens, sinks,
    small block tables and partials of a batch of 1-7 would otherwise be `constant` and
    run another compiled pipeline than batch 8+ (under relaxed math the two need not
    give the same bits: issue 41, R1). Kernels index these arrays by row and never read
    their shapes, so the added rows are never read."""
    if a.ndim == 0 or a.size >= MIN_DEVICE_ELEMENTS:
        return a
    row = 1
    for d in a.shape[1:]:
        row *= d
    if row == 0:
        return mx.zeros((MIN_DEVICE_ELEMENTS,) + (1,) * (a.ndim - 1), dtype=a.dtype)
    extra = -(-MIN_DEVICE_ELEMENTS // row) - a.shape[0]
    return mx.concatenate([a, mx.zeros((extra,) + tuple(a.shape[1:]), dtype=a.dtype)], axis=0)


_BITS = {1: mx.uint8, 2: mx.uint16, 4: mx.uint32}


def _scatter_rows(array: mx.array, row_index: mx.array, rows: mx.array, write: mx.array) -> mx.array:
    """``array`` viewed as [rows, width] with ``rows`` written at ``row_index``.

    MLX scatters: they run in place (buffer donation) when ``array`` has no other
    reference by the time they are evaluated, i.e. when the caller rebinds the result.
    ``write`` (bool per row of ``rows``) masks the writes: two integer scatters on
    the bits, ``old * 0 + new`` where set and ``old * 1 + 0`` where not, exact for
    any value incl. NaN. (Reading the old rows instead would hold a second
    reference to the cache and cost the donation.) Rows written more than once
    must all be masked off but one; ops rejects duplicate slots with validate=True.
    """
    width = array.shape[-1]
    flat = array.reshape(-1, width)
    new = rows.reshape(-1, width)
    bits = _BITS[array.dtype.size]
    keep = mx.where(write, 0, 1).astype(bits)[:, None]
    words = flat.view(bits)
    words = words.at[row_index].multiply(mx.broadcast_to(keep, new.shape))
    words = words.at[row_index].add(new.view(bits) * (1 - keep))
    return words.view(array.dtype).reshape(array.shape)


# ----------------------------------------------------------------------------- backend

class KernelBackend:
    """The five contract functions over SPECS, with kernels made by ``make_kernel``."""

    def __init__(self, name: str, make_kernel: Callable, *, call_options: Callable | None = None,
                 macos: int | None = None):
        self.name = name
        self.macos = metal_specs.default_macos_version() if macos is None else int(macos)
        self._make_kernel = make_kernel
        self._call_options = call_options or (lambda: {})
        self._kernels = {}
        self._lock = threading.Lock()

    # -- building and launching

    def kernel(self, spec: KernelSpec, template_values: dict):
        """The kernel object of one specialisation, built once per process."""
        variant = spec.variant(template_values)
        with self._lock:
            if variant not in self._kernels:
                header, body = kernel_text(spec.name)
                self._kernels[variant] = self._make_kernel(
                    name=variant, input_names=list(spec.inputs), output_names=list(spec.outputs),
                    source=body, header=header, ensure_row_contiguous=spec.row_contiguous,
                    compile_options={"math_mode": math_mode_for(spec.math_mode, self.macos)})
            return self._kernels[variant]

    def launch(self, name: str, template_values: dict, geometry: Geometry, output_shapes: list,
               output_dtypes: list, **inputs) -> list:
        """Run kernel ``name`` with its inputs by name, checked against SPECS first."""
        spec = SPECS[name]
        missing = [n for n in spec.inputs if n not in inputs]
        extra = sorted(set(inputs) - set(spec.inputs))
        if missing or extra:
            raise TypeError(f"[metal] {name} takes inputs {list(spec.inputs)}; missing {missing}, unexpected {extra}")
        for n in spec.inputs:
            if not isinstance(inputs[n], mx.array):
                raise TypeError(f"[metal] {name} input '{n}' must be an mx.array, got {type(inputs[n]).__name__}")
        absent = [k for k in spec.template if k not in template_values]
        if absent:
            raise TypeError(f"[metal] {name} needs template values {absent}")
        if len(output_shapes) != len(spec.outputs) or len(output_dtypes) != len(spec.outputs):
            raise TypeError(f"[metal] {name} has outputs {list(spec.outputs)}")
        kernel = self.kernel(spec, template_values)
        return kernel(inputs=[_device_bound(inputs[n]) for n in spec.inputs],
                      template=[(k, template_values[k]) for k in spec.template],
                      grid=geometry.grid, threadgroup=geometry.threadgroup,
                      output_shapes=output_shapes, output_dtypes=output_dtypes, **self._call_options())

    # -- writes

    def reshape_and_cache(self, key, value, key_cache, value_cache, slot_mapping):
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return key_cache, value_cache
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        # Index guard: a slot outside [0, N * BS) (negative = padding, or validate=False
        # misuse) writes nothing. Such tokens aim at row 0 with their write masked off
        # (``write`` false, see _scatter_rows), so the scatter needs no host sync.
        valid = (slot_mapping >= 0) & (slot_mapping < num_blocks * block_size)
        slots = mx.where(valid, slot_mapping, 0)
        block, offset = slots // block_size, slots % block_size
        heads = mx.arange(num_kv_heads, dtype=mx.int32)
        row_index = ((block[:, None] * num_kv_heads + heads[None, :]) * block_size + offset[:, None]).reshape(-1)
        write = mx.broadcast_to(valid[:, None], (num_tokens, num_kv_heads)).reshape(-1)
        return (self._write_rows(key, key_cache, row_index, write),
                self._write_rows(value, value_cache, row_index, write))

    def _write_rows(self, rows, cache, row_index, write):
        num_tokens, num_kv_heads, head_dim = rows.shape
        if not isinstance(cache, QuantizedKV):
            template = dict(TC=cache.dtype, D=head_dim)
            geometry = SPECS["cache_rows_convert"].geometry(tokens=num_tokens, num_kv_heads=num_kv_heads,
                                                            head_dim=head_dim)
            (converted,) = self.launch("cache_rows_convert", template, geometry, [rows.shape], [cache.dtype],
                                       new_rows=rows)
            return _scatter_rows(cache, row_index, converted, write)
        groups = head_dim // cache.group_size
        template = dict(TC=cache.dtype, D=head_dim, BITS=cache.bits, GS=cache.group_size)
        geometry = SPECS["cache_rows_quantize"].geometry(tokens=num_tokens, num_kv_heads=num_kv_heads,
                                                         groups=groups)
        words, scales, biases = self.launch(
            "cache_rows_quantize", template, geometry,
            [(num_tokens, num_kv_heads, packed_words(head_dim, cache.bits)), (num_tokens, num_kv_heads, groups),
             (num_tokens, num_kv_heads, groups)],
            [mx.uint32, cache.dtype, cache.dtype], new_rows=rows)
        return cache.replace(_scatter_rows(cache.data, row_index, words, write),
                             _scatter_rows(cache.scales, row_index, scales, write),
                             _scatter_rows(cache.biases, row_index, biases, write))

    def copy_blocks(self, key_cache, value_cache, src, dst):
        if src.shape[0] == 0:
            return key_cache, value_cache
        # Index guard: a pair with src or dst outside [0, N) (validate=False misuse)
        # copies nothing: it reads block 0 and writes it nowhere (a masked write).
        # K and V have the same N (ops checks); src, dst are int32 (the contract).
        num_blocks = key_cache.shape[0]
        valid = (src >= 0) & (src < num_blocks) & (dst >= 0) & (dst < num_blocks)
        src = mx.where(valid, src, 0)
        dst = mx.where(valid, dst, 0)
        return self._copy(key_cache, src, dst, valid), self._copy(value_cache, src, dst, valid)

    def _copy(self, cache, src, dst, valid):
        """``cache`` with block ``src[i]`` copied to ``dst[i]`` where ``valid[i]`` (ids already guarded)."""
        if isinstance(cache, QuantizedKV):
            return cache.replace(*(self._copy(part, src, dst, valid) for part in cache.arrays()))
        blocks = cache.reshape(cache.shape[0], -1)
        width = blocks.shape[1]
        geometry = SPECS["copy_blocks_gather"].geometry(width=width, count=src.shape[0])
        (copied,) = self.launch("copy_blocks_gather", dict(T=cache.dtype), geometry, [(src.shape[0], width)],
                                [cache.dtype], blocks=blocks, src=src)
        return _scatter_rows(blocks, dst, copied, valid).reshape(cache.shape)

    # -- reads

    def gather_kv_cache(self, key_cache, value_cache, block_tables, seq_lens, *, max_len):
        return (self._gather(key_cache, block_tables, seq_lens, max_len),
                self._gather(value_cache, block_tables, seq_lens, max_len))

    def _gather(self, cache, block_tables, seq_lens, max_len):
        _, num_kv_heads, block_size, head_dim = cache.shape
        data, scales, biases, dtype, bits, group_size = _cache_parts(cache)
        num_seqs, max_blocks = block_tables.shape
        tasks = head_dim // group_size if bits else head_dim // 4
        template = dict(TE=dtype, D=head_dim, BS=block_size, BITS=bits, GS=group_size)
        geometry = SPECS["gather_kv_rows"].geometry(tasks=tasks, max_len=max_len,
                                                    num_rows=num_seqs * num_kv_heads)
        (rows,) = self.launch("gather_kv_rows", template, geometry, [(num_seqs, num_kv_heads, max_len, head_dim)],
                              [dtype], cache_data=data, cache_scales=scales, cache_biases=biases,
                              block_tables=block_tables, seq_lens=seq_lens,
                              params=GATHER_PARAMS.pack(num_kv_heads=num_kv_heads, max_blocks=max_blocks,
                                                        max_len=max_len, num_blocks=cache.shape[0]))
        return rows

    # -- attention

    def paged_attention(self, query, key_cache, value_cache, block_tables, seq_lens, *, scale, softcap,
                        sliding_window, sinks, num_splits, sparse_v=None):
        """query [S, L, H, D] -> [S, L, H, D] (ops passes a one-token [S, H, D] query as L = 1).
        ``sparse_v``: None (the exact SV = 0 kernels) or tau in (0, 1) (SV = 1)."""
        num_seqs, query_len, num_heads, head_dim = query.shape
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        max_blocks = block_tables.shape[1]
        work = max_blocks * block_size
        if sliding_window is not None:
            work = min(work, sliding_window + query_len - 1 + SPLIT_UNIT)
        layout = layout_for(query, key_cache, value_cache, paged=True)
        grow = window_growth(layout.register_mode)
        splits, split_tokens = self._splits(num_splits, work, num_seqs * num_kv_heads, layout,
                                            misaligned=sliding_window is not None, split_grow=grow)
        gqa = num_heads // num_kv_heads
        template, kv_buffers = self._kv_inputs(query, key_cache, value_cache, head_dim, gqa, query_len, layout,
                                               sparse_v)
        template["BS"] = block_size
        params = ATTENTION_PARAMS.pack(num_kv_heads=num_kv_heads, num_heads=num_heads, query_len=query_len,
                                       num_splits=splits, max_blocks=max_blocks, num_blocks=num_blocks,
                                       window=sliding_window or 0, scale=scale, softcap=softcap or 0.0, head_div=1,
                                       sparse_v=sparse_v or 0.0, split_tokens=split_tokens,
                                       **_window_fields(split_tokens, grow))
        geometry = SPECS["paged_attention_partials"].geometry(splits=splits, num_kv_heads=num_kv_heads,
                                                              num_seqs=num_seqs, layout=layout)
        rows = num_seqs * query_len * num_heads
        partials = self.launch("paged_attention_partials", template, geometry,
                               *self._partial_outputs(rows, splits, head_dim, template["TP"]),
                               query=mx.contiguous(query), **kv_buffers, block_tables=block_tables,
                               seq_lens=seq_lens, params=params)
        return self._reduce(partials, sinks, params, query.dtype, rows, head_dim).reshape(query.shape)

    def decode_attention(self, query, keys, values, *, scale, softcap, sinks, num_splits, sparse_v=None):
        """query [B, H, L, D] -> [B, H, L, D]; keys/values [B, Hkv, T, D] read in place (any view)."""
        batch, num_heads, query_len, head_dim = query.shape
        _, num_kv_heads, num_tokens, _ = keys.shape
        layout = layout_for(query, keys, values, paged=False)
        grow = window_growth(layout.register_mode)
        splits, split_tokens = self._splits(num_splits, num_tokens, batch * num_kv_heads, layout, misaligned=False,
                                            split_grow=grow)
        template, kv_buffers = self._kv_inputs(query, keys, values, head_dim, num_heads // num_kv_heads, query_len,
                                               layout, sparse_v)
        params = ATTENTION_PARAMS.pack(num_kv_heads=num_kv_heads, num_heads=num_heads, query_len=query_len,
                                       num_splits=splits, num_tokens=num_tokens, scale=scale,
                                       softcap=softcap or 0.0, head_div=query_len, sparse_v=sparse_v or 0.0,
                                       split_tokens=split_tokens, **_window_fields(split_tokens, grow))
        geometry = SPECS["decode_attention_partials"].geometry(splits=splits, num_kv_heads=num_kv_heads,
                                                               num_seqs=batch, layout=layout)
        rows = batch * num_heads * query_len
        # The kernel reads K/V views in place through their strides; the small
        # query is made row-contiguous here instead.
        partials = self.launch("decode_attention_partials", template, geometry,
                               *self._partial_outputs(rows, splits, head_dim, template["TP"]),
                               query=mx.contiguous(query), **kv_buffers, params=params)
        return self._reduce(partials, sinks, params, query.dtype, rows, head_dim).reshape(query.shape)

    def paged_attention_varlen(self, query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, *,
                               scale, softcap, sliding_window, sinks, tiles: VarlenTiles | None = None,
                               num_splits: int | None = None):
        """query [T, H, D] -> [T, H, D]: sequence s owns rows [qsl[s], qsl[s+1]), its last
        cached positions. Runs of n_s <= VARLEN_DECODE_ROWS go through the decode partials
        (one launch per distinct n_s), longer ones through paged_varlen_partials; both
        reduce with attention_reduce. ``tiles``/``num_splits`` override the defaults
        (tile sweeps, tests). The schedule is planned on the host (one sync)."""
        num_tokens, num_heads, head_dim = query.shape
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        max_blocks = block_tables.shape[1]
        gqa = num_heads // num_kv_heads
        kd, ks, kb, kdt, kbits, kgs = _cache_parts(key_cache)
        vd, vs, vb, vdt, vbits, vgs = _cache_parts(value_cache)
        # A quantized K tile holds float32 rows: K rounded to the scales' 16-bit type moves
        # a score by ~|q||k| 2^-9 sqrt(D) (bfloat16), which an explicit large scale turns
        # into a wrong softmax weight (issue 41, defect 1). V stays in the scales' type.
        ktt = mx.float32 if kbits else kdt
        tiles = tiles or varlen_tiles(head_dim=head_dim, k_itemsize=ktt.size, v_itemsize=vdt.size,
                                      q_itemsize=query.dtype.size)
        plan = varlen_plan(query_start_loc, seq_lens, num_tokens=num_tokens, gqa=gqa, block_q=tiles.block_q,
                           max_len=max_blocks * block_size, sliding_window=sliding_window)
        outs = []
        if plan.tiles.shape[0]:
            tg_bytes = tiles_threadgroup_bytes(tiles, head_dim=head_dim, k_itemsize=ktt.size, v_itemsize=vdt.size,
                                               q_itemsize=query.dtype.size)
            useful = max(1, -(-plan.max_work // tiles.block_k))
            split_tokens = 0
            if num_splits is not None:
                splits = int(num_splits)
            elif split_policy() == "windows":  # windows of whole K/V tiles
                split_tokens = -(-VARLEN_SPLIT_TOKENS // tiles.block_k) * tiles.block_k
                splits = window_splits(plan.max_work, split_tokens, misaligned=sliding_window is not None)
            else:
                splits = choose_num_splits(plan.max_work, plan.tiles.shape[0] * num_kv_heads,
                                           threadgroup_bytes=tg_bytes, threads=tiles.threads)
            if not split_tokens:
                splits = max(1, min(splits, useful))
            params = ATTENTION_PARAMS.pack(num_kv_heads=num_kv_heads, num_heads=num_heads,
                                           query_len=plan.long_tokens, num_splits=splits, max_blocks=max_blocks,
                                           num_blocks=num_blocks, window=sliding_window or 0,
                                           num_tokens=num_tokens, scale=scale, softcap=softcap or 0.0, head_div=1,
                                           split_tokens=split_tokens)
            template = dict(TQ=query.dtype, TK=ktt, TV=vdt, D=head_dim, G=gqa, BS=block_size,
                            NSG=tiles.simdgroups, BK=tiles.block_k, KT=int(tiles.transposed_k), RF=tiles.row_fragments,
                            DS=tiles.d_split, SKV=int(tiles.sequential_kv), KBITS=kbits, KGS=kgs,
                            VBITS=vbits, VGS=vgs)
            geometry = SPECS["paged_varlen_partials"].geometry(
                num_tiles=plan.tiles.shape[0], num_kv_heads=num_kv_heads, splits=splits, tiles=tiles,
                threadgroup_bytes=tg_bytes)
            rows = plan.long_tokens * num_heads
            partials = self.launch("paged_varlen_partials", template, geometry,
                                   *self._partial_outputs(rows, splits, head_dim), query=mx.contiguous(query),
                                   key_data=kd, key_scales=ks, key_biases=kb, value_data=vd, value_scales=vs,
                                   value_biases=vb, block_tables=block_tables, seq_lens=mx.array(plan.lens),
                                   tiles=mx.array(plan.tiles), params=params)
            out = self._reduce(partials, sinks, params, query.dtype, rows, head_dim)
            outs.append(out.reshape(plan.long_tokens, num_heads, head_dim))
        lens = mx.array(plan.lens)
        for n, (ids, q0s) in plan.short.items():
            rows_idx = (np.asarray(q0s)[:, None] + np.arange(n)[None, :]).reshape(-1)
            q = mx.take(query, mx.array(rows_idx.astype(np.int32)), axis=0).reshape(len(ids), n, num_heads,
                                                                                   head_dim)
            sel = mx.array(np.asarray(ids, dtype=np.int32))
            out = self.paged_attention(q, key_cache, value_cache, mx.take(block_tables, sel, axis=0),
                                       mx.take(lens, sel), scale=scale, softcap=softcap,
                                       sliding_window=sliding_window, sinks=sinks, num_splits=None)
            outs.append(out.reshape(len(ids) * n, num_heads, head_dim))
        outs.append(mx.zeros((1, num_heads, head_dim), dtype=query.dtype))
        stacked = mx.concatenate(outs, axis=0) if len(outs) > 1 else outs[0]
        return mx.take(stacked, mx.array(plan.gather.astype(np.int32)), axis=0)

    def paged_attention_cascade(self, query, key_cache, value_cache, prefix_block_tables, prefix_lens, prefix_of,
                                block_tables, seq_lens, *, scale, softcap, sinks, sparse_v=None):
        """query [S, H, D] -> [S, H, D]: one cascade_partials launch over the shared prefix
        chunks (each chunk's member query rows in one threadgroup), one over the sequences'
        own tokens, one cascade_reduce; planned on the host (kvmetal/backends/metal_cascade.py).
        ``sparse_v``: as in paged_attention, for both partials passes."""
        num_seqs, num_heads, head_dim = query.shape
        num_kv_heads, block_size = key_cache.shape[1], key_cache.shape[2]
        schedule = cascade_plan(prefix_lens, prefix_of, gqa=num_heads // num_kv_heads,
                                capacity=prefix_block_tables.shape[1] * block_size, max_rows=CASCADE_CHUNK_ROWS)
        own_work = int(np.clip(np.asarray(seq_lens), 0, block_tables.shape[1] * block_size).max(initial=0))
        own, own_splits = self._cascade_partials(query[:, None], key_cache, value_cache, block_tables, seq_lens,
                                                 work=own_work, scale=scale, softcap=softcap, sparse_v=sparse_v)
        parts, prefix_splits = [], None
        for group in schedule.groups:  # largest QL first: its split count is every group's
            chunk = mx.array(group.chunk_prefix)
            members = mx.take(query, mx.array(group.member_rows), axis=0)
            members = members.reshape(group.chunk_prefix.shape[0], group.query_len, num_heads, head_dim)
            part, prefix_splits = self._cascade_partials(
                members, key_cache, value_cache, mx.take(prefix_block_tables, chunk, axis=0),
                mx.take(prefix_lens, chunk), work=schedule.prefix_work, scale=scale, softcap=softcap,
                sparse_v=sparse_v, splits=prefix_splits)
            parts.append(part)
        if len(parts) > 1:
            prefix = tuple(mx.concatenate([p[i] for p in parts], axis=0) for i in range(3))
        elif parts:
            prefix = parts[0]
        else:  # no sequence has a prefix: placeholders the reduce never reads (acc in own's type)
            empty = mx.zeros((8,), dtype=mx.float32)
            prefix, prefix_splits = (empty, empty, mx.zeros((8,), dtype=own[2].dtype)), 1
        params = CASCADE_REDUCE_PARAMS.pack(num_heads=num_heads, prefix_splits=prefix_splits, own_splits=own_splits,
                                            prefix_slots=schedule.prefix_slots, num_seqs=num_seqs)
        rows = num_seqs * num_heads
        template = dict(TQ=query.dtype, TP=own[2].dtype, D=head_dim, HAS_SINKS=sinks is not None)
        geometry = SPECS["cascade_reduce"].geometry(rows=rows)
        (out,) = self.launch("cascade_reduce", template, geometry, [(rows, head_dim)], [query.dtype],
                             prefix_max=prefix[0], prefix_sum=prefix[1], prefix_acc=prefix[2], own_max=own[0],
                             own_sum=own[1], own_acc=own[2], slot_of=mx.array(schedule.slot_of),
                             sinks=sinks if sinks is not None else _placeholder(mx.float32), params=params)
        return out.reshape(num_seqs, num_heads, head_dim)

    def _cascade_partials(self, query4, key_cache, value_cache, tables, lens, *, work: int, scale, softcap,
                          sparse_v=None, splits: int | None = None):
        """cascade_partials over table rows ``tables``/``lens`` (every row of query [C, QL, H,
        D] sees its whole table row): (part_max, part_sum, part_acc) [C * QL * H, splits(, D)]
        and the split count. ``work``: the most tokens a table row holds; ``splits``: the
        split count to use exactly (launches whose partials are concatenated), else chosen."""
        num_rows, query_len, num_heads, head_dim = query4.shape
        num_blocks, num_kv_heads, block_size, _ = key_cache.shape
        layout = layout_for(query4, key_cache, value_cache, paged=True)
        split_tokens = SPLIT_TOKENS if split_policy() == "windows" else 0
        # Growth 1 whatever the layout: the prefix groups' launches (register or shared mode)
        # share one split count, so they share one window rule.
        grow = window_growth(False)
        if splits is None:
            splits, split_tokens = self._splits(None, max(1, work), num_rows * num_kv_heads, layout,
                                                misaligned=False, split_grow=grow)
        template, kv_buffers = self._kv_inputs(query4, key_cache, value_cache, head_dim, num_heads // num_kv_heads,
                                               query_len, layout, sparse_v)
        template["BS"] = block_size
        params = ATTENTION_PARAMS.pack(num_kv_heads=num_kv_heads, num_heads=num_heads, query_len=query_len,
                                       num_splits=splits, max_blocks=tables.shape[1], num_blocks=num_blocks, window=0,
                                       scale=scale, softcap=softcap or 0.0, head_div=1, sparse_v=sparse_v or 0.0,
                                       split_tokens=split_tokens, **_window_fields(split_tokens, grow))
        geometry = SPECS["cascade_partials"].geometry(splits=splits, num_kv_heads=num_kv_heads, num_seqs=num_rows,
                                                      layout=layout)
        rows = num_rows * query_len * num_heads
        parts = self.launch("cascade_partials", template, geometry,
                            *self._partial_outputs(rows, splits, head_dim, template["TP"]),
                            query=mx.contiguous(query4), **kv_buffers, block_tables=tables, seq_lens=lens,
                            params=params)
        return parts, splits

    @staticmethod
    def _kv_inputs(query, keys, values, head_dim, gqa, query_len, layout, sparse_v=None) -> tuple:
        """The template parameters and the K/V buffers the partials kernels take (TQ: the
        query's dtype, the type its register share keeps; TP: the partial accumulators'
        dtype, metal_layout.partials_dtype)."""
        kd, ks, kb, kdt, kbits, kgs = _cache_parts(keys)
        vd, vs, vb, vdt, vbits, vgs = _cache_parts(values)
        template = dict(TQ=query.dtype, TK=kdt, TV=vdt, D=head_dim, G=gqa, QL=query_len, NSG=layout.simdgroups,
                        RPS=layout.rows_per_simdgroup, LPK=layout.lanes_per_key, TT=layout.tile, KBITS=kbits,
                        KGS=kgs, KAW=layout.key_atom_words, VBITS=vbits, VGS=vgs, VAW=layout.value_atom_words,
                        PF=int(layout.prefetch), SV=int(bool(sparse_v)),
                        TP=metal_layout.partials_dtype(query.dtype, values))
        buffers = dict(key_data=kd, key_scales=ks, key_biases=kb, value_data=vd, value_scales=vs, value_biases=vb)
        return template, buffers

    @staticmethod
    def _splits(requested, work_tokens, parallel_groups, layout, *, misaligned: bool, split_grow: int) -> tuple:
        """(splits, split_tokens) of a partials launch over at most ``work_tokens`` live keys
        per sequence: windows of SPLIT_TOKENS (split_tokens > 0), or, for an explicit
        ``requested`` count or the occupancy policy, equal runs (split_tokens = 0)."""
        if requested is None and split_policy() == "windows":
            return window_splits(work_tokens, SPLIT_TOKENS, misaligned=misaligned,
                                 split_max=metal_layout.SPLIT_WINDOW_MAX,
                                 split_div=window_div(), split_grow=split_grow), SPLIT_TOKENS
        # Equal runs cut whole SPLIT_UNIT-token units: more than that many would be empty.
        useful = max(1, -(-work_tokens // SPLIT_UNIT))
        if requested is not None:
            return max(1, min(int(requested), useful)), 0
        return max(1, min(useful, choose_num_splits(work_tokens, parallel_groups,
                                                    threadgroup_bytes=layout.threadgroup_bytes,
                                                    threads=layout.threads))), 0

    @staticmethod
    def _partial_outputs(rows, splits, head_dim, acc_dtype=mx.float32):
        """(shapes, dtypes) of part_max, part_sum (float32) and part_acc (``acc_dtype``: the
        decode kernels' TP; varlen's partials are float32)."""
        return ([(rows, splits), (rows, splits), (rows, splits, head_dim)], [mx.float32, mx.float32, acc_dtype])

    def _reduce(self, partials, sinks, params, dtype, rows, head_dim):
        template = dict(TQ=dtype, TP=partials[2].dtype, D=head_dim, HAS_SINKS=sinks is not None)
        geometry = SPECS["attention_reduce"].geometry(rows=rows)
        sink_input = sinks if sinks is not None else _placeholder(mx.float32)
        part_max, part_sum, part_acc = partials
        (out,) = self.launch("attention_reduce", template, geometry, [(rows, head_dim)], [dtype],
                             part_max=part_max, part_sum=part_sum, part_acc=part_acc, sinks=sink_input,
                             params=params)
        return out


# ----------------------------------------------------------------------------- entry points

_backends = {}
_backends_lock = threading.Lock()


def metal_backend(macos: int | None = None) -> KernelBackend:
    """The kernels compiled by MLX for the Apple GPU (built once per process and macOS
    version; default: this machine's, :func:`default_macos_version`)."""
    macos = metal_specs.default_macos_version() if macos is None else int(macos)
    with _backends_lock:
        if ("metal", macos) not in _backends:
            _backends[("metal", macos)] = KernelBackend("metal", mx.fast.metal_kernel, macos=macos)
        return _backends[("metal", macos)]
