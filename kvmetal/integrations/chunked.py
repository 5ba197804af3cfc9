"""llama4's chunked attention on kvmetal's kernels (issue 40).

mlx-lm's llama4 gives three of every four layers a ``ChunkedKVCache``: a token at position
p attends only to [floor(p / C) * C, p] (C = ``attention_chunk_size``). Its ``LlamaModel``
builds that chunk mask as an array from the cache's ``start_position`` and ``offset``;
over kvmetal's caches the model's call is replaced (``llama4_model``, installed through
``mlx_lm.HAND_ATTENTION`` while a patch lives) by the same code with one difference:
the chunked layers get a marker mask (``PagedModelCache._chunk_mask``) that the layer
caches' ``attention`` recognises as the chunk rule and runs on the kernels (tables
shifted to the chunk start, prompt rows cut at chunk starts; see ``model_cache._ChunkView``).
Any other mask array still reaches the gathered route, applied as given.

The Engine's passes give each row (or each sequence) its own position, an int32 array
``offset``, which llama4's own code cannot take (``mx.arange(offset, ...)`` in the chunk
mask and in the attention temperature of its NoPE layers): ``llama4_attention`` is
mlx-lm's ``Attention.__call__`` with that temperature computed per row. With an int
offset (one sequence, or a batch at one position) mlx-lm's own call runs.

Both run mlx-lm's own code for any other cache (mlx-lm's, during ``analyse_model``'s
probe passes too); ``tests/test_mlx_lm_chunked.py`` and ``tests/test_engine_llama4.py`` check them against mlx-lm. ``project_heads`` is the q/k/v head split the hand-attention stand-ins (gemma2's too) share.
"""
from __future__ import annotations

import mlx.core as mx

from .model_cache import PagedLayerCache, RaggedLayerCache

_OURS = (PagedLayerCache, RaggedLayerCache)



def project_heads(attn, x):
    """A llama-style attention module's q/k/v projections of ``x`` [B, L, hidden] as
    [B, heads, L, head_dim] (n_heads for the queries, n_kv_heads for keys and values)."""
    b, n, _ = x.shape
    split = lambda y, heads: y.reshape(b, n, heads, -1).transpose(0, 2, 1, 3)
    return (split(attn.q_proj(x), attn.n_heads), split(attn.k_proj(x), attn.n_kv_heads),
            split(attn.v_proj(x), attn.n_kv_heads))

def llama4_model(original):
    """``LlamaModel.__call__`` (llama4): over kvmetal's caches, the chunked layers get the
    chunk rule's marker instead of the chunk mask array."""
    def __call__(self, inputs, cache=None):
        if cache is None or not any(isinstance(c, _OURS) for c in cache):
            return original(self, inputs, cache)
        from mlx_lm.models.base import create_attention_mask

        h = self.embed_tokens(inputs)
        # mlx-lm's code calls maybe_trim_front on the chunked layers here: a paged chunk
        # layer releases its blocks when a sequence grows (PagedModelCache._evict_behind_window).
        ours = next(c for c in cache if isinstance(c, _OURS))
        chunk_mask = ours.model_cache._chunk_mask(self.attention_chunk_size)
        global_mask = create_attention_mask(h, cache[3])
        for idx, (layer, c) in enumerate(zip(self.layers, cache)):
            use_chunked_attention = (idx + 1) % 4 != 0  # the layers llama4's make_cache gives a ChunkedKVCache
            h = layer(h, chunk_mask if use_chunked_attention else global_mask, cache=c)
        return self.norm(h)

    __call__.__wrapped__ = original
    return __call__


def llama4_attention(original):
    """``Attention.__call__`` (llama4) for kvmetal caches whose offset is an array (a
    position per sequence, or per row of a ragged pass); mlx-lm's own call otherwise."""
    def __call__(self, x, mask=None, cache=None):
        if not isinstance(cache, _OURS) or not isinstance(cache.offset, mx.array):
            return original(self, x, mask=mask, cache=cache)
        b, n, _ = x.shape
        queries, keys, values = project_heads(self, x)
        offset = cache.offset  # int32 [b]
        if self.use_rope:
            queries = self.rope(queries, offset=offset)
            keys = self.rope(keys, offset=offset)
        if self.use_qk_norm:
            queries = mx.fast.rms_norm(queries, weight=None, eps=1e-6)
            keys = mx.fast.rms_norm(keys, weight=None, eps=1e-6)
        if self.attn_temperature_tuning and not self.use_rope:
            positions = offset[:, None] + mx.arange(1, n + 1)[None, :]  # mlx-lm: arange(offset + 1, offset + n + 1)
            attn_scales = mx.log(mx.floor(positions / self.floor_scale) + 1.0) * self.attn_scale + 1.0
            queries = (queries * attn_scales[:, None, :, None]).astype(queries.dtype)
        keys, values = cache.update_and_fetch(keys, values)
        out = cache.attention(queries, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))

    __call__.__wrapped__ = original
    return __call__
