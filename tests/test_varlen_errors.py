"""paged_attention_varlen: bad input is a ValueError/TypeError naming the argument,
raised before any kernel runs."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import backends
from kvcases import no_kernels  # noqa: F401 (an autouse fixture)
from paged_cases import varlen_case


@pytest.fixture
def case():
    return varlen_case([(30, 12), (5, 1), (0, 0)], dtype=mx.float16)


def call(case, **overrides):
    names = ("query", "key_cache", "value_cache", "block_tables", "seq_lens", "query_start_loc")
    args = dict(zip(names, case.args()))
    options = {k: overrides.pop(k) for k in list(overrides) if k not in args}
    args.update(overrides)
    return kv.paged_attention_varlen(*(args[n] for n in names), **options)


def qsl(values, dtype=mx.int32):
    return mx.array(np.array(values), dtype=dtype)


OP = r"\[paged_attention_varlen\] "


@pytest.mark.parametrize("values,match", [
    ([1, 12, 13, 13], r"query_start_loc\[0\] must be 0, got 1"),
    ([0, 12, 11, 13], r"query_start_loc must not decrease: query_start_loc\[2\] = 11 < query_start_loc\[1\] = 12"),
    ([0, 12, 13, 12], r"query_start_loc must not decrease"),
    ([0, 12, 13, 14], r"query_start_loc\[-1\] must equal the query's 13 tokens, got 14"),
    ([0, 6, 13, 13], r"query_start_loc gives sequence 1 7 query tokens but seq_lens\[1\] = 5"),
    ([0, 11, 12, 13], r"query_start_loc gives sequence 2 1 query tokens but seq_lens\[2\] = 0"),
])
def test_bad_query_start_loc_values(case, values, match):
    for dtype in (mx.int32, mx.int64):
        with pytest.raises(ValueError, match=OP + match):
            call(case, query_start_loc=qsl(values, dtype))


def test_bad_query_start_loc_type_and_shape(case):
    with pytest.raises(TypeError, match=OP + r"query_start_loc must have dtype in \(int32, int64\), got float32"):
        call(case, query_start_loc=case.query_start_loc.astype(mx.float32))
    with pytest.raises(TypeError, match=OP + r"query_start_loc must have dtype in \(int32, int64\), got uint32"):
        call(case, query_start_loc=case.query_start_loc.astype(mx.uint32))
    with pytest.raises(TypeError, match=OP + r"query_start_loc must be an mx.array"):
        call(case, query_start_loc=[0, 12, 13, 13])
    with pytest.raises(ValueError, match=OP + r"query_start_loc must have S \+ 1 = 4 entries .* got 3"):
        call(case, query_start_loc=qsl([0, 12, 13]))
    with pytest.raises(ValueError, match=OP + r"query_start_loc must have rank 1"):
        call(case, query_start_loc=qsl([[0, 12, 13, 13]]))


def test_bad_tables_and_lengths(case):
    lens = np.array(case.seq_lens)
    with pytest.raises(ValueError, match=OP + r"seq_lens\[0\] = 1000 exceeds its block table capacity"):
        call(case, seq_lens=mx.array(np.array([1000, 5, 0], np.int32)))
    with pytest.raises(ValueError, match=OP + r"seq_lens\[2\] = -1 is negative"):
        call(case, seq_lens=mx.array(np.array([30, 5, -1], np.int32)))
    tables = np.array(case.block_tables)
    tables[0, 1] = 10**6
    with pytest.raises(ValueError, match=OP + r"block_tables\[0, 1\] = 1000000 is out of range"):
        call(case, block_tables=mx.array(tables))
    with pytest.raises(ValueError, match=OP + r"seq_lens must have one entry per block_tables row \(3\), got 2"):
        call(case, seq_lens=mx.array(lens[:2]))
    with pytest.raises(TypeError, match=OP + r"block_tables must have dtype"):
        call(case, block_tables=case.block_tables.astype(mx.float32))
    # int64 values are checked before the cast: 2**32 would wrap to 0.
    with pytest.raises(ValueError, match=OP + r"seq_lens\[0\] = 4294967296 exceeds"):
        call(case, seq_lens=mx.array(np.array([2**32, 5, 0]), dtype=mx.int64))


def test_bad_query_and_caches(case):
    with pytest.raises(ValueError, match=OP + r"query must have rank 3 \[T, H, D\], got shape \(13, 1, 8, 64\)"):
        call(case, query=case.query[:, None])
    with pytest.raises(TypeError, match=OP + r"query must have dtype"):
        call(case, query=case.query.astype(mx.int32))
    with pytest.raises(ValueError, match=OP + r"query head_dim 32 does not match the cache head_dim 64"):
        call(case, query=case.query[..., :32])
    with pytest.raises(ValueError, match=OP + r"query heads \(7\) must be a multiple of kv heads \(2\)"):
        call(case, query=case.query[:, :7])
    with pytest.raises(TypeError, match=OP + r"key_cache and value_cache must have the same dtype"):
        call(case, value_cache=case.value_cache.astype(mx.float32))
    with pytest.raises(ValueError, match=OP + r"head_dim 40 of key_cache is not supported"):  # 48 is served
        call(case, query=case.query[..., :40], key_cache=case.key_cache[..., :40],
             value_cache=case.value_cache[..., :40])


def test_bad_options(case):
    with pytest.raises(ValueError, match=OP + r"sinks must have one logit per query head \(8\)"):
        call(case, sinks=mx.zeros((4,)))
    with pytest.raises(ValueError, match=OP + r"scale must be None or a positive finite float"):
        call(case, scale=-1.0)
    with pytest.raises(ValueError, match=OP + r"softcap must be None or a positive finite float"):
        call(case, softcap=float("inf"))
    with pytest.raises(ValueError, match=OP + r"sliding_window must be None or an int >= 1, got 0"):
        call(case, sliding_window=0)
    with pytest.raises(TypeError, match=OP + r"validate must be True or False"):
        call(case, validate=1)


def test_validate_false_skips_only_the_value_checks(case, monkeypatch):
    """With validate=False the bad query_start_loc reaches the backend (whose kernels guard it)."""
    reached = []

    class Backend:
        def paged_attention_varlen(self, *args, **kwargs):
            reached.append(args[5])
            return mx.zeros(args[0].shape, args[0].dtype)
    monkeypatch.setattr(backends, "get", lambda name=None: Backend())
    call(case, query_start_loc=qsl([5, 1, 99, 0], mx.int64), validate=False)
    assert reached and reached[0].dtype == mx.int32 and reached[0].tolist() == [5, 1, 99, 0]
    # Shapes and dtypes are still checked.
    with pytest.raises(ValueError, match=OP + r"query_start_loc must have S \+ 1"):
        call(case, query_start_loc=qsl([0, 13]), validate=False)
