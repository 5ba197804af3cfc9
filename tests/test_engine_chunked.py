"""The stall-free step: one ragged forward per step under ``max_num_batched_tokens``.

Counted in engine steps, not seconds: running requests get a token every step while a
long prompt is chunked in; chunks publish their blocks, so requests with one prefix
compute it once; a partly prefilled request that is preempted resumes from its
published blocks; logits come only for the rows that sample."""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402

from kvmetal.integrations import tiny_models  # noqa: E402
from kvmetal.engine.engine import Engine  # noqa: E402
from kvmetal.integrations.heads import body, lm_head  # noqa: E402
from kvmetal.integrations.mlx_lm import SUPPORTED_FAMILIES  # noqa: E402


def one_at_a_time(model, prompt, max_tokens):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                             sampler=lambda lp: mx.argmax(lp, axis=-1))]


def tokens(rng, n):
    return [int(t) for t in rng.integers(0, 512, n)]


@pytest.mark.parametrize("family", SUPPORTED_FAMILIES)
def test_head_of_body_is_the_model(family):
    # The engine slices hidden states between body and head: together they must be the model.
    model = tiny_models.build(family)
    x = mx.array([[3, 1, 4, 1, 5, 9, 2, 6]])
    assert mx.array_equal(lm_head(model)(body(model)(x, None)), model(x))


@pytest.mark.parametrize("async_steps", [False, True])
def test_running_requests_get_a_token_every_step_while_a_long_prompt_is_chunked_in(async_steps):
    model = tiny_models.build("llama", max_position_embeddings=8192)
    rng = np.random.default_rng(0)
    budget = 512
    with Engine(model, max_num_batched_tokens=budget, block_size=32, async_steps=async_steps) as engine:
        decoders = [engine.add_request(tokens(rng, 20), max_tokens=200) for _ in range(8)]
        while sum(r.decoding for r in engine.running) < 8:
            engine.step()
        long = engine.add_request(tokens(rng, 6000), max_tokens=2)
        steps = 0
        first_token_step = None
        while first_token_step is None:
            events = engine.step()
            steps += 1
            got = {e.request_id for e in events if e.token is not None}
            assert set(decoders) <= got, f"step {steps}: a running request got no token"
            assert engine.last_step_tokens <= budget
            if long in got:
                first_token_step = steps
        # Decodes take 8 of each step's tokens; the prompt gets the rest of the budget.
        # Pipelined steps return the previous pass's tokens: the first token is read one step later.
        late = int(async_steps)
        assert first_token_step <= math.ceil(6000 / (budget - 8)) + late
        assert first_token_step == math.ceil(6000 / budget) + late  # 12: the 8 decodes cost no extra step here
        assert engine.prompt_tokens_computed == 8 * 20 + 6000
        # The prompt's first token is mlx-lm's (a chunked prefill changes nothing).
        assert engine.requests[long].output[0] == one_at_a_time(model, engine.requests[long].prompt, 1)[0]


def test_logits_only_for_rows_that_sample(monkeypatch):
    model = tiny_models.build("llama")
    head_rows = []
    with Engine(model, max_num_batched_tokens=64) as engine:
        real = engine._head
        engine._head = lambda h: head_rows.append(h.shape[0]) or real(h)
        engine.add_request(list(range(1, 41)), max_tokens=3)
        engine.add_request(list(range(100, 200)), max_tokens=3)
        engine.step()  # 40 + 24 tokens: only the first prompt's last row samples
        engine.step()  # 1 decode + 64 tokens of the second prompt (not finished): one row
        engine.step()  # 1 decode + the second prompt's last 12 tokens: two rows
        assert head_rows == [1, 1, 2]


def test_requests_with_one_prefix_admitted_together_compute_it_once():
    model = tiny_models.build("llama")
    rng = np.random.default_rng(1)
    prefix = tokens(rng, 200)
    prompts = [prefix + tokens(rng, 10 + i) for i in range(3)]
    expected = [one_at_a_time(model, p, 4) for p in prompts]
    with Engine(model, max_num_batched_tokens=64, block_size=16) as engine:
        outputs = engine.run(prompts, 4)
        shared = 200 // 16 * 16  # the prefix's full blocks
        assert outputs == expected
        assert engine.prompt_tokens_computed == sum(map(len, prompts)) - 2 * shared
        assert engine.prompt_tokens_cached == 2 * shared
    with Engine(model, max_num_batched_tokens=64, block_size=16, prefix_sharing=False) as engine:
        assert engine.run(prompts, 4) == expected
        assert engine.prompt_tokens_computed == sum(map(len, prompts))


