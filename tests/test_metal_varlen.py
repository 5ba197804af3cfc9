"""Paged varlen attention on the metal backend's kernels (tiled MMA kernel for runs of
more than 8 rows, decode partials for the rest), run by the simulator with strict
checks and two schedule seeds, against the float64 oracle. Small shapes: the
simulator executes every simdgroup_matrix product as a simdgroup collective.
Unowned cache slots are NaN (kvcases.paged_cache)."""
import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import reference as ref
from kvmetal import sim
from kvmetal.backends import metal_layout
from kvmetal.sim.backend import sim_backend

from kvcases import SEEDS, assert_close
from paged_cases import varlen_inputs

f32, f16, bf16 = mx.float32, mx.float16, mx.bfloat16


def oracle(query, kc, vc, tables, seq_lens, qsl, **options):
    return ref.paged_attention_varlen(query, kc, vc, tables, seq_lens, qsl, **options)


def run_varlen(query, kc, vc, tables, seq_lens, qsl, *, seeds=SEEDS, tiles=None, num_splits=None, validate=True,
               **options):
    """paged_attention_varlen on the simulator under every schedule seed (strict); the trace of
    the last run. ``tiles``/``num_splits`` (backend overrides) call the sim backend directly."""
    outs = []
    for seed in seeds:
        with sim.trace(strict=True, seed=seed) as t:
            if tiles is None and num_splits is None:
                with kv.use_backend("sim"):
                    out = kv.paged_attention_varlen(query, kc, vc, tables, seq_lens, qsl, validate=validate,
                                                    **options)
            else:
                kwargs = dict(softcap=None, sliding_window=None, sinks=None)
                kwargs.update(options)
                out = sim_backend().paged_attention_varlen(
                    query, kc, vc, tables, seq_lens, qsl, scale=query.shape[-1] ** -0.5, tiles=tiles,
                    num_splits=num_splits, **kwargs)
            mx.eval(out)
        assert out.shape == query.shape and out.dtype == query.dtype
        outs.append(out)
    return outs, t


# dtype, D, BS, Hkv, G, seq lens, new rows per sequence, softcap, sinks, window, K quant, V quant
CASES = [
    # ragged mix: n_s 0, 1, 7, 8, 9, 33 and a long one; lengths not multiples of the block size
    (f16, 64, 16, 1, 4, (3, 1, 20, 8, 9, 50, 230), (0, 1, 7, 8, 9, 33, 200), None, False, None, None, None),
    (bf16, 128, 8, 2, 3, (70, 12), (40, 12), None, False, 24, None, None),            # GQA 3, window
    (f32, 256, 16, 1, 8, (41, 2), (17, 1), 20.0, True, None, None, None),             # GQA 8, D 256, softcap
    (f16, 128, 16, 1, 1, (100, 30), (40, 30), None, True, None, (8, 64), (4, 64)),    # GQA 1, K8/V4, prefix
]


@pytest.mark.parametrize("case", CASES, ids=[f"{str(c[0]).split('.')[-1]}-d{c[1]}-g{c[4]}-{i}"
                                             for i, c in enumerate(CASES)])
def test_varlen_matches_oracle(case):
    dtype, head_dim, block_size, hkv, gqa, lens, counts, softcap, use_sinks, window, kq, vq = case
    rng = np.random.default_rng(head_dim + gqa)
    query, kc, vc, tables, seq_lens, qsl, sinks = varlen_inputs(
        rng, lens=lens, counts=counts, num_kv_heads=hkv, gqa=gqa, head_dim=head_dim, block_size=block_size,
        dtype=dtype, k_quant=kq, v_quant=vq, use_sinks=use_sinks)
    options = dict(softcap=softcap, sinks=sinks, sliding_window=window)
    expected = oracle(query, kc, vc, tables, seq_lens, qsl, **options)
    outs, trace = run_varlen(query, kc, vc, tables, seq_lens, qsl, **options)
    for out in outs:
        assert_close(out, expected, dtype)
    tiled = [c for c in trace.calls if "paged_varlen_partials" in c.name]
    assert len(tiled) == 1                                     # every long run in one launch
    k_item = 4 if kq else kc.dtype.size  # a quantized K tile holds float32 rows (issue 41, defect 1)
    v_item = (vc.scales if vq else vc).dtype.size
    tiles = metal_layout.varlen_tiles(head_dim=head_dim, k_itemsize=k_item, v_itemsize=v_item,
                                      q_itemsize=query.dtype.size)
    assert tiled[0].threadgroup_memory == metal_layout.tiles_threadgroup_bytes(
        tiles, head_dim=head_dim, k_itemsize=k_item, v_itemsize=v_item, q_itemsize=query.dtype.size) <= 32 * 1024
    assert tiled[0].mma > 0


