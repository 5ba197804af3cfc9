"""paged_attention_cascade (shared-prefix decode) on every backend available here:
against the float64 oracle and against paged_attention over the concatenated block
table; bad input; validate=False guards (the simulator in strict mode flags any
out-of-bounds read or race); and the traffic the cascade exists for (each prefix row
loaded once per step, not once per member). Unowned cache slots are NaN (kvcases)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import kvmetal as kv
from kvmetal import reference, sim
from kvmetal.backends import metal, metal_cascade
from kvmetal.sim import traffic

from kvcases import TOLERANCE, assert_close, backend_params, run_on
from paged_cases import cascade_case

f32, f16, bf16 = mx.float32, mx.float16, mx.bfloat16
BACKENDS = backend_params(("cpu", "sim", "metal"))


def concatenated(args):
    """The plain op's inputs: each sequence's prefix blocks then its own blocks (prefixes
    must fill whole blocks for the two to be the same token list)."""
    bs = args["key_cache"].shape[2]
    ptables, plens = np.array(args["prefix_block_tables"]), np.array(args["prefix_lens"])
    tables, lens, owner = np.array(args["block_tables"]), np.array(args["seq_lens"]), np.array(args["prefix_of"])
    rows, total = [], []
    for s in range(tables.shape[0]):
        pre = [] if owner[s] < 0 else list(ptables[owner[s], :-(-plens[owner[s]] // bs)])
        assert owner[s] < 0 or plens[owner[s]] % bs == 0
        rows.append(pre + list(tables[s, :-(-lens[s] // bs)]))
        total.append((plens[owner[s]] if owner[s] >= 0 else 0) + lens[s])
    width = max(1, max(len(r) for r in rows))
    table = np.array([r + [0] * (width - len(r)) for r in rows], np.int32)
    return mx.array(table), mx.array(np.array(total, np.int32))


def cascade(args, **options):
    return kv.paged_attention_cascade(args["query"], args["key_cache"], args["value_cache"],
                                      args["prefix_block_tables"], args["prefix_lens"], args["prefix_of"],
                                      args["block_tables"], args["seq_lens"], **options)


def oracle(args, **options):
    return reference.paged_attention_cascade(args["query"], args["key_cache"], args["value_cache"],
                                             args["prefix_block_tables"], args["prefix_lens"], args["prefix_of"],
                                             args["block_tables"], args["seq_lens"], **options)


# prefix lens, own lens, prefix_of, dtype, gqa, K quant, V quant, block size, softcap, sinks
CASES = [
    # four prefixes (one empty), members of several prefixes, -1, empty own runs, a prefix
    # that does not fill its last block
    ([48, 17, 0, 32], [5, 0, 9, 1, 16, 3, 0], [0, 0, 1, -1, 0, 2, 3], f16, 4, None, None, 16, None, False),
    ([64], [1, 30, 7], [0, 0, 0], f32, 1, None, None, 8, 30.0, True),      # MHA, softcap, sinks
    ([32, 40], [3, 12, 0, 8], [1, 0, 1, 0], bf16, 8, None, None, 32, None, False),
    ([48, 16], [2, 9, 0, 17], [0, 1, 0, -1], f16, 4, (8, 64), (4, 64), 16, None, False),  # K8/V4
    ([33], [4, 0, 20], [0, 0, 0], f16, 2, (4, 32), None, 16, None, True),  # 4-bit K, float V
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("plens,own,prefix_of,dtype,gqa,kq,vq,bs,softcap,sinks", CASES)
def test_cascade_matches_oracle(backend, plens, own, prefix_of, dtype, gqa, kq, vq, bs, softcap, sinks):
    args, sink = cascade_case(plens, own, prefix_of, dtype=dtype, gqa=gqa, block_size=bs,
                              k_bits=kq and kq[0], v_bits=vq and vq[0], group_size=(kq or vq or (None, 64))[1])
    expected = oracle(args, softcap=softcap, sinks=sink)
    with run_on(backend):
        out = cascade(args, softcap=softcap, sinks=sink)
        mx.eval(out)
    assert out.shape == args["query"].shape and out.dtype == dtype
    assert_close(out, expected, dtype)
    # A sequence that sees no token (no prefix or an empty one, and no own token) is zeros.
    owner = np.asarray(prefix_of)
    seen = np.array(own) + np.array([plens[o] if o >= 0 else 0 for o in owner])
    assert not np.array(out.astype(f32))[seen == 0].any()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kq,vq", [(None, None), ((8, 64), (4, 64))], ids=["f16", "k8v4"])
def test_cascade_matches_plain_op_on_concatenated_table(backend, kq, vq):
    args, _ = cascade_case([32, 64], [3, 17, 1, 0, 40], [0, 1, 1, 0, -1], k_bits=kq and kq[0],
                           v_bits=vq and vq[0], seed=3)
    table, total = concatenated(args)
    with run_on(backend):
        out = cascade(args)
        plain = kv.paged_attention(args["query"], args["key_cache"], args["value_cache"], table, total)
        mx.eval(out, plain)
    assert_close(out, np.array(plain.astype(f32)), f16, factor=2.0)
    assert_close(plain, oracle(args), f16)


def test_many_members_are_chunked(monkeypatch):
    """More members than a threadgroup's rows hold: several chunks of one prefix, same result."""
    monkeypatch.setattr(metal, "CASCADE_CHUNK_ROWS", 8)   # 2 members of G = 4 per chunk
    schedule = metal_cascade.plan([32], [0, 0, 0, 0, 0], gqa=4, capacity=64, max_rows=8)
    assert list(schedule.chunk_prefix) == [0, 0, 0] and [g.query_len for g in schedule.groups] == [2, 1]
    args, _ = cascade_case([32], [2, 5, 0, 9, 1], [0, 0, 0, 0, 0], seed=5)
    with run_on("sim"):
        out = cascade(args)
        mx.eval(out)
    assert_close(out, oracle(args), f16)


