"""A small, strict simulator suite for every kernel of kernels/*.metal: the test set
``tools/mutate_kernels.py`` runs against each kernel mutant (and an ordinary part of
the suite).

Few specialisations (each one is a compile per mutant), float32 wherever the kernel
allows it (budget 1e-5, so a dropped rescale or a wrong scale cannot hide in rounding),
both attention modes (register: rows fit in registers; shared: more query rows than
that, tiles in threadgroup memory), multi-token queries, windows, softcap, sinks,
uneven split counts, quantized K/V with codes that straddle words, strided views, and
bit-exact writes. Test names carry the kernel family, the name of its file in kernels/
(``attention``, ``varlen``, ``cascade``, ``cache_write``, ``cache_copy``), so the
mutation tool picks the tests of every family a mutated file reaches (the families
come from ``kvmetal.backends.metal_specs.SPECS``; tests/test_metal_rules.py runs too).
"""
from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import quant
from kvmetal import reference as ref
from kvmetal.backends import metal, metal_layout
from kvmetal.sim.backend import sim_backend
from kvcases import maybe_quantize, paged_attention_inputs, paged_cache, random, run_checked, run_on
from paged_cases import cascade_case, varlen_inputs

f32, f16 = mx.float32, mx.float16

# head_dim, block_size, kv heads, GQA, lens, query rows (None: 3-D query), splits, softcap, sinks,
# window, K quant, V quant, dtype
PAGED = [
    ("register-gqa4-sinks", 64, 8, 2, 4, (1, 37, 70), None, 3, None, True, None, None, None, f32),
    ("register-window-softcap-empty", 64, 16, 1, 1, (45, 0, 100), None, 2, 5.0, False, 20, None, None, f32),
    ("shared-rows3-window-sinks", 64, 32, 1, 8, (40, 67), 3, 2, None, True, 9, None, None, f32),
    # 3/6-bit atoms hold 32 values: past the register-mode estimate even at 4 rows (shared mode).
    ("shared-rows2-k3v6", 64, 16, 1, 2, (29, 66), 2, 3, None, False, None, (3, 32), (6, 32), f32),
    ("shared-rows2-k8v4-f16", 128, 8, 2, 8, (50, 9), 2, 2, 8.0, True, None, (8, 64), (4, 64), f16),
    # GQA 8 decode (8 simdgroups x 1 row, tiles of 8 tokens): the tile fill unpacks each quantized
    # element once to centred halves (KvTileFill) that every simdgroup reads; 8-bit K, 4-bit V
    # (two half4s a unit), and 3/6-bit atoms (a value one at a time, 3-bit codes straddling words).
    ("shared-gqa8-k8v4-f16", 128, 16, 2, 8, (70, 33, 1), None, 2, None, False, None, (8, 64), (4, 64), f16),
    ("shared-gqa8-k3v6", 64, 16, 1, 8, (45, 19), None, 2, None, True, 11, (3, 32), (6, 32), f32),
    # G 8, D 128: a key group's 4 lanes span V8's groups of 64 (ROW_PAIRS: a lane's pairs in one
    # 4-element load) but two of K8's groups of 32 (one pair an atom).
    ("shared-gqa8-k8g32-v8g64", 128, 16, 1, 8, (40, 21), None, 2, None, True, None, (8, 32), (8, 64), f32),
    # float16 over a float16 V: half partials, normalized (metal_layout.partials_dtype).
    ("register-gqa4-f16-sinks", 64, 16, 1, 4, (90, 7, 40), None, 3, None, True, None, None, None, f16),
]


@pytest.mark.parametrize("case", PAGED, ids=[c[0] for c in PAGED])
def test_attention_paged(case):
    _, head_dim, block_size, kv_heads, gqa, lens, rows, splits, softcap, use_sinks, window, kq, vq, dtype = case
    rng = np.random.default_rng(head_dim + gqa + len(lens))
    query, kc, vc, tables, seq_lens, sinks = paged_attention_inputs(
        rng, lens=lens, num_kv_heads=kv_heads, gqa=gqa, head_dim=head_dim, block_size=block_size, dtype=dtype,
        k_quant=kq, v_quant=vq, use_sinks=use_sinks, query_len=rows)
    options = dict(softcap=softcap, sinks=sinks, sliding_window=window)
    expected = ref.paged_attention(query, kc, vc, tables, seq_lens, **options)
    run_checked("sim", kv.paged_attention, expected, query, kc, vc, tables, seq_lens, num_splits=splits,
                kernel="paged_attention_partials", **options)


