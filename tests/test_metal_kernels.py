"""Every metal kernel against the NumPy float64 oracles, run by the simulator
(strict checks, two schedule seeds) and, on a Mac, by the real Metal backend.

The shape matrix is a covering subset, not a product: each row changes several
axes at once so that every dtype, head_dim (64..256), block size (8/16/32), GQA
factor (1, 2, 3, 4, 6, 8, 16), quantized format and option (softcap, sinks, sliding
window, odd split counts, length 1, lengths off the block grid) appears, and
each axis meets the others in some row.
"""
import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import quant
from kvmetal.backends import metal_layout
from kvmetal.sim.backend import sim_backend
from kvmetal import reference as ref

from kvcases import (TOLERANCE, assert_close, backend_params, kernel_backends, maybe_quantize,
                     paged_attention_inputs, paged_cache, random, rel_error, run_checked, run_on)

f32, f16, bf16 = mx.float32, mx.float16, mx.bfloat16

# dtype, head_dim, block_size, kv heads, GQA, seq lens, splits, softcap, sinks, window, K quant, V quant
PAGED = [
    (f32, 64, 8, 2, 1, (1, 37), None, None, False, None, None, None),
    (f16, 80, 16, 2, 4, (17, 100), 3, 30.0, False, None, None, None),
    (bf16, 96, 32, 1, 6, (64, 5), 5, None, True, None, None, None),
    (f16, 112, 8, 1, 8, (200, 1), None, None, False, 37, None, None),
    (f32, 128, 16, 3, 1, (33,), 7, 20.0, True, 20, None, None),
    (bf16, 192, 8, 2, 4, (9, 70), 1, None, False, None, None, None),
    (f16, 256, 32, 1, 6, (45, 130), 3, None, True, 64, None, None),
    (f32, 256, 16, 1, 8, (81,), 2, 50.0, False, None, None, None),
    (bf16, 64, 32, 1, 16, (150, 31), None, 10.0, True, 100, None, None),
    (f16, 128, 16, 2, 2, (60, 19), 3, None, True, None, None, None),
    (f32, 80, 8, 1, 3, (25, 2), None, 5.0, False, 9, None, None),
    (f16, 256, 8, 1, 16, (70,), 4, None, True, None, (8, 64), (4, 64)),
    # quantized: default K8/V4, straddling 3/5/6-bit, mixed float and quantized
    (f16, 128, 16, 2, 4, (77, 3), 3, None, False, None, (8, 64), (4, 64)),
    (bf16, 96, 8, 1, 6, (40,), None, 15.0, True, None, (3, 32), (6, 32)),
    (f32, 64, 32, 2, 1, (1, 65), 5, None, False, 33, (5, 32), (2, 64)),
    (f16, 256, 16, 1, 8, (50,), 2, None, True, None, None, (4, 128)),
    (f32, 128, 8, 1, 4, (29,), None, None, False, None, (6, 128), None),
    # shared mode, a key group's 4 lanes over one group of 64 (ROW_PAIRS): float32 and bfloat16 pairs
    (f32, 128, 16, 1, 8, (90, 33), 3, None, True, None, (8, 64), (8, 64)),
    (bf16, 128, 8, 2, 6, (61,), None, 20.0, False, None, (8, 64), (4, 64)),
]


