"""mlx-lm's BatchGenerator and prompt-cache files over kvmetal caches (issue 11 items 4, 7).

BatchGenerator merges one cache per prompt, right-pads prompts of different lengths,
splits and filters batches and extracts finished sequences: on the paged pool these are
forks, frees and truncations. Its tokens must equal what it gives over mlx-lm's caches.
"""
from __future__ import annotations

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import BatchGenerator, generate_step  # noqa: E402
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache  # noqa: E402

from kvmetal.integrations import tiny_models  # noqa: E402
from kvmetal.integrations.mlx_lm import use_paged_cache  # noqa: E402
from kvmetal.integrations.model_cache import PagedLayerCache  # noqa: E402

from mlx_lm_cases import GREEDY, batch_generate  # noqa: E402

@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3_text"])
def test_batch_generator_over_kvmetal_caches_gives_mlx_lms_tokens(family):
    model = tiny_models.build(family)
    max_tokens = [9, 4, 30, 12, 7, 16]
    expected, mlx_caches = batch_generate(model, max_tokens)
    with use_paged_cache(model) as handle:
        got, caches = batch_generate(model, max_tokens)
        assert all(isinstance(c, PagedLayerCache) for cs in caches for c in cs)
        pool = handle.shared_cache.pools[0]
        # Each finished sequence's extracted cache holds what mlx-lm's holds: no padding.
        assert [cs[0].offset for cs in caches] == [cs[0].offset for cs in mlx_caches]
        assert pool.allocator.num_sequences == len(caches)  # only what the extracted caches hold
        del caches
        assert pool.allocator.num_sequences == 0 and pool.allocator.num_owned == 0  # nothing leaked
    assert got == expected


def greedy(model, prompt, steps, cache):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=steps, sampler=GREEDY,
                                             prompt_cache=cache)]


@pytest.mark.parametrize("family,k_bits,v_bits", [("llama", None, None), ("gemma3_text", None, None),
                                                   ("qwen3", 8, 4)])
def test_save_and_load_prompt_cache_continue_identically(tmp_path, family, k_bits, v_bits):
    model = tiny_models.build(family)
    prompt = list(range(3, 60))  # past gemma's window, so the saved window layers dropped blocks
    with use_paged_cache(model, k_bits=k_bits, v_bits=v_bits, block_size=8):
        cache = make_prompt_cache(model)
        first = greedy(model, prompt, 6, cache)
        saved_offset = cache[0].offset
        path = str(tmp_path / "prompt.safetensors")
        save_prompt_cache(path, cache, {"note": "kvmetal"})
        expected = greedy(model, [first[-1]], 20, cache)
        loaded, meta = load_prompt_cache(path, return_metadata=True)
        assert meta == {"note": "kvmetal"} and all(isinstance(c, PagedLayerCache) for c in loaded)
        assert [c.offset for c in loaded] == [saved_offset] * len(loaded)
        assert loaded[0].model_cache.kv_format.k_bits == k_bits
        got = greedy(model, [first[-1]], 20, loaded)
    assert got == expected


def test_a_saved_cache_loads_in_a_later_patch(tmp_path):
    model = tiny_models.build("qwen2")
    path = str(tmp_path / "prompt.safetensors")
    prompt = list(range(3, 30))
    with use_paged_cache(model):
        cache = make_prompt_cache(model)
        first = greedy(model, prompt, 3, cache)
        save_prompt_cache(path, cache)
        expected = greedy(model, [first[-1]], 10, cache)
    loaded = load_prompt_cache(path)  # no patch active: the class is still found
    with use_paged_cache(model):
        assert greedy(model, [first[-1]], 10, loaded) == expected


def test_batch_generator_continues_from_extracted_caches_with_history():
    # mlx-lm's server reuses prompt caches: sequences come back with history and are merged.
    model = tiny_models.build("llama")

    def two_rounds():
        _, caches = batch_generate(model, [6, 3, 8, 5, 2, 4])
        gen = BatchGenerator(model, sampler=GREEDY, prefill_batch_size=3, completion_batch_size=4)
        follow = [[7, 8, 9], [4], [11, 12], [5, 6, 7, 8, 9, 10], [1, 2], [3]]
        uids = gen.insert(follow, max_tokens=[5] * 6, caches=caches)
        out = {u: [] for u in uids}
        done = 0
        while done < len(uids):
            for r in gen.next_generated():
                out[r.uid].append(r.token)
                done += r.finish_reason is not None
        gen.close()
        return [out[u] for u in uids]

    expected = two_rounds()
    with use_paged_cache(model) as handle:
        got = two_rounds()
        assert handle.shared_cache.pools[0].allocator.num_sequences == 0
    assert got == expected
