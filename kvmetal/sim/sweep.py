"""A randomized sweep of the attention kernels on the simulator, against the
float64 oracles (kvmetal.reference): every attention op of the specialisation
registry (``specialisations.ATTENTION_OPS``: paged and contiguous decode, varlen,
cascade), so a new attention op must be drawn here or the sweep refuses to start.

Each configuration is drawn over the whole space the ops accept: G 1-48 query
heads per kv head, L 1-8 query tokens, every head_dim the ops serve (32-512), block sizes
8/16/32, 1-7 splits (or automatic), tiny and odd lengths, every K/V bit width and
group size (float and quantized K and V mixed), sliding window, softcap (with
scores large enough to overflow an unguarded fast tanh now and then), sinks, and
for ``decode_attention`` strided and offset views; for ``paged_attention_varlen``
ragged batches of decode rows and prefill runs (1-64 new rows per sequence, the
tiled kernel past 8); for ``paged_attention_cascade`` 1-3 shared prefixes of up to
40 members (chunked), sequences without one, and empty own lengths; sparse V (tau 1e-1,
1e-3 or 1e-6) on 3 in 10 of the paged, decode and cascade configurations, checked
against the exact oracle within its error bound. Slots no sequence owns are
NaN (so is everything a view hides), and each configuration runs on the strict
simulator under two schedule seeds. Explicit scales are drawn on 3 in 10
configurations (0.25-16 x the default, or 1 and 4). Errors are measured per query
row against the row's own largest output (a batch-wide scale hid wrong rows with
small outputs, issue 41).

``--class sinks_scale`` (issue 41) draws sinks (often at the spread of the logits)
and explicit scales on 8 in 10 configurations, and for varlen tiled runs with no or
little cached context, so their first rows see one or a few keys of a mostly masked
K tile, block size 8 often.

The kernel-selecting part of a configuration (op, dtypes, head_dim, G, L,
formats, block size) is drawn from a pool of ``pool`` shapes so that a long
sweep spends its time running kernels rather than compiling them; everything
else is drawn per configuration.

Usage::

    python -m kvmetal.sim.sweep --fuzz 2000 [--seed 1] [--pool 150] [--class sinks_scale]
    python -m kvmetal.sim.sweep --case '<json printed by a failure>'

Every failure prints a one-line reproducer. ``tests/test_sim_sweep.py`` runs a
fixed-seed sweep in CI.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import mlx.core as mx
import numpy as np

from .. import quant
from .. import reference as ref
from ..backends import metal_layout
from ..ops import SUPPORTED_HEAD_DIMS

HEAD_DIMS = SUPPORTED_HEAD_DIMS  # every head_dim the ops serve (quantized where a group size fits)
BLOCK_SIZES = (8, 16, 32)
DTYPES = ("float16", "bfloat16", "float32")
TOLERANCE = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}  # docs/design.md budgets
VIEWS = ("contiguous", "slice_t", "slice_heads", "transposed", "padded", "offset")
SCHEDULE_SEEDS = (0, 1)
_MX = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


@dataclasses.dataclass(frozen=True)
class Config:
    op: str                    # "paged", "decode", "varlen" or "cascade" (OPS)
    dtype: str
    head_dim: int
    gqa: int
    query_len: int
    k_quant: tuple | None      # (bits, group_size)
    v_quant: tuple | None
    block_size: int = 16       # paged
    num_kv_heads: int = 1
    lens: tuple = (1,)         # paged: one per sequence; decode: (T,) * batch
    splits: int | None = None
    window: int | None = None  # paged
    softcap: float | None = None
    big_scores: bool = False   # query x 40: softcap arguments far past tanh's overflow
    sinks: bool = False
    view: str = "contiguous"   # decode
    pad: int = 0               # decode padded/offset views: elements of padding per row
    data_seed: int = 0
    counts: tuple | None = None       # varlen: new rows of each sequence (its last cached positions)
    prefix_lens: tuple | None = None  # cascade: the shared prefixes' lengths (lens: own tokens)
    prefix_of: tuple | None = None    # cascade: each sequence's prefix, -1 for none
    sparse_v: float | None = None     # paged, decode, cascade: sparse V's tau (checked within its bound)
    scale: float | None = None        # explicit scale (None: head_dim ** -0.5)
    sink_spread: bool = False         # sinks drawn at the spread of the logits (scale * sqrt(D)), not N(0, 1)
    windows: tuple | None = None      # (KVMETAL_METAL_WINDOW_DIV, _GROWTH) for the run: windows that grow
                                      # at a few hundred tokens (automatic splits only)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), separators=(",", ":"))

    @staticmethod
    def from_json(text: str) -> "Config":
        d = json.loads(text)
        for k in ("k_quant", "v_quant", "lens", "counts", "prefix_lens", "prefix_of", "windows"):
            if d.get(k) is not None:
                d[k] = tuple(d[k])
        return Config(**d)

    def reproducer(self) -> str:
        return f"python -m kvmetal.sim.sweep --case '{self.to_json()}'"


# ----------------------------------------------------------------------------- drawing

def _fits(head_dim, spec) -> bool:
    bits, gs = spec
    return head_dim % gs == 0 and head_dim * bits % 32 == 0


def _draw_quant(rng, head_dim):
    if rng.random() < 0.4:
        return None
    options = [(b, g) for b in quant.SUPPORTED_BITS for g in quant.SUPPORTED_GROUP_SIZES if _fits(head_dim, (b, g))]
    return tuple(int(x) for x in options[rng.integers(len(options))]) if options else None


# The sweep's name of each attention op of the registry (specialisations.ATTENTION_OPS).
OPS = {"paged_attention": "paged", "decode_attention": "decode", "paged_attention_varlen": "varlen",
       "paged_attention_cascade": "cascade"}


def _check_ops():
    from ..backends.specialisations import ATTENTION_OPS

    missing = set(ATTENTION_OPS) - set(OPS)
    if missing:
        raise RuntimeError(f"[kvmetal.sim.sweep] attention op(s) {sorted(missing)} of the registry are not drawn")


def draw_shape(rng, ops=None) -> dict:
    """The kernel-selecting half of a configuration (ops: the sweep names to draw from)."""
    ops = tuple(ops or OPS.values())
    r = rng.random()
    gqa = int(rng.integers(1, 9) if r < 0.5 else rng.integers(9, 17) if r < 0.85 else rng.integers(17, 49))
    head_dim = int(rng.choice(HEAD_DIMS))
    op = str(ops[int(rng.integers(len(ops)))])
    return dict(op=op, dtype=str(rng.choice(DTYPES)), head_dim=head_dim,
                gqa=gqa, query_len=int(rng.integers(1, 9)) if op in ("paged", "decode") else 1,
                k_quant=_draw_quant(rng, head_dim), v_quant=_draw_quant(rng, head_dim),
                block_size=int(rng.choice(BLOCK_SIZES)))


def _draw_len(rng, query_len, block_size):
    kind = rng.integers(5)
    if kind == 0:
        n = query_len                                   # just the query tokens (1 when L = 1)
    elif kind == 1:
        n = int(rng.integers(1, 8))                      # tiny
    elif kind == 2:
        n = int(rng.integers(1, 65)) * 2 + 1             # odd
    elif kind == 3:
        n = block_size * int(rng.integers(1, 9)) + int(rng.integers(-1, 2))  # around the block grid
    else:
        n = int(rng.integers(1, 200))
    return max(n, query_len, 1)


# Explicit scales drawn (factors on head_dim ** -0.5, and absolute ones): a scale well
# above the default makes the softmax sharp, where an error in a score shows.
SCALE_FACTORS = (0.25, 2.0, 4.0, 16.0)
SCALES = (1.0, 4.0)


def _draw_scale(rng, head_dim) -> float:
    if rng.random() < 0.5:
        return float(head_dim ** -0.5 * rng.choice(SCALE_FACTORS))
    return float(rng.choice(SCALES))


# Sweep classes: "default" draws over the whole space; "sinks_scale" (issue 41) draws
# sinks and explicit scales often, and for varlen prefill sequences with no cached
# context (the first rows see one or a few keys of a mostly masked K tile) next to
# long-context ones, block size 8 often.
CLASSES = ("default", "sinks_scale")


def draw_config(rng, shape: dict, klass: str = "default") -> Config:
    """A full configuration over ``shape``: lengths, splits and options drawn afresh."""
    if klass == "sinks_scale":
        return _draw_sinks_scale(rng, shape)
    config = _draw_config(rng, shape)
    # From their own streams, so the other draws of a seed stay what they were before
    # sparse V and explicit scales.
    scale_rng = np.random.default_rng(config.data_seed + 2)
    if scale_rng.random() < 0.3:
        config = dataclasses.replace(config, scale=_draw_scale(scale_rng, config.head_dim))
    config = _draw_windows(config)
    if config.op == "varlen":  # no sparse V there
        return config
    extra = np.random.default_rng(config.data_seed + 1)
    tau = float(extra.choice((1e-1, 1e-3, 1e-6))) if extra.random() < 0.3 else None
    return dataclasses.replace(config, sparse_v=tau)


def _draw_windows(config: Config) -> Config:
    """A quarter of the configurations run with windows that grow at a few hundred tokens
    (divisor 1 or 2, growth 1, 2 or 4; automatic splits), one sequence (a decode batch:
    all) or prefix 257-1200 tokens longer so that they do; from their own stream."""
    rng = np.random.default_rng(config.data_seed + 3)
    if rng.random() >= 0.25:
        return config
    extra = int(rng.integers(257, 1201))
    changes = dict(windows=(int(rng.choice((1, 2))), int(rng.choice((1, 2, 4)))), splits=None)
    if config.op == "cascade":
        changes["prefix_lens"] = (config.prefix_lens[0] + extra,) + tuple(config.prefix_lens[1:])
    elif config.op == "decode":
        changes["lens"] = tuple(n + extra for n in config.lens)
    else:
        changes["lens"] = (config.lens[0] + extra,) + tuple(config.lens[1:])
    return dataclasses.replace(config, **changes)


def _window_env(windows):
    """KVMETAL_METAL_WINDOW_DIV / _GROWTH set to ``windows`` (unchanged when None), restored after."""
    names = ("KVMETAL_METAL_WINDOW_DIV", "KVMETAL_METAL_WINDOW_GROWTH")
    return metal_layout.tuning_variables({} if windows is None else dict(zip(names, windows)))


def _draw_sinks_scale(rng, shape: dict) -> Config:
    config = _draw_config(rng, shape)
    scale = _draw_scale(rng, config.head_dim) if rng.random() < 0.8 else None
    changes = dict(sinks=bool(rng.random() < 0.8), scale=scale, sink_spread=bool(rng.random() < 0.7))
    if config.op == "varlen":
        bs = int(rng.choice((8, 8, 16, 32)))
        seqs = 1 if config.gqa > 16 else int(rng.integers(1, 4))
        counts, lens = [], []
        for _ in range(seqs):
            n = int(rng.choice((1, 3, 9, 12, 15, 17, 33)))
            # no context (row 0 sees one key of its tile), a few keys, or a long context
            ctx = int(rng.choice((0, 0, 1, 2, 3, int(rng.integers(4, 201)))))
            counts.append(n)
            lens.append(n + ctx)
        changes.update(block_size=bs, counts=tuple(counts), lens=tuple(lens),
                       window=int(rng.integers(1, 5)) if rng.random() < 0.15 else None)
    return _draw_windows(dataclasses.replace(config, **changes))


def _draw_config(rng, shape: dict) -> Config:
    L = shape["query_len"]
    big = shape["gqa"] * L > 64
    seqs = 1 if big else int(rng.integers(1, 4))
    kw = dict(shape, num_kv_heads=int(rng.integers(1, 3)), splits=None if rng.random() < 0.3 else int(rng.integers(1, 8)),
              softcap=float(rng.choice((5.0, 20.0, 50.0))) if rng.random() < 0.3 else None,
              sinks=bool(rng.random() < 0.3), data_seed=int(rng.integers(1 << 30)))
    kw["big_scores"] = kw["softcap"] is not None and bool(rng.random() < 0.3)
    if shape["op"] == "paged":
        lens = tuple(_draw_len(rng, L, shape["block_size"]) for _ in range(seqs))
        window = int(rng.integers(1, max(lens) + 8)) if rng.random() < 0.25 else None
        return Config(**kw, lens=lens, window=window)
    if shape["op"] == "varlen":
        seqs = 1 if shape["gqa"] > 16 else int(rng.integers(1, 4))
        counts = tuple(int(rng.choice((0, 1, 3, 8, 9, 17, 33, 64))) for _ in range(seqs))
        lens = tuple(max(n, _draw_len(rng, max(n, 1), shape["block_size"]) if rng.random() < 0.7 else n)
                     for n in counts)
        window = int(rng.integers(1, max(lens) + 8)) if rng.random() < 0.25 else None
        return Config(**dict(kw, splits=None), lens=lens, counts=counts, window=window)
    if shape["op"] == "cascade":
        prefixes = int(rng.integers(1, 4))
        prefix_lens = tuple(int(rng.choice((0, 1, 16, 37, 64, 150))) for _ in range(prefixes))
        members = int(rng.integers(1, 41)) if shape["gqa"] <= 8 else int(rng.integers(1, 9))
        prefix_of = tuple(int(rng.integers(-1, prefixes)) for _ in range(members))
        lens = tuple(int(rng.choice((0, 1, 5, 17, 40))) for _ in range(members))
        return Config(**dict(kw, splits=None), lens=lens, prefix_lens=prefix_lens, prefix_of=prefix_of)
    tokens = _draw_len(rng, L, 16)
    view = str(rng.choice(VIEWS))
    pad = int(rng.choice((1, 2, 4, 8))) if view in ("padded", "offset") else 0
    return Config(**kw, lens=(tokens,) * seqs, view=view, pad=pad)


# ----------------------------------------------------------------------------- inputs

def _rand(rng, shape):
    return rng.standard_normal(shape).astype(np.float32)


def _make_cache(values: np.ndarray, dtype, spec, hidden: np.ndarray):
    """A float or quantized cache of ``values``; positions where ``hidden`` (bool over
    the leading axes) is set are NaN (floats, or a quantized cache's scales)."""
    if spec is None:
        values = values.copy()
        values[hidden] = np.nan
        return mx.array(values).astype(dtype)
    q = quant.quantize(mx.array(values).astype(dtype), bits=spec[0], group_size=spec[1])
    scales = np.array(q.scales.astype(mx.float32))
    scales[hidden] = np.nan
    return q.replace(q.data, mx.array(scales).astype(dtype), q.biases)


def _pool(c: Config, rng, lens):
    """(key cache, value cache, block_tables) holding sequences of ``lens`` tokens in
    shuffled blocks; every slot no sequence owns is NaN, padding table entries point at
    an all-NaN block or out of range."""
    dtype = _MX[c.dtype]
    bs, D, Hkv = c.block_size, c.head_dim, c.num_kv_heads
    per_seq = [max(1, -(-n // bs)) for n in lens]
    num_blocks = sum(per_seq) + 2
    ids = rng.permutation(num_blocks)
    spare = int(ids[-1])  # never handed out: all NaN
    pad = spare if rng.random() < 0.5 else num_blocks + 1000  # padding entries: NaN block or out of range
    tables = np.full((len(lens), max(per_seq) + int(rng.integers(0, 3))), pad, np.int32)
    owned = np.zeros((num_blocks, bs), bool)
    cursor = 0
    for s, (n, nb) in enumerate(zip(lens, per_seq)):
        tables[s, :nb] = ids[cursor:cursor + nb]
        cursor += nb
        for t in range(n):
            owned[tables[s, t // bs], t % bs] = True
    hidden = np.broadcast_to(~owned[:, None, :], (num_blocks, Hkv, bs))
    shape = (num_blocks, Hkv, bs, D)
    kc = _make_cache(_rand(rng, shape), dtype, c.k_quant, hidden)
    vc = _make_cache(_rand(rng, shape), dtype, c.v_quant, hidden)
    return kc, vc, mx.array(tables)


def _sink_spread(c: Config) -> float:
    """1, or (sink_spread) the spread of the logits: q . k of N(0, 1) rows is N(0, D)
    (x 40 with big_scores), times the scale, bounded by a softcap: there a sink competes
    with the keys rather than vanishing beside them."""
    if not c.sink_spread:
        return 1.0
    spread = (c.scale if c.scale is not None else c.head_dim ** -0.5) * c.head_dim ** 0.5
    spread *= 40.0 if c.big_scores else 1.0
    return float(min(spread, c.softcap) if c.softcap else spread)


def _query(c: Config, rng, shape):
    q = _rand(rng, shape) * (40.0 if c.big_scores else 1.0)
    sinks = mx.array(_rand(rng, (shape[-2],)) * _sink_spread(c)) if c.sinks else None
    return mx.array(q).astype(_MX[c.dtype]), sinks


def paged_inputs(c: Config, rng):
    """(query [S, L, H, D], key cache, value cache, block_tables, seq_lens, sinks)."""
    kc, vc, tables = _pool(c, rng, c.lens)
    q, sinks = _query(c, rng, (len(c.lens), c.query_len, c.num_kv_heads * c.gqa, c.head_dim))
    return q, kc, vc, tables, mx.array(np.array(c.lens, np.int32)), sinks


def varlen_inputs(c: Config, rng):
    """(query [T, H, D], key cache, value cache, block_tables, seq_lens, query_start_loc, sinks)."""
    kc, vc, tables = _pool(c, rng, c.lens)
    qsl = np.concatenate([[0], np.cumsum(c.counts)]).astype(np.int32)
    q, sinks = _query(c, rng, (int(qsl[-1]), c.num_kv_heads * c.gqa, c.head_dim))
    return q, kc, vc, tables, mx.array(np.array(c.lens, np.int32)), mx.array(qsl), sinks


def cascade_inputs(c: Config, rng) -> tuple:
    """(positional args of paged_attention_cascade, sinks): the prefixes' rows of the pool
    first, then each sequence's own."""
    P = len(c.prefix_lens)
    kc, vc, tables = _pool(c, rng, tuple(c.prefix_lens) + tuple(c.lens))
    q, sinks = _query(c, rng, (len(c.lens), c.num_kv_heads * c.gqa, c.head_dim))
    args = (q, kc, vc, tables[:P], mx.array(np.array(c.prefix_lens, np.int32)),
            mx.array(np.array(c.prefix_of, np.int32)), tables[P:], mx.array(np.array(c.lens, np.int32)))
    return args, sinks


def _view(c: Config, rng, dtype, spec, B, Hkv, T, D):
    """A [B, Hkv, T, D] view (float or quantized: a view of each of its arrays) of
    larger arrays whose hidden elements are NaN (a quantized cache's scales and biases)."""
    extra_h = 2 if c.view == "slice_heads" else 0
    extra_t = 5 if c.view == "slice_t" else 0
    heads = slice(1, 1 + Hkv) if c.view == "slice_heads" else slice(None)
    live = _rand(rng, (B, Hkv, T, D))
    if spec is None:
        arrays = [(live, c.pad, True)]
    else:
        q = quant.quantize(mx.array(live).astype(dtype), bits=spec[0], group_size=spec[1])
        arrays = [(np.array(q.data), max(1, q.data.shape[-1] // 8) if c.pad else 0, False)]
        arrays += [(np.array(a.astype(mx.float32)), 1 if c.pad else 0, True) for a in (q.scales, q.biases)]
    views = []
    for a, pad, is_float in arrays:
        width = a.shape[-1]
        big = np.full((B, Hkv + extra_h, T + extra_t, width + pad), np.nan if is_float else 0, a.dtype)
        cols = slice(pad, pad + width) if c.view == "offset" else slice(0, width)
        big[:, heads, :T, cols] = a
        if c.view == "transposed":
            m = mx.array(np.ascontiguousarray(big.transpose(0, 2, 1, 3))).transpose(0, 2, 1, 3)
        else:
            m = mx.array(big)
        m = m.astype(dtype) if is_float else m
        views.append(m[:, heads, :T, cols])
    return views[0] if spec is None else quant.QuantizedKV(*views, spec[0], spec[1])


def decode_inputs(c: Config, rng):
    dtype = _MX[c.dtype]
    B, T, D, Hkv = len(c.lens), c.lens[0], c.head_dim, c.num_kv_heads
    k = _view(c, rng, dtype, c.k_quant, B, Hkv, T, D)
    v = _view(c, rng, dtype, c.v_quant, B, Hkv, T, D)
    H = Hkv * c.gqa
    q = _rand(rng, (B, H, c.query_len, D)) * (40.0 if c.big_scores else 1.0)
    sinks = mx.array(_rand(rng, (H,)) * _sink_spread(c)) if c.sinks else None
    return mx.array(q).astype(dtype), k, v, sinks


# ----------------------------------------------------------------------------- running

# A row is measured against at least this: a sink far above a row's keys leaves outputs
# the dtype holds only as subnormals (float16: below 2^-14), or that the kernels compute
# through float32 weights below 2^-126, which fast math flushes to zero (a float32 row of
# 1e-39 came out 0); 2^-100 leaves such flushes ~2^-26 of the row's scale.
ROW_FLOOR = {"float16": 2.0 ** -14, "bfloat16": 2.0 ** -100, "float32": 2.0 ** -100}


def _rel_error(out, expected, bound=0.0, floor=ROW_FLOOR["float32"]):
    """Per query row (the last axis is D): max |out - expected| over the row's max |expected|
    (a batch-wide scale let a wrong row with small outputs hide behind large ones, issue 41;
    at least ``floor``), less the sparse-V ``bound`` of the row over the same scale.
    Returns the worst row."""
    out = np.array(out.astype(mx.float32), dtype=np.float64)
    if out.shape != np.shape(expected):
        raise AssertionError(f"output shape {out.shape} != oracle shape {np.shape(expected)}")
    if not np.isfinite(out).all():
        return float("inf")
    if out.size == 0:  # a batch with no query rows: nothing to compare, the shape matched
        return 0.0
    scale = np.maximum(np.abs(expected).max(axis=-1), floor)
    err = np.abs(out - expected).max(axis=-1) / scale - np.asarray(bound, dtype=np.float64) / scale
    return float(err.max())


def _scale_term(c: Config) -> float:
    """The budget's share for large scores: a score q . k carries a float32 rounding
    error of about 2^-24 sum_d |q_d k_d| (~0.64 D for N(0, 1) rows, x 40 with big_scores),
    which the scale multiplies and the softmax passes to the output at about that relative
    size. At the default scale (D ** -0.5) and unit queries the dtype budget covers it; at
    scale 4 and D 256 it does not for float32 (the cpu backend's own error was 1.9e-5 on a
    sweep row), nor with big_scores at the default scale (D 112, GQA 9, softcap 50: the
    tiled varlen kernel 1.22e-5, the cpu backend 5.2e-6). There the term is the estimate
    itself, 2^-24 x 0.64 D x 40 x D ** -0.5 (1.6e-5 at D 112), without the explicit scale's
    factor 2: a kernel that loses more (an uncentred quantized key's cancellation, 2.09e-5
    at D 32 against 1e-5 + 0.86e-5) still fails."""
    if c.scale is not None:
        return 2.0 * 2.0 ** -24 * c.head_dim * c.scale * (40.0 if c.big_scores else 1.0)
    if c.big_scores:
        return 2.0 ** -24 * 0.64 * c.head_dim * 40.0 * c.head_dim ** -0.5
    return 0.0


def run_config(c: Config, seeds=SCHEDULE_SEEDS) -> float:
    """Run ``c`` on the strict simulator under each schedule seed; returns the worst
    relative error against the oracle. Raises AssertionError past the dtype's budget
    (or on NaN/inf), and lets simulator errors through."""
    import kvmetal as kv
    from . import trace

    rng = np.random.default_rng(c.data_seed)
    options = dict(scale=c.scale, softcap=c.softcap, num_splits=c.splits)
    sparse = dict(sparse_v=c.sparse_v) if c.sparse_v else {}
    bound = 0.0  # sparse V: the oracle's bound on the rows it may leave out, added to the budget
    if c.op == "paged":
        q, kc, vc, tables, lens, sinks = paged_inputs(c, rng)
        expected = ref.paged_attention(q, kc, vc, tables, lens, scale=c.scale, softcap=c.softcap, sinks=sinks,
                                       sliding_window=c.window)
        if sparse:
            bound = ref.paged_attention(q, kc, vc, tables, lens, scale=c.scale, softcap=c.softcap, sinks=sinks,
                                        sliding_window=c.window, with_bound=True, **sparse)[1]
        fn = lambda: kv.paged_attention(q, kc, vc, tables, lens, sinks=sinks, sliding_window=c.window, **options,
                                        **sparse)
    elif c.op == "varlen":
        args = varlen_inputs(c, rng)
        opts = dict(scale=c.scale, softcap=c.softcap, sinks=args[-1], sliding_window=c.window)
        expected = ref.paged_attention_varlen(*args[:-1], **opts)
        fn = lambda: kv.paged_attention_varlen(*args[:-1], **opts)
    elif c.op == "cascade":
        args, sinks = cascade_inputs(c, rng)
        expected = ref.paged_attention_cascade(*args, scale=c.scale, softcap=c.softcap, sinks=sinks)
        if sparse:
            bound = ref.paged_attention_cascade(*args, scale=c.scale, softcap=c.softcap, sinks=sinks, with_bound=True,
                                                **sparse)[1]
        fn = lambda: kv.paged_attention_cascade(*args, scale=c.scale, softcap=c.softcap, sinks=sinks, **sparse)
    else:
        q, k, v, sinks = decode_inputs(c, rng)
        expected = ref.decode_attention(q, k, v, scale=c.scale, softcap=c.softcap, sinks=sinks)
        if sparse:
            bound = ref.decode_attention(q, k, v, scale=c.scale, softcap=c.softcap, sinks=sinks, with_bound=True,
                                         **sparse)[1]
        fn = lambda: kv.decode_attention(q, k, v, sinks=sinks, **options, **sparse)
    budget = TOLERANCE[c.dtype] + _scale_term(c)
    worst = 0.0
    with kv.use_backend("sim"), _window_env(c.windows):
        for seed in seeds:
            with trace(strict=True, seed=seed):
                out = fn()
                mx.eval(out)
            err = _rel_error(out, expected, bound, ROW_FLOOR[c.dtype])
            if not err <= budget:
                raise AssertionError(f"schedule seed {seed}: relative error {err:.3g} > {budget:.3g}")
            worst = max(worst, err)
    return worst


def configs(count: int, seed: int, pool: int, ops=None, klass: str = "default") -> list:
    """``count`` configurations drawn with ``seed`` over a pool of ``pool`` kernel shapes
    (of the sweep ops ``ops``; default every attention op of the registry), of sweep
    class ``klass`` (CLASSES)."""
    _check_ops()
    if klass not in CLASSES:
        raise ValueError(f"[kvmetal.sim.sweep] unknown class {klass!r}; choose from {', '.join(CLASSES)}")
    rng = np.random.default_rng(seed)
    shapes = [draw_shape(rng, ops) for _ in range(max(1, pool))]
    return [draw_config(rng, shapes[int(rng.integers(len(shapes)))], klass) for _ in range(count)]


def sweep(count: int, *, seed: int = 0, pool: int = 32, out=sys.stdout, budget_s: float | None = None,
          progress: int = 0, skip: int = 0, ops=None, klass: str = "default") -> dict:
    """Run ``count`` configurations; prints one reproducer line per failure. Returns
    {"ran", "failed", "seconds", "failures": [(config, message)]}. ``budget_s`` stops
    early (reporting how many ran)."""
    t0 = time.perf_counter()
    failures, ran = [], 0
    for c in configs(skip + count, seed, pool, ops, klass)[skip:]:
        if budget_s is not None and time.perf_counter() - t0 > budget_s:
            break
        try:
            run_config(c)
        except Exception as e:  # noqa: BLE001 - every failure is reported with its reproducer
            message = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"
            failures.append((c, message))
            print(f"FAIL {message}\n  reproduce: {c.reproducer()}", file=out, flush=True)
        ran += 1
        if progress and ran % progress == 0:
            print(f"  ... {ran} configurations, {len(failures)} failed, {time.perf_counter() - t0:.0f} s",
                  file=out, flush=True)
    return {"ran": ran, "failed": len(failures), "seconds": time.perf_counter() - t0, "failures": failures}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvmetal.sim.sweep", description=__doc__.split("\n\n")[0])
    p.add_argument("--fuzz", type=int, default=0, metavar="N", help="run N random configurations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pool", type=int, default=150, help="kernel shapes the configurations share")
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS", help="stop after this long")
    p.add_argument("--skip", type=int, default=0, metavar="K",
                   help="start at configuration K of the seed's sequence (to split one sweep over processes)")
    p.add_argument("--case", type=str, default=None, help="rerun one configuration (a reproducer's JSON)")
    p.add_argument("--ops", type=str, default="", help=f"only these ops, comma-separated: {', '.join(OPS.values())}")
    p.add_argument("--class", dest="klass", choices=CLASSES, default="default",
                   help="sinks_scale: sinks and explicit scales often, varlen rows that see one or a few keys")
    args = p.parse_args(argv)
    if args.case:
        c = Config.from_json(args.case)
        print(f"max relative error {run_config(c):.3g}: ok")
        return 0
    ops = [o for o in args.ops.split(",") if o]
    unknown = set(ops) - set(OPS.values())
    if unknown:
        p.error(f"--ops: unknown op(s) {sorted(unknown)}; choose from {', '.join(OPS.values())}")
    result = sweep(args.fuzz, seed=args.seed, pool=args.pool, budget_s=args.budget, progress=25, skip=args.skip,
                   ops=ops or None, klass=args.klass)
    print(f"sweep: {result['ran']} configurations, {result['failed']} failed, {result['seconds']:.0f} s "
          f"(class {args.klass}, seed {args.seed}, pool {args.pool}, from configuration {args.skip})")
    return 1 if result["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
