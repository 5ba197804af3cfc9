"""Every architecture of the installed mlx-lm under use_paged_cache (issue 40).

Support is derived from the model (what its make_cache builds, what its layers call), not
from a list: ``kvmetal.integrations.arch_sweep`` walks ``mlx_lm.models`` with pkgutil, builds
each architecture tiny and random from its own ``ModelArgs``, and compares the paged
cache's logits with mlx-lm's own over a prefill and 16 decode steps (float32, cpu backend),
greedy tokens, ``generate_step`` tokens and a K8/V4 run. A family mlx-lm adds is swept
without editing anything.

The first cases cover one architecture of each kind; the whole sweep (126 architectures
in mlx-lm 0.32.2) takes about a minute on 2 cores.
docs/integration.md's table comes from the same sweep (``tools/model_coverage.py``) and is
checked against its JSON here.
"""
from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

pytest.importorskip("mlx_lm")
from mlx_lm.models.base import scaled_dot_product_attention  # noqa: E402
from mlx_lm.models.cache import ArraysCache, KVCache, make_prompt_cache  # noqa: E402

from kvmetal.integrations import arch_sweep, tiny_models  # noqa: E402
from kvmetal.ops import SUPPORTED_HEAD_DIMS  # noqa: E402
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
    "stablelm",      # attends over its fetched keys cast to float32 (a lossless cast: the same rows)
    "plamo",         # tiles its fetched kv heads (query head h reads h % Hkv): query heads permuted
    "iquestloopcoder",  # its second loop also attends over the first loop's fetched rows (window 24 here)
    "plamo2",        # calls mx.fast.scaled_dot_product_attention directly: a HAND_ATTENTION stand-in
    "nemotron-nas",  # block_configs: one derived BlockConfig per layer
    "mimo_v2_flash",  # swa_head_dim, swa_num_attention_heads...: variants of the sizes
    "lfm2-vl",       # text_config derived from lfm2.ModelArgs, the class its code reads it into
    "gemma3n",       # K/V sharing as shipped: layers 2, 3 attend over layers 0, 1's rows (keys_and_values())
    "afm7",          # K/V reuse: layer 1 attends over layer 0's rows (keys_and_values(), no cache passed)
])
def test_exact_against_mlx_lm(name):
    row = arch_sweep.check(name)
    assert row.status == "exact", row
    assert row.max_rel_diff <= arch_sweep.TOLERANCE and row.greedy_identical and row.generate_step_identical
    assert row.k8v4_finite and row.k8v4_top1 >= 0.5, row


def _widest_head_dim_architectures() -> list:
    """The architectures whose paged layers (in the coverage sweep's JSON) reach the widest
    head_dim kvmetal serves: gemma4 and gemma4_text's global layers at D 512 (issue 40)."""
    widest = max(SUPPORTED_HEAD_DIMS)
    return sorted(r["name"] for r in json.loads(COVERAGE.read_text())["rows"]
                  if r.get("head_dims") and max(r["head_dims"]) == widest)


def test_some_architecture_reaches_the_widest_head_dim():
    assert _widest_head_dim_architectures(), f"no swept architecture has a head_dim {max(SUPPORTED_HEAD_DIMS)} layer"


@pytest.mark.parametrize("name", _widest_head_dim_architectures())
def test_widest_head_dim_is_exact_against_mlx_lm(name):
    row = arch_sweep.check(name)
    assert row.status == "exact" and max(row.head_dims) == max(SUPPORTED_HEAD_DIMS), row
    assert row.max_rel_diff <= arch_sweep.TOLERANCE and row.greedy_identical and row.generate_step_identical
    assert row.k8v4_finite and row.k8v4_top1 >= 0.5, row


@pytest.mark.parametrize("name,reason", [
    ("mamba", r"mamba: no layer keeps a K/V cache"),
    ("rwkv7", r"rwkv7: no layer keeps a K/V cache"),
    ("deepseek_v3", r"deepseek_v3 layer 0: K head_dim 32 and V head_dim 16 differ"),
    ("deepseek_v41", r"deepseek_v41 layer 0: its cache is a LayerCache, which has no update_and_fetch"),
    ("phi3small", r"phi3small layer 0: it attends by hand over the keys its cache returns"),
])
def test_refused_up_front_naming_the_layer(name, reason):
    model = arch_sweep.build(name)
    with pytest.raises(UnsupportedModel, match=r"^\[use_paged_cache\] " + reason):
        use_paged_cache(model)
    assert "make_cache" not in vars(model)  # nothing patched, no cache was made
    assert not any(isinstance(c, PagedLayerCache) for c in make_prompt_cache(model))


