"""validate=False misuse: the kernels guard their own indices (issue 10, item 6).

With ``validate=False`` the host checks are skipped, so bad indices reach the kernels.
They must never crash, read or write outside the caches: a slot out of range is a
skipped row, a block id outside [0, N) is padding (its tokens are not attended, gather
returns zeros for them), a length is clamped to [0, table capacity], and a copy pair
with an id out of range is skipped. int64 values that do not fit int32 saturate
instead of wrapping onto a valid index.

Each case runs in its own Python process, so a crash (SIGSEGV, abort) fails that test
instead of killing pytest. A case prints "ok" after its own assertions pass.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import reference
from kvcases import backend_params, assert_close, paged_case, run_case_in_subprocess

BACKENDS = backend_params()  # metal skipped, with the reason, off a Mac

FAR = 10**6
I64_WRAPS_TO_5 = 2**32 + 5  # an int32 cast would turn it into 5



# Every way the kernels read a cache: float32 and float16 in place, bfloat16 with more
# query rows than the in-place path takes (converted), and quantized K8/V4.
KINDS = {"f32": dict(dtype=mx.float32), "f16": dict(dtype=mx.float16),
         "bf16_gqa12": dict(dtype=mx.bfloat16, num_heads=24), "k8v4": dict(dtype=mx.float16, k_bits=8, v_bits=4)}


def _case(kind="f32"):
    opts = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, seed=3)
    opts.update(KINDS[kind])
    return paged_case([5, 30, 17], **opts)


def _masked_oracle(case, tables, lens, query=None, **opts):
    """paged_attention over the tokens whose block id is in range, lengths clamped to the table
    (one query token per sequence)."""
    q = reference.to_f64(case.query if query is None else query)
    kc, vc = reference.to_f64(case.key_cache), reference.to_f64(case.value_cache)
    tables, lens = np.asarray(tables, np.int64), np.asarray(lens, np.int64)
    num_blocks, block_size = kc.shape[0], kc.shape[2]
    group = q.shape[1] // kc.shape[1]
    out = np.zeros_like(q)
    for s in range(q.shape[0]):
        n = int(np.clip(lens[s], 0, tables.shape[1] * block_size))
        tokens = [t for t in range(n) if 0 <= tables[s, t // block_size] < num_blocks]
        for h in range(q.shape[1]):
            if not tokens:
                continue
            keys = np.stack([kc[tables[s, t // block_size], h // group, t % block_size] for t in tokens])
            values = np.stack([vc[tables[s, t // block_size], h // group, t % block_size] for t in tokens])
            out[s, h] = reference.attend(q[s, h], keys, values, scale=q.shape[-1] ** -0.5, **opts)
    return out


def _attend(case, tables, lens, dtype=mx.int32, **opts):
    out = kv.paged_attention(case.query, case.key_cache, case.value_cache, mx.array(tables, dtype=dtype),
                             mx.array(lens, dtype=dtype), validate=False, **opts)
    mx.eval(out)
    return out


# ---------------------------------------------------------------- cases (run in a subprocess)

def _host_arrays(cache):
    parts = cache.arrays() if hasattr(cache, "arrays") else (cache,)
    return [np.array(a.astype(mx.float32) if a.dtype == mx.bfloat16 else a) for a in parts]


def _assert_same_cache(a, b):
    for x, y in zip(_host_arrays(a), _host_arrays(b)):
        np.testing.assert_array_equal(x, y)  # NaN-poisoned slots compare equal too


def case_slot_past_the_end():
    for kind in KINDS:
        case = _case(kind)
        rows = mx.ones((3, 2, 64))
        num_slots = case.key_cache.shape[0] * 16
        for slots, dtype in (([num_slots + FAR, num_slots, 2**31 - 1], mx.int32),
                             ([I64_WRAPS_TO_5, 2**32 + 15, 2**40], mx.int64)):
            kc, vc = kv.reshape_and_cache(rows, rows, case.key_cache, case.value_cache,
                                          mx.array(slots, dtype=dtype), validate=False)
            _assert_same_cache(kc, case.key_cache)
            _assert_same_cache(vc, case.value_cache)


def case_far_block_ids_are_padding():
    for kind in KINDS:
        case = _case(kind)
        dtype = case.query.dtype
        tables = np.array(case.block_tables)
        lens = np.array(case.seq_lens)
        for bad in (FAR, -5, case.key_cache.shape[0]):
            t = tables.copy()
            t[1, 0] = bad  # seq 1 (30 tokens): its first block becomes padding
            assert_close(_attend(case, t, lens), _masked_oracle(case, t, lens), dtype)
        # Every block of a sequence padding: that row is zeros.
        t = tables.copy()
        t[0, 0] = -1
        out = _attend(case, t, lens)
        assert (np.array(out.astype(mx.float32))[0] == 0).all()
        assert_close(out, _masked_oracle(case, t, lens), dtype)
        keys, values = kv.gather_kv_cache(case.key_cache, case.value_cache, mx.array(t), mx.array(lens),
                                          validate=False)
        assert (np.array(keys.astype(mx.float32))[0] == 0).all() and (np.array(values.astype(mx.float32))[0] == 0).all()


def case_more_query_tokens_than_cached_tokens():
    # L = 8 tokens, sequences of 5, 30 and 17: the first 3 rows of sequence 0 see nothing
    # (zeros, sinks or not); the others see t <= seq_len - L + l.
    case = _case()
    rows = 8
    query = mx.random.normal((3, rows, 8, 64), key=mx.random.key(0))
    sinks = mx.zeros((8,))
    for opts in ({}, {"sinks": sinks}):
        out = np.array(kv.paged_attention(query, case.key_cache, case.value_cache, case.block_tables,
                                          case.seq_lens, validate=False, **opts))
        assert (out[0, :3] == 0).all()
        lens = np.array(case.seq_lens)
        for l in range(3, rows):
            cut = lens - rows + l + 1
            ref = _masked_oracle(case, np.array(case.block_tables), cut, query=query[:, l],
                                 **({"sink": 0.0} if opts else {}))
            assert_close(out[:, l], ref, mx.float32)


def case_int64_block_id_does_not_wrap():
    case = _case()
    tables = np.array(case.block_tables).astype(np.int64)
    lens = np.array(case.seq_lens)
    wrapped = tables.copy()
    wrapped[1, 1] = 1
    tables[1, 1] = 2**32 + 1
    out = _attend(case, tables, lens, dtype=mx.int64)
    assert_close(out, _masked_oracle(case, tables, lens), mx.float32)
    assert not np.allclose(np.array(out)[1], _masked_oracle(case, wrapped, lens)[1])


def case_lengths_beyond_the_table_or_negative():
    case = _case()
    # A clamped length reads slots no sequence owns: make them finite, and the spare table
    # column a valid block.
    case.key_cache = mx.array(np.nan_to_num(np.array(case.key_cache)))
    case.value_cache = mx.array(np.nan_to_num(np.array(case.value_cache)))
    tables = np.array(case.block_tables)
    tables[tables >= case.key_cache.shape[0]] = 0
    for lens, dtype in (([FAR, -3, 2**31 - 1], mx.int32), ([I64_WRAPS_TO_5, -(2**40), 17], mx.int64)):
        out = np.array(_attend(case, tables, lens, dtype=dtype, softcap=5.0))
        assert np.isfinite(out).all()
        assert_close(out, _masked_oracle(case, tables, lens, softcap=5.0), mx.float32)
    out = np.array(_attend(case, tables, [-1, -1, 0]))
    assert (out == 0).all()


def case_gather_guards():
    case = _case()
    tables = np.array(case.block_tables)
    tables[0, 0] = FAR
    lens = [-7, FAR, 17]
    keys, values = kv.gather_kv_cache(case.key_cache, case.value_cache, mx.array(tables), mx.array(lens),
                                      validate=False)
    mx.eval(keys, values)
    keys = np.array(keys)
    assert (keys[0] == 0).all()  # negative length: nothing
    cap = tables.shape[1] * 16
    ref_k, _ = reference.gather_kv_cache(case.key_cache, case.value_cache, case.block_tables,
                                         mx.array([1, 30, 17]))
    np.testing.assert_array_equal(keys[2], ref_k[2])
    np.testing.assert_array_equal(keys[1, :, :30], ref_k[1, :, :30])  # clamped to the table
    assert keys.shape[2] == cap
    out = kv.gather_kv_cache(case.key_cache, case.value_cache, mx.array(tables.astype(np.int64) + 2**32),
                             mx.array([16, 16, 16], dtype=mx.int64), validate=False)
    mx.eval(out)
    assert (np.array(out[0]) == 0).all()  # every id out of range: zero rows, not ids - 2**32


def case_copy_blocks_far_ids_are_skipped():
    for kind in ("k8v4", "bf16_gqa12"):
        case = _case(kind)
        kc, vc = kv.copy_blocks(case.key_cache, case.value_cache, mx.array([0, FAR]), mx.array([-1, 1]),
                                validate=False)
        _assert_same_cache(kc, case.key_cache)
        _assert_same_cache(vc, case.value_cache)
    case = _case()
    before = np.array(case.key_cache)
    n = case.key_cache.shape[0]
    for src, dst, dtype in (([0, FAR, 1], [FAR, 2, -4], mx.int32),
                            ([0, 1], [I64_WRAPS_TO_5, -(2**33)], mx.int64),
                            ([2**32 + 1], [3], mx.int64)):
        kc, vc = kv.copy_blocks(case.key_cache, case.value_cache, mx.array(src, dtype=dtype),
                                mx.array(dst, dtype=dtype), validate=False)
        mx.eval(kc, vc)
        np.testing.assert_array_equal(np.array(kc), before)
    kc, _ = kv.copy_blocks(case.key_cache, case.value_cache, mx.array([FAR, 1]), mx.array([0, n - 1]),
                           validate=False)
    expected = before.copy()
    expected[n - 1] = before[1]  # the good pair still runs
    np.testing.assert_array_equal(np.array(kc), expected)


def case_absurd_num_splits():
    case = _case()
    ref = reference.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                    case.seq_lens)
    for splits in (2**31 - 1, 2**40):
        out = kv.paged_attention(case.query, case.key_cache, case.value_cache, case.block_tables,
                                 case.seq_lens, num_splits=splits, validate=False)
        assert_close(out, ref, mx.float32)
    q, k = mx.random.normal((1, 4, 1, 64)), mx.random.normal((1, 2, 40, 64))
    out = kv.decode_attention(q, k, k, num_splits=2**40)
    assert_close(out, reference.decode_attention(q, k, k), mx.float32)


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


# ---------------------------------------------------------------- the tests

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_validate_false_misuse_never_crashes(backend, name):
    run_case_in_subprocess('test_index_guards', backend, name)