def test_plan_skips_unused_and_empty_prefixes():
    schedule = metal_cascade.plan([16, 0, 32, 8], [2, 1, -1, 2, 7, 0], gqa=4, capacity=32, max_rows=128)
    assert sorted(schedule.chunk_prefix) == [0, 2]        # prefix 1 is empty, 3 unused, 7 out of range
    assert schedule.prefix_work == 32 and schedule.prefix_slots == 3
    # Chunks sized per prefix: prefix 2's two members take QL 2, prefix 0's one takes QL 1.
    assert [(g.query_len, list(g.chunk_prefix), list(g.member_rows)) for g in schedule.groups] == [
        (2, [2], [0, 3]), (1, [0], [5])]
    assert list(schedule.slot_of) == [0, -1, -1, 1, -1, 2]


def test_chunks_are_sized_per_prefix():
    # A one-member prefix beside a 32-member one computes no padding rows.
    schedule = metal_cascade.plan([16, 16], [0] * 32 + [1], gqa=2, capacity=16, max_rows=96)
    assert [(g.query_len, g.chunk_prefix.shape[0]) for g in schedule.groups] == [(32, 1), (1, 1)]
    assert schedule.prefix_slots == 33
    args, _ = cascade_case([16, 16], [3] * 5 + [2], [0] * 5 + [1], seed=8, gqa=2, num_kv_heads=1)
    with run_on("sim") as trace:
        out = cascade(args)
        mx.eval(out)
    assert_close(out, oracle(args), f16)
    prefix_calls = [c for c in trace.calls if "cascade_partials" in c.name and "_ql1_" not in c.name]
    assert sorted(c.name.split("_ql")[1].split("_")[0] for c in prefix_calls) == ["8"]  # 5 members: QL 8


# ----------------------------------------------------------------------------- bad input

def _bad(args, **change):
    a = dict(args)
    a.update(change)
    return a


