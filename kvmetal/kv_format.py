"""One value for how a KV cache stores K and V, from the flags to the kernels.

``KVFormat`` holds K's and V's bits (None: float) and group sizes, and the float dtype.
It is validated once, when it is made; ``from_flags`` gives ``kvmetal generate``,
``serve`` and ``bench -m`` one meaning for their flags (``--kv-bits`` sets both sides, a
per-side flag wins for its side, as mlx-lm users expect); ``for_head_dim`` fills the
group sizes left open for a model's head_dim; ``cache_options`` is what
``use_paged_cache`` / ``Engine`` / ``PagedModelCache`` take as ``kv_format``.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from . import quant

FLOAT_BYTES = {"f16": 2, "bf16": 2, "f32": 4}
FLOAT_NAMES = {"f16": "f16", "fp16": "f16", "float16": "f16", "half": "f16",
               "bf16": "bf16", "bfloat16": "bf16", "f32": "f32", "fp32": "f32", "float32": "f32"}


class KVFormatError(ValueError):
    """A K/V format that cannot be built; the message names the field (or flag)."""


DEFAULT_KV_GROUP_SIZE = 32


def default_group_size(head_dim: int) -> int:
    """Group size when none is given: 32 at every head_dim (``for_head_dim`` falls back to
    the largest supported size that divides head_dim). Measured on real text
    (docs/quantization.md, sections 3 and 4): K8/V4 at group 32 has 0.57-0.66x the KL of
    group 64 both at head_dim 64 (SmolLM2-135M) and at head_dim 256 (Gemma-3-270M), for
    4 more bytes per 64 values and side (8% more than K8/V4 g64 at head_dim 256)."""
    return DEFAULT_KV_GROUP_SIZE


def largest_group_size(head_dim: int) -> int | None:
    """The largest supported quantization group size dividing ``head_dim`` (96 -> 32), or None."""
    fits = [g for g in quant.SUPPORTED_GROUP_SIZES if head_dim % g == 0]
    return max(fits) if fits else None


@dataclass(frozen=True)
class KVFormat:
    """How K and V are stored: float (bits None) or quantized, each with its own bits and
    group size (None: chosen for the head_dim by ``for_head_dim``, else 64)."""

    k_bits: int | None = None
    v_bits: int | None = None
    k_group_size: int | None = None
    v_group_size: int | None = None
    dtype: str = "f16"   # float storage, and the dtype of quantization scales/biases (budgets)

    def __post_init__(self):
        for name in ("k_bits", "v_bits"):
            bits = getattr(self, name)
            if bits is not None and (isinstance(bits, bool) or bits not in quant.SUPPORTED_BITS):
                raise KVFormatError(f"{name} must be None or one of {quant.SUPPORTED_BITS}, got {bits!r}")
        for name in ("k_group_size", "v_group_size"):
            group = getattr(self, name)
            if group is not None and (isinstance(group, bool) or group not in quant.SUPPORTED_GROUP_SIZES):
                raise KVFormatError(f"{name} must be None or one of {quant.SUPPORTED_GROUP_SIZES}, got {group!r}")
        if self.dtype not in FLOAT_BYTES:
            raise KVFormatError(f"dtype must be one of {tuple(FLOAT_BYTES)}, got {self.dtype!r}")

    # ------------------------------------------------------------------ building

    @classmethod
    def from_flags(cls, *, kv_bits=None, k_bits=None, v_bits=None, kv_group_size=None, k_group_size=None,
                   v_group_size=None, dtype: str = "f16") -> "KVFormat":
        """The CLI's meaning, the same in every command: ``--kv-bits``/``--kv-group-size``
        set both sides, ``--k-*``/``--v-*`` set (and win for) their side. Errors name the flag."""
        def pick(both, side, both_flag, side_flag):
            return (side, side_flag) if side is not None else (both, both_flag)

        k, k_flag = pick(kv_bits, k_bits, "--kv-bits", "--k-bits")
        v, v_flag = pick(kv_bits, v_bits, "--kv-bits", "--v-bits")
        kg, kg_flag = pick(kv_group_size, k_group_size, "--kv-group-size", "--k-group-size")
        vg, vg_flag = pick(kv_group_size, v_group_size, "--kv-group-size", "--v-group-size")
        for flag, bits in ((k_flag, k), (v_flag, v)):
            if bits is not None and bits not in quant.SUPPORTED_BITS:
                raise KVFormatError(f"{flag} must be one of {quant.SUPPORTED_BITS}, got {bits}")
        for flag, group in ((kg_flag, kg), (vg_flag, vg)):
            if group is not None and group not in quant.SUPPORTED_GROUP_SIZES:
                raise KVFormatError(f"{flag} must be one of {quant.SUPPORTED_GROUP_SIZES}, got {group}")
        fmt = cls(k_bits=k, v_bits=v, k_group_size=kg, v_group_size=vg, dtype=dtype)
        object.__setattr__(fmt, "_flags", {"k": kg_flag, "v": vg_flag})
        return fmt

    @classmethod
    def coerce(cls, kv_format=None, *, k_bits=None, v_bits=None, group_size=None, k_group_size=None,
               v_group_size=None, owner: str = "kv_format") -> "KVFormat":
        """One KVFormat from an API's ``kv_format`` or its older keyword arguments (not both)."""
        loose = {k: v for k, v in (("k_bits", k_bits), ("v_bits", v_bits), ("group_size", group_size),
                                   ("k_group_size", k_group_size), ("v_group_size", v_group_size))
                 if v is not None}
        if kv_format is not None:
            if not isinstance(kv_format, KVFormat):
                raise TypeError(f"[{owner}] kv_format must be a kvmetal.KVFormat, got {type(kv_format).__name__}")
            if loose:
                raise ValueError(f"[{owner}] give kv_format or {', '.join(sorted(loose))}, not both")
            return kv_format
        try:
            return cls(k_bits=k_bits, v_bits=v_bits,
                       k_group_size=k_group_size if k_group_size is not None else group_size,
                       v_group_size=v_group_size if v_group_size is not None else group_size)
        except KVFormatError as exc:
            raise KVFormatError(f"[{owner}] {exc}") from None

    def for_head_dim(self, head_dim: int) -> "KVFormat":
        """Group sizes filled and checked for ``head_dim``: a quantized side without one
        gets ``default_group_size`` (or the largest that divides head_dim); one given that
        does not divide it is an error naming its flag (or field) with one that would."""
        groups = {}
        for side in ("k", "v"):
            bits, group = getattr(self, f"{side}_bits"), getattr(self, f"{side}_group_size")
            name = getattr(self, "_flags", {}).get(side, f"{side}_group_size")
            if bits is None:
                groups[side] = group
                continue
            if group is None:
                group = default_group_size(head_dim)
                if head_dim % group:
                    group = largest_group_size(head_dim)
                    if group is None:
                        raise KVFormatError(f"head_dim {head_dim} has no supported quantization group size "
                                            f"({quant.SUPPORTED_GROUP_SIZES})")
            elif head_dim % group:
                raise KVFormatError(f"{name} {group} does not divide the model's head_dim {head_dim}; "
                                    f"try {name} {largest_group_size(head_dim) or 32}")
            groups[side] = group
        return replace(self, k_group_size=groups["k"], v_group_size=groups["v"])

    # ------------------------------------------------------------------ reading

    @property
    def quantized(self) -> bool:
        return self.k_bits is not None or self.v_bits is not None

    def group_size(self, side: str) -> int:
        """The group size of ``side`` ('k' or 'v'): the one set, else the library default."""
        group = self.k_group_size if side == "k" else self.v_group_size
        return quant.DEFAULT_GROUP_SIZE if group is None else group

    def cache_options(self) -> dict:
        """K/V keyword arguments of ``PagedKVCache``."""
        return dict(k_bits=self.k_bits, v_bits=self.v_bits, k_group_size=self.group_size("k"),
                    v_group_size=self.group_size("v"))

    @property
    def label(self) -> str:
        if not self.quantized:
            return self.dtype
        side = lambda bits: self.dtype if bits is None else str(bits)
        label = f"K{side(self.k_bits)}/V{side(self.v_bits)}"
        groups = {self.group_size(s) for s, b in (("k", self.k_bits), ("v", self.v_bits)) if b}
        return label + (f" g{groups.pop()}" if len(groups) == 1 else
                        f" g{self.group_size('k')}/{self.group_size('v')}")

    def row_bytes(self, head_dim: int, which: str) -> int:
        """Bytes of one K (``which='k'``) or V row of ``head_dim`` values."""
        bits = self.k_bits if which == "k" else self.v_bits
        scale_bytes = FLOAT_BYTES[self.dtype]
        if bits is None:
            return head_dim * scale_bytes
        return quant.row_nbytes(head_dim, bits=bits, group_size=self.group_size(which), scale_bytes=scale_bytes)


