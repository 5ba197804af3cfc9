"""kvmetal's drop-in cache against mlx-lm's own cache protocol (issue 10 items 10, 13-17).

Every behaviour is compared with what mlx-lm's own caches do on the same small random
model: where kvmetal serves an option, the greedy tokens (or logits) match; where it
cannot, it raises instead of silently doing something else.
"""
from __future__ import annotations

import copy
import sys
import threading

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import KVCache, make_prompt_cache  # noqa: E402

from kvmetal import KVFormat  # noqa: E402
from kvmetal.integrations import tiny_models  # noqa: E402
from kvmetal.integrations.mlx_lm import use_paged_cache  # noqa: E402
from kvmetal.integrations.model_cache import PagedLayerCache  # noqa: E402

PROMPT = list(range(3, 40))  # 37 tokens
GREEDY = dict(sampler=lambda lp: mx.argmax(lp, axis=-1))


def greedy(model, prompt=PROMPT, steps=12, **kwargs):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=steps, **GREEDY, **kwargs)]


def logits_after(model, cache, tokens):
    return model(mx.array(tokens)[None], cache=cache)[:, -1].astype(mx.float32)


# ----------------------------------------------------------------------------- item 10

def test_patch_is_atomic_per_model_across_threads():
    model = tiny_models.build("llama")
    module = sys.modules[type(model).__module__]
    original_sdpa = module.scaled_dot_product_attention
    barrier = threading.Barrier(8)
    handles, errors = [], []

    def patch():
        barrier.wait()
        try:
            handles.append(use_paged_cache(model))
        except ValueError as e:
            errors.append(str(e))

    threads = [threading.Thread(target=patch) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(handles) == 1 and len(errors) == 7
    assert all("already uses a paged cache" in e for e in errors)
    for h in handles:
        h.undo()
    assert "make_cache" not in vars(model) and module.scaled_dot_product_attention is original_sdpa
    assert isinstance(make_prompt_cache(model)[0], KVCache)
    with use_paged_cache(model):  # free again after the undo
        assert isinstance(make_prompt_cache(model)[0], PagedLayerCache)


def test_undo_from_many_threads_restores_once():
    model = tiny_models.build("llama")
    handle = use_paged_cache(model)
    threads = [threading.Thread(target=handle.undo) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert "make_cache" not in vars(model)
    with use_paged_cache(model):
        pass


# ----------------------------------------------------------------------------- item 13

@pytest.mark.parametrize("family", ["qwen2", "qwen3", "phi3", "llama"])
def test_max_kv_size_is_refused_not_dropped(family):
    model = tiny_models.build(family)
    assert greedy(model, steps=4, max_kv_size=16)  # mlx-lm serves it with a rotating cache
    unpatched = greedy(model, steps=4)  # mlx-lm's own cache: the external reference
    with use_paged_cache(model):
        with pytest.raises(NotImplementedError, match=r"max_kv_size=16 is not supported"):
            greedy(model, steps=4, max_kv_size=16)
        assert greedy(model, steps=4) == unpatched  # without it all is well


# ----------------------------------------------------------------------------- item 14

@pytest.mark.parametrize("family,start", [("llama", 0), ("qwen3", 20), ("llama", 45)])
def test_kv_bits_quantizes_the_pool_like_mlx_lm(family, start):
    model = tiny_models.build(family, dtype=mx.float16, seed=2)
    kwargs = dict(kv_bits=8, kv_group_size=64, quantized_kv_start=start)
    reference = list(generate_step(mx.array(PROMPT), model, max_tokens=16, **GREEDY, **kwargs))
    expected = [int(t) for t, _ in reference]
    with use_paged_cache(model):
        cache = make_prompt_cache(model)
        got = greedy(model, steps=16, prompt_cache=cache, **kwargs)
        pools = {id(p): p for c in cache for p in c.model_cache.pools}.values()
        assert all(p.k_bits == 8 and p.v_bits == 8 for p in pools)
        assert all(isinstance(c, PagedLayerCache) for c in cache)
    # Same tokens, up to a float16 near-tie: the two implementations round differently
    # (their logits differ by ~3e-3 here), so a step whose top two are closer than that
    # may go either way, and the sequences part there.
    split = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), None)
    if split is not None:
        top2 = np.sort(np.array(reference[split][1].astype(mx.float32)))[-2:]
        assert split >= 4 and top2[1] - top2[0] < 0.01, (split, got, expected, top2)
    assert len(got) == len(expected)


