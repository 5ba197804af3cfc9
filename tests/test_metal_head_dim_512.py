"""Issue 40: head_dim 512 (gemma4's global attention layers) on the Metal kernels, run by the
simulator against the float64 oracles: paged decode (float16, K8/V4, GQA 1/4/8, sinks,
sliding window, query tokens), the one-row layout that loads K/V in the pass (PF 0),
varlen prefill with split-D over 4 simdgroups (DS 4) and K/V taking turns in one tile
buffer (SKV), and cascade. Lengths stay small: a D 512 call costs the simulator 4x a D 128
one."""
import dataclasses

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import chips, ops
from kvmetal import reference as ref
from kvmetal import sim
from kvmetal.backends import metal, metal_layout
from kvmetal.sim.backend import sim_backend

from kvcases import SEEDS, assert_close, kernel_backends, paged_attention_inputs, run_checked
from paged_cases import cascade_case, varlen_inputs

D = 512
f32, f16, bf16 = mx.float32, mx.float16, mx.bfloat16
K8V4 = dict(k_quant=(8, 64), v_quant=(4, 64))


def test_512_is_served():
    assert D in ops.SUPPORTED_HEAD_DIMS
    cache = kv.PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=D, num_blocks=4)
    assert cache.head_dim == D


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("dtype,quant,gqa,query_len,sinks,window", [
    (f16, {}, 1, 1, False, None),
    (f16, {}, 4, 1, True, None),
    (f16, {}, 8, 1, False, 21),
    (f16, K8V4, 1, 1, True, 21),
    (f16, K8V4, 4, 1, False, None),
    (f16, K8V4, 8, 1, True, None),
    (bf16, {}, 4, 3, False, None),
    (f16, K8V4, 2, 4, True, 30),
])
def test_paged_decode(backend, dtype, quant, gqa, query_len, sinks, window):
    rng = np.random.default_rng(gqa * 10 + query_len)
    lens = (1 if query_len == 1 else query_len, 19, 70)
    query, kc, vc, tables, seq_lens, sink = paged_attention_inputs(
        rng, lens=lens, num_kv_heads=2, gqa=gqa, head_dim=D, block_size=16, dtype=dtype, use_sinks=sinks,
        query_len=None if query_len == 1 else query_len, **quant)
    options = dict(sinks=sink, sliding_window=window)
    expected = ref.paged_attention(query, kc, vc, tables, seq_lens, **options)
    calls = run_checked(backend, ops.paged_attention, expected, query, kc, vc, tables, seq_lens,
                        kernel="paged_attention_partials", **options)
    for call in calls:
        assert "_d512_" in call.name and call.threadgroup[0] <= chips.PIPELINE_THREAD_LIMIT


@pytest.mark.parametrize("quant", [{}, dict(k_quant=(5, 128), v_quant=(5, 128))], ids=["f32", "q5"])
def test_one_float32_row_loads_in_the_pass_with_the_same_bits(quant, monkeypatch):
    """One float32 row at D 512 (float32 or 5-bit atoms) passes 128 registers with the next
    pass's atoms in flight at every key group: the layout loads them in the pass (PF 0),
    within 128. Only the loads move: the bits equal the pipelined kernel's (PF 1); several
    splits and a sink."""
    rng = np.random.default_rng(5)
    query, kc, vc, tables, seq_lens, sink = paged_attention_inputs(
        rng, lens=(45, 3), num_kv_heads=1, gqa=1, head_dim=D, block_size=16, dtype=f32, use_sinks=True, **quant)
    layout = metal_layout.layout_for(query[:, None], kc, vc, paged=True)
    assert not layout.prefetch and layout.rows_per_simdgroup == 1
    kbits = quant.get("k_quant", (0,))[0]
    regs = layout.registers(head_dim=D, k_bits=kbits, v_bits=kbits, q_itemsize=4, k_itemsize=4, v_itemsize=4)
    assert regs <= chips.PIPELINE_REGISTER_LIMIT < dataclasses.replace(layout, prefetch=True).registers(
        head_dim=D, k_bits=kbits, v_bits=kbits, q_itemsize=4, k_itemsize=4, v_itemsize=4)
    expected = ref.paged_attention(query, kc, vc, tables, seq_lens, sinks=sink)
    backend = sim_backend()
    opts = dict(scale=D ** -0.5, softcap=None, sliding_window=None, sinks=sink, num_splits=3)
    outs = {}
    for prefetch in (False, True):
        monkeypatch.setattr(metal, "layout_for", lambda *a, prefetch=prefetch, **k: dataclasses.replace(
            metal_layout.layout_for(*a, **k), prefetch=prefetch))
        with sim.trace(strict=True, seed=SEEDS[0]) as trace:
            outs[prefetch] = backend.paged_attention(query[:, None], kc, vc, tables, seq_lens, **opts)[:, 0]
            mx.eval(outs[prefetch])
        (call,) = [c for c in trace.calls if "paged_attention_partials" in c.name]
        assert f"_pf{int(prefetch)}_" in call.name
    assert_close(outs[False], expected, f32)
    assert mx.array_equal(outs[False], outs[True])