# ----------------------------------------------------------------------------- the CLI's flags

FORMAT_FLAGS_HELP = ("K/V storage: --kv-bits quantizes K and V (mlx-lm's flag); --k-bits / --v-bits set one "
                     "side and win over --kv-bits for it (K8/V4: --k-bits 8 --v-bits 4, or --kv-bits 4 --k-bits 8); "
                     "the group sizes likewise (default 32, or the largest that divides head_dim).")


def add_format_flags(parser) -> None:
    """The K/V format flags, the same in ``kvmetal generate``, ``serve`` and ``bench -m``."""
    bits = dict(type=int, choices=quant.SUPPORTED_BITS, default=None,
                metavar="{" + ",".join(map(str, quant.SUPPORTED_BITS)) + "}")
    groups = dict(type=int, choices=quant.SUPPORTED_GROUP_SIZES, default=None,
                  metavar="{" + ",".join(map(str, quant.SUPPORTED_GROUP_SIZES)) + "}")
    parser.add_argument("--kv-bits", **bits, help="quantize K and V to these bits (mlx-lm's flag)")
    parser.add_argument("--kv-group-size", **groups,
                        help="quantization group size of K and V (default 32, or the largest that divides "
                             "head_dim)")
    parser.add_argument("--k-bits", **bits, help="quantize K to these bits (wins over --kv-bits for K)")
    parser.add_argument("--v-bits", **bits, help="quantize V to these bits (wins over --kv-bits for V)")
    parser.add_argument("--k-group-size", **groups, help="group size of K (wins over --kv-group-size)")
    parser.add_argument("--v-group-size", **groups, help="group size of V (wins over --kv-group-size)")


def format_from_args(args) -> KVFormat:
    """The KVFormat the flags of ``add_format_flags`` name (errors name the flag)."""
    return KVFormat.from_flags(**{name: getattr(args, name, None) for name in
                                  ("kv_bits", "k_bits", "v_bits", "kv_group_size", "k_group_size", "v_group_size")})


def format_notes(fmt: KVFormat, head_dim: int) -> list:
    """What ``for_head_dim`` chose that a user would not expect (a group size other than the default)."""
    resolved = fmt.for_head_dim(head_dim)
    auto = [(side.upper(), resolved.group_size(side)) for side in ("k", "v")
            if getattr(fmt, f"{side}_bits") is not None and getattr(fmt, f"{side}_group_size") is None
            and resolved.group_size(side) != default_group_size(head_dim)]
    if not auto:
        return []
    sides = " and ".join(side for side, _ in auto)
    return [f"head_dim {head_dim} is not a multiple of {default_group_size(head_dim)}: {sides} "
            f"use{'s' if len(auto) == 1 else ''} group size {auto[0][1]}"]
