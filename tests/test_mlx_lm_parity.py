"""mlx-lm models with kvmetal's paged cache generate exactly what mlx-lm's own cache does.

Each supported family is built small and random in code. Prompts cross block boundaries
(block size 16) and, for window families (gemma3_text, gpt_oss: window 24), 64 decode
steps run far past the window, so eviction and windowed paged attention both matter.
"""
from __future__ import annotations

import sys

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step, stream_generate  # noqa: E402
from mlx_lm.models.cache import KVCache, make_prompt_cache  # noqa: E402

from kvmetal.integrations import tiny_models  # noqa: E402
from kvmetal.integrations.mlx_lm import SUPPORTED_FAMILIES, use_paged_cache  # noqa: E402
from kvmetal.integrations.model_cache import TRIM_SLACK, PagedLayerCache  # noqa: E402
from kvmetal.quant import QuantizedKV  # noqa: E402

STEPS = 64
PROMPT = list(range(3, 40))  # 37 tokens: two full blocks and a partial one
# Seeds whose reference greedy path has no exactly tied top-2 logits (a tie has no
# "right" answer, so parity would be ill-defined there); asserted below, not assumed.
SEEDS = {("qwen3", mx.float16): 1, ("qwen2", mx.float16): 5, ("gpt_oss", mx.float16): 4}


def greedy_tokens(model, prompt, steps):
    """Greedy tokens and the top-1 minus top-2 log-prob gap at every step."""
    tokens, gaps = [], []
    for token, logprobs in generate_step(mx.array(prompt), model, max_tokens=steps,
                                         sampler=lambda lp: mx.argmax(lp, axis=-1)):
        top2 = mx.sort(logprobs.astype(mx.float32))[-2:]
        tokens.append(int(token))
        gaps.append(float(top2[1] - top2[0]))
    return tokens, gaps


def _cases():
    # gpt_oss in float16 on a CPU keeps its experts in float32 (MLX's CPU GatherMM is
    # float32 only, see tiny_models.Float32Block); attention and the cache are float16.
    for family in SUPPORTED_FAMILIES:
        for dtype in (mx.float32, mx.float16):
            yield pytest.param(family, dtype, id=f"{family}-{str(dtype).split('.')[-1]}")


@pytest.mark.parametrize("family,dtype", list(_cases()))
def test_greedy_parity_64_steps(family, dtype):
    model = tiny_models.build(family, dtype=dtype, seed=SEEDS.get((family, dtype), 0))
    expected, gaps = greedy_tokens(model, PROMPT, STEPS)
    assert min(gaps) > 0, "reference has an exact logit tie: pick another seed"
    assert len(set(expected)) > 8, "degenerate reference (repeats one token)"
    with use_paged_cache(model, block_size=16) as handle:
        cache = make_prompt_cache(model)
        assert all(isinstance(c, PagedLayerCache) for c in cache)
        got, _ = greedy_tokens(model, PROMPT, STEPS)
        if any(spec.window for spec in handle.specs):
            # Window layers really released blocks: at most the window, the rewind slack and a block.
            prompt_cache = make_prompt_cache(model)
            list(generate_step(mx.array(PROMPT), model, max_tokens=STEPS, prompt_cache=prompt_cache))
            for c in prompt_cache:
                if c.window is not None:
                    live = [b for b in c.pool.allocator.block_table(c.seq_ids[0]) if b >= 0]
                    assert len(live) <= -(-(c.window + TRIM_SLACK) // 16) + 1
    assert got == expected


def test_stream_generate_with_a_tokenizer_matches():
    model = tiny_models.build("llama", dtype=mx.float32)
    tokenizer = tiny_models.word_tokenizer()
    prompt = " ".join(f"t{i}" for i in PROMPT)
    text = lambda: "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens=24))
    expected = text()
    with use_paged_cache(model):
        assert text() == expected


def test_undo_restores_model_and_module():
    model = tiny_models.build("gemma3_text")
    module = sys.modules[type(model).__module__]
    original_sdpa = module.scaled_dot_product_attention
    handle = use_paged_cache(model)
    assert module.scaled_dot_product_attention is not original_sdpa
    with pytest.raises(ValueError, match=r"\[use_paged_cache\] this model already uses a paged cache"):
        use_paged_cache(model)
    handle.undo()
    handle.undo()  # idempotent
    assert module.scaled_dot_product_attention is original_sdpa
    assert "make_cache" not in vars(model)
    assert not any(isinstance(c, PagedLayerCache) for c in make_prompt_cache(model))
    with use_paged_cache(model):  # and it can be applied again
        assert isinstance(make_prompt_cache(model)[0], PagedLayerCache)
    assert module.scaled_dot_product_attention is original_sdpa


def test_two_models_of_one_family_patch_and_unpatch_independently():
    a, b = tiny_models.build("llama", seed=0), tiny_models.build("llama", seed=1)
    module = sys.modules[type(a).__module__]
    original_sdpa = module.scaled_dot_product_attention
    ha, hb = use_paged_cache(a), use_paged_cache(b)
    ha.undo()
    assert isinstance(make_prompt_cache(b)[0], PagedLayerCache)
    assert module.scaled_dot_product_attention is not original_sdpa  # b still needs it
    hb.undo()
    assert module.scaled_dot_product_attention is original_sdpa


def test_a_model_without_k_v_caches_is_refused_up_front():
    # No family list: what is refused is refused for what the model does (here: recurrent state only).
    from kvmetal.integrations import arch_sweep

    model = arch_sweep.build("mamba")
    with pytest.raises(NotImplementedError, match=r"\[use_paged_cache\] mamba: no layer keeps a K/V cache"):
        use_paged_cache(model)
    assert "make_cache" not in vars(model)


@pytest.mark.parametrize("kwargs,match", [
    (dict(block_size=12), r"block_size must be one of"),
    (dict(num_blocks=0), r"num_blocks must be None or an int >= 1"),
    (dict(k_bits=7), r"k_bits must be None or one of"),
    (dict(v_bits=1), r"v_bits must be None or one of"),
])
def test_bad_options_raise(kwargs, match):
    model = tiny_models.build("llama")
    with pytest.raises(ValueError, match=r"\[use_paged_cache\] " + match):
        use_paged_cache(model, **kwargs)
    assert "make_cache" not in vars(model)


def _logits(model, prompt, extra):
    cache = make_prompt_cache(model)
    model(mx.array(prompt)[None], cache=cache)
    return model(mx.array([extra])[None], cache=cache)[0, -1].astype(mx.float32), cache


@pytest.mark.parametrize("k_bits,v_bits,budget", [(8, 8, 0.01), (8, None, 0.005), (8, 4, 0.2)])
def test_quantized_cache_stays_close_to_float(k_bits, v_bits, budget):
    # Random weights give Gaussian V rows, the worst case for 4 bits; real models do better.
    model = tiny_models.build("llama", dtype=mx.float16)
    reference, float_cache = _logits(model, PROMPT, 7)
    with use_paged_cache(model, k_bits=k_bits, v_bits=v_bits):
        quantized, cache = _logits(model, PROMPT, 7)
        pool = cache[0].pool
        for c, bits in ((pool.key_caches[0], k_bits), (pool.value_caches[0], v_bits)):
            assert isinstance(c, QuantizedKV) == (bits is not None)
            assert bits is None or c.bits == bits
        with use_paged_cache(tiny_models.build("llama", dtype=mx.float16)) as plain:
            float_pool = plain.new_model_cache().pools[0]
        assert pool.nbytes < float_pool.nbytes
    err = float(mx.abs(quantized - reference).max() / mx.abs(reference).max())
    assert err < budget, err


def test_trim_then_regenerate_gives_the_same_logits():
    model = tiny_models.build("qwen3")
    with use_paged_cache(model, block_size=8):
        expected, _ = _logits(model, PROMPT, 11)
        cache = make_prompt_cache(model)
        model(mx.array(PROMPT + [5, 6, 7, 8, 9])[None], cache=cache)  # 42 tokens, crosses a block
        assert all(c.is_trimmable() for c in cache)
        assert [c.trim(10) for c in cache] == [10] * len(cache)
        assert cache[0].offset == len(PROMPT) - 5
        model(mx.array(PROMPT[-5:])[None], cache=cache)
        got = model(mx.array([[11]]), cache=cache)[0, -1].astype(mx.float32)
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=1e-4, atol=1e-4)


