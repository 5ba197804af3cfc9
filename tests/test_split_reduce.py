"""Issue 41, P3 and P2 on the simulator: empty splits write only (max, sum) and
return; the reduces fold splits in two phases (lane-parallel max, then a fixed-order
sum), one exp2 per lane and split that saw a key; a row's result does not depend on
the launch's split count. Counted with the simulator's per-buffer bytes and math calls."""
import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import reference as ref
from kvmetal import sim
from kvmetal.backends import metal_layout

from kvcases import assert_close, paged_attention_inputs

D, HKV, G = 64, 2, 4
LENS = (600, 37, 1, 300)


def _run(lens, *, use_sinks, seed=0):
    rng = np.random.default_rng(seed)
    q, kc, vc, tables, seq_lens, sinks = paged_attention_inputs(
        rng, lens=lens, num_kv_heads=HKV, gqa=G, head_dim=D, block_size=16, dtype=mx.float32, use_sinks=use_sinks)
    with sim.trace(strict=True, seed=0) as t, kv.use_backend("sim"):
        out = kv.paged_attention(q, kc, vc, tables, seq_lens, sinks=sinks)
        mx.eval(out)
    assert_close(out, ref.paged_attention(q, kc, vc, tables, seq_lens, sinks=sinks), mx.float32)
    partials = next(c for c in t.calls if "paged_attention_partials" in c.name)
    reduce = next(c for c in t.calls if "attention_reduce" in c.name)
    return (q, kc, vc, tables, seq_lens, sinks), out, partials, reduce