@pytest.mark.parametrize("change,error,match", [
    (dict(query=mx.zeros((7, 1, 8, 64), f16)), ValueError, "one token per sequence"),
    (dict(query=mx.zeros((7, 8, 64), mx.int32)), TypeError, "query"),
    (dict(query=mx.zeros((7, 5, 64), f16)), ValueError, "multiple of kv heads"),
    (dict(query=mx.zeros((7, 8, 128), f16)), ValueError, "head_dim"),
    (dict(prefix_block_tables=mx.zeros((4,), mx.int32)), ValueError, "prefix_block_tables"),
    (dict(prefix_block_tables=mx.zeros((4, 4), mx.float32)), TypeError, "prefix_block_tables"),
    (dict(prefix_lens=mx.zeros((3,), mx.int32)), ValueError, "prefix_lens"),
    (dict(prefix_lens=mx.array([48, 17, 0, 999], mx.int32)), ValueError, r"prefix_lens\[3\] = 999"),
    (dict(prefix_lens=mx.array([48, -1, 0, 32], mx.int32)), ValueError, r"prefix_lens\[1\] = -1"),
    (dict(prefix_of=mx.array([0, 0, 1, -1, 0, 2, 4], mx.int32)), ValueError, r"prefix_of\[6\] = 4"),
    (dict(prefix_of=mx.array([0, 0, 1, -2, 0, 2, 3], mx.int32)), ValueError, r"prefix_of\[3\] = -2"),
    (dict(prefix_of=mx.zeros((6,), mx.int32)), ValueError, "prefix_of"),
    (dict(prefix_of=mx.zeros((7,), mx.float16)), TypeError, "prefix_of"),
    (dict(seq_lens=mx.array([5, 0, 9, 1, 16, 3, -4], mx.int32)), ValueError, r"seq_lens\[6\] = -4"),
    (dict(seq_lens=mx.zeros((6,), mx.int32)), ValueError, "seq_lens"),
    (dict(block_tables=mx.full((7, 3), 10**6, mx.int32)), ValueError, r"block_tables\[0, 0\]"),
])
def test_bad_input_names_the_argument(change, error, match):
    args, _ = cascade_case(*CASES[0][:3])
    with kv.use_backend("cpu"), pytest.raises(error, match=match):
        cascade(_bad(args, **change))


def test_bad_prefix_block_id_and_options():
    args, _ = cascade_case(*CASES[0][:3])
    table = np.array(args["prefix_block_tables"])
    table[1, 1] = -3   # prefix 1 (17 tokens) uses 2 blocks
    with pytest.raises(ValueError, match=r"prefix_block_tables\[1, 1\] = -3"):
        cascade(_bad(args, prefix_block_tables=mx.array(table)))
    with pytest.raises(ValueError, match="sliding_window"):
        cascade(args, sliding_window=16)
    with pytest.raises(ValueError, match="scale"):
        cascade(args, scale=-1.0)
    with pytest.raises(ValueError, match="sinks"):
        cascade(args, sinks=mx.zeros((3,), f32))
    with pytest.raises(TypeError, match="validate"):
        cascade(args, validate=1)


def test_no_prefixes_and_no_sequences():
    args, _ = cascade_case([16], [5, 9], [-1, -1])
    none = _bad(args, prefix_block_tables=mx.zeros((0, 2), mx.int32), prefix_lens=mx.zeros((0,), mx.int32))
    with kv.use_backend("cpu"):
        assert_close(cascade(none), oracle(args), f16)
    empty = _bad(args, query=args["query"][:0], prefix_of=args["prefix_of"][:0], block_tables=args["block_tables"][:0],
                 seq_lens=args["seq_lens"][:0])
    assert cascade(empty).shape == (0, 8, 64)


# ----------------------------------------------------------------------------- guards

