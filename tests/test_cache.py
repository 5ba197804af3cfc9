"""PagedKVCache with real tensors: writes land where the tables say, copy-on-write keeps a
parent's rows intact, eviction works with windowed attention, KVCacheFull changes nothing.
Unowned blocks are NaN-poisoned so any stray read shows up in the results."""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import quant
from kvmetal.cache import KVCacheFull, PagedKVCache

H_KV, D, BS = 2, 64, 16


def make_cache(num_blocks=8, **kwargs) -> PagedKVCache:
    cache = PagedKVCache(num_layers=2, num_kv_heads=H_KV, head_dim=D, num_blocks=num_blocks, block_size=BS,
                         dtype=mx.float32, **kwargs)
    if not kwargs.get("k_bits") and not kwargs.get("v_bits"):
        poison = mx.full(cache.key_caches[0].shape, math.nan, dtype=mx.float32)
        cache.key_caches = [poison] * 2
        cache.value_caches = [poison] * 2
    return cache


def rows(rng, n):
    return mx.array(rng.standard_normal((n, H_KV, D)).astype(np.float32))


def one_filled_sequence(rng, tokens, cache=None, **kwargs):
    """``cache`` (default ``make_cache(**kwargs)``) holding sequence 0 with ``tokens``
    random rows written to every layer: (cache, keys, values)."""
    cache = make_cache(**kwargs) if cache is None else cache
    k, v = rows(rng, tokens), rows(rng, tokens)
    cache.add_sequence(0, num_tokens=tokens)
    fill(cache, 0, k, v)
    return cache, k, v


def gathered(cache, layer, seq):
    tables, lens = cache.block_tables([seq])
    k, v = kv.gather_kv_cache(cache.key_caches[layer], cache.value_caches[layer], tables, lens,
                              max_len=int(lens[0]))
    # [1, Hkv, T, D] -> [T, Hkv, D]
    return np.array(k[0].transpose(1, 0, 2)), np.array(v[0].transpose(1, 0, 2))


def fill(cache, seq, k, v, start=0):
    for layer in range(cache.num_layers):
        cache.write(layer, k * (layer + 1), v * (layer + 1), cache.slots(seq, start, start + k.shape[0]))


def test_writes_and_gathers_round_trip_per_layer():
    rng = np.random.default_rng(0)
    cache = make_cache()
    ka, va, kb, vb = rows(rng, 21), rows(rng, 21), rows(rng, 5), rows(rng, 5)
    cache.add_sequence("a", num_tokens=21)
    cache.add_sequence("b", num_tokens=5)
    fill(cache, "a", ka, va)
    fill(cache, "b", kb, vb)
    for layer in (0, 1):
        k, v = gathered(cache, layer, "a")
        np.testing.assert_array_equal(k, np.array(ka) * (layer + 1))
        np.testing.assert_array_equal(v, np.array(va) * (layer + 1))
        k, _ = gathered(cache, layer, "b")
        np.testing.assert_array_equal(k, np.array(kb) * (layer + 1))