@pytest.mark.parametrize("name,reads,calls", [
    ("gemma3n", ["cache", "cache"], 4),  # 2 own calls, 2 shared layers passing the owner's cache
    ("afm7", ["none"], 2),  # 1 own call, 1 reuse layer passing no cache
])
def test_kv_sharing_and_reuse_attend_on_the_owners_pool(monkeypatch, name, reads, calls):
    # Every attention call, the readers' included, runs kvmetal's attention over a pool (never
    # mlx-lm's sdpa over gathered rows, which would also be exact): one call per model layer.
    model = arch_sweep.build(name)
    assert [s.read for s in analyse_model(model).specs] == reads
    seen = []
    attention = PagedLayerCache.attention
    monkeypatch.setattr(PagedLayerCache, "attention", lambda self, *a, **k: seen.append(self.layer) or
                        attention(self, *a, **k))
    prompt = mx.array([list(range(3, 40))])
    expected = [model(prompt, cache=(c := make_prompt_cache(model))), model(mx.array([[5]]), cache=c)]
    with use_paged_cache(model) as handle:
        got = [model(prompt, cache=(c := make_prompt_cache(model))), model(mx.array([[5]]), cache=c)]
        assert handle.shared_cache.gathered_attention == 0
    assert len(seen) == 2 * calls
    for g, e in zip(got, expected):
        assert float(mx.abs(g - e).max() / mx.abs(e).max()) < arch_sweep.TOLERANCE


def test_kv_sharing_mapped_to_the_wrong_layer_fails(monkeypatch):
    # Negative control: the shared layers attending over the other paged layer's pool (window
    # 24 against full, a 20-token prompt and 16 steps) is caught by the sweep's comparison.
    from kvmetal.integrations import mlx_lm

    written = {}
    update = PagedLayerCache.update_and_fetch
    monkeypatch.setattr(PagedLayerCache, "update_and_fetch",
                        lambda self, k, v: written.__setitem__(self.layer, self) or update(self, k, v))
    owner = mlx_lm.read_owner
    monkeypatch.setattr(mlx_lm, "read_owner", lambda keys: (o := owner(keys)) and written[1 - o.layer])
    row = arch_sweep.check("gemma3n")
    assert row.status == "broken" and row.max_rel_diff > 1e-2, row


def test_a_shared_layer_reading_a_cache_of_another_kind_is_refused():
    # gemma3n with its shared layers mapped across kinds: the full layer 3 reads the sliding
    # layer 0's rows under the full mask, which kvmetal's attention over layer 0's pool (its
    # window) would not give; the probe tells the two "causal" masks apart.
    model = arch_sweep.build("gemma3n")
    language = model.model.language_model
    assert language.layer_idx_to_cache_idx == [0, 1, 0, 1]
    language.layer_idx_to_cache_idx = [0, 1, 1, 0]
    with pytest.raises(UnsupportedModel, match=r"^\[use_paged_cache\] gemma3n layer 0: a layer attends over its "
                                               r"rows read with keys_and_values\(\) with another mask"):
        use_paged_cache(model)


class _AlsoReadsLayer0(nn.Module):
    """llama's attention; layer 1 also attends over layer 0's rows, read with
    ``keys_and_values()`` (``after`` applied to the keys), passing its own cache."""

    def __init__(self, attention, holder: dict, after=None):
        super().__init__()
        self.inner, self.holder, self.after = attention, holder, after

    def __call__(self, x, mask=None, cache=None):
        a = self.inner
        if self.after is None:  # layer 0: its cache is the one layer 1 reads
            self.holder["cache"] = cache
            return a(x, mask=mask, cache=cache)
        out = a(x, mask=mask, cache=cache)
        b, n, _ = x.shape
        q = a.rope(a.q_proj(x).reshape(b, n, a.n_heads, -1).transpose(0, 2, 1, 3), offset=cache.offset - n)
        k, v = self.holder["cache"].keys_and_values()
        o = scaled_dot_product_attention(q, self.after(k), v, cache=cache, scale=a.scale, mask=mask)
        return out + a.o_proj(o.transpose(0, 2, 1, 3).reshape(b, n, -1))


def _llama_reading_layer0(after):
    model = tiny_models.build("llama")
    holder = {}
    model.layers[0].self_attn = _AlsoReadsLayer0(model.layers[0].self_attn, holder)
    model.layers[1].self_attn = _AlsoReadsLayer0(model.layers[1].self_attn, holder, after)
    return model


