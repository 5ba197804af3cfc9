"""The quantized KV format: NumPy references against MLX, the empty-cache factory, validation."""
import itertools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvmetal import quant
from kvmetal.quant import (
    SUPPORTED_BITS,
    SUPPORTED_GROUP_SIZES,
    QuantizedKV,
    check_layout,
    dequantize_reference,
    pack_codes,
    quantize_rows,
    unpack_codes,
)

DTYPES = (mx.float32, mx.float16, mx.bfloat16)
NP_DTYPE = {mx.float32: np.float32, mx.float16: np.float16}


def _np(a: mx.array) -> np.ndarray:
    return np.array(a.astype(mx.float32)) if a.dtype != mx.uint32 else np.array(a)


def _assert_same_as_mlx(x: mx.array, bits: int, group_size: int):
    w, s, b = mx.quantize(x, group_size=group_size, bits=bits)
    data, scales, biases = quantize_rows(x, bits=bits, group_size=group_size)
    np.testing.assert_array_equal(data, np.array(w))
    np.testing.assert_array_equal(scales, _np(s))
    np.testing.assert_array_equal(biases, _np(b))


# ----------------------------------------------------------------------------- bit layout

@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_pack_layout_matches_mlx_dequantize(bits):
    # scale 1, bias 0: mx.dequantize must read back exactly the codes we packed by hand.
    rng = np.random.default_rng(bits)
    codes = rng.integers(0, 1 << bits, size=(5, 128), dtype=np.uint32)
    words = pack_codes(codes, bits)
    assert words.shape == (5, 128 * bits // 32)
    ones = mx.ones((5, 128 // 32), dtype=mx.float32)
    got = mx.dequantize(mx.array(words), ones, mx.zeros_like(ones), group_size=32, bits=bits)
    np.testing.assert_array_equal(np.array(got), codes.astype(np.float32))
    np.testing.assert_array_equal(unpack_codes(words, bits), codes)


def test_three_bit_code_straddles_words():
    # code 10 starts at bit 30: its low two bits end word 0, its high bit starts word 1.
    codes = np.zeros((1, 32), dtype=np.uint32)
    codes[0, 10] = 0b101
    words = pack_codes(codes, 3)
    np.testing.assert_array_equal(words[0], [1 << 30, 1, 0])
    np.testing.assert_array_equal(unpack_codes(words, 3), codes)
    ones = mx.ones((1, 1), dtype=mx.float32)
    got = mx.dequantize(mx.array(words), ones, mx.zeros_like(ones), group_size=32, bits=3)
    assert float(got[0, 10]) == 5.0 and float(mx.abs(got).sum()) == 5.0


@pytest.mark.parametrize("bits", (5, 6))
def test_five_and_six_bit_codes_straddle_words(bits):
    # the code holding stream bits 30..: all ones must come back whole.
    codes = np.zeros((1, 64), dtype=np.uint32)
    straddler = next(i for i in range(64) if (i * bits) % 32 + bits > 32)
    codes[0, straddler] = (1 << bits) - 1
    words = pack_codes(codes, bits)
    word, offset = divmod(straddler * bits, 32)
    assert words[0, word] >> offset == (1 << (32 - offset)) - 1
    assert words[0, word + 1] == (1 << (bits - (32 - offset))) - 1
    np.testing.assert_array_equal(unpack_codes(words, bits), codes)


def test_pack_codes_rejects_codes_too_large():
    with pytest.raises(ValueError, match=r"\[pack_codes\] codes must be < 2\*\*4"):
        pack_codes(np.full((1, 32), 16), 4)


# ----------------------------------------------------------------------------- quantize_rows == mx.quantize

@pytest.mark.parametrize("dtype,bits,group_size",
                         list(itertools.product(DTYPES, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES)))
def test_quantize_rows_bit_exact(dtype, bits, group_size):
    mx.random.seed(bits * 1000 + group_size)
    x = (mx.random.normal((24, 256)) * 2.5 + 0.3).astype(dtype)
    _assert_same_as_mlx(x, bits, group_size)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_rows_bit_exact_on_awkward_groups(dtype, bits):
    g = 32
    rows = [
        np.zeros(g),                                   # all zero: q0 == 0, bias 0
        np.full(g, 3.0),                               # constant: scale clamps to 1e-7
        np.full(g, -2.5),
        np.linspace(-1.0, 1.0, g),                     # |min| == |max|
        np.linspace(-4.0, -1.0, g),                    # all negative
        np.linspace(0.5, 9.0, g),                      # all positive
        np.r_[np.full(g - 1, 1e-3), 100.0],            # one outlier
        np.r_[np.full(g - 1, 1e-8), -1e-8],            # below eps range
        np.arange(g) % 4 - 1.5,                        # exact half-way codes (ties)
    ]
    x = mx.array(np.stack(rows).astype(np.float32)).astype(dtype)
    _assert_same_as_mlx(x, bits, g)


@settings(max_examples=60, deadline=None)
@given(x=hnp.arrays(np.float32, (3, 64),
                    elements=st.floats(-1e4, 1e4, allow_nan=False, allow_infinity=False, width=32)),
       bits=st.sampled_from(SUPPORTED_BITS), group_size=st.sampled_from((32, 64)))
def test_quantize_rows_bit_exact_property(x, bits, group_size):
    _assert_same_as_mlx(mx.array(x), bits, group_size)


def test_quantize_rows_accepts_numpy_and_keeps_dtype():
    x = np.random.default_rng(0).standard_normal((4, 64)).astype(np.float16)
    data, scales, biases = quantize_rows(x, bits=4, group_size=32)
    w, s, b = mx.quantize(mx.array(x), group_size=32, bits=4)
    assert s.dtype == mx.float16
    np.testing.assert_array_equal(data, np.array(w))
    np.testing.assert_array_equal(scales, _np(s))
    assert scales.dtype == np.float32 and np.all(scales.astype(np.float16).astype(np.float32) == scales)


def test_quantize_rows_rejects_bad_input():
    with pytest.raises(TypeError, match=r"\[quantize_rows\] x must be a float16 or float32"):
        quantize_rows(np.zeros((2, 64), dtype=np.int32))
    with pytest.raises(ValueError, match=r"\[quantize_rows\] head_dim 80 is not a multiple of group_size 64"):
        quantize_rows(np.zeros((2, 80), dtype=np.float32), bits=4, group_size=64)
    with pytest.raises(ValueError, match=r"\[quantize_rows\] bits must be one of"):
        quantize_rows(np.zeros((2, 64), dtype=np.float32), bits=7, group_size=64)


# ----------------------------------------------------------------------------- dequantize_reference

@pytest.mark.parametrize("dtype,bits,group_size",
                         list(itertools.product(DTYPES, SUPPORTED_BITS, SUPPORTED_GROUP_SIZES)))
def test_dequantize_reference_matches_mlx(dtype, bits, group_size):
    mx.random.seed(7 + bits)
    x = (mx.random.normal((2, 3, 5, 128)) * 4).astype(dtype)
    q = quant.quantize(x, bits=bits, group_size=group_size)
    ref = dequantize_reference(q)
    assert ref.dtype == np.float64 and ref.shape == x.shape == q.shape
    got = np.array(quant.dequantize(q).astype(mx.float32), dtype=np.float64)
    # mx.dequantize rounds scale*q and then (+ bias) to the output dtype: <= 1 ulp each.
    codes = unpack_codes(np.array(q.data), bits).astype(np.float64)
    scaled = np.abs(codes * np.repeat(_np(q.scales), group_size, -1))
    eps = {mx.float32: 2.0**-23, mx.float16: 2.0**-10, mx.bfloat16: 2.0**-7}[dtype]
    assert np.all(np.abs(got - ref) <= eps * (scaled + np.abs(ref)) + 1e-30)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", (3, 4, 6, 8))
def test_mlx_dequantize_is_two_roundings_in_the_dtype(dtype, bits):
    # Documents MLX's CPU numerics exactly: out = rnd(rnd(scale * q) + bias) in the dtype.
    x = (mx.random.normal((16, 128), key=mx.random.key(bits)) * 3).astype(dtype)
    q = quant.quantize(x, bits=bits, group_size=64)
    rnd = lambda a: quant._round_to_dtype(a.astype(np.float32), dtype)
    codes = unpack_codes(np.array(q.data), bits).astype(np.float32)
    s = np.repeat(_np(q.scales), 64, -1)
    b = np.repeat(_np(q.biases), 64, -1)
    expected = rnd(rnd(codes * s) + b)
    np.testing.assert_array_equal(_np(quant.dequantize(q)), expected)


@pytest.mark.parametrize("bits", SUPPORTED_BITS)
def test_round_trip_error_is_half_a_step(bits):
    x = mx.random.normal((64, 128), key=mx.random.key(3))
    q = quant.quantize(x, bits=bits, group_size=32)
    err = np.abs(dequantize_reference(q) - np.array(x, dtype=np.float64))
    step = np.repeat(np.abs(_np(q.scales)), 32, -1)
    # Half a step, except where the code clipped: making the larger edge exact can
    # shrink the grid so the far edge falls just outside it (few bits, rint(q0) up).
    codes = unpack_codes(np.array(q.data), bits)
    clipped = (codes == 0) | (codes == (1 << bits) - 1)
    assert np.all((err <= step * (0.5 + 1e-5)) | clipped)
    # and more bits means a finer grid
    assert err.mean() < 2.0 ** -bits * 4


def test_reference_oracle_uses_the_hand_unpacker():
    from kvmetal import reference

    q = quant.quantize(mx.random.normal((1, 2, 4, 64), key=mx.random.key(1)), bits=5, group_size=32)
    np.testing.assert_array_equal(reference.to_f64(q), dequantize_reference(q))


# ----------------------------------------------------------------------------- cache factories

@pytest.mark.parametrize("bits,group_size", [(8, 64), (4, 64), (3, 32), (6, 128), (5, 32), (2, 128)])
def test_empty_like_layout(bits, group_size):
    c = quant.empty_like_layout((6, 2, 16, 128), bits=bits, group_size=group_size, dtype=mx.bfloat16)
    assert isinstance(c, QuantizedKV)
    assert c.shape == (6, 2, 16, 128) and c.head_dim == 128 and c.dtype == mx.bfloat16
    assert c.data.shape == (6, 2, 16, 128 * bits // 32) and c.data.dtype == mx.uint32
    assert c.scales.shape == c.biases.shape == (6, 2, 16, 128 // group_size)
    assert c.nbytes == 6 * 2 * 16 * quant.row_nbytes(128, bits=bits, group_size=group_size, scale_bytes=2)
    assert float(mx.abs(quant.dequantize(c)).max()) == 0.0


def test_empty_like_layout_matches_quantize():
    x = mx.random.normal((4, 2, 16, 128), key=mx.random.key(0)).astype(mx.float16)
    q = quant.quantize(x, bits=4, group_size=64)
    e = quant.empty_like_layout(x.shape, bits=4, group_size=64)
    assert [a.shape for a in q.arrays()] == [a.shape for a in e.arrays()]
    assert [a.dtype for a in q.arrays()] == [a.dtype for a in e.arrays()]


@pytest.mark.parametrize("shape,kwargs,error,match", [
    ((4, 128), dict(bits=7, group_size=64), ValueError, r"\[quantize\] bits must be one of \(2, 3, 4, 5, 6, 8\), got 7"),
    ((4, 128), dict(bits=4, group_size=48), ValueError, r"\[quantize\] group_size must be one of"),
    ((4, 128), dict(bits="4", group_size=64), TypeError, r"\[quantize\] bits must be an int"),
    ((4, 96), dict(bits=8, group_size=64), ValueError, r"\[quantize\] head_dim 96 is not a multiple of group_size 64"),
])
def test_empty_like_layout_rejects_bad_layouts(shape, kwargs, error, match):
    with pytest.raises(error, match=match):
        quant.empty_like_layout(shape, **kwargs)


def test_check_layout_messages():
    check_layout(128, bits=3, group_size=128)
    with pytest.raises(ValueError, match=r"\[paged_attention\] head_dim 80 is not a multiple of group_size 32"):
        check_layout(80, bits=4, group_size=32, op="paged_attention")
    with pytest.raises(TypeError, match=r"\[quantize\] group_size must be an int"):
        check_layout(64, bits=4, group_size=None)
    with pytest.raises(ValueError, match=r"\[quantize\] bits must be one of"):
        quant.quantize(mx.zeros((2, 64)), bits=1)


def test_check_bits_rejects_bools_and_names_the_argument():
    with pytest.raises(TypeError, match=r"\[budget\] --k-bits must be an int"):
        quant.check_bits(True, op="budget", name="--k-bits")
    assert quant.check_bits(np.int64(4)) == 4


def test_row_nbytes():
    # K8 at head_dim 128, group 64, float16 scales: 128 code bytes + 2 groups * (scale + bias) * 2 B
    assert quant.row_nbytes(128, bits=8, group_size=64) == 136
    assert quant.row_nbytes(128, bits=4, group_size=64) == 72
    assert quant.row_nbytes(128, bits=3, group_size=32, scale_bytes=4) == 48 + 32


# ----------------------------------------------------------------------------- backends write the same format

@pytest.mark.parametrize("backend", ("cpu", "sim"))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits,group_size", [(8, 64), (4, 64), (3, 32), (5, 128), (6, 64), (2, 32)])
def test_backend_cache_writes_are_bit_exact_with_quantize_rows(backend, dtype, bits, group_size):
    """reshape_and_cache into a quantized cache stores exactly what mx.quantize would."""
    import kvmetal as kv

    T, H, D, bs, N = 20, 2, 128, 16, 4
    key = (mx.random.normal((T, H, D), key=mx.random.key(bits)) * 3).astype(dtype)
    value = mx.random.normal((T, H, D), key=mx.random.key(bits + 50)).astype(dtype)
    kc, vc = (quant.empty_like_layout((N, H, bs, D), bits=bits, group_size=group_size, dtype=dtype)
              for _ in range(2))
    slots = np.random.default_rng(bits).permutation(N * bs)[:T]
    with kv.use_backend(backend):
        kc, vc = kv.reshape_and_cache(key, value, kc, vc, mx.array(slots, dtype=mx.int32))
    for cache, rows in ((kc, key), (vc, value)):
        # [N, H, bs, X] -> one row per slot: [N * bs, H, X], then the written slots
        by_slot = lambda a: _np(a).transpose(0, 2, 1, 3).reshape(N * bs, H, -1)[slots]
        data, scales, biases = quantize_rows(rows, bits=bits, group_size=group_size)
        np.testing.assert_array_equal(by_slot(cache.data), data)
        np.testing.assert_array_equal(by_slot(cache.scales), scales)
        np.testing.assert_array_equal(by_slot(cache.biases), biases)


def test_quantize_and_dequantize_reject_what_they_cannot_read():
    with pytest.raises(TypeError, match=r"\[quantize\] x must be an mx.array"):
        quant.quantize(np.zeros((2, 64), np.float32))
    with pytest.raises(TypeError, match=r"\[quantize\] x must be a float16, bfloat16 or float32 array"):
        quant.quantize(mx.zeros((2, 64), dtype=mx.int32))
    with pytest.raises(TypeError, match=r"\[quantize\] x must be a float16"):
        quant.quantize(mx.array(1.0))
    with pytest.raises(TypeError, match=r"\[dequantize\] q must be a QuantizedKV"):
        quant.dequantize(mx.zeros((2, 64)))