def test_to_quantized_copies_when_the_pool_is_shared_and_keeps_window_layers():
    model = tiny_models.build("gemma3_text", dtype=mx.float16)  # mlx-lm cannot quantize its window layers
    with use_paged_cache(model, kv_format=KVFormat(k_bits=8, v_bits=8, k_group_size=64, v_group_size=64)):
        native = make_prompt_cache(model)  # quantized from the first row on, groups as to_quantized's
        logits_after(model, native, PROMPT)
        want = logits_after(model, native, [7])
    with use_paged_cache(model):
        other = make_prompt_cache(model)
        logits_after(model, other, PROMPT[:5])
        cache = make_prompt_cache(model)
        logits_after(model, cache, PROMPT)
        quantized = [c.to_quantized(group_size=64, bits=8) for c in cache]
        assert quantized[0].model_cache is not cache[0].model_cache  # `other` keeps its float rows
        assert other[0].model_cache.pools[0].k_bits is None
        assert {p.k_bits for p in quantized[0].model_cache.pools} == {8}
        got = logits_after(model, quantized, [7])
        del other, cache
        alone = make_prompt_cache(model)
        logits_after(model, alone, PROMPT)
        in_place = [c.to_quantized(group_size=64, bits=8) for c in alone]
        assert in_place[0] is alone[0]  # the only sequences in the pool: converted in place
        got_in_place = logits_after(model, in_place, [7])
    np.testing.assert_array_equal(np.array(got), np.array(got_in_place))
    # Only the prefill differs from a cache quantized from the start (it attended over float rows).
    err = float(mx.abs(got - want).max() / mx.abs(want).max())
    assert err < 0.02, err


# ----------------------------------------------------------------------------- item 15

@pytest.mark.parametrize("family", ["llama", "gemma3_text"])
def test_deepcopy_forks_and_both_copies_continue_independently(family):
    model = tiny_models.build(family)
    ref = make_prompt_cache(model)
    logits_after(model, ref, PROMPT)
    ref_copy = copy.deepcopy(ref)
    want_a, want_b = logits_after(model, ref, [5, 6]), logits_after(model, ref_copy, [9])
    with use_paged_cache(model):
        cache = make_prompt_cache(model)
        logits_after(model, cache, PROMPT)
        pool = cache[0].pool
        used = pool.allocator.num_owned
        clone = copy.deepcopy(cache)
        assert pool.allocator.num_owned == used  # a fork: no block copied yet
        assert clone[0].seq_ids != cache[0].seq_ids and len({c.seq_ids[0] for c in clone}) == 1
        got_a, got_b = logits_after(model, cache, [5, 6]), logits_after(model, clone, [9])
        del clone
        assert clone_freed(cache[0])
    for got, want in ((got_a, want_a), (got_b, want_b)):
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-4, atol=1e-4)


def clone_freed(layer_cache) -> bool:
    return layer_cache.pool.allocator.num_sequences == 1


# ----------------------------------------------------------------------------- item 16

