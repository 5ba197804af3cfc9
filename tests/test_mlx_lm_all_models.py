"""Every architecture of the installed mlx-lm under use_paged_cache (issue 40).

Support is derived from the model (what its make_cache builds, what its layers call), not
from a list: ``kvmetal.integrations.arch_sweep`` walks ``mlx_lm.models`` with pkgutil, builds
each architecture tiny and random from its own ``ModelArgs``, and compares the paged
cache's logits with mlx-lm's own over a prefill and 16 decode steps (float32, cpu backend),
greedy tokens, ``generate_step`` tokens and a K8/V4 run. A family mlx-lm adds is swept
without editing anything.

The first cases cover one architecture of each kind; the whole sweep (126 architectures
in mlx-lm 0.32.2) takes about a minute on 2 cores, so it is not marked slow.
docs/integration.md's table comes from the same sweep (``tools/model_coverage.py``) and is
checked against its JSON here.
"""
from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache  # noqa: E402

from kvmetal.integrations import arch_sweep, tiny_models  # noqa: E402
from kvmetal.integrations.mlx_lm import UnsupportedModel, analyse_model, use_paged_cache  # noqa: E402
from kvmetal.integrations.model_cache import PagedLayerCache  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
COVERAGE = ROOT / "bench" / "model_coverage.json"


@pytest.mark.parametrize("name", [
    "llama",         # dense
    "cohere2",       # window layers beside full ones, no longer on any list
    "mixtral",       # MoE: attention is its dense sibling's
    "qwen3_next",    # hybrid: gated delta-net layers keep mlx-lm's ArraysCache
    "falcon_h1",     # hybrid: attention and mamba in every layer (a CacheList)
    "llama4",        # chunked attention (ChunkedKVCache, chunk 16 here): the chunk rule on the kernels
])
def test_exact_against_mlx_lm(name):
    row = arch_sweep.check(name)
    assert row.status == "exact", row
    assert row.max_rel_diff <= arch_sweep.TOLERANCE and row.greedy_identical and row.generate_step_identical
    assert row.k8v4_finite and row.k8v4_top1 >= 0.5, row


@pytest.mark.parametrize("name,reason", [
    ("mamba", r"mamba: no layer keeps a K/V cache"),
    ("rwkv7", r"rwkv7: no layer keeps a K/V cache"),
    ("deepseek_v3", r"deepseek_v3 layer 0: K head_dim 32 and V head_dim 16 differ"),
    ("stablelm", r"stablelm layer 0: the keys/values it attends over are not the ones its cache returned"),
])
def test_refused_up_front_naming_the_layer(name, reason):
    model = arch_sweep.build(name)
    with pytest.raises(UnsupportedModel, match=r"^\[use_paged_cache\] " + reason):
        use_paged_cache(model)
    assert "make_cache" not in vars(model)  # nothing patched, no cache was made
    assert not any(isinstance(c, PagedLayerCache) for c in make_prompt_cache(model))


def test_head_dim_kvmetal_cannot_serve_is_refused_by_use_paged_cache():
    # head_dim 8 used to pass use_paged_cache and fail later, at make_prompt_cache.
    model = tiny_models.build("llama", head_dim=8)
    with pytest.raises(UnsupportedModel, match=r"^\[use_paged_cache\] llama layer 0: head_dim 8 is not one "):
        use_paged_cache(model)


@pytest.mark.parametrize("head_dim", [32, 48, 72])
def test_small_head_dims_are_served(head_dim):
    # head_dim 32 was refused (late) before issue 40; 48 and 72 too. Float32, cpu backend.
    model = tiny_models.build("llama", head_dim=head_dim)
    prompt = mx.array([list(range(3, 40))])
    expected = model(prompt, cache=make_prompt_cache(model))
    with use_paged_cache(model):
        got = model(prompt, cache=make_prompt_cache(model))
    assert float(mx.abs(got - expected).max() / mx.abs(expected).max()) < 1e-5


def test_attention_by_hand_is_refused():
    model = arch_sweep.build("plamo2")  # its attention layers compute scores on the fetched keys
    with pytest.raises(UnsupportedModel, match=r"plamo2 layer 1: it attends by hand over the keys"):
        use_paged_cache(model)


def test_gemma2_softcap_is_mapped_onto_kvmetal_and_matters(monkeypatch):
    row = arch_sweep.check("gemma2")  # the tiny config caps scores at 0.5, so the cap bites
    assert row.status == "exact" and row.paged_layers == 2, row
    from kvmetal.integrations import model_cache

    attention = model_cache.PagedLayerCache.attention
    monkeypatch.setattr(model_cache.PagedLayerCache, "attention",
                        lambda self, *a, softcap=None, **k: attention(self, *a, **k))  # drop the cap
    row = arch_sweep.check("gemma2")
    assert row.status == "broken" and row.max_rel_diff > 1e-2, row


