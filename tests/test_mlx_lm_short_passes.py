"""Forward passes of 2-8 new tokens (speculative verification, short chunks) through
``paged_attention`` with a [S, L, H, D] query (issue 9 item 2, mlx-lm side): the
drop-in reads the pool in place instead of gathering, and must give mlx-lm's own
greedy tokens.
"""
from __future__ import annotations

import types

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step, speculative_generate_step  # noqa: E402
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

import kvmetal.backends  # noqa: E402
from kvmetal.integrations import tiny_models  # noqa: E402
from kvmetal.integrations.mlx_lm import SUPPORTED_FAMILIES, use_paged_cache  # noqa: E402

PROMPT = list(range(3, 40))
GREEDY = lambda lp: mx.argmax(lp, axis=-1)  # noqa: E731


@pytest.fixture
def counting_backend(monkeypatch):
    """The current backend, with the query rows of every paged_attention call recorded."""
    real = kvmetal.backends.get()
    calls = {"rows": []}

    def paged_attention(query, *args, **kw):
        calls["rows"].append(query.shape[1])
        return real.paged_attention(query, *args, **kw)

    fake = types.SimpleNamespace(paged_attention=paged_attention,
                                 **{n: getattr(real, n) for n in ("reshape_and_cache", "gather_kv_cache",
                                                                  "decode_attention", "copy_blocks",
                                                                  "paged_attention_varlen")})
    monkeypatch.setattr(kvmetal.backends, "get", lambda name=None: fake)
    return calls


def greedy(model, steps=20, **kwargs):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=steps, sampler=GREEDY, **kwargs)]


def speculative(model, draft, steps=20, num_draft=3):
    return [int(t) for t, _, _ in speculative_generate_step(mx.array(PROMPT), model, draft, max_tokens=steps,
                                                            num_draft_tokens=num_draft, sampler=GREEDY)]


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_speculative_decoding_on_the_paged_cache_matches_plain_greedy(family, counting_backend):
    model = tiny_models.build(family, seed=1)
    draft = tiny_models.build(family, seed=7)
    expected = greedy(model)
    with use_paged_cache(model), use_paged_cache(draft):
        got = speculative(model, draft)
    assert got == expected
    assert 4 in counting_backend["rows"]  # verification passes (3 drafts + 1) ran on the pool


@pytest.mark.parametrize("family", ["qwen3", "gpt_oss"])
def test_short_chunks_through_the_pool_match_mlx_lm(family, counting_backend):
    # Chunks of 1..8 tokens (short prefill steps) and a batch of two sequences.
    model = tiny_models.build(family)
    chunks = [PROMPT[:5], PROMPT[5:13], PROMPT[13:14], PROMPT[14:21], PROMPT[21:29], PROMPT[29:37]]

    def run(cache):
        outs = []
        for chunk in chunks:
            tokens = mx.array([chunk, [t + 1 for t in chunk]])
            outs.append(model(tokens, cache=cache).astype(mx.float32))
        return outs

    expected = run(make_prompt_cache(model))
    with use_paged_cache(model):
        got = run(make_prompt_cache(model))
    for g, e in zip(got, expected):
        np.testing.assert_allclose(np.array(g), np.array(e), rtol=2e-4, atol=2e-4)
    assert sorted(set(counting_backend["rows"])) == [1, 5, 7, 8]


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_speculative_decoding_on_the_current_backend_matches_plain_greedy(family):
    model = tiny_models.build(family, seed=1)
    draft = tiny_models.build(family, seed=7)
    expected = greedy(model)
    with use_paged_cache(model), use_paged_cache(draft):
        assert speculative(model, draft, num_draft=4) == expected


def test_window_layers_rewind_within_the_slack_and_refuse_beyond():
    from kvmetal.integrations.model_cache import TRIM_SLACK

    model = tiny_models.build("gemma3_text")
    with use_paged_cache(model, block_size=16):
        cache = make_prompt_cache(model)
        model(mx.array(PROMPT * 3)[None], cache=cache)  # 111 tokens, far past the 24-token window
        for t in range(5):
            model(mx.array([[t]]), cache=cache)
        assert all(c.is_trimmable() for c in cache)
        assert [c.trim(TRIM_SLACK) for c in cache] == [TRIM_SLACK] * len(cache)
        window_layer = next(c for c in cache if c.window is not None)
        with pytest.raises(ValueError, match=r"\[PagedLayerCache.trim\] cannot go back to \d+ tokens"):
            window_layer.trim(64)