def _assert_prompt_and_step_match_mlx_lm(model):
    """A 37-token prompt and one decode step under use_paged_cache give mlx-lm's logits."""
    prompt = mx.array([list(range(3, 40))])
    expected = [model(prompt, cache=(c := make_prompt_cache(model))), model(mx.array([[5]]), cache=c)]
    with use_paged_cache(model):
        got = [model(prompt, cache=(c := make_prompt_cache(model))), model(mx.array([[5]]), cache=c)]
    for g, e in zip(got, expected):
        assert float(mx.abs(g - e).max() / mx.abs(e).max()) < 1e-5


def test_a_read_of_another_layers_rows_is_derived_from_the_calls_not_the_family():
    # llama, no family list involved: layer 1 attends over layer 0's read rows passing its own
    # cache; kvmetal runs that call on layer 0's pool and matches mlx-lm.
    model = _llama_reading_layer0(lambda k: k)
    assert [s.read for s in analyse_model(model).specs] == ["cache", None]
    _assert_prompt_and_step_match_mlx_lm(model)


def test_read_rows_used_otherwise_are_refused():
    with pytest.raises(UnsupportedModel, match=r"^\[use_paged_cache\] llama layer 0: the model reads its cache's "
                                               r"rows with keys_and_values\(\) and uses them other than as"):
        use_paged_cache(_llama_reading_layer0(lambda k: k * 2))


def test_keys_and_values_returns_every_row_and_attention_needs_the_writing_pass():
    from kvmetal.integrations.mlx_lm import _paged_attention
    from kvmetal.integrations.model_cache import LayerSpec, PagedModelCache, read_owner

    cache = PagedModelCache([LayerSpec(None, 2, 64, mx.float32)]).owned_layer_caches(1)[0]
    assert cache.keys_and_values()[0].shape == (1, 2, 0, 64)  # nothing written yet
    rng = np.random.default_rng(0)
    rows = [[mx.array(rng.standard_normal((1, 2, n, 64)).astype(np.float32)) for _ in range(2)] for n in (3, 5)]
    for k, v in rows:
        cache.update_and_fetch(k, v)
    keys, values = cache.keys_and_values()
    assert read_owner(keys) is cache and read_owner(rows[1][0]) is None
    np.testing.assert_array_equal(np.array(keys), np.concatenate([np.array(rows[0][0]), np.array(rows[1][0])], 2))
    np.testing.assert_array_equal(np.array(values), np.concatenate([np.array(rows[0][1]), np.array(rows[1][1])], 2))
    q = mx.array(rng.standard_normal((1, 4, 5, 64)).astype(np.float32))
    got = _paged_attention(cache, q, keys, values, 0.125, "causal", None)
    expected = mx.fast.scaled_dot_product_attention(q, keys, values, scale=0.125, mask="causal")
    assert float(mx.abs(got - expected).max()) < 1e-5
    with pytest.raises(NotImplementedError, match=r"with the queries of the pass that wrote them"):
        _paged_attention(cache, q[:, :, :3], keys, values, 0.125, "causal", None)  # 3 queries, 5 written
    cache.trim(1)  # the tables changed: no pass wrote these rows as they are now
    keys, values = cache.keys_and_values()
    assert keys.shape[2] == 7
    with pytest.raises(NotImplementedError, match=r"after no write in this pass"):
        _paged_attention(cache, q, keys, values, 0.125, "causal", None)


def test_gemma3n_without_kv_sharing_is_exact():
    config = arch_sweep.tiny_args("gemma3n")
    config["text_config"] = dict(config["text_config"], num_hidden_layers=2, num_kv_shared_layers=0,
                                 layer_types=["sliding_attention", "full_attention"],
                                 activation_sparsity_pattern=[0.0, 0.0])
    row = arch_sweep.check("gemma3n", config=config)
    assert row.status == "exact" and row.paged_layers == 2, row


