"""The specialisation families of the metal backend's kernels, derived from their
template parameters: the one registry of what must be compiled, checked and run.

A *specialisation family* is a set of kernel variants that share one code path:
the same template values where a value selects code (element type, quantized
format and its atom width, register / shared / multi-pass shared mode, key-group
width, tile size, whether an input is bound as ``constant``), whatever the sizes.
:func:`specialisation_families` finds a small list of op-level configurations
that reaches every family at least once: it runs a seeded grid of candidate
configurations through a :class:`~kvmetal.backends.metal.KernelBackend` whose
kernels only record what they were built and called with (no kernel runs), and
keeps, greedily, the candidates that add a family not yet seen.

``tools/msl_check.py`` compiles the exact MLX source of every family with
clang's address-space check; :func:`family_inputs` builds random inputs of one
family for running it (e.g. on the simulator against the float64 oracles), and
the hardening tests, the kernel mutants and ``kvmetal selfcheck`` run every
kernel of :data:`~kvmetal.backends.metal_specs.SPECS` through it. Every kernel in
SPECS must have its code-selecting parameters in :data:`PATH_PARAMETERS` and be
reached by some family (both checked by tests/test_metal_registry.py), so a
new kernel cannot be missed by any of them.
"""
from __future__ import annotations

import functools
import itertools
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .. import quant

# Template parameters that select code, per kernel (the others are sizes).
PATH_PARAMETERS = {
    "paged_attention_partials": ("TQ", "TK", "TV", "KBITS", "KAW", "VBITS", "VAW", "LPK", "TT", "PF", "SV", "TP"),
    "decode_attention_partials": ("TQ", "TK", "TV", "KBITS", "KAW", "VBITS", "VAW", "LPK", "TT", "PF", "SV", "TP"),
    "attention_reduce": ("TQ", "TP", "HAS_SINKS"),
    "cache_rows_convert": ("TC",),
    "cache_rows_quantize": ("TC", "BITS", "GS"),
    "gather_kv_rows": ("TE", "BITS", "GS", "BS"),
    "copy_blocks_gather": ("T",),
    "paged_varlen_partials": ("TQ", "TK", "TV", "KBITS", "VBITS", "NSG", "BK", "KT", "RF", "DS", "SKV"),
    "cascade_partials": ("TQ", "TK", "TV", "KBITS", "KAW", "VBITS", "VAW", "LPK", "TT", "PF", "SV", "TP"),
    "cascade_reduce": ("TQ", "TP", "HAS_SINKS"),
}
MAX_CONSTANT_ELEMENTS = 8  # MLX binds inputs with fewer elements as `constant`

OPS = ("paged_attention", "decode_attention", "paged_attention_varlen", "paged_attention_cascade",
       "gather_kv_cache", "reshape_and_cache", "copy_blocks")
# The ops whose kernels compute attention scores (softcap, masks, sinks apply).
ATTENTION_OPS = OPS[:4]
DTYPES = {"float16": mx.float16, "bfloat16": mx.bfloat16, "float32": mx.float32}


@dataclass(frozen=True)
class Family:
    """One op-level configuration and the specialisation families it reaches."""

    op: str                   # one of OPS
    dtype: str                # float16 / bfloat16 / float32
    head_dim: int
    num_kv_heads: int = 1
    gqa: int = 1
    query_len: int = 1        # varlen: new rows of each sequence (over 8: the tiled kernel)
    block_size: int = 16
    tokens: int = 40          # paged/gather/varlen: each sequence's length; decode: T; cascade: the prefix's
    num_seqs: int = 1         # cascade: the prefix's member sequences
    k_quant: tuple | None = None   # (bits, group_size) or None: float cache
    v_quant: tuple | None = None
    sinks: bool = False
    sparse_v: float | None = None  # paged/decode attention: the sparse-V threshold (SV = 1 kernels)
    keys: frozenset = field(default=frozenset(), compare=False)  # the families reached

    @property
    def name(self) -> str:
        fmt = lambda q: f"q{q[0]}g{q[1]}" if q else "f"
        return (f"{self.op}-{self.dtype}-d{self.head_dim}-hkv{self.num_kv_heads}-g{self.gqa}-l{self.query_len}"
                f"-bs{self.block_size}-t{self.tokens}-s{self.num_seqs}-k{fmt(self.k_quant)}-v{fmt(self.v_quant)}"
                + ("-sinks" if self.sinks else "") + (f"-sv{self.sparse_v:g}" if self.sparse_v else ""))