@pytest.mark.parametrize("backend", backend_params(("cpu", "sim")))
def test_validate_false_guards(backend):
    """Out-of-range block ids are padding, lengths are cut to their tables, a prefix_of
    outside [0, P) is no prefix: nothing outside the caches is read (strict simulator)."""
    args, _ = cascade_case([32, 16], [5, 9, 3, 20], [0, 1, 0, 1], seed=7)
    num_blocks = args["key_cache"].shape[0]
    ptable = np.array(args["prefix_block_tables"])
    ptable[0, 1] = num_blocks + 5                      # prefix 0's second block: padding
    bad = _bad(args, prefix_block_tables=mx.array(ptable),
               prefix_lens=mx.array([32, 10**6], mx.int32),         # cut to prefix 1's table (48 tokens)
               prefix_of=mx.array([0, 9, -7, 1], mx.int32),       # 9 and -7: no prefix
               seq_lens=mx.array([5, 9, -3, 10**6], mx.int32))    # -3: nothing; huge: cut to the table
    with run_on(backend):
        out = cascade(bad, validate=False)
        mx.eval(out)
    out = np.array(out.astype(f32))
    # Sequence 1 (no prefix, 9 own tokens) is exactly the no-prefix result; sequence 2 sees nothing.
    expected = oracle(_bad(args, prefix_of=mx.array([0, -1, -1, 1], mx.int32)))
    assert_close(out[1:2], expected[1:2], f16)
    assert not out[2].any()
    # Sequence 0: its prefix's first block only (the padding block attends nothing).
    first_block = _bad(args, prefix_lens=mx.array([16, 16], mx.int32))
    assert_close(out[0:1], oracle(first_block)[0:1], f16)


# ----------------------------------------------------------------------------- traffic

@pytest.mark.parametrize("kq,vq", [(None, None), ((8, 64), (4, 64))], ids=["f16", "k8v4"])
def test_prefix_rows_loaded_once(kq, vq):
    """8 members over a 128-token prefix, 8-24 own tokens each: the K/V bytes the cascade
    kernels load are the live bytes of the prefix once plus the own tokens (ratio <= 1.05),
    where the plain op over the concatenated tables loads the prefix 8 times."""
    own = [8, 24, 16, 9, 12, 20, 11, 15]
    args, _ = cascade_case([128], own, [0] * 8, num_kv_heads=1, gqa=4, head_dim=64,
                           k_bits=kq and kq[0], v_bits=vq and vq[0], seed=2)
    table, total = concatenated(args)
    row = traffic.row_bytes(args["key_cache"], 64) + traffic.row_bytes(args["value_cache"], 64)
    live = (128 + sum(own)) * row

    def kv_loaded(calls, kernel):
        return sum(c.buffers[n].loaded for c in calls if kernel in c.name for n in traffic.KV_BUFFERS
                   if n in c.buffers)

    with kv.use_backend("sim"), sim.trace() as t:
        mx.eval(cascade(args))
    cascade_ratio = kv_loaded(t.calls, "cascade_partials") / live
    with kv.use_backend("sim"), sim.trace() as t:
        mx.eval(kv.paged_attention(args["query"], args["key_cache"], args["value_cache"], table, total))
    plain_ratio = kv_loaded(t.calls, "paged_attention_partials") / live
    assert 0.999 <= cascade_ratio <= 1.05, cascade_ratio
    assert plain_ratio > 4.0, plain_ratio


# ----------------------------------------------------------------------------- sparse V

def _sparse_case(quant=(None, None), *, gqa=4, peak=6.0):
    """Two prefixes (one with 3 members, one with 1) and a sequence without one; a
    peaked query (scale ``peak``) puts many keys under tau."""
    args, _ = cascade_case((64, 40), (30, 9, 17, 0, 21), (0, 0, 1, 0, -1), gqa=gqa, k_bits=quant[0],
                           v_bits=quant[1], seed=4)
    args["query"] = (args["query"] * peak).astype(f16)
    return args


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kq,vq", [(None, None), (8, 4)], ids=["f16", "k8v4"])
def test_sparse_v_error_within_the_bound(backend, kq, vq):
    # Each pass compares against its own running max, never above the row's final one,
    # so the oracle's bound (over the concatenated tokens, final max) holds.
    args = _sparse_case((kq, vq))
    tau = 1e-3
    exact = reference.paged_attention_cascade(**args)
    _, bound = reference.paged_attention_cascade(**args, sparse_v=tau, with_bound=True)
    assert bound.max() > 0  # keys really fall under tau: the check is not vacuous
    with run_on(backend):
        out, plain = cascade(args, sparse_v=tau), cascade(args)
        mx.eval(out, plain)
    assert not np.array_equal(np.array(out), np.array(plain))  # the threshold reached the kernels
    out = np.array(out.astype(f32), np.float64)
    err = np.abs(out - exact).max(axis=-1)
    slack = TOLERANCE[f16] * np.abs(exact).max(axis=-1)
    assert np.isfinite(out).all() and (err <= bound + slack).all(), f"worst excess {(err - bound - slack).max():.3g}"


