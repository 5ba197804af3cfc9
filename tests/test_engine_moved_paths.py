"""The engine left kvmetal/integrations/ for kvmetal/engine/, the generate and demo commands
for kvmetal/commands/ (issue 43): their old module paths still import, and are the new
modules under their old names, so a monkeypatch through an old path reaches the code that
runs."""
import importlib

import pytest

pytest.importorskip("mlx_lm")

MOVED = {"engine": "engine.engine", "scheduler": "engine.scheduler", "forward": "engine.runner",
         "sampler": "engine.sampler", "request": "engine.request", "draft_model": "engine.proposers",
         "generate": "commands.generate", "demo": "commands.demo"}


@pytest.mark.parametrize("old", sorted(MOVED))
def test_an_old_engine_path_is_the_new_module(old):
    assert importlib.import_module(f"kvmetal.integrations.{old}") is \
        importlib.import_module(f"kvmetal.{MOVED[old]}")


def test_old_names_import_from_old_paths():
    from kvmetal.engine.engine import Engine as NewEngine
    from kvmetal.integrations.draft_model import ModelDrafter
    from kvmetal.integrations.engine import DEFAULT_MAX_NUM_BATCHED_TOKENS, Engine, RequestTooLarge, SamplingParams
    from kvmetal.integrations.forward import Forward, Flight
    from kvmetal.integrations.request import Event, Request
    from kvmetal.integrations.sampler import SamplingParams as Params, TokenLogprobs, greedy
    from kvmetal.integrations.scheduler import MIN_PREFILL_CHUNK, POLICIES, prompt_chunk
    from kvmetal.integrations.speculative import (MAX_DRAFT_TOKENS, DraftState, SpeculativeConfig, Verification,
                                                  ngram_draft, residual_logits, verify)

    from kvmetal.integrations.generate import UserError, distributed_group, kv_options, main, resolve_model

    assert Engine is NewEngine and Params is SamplingParams
    assert ngram_draft([1, 2, 3, 1, 2], ngram_max=2, ngram_min=2, num_tokens=1) == [3]


def test_a_monkeypatch_through_the_split_speculative_path_reaches_the_sampler(monkeypatch):
    from kvmetal.engine import proposers, sampler
    from kvmetal.integrations import speculative

    def fake(scaled, drafted):
        return scaled

    monkeypatch.setattr(speculative, "residual_logits", fake)
    assert sampler.residual_logits is fake and speculative.residual_logits is fake
    monkeypatch.setattr(speculative, "MAX_DRAFT_TOKENS", 3)
    assert proposers.MAX_DRAFT_TOKENS == 3
    monkeypatch.undo()
    assert sampler.residual_logits is not fake and proposers.MAX_DRAFT_TOKENS == 7
    with pytest.raises(AttributeError):
        speculative.no_such_name
