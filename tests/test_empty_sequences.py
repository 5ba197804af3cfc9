"""seq_lens[i] = 0 is an empty batch slot (varlen batches, free slots), accepted by every op
that takes lengths, on every backend: gather returns zero rows, and attention rows that
see nothing return zeros (sinks or not), while the other sequences of the call are
unaffected. The table row of an empty sequence is never read (here it holds ids outside
the cache)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import reference
from kvcases import backend_params, assert_close, paged_case

BACKENDS = backend_params()  # metal skipped, with the reason, off a Mac
LENS = [0, 17, 0, 5]


def _empty_slots(case, lens):
    """The case's tables with the rows of empty sequences pointing outside the cache."""
    tables = np.array(case.block_tables)
    tables[np.array(lens) == 0] = 10**6
    return mx.array(tables), mx.array(np.array(lens, np.int32))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("validate", [True, False])
def test_attention_of_an_empty_sequence_is_zero(backend, rows, validate):
    case = paged_case([max(n, 1) for n in LENS], num_heads=8, num_kv_heads=2, head_dim=64, block_size=8,
                      dtype=mx.float32, seed=3)
    tables, lens = _empty_slots(case, LENS)
    query = mx.array(np.random.default_rng(1).standard_normal((len(LENS), rows, 8, 64)).astype(np.float32))
    opts = dict(sinks=mx.array(np.linspace(-1, 2, 8).astype(np.float32)), softcap=20.0)
    expected = reference.paged_attention(query, case.key_cache, case.value_cache, tables, lens, **opts)
    assert not expected[[0, 2]].any()
    with kv.use_backend(backend):
        out = kv.paged_attention(query, case.key_cache, case.value_cache, tables, lens, num_splits=2,
                                 validate=validate, **opts)
        plain = kv.paged_attention(query[:, -1], case.key_cache, case.value_cache, tables, lens,
                                   sliding_window=4, validate=validate)
    assert_close(out, expected, mx.float32)
    assert not np.array(out)[[0, 2]].any()
    assert_close(plain, reference.paged_attention(query[:, -1], case.key_cache, case.value_cache, tables, lens,
                                                  sliding_window=4), mx.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_all_sequences_empty(backend):
    case = paged_case([3, 3], num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=mx.float16,
                      k_bits=8, v_bits=4, seed=2)
    tables, lens = _empty_slots(case, [0, 0])
    with kv.use_backend(backend):
        out = kv.paged_attention(case.query, case.key_cache, case.value_cache, tables, lens)
        keys, values = kv.gather_kv_cache(case.key_cache, case.value_cache, tables, lens, max_len=20)
    assert out.shape == case.query.shape and not np.array(out).any()
    assert keys.shape == (2, 2, 20, 64) and not np.array(keys).any() and not np.array(values).any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("quantized", [False, True])
def test_gather_of_an_empty_sequence_is_zero(backend, quantized):
    bits = dict(k_bits=8, v_bits=3) if quantized else {}
    case = paged_case([max(n, 1) for n in LENS], num_heads=2, num_kv_heads=2, head_dim=64, block_size=8,
                      dtype=mx.float16, seed=4, **bits)
    tables, lens = _empty_slots(case, LENS)
    want_k, want_v = reference.gather_kv_cache(case.key_cache, case.value_cache, tables, lens)
    assert not want_k[[0, 2]].any()
    with kv.use_backend(backend):
        keys, values = kv.gather_kv_cache(case.key_cache, case.value_cache, tables, lens)
    np.testing.assert_array_equal(np.array(keys.astype(mx.float32))[[0, 2]], 0)
    assert_close(keys, want_k, mx.float16)
    assert_close(values, want_v, mx.float16)


def test_a_negative_length_is_still_refused():
    case = paged_case([5], num_heads=2, num_kv_heads=2, head_dim=64, block_size=8)
    with pytest.raises(ValueError, match=r"\[gather_kv_cache\] seq_lens\[0\] = -1: a length must be >= 0"):
        kv.gather_kv_cache(case.key_cache, case.value_cache, case.block_tables, mx.array([-1], dtype=mx.int32))
    # 0 < seq_len < L stays refused: the query rows are cached positions the sequence lacks.
    with pytest.raises(ValueError, match=r"query holds 3 tokens"):
        kv.paged_attention(mx.zeros((1, 3, 2, 64)), case.key_cache, case.value_cache, case.block_tables,
                           mx.array([2], dtype=mx.int32))