def test_a_window_asked_through_make_mask_is_honoured_on_a_full_layer():
    model = tiny_models.build("llama")
    window = 4

    def run(cache):
        logits_after(model, cache, PROMPT[:10])
        outs = []
        for token in (11, 12, 13):
            mask = cache[0].make_mask(1, return_array=False, window_size=window)
            assert mask is not None
            outs.append(windowed_forward(model, cache, token, mask))
        return outs

    expected = run(make_prompt_cache(model))
    with use_paged_cache(model):
        cache = make_prompt_cache(model)
        got = run(cache)
        own = cache[0].make_mask(1, return_array=False, window_size=window)
        reference = KVCache()
        reference.offset = cache[0].offset
        assert np.array_equal(np.array(own), np.array(reference.make_mask(1, return_array=False, window_size=window)))
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.array(g), np.array(e), rtol=1e-4, atol=1e-4)


def windowed_forward(model, cache, token, mask):
    """The llama forward pass with ``mask`` (one the model would build with a window)."""
    inner = model.model
    h = inner.embed_tokens(mx.array([[token]]))
    for layer, c in zip(inner.layers, cache):
        h = layer(h, mask, c)
    return model.lm_head(inner.norm(h))[:, -1].astype(mx.float32)


# ----------------------------------------------------------------------------- item 17

@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss"])
def test_a_batch_of_prompts_through_one_make_cache(family):
    model = tiny_models.build(family)
    prompts = mx.array([PROMPT[:30], PROMPT[7:37]])

    def run(cache):
        out = [logits_after_batch(model, cache, prompts)]
        tokens = mx.argmax(out[-1], axis=-1)
        for _ in range(30):  # past gemma's/gpt-oss's 24-token window
            out.append(logits_after_batch(model, cache, tokens[:, None]))
            tokens = mx.argmax(out[-1], axis=-1)
        return out

    expected = run(make_prompt_cache(model))
    with use_paged_cache(model):
        cache = make_prompt_cache(model)
        got = run(cache)
        assert len(cache[0].seq_ids) == 2
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.array(g), np.array(e), rtol=2e-4, atol=2e-4)


def logits_after_batch(model, cache, tokens):
    return model(tokens, cache=cache)[:, -1].astype(mx.float32)


def test_a_batch_into_a_cache_with_history_says_how_to_batch():
    model = tiny_models.build("llama")
    with use_paged_cache(model):
        cache = make_prompt_cache(model)
        logits_after(model, cache, PROMPT[:4])
        with pytest.raises(ValueError, match=r"keys hold 2 sequences, the cache serves 1.*Engine.*BatchGenerator"):
            model(mx.array([[1], [2]]), cache=cache)


def test_to_quantized_mid_generation_with_group_size_32_stays_close():
    model = tiny_models.build("qwen2", dtype=mx.float16, seed=5)
    steps = list(generate_step(mx.array(PROMPT), model, max_tokens=4, **GREEDY))
    with use_paged_cache(model):
        cache = make_prompt_cache(model)
        first = [t for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=2, prompt_cache=cache, **GREEDY)]
        cache = [c.to_quantized(bits=8, group_size=32) for c in cache]
        assert {p.group_size for p in cache[0].model_cache.pools} == {32}
        (token, logprobs), = list(generate_step(mx.array([first[-1]]), model, max_tokens=1, prompt_cache=cache,
                                                **GREEDY))
    assert first == [t for t, _ in steps[:2]] and token == steps[2][0]
    np.testing.assert_allclose(np.array(logprobs), np.array(steps[2][1]), rtol=4e-2, atol=4e-2)


def test_trim_after_generate_regenerates_the_same_tokens():
    model = tiny_models.build("phi3")
    with use_paged_cache(model):
        cache = make_prompt_cache(model)
        last, _ = next(generate_step(mx.array(PROMPT), model, prompt_cache=cache, **GREEDY))
        again = lambda: [t for _, (t, _) in zip(range(2), generate_step(mx.array([last]), model,  # noqa: E731
                                                                        prompt_cache=cache, **GREEDY))]
        first = again()
        assert sum(c.trim(3) for c in cache[:1]) == 3 and all(c.trim(3) == 3 for c in cache[1:])
        assert again() == first