def test_unknown_cache_type_is_refused():
    model = tiny_models.build("llama")

    class MyCache(KVCache):
        pass

    model.make_cache = lambda: [MyCache() for _ in model.layers]
    try:
        with pytest.raises(UnsupportedModel, match=r"llama layer 0: its cache is a MyCache, a cache type"):
            use_paged_cache(model)
    finally:
        del model.make_cache


def test_hybrid_keeps_mlx_lm_recurrent_caches_beside_paged_layers():
    model = arch_sweep.build("qwen3_next")
    layout = analyse_model(model)
    assert layout.native and layout.specs
    with use_paged_cache(model):
        cache = make_prompt_cache(model)
        kinds = [type(c) for c in cache]
        assert PagedLayerCache in kinds and ArraysCache in kinds
        assert [i for i, t in enumerate(layout.template) if t is None] == [i for i, k in enumerate(kinds)
                                                                           if k is ArraysCache]


def test_update_and_fetch_returns_everything_written_so_far():
    # mlx-lm's protocol (its own test_kv_cache): one row, then 256, fetches 257.
    model = tiny_models.build("llama")
    with use_paged_cache(model) as handle:
        cache = handle.make_cache()[0]
        rng = np.random.default_rng(0)
        first = [mx.array(rng.standard_normal((1, 2, 1, 64)).astype(np.float32)) for _ in range(2)]
        more = [mx.array(rng.standard_normal((1, 2, 256, 64)).astype(np.float32)) for _ in range(2)]
        cache.update_and_fetch(*first)
        keys, values = cache.update_and_fetch(*more)
        assert keys.shape == values.shape == (1, 2, 257, 64)
        np.testing.assert_array_equal(np.array(keys), np.concatenate([np.array(first[0]), np.array(more[0])], 2))
        np.testing.assert_array_equal(np.array(values), np.concatenate([np.array(first[1]), np.array(more[1])], 2))
        assert cache.offset == 257


def test_the_docs_table_is_the_sweeps():
    """docs/integration.md's coverage table is what tools/model_coverage.py made from the JSON,
    and the JSON accounts for every architecture installed with none broken."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("model_coverage", ROOT / "tools" / "model_coverage.py")
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)
    markdown_table, replace_section = tool.markdown_table, tool.replace_section
    import mlx_lm

    data = json.loads(COVERAGE.read_text())
    rows = data["rows"]
    names = [r["name"] for r in rows]
    if data["mlx_lm_version"] == mlx_lm.__version__:  # another release is swept live below
        assert sorted(names) == arch_sweep.architectures()
    assert not [r for r in rows if r["status"] == "broken"]
    doc = (ROOT / "docs" / "integration.md").read_text()
    assert replace_section(doc, markdown_table([arch_sweep.Row(**r) for r in rows])) == doc
    readme = (ROOT / "README.md").read_text()
    grouped = tool.readme_table([arch_sweep.Row(**r) for r in rows]).replace("{version}", data["mlx_lm_version"])
    assert replace_section(readme, grouped) == readme, "README's table is stale: python tools/model_coverage.py --from-json"


@pytest.mark.slow  # over 10 s here (tests/README.md)
def test_every_architecture_is_exact_refused_or_unbuilt():
    rows = arch_sweep.sweep()
    broken = [r for r in rows if r.status == "broken"]
    assert not broken, "\n".join(f"{r.name}: {r.reason}" for r in broken)
    for r in rows:
        if r.status == "refused":
            assert r.reason.startswith(r.name), r  # one line naming the architecture and layer
    exact = {r.name for r in rows if r.status == "exact"}
    assert {"llama", "qwen2", "qwen3", "phi3", "gemma3_text", "gpt_oss"} <= exact


@pytest.mark.parametrize("name", ["qwen3_next", "mixtral", "cohere2"])
def test_batch_generator_gives_mlx_lms_tokens_on_hybrid_moe_and_window_models(name):
    # mlx-lm's BatchGenerator merges, filters and extracts the prompt caches: the paged
    # layers as table operations, a hybrid's ArraysCache layers as mlx-lm does.
    from mlx_lm_cases import batch_generate

    model = arch_sweep.build(name)
    max_tokens = [9, 4, 30, 12, 7, 16]
    expected, _ = batch_generate(model, max_tokens)
    with use_paged_cache(model):
        got, caches = batch_generate(model, max_tokens)
        assert any(isinstance(c, PagedLayerCache) for c in caches[0])
    assert got == expected


def test_chunked_attention_runs_on_the_kernels_in_the_sweep():
    """llama4's chunked layers (chunk 16 here, blocks of 16) run the chunk rule on the
    kernels: the sweep's row has no gathered attention call (before issue 40's chunk rule:
    51, the model's chunk mask applied to gathered rows). tests/test_mlx_lm_chunked.py and
    tests/test_engine_llama4.py check it in depth."""
    model = arch_sweep.build("llama4")
    layout = analyse_model(model)
    assert layout.chunked == ["layer 0", "layer 1", "layer 2"]  # every 4th layer attends globally
    row = arch_sweep.check("llama4")
    assert row.status == "exact" and row.gathered_calls == 0, row