def test_tiny_configs_are_derived_from_the_model_code():
    args = arch_sweep.tiny_args
    # a wrapper's text_config is its language model's own tiny config
    assert {k: v for k, v in args("lfm2-vl")["text_config"].items() if k != "model_type"} == \
        {k: v for k, v in args("lfm2").items() if k != "model_type"}
    # required fields of a nested config class (gemma3n's TextConfig), by name
    text = arch_sweep.derive(__import__("mlx_lm.models.gemma3n", fromlist=["x"]).TextConfig, "gemma3n")
    assert text["vocab_size_per_layer_input"] == arch_sweep.VOCAB and text["hidden_size_per_layer_input"] == 256
    assert text["activation_sparsity_pattern"] == [0.0] * arch_sweep.LAYERS and text["altup_active_idx"] == 0
    assert text["num_kv_shared_layers"] == 0
    # per-layer config dataclasses, one per layer
    blocks = args("nemotron-nas")["block_configs"]
    assert blocks == [{"attention": {"n_heads_in_group": 2}, "ffn": {"ffn_mult": 1.0}}] * arch_sweep.LAYERS
    # swa_ variants agree with the sizes they qualify; an int rotary fraction is 1, not 2
    mimo = args("mimo_v2_flash")
    assert (mimo["swa_head_dim"], mimo["swa_num_attention_heads"], mimo["partial_rotary_factor"]) == (64, 4, 1)
    assert args("qwen")["kv_channels"] * args("qwen")["num_attention_heads"] == args("qwen")["hidden_size"]
    assert args("afm7")["num_kv_reuse_layers"] == 1  # one of the two layers reuses K/V
    muse = args("muse_spark")["text_config"]
    assert muse["layer_rope_theta"] == [10000.0] * arch_sweep.LAYERS and muse["moe_hidden_size"] == 256


def test_a_custom_metal_kernel_reads_as_such():
    reason = arch_sweep._not_built(RuntimeError("[metal_kernel] No Metal back-end."))
    assert reason.startswith("tiny model not built: RuntimeError: [metal_kernel] No Metal back-end.")
    assert "custom Metal kernel" in reason


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


def test_attention_by_hand_is_refused_unless_mapped(monkeypatch):
    # plamo2 calls mx.fast.scaled_dot_product_attention itself: without its stand-in, refused.
    from kvmetal.integrations import mlx_lm

    model = arch_sweep.build("plamo2")
    assert analyse_model(model).specs  # mapped: served (exact above)
    monkeypatch.delitem(mlx_lm.HAND_ATTENTION, ("mlx_lm.models.plamo2", "Attention"))
    with pytest.raises(UnsupportedModel, match=r"plamo2 layer 1: it attends by hand over the keys"):
        use_paged_cache(model)


@pytest.mark.parametrize("name,derived", [
    ("stablelm", lambda s: s.head_order == (0, 1, 2, 3) and not s.shared),  # cast: the fetched heads as they are
    ("plamo", lambda s: s.head_order == (0, 2, 1, 3) and not s.shared),  # tile: kv head 0 serves heads 0 and 2
    ("llama", lambda s: s.head_order is None and not s.shared),
])
def test_what_the_model_does_to_its_fetched_rows_is_derived(name, derived):
    specs = analyse_model(arch_sweep.build(name)).specs
    assert specs and all(derived(s) for s in specs), specs


def test_iquestloopcoder_second_loop_reads_the_first_loops_rows_and_that_matters(monkeypatch):
    model = arch_sweep.build("iquestloopcoder")
    layout = analyse_model(model)
    assert [s.shared for s in layout.specs] == [True, True, False, False]  # loop 1's layers are read by loop 2's
    assert [s.window for s in layout.specs] == [None, None, arch_sweep.WINDOW, arch_sweep.WINDOW]
    from kvmetal.integrations import model_cache

    monkeypatch.setattr(model_cache.PagedModelCache, "fetch_owner", lambda self, keys: None)  # attend over own rows
    row = arch_sweep.check("iquestloopcoder")
    assert row.status == "broken", row


def test_a_loaded_cache_of_a_model_that_tiles_its_kv_heads_is_refused_not_wrong(tmp_path):
    # A saved cache keeps the rows, not how the model reads them: plamo's tiled heads would
    # be grouped h // G over it, so attention refuses instead.
    from mlx_lm.models.cache import load_prompt_cache, save_prompt_cache

    model = arch_sweep.build("plamo")
    path = str(tmp_path / "cache.safetensors")
    with use_paged_cache(model):
        cache = make_prompt_cache(model)
        model(mx.array([list(range(3, 20))]), cache=cache)
        save_prompt_cache(path, cache)
        loaded = load_prompt_cache(path)
        assert isinstance(loaded[0], PagedLayerCache)
        with pytest.raises(NotImplementedError, match=r"does not know how the model maps its query heads"):
            model(mx.array([[5]]), cache=loaded)


