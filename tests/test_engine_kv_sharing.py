"""The Engine and ``kvmetal generate`` on K/V sharing (issue 40): gemma3n as shipped (4
layers, the last 2 attend over the rows of layers 0 and 1, read with keys_and_values()),
tiny and random (arch_sweep). Greedy tokens equal mlx-lm's own generation of each prompt
alone, whatever the batch, prefill chunking or preemption; every attention call runs on a
pool. afm7's K/V reuse (its reuse layer passes no cache and takes its positions from the
number of rows read) is refused by the Engine up front: a ragged pass has one row per token."""
from __future__ import annotations

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.models.cache import make_prompt_cache  # noqa: E402

from kvmetal.engine.engine import Engine  # noqa: E402
from kvmetal.integrations import arch_sweep  # noqa: E402
from kvmetal.integrations.mlx_lm import UnsupportedModel, use_paged_cache  # noqa: E402

from mlx_lm_cases import TinyGreedy  # noqa: E402

PROMPTS = [list(range(3, 60)), [7, 1, 9, 4, 4], list(range(100, 141))]  # 57, 5 and 41 tokens: past the window 24
STEPS = 20
_CASE = TinyGreedy("gemma3n", STEPS)  # the tiny model and mlx-lm's greedy tokens, each built once
model, expected = _CASE.model, _CASE.expected


@pytest.mark.parametrize("options", [dict(block_size=8), dict(async_steps=True, max_num_batched_tokens=16),
                                     dict(num_blocks=14, block_size=8)], ids=["batched", "chunked-async", "preempt"])
def test_gemma3n_greedy_tokens_equal_mlx_lm_alone(options):
    with Engine(model(), **options) as engine:
        assert [s.read for s in engine.handle.specs] == ["cache", "cache"]
        got = engine.run(PROMPTS, STEPS)
        assert engine.cache.gathered_attention == 0
        if "num_blocks" in options:
            assert engine.preemptions > 0
    assert got == [expected(p) for p in PROMPTS]
    assert len({tuple(t) for t in got}) > 1  # the prompts are told apart (not a constant model)


def test_a_ragged_pass_of_gemma3n_gives_mlx_lms_logits():
    # One ragged prefill pass (a row per token): the shared layers' reads are this pass's rows,
    # their attention runs over the owners' pools with the pass's plan.
    m = model()
    prompt = list(range(3, 40))
    reference = m(mx.array([prompt]), cache=make_prompt_cache(m))[0]  # (no cache: no sharing, another model)
    with use_paged_cache(m) as handle:
        cache = handle.new_model_cache()
        cache.add_sequence(0, num_tokens=len(prompt))
        got = m(mx.array(prompt)[:, None], cache=cache.ragged_layer_caches([0], [0], [len(prompt)]))[:, 0]
    assert float(mx.abs(got - reference).max() / mx.abs(reference).max()) < arch_sweep.TOLERANCE


def test_afm7_kv_reuse_is_refused_by_the_engine_up_front():
    m = arch_sweep.build("afm7")
    with pytest.raises(UnsupportedModel, match=r"^\[use_paged_cache\] afm7 layer 0: a layer attends over its rows "
                                               r"read with keys_and_values\(\) through an attention call that "
                                               r"passes no cache"):
        Engine(m)
    assert "make_cache" not in vars(m)  # the patch was undone
    with use_paged_cache(m):  # use_paged_cache itself serves it (tests/test_mlx_lm_all_models.py)
        pass


def test_kvmetal_generate_runs_a_saved_gemma3n(tmp_path, capsys):
    from mlx_lm import load, stream_generate

    from kvmetal import cli
    from kvmetal.serve.tiny import build_arch_dir

    path = build_arch_dir(tmp_path / "gemma3n", "gemma3n")
    prompt = "What is the capital of France? Write a short poem about the sea."
    m, tokenizer = load(str(path))
    ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True)
    assert len(ids) > 24  # past the sliding window
    answer = "".join(r.text for r in stream_generate(m, tokenizer, ids, max_tokens=12))
    assert answer.strip()
    assert cli.main(["generate", "-m", str(path), "-p", prompt, "--max-tokens", "12"]) == 0
    assert capsys.readouterr().out == answer + "\n"
