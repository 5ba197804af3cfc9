"""llama4's chunked attention under use_paged_cache (issue 40): a token at position p sees
only [floor(p / C) * C, p]. kvmetal runs that rule on its kernels (tables shifted to the
chunk start, prompt rows cut at chunk starts; ``model_cache._ChunkView``) and releases a
chunk layer's blocks before a sequence's chunk. Tiny random llama4 (arch_sweep), float32,
cpu backend; the sim backend runs the same index arrays through the metal kernels' code."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvmetal import use_backend  # noqa: E402
from kvmetal.cache import HOLE  # noqa: E402
from kvmetal.integrations import arch_sweep, model_cache  # noqa: E402
from kvmetal.integrations.mlx_lm import analyse_model, use_paged_cache  # noqa: E402
from kvmetal.integrations.model_cache import TRIM_SLACK, LayerSpec, PagedModelCache  # noqa: E402

PROMPT = [int(t) for t in np.random.default_rng(0).integers(1, 256, 70)]  # 70 tokens: past 4 chunks of 16
STEPS = 20  # decode 70 -> 90: crosses the chunk start at 80
_MODELS: dict = {}


def llama4(chunk: int):
    if chunk not in _MODELS:
        config = arch_sweep.tiny_args("llama4")
        config["text_config"] = dict(config["text_config"], attention_chunk_size=chunk)
        _MODELS[chunk] = arch_sweep.build("llama4", config=config)
    return _MODELS[chunk]


def run(model, pieces, steps, forced=None):
    """Logits [passes, vocab] (each pass's last row) of the prompt fed in ``pieces`` (lengths),
    then ``steps`` greedy (or ``forced``) decode steps, through make_prompt_cache's cache."""
    cache = make_prompt_cache(model)
    out, at = [], 0
    for n in pieces:
        out.append(model(mx.array([PROMPT[at:at + n]]), cache=cache)[0, -1])
        at += n
    assert at == len(PROMPT)
    tokens = []
    for i in range(steps):
        token = int(mx.argmax(out[-1])) if forced is None else forced[i]
        tokens.append(token)
        out.append(model(mx.array([[token]]), cache=cache)[0, -1])
    logits = mx.stack(out)
    mx.eval(logits)
    return np.array(logits), tokens


def rel(a, b) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.parametrize("chunk,block_size", [(16, 8), (16, 16), (32, 8)])
@pytest.mark.parametrize("pieces", [[70], [7, 5, 6, 1, 3, 20, 28]], ids=["whole", "pieces"])
def test_logits_equal_mlx_lm_on_the_kernels(chunk, block_size, pieces):
    """A prompt past several chunks (whole, or in passes of 1 to 28 tokens that cross chunk
    starts: a 6-token pass straddling one runs varlen over the cut rows) and 20
    decode steps across a chunk start: mlx-lm's logits within the sweep's tolerance, its
    greedy tokens, and not one gathered attention call."""
    model = llama4(chunk)
    with use_backend("cpu"):
        expected, tokens = run(model, pieces, STEPS)
        with use_paged_cache(model, block_size=block_size) as handle:
            got, got_tokens = run(model, pieces, STEPS)
            cache = handle.shared_cache
            assert cache.chunks == [chunk, None] and [p.num_layers for p in cache.pools] == [3, 1]
            assert cache.gathered_attention == 0
    assert rel(got, expected) <= arch_sweep.TOLERANCE
    assert got_tokens == tokens


def test_sim_backend_runs_the_chunk_rule_through_the_metal_kernels_code():
    model = llama4(16)
    with use_backend("cpu"):
        expected, tokens = run(model, [70], 4)
    with use_paged_cache(model, block_size=8) as handle, use_backend("sim"):
        got, _ = run(model, [40, 30], 4, forced=tokens)
        assert handle.shared_cache.gathered_attention == 0
    assert rel(got[1:], expected) <= arch_sweep.TOLERANCE  # got[0]: the 40-token pass's last row


def held(pool, seq) -> list:
    return [i for i, b in enumerate(pool.allocator.block_table(seq)) if b != HOLE]


def test_blocks_before_the_chunk_are_released():
    """After a 70-token prompt (chunk 16, blocks of 8) the chunk layers hold every block;
    the next token (position 70) releases those wholly before the chunk start of
    70 - TRIM_SLACK = 54, i.e. 48: blocks 0..5. The full layer keeps all of its."""
    model = llama4(16)
    with use_paged_cache(model, block_size=8) as handle, use_backend("cpu"):
        cache = make_prompt_cache(model)
        logits = model(mx.array([PROMPT]), cache=cache)
        mx.eval(logits)
        chunk_pool, full_pool = handle.shared_cache.pools
        seq = cache[0].seq_ids[0]
        before = (held(chunk_pool, seq), held(full_pool, seq))
        for step in range(STEPS):
            logits = model(mx.argmax(logits[:, -1:], axis=-1), cache=cache)
            mx.eval(logits)
            if step == 0:
                after = (held(chunk_pool, seq), held(full_pool, seq))
        last = held(chunk_pool, seq)
    assert before == (list(range(9)), list(range(9)))
    keep_from = (70 - TRIM_SLACK) // 16 * 16
    assert keep_from == 48 and after == (list(range(6, 9)), list(range(9)))
    assert last == list(range((90 - TRIM_SLACK) // 16 * 16 // 8, 12))  # position 89 -> from block 8


def test_a_block_size_that_does_not_divide_the_chunk_keeps_the_gathered_route():
    model = llama4(8)
    with use_backend("cpu"):
        expected, tokens = run(model, [30, 40], 6)
        with use_paged_cache(model, block_size=16) as handle:
            got, got_tokens = run(model, [30, 40], 6)
            assert handle.shared_cache.gathered_attention == 3 * 8  # 3 chunk layers, 8 passes
    assert rel(got, expected) <= arch_sweep.TOLERANCE and got_tokens == tokens


def pool_with_rows(chunk, total, block_size=8):
    cache = PagedModelCache([LayerSpec(None, 2, 64, mx.float32, chunk)], block_size=block_size)
    layer = cache.owned_layer_caches(1)[0]
    keys = mx.random.normal((1, 2, total, 64), key=mx.random.key(1))
    values = mx.random.normal((1, 2, total, 64), key=mx.random.key(2))
    layer.update_and_fetch(keys, values)
    return cache, layer, keys, values


def test_the_marker_is_the_chunk_rule_and_any_other_mask_is_applied_as_given():
    """The same pass through the chunk rule's marker (kernels) and through the mask array it
    stands for (gathered rows, MLX's sdpa) agree; an array that is not the rule (here plain
    causal) is applied as given, not taken for the rule."""
    with use_backend("cpu"):
        cache, layer, keys, values = pool_with_rows(16, 45)
        queries = mx.random.normal((1, 4, 45, 64), key=mx.random.key(3))
        marker = cache._chunk_mask(16)
        ruled = layer.attention(queries, keys, values, scale=0.125, mask=marker)
        assert cache.gathered_attention == 0
        pos = mx.arange(45)
        as_array = (pos[None, :] <= pos[:, None]) & (pos[None, :] // 16 == pos[:, None] // 16)
        gathered = layer.attention(queries, keys, values, scale=0.125, mask=as_array)
        causal = layer.attention(queries, keys, values, scale=0.125, mask=mx.tril(mx.ones((45, 45), dtype=mx.bool_)))
        assert cache.gathered_attention == 2
        reference = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=0.125, mask=as_array)
    assert float(mx.abs(ruled - reference).max()) < 1e-5
    assert float(mx.abs(gathered - reference).max()) < 1e-5
    assert float(mx.abs(causal - reference).max()) > 1e-2  # it differs past the first chunk: not the rule


def test_chunk_views_cut_rows_at_chunk_starts():
    cache, layer, _, _ = pool_with_rows(16, 45)
    view = cache._chunk_view(0, layer._plan, 16)
    assert view.straddles.tolist() == [True]
    tables, lens, starts = view.runs(0, 1)
    assert np.array(lens).tolist() == [16, 16, 13]  # each run: its rows from its chunk start
    assert np.array(starts).tolist() == [0, 16, 32, 45]
    table = cache.pools[0].allocator.block_table(layer.seq_ids[0])
    assert np.array(tables)[:, :2].tolist() == [table[0:2], table[2:4], table[4:6]]
    with pytest.raises(ValueError, match=r"chunk must be an int >= 1, got 0"):
        cache._chunk_mask(0)


def test_trim_within_the_slack_and_refused_past_a_released_chunk():
    model = llama4(16)
    with use_paged_cache(model, block_size=8), use_backend("cpu"):
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([PROMPT]), cache=cache))
        mx.eval(model(mx.array([[5]]), cache=cache))  # releases blocks 0..5 of the chunk layers
        assert cache[0].trim(71 - 50) == 21  # back to 50: its chunk (from 48) is still held
        with pytest.raises(ValueError, match=r"cannot go back to 40 tokens: this window \(or chunk\) layer"):
            cache[0].trim(10)


def test_state_round_trip_keeps_the_chunk():
    with use_backend("cpu"):
        cache, layer, keys, values = pool_with_rows(16, 45)
        cache.append(layer.seq_ids[0], num_tokens=1)  # releases the blocks before 16 (45 - 16 = 29 -> 16)
        layer._offsets = [46]
        restored = model_cache.PagedLayerCache.from_state(layer.state)
        assert restored.model_cache.chunks == [16]
        assert restored._first_live() == 16
        assert np.array_equal(np.array(restored.state[0][:, :, :29]), np.array(keys[:, :, 16:45]))


def test_analyse_model_gives_chunk_layers_their_chunk():
    layout = analyse_model(llama4(16))
    assert layout.chunked == ["layer 0", "layer 1", "layer 2"]  # every 4th layer attends globally
    assert [s.chunk for s in layout.specs] == [16, 16, 16, None]