def test_plamo_head_permutation_matters(monkeypatch):
    from kvmetal.integrations import mlx_lm

    monkeypatch.setattr(mlx_lm, "_head_permutation", lambda order: None)  # kvmetal's h // G grouping as is
    row = arch_sweep.check("plamo")
    assert row.status == "broken" and row.max_rel_diff > 1e-2, row


class _AfterFetch(nn.Module):
    """llama's attention with ``after`` applied to the fetched keys and values before attending."""

    def __init__(self, attention, after):
        super().__init__()
        self.inner, self.after = attention, after

    def __call__(self, x, mask=None, cache=None):
        a = self.inner
        b, n, _ = x.shape
        q = a.q_proj(x).reshape(b, n, a.n_heads, -1).transpose(0, 2, 1, 3)
        k = a.k_proj(x).reshape(b, n, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = a.v_proj(x).reshape(b, n, a.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = a.rope(q, offset=cache.offset), a.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, self.after(k), self.after(v), cache=cache, scale=a.scale, mask=mask)
        return a.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


def _llama_after_fetch(after):
    model = tiny_models.build("llama")  # 4 query heads, 2 kv heads
    for layer in model.layers:
        layer.self_attn = _AfterFetch(layer.self_attn, after)
    return model


@pytest.mark.parametrize("after,order", [
    (lambda k: mx.repeat(k, 2, axis=1), (0, 1, 2, 3)),  # query head h reads kv head h // 2: kvmetal's grouping
    (lambda k: mx.tile(k, [1, 2, 1, 1]), (0, 2, 1, 3)),  # h % 2
    (lambda k: k[:, ::-1], (2, 3, 0, 1)),  # heads 0, 1 read kv head 1
])
def test_a_rearrangement_of_the_fetched_heads_is_served_exactly(after, order):
    model = _llama_after_fetch(after)
    assert [s.head_order for s in analyse_model(model).specs] == [order, order]
    _assert_prompt_and_step_match_mlx_lm(model)


@pytest.mark.parametrize("after,reason", [
    (lambda k: k * 2, r"the keys/values it attends over are not the ones its cache returned"),
    (lambda k: k.astype(mx.float16), r"the keys/values it attends over are not the ones"),  # lossy
    (lambda k: k[:, [0, 0, 0, 1]], r"its query heads read its 2 kv heads unevenly"),
])
def test_anything_else_after_the_fetch_is_refused(after, reason):
    with pytest.raises(UnsupportedModel, match=r"^\[use_paged_cache\] llama layer 0: " + reason):
        use_paged_cache(_llama_after_fetch(after))


def test_keys_cast_to_float32_give_the_dtype_mlx_gives():
    # stablelm attends with float32 queries and keys over its float16 values: mlx's attention
    # returns float32, computed from the same float16 rows kvmetal reads from the pool.
    from kvmetal.integrations.mlx_lm import _paged_attention
    from kvmetal.integrations.model_cache import LayerSpec, PagedModelCache

    cache = PagedModelCache([LayerSpec(None, 2, 64, mx.float16)]).owned_layer_caches(1)[0]
    rng = np.random.default_rng(0)
    k, v = (mx.array(rng.standard_normal((1, 2, 5, 64)), dtype=mx.float16) for _ in range(2))
    q = mx.array(rng.standard_normal((1, 4, 5, 64)), dtype=mx.float32)
    keys, values = cache.update_and_fetch(k, v)
    got = _paged_attention(cache, q, keys.astype(mx.float32), values, 0.125, "causal", None)
    expected = mx.fast.scaled_dot_product_attention(q, k.astype(mx.float32), v, scale=0.125, mask="causal")
    assert got.dtype == expected.dtype == mx.float32
    assert float(mx.abs(got - expected).max()) < 1e-5


def test_stablelm_in_float16_keeps_mlx_lms_tokens():
    model = arch_sweep.build("stablelm")
    model.set_dtype(mx.float16)
    prompt = [int(t) for t in np.random.default_rng(1).integers(1, 256, 20)]
    expected, tokens = arch_sweep._run(model, prompt, 8)
    with use_paged_cache(model):
        got, got_tokens = arch_sweep._run(model, prompt, 8)
    assert got_tokens == tokens
    assert float(np.abs(got - expected).max() / np.abs(expected).max()) < 5e-3  # float16 rounding


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


@pytest.mark.parametrize("name", ["qwen3_next", "mixtral", "cohere2", "gemma3n"])
def test_batch_generator_gives_mlx_lms_tokens_on_hybrid_moe_window_and_kv_sharing_models(name):
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