def test_fixed_pool_too_small_raises_kv_cache_full():
    from kvmetal import KVCacheFull

    model = tiny_models.build("llama")
    with use_paged_cache(model, num_blocks=2, block_size=16):
        cache = make_prompt_cache(model)
        with pytest.raises(KVCacheFull, match=r"needs more blocks"):
            model(mx.array(list(range(40)))[None], cache=cache)


def test_reference_caches_are_mlx_lm_kinds():
    # The patch reads windows from the caches mlx-lm would build; make sure they are what we model.
    model = tiny_models.build("gemma3_text")
    kinds = {type(c).__name__ for c in make_prompt_cache(model)}
    assert kinds == {"KVCache", "RotatingKVCache"}
    assert isinstance(make_prompt_cache(tiny_models.build("llama"))[0], KVCache)


def test_k_and_v_keep_their_own_group_sizes():
    """K and V may differ in group size (issue 33: the API took both, the cache refused them):
    each pool side holds its own, and a pass reads them as the kernels take them."""
    from kvmetal import KVFormat
    model = tiny_models.build("llama")
    prompt = mx.array(list(range(1, 40)))[None]
    with use_paged_cache(model, k_bits=8, v_bits=8, k_group_size=32, v_group_size=64) as handle:
        cache = make_prompt_cache(model)
        mixed = model(prompt, cache=cache)
        pool = cache[0].model_cache.pools[0]
        assert (pool.k_group_size, pool.v_group_size) == (32, 64)
        assert (pool.key_caches[0].group_size, pool.value_caches[0].group_size) == (32, 64)
        assert handle.kv_format == KVFormat(k_bits=8, v_bits=8, k_group_size=32, v_group_size=64)
    with use_paged_cache(model, k_bits=8, v_bits=8, k_group_size=32, v_group_size=32):
        same_groups = model(prompt, cache=make_prompt_cache(model))
    with use_paged_cache(model):
        exact = model(prompt, cache=make_prompt_cache(model))
    # V's other group size rounds V differently; K8/V8 stays within 8-bit error of float.
    assert not mx.array_equal(mixed, same_groups)
    assert float(mx.abs(mixed - exact).max()) < 0.02 * float(mx.abs(exact).max())
    with pytest.raises(ValueError, match=r"v_group_size must be None or one of \(32, 64, 128\), got 48"):
        use_paged_cache(model, k_bits=8, v_bits=4, v_group_size=48)
    assert "make_cache" not in vars(model)