def test_a_chunk_that_completes_a_block_publishes_it():
    model = tiny_models.build("llama")
    prompt = list(range(1, 101))
    with Engine(model, max_num_batched_tokens=40, block_size=16) as engine:
        engine.add_request(prompt, max_tokens=1)
        engine.step()  # 40 tokens: blocks 0 and 1 are full
        allocator = engine.cache.pools[0].allocator
        assert engine.cache.cached_prefix(prompt[:33] + [7] * 10) == 32
        engine.step()  # 80 tokens: five full blocks
        assert engine.cache.cached_prefix(prompt) == 80
        assert allocator.num_cached == 0  # published, still owned


def test_a_preempted_partly_prefilled_request_resumes_from_its_published_blocks():
    model = tiny_models.build("llama")
    rng = np.random.default_rng(2)
    short, long = tokens(rng, 30), tokens(rng, 160)
    expected_short, expected_long = one_at_a_time(model, short, 40), one_at_a_time(model, long, 3)
    # 12 blocks of 16. The long prompt is chunked in beside the decoding short request
    # until the pool is full (9 of its blocks); the short one's next block then preempts it.
    with Engine(model, max_num_batched_tokens=32, block_size=16, num_blocks=12) as engine:
        a = engine.add_request(short, max_tokens=40)
        engine.step()
        b = engine.add_request(long, max_tokens=3)
        request = engine.requests[b]
        computed_before, resumed_at = None, None
        while engine.has_work():
            was_running, held = request in engine.running, request.computed
            engine.step()
            if was_running and request not in engine.running and computed_before is None:
                assert not request.finished and not request.decoding
                computed_before = held  # preempted while prefilling
                assert b not in engine.cache and engine.cache.stats()["used_blocks"] == 4  # its blocks are free
            if computed_before is not None and resumed_at is None and request in engine.running:
                resumed_at = request.cached_prompt_tokens
        assert engine.preemptions == 1 and 0 < computed_before < len(long)
        # It came back from its published full blocks (the short request's growth evicted
        # only the last ones: blocks are released tail first), not from scratch.
        assert resumed_at is not None and 0 < resumed_at <= computed_before and resumed_at % 16 == 0
        assert engine.prompt_tokens_computed == len(short) + computed_before + len(long) - resumed_at
        assert engine.requests[a].output == expected_short
        assert request.output == expected_long


def test_engine_steps_bench_runs_and_counts_steps():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "bench" / "engine_steps.py"
    spec = importlib.util.spec_from_file_location("engine_steps", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = tiny_models.build("llama")
    result = bench.run_budget(model, 64, 200, 2, 512)
    assert result["steps_to_first_token"] == math.ceil(200 / (64 - 2))
    assert result["device_ms_per_step"] > 0 and result["host_ms_per_step"] > 0
    pipelined = bench.run_budget(model, 64, 200, 2, 512, async_steps=True)
    assert pipelined["mode"] == "async"
    assert pipelined["steps_to_first_token"] == math.ceil(200 / (64 - 2)) + 1  # read one step later


def test_a_new_request_leaves_a_block_per_running_decode_free():
    # Admitting into the blocks the running decodes need at their next block boundary
    # would only preempt one of them a few steps later.
    model = tiny_models.build("llama")
    with Engine(model, num_blocks=10, block_size=16, max_num_batched_tokens=256) as engine:
        a = engine.add_request(list(range(1, 41)), max_tokens=20)  # 3 blocks each
        b = engine.add_request(list(range(50, 90)), max_tokens=20)
        engine.step()
        assert engine.requests[a].decoding and engine.requests[b].decoding
        assert engine.cache.free_blocks == 4
        c = engine.add_request(list(range(100, 140)), max_tokens=2)
        engine.step()
        # 4 free blocks, 2 kept for the decodes: c's first chunk fits 2 blocks, not its whole 40
        # tokens; 31, not 32, so that its rest is no run of <= 8 rows (scheduler.prompt_chunk)
        assert engine.requests[c].computed == 31
        assert engine.last_step_tokens == 2 + 31
        while engine.has_work():
            engine.step()
        assert engine.preemptions == 0
        assert len(engine.requests[c].output) == 2
