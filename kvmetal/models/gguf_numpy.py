"""A GGUF file read with llama.cpp's own ``gguf`` package (NumPy): metadata and tensors.

``mx.load`` reads only the GGUF tensor types that map onto MLX's affine format (Q4_0,
Q4_1, Q8_0) and float ones; K-quants (Q4_K, Q5_K, Q6_K, ...) and Q5_0/Q5_1 it cannot
read. The ``gguf`` package dequantizes every type llama.cpp writes, in NumPy, so the
converters for such files (:mod:`kvmetal.models.gemma3_convert`) read through here.

    meta = read_metadata(reader)         # {key: int | float | bool | str | list}
    for name, kind in tensor_types(reader).items(): ...
    w = dequantize(reader, "blk.0.attn_q.weight")   # float32, PyTorch/MLX [out, in] order
"""
from __future__ import annotations

import os
from pathlib import Path

from .gguf import GGUFError

# gguf.GGUFValueType members whose values are scalars/strings; ARRAY holds a list of them.
_ARRAY = "ARRAY"


def open_reader(path: str | os.PathLike):
    """``gguf.GGUFReader`` on ``path``, with one-line errors (no file, not GGUF, no package)."""
    path = Path(path)
    if not path.is_file():
        raise GGUFError(f"{str(path)!r}: no such file")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise GGUFError(f"{str(path)!r} is not a GGUF file (no GGUF magic)")
    try:
        import gguf
    except ImportError:
        raise GGUFError(f"{path.name}: reading K-quantized GGUF files needs llama.cpp's gguf package "
                        f"(pip install gguf)") from None
    try:
        return gguf.GGUFReader(str(path))
    except Exception as exc:  # the package's own message names what it cannot parse
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise GGUFError(f"{path.name}: the gguf package cannot read this file ({reason})") from None


def read_metadata(reader) -> dict:
    """Every key-value field as a plain Python value (strings, numbers, bools, lists)."""
    meta = {}
    for key, field in reader.fields.items():
        if key.startswith("GGUF."):
            continue  # the header's own counts
        value = field.contents()
        meta[key] = value.tolist() if hasattr(value, "tolist") else value
    return meta


def tensor_types(reader) -> dict:
    """{tensor name: GGML type name} in file order (e.g. ``"Q4_K"``, ``"F32"``)."""
    return {t.name: t.tensor_type.name for t in reader.tensors}


def dequantize(reader, name: str):
    """One tensor as a float32 NumPy array in row-major ``[..., out, in]`` order (GGUF
    lists dimensions fastest first; this is the reverse, as PyTorch and MLX store it)."""
    import numpy as np
    from gguf import quants

    for t in reader.tensors:
        if t.name == name:
            break
    else:
        raise GGUFError(f"GGUF has no tensor {name!r}")
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    try:
        values = quants.dequantize(t.data, t.tensor_type)
    except NotImplementedError:
        raise GGUFError(f"GGUF tensor {name!r} has type {t.tensor_type.name}, which the gguf package cannot "
                        f"dequantize") from None
    return np.ascontiguousarray(values, dtype=np.float32).reshape(shape)