def _live_splits(n):
    return -(-n // metal_layout.SPLIT_TOKENS)  # windows of SPLIT_TOKENS from position 0


def test_empty_splits_write_only_max_and_sum():
    _, _, partials, _ = _run(LENS, use_sinks=True)
    splits = partials.grid[0] // partials.threadgroup[0]
    assert splits == _live_splits(max(LENS)) == 3
    live = sum(_live_splits(n) for n in LENS)  # 3 + 1 + 1 + 2 of 12 splits
    # Every split writes (max, sum) of its G rows; only the live ones an accumulator.
    assert partials.buffers["part_max"].stored == len(LENS) * HKV * splits * G * 4
    assert partials.buffers["part_sum"].stored == len(LENS) * HKV * splits * G * 4
    assert partials.buffers["part_acc"].stored == live * HKV * G * D * 4, \
        "an empty split wrote its accumulator (before P3: all 12 splits did)"
    # and an empty split loads no query (before P3 every split loaded q)
    rows_q_bytes = G * D * 4
    assert partials.buffers["query"].loaded <= live * HKV * rows_q_bytes * 32


def test_reduce_is_two_phase_one_exp2_per_lane_and_live_split():
    _, _, partials, reduce = _run(LENS, use_sinks=False)
    rows = len(LENS) * HKV * G
    assert reduce.collectives.get("simd_max", 0) == rows  # phase 1: one simd_max per row
    # phase 2: lane j weighs split j of each block of 32 (every live split but the one
    # holding the row max, whose weight is exactly 1) and the walk takes the weights by
    # shuffle: one exp2 per live split (before: every lane weighed every split, 32 x).
    want = sum(G * HKV * (_live_splits(n) - 1) for n in LENS)
    assert reduce.math.get("exp2", 0) == want, reduce.math
    # the walk loads no split's max or sum: each lane loads one of each per block of 32
    # splits in each phase (before: every lane loaded every split's, a chain as long as
    # the splits)
    splits = reduce.buffers["part_max"].size // 4 // rows
    assert reduce.buffers["part_max"].load_ops <= 2 * reduce.threads * -(-splits // 32)


def test_a_rows_result_does_not_depend_on_the_split_count():
    # The same sequence alone (2 splits) and next to a longer one (the launch gets 8):
    # its rows are bitwise the same (empty splits are skipped; the sum's order is fixed).
    args_a, out_a, partials_a, _ = _run((300,), use_sinks=True, seed=3)
    rng = np.random.default_rng(11)
    q, kc, vc, tables, seq_lens, sinks = args_a
    q2, kc2, vc2, tables2, lens2, _ = paged_attention_inputs(
        rng, lens=(2000,), num_kv_heads=HKV, gqa=G, head_dim=D, block_size=16, dtype=mx.float32)
    nb = kc.shape[0]
    kc_all = mx.concatenate([kc, kc2], axis=0)
    vc_all = mx.concatenate([vc, vc2], axis=0)
    width = max(tables.shape[1], tables2.shape[1])
    t1 = np.full((1, width), 0, np.int32)
    t1[0, :tables.shape[1]] = np.array(tables)[0]
    t2 = np.array(tables2) + nb
    t2 = np.pad(t2, ((0, 0), (0, width - t2.shape[1])))
    both_tables = mx.array(np.concatenate([t1, t2]).astype(np.int32))
    with sim.trace(strict=True, seed=1) as t, kv.use_backend("sim"):
        out = kv.paged_attention(mx.concatenate([q, q2]), kc_all, vc_all, both_tables,
                                 mx.array([300, 2000], mx.int32), sinks=sinks)
        mx.eval(out)
    splits = next(c for c in t.calls if "paged_attention_partials" in c.name).grid[0] // partials_a.threadgroup[0]
    assert splits > partials_a.grid[0] // partials_a.threadgroup[0]
    np.testing.assert_array_equal(np.array(out[0]), np.array(out_a[0]))


def test_split_window_is_a_function_of_the_length():
    # Issue 41, P4: windows of clamp(pow2ceil(len) / div, 256, 2048) tokens, div 8 while the
    # window is 256 and 16 once it has grown (growth 2, stop 50; div 32 and no growth before
    # bench/window_policy.py's modelled sweeps): 8 windows up to 4K, 16 from 8K to 32K.
    w = lambda n: metal_layout.split_window(n, metal_layout.SPLIT_TOKENS, metal_layout.SPLIT_WINDOW_MAX,
                                            metal_layout.SPLIT_WINDOW_DIV, metal_layout.SPLIT_WINDOW_GROWTH)
    assert [w(n) for n in (1, 256, 2048, 2049, 4096, 4097, 8192, 8193, 16384, 16385, 32768, 32769, 1 << 20)] == \
        [256, 256, 256, 512, 512, 512, 512, 1024, 1024, 2048, 2048, 2048, 2048]
    # growth 1 is the rule before stop 50
    w1 = lambda n: metal_layout.split_window(n, 256, 2048, 8, 1)
    assert [w1(n) for n in (2048, 2049, 4097, 8193, 16385)] == [256, 512, 1024, 2048, 2048]
    # the launch's split count bounds every length up to the work (brute force), at each growth
    for grow, wn in ((metal_layout.SPLIT_WINDOW_GROWTH, w), (1, w1), (4, lambda n: metal_layout.split_window(n, 256, 2048, 8, 4))):
        for work in (1, 255, 256, 4097, 8192, 8193, 9000, 16384, 16385, 20000, 65537, 200000):
            most = max(-(-n // wn(n)) for n in range(1, work + 1))
            assert metal_layout.window_splits(work, metal_layout.SPLIT_TOKENS, misaligned=False,
                                              split_max=metal_layout.SPLIT_WINDOW_MAX,
                                              split_div=metal_layout.SPLIT_WINDOW_DIV, split_grow=grow) == most, (grow, work)
    assert metal_layout.window_splits(32768, 256, misaligned=False, split_max=2048, split_div=32, split_grow=1) == 32


def test_long_sequence_gets_length_windows_and_stays_batch_invariant():
    # A 9000-token sequence: windows of 1024 (9 live splits, not 36 of 256); its rows are the
    # same bits alone and next to a short sequence; both match the oracle.
    rng = np.random.default_rng(5)
    q, kc, vc, tables, seq_lens, sinks = paged_attention_inputs(
        rng, lens=(9000, 40), num_kv_heads=1, gqa=1, head_dim=64, block_size=32, dtype=mx.float32, use_sinks=True)
    outs = []
    for batch in (1, 2):
        with sim.trace(strict=True, seed=batch) as t, kv.use_backend("sim"):
            out = kv.paged_attention(q[:batch], kc, vc, tables[:batch], seq_lens[:batch], sinks=sinks)
            mx.eval(out)
        outs.append(out)
        partials = next(c for c in t.calls if "paged_attention_partials" in c.name)
        splits = partials.grid[0] // partials.threadgroup[0]
        assert splits >= 9  # the launch bounds any length up to the table's
        assert partials.buffers["part_acc"].stored == (9 + (batch == 2)) * 1 * 64 * 4
    np.testing.assert_array_equal(np.array(outs[0][0]), np.array(outs[1][0]))
    assert_close(outs[1], ref.paged_attention(q, kc, vc, tables, seq_lens, sinks=sinks), mx.float32)


def test_window_divisor_is_a_parameter_for_a_mac(monkeypatch):
    # KVMETAL_METAL_WINDOW_DIV and _GROWTH (issue 41, P4: a window size only a Mac can
    # choose): a 1100-token sequence is cut into 5 windows of 256 by default; div 2 makes it
    # 3 of 512 (the divisor 4 once grown), div 2 at growth 1 2 of 1024. The split count and
    # the kernels' windows read the same values, and every run matches the oracle.
    rng = np.random.default_rng(11)
    inputs = paged_attention_inputs(rng, lens=(1100,), num_kv_heads=1, gqa=2, head_dim=64, block_size=16,
                                    dtype=mx.float32, use_sinks=False)
    q, kc, vc, tables, seq_lens, _ = inputs
    stored = {}
    for div, grow in ((None, None), ("2", None), ("2", "1")):
        for name, value in (("KVMETAL_METAL_WINDOW_DIV", div), ("KVMETAL_METAL_WINDOW_GROWTH", grow)):
            if value is None:
                monkeypatch.delenv(name, raising=False)
            else:
                monkeypatch.setenv(name, value)
        with sim.trace(strict=True, seed=0) as t, kv.use_backend("sim"):
            out = kv.paged_attention(q, kc, vc, tables, seq_lens)
            mx.eval(out)
        assert_close(out, ref.paged_attention(q, kc, vc, tables, seq_lens), mx.float32)
        partials = next(c for c in t.calls if "paged_attention_partials" in c.name)
        stored[div, grow] = partials.buffers["part_acc"].stored // (2 * 64 * 4)  # live windows
    assert stored == {(None, None): 5, ("2", None): 3, ("2", "1"): 2}
    for bad in ("3", "-1", "x", "2048"):
        monkeypatch.setenv("KVMETAL_METAL_WINDOW_DIV", bad)
        with pytest.raises(ValueError, match="KVMETAL_METAL_WINDOW_DIV"):
            metal_layout.window_div()
    for bad in ("0", "3", "8", "x"):
        monkeypatch.setenv("KVMETAL_METAL_WINDOW_GROWTH", bad)
        with pytest.raises(ValueError, match="KVMETAL_METAL_WINDOW_GROWTH"):
            metal_layout.window_growth(True)


@pytest.mark.parametrize("gqa, register_mode", [(2, True), (16, False)])
def test_window_growth_follows_the_launch_mode(monkeypatch, gqa, register_mode):
    # Growth 2 halves register mode's windows from 4K to 16K (more threadgroups at batch 1);
    # shared mode keeps growth 1 (bench/window_policy.json). A 4500-token sequence: 9 windows
    # of 512 in register mode, 5 of 1024 in shared mode; KVMETAL_METAL_WINDOW_GROWTH overrides
    # both. The launch's params carry the growth its split count used, and the result is right.
    monkeypatch.delenv("KVMETAL_METAL_WINDOW_GROWTH", raising=False)
    rng = np.random.default_rng(23)
    q, kc, vc, tables, seq_lens, _ = paged_attention_inputs(
        rng, lens=(4500,), num_kv_heads=1, gqa=gqa, head_dim=64, block_size=32, dtype=mx.float16, use_sinks=False)
    expect = ref.paged_attention(q, kc, vc, tables, seq_lens)
    live = {}
    for grow in (None, "1", "2"):
        if grow is not None:
            monkeypatch.setenv("KVMETAL_METAL_WINDOW_GROWTH", grow)
        with sim.trace(strict=True, seed=0) as t, kv.use_backend("sim"):
            out = kv.paged_attention(q, kc, vc, tables, seq_lens)
            mx.eval(out)
        assert_close(out, expect, mx.float16)
        partials = next(c for c in t.calls if "paged_attention_partials" in c.name)
        assert (int(partials.name.split("_rps")[1].split("_")[0]) >= gqa) == register_mode
        live[grow] = partials.buffers["part_acc"].stored // (gqa * 64 * 2)  # half partials; empty windows store none
    assert live == {None: 9 if register_mode else 5, "1": 5, "2": 9}


def test_tuning_variables_set_unset_and_restore(monkeypatch):
    # metal_layout.tuning_variables (the sweep's and bench/window_policy.py's way to run under a
    # Mac's setting): a value sets, None unsets, and every variable is as before afterwards,
    # also when the block raises.
    monkeypatch.setenv("KVMETAL_METAL_WINDOW_DIV", "4")
    monkeypatch.delenv("KVMETAL_METAL_WINDOW_GROWTH", raising=False)
    names = {"KVMETAL_METAL_WINDOW_DIV": None, "KVMETAL_METAL_WINDOW_GROWTH": 1}
    with pytest.raises(RuntimeError):
        with metal_layout.tuning_variables(names):
            assert metal_layout.window_div() == metal_layout.SPLIT_WINDOW_DIV
            assert metal_layout.window_growth(True) == 1
            raise RuntimeError
    assert metal_layout.window_div() == 4
    assert metal_layout.window_growth(True) == metal_layout.SPLIT_WINDOW_GROWTH
