"""The Engine on llama4's chunked attention (issue 40): a tiny random llama4 (arch_sweep,
chunk 16, every 4th layer global), prompts past several chunks. Greedy tokens equal
mlx-lm's own generation of each prompt alone, whatever the batch, prefill chunking,
pipelining, preemption or speculative drafts; the chunk rule runs on the kernels (no
gathered attention); prefix sharing across a chunk start stays right."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from kvmetal.engine.engine import Engine  # noqa: E402
from kvmetal.integrations import arch_sweep  # noqa: E402
from kvmetal.integrations.mlx_lm import UnsupportedModel  # noqa: E402

from mlx_lm_cases import TinyGreedy  # noqa: E402

CHUNK = 16
PROMPTS = [list(range(3, 60)), [7, 1, 9, 4, 4], list(range(100, 141))]  # 57, 5 and 41 tokens
STEPS = 20  # each crosses a chunk start while decoding
_CASE = TinyGreedy("llama4", STEPS)  # the tiny model and mlx-lm's greedy tokens, each built once
expected = _CASE.expected


def model():
    assert arch_sweep.tiny_args("llama4")["text_config"]["attention_chunk_size"] == CHUNK
    return _CASE.model()


@pytest.mark.parametrize("options", [dict(block_size=8), dict(async_steps=True, max_num_batched_tokens=16),
                                     dict(num_blocks=14, block_size=8)], ids=["batched", "chunked-async", "preempt"])
def test_greedy_tokens_equal_mlx_lm_alone(options):
    with Engine(model(), **options) as engine:
        got = engine.run(PROMPTS, STEPS)
        assert engine.cache.chunks == [CHUNK, None]  # the chunk layers' pool, the global layer's
        assert engine.cache.gathered_attention == 0
        if "num_blocks" in options:
            assert engine.preemptions > 0
    assert got == [expected(p) for p in PROMPTS]


def test_a_request_gets_the_same_tokens_alone_and_in_a_batch():
    with Engine(model(), block_size=8) as engine:
        alone = engine.run(PROMPTS[:1], STEPS)[0]
    with Engine(model(), block_size=8, max_num_batched_tokens=24) as engine:
        batched = engine.run(PROMPTS, STEPS)[0]
    assert alone == batched == expected(PROMPTS[0])


def test_chunk_layers_release_blocks_in_a_fixed_pool():
    """A 57-token prompt decoding 40 tokens in blocks of 8: the global layer keeps every
    block (97 tokens: 13), the chunk layers a chunk plus the slack (at most 5 here)."""
    prompt, steps = PROMPTS[0], 40
    with Engine(model(), block_size=8, num_blocks=16) as engine:
        chunk_pool, full_pool = engine.cache.pools
        rid = engine.add_request(prompt, max_tokens=steps)
        held = []
        while engine.has_work():
            engine.step()
            if rid in chunk_pool:
                held.append((len([b for b in chunk_pool.allocator.block_table(rid) if b >= 0]),
                             len(full_pool.allocator.block_table(rid))))
        assert engine.requests[rid].output == expected(prompt, steps)
    assert max(f for _, f in held) == 12  # the 97th token is sampled, never written
    assert held[0][0] == 8 and max(c for c, _ in held[1:]) <= (CHUNK + 16) // 8 + 1


def test_prefix_sharing_across_a_chunk_start():
    """A second prompt sharing 40 tokens (two chunk starts) with one that ran before starts
    after the cached blocks, the chunk layers' included, and still gets mlx-lm's tokens."""
    first = PROMPTS[0]
    second = first[:40] + [200, 201, 202, 203, 204, 205, 206]
    with Engine(model(), block_size=8) as engine:
        assert engine.prefix_sharing is True
        got = engine.run([first], STEPS) + engine.run([second], STEPS)
        assert engine.prompt_tokens_cached >= 32
    assert got == [expected(first), expected(second)]


def test_speculative_drafts_across_chunk_starts_keep_greedy_tokens():
    from kvmetal.engine.proposers import SpeculativeConfig

    rng = np.random.default_rng(0)
    base = rng.integers(1, 250, 30).tolist()
    prompts = [base + base[:12] + base[:11], base[5:] + base[5:20]]  # repeats for prompt lookup to draft
    spec = SpeculativeConfig(ngram_min=1, min_acceptance=0.0)
    with Engine(model(), block_size=8, speculative=spec) as engine:
        got = engine.run(prompts, 30)
        assert engine.drafted_tokens > 0 and engine.cache.gathered_attention == 0
    assert got == [expected(p, 30) for p in prompts]


def test_a_block_size_that_does_not_divide_the_chunk_is_refused_up_front():
    with pytest.raises(UnsupportedModel, match=r"^\[use_paged_cache\] llama4 layer 0: chunked attention \(chunk "
                                               r"16\) needs a block_size that divides the chunk for kvmetal's "
                                               r"Engine, got block_size=32"):
        Engine(model(), block_size=32)
    assert "make_cache" not in vars(model())  # the refusal left the model as it was
