"""The mlx-lm drop-in on the metal backend's own kernel calls (run by the simulator).

On a Mac the integration picks the metal backend by default; here the same Python path
runs with its kernels simulated, so the calls a Mac makes (prefill gather, cache writes,
batched decode with windows and sinks) are exercised end to end.
"""
from __future__ import annotations

import mlx.core as mx
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.generate import generate_step  # noqa: E402

import kvmetal as kv  # noqa: E402
from kvmetal import sim  # noqa: E402
from kvmetal.integrations import tiny_models  # noqa: E402
from kvmetal.integrations.mlx_lm import use_paged_cache  # noqa: E402

STEPS = 6
PROMPT = list(range(5, 35))  # 30 tokens: crosses a block boundary at block size 16


def greedy(model, steps=STEPS):
    return [int(t) for t, _ in generate_step(mx.array(PROMPT), model, max_tokens=steps,
                                              sampler=lambda lp: mx.argmax(lp, axis=-1))]


@pytest.mark.parametrize("family", ["llama", "gemma3_text", "gpt_oss"])
def test_greedy_tokens_on_simulated_metal_kernels(family):
    model = tiny_models.build(family, dtype=mx.float32, seed=0)
    expected = greedy(model)
    with kv.use_backend("sim"), use_paged_cache(model, block_size=16), sim.trace() as trace:
        got = greedy(model)
    assert got == expected
    names = [call.name for call in trace.calls]
    assert any("paged_attention_partials" in n for n in names) and any("cache_rows" in n for n in names), names


def test_quantized_cache_on_simulated_metal_kernels_matches_cpu_backend():
    model = tiny_models.build("llama", dtype=mx.float16, seed=0)
    with kv.use_backend("cpu"), use_paged_cache(model, block_size=16, k_bits=8, v_bits=4):
        on_cpu = greedy(model)
    with kv.use_backend("sim"), use_paged_cache(model, block_size=16, k_bits=8, v_bits=4):
        on_sim = greedy(model)
    assert on_sim == on_cpu