def test_decode_attention_over_the_cache_matches_float64():
    rng = np.random.default_rng(1)
    cache, k, v = one_filled_sequence(rng, 37)
    query = mx.array(rng.standard_normal((1, 8, D)).astype(np.float32))
    tables, lens = cache.block_tables([0])
    out = kv.paged_attention(query, cache.key_caches[0], cache.value_caches[0], tables, lens)
    q, kk, vv = (np.array(x, dtype=np.float64) for x in (query[0], k, v))
    expected = np.stack([_attend(q[h], kk[:, h // 4], vv[:, h // 4]) for h in range(8)])
    np.testing.assert_allclose(np.array(out[0]), expected, rtol=1e-5, atol=1e-5)


def _attend(q, keys, values):
    s = keys @ q / math.sqrt(q.shape[0])
    w = np.exp(s - s.max())
    return (w / w.sum()) @ values


def test_fork_copy_on_write_keeps_the_parent_intact():
    rng = np.random.default_rng(2)
    cache = make_cache()
    k, v = rows(rng, 20), rows(rng, 20)
    cache.add_sequence("parent", num_tokens=20)
    fill(cache, "parent", k, v)
    cache.fork("parent", "child")
    assert cache.stats()["shared_blocks"] == 2
    ck, cv = rows(rng, 3), rows(rng, 3)
    slots = cache.append("child", num_tokens=3)
    for layer in (0, 1):
        cache.write(layer, ck, cv, slots)
    pk, _ = gathered(cache, 0, "parent")
    np.testing.assert_array_equal(pk, np.array(k))  # the child's writes are invisible
    chk, chv = gathered(cache, 1, "child")
    np.testing.assert_array_equal(chk[:20], np.array(k) * 2)  # the copied block kept the old rows
    np.testing.assert_array_equal(chk[20:], np.array(ck))
    np.testing.assert_array_equal(chv[:20], np.array(v) * 2)
    np.testing.assert_array_equal(chv[20:], np.array(cv))
    tp, tc = cache.allocator.block_table("parent"), cache.allocator.block_table("child")
    assert tp[0] == tc[0] and tp[1] != tc[1]  # full block shared, partial one copied
    assert cache.stats()["shared_blocks"] == 1


def test_quantized_pool_round_trips_like_mx_quantize():
    rng = np.random.default_rng(3)
    cache = make_cache(k_bits=8, v_bits=4)
    assert isinstance(cache.key_caches[0], quant.QuantizedKV) and cache.value_caches[0].bits == 4
    k, v = rows(rng, 19), rows(rng, 19)
    cache.add_sequence(0, num_tokens=19)
    for layer in (0, 1):
        cache.write(layer, k, v, cache.slots(0, 0, 19))
    gk, gv = gathered(cache, 1, 0)
    for got, x, bits in ((gk, k, 8), (gv, v, 4)):
        expected = np.array(quant.dequantize(quant.quantize(x, bits=bits, group_size=64)))
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)
    float_cache = make_cache()
    assert cache.nbytes < float_cache.nbytes / 2


def test_kv_cache_full_leaves_tensors_and_tables_unchanged():
    rng = np.random.default_rng(4)
    cache = make_cache(num_blocks=3)
    cache.add_sequence(0, num_tokens=40)
    fill(cache, 0, rows(rng, 40), rows(rng, 40))
    before_arrays = [np.array(a) for a in cache.arrays()]
    before_stats = cache.stats()
    with pytest.raises(KVCacheFull, match=r"\[append\] sequence 0 needs 1 blocks for 9 tokens, only 0 are free"):
        cache.append(0, num_tokens=9)
    with pytest.raises(KVCacheFull, match=r"\[add\]"):
        cache.add_sequence(1, num_tokens=1)
    assert cache.stats() == before_stats
    for a, b in zip(before_arrays, cache.arrays()):
        np.testing.assert_array_equal(a, np.array(b))
    cache.append(0, num_tokens=8)  # what still fits does


def test_grow_keeps_content_and_adds_free_blocks():
    rng = np.random.default_rng(5)
    cache, k, v = one_filled_sequence(rng, 30, num_blocks=2)
    cache.grow(3)
    assert cache.stats()["num_blocks"] == 5 and cache.allocator.num_free == 3
    assert cache.key_caches[0].shape == (6, H_KV, BS, D)  # 5 blocks and the null block
    np.testing.assert_array_equal(gathered(cache, 0, 0)[0], np.array(k))
    cache.append(0, num_tokens=40)


def test_evicted_blocks_are_reusable_and_windowed_attention_ignores_them():
    rng = np.random.default_rng(6)
    cache, k, v = one_filled_sequence(rng, 50, num_blocks=4)
    assert cache.evict(0, window=20) == 1  # tokens 0..15 are wholly outside the last 20
    evicted = [b for b in range(4) if cache.allocator.refcount[b] == 0]
    # Someone else takes the evicted block and writes garbage there.
    cache.add_sequence(1, num_tokens=16)
    assert cache.allocator.block_table(1) == evicted
    cache.write(0, mx.full((16, H_KV, D), math.nan), mx.full((16, H_KV, D), math.nan), cache.slots(1, 0, 16))
    query = mx.array(rng.standard_normal((1, 4, D)).astype(np.float32))
    tables, lens = cache.block_tables([0])
    out = kv.paged_attention(query, cache.key_caches[0], cache.value_caches[0], tables, lens, sliding_window=20)
    q, kk, vv = (np.array(x, dtype=np.float64) for x in (query[0], k, v))
    expected = np.stack([_attend(q[h], kk[30:, h // 2], vv[30:, h // 2]) for h in range(4)])
    np.testing.assert_allclose(np.array(out[0]), expected, rtol=1e-5, atol=1e-5)


def test_stats_and_nbytes():
    cache = make_cache(num_blocks=8)
    per_block = 2 * 2 * H_KV * BS * D * 4  # layers x (K, V) x heads x slots x dim x float32
    assert cache.nbytes == 9 * per_block and cache.bytes_per_block == per_block  # + the null block
    cache.add_sequence("a", list(range(40)))
    assert cache.add_sequence("b", list(range(40))) == 32
    s = cache.stats()
    assert s["used_blocks"] == 4 and s["shared_blocks"] == 2 and s["blocks_saved_by_sharing"] == 2
    assert s["used_bytes"] == 4 * per_block and s["tokens"] == 80 and s["sequences"] == 2
    cache.free("a")
    cache.free("b")
    s = cache.stats()
    assert s["used_blocks"] == 0 and s["cached_blocks"] == 2 and s["free_blocks"] == 6


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(block_size=12), ValueError, r"block_size must be one of"),
    (dict(num_blocks=0), ValueError, r"num_blocks must be an int >= 1"),
    (dict(head_dim=0), ValueError, r"head_dim must be an int >= 1"),
    (dict(dtype=mx.int32), TypeError, r"dtype must be one of"),
    (dict(k_bits=7), ValueError, r"k_bits must be None or one of"),
    (dict(v_bits=4, head_dim=80), ValueError, r"head_dim 80 is not a multiple of group_size 64"),
])
def test_bad_arguments(kwargs, error, match):
    args = dict(num_layers=1, num_kv_heads=1, head_dim=64, num_blocks=4, block_size=16)
    args.update(kwargs)
    with pytest.raises(error, match=r"\[PagedKVCache\] " + match):
        PagedKVCache(**args)


def test_prefix_sharing_never_serves_rows_overwritten_after_a_truncate():
    # issue 10 item 1, with tensors: the K/V C finds for its prefix are the rows of that prefix.
    rng = np.random.default_rng(7)
    cache = PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=64, num_blocks=8, block_size=8, dtype=mx.float32)
    prefix = list(range(100, 116))
    row_of = {}  # token id -> its K row (a deterministic stand-in for the model)

    def write(seq, start, tokens):
        k = mx.array(np.stack([row_of.setdefault(t, rng.standard_normal((1, 64)).astype(np.float32))
                               for t in tokens]))
        cache.write(0, k, k, cache.slots(seq, start, start + len(tokens)))

    write("A", cache.add_sequence("A", prefix + [1]), prefix + [1])
    assert cache.add_sequence("B", prefix + [1]) == 16
    write("B", 16, [1])
    cache.truncate("B", 12)
    cache.free("A")
    slots = cache.append("B", [7, 7, 7, 7])
    k = mx.array(np.stack([row_of.setdefault(7, rng.standard_normal((1, 64)).astype(np.float32))] * 4))
    cache.write(0, k, k, slots)
    cached = cache.add_sequence("C", prefix + [2])
    assert cached == 8
    write("C", cached, (prefix + [2])[cached:])
    got, _ = gathered(cache, 0, "C")
    np.testing.assert_array_equal(got, np.stack([row_of[t] for t in prefix + [2]]))


def test_write_checks_the_callers_slots():
    cache = make_cache(num_blocks=4)
    cache.add_sequence("a", num_tokens=20)
    k = mx.zeros((1, H_KV, D))
    for slots, match in [([4 * BS + 10**6], r"slots\[0\] = 1000064 is out of range \[0, 64\)"),
                         ([2**40], r"slots\[0\] = 1099511627776 is out of range"),
                         ([3 * BS], r"lies in block 3, which no sequence owns"),
                         ([4 * BS], r"slots\[0\] = 64 is out of range"),  # the null block is never written
                         ([[1]], r"1-D array of ints"),
                         (np.array([1.5]), r"1-D array of ints")]:
        with pytest.raises(ValueError, match=r"\[PagedKVCache.write\] .*" + match):
            cache.write(0, k, k, slots)
    with pytest.raises(ValueError, match=r"same slot twice"):
        cache.write(0, mx.zeros((2, H_KV, D)), mx.zeros((2, H_KV, D)), [3, 3])
    with pytest.raises(ValueError, match=r"layer must be an int in \[0, 2\)"):
        cache.write(2, k, k, [0])
    cache.fork("a", "b")
    with pytest.raises(ValueError, match=r"lies in block 1, which several sequences share"):
        cache.write(0, k, k, cache.slots("b", 19, 20))
    cache.write(0, k, k, [-1])  # a negative slot skips its row
    slots = cache.append("b", num_tokens=1)  # copy-on-write first: then b owns the block alone
    cache.write(0, k, k, slots)


def test_block_tables_of_no_sequences_and_evicted_entries_read_as_zeros():
    cache = make_cache(num_blocks=4)
    tables, lens = cache.block_tables([])
    assert tables.shape == (0, 1) and lens.shape == (0,)
    cache.key_caches = [mx.zeros(c.shape) for c in cache.key_caches]  # un-poison: the null block is zero
    cache.value_caches = list(cache.key_caches)
    rng = np.random.default_rng(8)
    cache.add_sequence(0, num_tokens=40)
    fill(cache, 0, rows(rng, 40), rows(rng, 40))
    assert cache.evict(0, window=8) == 2
    tables, _ = cache.block_tables([0])
    assert tables.tolist()[0][:2] == [cache.null_block] * 2
    k, _ = gathered(cache, 0, 0)
    assert not k[:32].any() and k[32:].all()  # zeros, never another block's real rows


def test_quantize_converts_the_pool_in_place_like_mx_quantize():
    rng = np.random.default_rng(9)
    cache = PagedKVCache(num_layers=2, num_kv_heads=H_KV, head_dim=D, num_blocks=4, block_size=BS, dtype=mx.float32)
    cache, k, v = one_filled_sequence(rng, 20, cache)
    cache.quantize(k_bits=8, v_bits=4)
    assert cache.key_caches[1].bits == 8 and cache.value_caches[1].bits == 4
    gk, gv = gathered(cache, 1, 0)
    for got, x, bits in ((gk, k * 2, 8), (gv, v * 2, 4)):
        np.testing.assert_allclose(got, np.array(quant.dequantize(quant.quantize(x, bits=bits))), atol=1e-6)
    cache.quantize(k_bits=8, v_bits=4)  # idempotent
    with pytest.raises(ValueError, match=r"k_bits: the pool already holds 8-bit rows"):
        cache.quantize(k_bits=4, v_bits=4)


def test_negative_token_ids_and_unsupported_head_dims_are_refused():
    with pytest.raises(ValueError, match=r"\[PagedKVCache\] head_dim must be one of .* got 65"):
        kv.PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=65, num_blocks=8, block_size=8)
    cache = kv.PagedKVCache(num_layers=1, num_kv_heads=1, head_dim=64, num_blocks=8, block_size=8)
    with pytest.raises(ValueError, match=r"\[add\] tokens must be token ids >= 0, got -1"):
        cache.add_sequence("a", [3, -1, 2])
    cache.add_sequence("a", [3, 1, 2])
    with pytest.raises(ValueError, match=r"\[append\] tokens must be token ids >= 0, got -7"):
        cache.append("a", [-7])
    assert cache.num_tokens("a") == 3
