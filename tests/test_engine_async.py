"""Pipelined engine steps (``Engine(async_steps=True)``): the host schedules and builds
pass n+1 while the device computes pass n, feeding decodes pass n's sampled tokens on the
device, and ``step()`` returns pass n's tokens. Nothing a request sees may change."""
from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from kvmetal.cache import HOLE, BlockAllocator, PagedKVCache  # noqa: E402
from kvmetal.integrations import tiny_models  # noqa: E402
from kvmetal.engine.engine import Engine, SamplingParams  # noqa: E402

STOPS = (7, 11, 13, 17, 19, 23, 29, 31, 37, 41)


def workload():
    rng = random.Random(0)
    shared = [rng.randrange(512) for _ in range(40)]
    prompts = [shared + [rng.randrange(512) for _ in range(rng.randrange(1, 60))] for _ in range(8)]
    params = [dict(max_tokens=20), dict(max_tokens=25, sampling=SamplingParams(temperature=0.8, seed=3), logprobs=2),
              dict(max_tokens=18, sampling=SamplingParams(repetition_penalty=1.3, presence_penalty=0.5)),
              dict(max_tokens=30), dict(max_tokens=40, stop_token_ids=STOPS, logprobs=0),
              dict(max_tokens=15, sampling=SamplingParams(temperature=1.0, top_p=0.9, seed=5, frequency_penalty=0.3,
                                                          frequency_context_size=3)),
              dict(max_tokens=28), dict(max_tokens=12, sampling=SamplingParams(temperature=0.7, min_p=0.1, seed=9))]
    return prompts, params


def run(model, *, async_steps, num_blocks=None, budget=64):
    prompts, params = workload()
    seen = {}
    with Engine(model, num_blocks=num_blocks, async_steps=async_steps, max_num_batched_tokens=budget) as engine:
        ids = [engine.add_request(p, **kw) for p, kw in zip(prompts, params)]
        while engine.has_work():
            for e in engine.step():
                got = seen.setdefault(e.request_id, {"tokens": [], "logprobs": [], "reason": None})
                if e.token is not None:
                    got["tokens"].append(e.token)
                    got["logprobs"].append(None if e.logprobs is None else
                                           (round(e.logprobs.logprob, 4), [t for t, _ in e.logprobs.top]))
                if e.finished:
                    got["reason"] = e.finish_reason
        return [seen[i] for i in ids], engine.preemptions, engine.steps


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss"])
@pytest.mark.parametrize("num_blocks", [None, 12])
def test_pipelined_steps_give_every_request_the_same_tokens(family, num_blocks):
    # Greedy, seeded sampling, penalties over a history that ends in a token still in
    # flight, logprobs, stop tokens, and (12 blocks) preemption under a full pool.
    model = tiny_models.build(family)
    sync, preempted, _ = run(model, async_steps=False, num_blocks=num_blocks)
    pipelined, preempted_async, _ = run(model, async_steps=True, num_blocks=num_blocks)
    assert pipelined == sync
    assert any(r["reason"] == "stop" for r in sync) or family != "llama"
    if num_blocks is not None:
        assert preempted > 0 and preempted_async > 0


def test_step_returns_the_previous_pass_and_max_tokens_wastes_no_pass():
    model = tiny_models.build("llama")
    with Engine(model, async_steps=True) as engine:
        rid = engine.add_request([1, 2, 3, 4], max_tokens=3)
        assert engine.step() == []  # the prefill's token is still on the device
        assert engine.has_work()
        counts = [len(engine.step()) for _ in range(3)]
        assert counts == [1, 1, 1] and not engine.has_work()
        assert engine.steps == 3  # the last token was known to be the last: no pass past it
        assert len(engine.requests[rid].output) == 3


def test_a_stop_token_costs_one_pass_whose_token_is_dropped():
    model = tiny_models.build("llama")
    with Engine(model) as engine:
        free = engine.run([[5, 6, 7]], 12)[0]
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])  # first stop at token k
    stop = free[k]
    for async_steps, passes in ((False, k + 1), (True, k + 2)):
        with Engine(model, async_steps=async_steps) as engine:
            rid = engine.add_request([5, 6, 7], max_tokens=12, stop_token_ids=[stop])
            while engine.has_work():
                engine.step()
            request = engine.requests[rid]
            assert request.output == free[:k + 1] and request.finish_reason == "stop"
            assert engine.steps == passes
            assert engine.cache.pools[0].allocator.num_owned == 0


def test_abort_with_a_token_in_flight_drops_it_and_frees_the_blocks():
    model = tiny_models.build("llama")
    with Engine(model, async_steps=True) as engine:
        a = engine.add_request(list(range(1, 30)), max_tokens=50)
        b = engine.add_request(list(range(40, 60)), max_tokens=8)
        engine.step()
        engine.step()
        assert engine.requests[a].pending is not None
        assert engine.abort(a)
        events = []
        while engine.has_work():
            events += engine.step()
        assert all(e.request_id == b for e in events)
        assert len(engine.requests[b].output) == 8
        assert engine.cache.pools[0].allocator.num_owned == 0
        output = engine.requests[b].output
    with Engine(model) as engine:
        assert engine.run([list(range(40, 60))], 8)[0] == output


