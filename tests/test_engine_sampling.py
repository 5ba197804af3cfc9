"""Engine sampling against mlx-lm's rule, statistically: the first tokens of many seeded
requests vs the exact distribution computed here from the model's logits
(tests/sampling_oracle.py). Mutants of the sampler (inverted temperature, top-p dropped)
must fail the same checks."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")

from kvmetal.engine import sampler as sampler_module  # noqa: E402
from kvmetal.integrations import tiny_models  # noqa: E402
from kvmetal.engine.engine import Engine, SamplingParams  # noqa: E402
from sampling_oracle import (ARGMAX_CONFIGS, CONFIGS, DRAWS, assert_matches_distribution,  # noqa: E402
                             check_mlx_lm_filters_agree, first_token_logits, mlx_lm_distribution,
                             peak_lm_head, target_logits)

PROMPT = [17, 301, 42, 99, 5, 250, 7]
CANDIDATES = (11, 402, 3, 77, 260, 150, 499, 38)  # scattered ids: no order the sampler could lean on


@pytest.fixture(scope="module")
def peaked():
    model = tiny_models.build("llama", dtype=mx.float32, seed=4)
    peak_lm_head(model, PROMPT, target_logits(model.args.vocab_size, CANDIDATES))
    logits = first_token_logits(model, PROMPT)
    assert np.argsort(-logits)[:len(CANDIDATES)].tolist() == list(CANDIDATES)
    return model, logits


def first_tokens(model, params: dict, draws: int = DRAWS) -> list:
    """The first token of ``draws`` requests for PROMPT, seeds 0..draws-1, one batch."""
    with Engine(model) as engine:
        ids = [engine.add_request(PROMPT, max_tokens=1, sampling=SamplingParams(seed=s, **params))
               for s in range(draws)]
        tokens = {}
        while engine.has_work():
            for event in engine.step():
                if event.token is not None:
                    tokens[event.request_id] = event.token
    return [tokens[i] for i in ids]


@pytest.mark.parametrize("name,params", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_first_token_follows_mlx_lm_sampling(peaked, name, params):
    model, logits = peaked
    filters = {k: v for k, v in params.items() if k != "temperature"}
    check_mlx_lm_filters_agree(logits, **filters)
    assert_matches_distribution(first_tokens(model, params), mlx_lm_distribution(logits, **params))


@pytest.mark.parametrize("name,params", ARGMAX_CONFIGS, ids=[c[0] for c in ARGMAX_CONFIGS])
def test_argmax_limits(peaked, name, params):
    model, logits = peaked
    assert set(first_tokens(model, params, draws=100)) == {int(np.argmax(logits))}


def _inverted_temperature(logits, sampling, key):
    """The mutant the review found passing every test: logprobs * T instead of / T."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    logprobs = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[None]
    if 0 < sampling.top_p < 1:
        logprobs = apply_top_p(logprobs, sampling.top_p)
    if sampling.min_p > 0:
        logprobs = apply_min_p(logprobs, sampling.min_p)
    if 0 < sampling.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, sampling.top_k)
    return mx.random.categorical(logprobs * sampling.temperature, key=key)[0]


def _no_top_p(logits, sampling, key):
    """The other mutant: top-p silently ignored."""
    from dataclasses import replace

    return ORIGINAL_SAMPLE_ROW(logits, replace(sampling, top_p=1.0), key)


ORIGINAL_SAMPLE_ROW = sampler_module._sample_row


@pytest.mark.parametrize("mutant,name", [(_inverted_temperature, "t0.5"), (_no_top_p, "t0.7+top_p+min_p")],
                         ids=["inverted-temperature", "no-top-p"])
def test_sampler_mutants_fail_the_check(peaked, monkeypatch, mutant, name):
    """A test of the test: a sampler that inverts the temperature or drops top-p is caught."""
    model, logits = peaked
    params = dict(CONFIGS)[name]
    monkeypatch.setattr(sampler_module, "_sample_row", mutant)
    with pytest.raises(AssertionError, match="chi-square|removes"):
        assert_matches_distribution(first_tokens(model, params), mlx_lm_distribution(logits, **params))


def test_sampling_params_take_the_seeds_mlx_takes():
    """Issue 44: generate and serve refused seed -1 and 2**64, the Python API took them and failed
    later inside MLX with nanobind's text."""
    assert SamplingParams(seed=0).seed == 0 and SamplingParams(seed=2**64 - 1).seed == 2**64 - 1
    for bad in (-1, 2**64, 2**70):
        with pytest.raises(ValueError, match=r"seed must be an integer in \[0, 2\*\*64 - 1\]"):
            SamplingParams(seed=bad)
    with pytest.raises(TypeError, match="seed"):
        SamplingParams(seed=1.5)
