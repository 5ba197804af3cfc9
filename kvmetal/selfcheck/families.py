"""The kernel specialisation families ``kvmetal selfcheck`` compiles, and the op
calls that build every specialisation of one family.

:func:`specialisation_families` is the one place the list comes from. Today a family
(:class:`Family`) is one point of the kernels' template space (float dtype, head_dim,
block size, K/V formats, query rows, GQA) and runs all five ops there (paged attention
with every option on, contiguous decode over strided views, gather, cache write,
copy_blocks), which builds every kernel the backend has for that point: both partials
kernels, the reduce kernel with and without sinks, the convert or quantize write
kernels, the gather and copy kernels. :class:`OpFamily` takes a list in the other
form, one op-level configuration per family with a function building its inputs.
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from .. import quant
from ..backends import MAX_QUERY_TOKENS  # the decode ops' most query tokens per sequence

DTYPES = {"f16": mx.float16, "bf16": mx.bfloat16, "f32": mx.float32}
_DTYPE_TAGS = {**{v: k for k, v in DTYPES.items()}, "float16": "f16", "bfloat16": "bf16", "float32": "f32"}

# The trace shape every family runs at (tools/msl_check.py's): S sequences, H query
# heads over Hkv kv heads (GQA 4), N cache blocks, M blocks per table row.
NUM_SEQS, NUM_HEADS, NUM_KV_HEADS, NUM_BLOCKS, MAX_BLOCKS = 2, 8, 2, 16, 4
SEQ_LENS = (5, 9)  # raised to L where a family has more query rows (ops requires seq_len >= L)


def _fmt(q) -> str:
    return "float" if q is None else f"{q[0]}bit/g{q[1]}"


@dataclass(frozen=True)
class Family:
    dtype: str                   # "f16" | "bf16" | "f32"
    head_dim: int
    block_size: int
    k_quant: tuple | None        # (bits, group_size); None: a float cache
    v_quant: tuple | None
    query_len: int
    gqa: int = NUM_HEADS // NUM_KV_HEADS
    num_kv_heads: int = NUM_KV_HEADS
    tokens: int | None = None    # contiguous decode: T of the K/V views (default max(block_size - 1, L))
    sparse_v: float | None = None  # paged/decode attention's sparse-V threshold (None: the exact SV = 0 kernels)

    @property
    def name(self) -> str:
        name = (f"{self.dtype} D{self.head_dim} bs{self.block_size} L{self.query_len} G{self.gqa} "
                f"K {_fmt(self.k_quant)} V {_fmt(self.v_quant)}")
        if self.num_kv_heads != NUM_KV_HEADS:
            name += f" Hkv{self.num_kv_heads}"
        name += f" T{self.tokens}" if self.tokens is not None else ""
        return name + (f" sparse_v {self.sparse_v:g}" if self.sparse_v else "")

    def point(self) -> dict:
        """This family's point in the kernels' space, as the randomized sweep spells it."""
        return dict(dtype=self.dtype, d=self.head_dim, bs=self.block_size, hkv=self.num_kv_heads, g=self.gqa,
                    L=self.query_len, k=self.k_quant, v=self.v_quant)

    def paths(self, seed: int = 0) -> list:
        """(op name, thunk) pairs that build this family's kernels (see kernel_paths)."""
        return kernel_paths(self, seed)

    @property
    def mx_dtype(self):
        return DTYPES[self.dtype]

    @classmethod
    def from_params(cls, p) -> "Family":
        """A Family from a mapping or an object with the same fields; dtype may be an
        ``mx.Dtype`` or its tag, a format a (bits, group_size) pair or None. Extra
        fields are ignored, so a richer description of a family also converts."""
        get = (lambda k, d=None: p.get(k, d)) if isinstance(p, dict) else (lambda k, d=None: getattr(p, k, d))
        dtype = get("dtype")
        dtype = _DTYPE_TAGS.get(dtype, dtype)
        fmt = lambda q: None if q is None else (int(q[0]), int(q[1]))
        return cls(dtype=str(dtype), head_dim=int(get("head_dim")), block_size=int(get("block_size") or 16),
                   k_quant=fmt(get("k_quant")), v_quant=fmt(get("v_quant")), query_len=int(get("query_len") or 1),
                   gqa=int(get("gqa") or NUM_HEADS // NUM_KV_HEADS),
                   num_kv_heads=int(get("num_kv_heads") or NUM_KV_HEADS),
                   tokens=None if get("tokens") is None else int(get("tokens")),
                   sparse_v=None if not get("sparse_v") else float(get("sparse_v")))

    def as_dict(self) -> dict:
        return {"name": self.name, "dtype": self.dtype, "head_dim": self.head_dim, "block_size": self.block_size,
                "k_quant": list(self.k_quant) if self.k_quant else None,
                "v_quant": list(self.v_quant) if self.v_quant else None,
                "query_len": self.query_len, "gqa": self.gqa, "num_kv_heads": self.num_kv_heads,
                "tokens": self.tokens, "sparse_v": self.sparse_v}


class OpFamily:
    """A family given as one op-level configuration (with ``.op`` and ``.name``) and a
    function ``build_inputs(config, seed) -> (kvmetal op, args, kwargs)`` that makes
    its inputs: the form of a list derived from the kernels' specialisation parameters."""

    def __init__(self, config, build_inputs):
        self.config = config
        self._build_inputs = build_inputs

    @property
    def name(self) -> str:
        return str(self.config.name)

    def as_dict(self) -> dict:
        fields = getattr(self.config, "__dataclass_fields__", {})
        plain = lambda v: list(v) if isinstance(v, tuple) else v
        out = {k: plain(getattr(self.config, k)) for k in fields
               if isinstance(getattr(self.config, k), (str, int, float, bool, tuple, type(None)))}
        return {"name": self.name, **out}

    def point(self) -> dict:
        """As Family.point (the fields a configuration lacks take the Family defaults). A
        varlen family's new rows (9 and more: the tiled kernel) become the decode ops' most,
        8 query tokens, where the randomized sweep reuses the point for every op."""
        point = Family.from_params(self.config).point()
        return dict(point, L=min(point["L"], MAX_QUERY_TOKENS))

    def paths(self, seed: int = 0) -> list:
        fn, args, kwargs = self._build_inputs(self.config, seed)
        return [(self.config.op, lambda: fn(*args, **kwargs))]


def specialisation_families() -> list:
    """THE adapter: every family selfcheck compiles, the list the clang check traces
    (derived from the kernels' specialisation parameters in
    kvmetal/backends/specialisations.py), one op-level configuration per family."""
    from .. import ops
    from ..backends.specialisations import family_inputs, specialisation_families as derived

    def build_inputs(f, seed):
        return (getattr(ops, f.op), *family_inputs(f, seed))

    return [OpFamily(f, build_inputs) for f in derived()]


# ----------------------------------------------------------------------------- tracing one family

def _random(rng, shape, dtype) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def _maybe_quantize(x: mx.array, fmt):
    return x if fmt is None else quant.quantize(x, bits=fmt[0], group_size=fmt[1])


def flat_arrays(x) -> list:
    """The mx.arrays of an array, a QuantizedKV or a (nested) tuple of them (for mx.eval)."""
    if isinstance(x, quant.QuantizedKV):
        return list(x.arrays())
    if isinstance(x, (tuple, list)):
        return [a for item in x for a in flat_arrays(item)]
    return [x]


def kernel_paths(family: Family, seed: int = 0) -> list:
    """(op name, thunk) for the five kernel paths of one family. Each thunk calls a
    public op of ``kvmetal.ops`` (which dispatches to the current backend) and
    returns what it computed."""
    from .. import ops

    rng = np.random.default_rng(seed)
    dtype, d, bs = family.mx_dtype, family.head_dim, family.block_size
    hkv = family.num_kv_heads
    heads = hkv * family.gqa
    tokens = max(family.block_size - 1, family.query_len) if family.tokens is None else family.tokens
    shape = (NUM_BLOCKS, hkv, bs, d)
    kc = _maybe_quantize(_random(rng, shape, dtype), family.k_quant)
    vc = _maybe_quantize(_random(rng, shape, dtype), family.v_quant)
    tables = mx.array(rng.permutation(NUM_BLOCKS)[: NUM_SEQS * MAX_BLOCKS].reshape(NUM_SEQS, MAX_BLOCKS)
                      .astype(np.int32))
    lens = mx.array(np.array([max(n, family.query_len) for n in SEQ_LENS], np.int32))
    query = _random(rng, (NUM_SEQS, family.query_len, heads, d), dtype)
    rows = _random(rng, (3, hkv, d), mx.float32)

    def view(fmt):  # contiguous keys/values [S, Hkv, T, D]: an offset view of a longer array, as models pass
        base = _maybe_quantize(_random(rng, (NUM_SEQS, hkv, tokens + 1, d), dtype), fmt)
        if isinstance(base, quant.QuantizedKV):
            return base.replace(*(x[:, :, 1:] for x in base.arrays()))
        return base[:, :, 1:]

    keys, values = view(family.k_quant), view(family.v_quant)
    mx.eval(*flat_arrays((kc, vc, keys, values)), tables, lens, query, rows)
    paths = {
        "paged_attention": lambda: ops.paged_attention(query, kc, vc, tables, lens, scale=0.1, softcap=30.0,
                                                       sliding_window=7, sinks=mx.zeros((heads,)), num_splits=3,
                                                       sparse_v=family.sparse_v),
        "decode_attention": lambda: ops.decode_attention(query.transpose(0, 2, 1, 3), keys, values, scale=0.1,
                                                         sparse_v=family.sparse_v),
        "gather_kv_cache": lambda: ops.gather_kv_cache(kc, vc, tables, lens),
        "reshape_and_cache": lambda: ops.reshape_and_cache(rows, rows, kc, vc,
                                                           mx.array(np.array([0, bs + 1, -1], np.int32))),
        "copy_blocks": lambda: ops.copy_blocks(kc, vc, mx.array([1, 2], dtype=mx.int32),
                                               mx.array([3, 4], dtype=mx.int32)),
    }
    return list(paths.items())
