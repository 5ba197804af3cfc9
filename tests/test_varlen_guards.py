"""paged_attention_varlen with validate=False: the kernels guard their own indices.

query_start_loc is clamped to [0, T] and made non-decreasing (rows no run owns are
zeros), a length is clamped to [0, M * bs] (a row before the first cached token sees
nothing), and a block id outside [0, N) is padding. int64 values saturate into int32.
Each case runs in its own process (as in test_index_guards.py), so a crash fails that
case instead of killing pytest; a case prints "ok" after its own assertions pass.
"""
from __future__ import annotations


import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import reference
from kvcases import assert_close, paged_case, run_case_in_subprocess

BACKENDS = ["cpu"]  # the simulator and metal join here once their kernel lands
FAR = 10**6


def _case(dtype=mx.float32, **opts):
    """Sequences of 40, 9 and 23 tokens owning 20, 9 and 1 query rows (T = 30)."""
    case = paged_case([40, 9, 23], num_heads=8, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
                      seed=4, **opts)
    query = mx.random.normal((30, 8, 64), key=mx.random.key(1)).astype(dtype)
    return case, query, np.array([0, 20, 29, 30])


def guarded_runs(starts, num_tokens):
    """(first row, rows) per sequence after the kernels' clamping."""
    runs, end = [], 0
    for s in range(len(starts) - 1):
        a = max(end, int(np.clip(starts[s], 0, num_tokens)))
        b = max(a, int(np.clip(starts[s + 1], 0, num_tokens)))
        runs.append((a, b - a))
        end = b
    return runs


def masked_oracle(case, query, tables, lens, starts, window=None):
    """The varlen oracle over the tokens whose block id is in range, after the guards."""
    q = reference.to_f64(query)
    kc, vc = reference.to_f64(case.key_cache), reference.to_f64(case.value_cache)
    tables, lens = np.asarray(tables, np.int64), np.asarray(lens, np.int64)
    num_blocks, block_size = kc.shape[0], kc.shape[2]
    group = q.shape[1] // kc.shape[1]
    out = np.zeros_like(q)
    for s, (row0, n) in enumerate(guarded_runs(np.asarray(starts, np.int64), q.shape[0])):
        length = int(np.clip(lens[s], 0, tables.shape[1] * block_size))
        for i in range(n):
            p = length - n + i
            first = 0 if window is None else max(0, p - window + 1)
            tokens = [t for t in range(first, p + 1) if 0 <= tables[s, t // block_size] < num_blocks]
            if not tokens:
                continue
            for h in range(q.shape[1]):
                rows = [(tables[s, t // block_size], h // group, t % block_size) for t in tokens]
                keys = np.stack([kc[r] for r in rows])
                values = np.stack([vc[r] for r in rows])
                out[row0 + i, h] = reference.attend(q[row0 + i, h], keys, values, scale=0.125)
    return out


def _attend(case, query, tables, lens, starts, dtype=mx.int32, **opts):
    out = kv.paged_attention_varlen(query, case.key_cache, case.value_cache, mx.array(tables, dtype=dtype),
                                    mx.array(lens, dtype=dtype), mx.array(starts, dtype=dtype), validate=False,
                                    **opts)
    mx.eval(out)
    return out


# ---------------------------------------------------------------- cases (run in a subprocess)

def case_bad_query_start_loc():
    case, query, _ = _case()
    tables, lens = np.array(case.block_tables), np.array(case.seq_lens)
    for starts, dtype in (([5, 1, 99, 30], mx.int32),     # decreasing, past T: clamped and made monotone
                          ([0, 20, 25, 12], mx.int32),    # ends before T: the tail rows are zeros
                          ([-7, -1, 29, FAR], mx.int32),
                          ([2**32 + 3, 20, 2**40, -(2**40)], mx.int64)):
        out = _attend(case, query, tables, lens, starts, dtype=dtype)
        assert_close(out, masked_oracle(case, query, tables, lens, starts), mx.float32)
    out = np.array(_attend(case, query, tables, lens, [0, 20, 25, 12]))
    assert (out[25:] == 0).all()


def case_more_rows_than_cached_tokens():
    case, query, _ = _case()
    tables, lens = np.array(case.block_tables), np.array(case.seq_lens)
    starts = [0, 28, 29, 30]  # 28 rows for a 40-token sequence is fine; then 9 tokens, 1 row
    lens = np.array([10, 9, 23])  # 28 rows over 10 tokens: the first 18 see nothing
    out = np.array(_attend(case, query, tables, lens, starts, sinks=mx.zeros((8,))))
    assert (out[:18] == 0).all() and np.isfinite(out).all()  # a sink alone gives no row a value
    out = np.array(_attend(case, query, tables, lens, starts))
    assert_close(out, masked_oracle(case, query, tables, lens, starts), mx.float32)


def case_far_block_ids_are_padding():
    for dtype, bits in ((mx.float32, {}), (mx.float16, {}), (mx.float16, dict(k_bits=8, v_bits=4))):
        case, query, starts = _case(dtype, **bits)
        tables, lens = np.array(case.block_tables), np.array(case.seq_lens)
        for bad in (FAR, -5, case.key_cache.shape[0]):
            t = tables.copy()
            t[0, 1] = bad  # tokens 16-31 of sequence 0: padding
            assert_close(_attend(case, query, t, lens, starts), masked_oracle(case, query, t, lens, starts), dtype)
        t = tables.copy()
        t[1, 0] = -1  # every block of sequence 1: its rows are zeros
        out = np.array(_attend(case, query, t, lens, starts, sliding_window=7).astype(mx.float32))
        assert (out[20:29] == 0).all()
        assert_close(out, masked_oracle(case, query, t, lens, starts, window=7), dtype)


def case_lengths_beyond_the_table_or_negative():
    case, query, starts = _case()
    # A clamped length reads slots no sequence owns: make them finite, and the spare table
    # column a valid block.
    case.key_cache = mx.array(np.nan_to_num(np.array(case.key_cache)))
    case.value_cache = mx.array(np.nan_to_num(np.array(case.value_cache)))
    tables = np.array(case.block_tables)
    tables[tables >= case.key_cache.shape[0]] = 0
    for lens, dtype in (([FAR, -3, 2**31 - 1], mx.int32), ([2**32 + 5, -(2**40), 17], mx.int64)):
        out = np.array(_attend(case, query, tables, lens, starts, dtype=dtype))
        assert np.isfinite(out).all()
        assert_close(out, masked_oracle(case, query, tables, lens, starts), mx.float32)
    out = np.array(_attend(case, query, tables, [-1, -1, 0], starts))
    assert (out == 0).all()


CASES = {name[len("case_"):]: fn for name, fn in globals().items() if name.startswith("case_")}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CASES))
def test_validate_false_misuse_never_crashes(backend, name):
    run_case_in_subprocess('test_varlen_guards', backend, name)
