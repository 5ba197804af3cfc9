"""Scheduling policies (``kvmetal/engine/scheduler.py``), counted in engine steps.

A short prompt is not starved behind a long partial prefill; the queue follows priority
then arrival; the preemption victim is the least important, latest arrival; the adaptive
budget follows the step times it is told."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402

from kvmetal.integrations import tiny_models  # noqa: E402
from kvmetal.engine.engine import Engine  # noqa: E402
from kvmetal.engine.scheduler import MIN_PREFILL_CHUNK, POLICIES, AdaptiveScheduler  # noqa: E402


def tokens(rng, n):
    return [int(t) for t in rng.integers(0, 512, n)]


def one_at_a_time(model, prompt, max_tokens):
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                             sampler=lambda lp: mx.argmax(lp, axis=-1))]


BUDGET = 512


def steps_to_first_token_behind_a_long_prompt(policy, options, async_steps):
    """Steps from a 20-token prompt's arrival to its first token, while a 6,000-token prompt
    is two chunks into its prefill and 8 requests decode."""
    model = tiny_models.build("llama", max_position_embeddings=8192)
    rng = np.random.default_rng(0)
    with Engine(model, max_num_batched_tokens=BUDGET, block_size=32, async_steps=async_steps,
                scheduling_policy=policy, scheduler_options=options) as engine:
        engine.scheduler.observe = lambda *step: None  # no timing: the adaptive budget stays the cap
        decoders = [engine.add_request(tokens(rng, 20), max_tokens=200) for _ in range(8)]
        while sum(r.decoding for r in engine.running) < 8:
            engine.step()
        long = engine.add_request(tokens(rng, 6000), max_tokens=2)
        engine.step()
        engine.step()
        assert 0 < engine.requests[long].computed < 6000  # a partial prefill
        short = engine.add_request(tokens(rng, 20), max_tokens=2)
        for steps in range(1, 40):
            got = {e.request_id for e in engine.step() if e.token is not None}
            assert set(decoders) <= got, f"step {steps}: a running request got no token"
            assert engine.last_step_tokens <= BUDGET
            if short in got:
                request = engine.requests[short]
                assert request.output[0] == one_at_a_time(model, request.prompt, 1)[0]
                return steps, engine.requests[long].computed < 6000
    return None, None


@pytest.mark.parametrize("async_steps", [False, True])
@pytest.mark.parametrize("policy,options", [("fcfs", {"long_prefill_tokens": 256}), ("adaptive", {})],
                         ids=["fcfs-long-prefill-256", "adaptive"])
def test_a_short_prompt_behind_a_long_partial_prefill_gets_its_first_token_within_two_steps(
        policy, options, async_steps):
    steps, long_still_prefilling = steps_to_first_token_behind_a_long_prompt(policy, options, async_steps)
    # Bound: the step after its arrival computes it whole (its share of the budget is at least
    # 512 - 8 decodes - 256 = 248 tokens), and a pipelined step reads it one step later.
    assert steps is not None and steps <= 1 + int(async_steps)
    assert long_still_prefilling  # it did not wait for the long prompt


def test_without_a_chunk_bound_the_short_prompt_waits_for_the_long_prefill():
    # The starvation the bound fixes: partial prefills come first and take the whole budget.
    steps, long_still_prefilling = steps_to_first_token_behind_a_long_prompt("fcfs", {}, False)
    assert steps >= 10 and not long_still_prefilling


def test_priority_orders_the_queue_then_arrival_and_fcfs_refuses_priorities():
    model = tiny_models.build("llama")
    with Engine(model, scheduling_policy="priority") as engine:
        ids = [engine.add_request([1, 2, 3], max_tokens=1, priority=p) for p in (0, 5, -1, 0)]
        assert [r.request_id for r in engine.waiting] == [ids[2], ids[0], ids[3], ids[1]]
    with Engine(model) as engine:
        with pytest.raises(ValueError, match="priority 3 needs a scheduling policy"):
            engine.add_request([1, 2, 3], max_tokens=1, priority=3)
        with pytest.raises(TypeError, match="priority must be an int"):
            engine.add_request([1, 2, 3], max_tokens=1, priority=1.5)
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        Engine(model, scheduling_policy="lottery")


@pytest.mark.parametrize("policy,first_victim", [("fcfs", "important"), ("priority", "unimportant")])
def test_the_victim_is_the_least_important_latest_arrival(policy, first_victim):
    # 8 blocks of 16; each request reaches 40 + 60 = 100 tokens (7 blocks): both cannot fit.
    model = tiny_models.build("llama")
    rng = np.random.default_rng(3)
    prompts = {"unimportant": tokens(rng, 40), "important": tokens(rng, 40)}
    expected = {name: one_at_a_time(model, p, 60) for name, p in prompts.items()}
    with Engine(model, num_blocks=8, block_size=16, scheduling_policy=policy) as engine:
        # The unimportant request arrives and is admitted first: FCFS preempts the newest admitted.
        ids = {"unimportant": engine.add_request(prompts["unimportant"], max_tokens=60,
                                                 priority=1 if policy == "priority" else 0)}
        engine.step()
        ids["important"] = engine.add_request(prompts["important"], max_tokens=60)
        names = {v: k for k, v in ids.items()}
        victims = []
        while engine.has_work():
            running = {r.request_id for r in engine.running}
            engine.step()
            victims += [names[i] for i in running if engine.requests[i] in engine.waiting]
        assert engine.preemptions >= 1 and victims[0] == first_victim
        assert {name: engine.requests[i].output for name, i in ids.items()} == expected  # no token changes


def test_the_adaptive_budget_follows_the_measured_step_times():
    s = AdaptiveScheduler(None, block_size=16, prefix_sharing=False, finish=None, max_num_batched_tokens=256,
                          prefill_tokens=2048, step_ratio=2.0)
    assert s.budget(0) == 2048  # no decodes to stall: prefill at the large budget
    assert s.budget(8) == 256  # nothing measured yet: the cap
    s.observe(8, 8, 0.010)  # a decode-only step of 10 ms
    s.observe(108, 8, 0.060)  # 100 prefill tokens added 50 ms: 0.5 ms a token
    # A step of 2 x 10 ms leaves 10 ms for prefill: 20 tokens beside the 8 decodes.
    assert s.budget(8) == 8 + 20
    for _ in range(50):  # prefill gets cheap: the cap binds
        s.observe(108, 8, 0.011)
    assert s.budget(8) == 256
    for _ in range(50):  # and dear: at least a block a step, and a chunk that moves a prompt
        s.observe(108, 8, 1.0)
    assert s.budget(8) == 8 + max(16, MIN_PREFILL_CHUNK)
    assert "adaptive" in POLICIES and POLICIES["fcfs"].uses_priority is False
    with pytest.raises(ValueError, match="step_ratio"):
        AdaptiveScheduler(None, block_size=16, prefix_sharing=False, finish=None, step_ratio=0.5)
    with pytest.raises(ValueError, match="long_prefill_tokens must be an int >= 1"):
        AdaptiveScheduler(None, block_size=16, prefix_sharing=False, finish=None, long_prefill_tokens=0)


# ----------------------------------------------------------------------------- chunks and kernels

def test_prompt_chunk_never_cuts_a_short_run_and_always_moves_with_enough_budget():
    """A prompt is never cut into a chunk, or a remainder, of 1..VARLEN_SHORT_RUN tokens
    (Metal runs such a run with its decode kernel: other bits than the same rows in a
    longer run), and a budget of MIN_PREFILL_CHUNK tokens always moves it."""
    from kvmetal.backends import VARLEN_SHORT_RUN
    from kvmetal.engine.scheduler import MIN_PREFILL_CHUNK, prompt_chunk
    short = range(1, VARLEN_SHORT_RUN + 1)
    for left in range(1, 80):
        for n in range(0, 90):
            got = prompt_chunk(n, left)
            assert 0 <= got <= min(max(n, 0), left) or got == left <= n
            if got and got < left:
                assert got not in short and left - got not in short, (n, left, got)
            if n >= MIN_PREFILL_CHUNK:
                assert got > 0, (n, left)


@pytest.mark.parametrize("policy,options", [("fcfs", {"long_prefill_tokens": 5}), ("adaptive", {})])
def test_engine_chunks_follow_the_rule_under_any_budget_left(policy, options):
    """Through the engine: prompts of every length arriving while others decode; every
    chunk of a prompt of more than VARLEN_SHORT_RUN tokens has more than that many."""
    from kvmetal.backends import VARLEN_SHORT_RUN
    model = tiny_models.build("llama")
    rng = np.random.default_rng(3)
    with Engine(model, max_num_batched_tokens=40, block_size=16, scheduling_policy=policy,
                scheduler_options=options) as engine:
        seen = []
        schedule = engine.scheduler.schedule

        def spy(*args):
            batch = schedule(*args)
            seen.extend((r.request_id, len(r.tokens) - r.computed, n) for r, n in batch if not r.decoding)
            return batch
        engine.scheduler.schedule = spy
        for length in (3, 9, 17, 18, 30, 57, 100):
            engine.add_request(tokens(rng, length), max_tokens=3)
            engine.step()
        for _ in range(200):
            if not engine.has_work():
                break
            engine.step()
        assert not engine.has_work()
        assert len({rid for rid, _, _ in seen}) == 7
        for rid, left, n in seen:  # a chunk is all that is left, or neither it nor its rest is short
            assert n == left or (n > VARLEN_SHORT_RUN and left - n > VARLEN_SHORT_RUN), (rid, left, n)
