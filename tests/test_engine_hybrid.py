"""The Engine on MoE and hybrid (recurrent-state) models, tiny and random, built from
mlx-lm's own configs (``arch_sweep.build``): greedy tokens equal mlx-lm's own generation
of each prompt alone, whatever the batch, chunking, pipelining or preemption."""
from __future__ import annotations

import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402

from kvmetal.engine.engine import Engine  # noqa: E402
from kvmetal.integrations import arch_sweep  # noqa: E402

from mlx_lm_cases import mlx_lm_greedy  # noqa: E402

PROMPTS = [list(range(3, 40)), [7, 1, 9, 4, 4], list(range(100, 121))]
STEPS = 10
# qwen3_moe: MoE only; qwen3_next: gated-delta recurrent layers (ArraysCache) and MoE;
# falcon_h1: a CacheList per layer, a Mamba state beside a K/V cache; bailing_moe_linear: its
# linear-attention layers take the attention cache's offset (the pass's per-row positions,
# handed to each sequence as its first position).
FAMILIES = ["qwen3_moe", "qwen3_next", "falcon_h1", "bailing_moe_linear"]
_MODELS: dict = {}


def model_of(name):
    if name not in _MODELS:
        _MODELS[name] = arch_sweep.build(name)
    return _MODELS[name]


def expected(name):
    return [mlx_lm_greedy(model_of(name), p, STEPS) for p in PROMPTS]


@pytest.mark.parametrize("name", FAMILIES)
@pytest.mark.parametrize("options", [dict(), dict(async_steps=True, max_num_batched_tokens=16),
                                     dict(num_blocks=7, block_size=8)], ids=["batched", "chunked-async", "preempt"])
def test_greedy_tokens_equal_mlx_lm_alone(name, options):
    model = model_of(name)
    with Engine(model, **options) as engine:
        got = engine.run(PROMPTS, STEPS)
        if "num_blocks" in options:
            assert engine.preemptions > 0  # 7 blocks of 8: all three need 12 by the end
    assert got == expected(name)


def test_a_request_gets_the_same_tokens_alone_and_in_a_batch():
    model = model_of("qwen3_next")
    with Engine(model) as engine:
        alone = engine.run(PROMPTS[:1], STEPS)[0]
    with Engine(model, max_num_batched_tokens=24) as engine:
        batched = engine.run(PROMPTS, STEPS)[0]
    assert alone == batched


def test_recurrent_state_turns_prefix_sharing_and_speculation_off_and_close_restores_the_model():
    from mlx_lm.models import qwen3_next

    model = model_of("qwen3_next")
    before = qwen3_next.Qwen3NextGatedDeltaNet.__call__
    with Engine(model) as engine:
        assert engine.prefix_sharing is False
        assert qwen3_next.Qwen3NextGatedDeltaNet.__call__ is not before  # runs once per sequence in a pass
    assert qwen3_next.Qwen3NextGatedDeltaNet.__call__ is before
    with pytest.raises(ValueError, match=r"prefix_sharing=True is not supported for qwen3_next: a request's "):
        Engine(model, prefix_sharing=True)
    with pytest.raises(ValueError, match=r"speculative decoding is not supported for qwen3_next"):
        Engine(model, speculative="ngram")
    assert qwen3_next.Qwen3NextGatedDeltaNet.__call__ is before
    with Engine(model_of("qwen3_moe")) as engine:  # no recurrent state: sharing stays on
        assert engine.prefix_sharing is True


def test_an_unlisted_family_is_split_before_its_head_only_where_a_probe_says_exact():
    """qwen3_moe is not a listed family: its head is split off because the probe (a prompt,
    then more tokens, on mlx-lm's caches) gives model(x) bit for bit, so the engine slices
    hidden states, not a prefill chunk's logits. A call that scales its logits after the
    head is split around its backbone (the stand-in split); one whose tail mixes rows is
    left whole (the runner then slices the logits), never split wrongly."""
    from kvmetal.integrations.heads import split_model

    model = arch_sweep.build("qwen3_moe")
    x = mx.array([[5, 3, 9, 1]], dtype=mx.int32)
    body, head = split_model(model)
    assert mx.array_equal(head(body(x, None)), model(x))
    plain = type(model)

    class Scaled(plain):  # a logit scale after the head, as cohere has
        def __call__(self, inputs, cache=None):
            return 2.0 * super().__call__(inputs, cache)

    class Mixed(plain):  # a tail that mixes rows: no head may be handed chosen rows
        def __call__(self, inputs, cache=None):
            return mx.cumsum(super().__call__(inputs, cache), axis=1)

    for cls in (Scaled, Mixed):
        cls.__module__ = plain.__module__
        model.__class__ = cls
        try:
            if cls is Scaled:
                body, head = split_model(model)
                assert mx.array_equal(head(body(x, None)), model(x))
                assert mx.array_equal(head(body(x, None)), 2.0 * plain.__call__(model, x))
            else:
                with pytest.raises(NotImplementedError, match="qwen3_moe"):
                    split_model(model)
        finally:
            model.__class__ = plain


@pytest.mark.parametrize("name", ["cohere", "gemma2"])  # a logit scale / a final softcap after the head
def test_stand_in_split_families_give_mlx_lm_tokens_through_the_engine(name):
    from kvmetal.integrations.heads import split_model

    model = model_of(name)
    split_model(model)  # the stand-in split passes its probe (NotImplementedError otherwise)
    with Engine(model, max_num_batched_tokens=16) as engine:
        assert engine.runner.head.__name__ == "head"  # hidden states sliced before the head
        got = engine.run(PROMPTS, STEPS)
    assert got == expected(name)


def test_absolute_positions_from_the_offset_follow_each_row_in_the_engine():
    # gpt_bigcode looks its learned positions up from np.arange(cache[0].offset, ...), one int:
    # an Engine pass's offset is a position per row (ValueError before its stand-in).
    with Engine(model_of("gpt_bigcode"), block_size=8, max_num_batched_tokens=16) as engine:
        got = engine.run(PROMPTS, STEPS)
    assert got == expected("gpt_bigcode")