def _ids(cases):
    return [f"{str(c[0]).split('.')[-1]}-d{c[1]}-bs{c[2]}-g{c[4]}-{i}" for i, c in enumerate(cases)]


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("case", PAGED, ids=_ids(PAGED))
def test_paged_attention(case, backend):
    dtype, head_dim, block_size, num_kv_heads, gqa, lens, splits, softcap, use_sinks, window, kq, vq = case
    rng = np.random.default_rng(head_dim + gqa)
    query, kc, vc, tables, seq_lens, sinks = paged_attention_inputs(
        rng, lens=lens, num_kv_heads=num_kv_heads, gqa=gqa, head_dim=head_dim, block_size=block_size, dtype=dtype,
        k_quant=kq, v_quant=vq, use_sinks=use_sinks)
    options = dict(softcap=softcap, sinks=sinks, sliding_window=window)
    expected = ref.paged_attention(query, kc, vc, tables, seq_lens, **options)
    layout = metal_layout.layout_for(query[:, None], kc, vc, paged=True)
    for call in run_checked(backend, kv.paged_attention, expected, query, kc, vc, tables, seq_lens,
                            num_splits=splits, kernel="paged_attention_partials", **options):
        # The description's threadgroup memory is what the MSL declares.
        assert call.threadgroup_memory == layout.threadgroup_bytes
        if splits is not None and window is None:
            # Requested splits, cut to the whole SPLIT_UNIT-token runs the table holds.
            units = -(-tables.shape[1] * block_size // metal_layout.SPLIT_UNIT)
            assert call.grid[0] == min(splits, units) * layout.threads


# dtype, head_dim, kv heads, GQA, tokens, splits, softcap, sinks, view, K quant, V quant
CONTIGUOUS = [
    (f32, 64, 2, 1, 1, None, None, False, "slice_t", None, None),
    (f16, 128, 2, 4, 77, 3, 25.0, True, "slice_t", None, None),
    (bf16, 80, 1, 6, 130, 5, None, False, "slice_heads", None, None),
    (f16, 256, 1, 8, 45, None, None, True, "transposed", None, None),
    (f32, 192, 2, 1, 33, 7, None, False, "contiguous", None, None),
    (f16, 112, 2, 2, 64, 2, None, False, "slice_heads", None, None),
    (f16, 128, 2, 4, 90, 3, None, False, "slice_t", (8, 64), (4, 64)),
    (bf16, 96, 1, 6, 17, None, 10.0, True, "contiguous", (3, 32), (5, 32)),
]


def _view(x, view, tokens, num_kv_heads):
    """A view of ``x`` with ``tokens`` rows and ``num_kv_heads`` heads that is not a fresh array."""
    if view == "slice_t":
        return x[:, :num_kv_heads, 3: 3 + tokens]
    if view == "slice_heads":
        return x[:, 1: 1 + num_kv_heads, :tokens]
    if view == "transposed":  # built as [B, T, Hkv, D], read as [B, Hkv, T, D]
        return x.transpose(0, 2, 1, 3)
    return x


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("case", CONTIGUOUS, ids=[f"{c[8]}-d{c[1]}-g{c[3]}-{i}" for i, c in enumerate(CONTIGUOUS)])
def test_decode_attention_reads_views_in_place(case, backend):
    dtype, head_dim, num_kv_heads, gqa, tokens, splits, softcap, use_sinks, view, kq, vq = case
    rng = np.random.default_rng(tokens)
    batch, num_heads = 2, num_kv_heads * gqa
    if view == "transposed":
        shape = (batch, tokens, num_kv_heads, head_dim)
    else:
        shape = (batch, num_kv_heads + 2, tokens + 7, head_dim)
    base_k, base_v = random(rng, shape, dtype), random(rng, shape, dtype)
    keys, values = (_view(b, view, tokens, num_kv_heads) for b in (base_k, base_v))
    if view in ("contiguous",):
        keys, values = keys[:, :num_kv_heads, :tokens], values[:, :num_kv_heads, :tokens]
        keys, values = mx.array(np.array(keys.astype(mx.float32))).astype(dtype), \
            mx.array(np.array(values.astype(mx.float32))).astype(dtype)
    keys, values = maybe_quantize(keys, kq), maybe_quantize(values, vq)
    query = random(rng, (batch, num_heads, 1, head_dim), dtype)
    sinks = mx.array(rng.standard_normal(num_heads).astype(np.float32)) if use_sinks else None
    expected = ref.decode_attention(query, keys, values, softcap=softcap, sinks=sinks)
    calls = run_checked(backend, kv.decode_attention, expected, query, keys, values, softcap=softcap, sinks=sinks,
                        num_splits=splits, kernel="decode_attention_partials")
    for call in calls if kq is None and view.startswith("slice") else ():
        # Read in place: the kernel's buffer spans the strided view, which a
        # compact copy (exactly keys.nbytes) would not.
        assert call.buffers["key_data"].size > keys.nbytes


GATHER = [
    (f32, 64, 8, 2, (1, 37), None, None),
    (f16, 128, 16, 1, (17, 50), 40, None),
    (bf16, 256, 32, 2, (33,), 80, None),
    (f16, 96, 8, 2, (9, 20), None, (8, 32)),
    (bf16, 192, 16, 1, (31, 2), 24, (3, 64)),
    (f32, 128, 32, 1, (40,), None, (6, 128)),
]


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("case", GATHER, ids=[f"d{c[1]}-bs{c[2]}-{i}" for i, c in enumerate(GATHER)])
def test_gather_kv_cache(case, backend):
    dtype, head_dim, block_size, num_kv_heads, lens, max_len, kq = case
    rng = np.random.default_rng(head_dim)
    kc, vc, tables, seq_lens = paged_cache(rng, lens=lens, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                           block_size=block_size, dtype=dtype)
    kc = maybe_quantize(kc, kq)
    expected = ref.gather_kv_cache(kc, vc, tables, seq_lens, max_len=max_len)
    with run_on(backend, seed=1):
        keys, values = kv.gather_kv_cache(kc, vc, tables, seq_lens, max_len=max_len)
        mx.eval(keys, values)
    assert keys.dtype == dtype and values.dtype == dtype
    for out, exp in zip((keys, values), expected):
        assert out.shape == exp.shape
        assert_close(out, exp, dtype)
    # Rows past each sequence's length are exactly zero.
    k = np.array(keys.astype(mx.float32))
    for s, n in enumerate(lens):
        assert not k[s, :, n:].any()


WRITES = [
    (f32, f16, 64, 8, 2, (5, -1, 0, 17), None),
    (f16, bf16, 128, 16, 1, (3, 40, -1), None),
    (bf16, f32, 256, 32, 2, (-1, 1), None),
    (f32, f16, 128, 16, 2, (5, -1, 0, 33, 12), (8, 64)),
    (f16, f16, 96, 8, 1, (7, 2, -1), (3, 32)),
    (bf16, bf16, 192, 32, 1, (0, 64), (6, 64)),
    (f32, f32, 64, 16, 2, (4, 9), (5, 32)),
    (f16, f16, 128, 8, 1, (1, 2), (2, 128)),
]


def expected_quantized_rows(rows, cache_dtype, bits, group_size):
    """What a quantized cache write stores for ``rows``: ``mx.quantize`` of the rows in
    float32 arithmetic (the kernel reads every row dtype as float), with scales and biases
    rounded to the cache's dtype."""
    q = quant.quantize(rows.astype(f32), bits=bits, group_size=group_size)
    return q.data, q.scales.astype(cache_dtype), q.biases.astype(cache_dtype)


def _host_bits(a: mx.array) -> np.ndarray:
    """The raw bits of an array (bfloat16 as uint16), for bit-exact comparisons."""
    return np.array(a.view(mx.uint16)) if a.dtype == bf16 else np.array(a)


@pytest.mark.parametrize("backend", kernel_backends() + backend_params(("cpu",)))
@pytest.mark.parametrize("case", WRITES, ids=[f"d{c[2]}-{c[6]}-{i}" for i, c in enumerate(WRITES)])
def test_reshape_and_cache(case, backend):
    rows_dtype, cache_dtype, head_dim, block_size, num_kv_heads, slots, qspec = case
    rng = np.random.default_rng(head_dim + len(slots))
    num_blocks = 4
    shape = (num_blocks, num_kv_heads, block_size, head_dim)
    key = random(rng, (len(slots), num_kv_heads, head_dim), rows_dtype)
    value = random(rng, (len(slots), num_kv_heads, head_dim), rows_dtype)
    slot_mapping = mx.array(np.array(slots, np.int32))
    kc0, vc0 = random(rng, shape, cache_dtype), random(rng, shape, cache_dtype)
    written = {s for s in slots if s >= 0}
    if qspec is None:
        with run_on(backend, seed=0):
            kc, vc = kv.reshape_and_cache(key, value, kc0, vc0, slot_mapping)
            mx.eval(kc, vc)
        for out, before, rows in ((kc, kc0, key), (vc, vc0, value)):
            assert out.dtype == cache_dtype
            # A conversion is MLX's own astype, bit for bit; untouched slots are unchanged.
            want = np.array(before.view(mx.uint16) if cache_dtype == bf16 else before).copy()
            new = _host_bits(rows.astype(cache_dtype))
            for t, slot in enumerate(slots):
                if slot >= 0:
                    want[slot // block_size, :, slot % block_size] = new[t]
            np.testing.assert_array_equal(_host_bits(out), want)
        return
    bits, group_size = qspec
    kq0, vq0 = quant.quantize(kc0, bits=bits, group_size=group_size), quant.quantize(vc0, bits=8, group_size=group_size)
    with run_on(backend, seed=0):
        kq, vq = kv.reshape_and_cache(key, value, kq0, vq0, slot_mapping)
        mx.eval(*kq.arrays(), *vq.arrays())
    for new_rows, before, after in ((key, kq0, kq), (value, vq0, vq)):
        fresh = expected_quantized_rows(new_rows, cache_dtype, after.bits, group_size)
        for part, old, got, rows in zip(("data", "scales", "biases"), before.arrays(), after.arrays(), fresh):
            want = _host_bits(old).copy()
            rows = _host_bits(rows)
            for t, slot in enumerate(slots):
                if slot >= 0:
                    want[slot // block_size, :, slot % block_size] = rows[t]
            got = _host_bits(got)
            if backend == "metal":
                # The GPU's division may put a value on a rounding boundary one code away;
                # only there is a tolerance allowed (on the dequantized rows).
                break
            np.testing.assert_array_equal(got, want, err_msg=f"{part} differs from mx.quantize")
        if backend == "metal":
            got = np.array(quant.dequantize(after).astype(f32))
            want = np.array(quant.dequantize(before).astype(f32))
            for t, slot in enumerate(slots):
                if slot >= 0:
                    want[slot // block_size, :, slot % block_size] = np.array(quant.dequantize(
                        quant.QuantizedKV(*fresh, after.bits, group_size)).astype(f32))[t]
            step = np.abs(np.array(after.scales.astype(f32))).max()
            assert np.abs(got - want).max() <= 1.01 * step
            assert np.mean(np.abs(got - want) > TOLERANCE[cache_dtype] * np.abs(want).max()) < 0.01
        for slot in range(num_blocks * block_size):
            if slot not in written:
                b, o = divmod(slot, block_size)
                assert np.array_equal(np.array(after.data[b, :, o]), np.array(before.data[b, :, o]))


def test_reshape_and_cache_all_padding_is_a_no_op():
    rng = np.random.default_rng(3)
    kc0 = random(rng, (2, 1, 8, 64), f16)
    key = random(rng, (2, 1, 64), f16)
    with run_on("sim"):
        kc, vc = kv.reshape_and_cache(key, key, kc0, kc0, mx.array([-1, -1], dtype=mx.int32))
    assert np.array_equal(np.array(kc), np.array(kc0))


@pytest.mark.parametrize("backend", kernel_backends())
@pytest.mark.parametrize("qspec", [None, (4, 64), (3, 32)])
def test_copy_blocks(qspec, backend):
    rng = np.random.default_rng(5)
    kc0, vc0 = random(rng, (6, 2, 16, 128), bf16), random(rng, (6, 2, 16, 128), bf16)
    kc0, vc0 = maybe_quantize(kc0, qspec), maybe_quantize(vc0, qspec)
    src, dst = mx.array([0, 3, 3], dtype=mx.int32), mx.array([5, 1, 2], dtype=mx.int32)
    expected = ref.copy_blocks(kc0, vc0, src, dst)
    with run_on(backend, seed=1):
        kc, vc = kv.copy_blocks(kc0, vc0, src, dst)
    for out, exp in zip((kc, vc), expected):
        got = ref.to_f64(out)
        assert np.array_equal(got, exp)


def _data_pointer(a: mx.array) -> int:
    view = np.asarray(a)
    address = view.__array_interface__["data"][0]
    del view
    return address


@pytest.mark.parametrize("backend", kernel_backends())
def test_cache_write_is_in_place(backend):
    """MLX donates the cache buffer to the scatter: no copy of the cache, same memory."""
    rng = np.random.default_rng(7)
    kc = mx.zeros((2048, 2, 16, 64), dtype=f16)
    vc = mx.zeros((2048, 2, 16, 64), dtype=f16)
    mx.eval(kc, vc)
    k_address, v_address = _data_pointer(kc), _data_pointer(vc)
    key = random(rng, (3, 2, 64), f16)
    slots = mx.array([5, 700, 2000], dtype=mx.int32)
    mx.eval(key, slots)
    with run_on(backend):
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        kc, vc = kv.reshape_and_cache(key, key, kc, vc, slots)
        mx.eval(kc, vc)
        grown = mx.get_peak_memory() - before
    assert _data_pointer(kc) == k_address and _data_pointer(vc) == v_address
    assert grown < kc.nbytes / 4, f"peak grew by {grown} bytes for a {kc.nbytes}-byte cache"
    assert np.array_equal(np.array(kc[5 // 16, :, 5 % 16]), np.array(key[0]))


@pytest.mark.parametrize("backend", kernel_backends())
def test_decode_attention_reads_quantized_views_in_place(backend):
    rng = np.random.default_rng(11)
    full_k, full_v = random(rng, (2, 3, 60, 128), f16), random(rng, (2, 3, 60, 128), f16)
    kq, vq = quant.quantize(full_k, bits=8, group_size=64), quant.quantize(full_v, bits=4, group_size=32)

    def window(q):  # kv heads 1..2, tokens 7..49 of the packed arrays, no copy
        return q.replace(*(a[:, 1:3, 7:50] for a in q.arrays()))

    keys, values = window(kq), window(vq)
    query = random(rng, (2, 8, 1, 128), f16)
    expected = ref.decode_attention(query, keys, values)
    with run_on(backend, seed=1) as trace:
        out = kv.decode_attention(query, keys, values, num_splits=3)
        mx.eval(out)
    assert_close(out, expected, f16)
    if trace is not None:
        call = next(c for c in trace.calls if "decode_attention_partials" in c.name)
        assert call.buffers["key_data"].size > keys.data.nbytes
        assert call.buffers["value_scales"].size > values.scales.nbytes


def test_kernels_are_built_once_per_specialisation():
    rng = np.random.default_rng(2)
    kc, vc, tables, seq_lens = paged_cache(rng, lens=(20,), num_kv_heads=1, head_dim=64, block_size=8, dtype=f16)
    query = random(rng, (1, 4, 64), f16)
    backend = sim_backend()
    assert sim_backend() is backend
    before = set(backend._kernels)  # other tests in this process may have built kernels already
    with run_on("sim"):
        mx.eval(kv.paged_attention(query, kc, vc, tables, seq_lens))
        built = dict(backend._kernels)
        mx.eval(kv.paged_attention(query * 2, kc, vc, tables, seq_lens))
    assert backend._kernels == built
    names = [n for n in set(built) - before if "paged_attention_partials" in n]
    assert names and all(n.startswith("kvmetal_paged_attention_partials_tqf16_tkf16") for n in names)


def test_split_count_changes_only_rounding():
    rng = np.random.default_rng(9)
    kc, vc, tables, seq_lens = paged_cache(rng, lens=(300, 45), num_kv_heads=2, head_dim=128, block_size=16,
                                           dtype=f32)
    query = random(rng, (2, 8, 128), f32)
    outs = []
    with run_on("sim", seed=3):
        for splits in (1, 2, 7, 19, None):
            outs.append(np.array(kv.paged_attention(query, kc, vc, tables, seq_lens, num_splits=splits,
                                                    sinks=mx.zeros((8,)))))
    for out in outs[1:]:
        assert rel_error(out, outs[0]) <= 1e-6  # per (sequence, head) row