def test_sparse_v_oracle_matches_paged_attention_oracle():
    args = _sparse_case()
    args["prefix_lens"] = mx.array([64, 32], mx.int32)  # whole blocks: the same token lists
    table, lens = concatenated(args)
    got, bound = reference.paged_attention_cascade(**args, sparse_v=1e-2, with_bound=True)
    want, want_bound = reference.paged_attention(args["query"], args["key_cache"], args["value_cache"], table, lens,
                                                 sparse_v=1e-2, with_bound=True)
    np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(bound, want_bound, rtol=1e-12, atol=1e-12)
    assert np.abs(got - reference.paged_attention_cascade(**args)).max() > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_sparse_v_tau_zero_is_the_exact_cascade_bit_for_bit(backend):
    args = _sparse_case()
    with run_on(backend):
        base = np.array(cascade(args))
        for tau in (0, 0.0, None):
            assert np.array_equal(np.array(cascade(args, sparse_v=tau)), base)


def test_sparse_v_sim_skips_v_rows_in_both_passes():
    # gqa 2: a 3-member prefix chunk holds 2 x 4 = 8 rows, register mode (shared mode
    # would still copy V tiles whole).
    args = _sparse_case(gqa=2, peak=8.0)

    def loaded(tau):
        with run_on("sim") as t:
            mx.eval(cascade(args, sparse_v=tau))
        calls = [c for c in t.calls if "cascade_partials" in c.name]
        # The own-token pass, then the prefix passes, one per chunk size (QL 4: the
        # 3-member prefix; QL 1: the 1-member one).
        assert len(calls) == 3 and "_ql4_" in calls[1].name and "_ql1_" in calls[2].name
        loads = [{n: c.buffers[n].loaded for n in ("key_data", "value_data")} for c in calls]
        for load, c in zip(loads, calls):
            load["distinct_k"] = c.buffers["key_data"].distinct_loaded
            load["threadgroups"] = c.threadgroups
        return [loads[0], {n: loads[1][n] + loads[2][n] for n in loads[0]}]

    exact, sparse = loaded(None), loaded(1e-3)
    # Measured: own pass 0.56 of the exact V bytes, prefix pass 0.73 (0.63 and 0.88 with
    # a running max from -inf; a key is loaded when any of the chunk's 8 member rows needs it).
    for e, s, most in zip(exact, sparse, (0.75, 0.95)):
        # Scores need every key; the seeds (kv_seed_rows) re-read up to 32 K rows
        # (64 float16s) per threadgroup, shared among its simdgroups.
        assert s["distinct_k"] == e["distinct_k"]
        seeds = reference.SPARSE_V_RECENT_SEEDS + 1
        assert 0 < s["key_data"] - e["key_data"] <= seeds * s["threadgroups"] * 64 * 2
        assert s["value_data"] < most * e["value_data"]


@pytest.mark.parametrize("bad,error", [(-1e-3, ValueError), (float("nan"), ValueError), (1.0, ValueError),
                                       (1e-45, ValueError), ("1e-6", TypeError), (True, TypeError)],
                         ids=["negative", "nan", "one", "denormal", "str", "bool"])
def test_bad_sparse_v_names_it(bad, error):
    args = _sparse_case()
    with kv.use_backend("cpu"), pytest.raises(error, match=r"\[paged_attention_cascade\] sparse_v"):
        cascade(args, sparse_v=bad)