# ----------------------------------------------------------------------------- inputs

def _cache(rng, shape, dtype, spec):
    x = mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)
    return quant.quantize(x, bits=spec[0], group_size=spec[1]) if spec else x


def family_inputs(f: Family, seed: int = 0) -> tuple:
    """(positional args, keyword args) of the kvmetal op ``f.op`` (a function of
    ``kvmetal.ops`` and of ``kvmetal.reference``) running family ``f`` on random data.

    Paged caches hold every sequence in its own shuffled blocks; decode caches are
    contiguous [B, Hkv, T, D]."""
    rng = np.random.default_rng(seed)
    dtype = DTYPES[f.dtype]
    D, Hkv, H = f.head_dim, f.num_kv_heads, f.num_kv_heads * f.gqa
    if f.op == "decode_attention":
        q = mx.array(rng.standard_normal((f.num_seqs, H, f.query_len, D)).astype(np.float32)).astype(dtype)
        k = _cache(rng, (f.num_seqs, Hkv, f.tokens, D), dtype, f.k_quant)
        v = _cache(rng, (f.num_seqs, Hkv, f.tokens, D), dtype, f.v_quant)
        sinks = mx.array(rng.standard_normal(H).astype(np.float32)) if f.sinks else None
        return (q, k, v), dict(sinks=sinks, sparse_v=f.sparse_v)
    blocks = -(-f.tokens // f.block_size)
    num_blocks = blocks * f.num_seqs + 1
    tables = mx.array(rng.permutation(num_blocks)[:blocks * f.num_seqs].reshape(f.num_seqs, blocks)
                      .astype(np.int32))
    lens = mx.array(np.full(f.num_seqs, f.tokens, np.int32))
    shape = (num_blocks, Hkv, f.block_size, D)
    kc, vc = _cache(rng, shape, dtype, f.k_quant), _cache(rng, shape, dtype, f.v_quant)
    sinks = mx.array(rng.standard_normal(H).astype(np.float32)) if f.sinks else None
    if f.op == "paged_attention_varlen":
        q = mx.array(rng.standard_normal((f.num_seqs * f.query_len, H, D)).astype(np.float32)).astype(dtype)
        qsl = mx.array((np.arange(f.num_seqs + 1) * f.query_len).astype(np.int32))
        return (q, kc, vc, tables, lens, qsl), dict(sinks=sinks)
    if f.op == "paged_attention_cascade":
        q = mx.array(rng.standard_normal((f.num_seqs, H, D)).astype(np.float32)).astype(dtype)
        prefix_tables, prefix_lens, prefix_of, own_tables, own_lens = _cascade_tables(f, tables)
        return (q, kc, vc, prefix_tables, prefix_lens, prefix_of, own_tables,
                                             own_lens), dict(sinks=sinks, sparse_v=f.sparse_v)
    if f.op == "paged_attention":
        q = mx.array(rng.standard_normal((f.num_seqs, f.query_len, H, D)).astype(np.float32)).astype(dtype)
        return (q, kc, vc, tables, lens), dict(sinks=sinks, sparse_v=f.sparse_v)
    if f.op == "gather_kv_cache":
        return (kc, vc, tables, lens), {}
    if f.op == "reshape_and_cache":
        new = mx.array(rng.standard_normal((f.tokens, Hkv, D)).astype(np.float32)).astype(dtype)
        slots = mx.array(rng.permutation(num_blocks * f.block_size)[:f.tokens].astype(np.int32))
        return (new, new, kc, vc, slots), {}
    if f.op == "copy_blocks":
        pairs = rng.permutation(num_blocks)[:2 * min(f.num_seqs, num_blocks // 2)].astype(np.int32)
        return (kc, vc, mx.array(pairs[0::2]), mx.array(pairs[1::2])), {}
    raise ValueError(f"unknown op {f.op!r}")


def _cascade_tables(f: Family, tables: mx.array) -> tuple:
    """A cascade call's index arrays from a family's [S, blocks] tables: every one of the
    S sequences is a member of one prefix (sequence 0's table row, f.tokens long), and
    each owns its own row's first block, holding block_size // 2 + s % 3 tokens."""
    prefix_tables = tables[:1]
    prefix_lens = mx.array([f.tokens], dtype=mx.int32)
    prefix_of = mx.zeros((f.num_seqs,), dtype=mx.int32)
    own_lens = mx.array([min(f.block_size, f.block_size // 2 + s % 3) for s in range(f.num_seqs)], dtype=mx.int32)
    return prefix_tables, prefix_lens, prefix_of, tables[:, :1], own_lens


# ----------------------------------------------------------------------------- recording backend

class _Recorder:
    """A make_kernel for KernelBackend: its kernels record their specialisation and
    which inputs MLX would bind as `constant`, and return zeros (nothing runs)."""

    def __init__(self):
        self.calls = []

    def __call__(self, *, name, input_names, output_names, source, header, ensure_row_contiguous,
                 compile_options):
        recorder = self

        def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes, **_):
            constant = tuple(n for n, a in zip(input_names, inputs) if a.size < MAX_CONSTANT_ELEMENTS)
            recorder.calls.append((name, dict(template), constant, grid, threadgroup))
            return [mx.zeros(s, d) for s, d in zip(output_shapes, output_dtypes)]

        return kernel


def _spec_name(variant: str) -> str:
    from .metal_specs import SPECS

    return next(n for n in sorted(SPECS, key=len, reverse=True) if variant.startswith("kvmetal_" + n + "_"))


def _mode(template: dict) -> str:
    rows = template["G"] * template["QL"]
    if template["RPS"] >= rows:
        return "register"
    passes = -(-rows // (template["NSG"] * template["RPS"]))
    return "shared" if passes == 1 else "shared-multipass"


def _value(v):
    return str(v).split(".")[-1] if isinstance(v, mx.Dtype) else v


def family_keys(calls) -> frozenset:
    """The specialisation families the recorded kernel calls reach (see the module doc)."""
    keys = set()
    for variant, template, constant, _, _ in calls:
        kernel = _spec_name(variant)
        if kernel not in PATH_PARAMETERS:
            raise KeyError(f"[specialisations] kernel {kernel!r} of SPECS has no PATH_PARAMETERS entry: "
                           "list the template parameters that select its code")
        params = {k: _value(template[k]) for k in PATH_PARAMETERS[kernel]}
        extra = {}
        if "RPS" in template:
            extra["mode"] = _mode(template)
            # Quantized formats by atom width and group size; each in each mode.
            for side in ("K", "V"):
                bits = template[side + "BITS"]
                params[side + "AW"] = (bits, template[side + "AW"]) if bits else 0
                params[side + "GS"] = (bits, template[side + "GS"]) if bits else 0
                keys.add((kernel, extra["mode"], side + "BITS", bits))
                keys.add((kernel, extra["mode"], side + "T", _value(template["T" + side])))
            keys.add((kernel, extra["mode"], "SV", template["SV"]))  # sparse V in each mode
            keys.add((kernel, extra["mode"], "TQ", _value(template["TQ"])))  # the query's register type
            if not template["KBITS"] and not template["VBITS"]:  # both sides float: no scales at all
                keys.add((kernel, "float K and V"))
        for name, value in params.items():
            keys.add((kernel, name, value))
        for name, value in extra.items():
            keys.add((kernel, name, value))
        for name in constant:
            keys.add((kernel, "constant", name))
            if "mode" in extra:
                keys.add((kernel, extra["mode"], "constant", name))
    return frozenset(keys)


def _trace_keys(backend, recorder, f: Family) -> frozenset:
    recorder.calls.clear()
    fn, args, kwargs = backend_call(f)
    getattr(backend, fn)(*args, **kwargs)
    return family_keys(recorder.calls)


def _zeros_cache(shape, dtype, spec):
    if not spec:
        return mx.zeros(shape, dtype)
    bits, gs = spec
    lead = shape[:-1]
    return quant.QuantizedKV(mx.zeros((*lead, quant.packed_words(shape[-1], bits)), mx.uint32),
                             mx.zeros((*lead, shape[-1] // gs), dtype), mx.zeros((*lead, shape[-1] // gs), dtype),
                             bits, gs)


def backend_call(f: Family) -> tuple:
    """(backend method name, args, kwargs): a backend-contract call of ``f`` on zeros (the
    shapes decide the specialisation and the `constant` binding; the values do not)."""
    dtype = DTYPES[f.dtype]
    D, Hkv, H = f.head_dim, f.num_kv_heads, f.num_kv_heads * f.gqa
    opts = dict(scale=D ** -0.5, softcap=None, sinks=mx.zeros((H,)) if f.sinks else None, num_splits=None)
    if f.sparse_v and f.op in ("paged_attention", "decode_attention", "paged_attention_cascade"):
        opts["sparse_v"] = f.sparse_v
    if f.op == "decode_attention":
        shape = (f.num_seqs, Hkv, f.tokens, D)
        return "decode_attention", (mx.zeros((f.num_seqs, H, f.query_len, D), dtype),
                                    _zeros_cache(shape, dtype, f.k_quant), _zeros_cache(shape, dtype, f.v_quant)), opts
    blocks = -(-f.tokens // f.block_size)
    num_blocks = blocks * f.num_seqs + 1
    shape = (num_blocks, Hkv, f.block_size, D)
    kc, vc = _zeros_cache(shape, dtype, f.k_quant), _zeros_cache(shape, dtype, f.v_quant)
    tables = mx.zeros((f.num_seqs, blocks), mx.int32)
    lens = mx.full((f.num_seqs,), f.tokens, mx.int32)
    if f.op == "paged_attention_varlen":
        qsl = mx.array((np.arange(f.num_seqs + 1) * f.query_len).astype(np.int32))
        return "paged_attention_varlen", (mx.zeros((f.num_seqs * f.query_len, H, D), dtype), kc, vc, tables, lens,
                                          qsl), dict(scale=opts["scale"], softcap=None, sliding_window=None,
                                                     sinks=opts["sinks"])
    if f.op == "paged_attention_cascade":
        return "paged_attention_cascade", (mx.zeros((f.num_seqs, H, D), dtype), kc, vc,
                                           *_cascade_tables(f, tables)), \
            dict(scale=opts["scale"], softcap=None, sinks=opts["sinks"], sparse_v=opts.get("sparse_v"))
    if f.op == "paged_attention":
        return "paged_attention", (mx.zeros((f.num_seqs, f.query_len, H, D), dtype), kc, vc, tables, lens), \
            dict(opts, sliding_window=None)
    if f.op == "gather_kv_cache":
        return "gather_kv_cache", (kc, vc, tables, lens), dict(max_len=blocks * f.block_size)
    if f.op == "reshape_and_cache":
        return "reshape_and_cache", (mx.zeros((f.tokens, Hkv, D), dtype), mx.zeros((f.tokens, Hkv, D), dtype), kc, vc,
                                     mx.zeros((f.tokens,), mx.int32)), {}
    n = min(f.num_seqs, num_blocks // 2)
    return "copy_blocks", (kc, vc, mx.zeros((n,), mx.int32), mx.ones((n,), mx.int32)), {}


# ----------------------------------------------------------------------------- candidates

# The head dims the candidate grid draws from. head_dim is a size, not a code path, up to
# 256: every other dim kvmetal serves (ops.SUPPORTED_HEAD_DIMS) reaches only families these
# reach (tests/test_head_dims_small.py traces every candidate again at each of them). D 512
# (issue 40) takes paths of its own: varlen tiles with DS 4 and sequential K/V (SKV), and
# shared-mode tiles of 2 tokens.
GRID_HEAD_DIMS = (64, 128, 256, 512)
# Candidates drawn from each shuffled grid per head dim of GRID_HEAD_DIMS (the draws were
# 2500 and 600 over three head dims before D 512 joined).
_DRAWS_PER_HEAD_DIM = {"attention": 834, "varlen": 200, "cascade": 200}
SPARSE_V_TAU = 1e-3  # the threshold sparse-V candidates run with (any tau in (0, 1) builds SV = 1)
_QUANTS = (None, (2, 32), (2, 64), (3, 32), (4, 32), (4, 64), (4, 128), (5, 32), (6, 64), (8, 32), (8, 64),
           (8, 128), (2, 128), (3, 128), (5, 128), (6, 32))
_ROWS = ((1, 1), (2, 2), (4, 1), (1, 5), (8, 1), (3, 3), (4, 4), (16, 1), (6, 8), (16, 8), (32, 8), (48, 8))


def _fits(head_dim: int, spec) -> bool:
    return spec is None or (head_dim % spec[1] == 0 and head_dim * spec[0] % 32 == 0)


def _candidates():
    """A seeded grid over every axis the ops accept, small sizes first."""
    rng = np.random.default_rng(17)
    out = []
    for op in ("paged_attention", "decode_attention"):
        grid = list(itertools.product(DTYPES, GRID_HEAD_DIMS, _ROWS, _QUANTS, _QUANTS, (8, 16, 32)))
        rng.shuffle(grid)
        draws = _DRAWS_PER_HEAD_DIM["attention"] * len(GRID_HEAD_DIMS)
        for i, (dtype, D, (g, L), kq, vq, bs) in enumerate(grid[:draws]):
            if not (_fits(D, kq) and _fits(D, vq)):
                continue
            # Every 7th candidate compiles sparse V (SV = 1); chosen by position, so
            # the seeded draws of the other axes stay as they were.
            sparse_v = SPARSE_V_TAU if i % 7 == 3 else None
            if op == "decode_attention":
                # Tiny T puts a quantized cache's arrays (scales at D = group size, 2-bit
                # data at T = 1) under 8 elements: MLX binds them as `constant`.
                tokens = int(rng.choice((1, 2, 5, 7, 40)))
                out.append(Family(op, dtype, D, 1, g, min(L, tokens), 16, tokens, 1, kq, vq, bool(rng.integers(2)),
                                  sparse_v))
            else:
                seqs = int(rng.choice((1, 3)))
                out.append(Family(op, dtype, D, int(rng.choice((1, 2))), g, L, bs, int(rng.choice((L, 40))), seqs,
                                  kq, vq, bool(rng.integers(2)), sparse_v))
    # Varlen: runs of 9-40 new rows (the tiled kernel; shorter runs are the decode
    # partials above) at every dtype, head_dim and cache format.
    grid = list(itertools.product(DTYPES, GRID_HEAD_DIMS, (1, 4, 8), _QUANTS, _QUANTS, (8, 16, 32)))
    rng.shuffle(grid)
    for dtype, D, g, kq, vq, bs in grid[:_DRAWS_PER_HEAD_DIM["varlen"] * len(GRID_HEAD_DIMS)]:
        if _fits(D, kq) and _fits(D, vq):
            n = int(rng.choice((9, 17, 40)))
            out.append(Family("paged_attention_varlen", dtype, D, int(rng.choice((1, 2))), g, n, bs,
                              n + int(rng.choice((0, 23))), int(rng.choice((1, 2))), kq, vq, bool(rng.integers(2))))
    # Cascade: prefixes of 1-100 members (the chunking), every dtype and cache format.
    grid = list(itertools.product(DTYPES, GRID_HEAD_DIMS, (1, 4, 8), _QUANTS, _QUANTS, (8, 16, 32)))
    rng.shuffle(grid)
    for i, (dtype, D, g, kq, vq, bs) in enumerate(grid[:_DRAWS_PER_HEAD_DIM["cascade"] * len(GRID_HEAD_DIMS)]):
        if _fits(D, kq) and _fits(D, vq):
            members = int(rng.choice((1, 3, 16, 100)))
            out.append(Family("paged_attention_cascade", dtype, D, 1, g, 1, bs, int(rng.choice((bs, 40))), members,
                              kq, vq, bool(rng.integers(2)), SPARSE_V_TAU if i % 7 == 3 else None))
    for op, dtype, D, q, bs, seqs in itertools.product(("gather_kv_cache", "reshape_and_cache", "copy_blocks"),
                                                      DTYPES, (64, 128), _QUANTS, (8, 16, 32), (1, 3)):
        if _fits(D, q):
            out.append(Family(op, dtype, D, 1, 1, 1, bs, 9, seqs, q, q))
    return out


@functools.lru_cache(maxsize=None)
def specialisation_families() -> tuple:
    """Op-level configurations that together reach every specialisation family of the
    metal backend's kernels (each family at least once), in a fixed order. Each
    :class:`Family` lists the family keys it reaches in ``keys``."""
    from .metal import KernelBackend

    recorder = _Recorder()
    backend = KernelBackend("families", recorder, macos=15)
    seen, chosen = set(), []
    scored = []
    for f in _candidates():
        keys = _trace_keys(backend, recorder, f)
        scored.append((f, keys))
    # Greedy cover: the candidate adding the most unseen families, until none adds any.
    while True:
        best, gain = None, 0
        for f, keys in scored:
            new = len(keys - seen)
            if new > gain:
                best, gain = (f, keys), new
        if best is None:
            break
        f, keys = best
        seen |= keys
        chosen.append(Family(**{k: getattr(f, k) for k in f.__dataclass_fields__ if k != "keys"}, keys=keys))
    return tuple(chosen)


def all_family_keys() -> frozenset:
    """Every family key the candidates reach (what :func:`specialisation_families` covers)."""
    return frozenset().union(*(f.keys for f in specialisation_families()))
