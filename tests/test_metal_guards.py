"""The Metal kernels' own index guards (issue 10 item 6), proven by the simulator.

With ``validate=False`` the host checks are skipped, so the kernels see raw caller
indices. The simulator bounds-checks every device access and raises
``OutOfBoundsError`` on any read or write outside a buffer; these tests pass only
if the guards hold: a slot outside the cache is skipped, a block id outside
[0, N) or a length beyond the block table is padding, never dereferenced.
"""
import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import quant
from kvmetal import reference as ref

from kvcases import paged_cache, random, run_on

BLOCK, HEADS, D = 8, 2, 64
BAD_IDS = (-1, 7, 2**31 - 1, -(2**31))  # 7 == N: one past the end


def _cache(rng, lens=(20, 9), quantized=False):
    kc, vc, tables, seq_lens = paged_cache(rng, lens=lens, num_kv_heads=HEADS, head_dim=D, block_size=BLOCK,
                                           dtype=mx.float32, spare_blocks=2)
    if quantized:
        kc = quant.quantize(kc, bits=8, group_size=32)
    return kc, vc, tables, seq_lens


@pytest.mark.parametrize("bad", BAD_IDS)
@pytest.mark.parametrize("quantized", [False, True])
def test_paged_attention_treats_bad_block_ids_as_padding(bad, quantized):
    rng = np.random.default_rng(3)
    kc, vc, tables, seq_lens = _cache(rng, quantized=quantized)
    assert kc.shape[0] == 7
    t = np.array(tables)
    t[0, 1] = bad  # tokens 8..15 of sequence 0 sit in a block that does not exist
    query = random(rng, (2, 3, 2 * HEADS, D), mx.float32)
    with run_on("sim", seed=2):
        out = kv.paged_attention(query, kc, vc, mx.array(t), seq_lens, validate=False)
        mx.eval(out)
    out = np.array(out)
    assert np.isfinite(out).all()
    # The bad block's tokens are left out: the oracle over a cache where they are
    # masked by a window cannot express that, so compare to the tokens that remain.
    keep = [i for i in range(20) if not 8 <= i < 16]
    gathered = kv.gather_kv_cache(kc, vc, tables, seq_lens)
    keys = np.array(gathered[0].astype(mx.float32))[0][:, keep]
    values = np.array(gathered[1].astype(mx.float32))[0][:, keep]
    q = np.array(query[0, -1])  # the last row sees every remaining token
    g = q.shape[0] // HEADS
    for h in range(q.shape[0]):
        s = keys[h // g] @ q[h] / np.sqrt(D)
        p = np.exp(s - s.max())
        np.testing.assert_allclose(out[0, -1, h], p @ values[h // g] / p.sum(), atol=1e-5)


@pytest.mark.parametrize("length", [10**6, 2**31 - 1, -5])
def test_lengths_beyond_the_table_are_cut_and_negative_ones_are_empty(length):
    rng = np.random.default_rng(4)
    kc, vc, tables, seq_lens = _cache(rng)
    lens = np.array(seq_lens)
    lens[1] = length
    query = random(rng, (2, 2 * HEADS, D), mx.float32)
    with run_on("sim", seed=1):
        out = np.array(kv.paged_attention(query, kc, vc, tables, mx.array(lens), validate=False))
        keys, values = kv.gather_kv_cache(kc, vc, tables, mx.array(lens), max_len=40, validate=False)
        mx.eval(keys, values)
    if length < 0:
        assert not out[1].any() and not np.array(keys)[1].any()
    else:
        # Cut to the table: every slot of sequence 1's blocks is attended (NaN-poisoned
        # tails included, so the output is NaN there, but nothing outside the cache is read).
        assert np.array(keys).shape == (2, HEADS, 40, D)
    np.testing.assert_allclose(out[0], ref.paged_attention(query, kc, vc, tables, seq_lens)[0], atol=1e-5)


@pytest.mark.parametrize("bad", BAD_IDS)
def test_gather_treats_bad_block_ids_as_zero_rows(bad):
    rng = np.random.default_rng(5)
    kc, vc, tables, seq_lens = _cache(rng)
    t = np.array(tables)
    t[0, 0] = bad
    with run_on("sim", seed=0):
        keys, values = kv.gather_kv_cache(kc, vc, mx.array(t), seq_lens, validate=False)
        mx.eval(keys, values)
    expected = ref.gather_kv_cache(kc, vc, tables, seq_lens)
    k = np.array(keys)
    assert not k[0, :, :BLOCK].any()
    np.testing.assert_allclose(k[0, :, BLOCK:20], expected[0][0, :, BLOCK:20], atol=0)


@pytest.mark.parametrize("quantized", [False, True])
@pytest.mark.parametrize("slots", [(3, 10**6), (10**6, 2**31 - 1), (56, -1)])
def test_reshape_and_cache_skips_slots_outside_the_cache(slots, quantized):
    rng = np.random.default_rng(6)
    shape = (7, HEADS, BLOCK, D)  # 56 slots
    kc0, vc0 = random(rng, shape, mx.float16), random(rng, shape, mx.float16)
    if quantized:
        kc0 = quant.quantize(kc0, bits=4, group_size=32)
    key, value = random(rng, (2, HEADS, D), mx.float32), random(rng, (2, HEADS, D), mx.float32)
    slot_mapping = mx.array(np.array(slots, np.int64))
    with run_on("sim", seed=0):
        kc, vc = kv.reshape_and_cache(key, value, kc0, vc0, slot_mapping, validate=False)
        mx.eval(kc, vc)
    real = [(i, s) for i, s in enumerate(slots) if 0 <= s < 56]
    expected_v = np.array(vc0.astype(mx.float32))
    for i, s in real:
        expected_v[s // BLOCK, :, s % BLOCK] = np.array(value[i].astype(mx.float16).astype(mx.float32))
    np.testing.assert_array_equal(np.array(vc.astype(mx.float32)), expected_v)
    if not quantized:
        untouched = np.ones(56, bool)
        untouched[[s for _, s in real]] = False
        before = np.array(kc0.astype(mx.float32)).transpose(0, 2, 1, 3).reshape(56, -1)
        after = np.array(kc.astype(mx.float32)).transpose(0, 2, 1, 3).reshape(56, -1)
        np.testing.assert_array_equal(after[untouched], before[untouched])


@pytest.mark.parametrize("pairs", [((1, 2), (7, 3)), ((2**31 - 1, 5), (-1, 2**31 - 1)), ((4, 4), (0, -3))])
def test_copy_blocks_skips_pairs_outside_the_cache(pairs):
    rng = np.random.default_rng(7)
    shape = (7, HEADS, BLOCK, D)
    kc0, vc0 = random(rng, shape, mx.float32), random(rng, shape, mx.float32)
    src = mx.array(np.array([p[0] for p in pairs], np.int64))
    dst = mx.array(np.array([p[1] for p in pairs], np.int64))
    with run_on("sim", seed=0):
        kc, vc = kv.copy_blocks(kc0, vc0, src, dst, validate=False)
        mx.eval(kc, vc)
    expected = np.array(kc0)
    for s, d in pairs:
        if 0 <= s < 7 and 0 <= d < 7:
            expected[d] = np.array(kc0)[s]
    np.testing.assert_array_equal(np.array(kc), expected)


@pytest.mark.parametrize("splits", [2**31 - 1, 2**40])
def test_huge_split_counts_are_cut_to_the_useful_maximum(splits):
    """Issue 10 item 4 on the metal backend: a split count past ceil(tokens / 32) adds
    only empty splits, so the backend cuts it there (no giant partials, no int32 overflow)."""
    from kvmetal.backends import metal_layout
    from kvmetal.sim.backend import sim_backend
    from kvmetal import sim

    rng = np.random.default_rng(8)
    kc, vc, tables, seq_lens = _cache(rng)
    query = random(rng, (2, 1, 2 * HEADS, D), mx.float32)
    options = dict(scale=D ** -0.5, softcap=None, sliding_window=None, sinks=None)
    backend = sim_backend()
    with sim.trace() as t:
        out = backend.paged_attention(query, kc, vc, tables, seq_lens, num_splits=splits, **options)
        mx.eval(out)
    call = next(c for c in t.calls if "paged_attention_partials" in c.name)
    units = -(-tables.shape[1] * BLOCK // metal_layout.SPLIT_UNIT)
    assert call.threadgroups == units * HEADS * 2
    np.testing.assert_allclose(np.array(out), ref.paged_attention(query, kc, vc, tables, seq_lens), atol=1e-5)