def run_varlen(args, *, tiles=None, seed=SEEDS[0], **options):
    with sim.trace(strict=True, seed=seed) as trace:
        if tiles is None:
            with kv.use_backend("sim"):
                out = ops.paged_attention_varlen(*args, **options)
        else:
            out = sim_backend().paged_attention_varlen(*args, scale=D ** -0.5, softcap=None,
                                                        sliding_window=options.get("sliding_window"),
                                                        sinks=options.get("sinks"), tiles=tiles)
        mx.eval(out)
    return out, next(c for c in trace.calls if "paged_varlen_partials" in c.name)


def test_varlen_tiles_split_d_four_ways_within_the_limits():
    """The default D 512 tiles: DS 4 (110 registers a lane; DS 2 would keep 174), 12
    simdgroups (BQ 24, 384 threads), BK 8; K and V side by side in 16-bit tiles, in turns
    (SKV) where a float32 tile (a float32 cache, or a quantized K's float32 rows) would take
    the two past 32 KiB."""
    for k_item, v_item, q_item, skv in ((2, 2, 2, False), (4, 2, 2, True), (4, 4, 4, True)):
        t = metal_layout.varlen_tiles(head_dim=D, k_itemsize=k_item, v_itemsize=v_item, q_itemsize=q_item)
        assert (t.d_split, t.simdgroups, t.block_q, t.block_k, t.sequential_kv) == (4, 12, 24, 8, skv)
        regs = metal_layout.varlen_registers(head_dim=D, block_k=t.block_k, row_fragments=t.row_fragments,
                                             d_split=t.d_split)
        assert regs <= chips.PIPELINE_REGISTER_LIMIT < metal_layout.varlen_registers(
            head_dim=D, block_k=t.block_k, d_split=2)
        assert t.threads <= min(chips.PIPELINE_THREAD_LIMIT, chips.max_threads_for_registers(regs))
        used = metal_layout.tiles_threadgroup_bytes(t, head_dim=D, k_itemsize=k_item, v_itemsize=v_item,
                                                    q_itemsize=q_item)
        assert used <= chips.THREADGROUP_MEMORY_LIMIT
        if skv:  # side by side they would not fit
            side = dataclasses.replace(t, sequential_kv=False)
            assert metal_layout.tiles_threadgroup_bytes(side, head_dim=D, k_itemsize=k_item, v_itemsize=v_item,
                                                        q_itemsize=q_item) > chips.THREADGROUP_MEMORY_LIMIT


@pytest.mark.parametrize("dtype,quant,gqa,sinks,window", [
    (f16, {}, 4, True, None),
    (f16, {}, 1, False, 25),
    (f32, {}, 2, True, None),
    (f16, K8V4, 8, False, None),
])
def test_varlen_prefill(dtype, quant, gqa, sinks, window):
    """Chunks after a cached context and a whole prompt, crossing query tiles (24 rows) and
    K/V tiles (8 tokens), plus a decode run (n 3: the decode partials)."""
    rng = np.random.default_rng(gqa)
    *args, sink = varlen_inputs(rng, lens=(37, 20, 9), counts=(13, 20, 3), num_kv_heads=2, gqa=gqa, head_dim=D,
                                block_size=16, dtype=dtype, use_sinks=sinks, **quant)
    options = dict(sinks=sink, sliding_window=window)
    expected = ref.paged_attention_varlen(*args, **options)
    for seed in SEEDS:
        out, call = run_varlen(args, seed=seed, **options)
        assert_close(out, expected, dtype)
    skv = dtype == f32 or bool(quant)
    assert "_ds4_" in call.name and f"_skv{int(skv)}_" in call.name and call.threadgroup[0] == 384


