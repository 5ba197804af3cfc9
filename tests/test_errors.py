"""Bad input raises ValueError/TypeError naming the argument, before any kernel runs."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import quant
from kvcases import no_kernels, paged_case  # noqa: F401 (no_kernels: an autouse fixture)


@pytest.fixture
def case():
    return paged_case([5, 30], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=mx.float16)


def attention(case, **overrides):
    args = dict(query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
                block_tables=case.block_tables, seq_lens=case.seq_lens)
    options = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    return kv.paged_attention(args["query"], args["key_cache"], args["value_cache"], args["block_tables"],
                              args["seq_lens"], **options)


def test_wrong_rank(case):
    with pytest.raises(ValueError, match=r"\[paged_attention\] query must have rank 3 .* or rank 4"):
        attention(case, query=case.query[None, None])
    with pytest.raises(ValueError, match=r"key_cache must have rank 4"):
        attention(case, key_cache=case.key_cache[0])
    with pytest.raises(ValueError, match=r"block_tables must have rank 2"):
        attention(case, block_tables=case.block_tables[0])
    with pytest.raises(ValueError, match=r"\[decode_attention\] query must have rank 4"):
        kv.decode_attention(mx.zeros((1, 8, 64)), mx.zeros((1, 2, 4, 64)), mx.zeros((1, 2, 4, 64)))


def test_wrong_dtype(case):
    with pytest.raises(TypeError, match=r"query must have dtype"):
        attention(case, query=case.query.astype(mx.int32))
    with pytest.raises(TypeError, match=r"key_cache and value_cache must have the same dtype"):
        attention(case, value_cache=case.value_cache.astype(mx.float32))
    with pytest.raises(TypeError, match=r"seq_lens must have dtype"):
        attention(case, seq_lens=case.seq_lens.astype(mx.float32))
    with pytest.raises(TypeError, match=r"slot_mapping must have dtype"):
        kv.reshape_and_cache(mx.zeros((1, 2, 64)), mx.zeros((1, 2, 64)), case.key_cache, case.value_cache,
                             mx.zeros((1,), dtype=mx.float32))
    with pytest.raises(TypeError, match=r"key_cache must be an mx.array"):
        attention(case, key_cache=np.zeros((4, 2, 16, 64)))


def test_mismatched_heads(case):
    with pytest.raises(ValueError, match=r"key must have shape \[T, 2, 64\]"):
        kv.reshape_and_cache(mx.zeros((1, 3, 64)), mx.zeros((1, 3, 64)), case.key_cache, case.value_cache,
                             mx.zeros((1,), dtype=mx.int32))
    with pytest.raises(ValueError, match=r"key_cache and value_cache must have the same shape"):
        attention(case, value_cache=case.value_cache[:, :1])
    with pytest.raises(ValueError, match=r"query head_dim 32 does not match"):
        attention(case, query=case.query[..., :32])


def test_gqa_not_divisible(case):
    with pytest.raises(ValueError, match=r"query heads \(7\) must be a multiple of kv heads \(2\)"):
        attention(case, query=case.query[:, :7])
    with pytest.raises(ValueError, match=r"\[decode_attention\] query heads \(3\)"):
        kv.decode_attention(mx.zeros((1, 3, 1, 64)), mx.zeros((1, 2, 4, 64)), mx.zeros((1, 2, 4, 64)))


def test_unsupported_head_dim_and_block_size():
    cache = mx.zeros((4, 2, 16, 40))  # 72 is served since issue 40; 40 is not
    with pytest.raises(ValueError, match=r"head_dim 40 .* not supported"):
        kv.paged_attention(mx.zeros((1, 2, 40)), cache, cache, mx.zeros((1, 2), mx.int32), mx.ones((1,), mx.int32))
    cache = mx.zeros((4, 2, 12, 64))
    with pytest.raises(ValueError, match=r"block_size 12 .* not supported"):
        kv.gather_kv_cache(cache, cache, mx.zeros((1, 2), mx.int32), mx.ones((1,), mx.int32))


def test_block_id_out_of_range(case):
    tables = np.array(case.block_tables)
    tables[1, 1] = case.key_cache.shape[0]  # seq 1 (30 tokens) uses blocks 0 and 1
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = \d+ is out of range"):
        attention(case, block_tables=mx.array(tables))
    tables[1, 1] = -1
    with pytest.raises(ValueError, match=r"block_tables\[1, 1\] = -1 is out of range"):
        attention(case, block_tables=mx.array(tables))
    with pytest.raises(ValueError, match=r"src\[0\] = 99 is out of range"):
        kv.copy_blocks(case.key_cache, case.value_cache, mx.array([99]), mx.array([0]))
    with pytest.raises(ValueError, match=r"dst names the same block twice"):
        kv.copy_blocks(case.key_cache, case.value_cache, mx.array([0, 1]), mx.array([2, 2]))


def test_slot_out_of_range(case):
    num_slots = case.key_cache.shape[0] * 16
    rows = mx.zeros((2, 2, 64))
    with pytest.raises(ValueError, match=rf"slot_mapping\[1\] = {num_slots} is out of range"):
        kv.reshape_and_cache(rows, rows, case.key_cache, case.value_cache, mx.array([0, num_slots]))
    with pytest.raises(ValueError, match=r"same slot twice"):
        kv.reshape_and_cache(rows, rows, case.key_cache, case.value_cache, mx.array([3, 3]))
    with pytest.raises(ValueError, match=r"one slot per token"):
        kv.reshape_and_cache(rows, rows, case.key_cache, case.value_cache, mx.array([3]))


def test_seq_len_beyond_block_table(case):
    capacity = case.block_tables.shape[1] * 16
    with pytest.raises(ValueError, match=rf"seq_lens\[0\] = {capacity + 1} exceeds its block table capacity"):
        attention(case, seq_lens=mx.array([capacity + 1, 3], dtype=mx.int32))
    with pytest.raises(ValueError, match=r"seq_lens\[1\] = -1: a length must be >= 0"):
        attention(case, seq_lens=mx.array([3, -1], dtype=mx.int32))


def test_bad_options(case):
    with pytest.raises(ValueError, match=r"softcap must be"):
        attention(case, softcap=-1.0)
    with pytest.raises(ValueError, match=r"sliding_window must be"):
        attention(case, sliding_window=0)
    with pytest.raises(ValueError, match=r"num_splits must be"):
        attention(case, num_splits=0)
    with pytest.raises(ValueError, match=r"sinks must have one logit per query head \(8\)"):
        attention(case, sinks=mx.zeros((3,)))
    with pytest.raises(TypeError, match=r"scale must be"):
        attention(case, scale="big")
    with pytest.raises(ValueError, match=r"max_len must be"):
        kv.gather_kv_cache(case.key_cache, case.value_cache, case.block_tables, case.seq_lens, max_len=0)


def test_bad_quantized_cache(case):
    good = quant.quantize(mx.zeros((4, 2, 16, 64)), bits=8, group_size=64)
    with pytest.raises(ValueError, match=r"key_cache.bits must be one of"):
        attention(case, key_cache=quant.QuantizedKV(good.data, good.scales, good.biases, 7, 64))
    with pytest.raises(ValueError, match=r"key_cache.scales must have shape"):
        attention(case, key_cache=good.replace(good.data, good.scales[..., :0], good.biases))


def test_bad_call_leaves_cache_untouched(case):
    before = np.array(case.key_cache)
    rows = mx.ones((2, 2, 64))
    with pytest.raises(ValueError, match=r"\[reshape_and_cache\] slot_mapping\[1\] = 1000000 is out of range"):
        kv.reshape_and_cache(rows, rows, case.key_cache, case.value_cache, mx.array([0, 10**6]))
    np.testing.assert_array_equal(np.isnan(np.array(case.key_cache)), np.isnan(before))
    np.testing.assert_array_equal(np.nan_to_num(np.array(case.key_cache)), np.nan_to_num(before))


# ------------------------------------------------------------------ classes of bad input (issue 10)

def _calls(case):
    """Every public op with good arguments: {op: (function, positional names, args dict)}."""
    rows = mx.zeros((2, 2, 64), dtype=mx.float16)
    keys = mx.zeros((2, 2, 8, 64))
    return {
        "reshape_and_cache": (kv.reshape_and_cache, ["key", "value", "key_cache", "value_cache", "slot_mapping"],
                              dict(key=rows, value=rows, key_cache=case.key_cache, value_cache=case.value_cache,
                                   slot_mapping=mx.array([1, 2], dtype=mx.int32))),
        "paged_attention": (kv.paged_attention, ["query", "key_cache", "value_cache", "block_tables", "seq_lens"],
                            dict(query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
                                 block_tables=case.block_tables, seq_lens=case.seq_lens)),
        "gather_kv_cache": (kv.gather_kv_cache, ["key_cache", "value_cache", "block_tables", "seq_lens"],
                            dict(key_cache=case.key_cache, value_cache=case.value_cache,
                                 block_tables=case.block_tables, seq_lens=case.seq_lens)),
        "decode_attention": (kv.decode_attention, ["query", "keys", "values"],
                             dict(query=mx.zeros((2, 8, 1, 64)), keys=keys, values=keys)),
        "copy_blocks": (kv.copy_blocks, ["key_cache", "value_cache", "src", "dst"],
                        dict(key_cache=case.key_cache, value_cache=case.value_cache,
                             src=mx.array([0], dtype=mx.int32), dst=mx.array([1], dtype=mx.int32))),
    }


def _call(spec, **overrides):
    fn, names, args = spec
    args = {**args}
    options = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    return fn(*(args[n] for n in names), **options)


INDEX_ARGS = [("reshape_and_cache", "slot_mapping"), ("paged_attention", "block_tables"),
              ("paged_attention", "seq_lens"), ("gather_kv_cache", "block_tables"),
              ("gather_kv_cache", "seq_lens"), ("copy_blocks", "src"), ("copy_blocks", "dst")]


@pytest.mark.parametrize("op", ["reshape_and_cache", "paged_attention", "gather_kv_cache", "decode_attention",
                                "copy_blocks"])
def test_python_lists_and_numpy_arrays_are_type_errors_naming_the_argument(case, op):
    spec = _calls(case)[op]
    for name in spec[1]:
        good = spec[2][name]
        array = good.data if isinstance(good, quant.QuantizedKV) else good
        for bad in (np.array(array.astype(mx.float32) if array.dtype == mx.bfloat16 else array).tolist(),
                    np.zeros(tuple(array.shape))):
            with pytest.raises(TypeError, match=rf"\[{op}\] {name} must be an mx.array"):
                _call(spec, **{name: bad})


@pytest.mark.parametrize("op,name", INDEX_ARGS)
def test_float_bool_and_unsigned_index_arrays_are_type_errors(case, op, name):
    spec = _calls(case)[op]
    good = spec[2][name]
    for dtype in (mx.float32, mx.bool_, mx.uint32, mx.int16):
        with pytest.raises(TypeError, match=rf"\[{op}\] {name} must have dtype in \(int32, int64\)"):
            _call(spec, **{name: good.astype(dtype)})


def test_int64_indices_are_range_checked_before_the_cast(case):
    rows = mx.zeros((1, 2, 64))
    num_slots = case.key_cache.shape[0] * 16
    for slot in (2**32 + 5, 2**32 - 1, 2**40):
        with pytest.raises(ValueError, match=rf"slot_mapping\[0\] = {slot} is out of range \[0, {num_slots}\)"):
            kv.reshape_and_cache(rows, rows, case.key_cache, case.value_cache, mx.array([slot], dtype=mx.int64))
    tables = np.array(case.block_tables).astype(np.int64)
    tables[1, 1] = 2**32 + 1
    for op in ("paged_attention", "gather_kv_cache"):
        with pytest.raises(ValueError, match=rf"\[{op}\] block_tables\[1, 1\] = {2**32 + 1} is out of range"):
            _call(_calls(case)[op], block_tables=mx.array(tables))
        with pytest.raises(ValueError, match=rf"\[{op}\] seq_lens\[0\] = {2**32 + 3} exceeds"):
            _call(_calls(case)[op], seq_lens=mx.array([2**32 + 3, 30], dtype=mx.int64))
        with pytest.raises(ValueError, match=rf"\[{op}\] seq_lens\[0\] = {-2**32 + 3}: a length must be"):
            _call(_calls(case)[op], seq_lens=mx.array([-2**32 + 3, 30], dtype=mx.int64))
    for name in ("src", "dst"):
        ids = {"src": mx.array([0], dtype=mx.int64), "dst": mx.array([1], dtype=mx.int64)}
        ids[name] = mx.array([2**32 + 1], dtype=mx.int64)
        with pytest.raises(ValueError, match=rf"{name}\[0\] = {2**32 + 1} is out of range"):
            kv.copy_blocks(case.key_cache, case.value_cache, ids["src"], ids["dst"])


@pytest.mark.parametrize("op", ["reshape_and_cache", "paged_attention", "gather_kv_cache", "decode_attention",
                                "copy_blocks"])
def test_zero_kv_heads_is_a_value_error_naming_the_cache(case, op):
    spec = _calls(case)[op]
    cache_names = ("keys", "values") if op == "decode_attention" else ("key_cache", "value_cache")
    empty = mx.zeros((2, 0, 8, 64)) if op == "decode_attention" else mx.zeros((8, 0, 16, 64), dtype=mx.float16)
    overrides = {cache_names[0]: empty, cache_names[1]: empty}
    if op == "reshape_and_cache":
        overrides.update(key=mx.zeros((2, 0, 64)), value=mx.zeros((2, 0, 64)))
    with pytest.raises(ValueError, match=rf"\[{op}\] {cache_names[0]} must have at least one kv head"):
        _call(spec, **overrides)


def test_zero_query_heads_and_zero_blocks(case):
    with pytest.raises(ValueError, match=r"\[paged_attention\] query must have at least one head"):
        attention(case, query=case.query[:, :0])
    with pytest.raises(ValueError, match=r"\[decode_attention\] query must have at least one head"):
        kv.decode_attention(mx.zeros((1, 0, 1, 64)), mx.zeros((1, 2, 4, 64)), mx.zeros((1, 2, 4, 64)))
    empty = mx.zeros((0, 2, 16, 64), dtype=mx.float16)
    with pytest.raises(ValueError, match=r"\[paged_attention\] key_cache must have at least one block"):
        attention(case, key_cache=empty, value_cache=empty)


@pytest.mark.parametrize("value", [True, False, 2.0, -1, 0, "4", [2]])
def test_num_splits_must_be_a_positive_int(case, value):
    with pytest.raises(ValueError, match=r"\[paged_attention\] num_splits must be None or an int >= 1"):
        attention(case, num_splits=value)
    with pytest.raises(ValueError, match=r"\[decode_attention\] num_splits must be"):
        _call(_calls(case)["decode_attention"], num_splits=value)


@pytest.mark.parametrize("name", ["softcap", "scale"])
@pytest.mark.parametrize("value", [1e-300, 1e-40, 1e39, 1e300, float("inf"), float("nan"), 0.0, -2.0])
def test_softcap_and_scale_must_be_normal_float32_numbers(case, name, value):
    # 1e-300 would reach the kernels as 0 (softcap 0 means "off"), 1e-40 as a denormal that
    # GPUs flush to 0, 1e39 as inf.
    with pytest.raises(ValueError, match=rf"\[paged_attention\] {name} must be None or a positive finite float"):
        attention(case, **{name: value})
    with pytest.raises(ValueError, match=rf"\[decode_attention\] {name} must be"):
        _call(_calls(case)["decode_attention"], **{name: value})


@pytest.mark.parametrize("name", ["softcap", "scale"])
def test_softcap_and_scale_of_the_wrong_type_are_type_errors(case, name):
    for value in (True, "0.5", mx.array(0.5), [0.5]):
        with pytest.raises(TypeError, match=rf"\[paged_attention\] {name} must be"):
            attention(case, **{name: value})


def test_sliding_window_and_max_len_must_be_ints(case):
    for value in (True, 1.5, 0, -3, "8"):
        with pytest.raises(ValueError, match=r"sliding_window must be None or an int >= 1"):
            attention(case, sliding_window=value)
    for value in (True, 1.5, 0, 2**31, 2**40):
        with pytest.raises(ValueError, match=r"\[gather_kv_cache\] max_len must be None or an int in \[1, "):
            kv.gather_kv_cache(case.key_cache, case.value_cache, case.block_tables, case.seq_lens, max_len=value)


@pytest.mark.parametrize("op", ["reshape_and_cache", "paged_attention", "gather_kv_cache", "copy_blocks"])
def test_validate_must_be_a_bool(case, op):
    for value in ("no", None, 1, 0.0):
        with pytest.raises(TypeError, match=rf"\[{op}\] validate must be True or False"):
            _call(_calls(case)[op], validate=value)