def test_every_row_a_decode_row_equals_paged_attention():
    rng = np.random.default_rng(5)
    query, kc, vc, tables, seq_lens, qsl, _ = varlen_inputs(
        rng, lens=(17, 1, 40), counts=(1, 1, 1), num_kv_heads=2, gqa=4, head_dim=64, block_size=16, dtype=f16)
    outs, trace = run_varlen(query, kc, vc, tables, seq_lens, qsl, seeds=SEEDS[:1], sliding_window=9)
    assert not any("varlen" in c.name for c in trace.calls)  # decode partials only
    with sim.trace(strict=True):
        want = sim_backend().paged_attention(query[:, None], kc, vc, tables, seq_lens,
                                                   scale=64 ** -0.5, softcap=None, sliding_window=9, sinks=None,
                                                   num_splits=None)
    np.testing.assert_array_equal(np.array(outs[0]), np.array(want[:, 0]))


@pytest.mark.parametrize("splits,tiles", [(3, None), (2, metal_layout.VarlenTiles(2, 16)),
                                          (2, metal_layout.VarlenTiles(4, 16, True, 2, 2))])
def test_splits_and_tile_sizes(splits, tiles):
    rng = np.random.default_rng(splits)
    query, kc, vc, tables, seq_lens, qsl, sinks = varlen_inputs(
        rng, lens=(150, 20), counts=(24, 20), num_kv_heads=2, gqa=2, head_dim=64, block_size=16, dtype=f32,
        use_sinks=True)
    expected = oracle(query, kc, vc, tables, seq_lens, qsl, sinks=sinks)
    outs, trace = run_varlen(query, kc, vc, tables, seq_lens, qsl, seeds=SEEDS[:1], sinks=sinks,
                             num_splits=splits, tiles=tiles)
    assert_close(outs[0], expected, f32)
    call = next(c for c in trace.calls if "paged_varlen_partials" in c.name)
    assert call.grid[2] == splits
    if tiles is not None:
        assert call.threadgroup == (tiles.threads, 1, 1)


