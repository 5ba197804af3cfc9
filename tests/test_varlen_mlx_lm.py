"""The mlx-lm drop-in runs every pass of more than 8 tokens through paged_attention_varlen
on the pool: a prompt, chunks after a cached prefix, a batch of prompts. No gather and no
SDPA on that path, and the logits and greedy tokens of mlx-lm's own cache."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvmetal import ops  # noqa: E402
from kvmetal.integrations import model_cache, tiny_models  # noqa: E402
from kvmetal.integrations.mlx_lm import use_paged_cache  # noqa: E402

PROMPT = list(range(3, 63))  # 60 tokens: past the 24-token window of gemma3_text / gpt_oss
GREEDY = lambda lp: mx.argmax(lp, axis=-1)  # noqa: E731


@pytest.fixture
def calls(monkeypatch):
    """Query rows of every varlen / paged call; a gather (the path that feeds SDPA) fails the test."""
    seen = {"varlen": [], "paged": []}
    real_varlen, real_paged = ops.paged_attention_varlen, ops.paged_attention

    def varlen(query, *args, **kwargs):
        seen["varlen"].append(query.shape[0])
        return real_varlen(query, *args, **kwargs)

    def paged(query, *args, **kwargs):
        seen["paged"].append(query.shape[0])
        return real_paged(query, *args, **kwargs)

    def refuse(*args, **kwargs):
        raise AssertionError("the drop-in gathered a pass it should read in place")

    monkeypatch.setattr(model_cache.ops, "paged_attention_varlen", varlen)
    monkeypatch.setattr(model_cache.ops, "paged_attention", paged)
    monkeypatch.setattr(model_cache.ops, "gather_kv_cache", refuse)
    return seen


def greedy(model, steps=8, **kwargs):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=steps, sampler=GREEDY, **kwargs)]


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss"])
def test_chunked_prefill_after_a_cached_prefix_reads_the_pool(family, calls):
    """prefill_step_size 20: chunks of 20 tokens, each after the previous ones' cached prefix."""
    model = tiny_models.build(family)
    expected = greedy(model, prefill_step_size=20)
    with use_paged_cache(model):
        got = greedy(model, prefill_step_size=20)
    assert got == expected
    layers = len(model.layers)
    assert calls["varlen"] == [20] * (2 * layers) + [19] * layers  # mlx-lm keeps the last token for decode
    assert calls["paged"]  # decode steps


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_a_batch_of_prompts_reads_the_pool(family, calls):
    model = tiny_models.build(family)
    tokens = mx.array([PROMPT[:40], PROMPT[20:60]])
    expected = model(tokens, cache=make_prompt_cache(model)).astype(mx.float32)
    with use_paged_cache(model):
        cache = make_prompt_cache(model)
        got = model(tokens, cache=cache).astype(mx.float32)
        again = model(mx.array([PROMPT[40:50], PROMPT[:10]]), cache=cache).astype(mx.float32)
    np.testing.assert_allclose(np.array(got), np.array(expected), rtol=2e-4, atol=2e-4)
    assert calls["varlen"] == [80] * len(model.layers) + [20] * len(model.layers)  # B * L rows per layer
    reference = make_prompt_cache(model)
    model(tokens, cache=reference)
    np.testing.assert_allclose(np.array(again), np.array(model(mx.array([PROMPT[40:50], PROMPT[:10]]),
                                                                  cache=reference).astype(mx.float32)),
                               rtol=2e-4, atol=2e-4)