def test_varlen_split_d_and_sequential_kv_cost_their_barriers_only():
    """DS 4 against one simdgroup per row fragment (DS 1, same BQ): the same MMAs, one more
    barrier per K/V tile (the scores' exchange), the oracle's result. SKV against K and V side
    by side: one more barrier per K/V tile again, and the same bits (only the buffer moves)."""
    rng = np.random.default_rng(3)
    *args, _ = varlen_inputs(rng, lens=(40,), counts=(30,), num_kv_heads=1, gqa=2, head_dim=D, block_size=16,
                             dtype=f16)
    expected = ref.paged_attention_varlen(*args)
    ds4 = metal_layout.varlen_tiles(head_dim=D, k_itemsize=2, v_itemsize=2)
    runs = {}
    for name, tiles in (("ds4", ds4), ("ds4-skv", dataclasses.replace(ds4, sequential_kv=True)),
                        ("ds1", metal_layout.VarlenTiles(3, ds4.block_k))):
        out, call = run_varlen(args, tiles=tiles)
        assert_close(out, expected, f16)
        runs[name] = out, call
    (_, one), (out4, four), (out_skv, skv) = runs["ds1"], runs["ds4"], runs["ds4-skv"]
    assert one.mma == four.mma == skv.mma and one.threadgroups == four.threadgroups
    per_tg = (one.barriers - one.threadgroups) // 2  # K/V tiles: two barriers each, one per threadgroup
    assert per_tg > 0
    assert four.barriers == 3 * per_tg + four.threadgroups
    assert skv.barriers == 4 * per_tg + skv.threadgroups
    assert mx.array_equal(out4, out_skv)


@pytest.mark.parametrize("quant", [{}, dict(k_bits=8, v_bits=4)], ids=["f16", "k8v4"])
def test_cascade(quant):
    inputs, sink = cascade_case((40,), (5, 17, 1), (0, 0, 0), num_kv_heads=1, gqa=4, head_dim=D, sinks=True,
                                seed=7, **quant)
    expected = ref.paged_attention_cascade(**inputs, sinks=sink)
    for seed in SEEDS:
        with sim.trace(strict=True, seed=seed) as trace, kv.use_backend("sim"):
            out = ops.paged_attention_cascade(**inputs, sinks=sink)
            mx.eval(out)
        assert_close(out, expected, f16)
    assert any("cascade_partials" in c.name and "_d512_" in c.name for c in trace.calls)


def test_gemma4_text_on_the_simulated_kernels_matches_mlx_lm():
    """gemma4_text (tiny, float32: sliding layers at D 64, the global layer at D 512) under
    use_paged_cache on the simulated Metal kernels: mlx-lm's logits over a 20-token prefill
    (the varlen kernel, DS 4) and 6 decode steps (the decode partials), greedy tokens the same."""
    pytest.importorskip("mlx_lm")
    from kvmetal.integrations import arch_sweep
    from kvmetal.integrations.mlx_lm import use_paged_cache

    model = arch_sweep.build("gemma4_text")
    prompt = [int(t) for t in np.random.default_rng(0).integers(1, 256, arch_sweep.PROMPT_TOKENS)]
    with kv.use_backend("cpu"):
        expected, tokens = arch_sweep._run(model, prompt, 6)
    with kv.use_backend("sim"), sim.trace(strict=True, seed=SEEDS[0]) as trace, use_paged_cache(model, block_size=16):
        got, got_tokens = arch_sweep._run(model, prompt, 6)
    assert float(np.abs(got - expected).max() / np.abs(expected).max()) <= arch_sweep.TOLERANCE
    assert got_tokens == tokens
    wide = [c.name for c in trace.calls if "_d512_" in c.name]
    assert any("paged_varlen_partials" in n and "_ds4_" in n for n in wide)
    assert any("paged_attention_partials" in n for n in wide)