def test_costs_causal_skip_and_kv_read_once_per_query_tile():
    """One chunk of 64 rows after a 64-token prefix, G = 4: every query tile reads only
    the K/V rows up to its last row's position, each once for its G heads; two
    barriers per K/V tile and one per threadgroup (the first tile's block ids); the block
    table read once per block of each K/V tile (issue 41: not once per fill task)."""
    rng = np.random.default_rng(7)
    hkv, gqa, d, bs = 1, 4, 64, 16
    query, kc, vc, tables, seq_lens, qsl, _ = varlen_inputs(
        rng, lens=(128,), counts=(64,), num_kv_heads=hkv, gqa=gqa, head_dim=d, block_size=bs, dtype=f16)
    outs, trace = run_varlen(query, kc, vc, tables, seq_lens, qsl, seeds=SEEDS[:1])
    assert_close(outs[0], oracle(query, kc, vc, tables, seq_lens, qsl), f16)
    call = next(c for c in trace.calls if "paged_varlen_partials" in c.name)
    tiles = metal_layout.varlen_tiles(head_dim=d, k_itemsize=2, v_itemsize=2)
    positions = tiles.block_q // gqa                     # 8 positions per query tile
    visible = [64 + (i + 1) * positions for i in range(64 // positions)]  # keys up to each tile's last row
    kv_tiles = [-(-v // tiles.block_k) for v in visible]
    assert call.buffers["key_data"].loaded == sum(visible) * d * 2   # rows past the diagonal: never loaded
    assert call.buffers["value_data"].loaded == call.buffers["key_data"].loaded
    assert call.bytes_per_load("key_data", "value_data") == 16.0   # rows copied in 16-byte units
    assert call.barriers == 2 * sum(kv_tiles) + len(kv_tiles)
    assert call.buffers["block_tables"].load_ops == sum(-(-v // bs) for v in visible)
    per_tile = 2 * (tiles.block_k // 8) * (d // 8) * tiles.simdgroups * tiles.row_fragments
    assert call.mma == per_tile * sum(kv_tiles)


def test_index_guards_without_validation():
    """validate=False misuse: a length past the block table, more rows than cached
    tokens, block ids outside the cache: no access out of bounds; rows at negative
    positions are zeros."""
    rng = np.random.default_rng(11)
    query, kc, vc, tables, seq_lens, qsl, _ = varlen_inputs(
        rng, lens=(40, 12), counts=(16, 12), num_kv_heads=1, gqa=2, head_dim=64, block_size=16, dtype=f16)
    bad_tables = np.array(tables)
    bad_tables[0, 1] = 10 ** 6                              # a block id outside [0, N)
    bad_lens = mx.array(np.array([10 ** 6, 9], np.int32))   # past the table; fewer than the 12 rows
    outs, _ = run_varlen(query, kc, vc, mx.array(bad_tables), bad_lens, qsl, seeds=SEEDS[:1], validate=False)
    out = np.array(outs[0].astype(mx.float32))             # sequence 0 reads garbage (the table's padding)
    np.testing.assert_array_equal(out[16:19], 0.0)          # 12 rows, 9 cached: 3 rows see nothing
    want = oracle(query[19:], kc, vc, tables[1:], bad_lens[1:], mx.array([0, 9]))
    assert_close(out[19:], want, f16)


def test_bench_prefill_case_sweeps_tiles_on_sim(monkeypatch):
    from kvmetal.benchmarks import cases

    # Two tile sizes x RF 1 and 2 x DS 1, 2 and 4 (DS: DS x the simdgroups, the same BQ), and
    # sequential K/V (SKV) on the first tile size at RF 1; what does not fit 32 KiB (BK 128,
    # and RF 2's Q tile beside BK 32's K/V tiles at D 128) or 384 threads (16 simdgroups) is
    # skipped. Each row is a kernel build.
    monkeypatch.setattr(cases, "PREFILL_TILE_SWEEP", ((4, 32), (2, 16), (4, 128)))
    rows = cases.run_case("prefill", backend="sim", tokens=24, repeat=1, baseline=True, progress=lambda m: None)
    assert [(r["tiles"]["row_fragments"], r["tiles"]["block_q"], r["tiles"]["block_k"], r["tiles"]["d_split"],
             r["tiles"]["simdgroups"], r["tiles"]["sequential_kv"]) for r in rows] == \
        [(1, 32, 32, 1, 4, False), (1, 32, 32, 1, 4, True), (1, 32, 32, 2, 8, False), (1, 32, 32, 2, 8, True),
         (1, 16, 16, 1, 2, False), (1, 16, 16, 2, 4, False), (1, 16, 16, 4, 8, False),
         (2, 32, 16, 1, 2, False), (2, 32, 16, 2, 4, False), (2, 32, 16, 4, 8, False)]
    for r in rows:
        assert r["seconds"] > 0 and r["baseline"]["seconds"] > 0


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "phi3", "gemma3_text", "gpt_oss"])
def test_mlx_lm_drop_in_greedy_parity_on_sim(family):
    """Chunked prefill (20-token chunks after the cached prefix) through the tiled kernel on
    the simulator, decode through the decode partials: mlx-lm's greedy tokens."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.generate import generate_step

    from kvmetal.integrations import tiny_models
    from kvmetal.integrations.mlx_lm import use_paged_cache

    model = tiny_models.build(family)
    prompt = mx.array(list(range(3, 63)))

    def greedy():
        return [int(t) for t, _ in generate_step(prompt, model, max_tokens=6, prefill_step_size=20,
                                                 sampler=lambda lp: mx.argmax(lp, axis=-1))]

    expected = greedy()
    with kv.use_backend("sim"), sim.trace(strict=True) as trace, use_paged_cache(model):
        got = greedy()
    assert got == expected
    # chunks of 20, 20, 19 tokens (mlx-lm keeps the last prompt token for decode): all tiled
    assert sum("paged_varlen_partials" in c.name for c in trace.calls) == 3 * len(model.layers)


def _issue41_varlen_case(*, scale, softcap, tie_sink, seed=41):
    """Issue 41, defect 1: bfloat16, D 256, block size 8, 2 kv heads, GQA 1, K 6-bit
    (group 32) with float V, n = [130, 15, 8] new rows over [200, 0, 0] cached ones, junk
    in the tables' unused columns. Row 130 (the second sequence's first row, position 0)
    sees one key of a mostly masked K tile plus the sink; ``tie_sink`` sets head 0's sink
    to that key's logit, so the row's output is half the key's value and any error in
    the score shows at full strength."""
    rng = np.random.default_rng(seed)
    counts, ctx = (130, 15, 8), (200, 0, 0)
    lens = tuple(c + n for c, n in zip(ctx, counts))
    query, kc, vc, tables, seq_lens, qsl, sinks = varlen_inputs(
        rng, lens=lens, counts=counts, num_kv_heads=2, gqa=1, head_dim=256, block_size=8, dtype=bf16,
        k_quant=(6, 32), use_sinks=True)
    if tie_sink:
        k0 = ref.to_f64(kc)[int(np.array(tables)[1, 0]), 0, 0]           # key 0 of sequence 1, kv head 0
        s = scale * float(np.array(query[130, 0].astype(f32), np.float64) @ k0)
        if softcap:
            s = softcap * np.tanh(s / softcap)
        sinks = mx.array(np.array([s, *np.array(sinks)[1:]], np.float32))
    return (query, kc, vc, tables, seq_lens, qsl), dict(scale=scale, softcap=softcap, sinks=sinks)


@pytest.mark.parametrize("softcap", [50.0, None])
@pytest.mark.parametrize("tie_sink", [True, False])
def test_issue41_sinks_with_an_explicit_scale(softcap, tie_sink):
    # Failed before the fix (rows up to 12% off, row 130 among them): the tile held the
    # quantized K dequantized to the scales' type (bfloat16), so a score carried an error of
    # ~|q||k| 2^-9 sqrt(D), which scale 4 made a large error in the row's weights; sinks
    # exposed it on a one-key row (without a sink one key's weight cancels).
    args, options = _issue41_varlen_case(scale=4.0, softcap=softcap, tie_sink=tie_sink)
    expected = oracle(*args, **options)
    outs, _ = run_varlen(*args, validate=False, **options)
    for out in outs:
        assert_close(out, expected, bf16)
    with kv.use_backend("cpu"):
        assert_close(kv.paged_attention_varlen(*args, validate=False, **options), expected, bf16)


def test_nan_in_a_visible_k_row_propagates():
    # Issue 41, R3: a NaN in a K row a query row sees makes that row NaN (as decode does
    # and the oracle does); rows that cannot see it stay finite and right. Before the fix
    # the tiled kernel chose weights by `score > -big/2`, which a NaN score fails: the key
    # was dropped silently.
    rng = np.random.default_rng(3)
    query, kc, vc, tables, seq_lens, qsl, sinks = varlen_inputs(
        rng, lens=(40,), counts=(17,), num_kv_heads=1, gqa=2, head_dim=64, block_size=16, dtype=f16, use_sinks=True)
    bad = 30  # key 30: query rows at positions >= 30 (new rows 7..16) see it
    k = np.array(kc.astype(f32))
    block = int(np.array(tables)[0, bad // 16])
    k[block, 0, bad % 16, 5] = np.nan
    kc = mx.array(k).astype(f16)
    options = dict(sinks=sinks)
    expected = oracle(query, kc, vc, tables, seq_lens, qsl, **options)
    first_seeing = bad - (40 - 17)
    assert np.isnan(expected[first_seeing:]).all() and np.isfinite(expected[:first_seeing]).all()
    outs, trace = run_varlen(query, kc, vc, tables, seq_lens, qsl, **options)
    assert any("paged_varlen_partials" in c.name for c in trace.calls)
    for out in outs:
        o = np.array(out.astype(f32))
        assert np.isnan(o[first_seeing:]).all(), "a NaN in a visible K row was dropped"
        assert_close(out[:first_seeing], expected[:first_seeing], f16)


def test_rescale_only_when_the_max_rises():
    # Issue 41, R2: the tiled kernel rescales (l, O) by exp2(m - m_new) only on lanes whose
    # row max rose; a tile a row cannot see, or one below its max, leaves it untouched
    # (before: times exp2(0), exact only where the fast exp2 is). Counted on the simulator:
    # one sequence of 9 new rows (no context), G 1, D 64 float16: one query tile of 32 rows
    # (4 simdgroups) and one K/V tile of 32 keys. Rows 0..8 see 1..9 keys (45 weights);
    # each row lives on 4 lanes whose max rises once (36 rescales). Before: all 128 lanes
    # rescaled (128 + 45 = 173 exp2 calls).
    rng = np.random.default_rng(9)
    query, kc, vc, tables, seq_lens, qsl, _ = varlen_inputs(
        rng, lens=(9,), counts=(9,), num_kv_heads=1, gqa=1, head_dim=64, block_size=16, dtype=f16)
    tiles = metal_layout.VarlenTiles(simdgroups=4, block_k=32)
    outs, trace = run_varlen(query, kc, vc, tables, seq_lens, qsl, seeds=SEEDS[:1], tiles=tiles, num_splits=1)
    assert_close(outs[0], oracle(query, kc, vc, tables, seq_lens, qsl), f16)
    (call,) = [c for c in trace.calls if "paged_varlen_partials" in c.name]
    assert call.math.get("exp2", 0) == 45 + 36, call.math


def test_split_d_matches_one_simdgroup_per_row_and_keeps_a_rows_bits_in_any_chunk_or_batch():
    """Issue 41, P1: at D 256 the default tiles split D (two simdgroups per row fragment,
    each over half the dims, their partial scores summed in threadgroup memory): the oracle's
    result, as with one simdgroup per row fragment (DS 1, the tiles a Mac can compare), with
    one more barrier per K/V tile; and a row gets the same bits whatever chunk and batch it is in."""
    rng = np.random.default_rng(21)
    d, bs, gqa = 256, 16, 2
    tiles = metal_layout.varlen_tiles(head_dim=d, k_itemsize=2, v_itemsize=2)
    assert (tiles.d_split, tiles.simdgroups, tiles.block_q) == (2, metal_layout.VARLEN_SPLIT_D_SIMDGROUPS, 24)
    query, kc, vc, tables, seq_lens, qsl, _ = varlen_inputs(
        rng, lens=(30, 72), counts=(10, 40), num_kv_heads=1, gqa=gqa, head_dim=d, block_size=bs, dtype=f16)
    expected = oracle(query, kc, vc, tables, seq_lens, qsl)
    outs, trace = run_varlen(query, kc, vc, tables, seq_lens, qsl)
    for out in outs:
        assert_close(out, expected, f16)
    split = next(c for c in trace.calls if "paged_varlen_partials" in c.name)
    assert "_ds2_" in split.name and split.threadgroup[0] == 32 * tiles.simdgroups
    one = metal_layout.VarlenTiles(tiles.simdgroups // 2, tiles.block_k, True, 1, 1)  # the same BQ, DS 1
    outs1, trace1 = run_varlen(query, kc, vc, tables, seq_lens, qsl, seeds=SEEDS[:1], tiles=one)
    assert_close(outs1[0], expected, f16)
    whole = next(c for c in trace1.calls if "paged_varlen_partials" in c.name)
    assert "_ds1_" in whole.name and whole.mma == split.mma
    # The same K/V tiles and threadgroups: DS 2 adds one barrier per K/V tile.
    per_tg = (whole.barriers - whole.threadgroups) // 2
    assert split.barriers == 3 * per_tg + split.threadgroups
    # The second sequence's rows in chunks of 14 (query tiles cut elsewhere than in the whole
    # run; every chunk over VARLEN_DECODE_ROWS) after a varying neighbour: the same bits.
    q1 = query[10:]
    parts = []
    for a in range(0, 40, 14):
        b = min(40, a + 14)
        lens = mx.array([int(seq_lens[0]), 72 - 40 + b], mx.int32)
        q = mx.concatenate([query[:a % 11 + 9], q1[a:b]])
        with sim.trace(strict=True, seed=SEEDS[0]), kv.use_backend("sim"):
            out = kv.paged_attention_varlen(q, kc, vc, tables, lens, mx.array([0, a % 11 + 9, q.shape[0]], mx.int32))
            mx.eval(out)
        parts.append(out[a % 11 + 9:])
    assert mx.array_equal(mx.concatenate(parts), outs[0][10:])


def test_split_d_threshold_is_a_tuning_variable(monkeypatch):
    """KVMETAL_METAL_VARLEN_REGISTERS moves the split-D threshold (a large value: never
    split); a value that does not parse or is below 1 raises naming the variable."""
    args = dict(head_dim=256, k_itemsize=2, v_itemsize=2)
    assert metal_layout.varlen_tiles(**args).d_split == 2
    assert metal_layout.varlen_tiles(head_dim=128, k_itemsize=2, v_itemsize=2).d_split == 1
    monkeypatch.setenv("KVMETAL_METAL_VARLEN_REGISTERS", "1000")
    assert metal_layout.varlen_tiles(**args) == metal_layout.VarlenTiles(4, 16, True, 1, 1)
    monkeypatch.setenv("KVMETAL_METAL_VARLEN_REGISTERS", "100")
    assert metal_layout.varlen_tiles(head_dim=128, k_itemsize=2, v_itemsize=2).d_split == 2
    for bad in ("0", "x", "1.5"):
        monkeypatch.setenv("KVMETAL_METAL_VARLEN_REGISTERS", bad)
        with pytest.raises(ValueError, match="KVMETAL_METAL_VARLEN_REGISTERS"):
            metal_layout.varlen_tiles(**args)
