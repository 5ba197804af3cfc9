"""Continuous batching: batched output equals one-at-a-time output, prefix sharing saves
blocks without changing tokens, finished requests free their blocks at once, and every
decode step makes one batched paged_attention call per layer."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402

from kvmetal import KVCacheFull  # noqa: E402
from kvmetal.integrations import model_cache, tiny_models  # noqa: E402
from kvmetal.integrations.engine import Engine  # noqa: E402


def one_at_a_time(model, prompt, max_tokens):
    """mlx-lm's own generation (its own cache), one sequence."""
    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens,
                                             sampler=lambda lp: mx.argmax(lp, axis=-1))]


def workload(seed=0, shared_len=40, n_shared=5, n_other=3):
    rng = np.random.default_rng(seed)
    shared = [int(t) for t in rng.integers(0, 512, shared_len)]
    prompts = [shared + [int(t) for t in rng.integers(0, 512, rng.integers(1, 30))] for _ in range(n_shared)]
    prompts += [[int(t) for t in rng.integers(0, 512, rng.integers(1, 50))] for _ in range(n_other)]
    max_tokens = [int(m) for m in rng.integers(1, 40, len(prompts))]
    return prompts, max_tokens


@pytest.fixture(scope="module", params=["llama", "gemma3_text"])
def model_and_expected(request):
    model = tiny_models.build(request.param, dtype=mx.float32)
    prompts, max_tokens = workload()
    expected = [one_at_a_time(model, p, m) for p, m in zip(prompts, max_tokens)]
    return model, prompts, max_tokens, expected


def test_batched_equals_one_at_a_time_with_staggered_joins(model_and_expected):
    model, prompts, max_tokens, expected = model_and_expected
    with Engine(model) as engine:
        ids, outputs = [], {}
        pending = list(zip(prompts, max_tokens))
        step = 0
        while pending or engine.has_work():
            if pending and step % 3 == 0:  # a request joins every third step
                prompt, m = pending.pop(0)
                ids.append(engine.add_request(prompt, max_tokens=m))
            for event in engine.step():
                outputs.setdefault(event.request_id, []).append(event.token)
            step += 1
        assert engine.decode_steps > 0
    assert [outputs[i] for i in ids] == expected


def test_prefix_sharing_keeps_tokens_and_uses_fewer_blocks(model_and_expected):
    model, prompts, max_tokens, expected = model_and_expected
    runs = {}
    for sharing in (True, False):
        with Engine(model, prefix_sharing=sharing) as engine:
            outputs = engine.run(prompts, max_tokens)
            runs[sharing] = (outputs, engine.peak_used_bytes, engine.prompt_tokens_computed,
                             engine.cache.stats()["prefix_hit_blocks"])
    assert runs[True][0] == expected and runs[False][0] == expected
    assert runs[True][1] < runs[False][1], "sharing must lower the peak of owned blocks"
    assert runs[True][2] < runs[False][2], "shared prefixes are not recomputed"
    assert runs[True][3] >= 4 and runs[False][3] == 0  # 5 prompts share 2 full blocks (40 tokens)


def test_tight_pool_preempts_and_recomputes_without_changing_tokens(model_and_expected):
    # The pool cannot hold every request at once: requests wait, and running ones are
    # preempted (freed, recomputed later). Output must not change.
    model, prompts, max_tokens, expected = model_and_expected
    with Engine(model, num_blocks=12) as engine:
        assert engine.run(prompts, max_tokens) == expected
        assert engine.preemptions > 0
        assert engine.cache.nbytes == sum(p.nbytes for p in engine.cache.pools)
        assert all(p.allocator.num_blocks == 12 for p in engine.cache.pools)  # a fixed pool never grows


def test_one_batched_paged_attention_call_per_layer_per_decode_step(monkeypatch):
    model = tiny_models.build("llama")
    calls = []
    real = model_cache.ops.paged_attention

    def counting(query, *args, **kwargs):
        calls.append(query.shape[0])
        return real(query, *args, **kwargs)

    monkeypatch.setattr(model_cache.ops, "paged_attention", counting)
    with Engine(model) as engine:
        for prompt in ([1, 2, 3], [4, 5, 6, 7, 8], [9] * 20, [10, 11]):
            engine.add_request(prompt, max_tokens=6)
        engine.step()  # admits all four (prefill: no paged_attention), then one decode step
        num_layers = len(model.layers)
        assert calls == [4] * num_layers
        calls.clear()
        engine.step()
        assert calls == [4] * num_layers


def test_finished_requests_free_their_blocks_at_once():
    model = tiny_models.build("llama")
    with Engine(model, block_size=16) as engine:
        short = engine.add_request(list(range(40)), max_tokens=2)
        long = engine.add_request(list(range(100, 140)), max_tokens=10)
        engine.step()  # prefill both (token 1), decode both (token 2): short is done
        pool = engine.cache.pools[0]
        assert short not in pool and long in pool
        assert engine.cache.stats()["used_blocks"] == 3  # only the long request's 41 tokens
        while engine.has_work():
            engine.step()
        assert engine.cache.stats()["used_blocks"] == 0
        assert len(engine.requests[long].output) == 10


def test_prompt_larger_than_the_pool_raises_kv_cache_full():
    model = tiny_models.build("llama")
    with Engine(model, num_blocks=2, block_size=16) as engine:
        engine.add_request(list(range(40)), max_tokens=2)
        with pytest.raises(KVCacheFull, match=r"\[Engine\] request 0 needs more blocks than the whole pool"):
            engine.step()


def test_bad_requests_raise():
    model = tiny_models.build("llama")
    with Engine(model) as engine:
        with pytest.raises(ValueError, match=r"\[Engine.add_request\] prompt"):
            engine.add_request([], max_tokens=1)
        with pytest.raises(ValueError, match=r"\[Engine.add_request\] max_tokens"):
            engine.add_request([1], max_tokens=0)
        engine.add_request([1], max_tokens=1, request_id="a")
        with pytest.raises(ValueError, match=r"already in use"):
            engine.add_request([1], max_tokens=1, request_id="a")
    assert "make_cache" not in vars(model)  # closing the engine restored the model
