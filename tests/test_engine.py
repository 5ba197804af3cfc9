"""Continuous batching: batched output equals one-at-a-time output, prefix sharing saves
blocks without changing tokens, finished requests free their blocks at once, and every
step is one forward pass: one batched attention call per layer."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402

from kvmetal.integrations import model_cache, tiny_models  # noqa: E402
from kvmetal.engine.engine import Engine, RequestTooLarge, SamplingParams  # noqa: E402


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


def test_attention_calls_per_layer_per_step(monkeypatch):
    model = tiny_models.build("llama")
    calls = []
    for name in ("paged_attention", "paged_attention_varlen"):
        real = getattr(model_cache.ops, name)
        monkeypatch.setattr(model_cache.ops, name,
                            lambda query, *a, _real=real, _name=name, **k: calls.append((_name, query.shape[0]))
                            or _real(query, *a, **k))
    num_layers = len(model.layers)
    with Engine(model) as engine:
        prompts = (list(range(1, 10)), list(range(20, 32)), [9] * 20, list(range(40, 50)))
        for prompt in prompts:
            engine.add_request(prompt, max_tokens=6)
        engine.step()  # all four prompts in one ragged pass: one varlen call per layer over every row
        assert calls == [("paged_attention_varlen", sum(map(len, prompts)))] * num_layers
        calls.clear()
        engine.step()  # decodes only: the decode kernel, one batched call per layer
        assert calls == [("paged_attention", 4)] * num_layers
        calls.clear()
        engine.add_request(list(range(60, 75)), max_tokens=3)
        engine.step()  # four decodes and a 15-token prompt: still one pass; per layer the decode rows
        # take the decode kernel, as in a step of decodes only, and the prompt rows the varlen one
        # (issue 35: a token's arithmetic must not depend on what shares its pass)
        assert calls == [("paged_attention", 4), ("paged_attention_varlen", 15)] * num_layers


def test_finished_requests_free_their_blocks_at_once():
    model = tiny_models.build("llama")
    with Engine(model, block_size=16) as engine:
        short = engine.add_request(list(range(40)), max_tokens=2)
        long = engine.add_request(list(range(100, 140)), max_tokens=10)
        engine.step()  # prefill both (token 1)
        engine.step()  # decode both (token 2): short is done
        pool = engine.cache.pools[0]
        assert short not in pool and long in pool
        assert engine.cache.stats()["used_blocks"] == 3  # only the long request's 41 tokens
        while engine.has_work():
            engine.step()
        assert engine.cache.stats()["used_blocks"] == 0
        assert len(engine.requests[long].output) == 10


def test_prompt_larger_than_the_pool_is_rejected_at_add_request_and_others_still_run():
    # issue 10 item 8: a 59-token prompt in 4 blocks of 8 used to wedge every later step.
    model = tiny_models.build("llama")
    with Engine(model, block_size=8, num_blocks=4) as engine:
        with pytest.raises(RequestTooLarge, match=r"59 tokens needs 8 blocks of 8, but the whole pool holds 4 "
                                                  r"blocks \(32 tokens\)") as info:
            engine.add_request(list(range(59)), max_tokens=2)
        assert (info.value.requested, info.value.fits) == (59, 32)
        assert isinstance(info.value, ValueError) and not engine.has_work()
        rid = engine.add_request(list(range(5)), max_tokens=3)
        while engine.has_work():
            engine.step()
        assert engine.requests[rid].finish_reason == "length" and len(engine.requests[rid].output) == 3


def test_request_outgrowing_the_pool_mid_decode_ends_with_length_while_others_run():
    # issue 10 item 8: prompt + max_tokens beyond the whole pool; a short request beside it.
    model = tiny_models.build("llama")
    long_prompt, short_prompt = list(range(1, 21)), list(range(100, 104))
    expected_short = one_at_a_time(model, short_prompt, 6)
    expected_long = one_at_a_time(model, long_prompt, 13)
    with Engine(model, block_size=8, num_blocks=4) as engine:  # 32 tokens in all
        long = engine.add_request(long_prompt, max_tokens=100)
        short = engine.add_request(short_prompt, max_tokens=6)
        outputs, reasons = {}, {}
        for _ in range(200):
            if not engine.has_work():
                break
            for event in engine.step():
                if event.token is not None:
                    outputs.setdefault(event.request_id, []).append(event.token)
                if event.finished:
                    reasons[event.request_id] = event.finish_reason
        assert not engine.has_work(), "the engine wedged"
        assert reasons == {long: "length", short: "length"}
        assert outputs[short] == expected_short
        # The cache holds 32 = 20 prompt + 12 output tokens, which give the 13th; no room after.
        assert outputs[long] == expected_long
        assert engine.cache.stats()["used_blocks"] == 0


def test_auto_request_ids_skip_ids_a_caller_took():
    # issue 10 item 7
    model = tiny_models.build("llama")
    with Engine(model) as engine:
        assert engine.add_request([1, 2], max_tokens=2, request_id=0) == 0
        assert engine.add_request([3, 4], max_tokens=2, request_id=2) == 2
        assert engine.add_request([5], max_tokens=2) == 1
        assert engine.add_request([6], max_tokens=2) == 3
        assert engine.run([[7]], 2) and sorted(engine.requests) == [0, 1, 2, 3, 4]


def test_engine_used_after_close_raises():
    # issue 10 item 9: after close() the model is unpatched, so running would be wrong.
    model = tiny_models.build("llama")
    engine = Engine(model)
    engine.add_request([1, 2, 3], max_tokens=4)
    engine.close()
    for call in (engine.step, lambda: engine.add_request([1], max_tokens=1), lambda: engine.run([[1]], 1),
                 lambda: engine.abort(0)):
        with pytest.raises(RuntimeError, match=r"closed"):
            call()


def test_max_tokens_must_be_a_real_int():
    # issue 10 item 12: True is an int subclass, and used to mean 1.
    model = tiny_models.build("llama")
    with Engine(model) as engine:
        for bad in (True, False, 2.0, "3", None):  # a wrong type
            with pytest.raises(TypeError, match=r"max_tokens must be an int >= 1"):
                engine.add_request([1], max_tokens=bad)
        with pytest.raises(ValueError, match=r"max_tokens must be an int >= 1"):  # a wrong value
            engine.add_request([1], max_tokens=-1)
        assert not engine.has_work()


def test_stop_tokens_abort_and_finish_reasons():
    model = tiny_models.build("llama")
    prompt = [5, 6, 7, 8]
    expected = one_at_a_time(model, prompt, 8)
    with Engine(model, keep_finished=False) as engine:
        stop = engine.add_request(prompt, max_tokens=8, stop_token_ids=[expected[3]])
        gone = engine.add_request(list(range(40)), max_tokens=50)
        events = engine.step()
        assert engine.abort(gone) and not engine.abort(gone)
        assert gone not in engine.cache.pools[0]
        while engine.has_work():
            events += engine.step()
        stop_events = [e for e in events if e.request_id == stop]
        first = expected.index(expected[3])
        assert [e.token for e in stop_events] == expected[: first + 1]
        assert stop_events[-1].finish_reason == "stop" and stop_events[-1].finished
        assert engine.requests == {} and engine.cache.stats()["used_blocks"] == 0


def test_seeded_sampling_does_not_depend_on_batching_or_preemption():
    model = tiny_models.build("llama")
    params = SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=1234)
    prompts = [list(range(i, i + 10 + 3 * i)) for i in range(6)]
    with Engine(model) as engine:
        rid = engine.add_request(prompts[0], max_tokens=20, sampling=params)
        while engine.has_work():
            engine.step()
        alone = engine.requests[rid].output
    with Engine(model, num_blocks=6) as engine:  # tight: preempts
        ids = [engine.add_request(p, max_tokens=20, sampling=params if i == 0 else None)
               for i, p in enumerate(prompts)]
        while engine.has_work():
            engine.step()
        assert engine.preemptions > 0
        assert engine.requests[ids[0]].output == alone
    with Engine(model) as engine:
        other = engine.add_request(prompts[0], max_tokens=20, sampling=SamplingParams(temperature=0.8, seed=99))
        while engine.has_work():
            engine.step()
        assert engine.requests[other].output != alone
    with pytest.raises(ValueError, match=r"top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(TypeError, match=r"seed"):
        SamplingParams(seed=1.5)


def test_bad_requests_raise():
    model = tiny_models.build("llama")
    with Engine(model) as engine:
        with pytest.raises(ValueError, match=r"\[Engine.add_request\] prompt"):
            engine.add_request([], max_tokens=1)
        with pytest.raises(ValueError, match=r"\[Engine.add_request\] max_tokens"):
            engine.add_request([1], max_tokens=0)
        for bad, error in (([1, -2], ValueError), ([1.5], TypeError), ([True], TypeError), (["3"], TypeError),
                           ([512], ValueError)):  # the tiny model's vocabulary is 512
            with pytest.raises(error, match=r"prompt token ids must be ints >= 0 and < 512"):
                engine.add_request(bad, max_tokens=1)
        assert engine.add_request(np.array([1, 511]), max_tokens=1) is not None
        engine.add_request([1], max_tokens=1, request_id="a")
        with pytest.raises(ValueError, match=r"already in use"):
            engine.add_request([1], max_tokens=1, request_id="a")
    assert "make_cache" not in vars(model)  # closing the engine restored the model


def test_quantized_sliding_window_layers_release_blocks_in_a_fixed_pool():
    # gemma3_text: window layers (24 tokens) and full layers, both K8/V4, in a fixed pool.
    from kvmetal.quant import QuantizedKV

    model = tiny_models.build("gemma3_text")
    prompt, max_tokens = list(range(1, 30)), 40
    with Engine(model, block_size=8, k_bits=8, v_bits=4) as roomy:
        expected = roomy.run([prompt], max_tokens)[0]
    with Engine(model, block_size=8, num_blocks=12, k_bits=8, v_bits=4) as engine:
        [window_pool] = [p for p, w in zip(engine.cache.pools, engine.cache.windows) if w is not None]
        [full_pool] = [p for p, w in zip(engine.cache.pools, engine.cache.windows) if w is None]
        assert isinstance(window_pool.key_caches[0], QuantizedKV) and isinstance(full_pool.value_caches[0], QuantizedKV)
        rid = engine.add_request(prompt, max_tokens=max_tokens)
        held = []
        while engine.has_work():
            engine.step()
            if rid in window_pool:
                held.append((len([b for b in window_pool.allocator.block_table(rid) if b >= 0]),
                             len(full_pool.allocator.block_table(rid))))
        assert engine.requests[rid].output == expected
    # The full layers keep every block (69 tokens: 9); the window layers keep about window / block_size.
    assert max(f for _, f in held) == 9
    assert max(w for w, _ in held[3:]) <= 24 // 8 + 3 and held[-1][0] < held[-1][1]


def test_token_budget_chunks_prompts_over_steps_without_changing_tokens():
    model = tiny_models.build("llama")
    prompts = [list(range(i * 50, i * 50 + 40)) for i in range(4)]
    expected = [one_at_a_time(model, p, 6) for p in prompts]
    with Engine(model, max_num_batched_tokens=50) as engine:
        ids = [engine.add_request(p, max_tokens=6) for p in prompts]
        running, sizes = [], []
        while engine.has_work():
            engine.step()
            running.append(sum(r.decoding for r in engine.running))
            sizes.append(engine.last_step_tokens)
        assert max(sizes) <= 50 and sizes[0] == 50  # 40 + a 10-token chunk of the second prompt
        assert running[:4] == [1, 2, 3, 4]  # decodes go on while the next prompt is chunked in
        assert [engine.requests[i].output for i in ids] == expected
    with pytest.raises(ValueError, match=r"max_num_batched_tokens"):
        Engine(model, max_num_batched_tokens=0)


def test_a_rejected_engine_leaves_the_model_unpatched():
    model = tiny_models.build("llama")
    with pytest.raises(ValueError, match=r"max_num_batched_tokens"):
        Engine(model, max_num_batched_tokens=0)
    assert "make_cache" not in vars(model)  # no instance patch left behind
    with Engine(model) as engine:  # a later patch of the same model works
        engine.close()  # closing twice (here and on exit) undoes once
    assert "make_cache" not in vars(model)


def test_each_request_applies_its_own_logits_processors_and_reports_real_logprobs():
    # Penalised, biased and plain greedy requests decode in one batch, through preemption;
    # each must match mlx-lm's generate_step with the same processors alone.
    from mlx_lm.sample_utils import make_logits_processors

    model = tiny_models.build("llama")
    prompts = [list(range(i, i + 12 + 5 * i)) for i in range(4)]
    settings = [dict(repetition_penalty=1.6, repetition_context_size=6),
                dict(presence_penalty=0.8, frequency_penalty=0.4, frequency_context_size=0),
                dict(logit_bias={7: 2.5, 300: -1.0}),
                {}]
    expected = [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=16,
                                                   sampler=lambda lp: mx.argmax(lp, -1),
                                                   logits_processors=make_logits_processors(**s))]
                for p, s in zip(prompts, settings)]
    assert len({tuple(e) for e in expected}) == len(expected)
    with Engine(model, num_blocks=5) as engine:  # tight: preempts and recomputes
        ids = [engine.add_request(p, max_tokens=16, sampling=SamplingParams(**s), logprobs=3)
               for p, s in zip(prompts, settings)]
        events = []
        while engine.has_work():
            events += engine.step()
        assert engine.preemptions > 0
        assert [engine.requests[i].output for i in ids] == expected
    # logprobs: the processed logits' log-softmax, recomputed here in float64 without the cache
    for rid, prompt, s in zip(ids, prompts, settings):
        mine = [e for e in events if e.request_id == rid]
        output = [e.token for e in mine]
        logits = model(mx.array(prompt + output)[None])[:, len(prompt) - 1:-1]
        processors = make_logits_processors(**s)
        for k, event in enumerate(mine):
            row = logits[:, k]
            for processor in processors:
                row = processor(mx.array(prompt + output[:k]), row)
            row = np.array(row[0], dtype=np.float64)
            row = row - row.max() - np.log(np.exp(row - row.max()).sum())
            top = np.argsort(-row)[:3]
            assert event.logprobs.logprob == pytest.approx(row[event.token], abs=1e-4)
            assert [t for t, _ in event.logprobs.top] == list(top) and top[0] == event.token
            assert [v for _, v in event.logprobs.top] == pytest.approx(list(row[top]), abs=1e-4)


def test_sampling_params_validate_and_survive_json():
    import dataclasses
    import json

    from kvmetal.serve.distributed import decode_add, encode_add

    params = SamplingParams(temperature=0.5, seed=3, logit_bias={"5": 1, 2: -0.5}, presence_penalty=-0.5,
                            xtc_probability=0.3, xtc_special_tokens=[4])
    assert params.logit_bias == ((2, -0.5), (5, 1.0)) and params.xtc_special_tokens == (4,)
    command = json.loads(json.dumps(encode_add("r", dict(prompt=[1, 2], max_tokens=3, sampling=params,
                                                         stop_token_ids={9}, logprobs=2))))
    decoded = decode_add(command[2])
    assert decoded["sampling"] == params and decoded["logprobs"] == 2
    assert dataclasses.asdict(decoded["sampling"]) == dataclasses.asdict(params)
    for bad, error, match in ((dict(repetition_penalty=-1), ValueError, "repetition_penalty"),
                              (dict(frequency_penalty=float("nan")), ValueError, "frequency_penalty"),
                              (dict(presence_context_size=1.5), TypeError, "presence_context_size"),
                              (dict(logit_bias={"a": 1}), ValueError, "logit_bias"),
                              (dict(logit_bias={1: "x"}), TypeError, "logit_bias"),
                              (dict(xtc_threshold=0.7), ValueError, "xtc_threshold")):
        with pytest.raises(error, match=match):
            SamplingParams(**bad)
    model = tiny_models.build("llama")
    with Engine(model) as engine:
        with pytest.raises(ValueError, match=r"logit_bias token ids must be < 512"):
            engine.add_request([1], max_tokens=1, sampling=SamplingParams(logit_bias={512: 1.0}))
        with pytest.raises(TypeError, match=r"logprobs"):
            engine.add_request([1], max_tokens=1, logprobs=True)
        with pytest.raises(ValueError, match=r"logprobs"):
            engine.add_request([1], max_tokens=1, logprobs=-1)


def test_prompts_as_arrays_are_token_ids_and_text_is_refused():
    model = tiny_models.build("llama")
    with Engine(model) as engine:
        a = engine.add_request(mx.array([5, 6, 7]), max_tokens=3)
        b = engine.add_request(np.array([5, 6, 7]), max_tokens=3)
        c = engine.add_request([5, 6, 7], max_tokens=3)
        while engine.has_work():
            engine.step()
        assert engine.requests[a].output == engine.requests[b].output == engine.requests[c].output
        with pytest.raises(TypeError, match=r"prompt must be a sequence of token ids"):
            engine.add_request("hello", max_tokens=3)
        with pytest.raises(ValueError, match=r"prompt must be 1-D token ids"):
            engine.add_request(mx.array([[5, 6]]), max_tokens=3)


def test_requests_end_at_the_tokenizers_eos_by_default():
    """Issue 35: docs/integration.md's Engine example never stopped (no stop tokens by
    default); with the tokenizer given, its EOS tokens end a request that names none."""
    model = tiny_models.build("llama")
    prompt = list(range(1, 12))
    with Engine(model) as engine:
        first = engine.run([prompt], 3)[0]
    eos = first[1]

    class Tokenizer:
        eos_token_ids = {eos}

    with Engine(model, tokenizer=Tokenizer()) as engine:
        assert engine.eos_token_ids == frozenset({eos})
        rid = engine.add_request(prompt, max_tokens=3)
        events = [e for _ in range(6) for e in engine.step() if e.request_id == rid]
        assert [e.token for e in events] == first[:first.index(eos) + 1] and events[-1].finish_reason == "stop"
        other = engine.add_request(prompt, max_tokens=3, stop_token_ids=())  # () asks for none
        assert engine.run([], 1) == [] and engine.requests[other].stop_token_ids == frozenset()