def test_attention_shared_quantized_tile_holds_centred_halves():
    """G 8 K8/V4 at D 128 (8 simdgroups x 1 row): the tile rows are D halves a side (the fill
    unpacks each element once per threadgroup), so 16 tokens with their scales take 16.5 KiB:
    within the 20 KiB budget (stop 50; 8 tokens within 16 KiB); the kernel declares what the
    layout says, and matches the oracle."""
    rng = np.random.default_rng(808)
    query, kc, vc, tables, seq_lens, _ = paged_attention_inputs(
        rng, lens=(41, 16), num_kv_heads=1, gqa=8, head_dim=128, block_size=16, dtype=f16,
        k_quant=(8, 64), v_quant=(4, 64), use_sinks=False)
    layout = metal_layout.layout_for(query[:, None], kc, vc, paged=True)
    assert (layout.simdgroups, layout.rows_per_simdgroup, layout.tile) == (8, 1, 16), layout
    rows = 128 * 2 + 128 * 2 + 4 * (128 // 64) * 2  # K and V halves, K and V scales and biases
    assert 2 * 16 * rows > 16 * 1024 and 2 * 16 * rows <= metal_layout.tile_memory_budget(128)
    expected = ref.paged_attention(query, kc, vc, tables, seq_lens)
    for call in run_checked("sim", kv.paged_attention, expected, query, kc, vc, tables, seq_lens, num_splits=2,
                            kernel="paged_attention_partials"):
        assert call.threadgroup_memory == layout.threadgroup_bytes == 17056


def _wide_key_groups(*a, **k):
    """layout_for with key groups of 16 lanes (D 64, K 8-bit and V 4-bit, group 32): atoms of
    one packed word, K's an odd AE4 (1 half4), V's an even one (2)."""
    lay = metal_layout.layout_for(*a, **k)
    return dataclasses.replace(lay, lanes_per_key=16, key_atom_words=metal_layout._atom_words(64, 8, 32, 16),
                               value_atom_words=metal_layout._atom_words(64, 4, 32, 16))


def test_attention_shared_tile_one_word_atoms(monkeypatch):
    """Shared mode's tile atoms read a unit of two half4s (one 16-byte load) where the atom's
    AE4 is even, one half4 where it is odd: 8-bit atoms of one word (AE4 1), forced by a key
    group of 16 lanes at D 64, next to 4-bit ones (AE4 2) - both branches against the oracle."""
    monkeypatch.setattr(metal, "layout_for", _wide_key_groups)
    rng = np.random.default_rng(116)
    query, kc, vc, tables, seq_lens, sinks = paged_attention_inputs(
        rng, lens=(45, 19), num_kv_heads=1, gqa=8, head_dim=64, block_size=16, dtype=f32,
        k_quant=(8, 32), v_quant=(4, 32), use_sinks=True)
    expected = ref.paged_attention(query, kc, vc, tables, seq_lens, sinks=sinks)
    calls = run_checked("sim", kv.paged_attention, expected, query, kc, vc, tables, seq_lens, sinks=sinks,
                        num_splits=2, kernel="paged_attention_partials")
    assert all("_tt" in c.name and "_tt0_" not in c.name and "_kaw1_" in c.name and "_vaw1_" in c.name
               for c in calls), calls[0].name


def test_attention_modes_are_both_covered():
    """The PAGED rows named register/shared run in that mode (a mutant in either is seen)."""
    for name, head_dim, block_size, kv_heads, gqa, lens, rows, *_ , kq, vq, dtype in PAGED:
        q = mx.zeros((len(lens), rows or 1, kv_heads * gqa, head_dim), dtype=dtype)
        kc = maybe_quantize(mx.zeros((2, kv_heads, block_size, head_dim), dtype=dtype), kq)
        vc = maybe_quantize(mx.zeros((2, kv_heads, block_size, head_dim), dtype=dtype), vq)
        layout = metal_layout.layout_for(q, kc, vc, paged=True)
        shared = layout.rows_per_simdgroup < gqa * (rows or 1)
        assert shared == name.startswith("shared"), (name, layout)


def test_attention_paged_register_in_pass_loads(monkeypatch):
    """Register mode's in-pass loads (PF 0, which the layout takes only for one D 512 row
    whose pipelined atoms pass 128 registers) forced at D 64: one row per kv head,
    several splits, a sink and a window, so a mutant of that loop is seen without a D 512
    compile."""
    rng = np.random.default_rng(64)
    query, kc, vc, tables, seq_lens, sinks = paged_attention_inputs(
        rng, lens=(1, 45, 70), num_kv_heads=2, gqa=1, head_dim=64, block_size=16, dtype=f32, use_sinks=True)
    monkeypatch.setattr(metal, "layout_for", lambda *a, **k: dataclasses.replace(
        metal_layout.layout_for(*a, **k), prefetch=False))
    options = dict(sinks=sinks, sliding_window=50)
    expected = ref.paged_attention(query, kc, vc, tables, seq_lens, **options)
    calls = run_checked("sim", kv.paged_attention, expected, query, kc, vc, tables, seq_lens, num_splits=3,
                        kernel="paged_attention_partials", **options)
    assert all("_pf0_" in call.name for call in calls)


def test_attention_paged_grown_windows(monkeypatch):
    """Windows cut by the length (num_splits=None) that grow twice at a few hundred tokens
    (divisor 1; register mode's growth 2): the kernel's windows must be the host's
    (metal_layout.split_window) - shorter ones drop keys the split count does not cover,
    longer ones leave fewer live windows than the host's rule."""
    monkeypatch.setenv("KVMETAL_METAL_WINDOW_DIV", "1")
    monkeypatch.delenv("KVMETAL_METAL_WINDOW_GROWTH", raising=False)
    lens, gqa, head_dim = (1500, 700, 40), 2, 64
    rng = np.random.default_rng(1500)
    query, kc, vc, tables, seq_lens, sinks = paged_attention_inputs(
        rng, lens=lens, num_kv_heads=1, gqa=gqa, head_dim=head_dim, block_size=32, dtype=f32, use_sinks=True)
    expected = ref.paged_attention(query, kc, vc, tables, seq_lens, sinks=sinks)
    calls = run_checked("sim", kv.paged_attention, expected, query, kc, vc, tables, seq_lens, sinks=sinks,
                        kernel="paged_attention_partials")
    grow = metal_layout.window_growth(True)
    assert grow > 1
    windows = [metal_layout.split_window(n, metal_layout.SPLIT_TOKENS, metal_layout.SPLIT_WINDOW_MAX, 1, grow)
               for n in lens]
    assert windows == [1024, 512, 256]
    live = sum(-(-n // w) for n, w in zip(lens, windows))
    assert calls[0].buffers["part_acc"].stored == live * gqa * head_dim * 4


# head_dim, kv heads, GQA, tokens, query rows, splits, softcap, sinks, K quant, V quant
CONTIGUOUS = [
    ("view-gqa3-sinks", 64, 2, 3, 50, 1, 3, None, True, None, None),
    ("view-rows4-k5v2-sinks", 64, 1, 2, 41, 4, 2, 6.0, True, (5, 32), (2, 64)),  # sinks: the reduce maps rows of [B, H, L] to heads
]


@pytest.mark.parametrize("case", CONTIGUOUS, ids=[c[0] for c in CONTIGUOUS])
def test_attention_decode_view(case):
    _, head_dim, kv_heads, gqa, tokens, rows, splits, softcap, use_sinks, kq, vq = case
    rng = np.random.default_rng(tokens)
    base_k = random(rng, (2, kv_heads + 1, tokens + 5, head_dim), f32)
    base_v = random(rng, (2, kv_heads + 1, tokens + 5, head_dim), f32)
    keys, values = base_k[:, 1:, 2:2 + tokens], base_v[:, 1:, 2:2 + tokens]  # strided views
    keys, values = maybe_quantize(keys, kq), maybe_quantize(values, vq)
    query = random(rng, (2, kv_heads * gqa, rows, head_dim), f32)
    sinks = mx.array(rng.standard_normal(kv_heads * gqa).astype(np.float32)) if use_sinks else None
    expected = ref.decode_attention(query, keys, values, softcap=softcap, sinks=sinks)
    run_checked("sim", kv.decode_attention, expected, query, keys, values, softcap=softcap, sinks=sinks,
                num_splits=splits, kernel="decode_attention_partials")


# dtype, D, BS, Hkv, G, seq lens, new rows per sequence, query scale, softcap, sinks, window, K, V quant
VARLEN = [
    # n > 8: the tiled kernel; scores past fast tanh's overflow (|s / softcap| >> 44).
    ("tiled-softcap-big-sinks", f32, 64, 8, 1, 2, (20, 45), (12, 17), 40.0, 5.0, True, None, None, None),
    ("tiled-window-k8v4", f32, 64, 16, 2, 1, (37, 30), (10, 3), 1.0, None, False, 9, (8, 32), (4, 32)),
    ("mixed-decode-rows", f32, 64, 8, 1, 4, (9, 26, 5), (9, 2, 5), 1.0, 3.0, False, None, None, None),
    # a short run through the decode partials (and one tiled) with 3/6-bit codes (kv_centred)
    ("decode-rows-k3v6", f32, 64, 8, 1, 2, (9, 26), (2, 12), 1.0, None, False, None, (3, 32), (6, 32)),
]


@pytest.mark.parametrize("case", VARLEN, ids=[c[0] for c in VARLEN])
def test_varlen(case):
    _, dtype, head_dim, block_size, kv_heads, gqa, lens, counts, qscale, softcap, use_sinks, window, kq, vq = case
    rng = np.random.default_rng(sum(lens))
    query, kc, vc, tables, seq_lens, qsl, sinks = varlen_inputs(
        rng, lens=lens, counts=counts, num_kv_heads=kv_heads, gqa=gqa, head_dim=head_dim, block_size=block_size,
        dtype=dtype, k_quant=kq, v_quant=vq, use_sinks=use_sinks)
    query = query * qscale
    options = dict(softcap=softcap, sinks=sinks, sliding_window=window)
    expected = ref.paged_attention_varlen(query, kc, vc, tables, seq_lens, qsl, **options)
    calls = run_checked("sim", kv.paged_attention_varlen, expected, query, kc, vc, tables, seq_lens, qsl,
                        kernel="paged_varlen_partials", **options)
    assert calls


def test_varlen_uneven_splits():
    # 3 K/V tiles of one query tile cut in 2 splits (the split length must round up).
    rng = np.random.default_rng(11)
    query, kc, vc, tables, seq_lens, qsl, _ = varlen_inputs(
        rng, lens=(90,), counts=(10,), num_kv_heads=1, gqa=1, head_dim=64, block_size=16, dtype=f32)
    expected = ref.paged_attention_varlen(query, kc, vc, tables, seq_lens, qsl)
    with run_on("sim", seed=1) as trace:
        out = sim_backend().paged_attention_varlen(
            query, kc, vc, tables, seq_lens, qsl, scale=64 ** -0.5, softcap=None, sliding_window=None, sinks=None,
            tiles=metal_layout.VarlenTiles(2, 32), num_splits=2)
        mx.eval(out)
    np.testing.assert_allclose(np.array(out), expected, rtol=1e-5, atol=1e-5)
    (call,) = [c for c in trace.calls if "paged_varlen_partials" in c.name]
    assert call.grid[2] == 2


# Split-D and sequential K/V (D 256 takes DS 2, D 512 DS 4 and SKV): forced at D 64, where
# each costs one small compile, so mutants of those paths are seen. (d_split, sequential_kv)
VARLEN_TILE_PATHS = [(2, False), (4, False), (1, True), (4, True)]


@pytest.mark.parametrize("d_split,sequential_kv", VARLEN_TILE_PATHS,
                         ids=[f"ds{d}-skv{int(s)}" for d, s in VARLEN_TILE_PATHS])
def test_varlen_split_d_and_sequential_kv(d_split, sequential_kv):
    rng = np.random.default_rng(10 * d_split + sequential_kv)
    query, kc, vc, tables, seq_lens, qsl, sinks = varlen_inputs(
        rng, lens=(70, 21), counts=(19, 21), num_kv_heads=1, gqa=2, head_dim=64, block_size=8, dtype=f32,
        use_sinks=True)
    options = dict(softcap=5.0, sinks=sinks, sliding_window=None)
    expected = ref.paged_attention_varlen(query, kc, vc, tables, seq_lens, qsl, **options)
    tiles = metal_layout.VarlenTiles(4, 16, d_split=d_split, sequential_kv=sequential_kv)
    with run_on("sim", seed=1) as trace:
        out = sim_backend().paged_attention_varlen(query, kc, vc, tables, seq_lens, qsl, scale=64 ** -0.5,
                                                   tiles=tiles, num_splits=2, **options)
        mx.eval(out)
    np.testing.assert_allclose(np.array(out), expected, rtol=1e-5, atol=1e-5)
    (call,) = [c for c in trace.calls if "paged_varlen_partials" in c.name]
    assert call.grid[2] == 2


# prefix lens, own lens, prefix of each sequence, GQA, query scale, softcap, sinks, K, V quant, dtype
CASCADE = [
    # Two prefixes (3 members and 1), a sequence without one; scores past fast tanh's overflow.
    ("members-softcap-big-sinks", (32, 16), (3, 17, 0, 5, 9), (0, 0, 1, 0, -1), 4, 40.0, 5.0, True, None, None,
     f32),
    ("chunks-k8v4", (48,), (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13), (0,) * 13, 8, 1.0, None, False, 8, 4, f32),
    # float16: half partials in both passes (prefix and own), normalized; the last sequence
    # has no prefix and no own token, and there is no sink: its row sees nothing (zeros).
    ("members-f16-empty-row", (40,), (3, 0, 9, 0), (0, 0, -1, -1), 4, 1.0, None, False, None, None, f16),
    # 3/6-bit codes (kv_centred: values that straddle words, one at a time)
    ("members-k3v6", (32,), (3, 9), (0, -1), 2, 1.0, None, False, 3, 6, f32),
    # Shared-mode quantized tiles (G 8: 8 simdgroups x 1 row, 8 keys a pass), queries x 1000:
    # scores thousands apart, one-hot rows; a running max that missed a key of a pass would
    # overflow its weight.
    ("members-k8v4-hot", (48,), (3, 9, 1), (0, 0, -1), 8, 1000.0, None, False, 8, 4, f32),
]


@pytest.mark.parametrize("case", CASCADE, ids=[c[0] for c in CASCADE])
def test_cascade(case):
    _, prefix_lens, own_lens, prefix_of, gqa, qscale, softcap, use_sinks, k_bits, v_bits, dtype = case
    args, sinks = cascade_case(prefix_lens, own_lens, prefix_of, num_kv_heads=1, gqa=gqa, head_dim=64,
                               block_size=16, dtype=dtype, k_bits=k_bits, v_bits=v_bits, group_size=32,
                               seed=len(own_lens), sinks=use_sinks)
    args["query"] = args["query"] * qscale
    options = dict(softcap=softcap, sinks=sinks)
    expected = ref.paged_attention_cascade(*args.values(), **options)
    run_checked("sim", kv.paged_attention_cascade, expected, *args.values(), kernel="cascade_partials", **options)


@pytest.mark.parametrize("group_size", [64, 32])
def test_cascade_shared_row_pairs(group_size):
    """The cascade's shared-mode tiles at G 8, D 128, K8 / V8: in groups of 64 a key group's 4
    lanes span one group, so each lane loads its two atoms' pairs at once (ROW_PAIRS); in groups
    of 32 they span two, one pair an atom."""
    args, sinks = cascade_case((48,), (3, 20, 1), (0, 0, -1), num_kv_heads=1, gqa=8, head_dim=128, block_size=16,
                               dtype=f32, k_bits=8, v_bits=8, group_size=group_size, seed=12, sinks=True)
    expected = ref.paged_attention_cascade(*args.values(), sinks=sinks)
    calls = run_checked("sim", kv.paged_attention_cascade, expected, *args.values(), kernel="cascade_partials",
                        sinks=sinks)
    assert all("_tt0_" not in c.name and "_lpk4_" in c.name and "_kaw4_" in c.name for c in calls), calls[0].name


def test_cascade_register_in_pass_loads(monkeypatch):
    """The cascade's register mode with in-pass loads (PF 0, as one D 512 row takes it),
    forced at D 64: its prefix and own partials walk the same loop as the paged kernel's."""
    monkeypatch.setattr(metal, "layout_for", lambda *a, **k: dataclasses.replace(
        metal_layout.layout_for(*a, **k), prefetch=False))
    args, sinks = cascade_case((70,), (5, 41, 1), (0, 0, -1), num_kv_heads=2, gqa=1, head_dim=64, block_size=16,
                               dtype=f32, k_bits=None, v_bits=None, group_size=32, seed=7, sinks=True)
    expected = ref.paged_attention_cascade(*args.values(), sinks=sinks)
    calls = run_checked("sim", kv.paged_attention_cascade, expected, *args.values(), kernel="cascade_partials",
                        sinks=sinks)
    assert all("_pf0_" in call.name for call in calls)


def test_cascade_shared_tile_one_word_atoms(monkeypatch):
    """The cascade's shared-mode tile atoms of one word (AE4 odd for K, even for V), as in
    test_attention_shared_tile_one_word_atoms."""
    monkeypatch.setattr(metal, "layout_for", _wide_key_groups)
    args, sinks = cascade_case((40,), (3, 17, 6), (0, 0, -1), num_kv_heads=1, gqa=8, head_dim=64, block_size=16,
                               dtype=f32, k_bits=8, v_bits=4, group_size=32, seed=16, sinks=True)
    expected = ref.paged_attention_cascade(*args.values(), sinks=sinks)
    calls = run_checked("sim", kv.paged_attention_cascade, expected, *args.values(), kernel="cascade_partials",
                        sinks=sinks)
    assert all("_tt0_" not in c.name and "_kaw1_" in c.name and "_vaw1_" in c.name for c in calls), calls[0].name


@pytest.mark.parametrize("growth", ["1", "2"])
def test_cascade_grown_windows(monkeypatch, growth):
    """The cascade's windows grown at a few hundred tokens (divisor 1) at growth 1 (its
    default) and 2 (KVMETAL_METAL_WINDOW_GROWTH): prefix and own windows must be the host's."""
    monkeypatch.setenv("KVMETAL_METAL_WINDOW_DIV", "1")
    monkeypatch.setenv("KVMETAL_METAL_WINDOW_GROWTH", growth)
    args, sinks = cascade_case((1500,), (700, 9, 1100), (0, 0, -1), num_kv_heads=1, gqa=2, head_dim=64,
                               block_size=32, dtype=f32, k_bits=None, v_bits=None, group_size=32, seed=11,
                               sinks=True)
    expected = ref.paged_attention_cascade(*args.values(), sinks=sinks)
    run_checked("sim", kv.paged_attention_cascade, expected, *args.values(), kernel="cascade_partials", sinks=sinks)
    with run_on("sim", seed=0) as trace:
        mx.eval(kv.paged_attention_cascade(*args.values(), sinks=sinks))
    w = lambda n: metal_layout.split_window(n, metal_layout.SPLIT_TOKENS, metal_layout.SPLIT_WINDOW_MAX, 1,
                                            int(growth))
    # live windows x rows: the own pass (3 sequences x 2 heads), then the prefix chunk (its 2
    # members x 2 heads)
    own = sum(-(-n // w(n)) for n in (700, 9, 1100)) * 2
    prefix = -(-1500 // w(1500)) * 2 * 2
    stored = [c.buffers["part_acc"].stored // (64 * 4) for c in trace.calls if "cascade_partials" in c.name]
    assert stored == [own, prefix]


def test_cascade_occupancy_splits(monkeypatch):
    """The cascade under KVMETAL_METAL_SPLITS=occupancy: equal runs of whole 32-token units
    (kv_split_range's num_splits branch), a count that does not divide the units, so the last
    split is short and no token may fall between two."""
    monkeypatch.setenv("KVMETAL_METAL_SPLITS", "occupancy")
    args, sinks = cascade_case((1000,), (300, 9, 700), (0, 0, -1), num_kv_heads=1, gqa=2, head_dim=64,
                               block_size=32, dtype=f32, k_bits=None, v_bits=None, group_size=32, seed=12,
                               sinks=True)
    expected = ref.paged_attention_cascade(*args.values(), sinks=sinks)
    calls = run_checked("sim", kv.paged_attention_cascade, expected, *args.values(), kernel="cascade_partials",
                        sinks=sinks)
    splits = [c.grid[0] // c.threadgroup[0] for c in calls]  # own pass, then the prefix chunk
    assert all(s > 1 for s in splits), splits
    assert any(units % s for units, s in zip((-(-700 // 32), -(-1000 // 32)), splits)), splits


@pytest.mark.parametrize("qspec", [None, (3, 32)], ids=["float", "k3"])
def test_cache_copy_gather_rows(qspec):
    rng = np.random.default_rng(5)
    kc, vc, tables, seq_lens = paged_cache(rng, lens=(1, 37, 16), num_kv_heads=2, head_dim=64, block_size=8,
                                           dtype=f32)
    kc = maybe_quantize(kc, qspec)
    expected = ref.gather_kv_cache(kc, vc, tables, seq_lens, max_len=44)
    with run_on("sim", seed=1):
        keys, values = kv.gather_kv_cache(kc, vc, tables, seq_lens, max_len=44)
        mx.eval(keys, values)
    # float rows are copies; dequantized rows are MLX's affine map in float32
    np.testing.assert_allclose(np.array(keys), expected[0], rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(np.array(values), expected[1])


@pytest.mark.parametrize("bits,group_size,rows_dtype", [(None, None, f32), (8, 64, f32), (3, 32, f16),
                                                        (5, 32, f32)], ids=["convert", "q8", "q3", "q5"])
def test_cache_write_rows_bit_exact(bits, group_size, rows_dtype):
    rng = np.random.default_rng(bits or 0)
    slots = [5, -1, 0, 17, 30, 12]
    rows = random(rng, (len(slots), 2, 64), rows_dtype) * 3
    rows = mx.concatenate([rows[:-1], mx.full((1, 2, 64), 0.75, dtype=rows_dtype)])  # a constant row
    cache = random(rng, (4, 2, 8, 64), f16)
    if bits is not None:
        cache = quant.quantize(cache, bits=bits, group_size=group_size)
    with run_on("sim", seed=1):
        new, _ = kv.reshape_and_cache(rows, rows, cache, cache, mx.array(np.array(slots, np.int32)))
        mx.eval(*(new.arrays() if bits else (new,)))
    if bits is None:
        fresh, before, after = (rows.astype(f16),), (cache,), (new,)
    else:
        q = quant.quantize(rows.astype(f32), bits=bits, group_size=group_size)
        fresh, before, after = (q.data, q.scales.astype(f16), q.biases.astype(f16)), cache.arrays(), new.arrays()
    for want_rows, old, got in zip(fresh, before, after):
        want = np.array(old).copy()
        for t, slot in enumerate(slots):
            if slot >= 0:
                want[slot // 8, :, slot % 8] = np.array(want_rows)[t]
        np.testing.assert_array_equal(np.array(got), want)


def test_cache_copy_blocks_exact():
    rng = np.random.default_rng(6)
    kc = quant.quantize(random(rng, (6, 2, 8, 64), f16), bits=4, group_size=32)
    vc = random(rng, (6, 2, 8, 64), f32)
    src, dst = mx.array([0, 3, 3], dtype=mx.int32), mx.array([5, 1, 2], dtype=mx.int32)
    expected = ref.copy_blocks(kc, vc, src, dst)
    with run_on("sim", seed=1):
        new_k, new_v = kv.copy_blocks(kc, vc, src, dst)
    for got, want in zip((new_k, new_v), expected):
        assert np.array_equal(ref.to_f64(got), want)
    old = kc.arrays()
    for part, got in zip(old, new_k.arrays()):
        np.testing.assert_array_equal(np.array(got)[[5, 1, 2]], np.array(part)[[0, 3, 3]])