def test_decode_blocks_are_published_when_their_last_token_lands():
    # A decode's input token has no id when its pass is built; the block it completes is
    # published once the id is read, so a follow-up turn still shares the whole history.
    model = tiny_models.build("llama")
    prompt = list(range(1, 21))
    for async_steps in (False, True):
        with Engine(model, block_size=8, async_steps=async_steps) as engine:
            first = engine.run([prompt], 30)[0]
            turn = prompt + first + [3, 4, 5]
            rid = engine.add_request(turn, max_tokens=1)
            while engine.has_work():
                engine.step()
            # 20 + 30 tokens ran through the model (the last output token never did): 49 -> 6 blocks
            assert engine.requests[rid].cached_prompt_tokens == 48


def test_allocator_ids_later_defers_hashing_until_provided():
    a = BlockAllocator(8, 4)
    a.add("s", [1, 2, 3])
    a.append("s", num_tokens=1, ids_later=True)
    assert a.cached_prefix([1, 2, 3, 9, 5]) == 0  # block 0's last id is unknown: not published
    with pytest.raises(ValueError, match="provide_ids"):
        a.append("s", [5])
    with pytest.raises(ValueError, match="waits for 1"):
        a.provide_ids("s", [9, 9])
    a.provide_ids("s", [9])
    assert a.cached_prefix([1, 2, 3, 9, 5]) == 4
    a.append("s", [5])  # ids known again: ordinary appends work
    a.append("s", num_tokens=2, ids_later=True)
    a.truncate("s", 5)  # truncation drops ids still owed
    a.append("s", [6, 7, 8])
    assert a.tokens("s") == [1, 2, 3, 9, 5, 6, 7, 8]
    assert a.cached_prefix([1, 2, 3, 9, 5, 6, 7, 8, 1]) == 8


def test_table_mirror_matches_the_allocator_through_random_table_changes():
    from kvmetal.integrations.table_mirror import BlockTableMirror

    rng = np.random.default_rng(3)
    pool = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=64, num_blocks=40, block_size=8, dtype=mx.float16)
    mirror = BlockTableMirror(pool)
    live, next_id = [], 0
    for step in range(400):
        op = rng.integers(0, 7)
        if op == 0 or not live:  # a new sequence (sometimes an old id again)
            sid = int(rng.integers(0, next_id + 1)) if rng.random() < 0.3 else next_id
            next_id = max(next_id, sid + 1)
            if sid not in pool and pool.allocator.can_add(num_tokens=10):
                pool.add_sequence(sid, num_tokens=int(rng.integers(1, 11)))
                live.append(sid)
        elif op in (1, 2):
            sid = live[int(rng.integers(len(live)))]
            if pool.allocator.blocks_needed(sid, 9) <= pool.allocator.num_free:
                pool.append(sid, num_tokens=int(rng.integers(1, 10)))
        elif op == 3:
            sid = live.pop(int(rng.integers(len(live))))
            pool.free(sid)
        elif op == 4:
            sid = live[int(rng.integers(len(live)))]
            keep = int(rng.integers(0, pool.num_tokens(sid) + 1))
            table = pool.allocator.block_table(sid)
            if keep == 0 or table[-(-keep // 8) - 1] != HOLE:  # not into what a window evicted
                pool.truncate(sid, keep)
        elif op == 5 and pool.allocator.num_free > 2:  # fork: the next append copies on write
            parent = live[int(rng.integers(len(live)))]
            pool.fork(parent, next_id)
            live.append(next_id)
            next_id += 1
        elif op == 6:
            sid = live[int(rng.integers(len(live)))]
            pool.evict(sid, window=int(rng.integers(1, 20)))
            if step % 50 == 0:
                pool.grow(4)  # the null block moves
        if live and rng.random() < 0.5:
            batch = list(rng.permutation(live)[: int(rng.integers(1, len(live) + 1))])
            batch = [int(s) for s in batch]
            rows, widths = mirror.rows(batch)
            tables, lens = pool.block_tables(batch)
            want = np.array(tables)
            got = mirror.tables(rows, widths)
            for i, s in enumerate(batch):  # entries past a sequence's blocks are never read
                n = len(pool.allocator.block_table(s))
                assert (got[i, :n] == want[i, :n]).all() and (got[i, n:] == pool.null_block).all()
            held = [s for s in batch if pool.num_tokens(s) and pool.allocator.block_table(s)[-1] != HOLE]
            if held:
                r, _ = mirror.rows(held)
                starts = np.array([pool.num_tokens(s) - 1 for s in held])
                slots = mirror.slots(r, starts, np.ones(len(held), dtype=np.int64))
                assert slots.tolist() == [int(pool.slots(s, n, n + 1)[0]) for s, n in zip(held, starts)]
