"""A GGUF file read in NumPy: metadata, tensor directory, and dequantization through
llama.cpp's own ``gguf`` package.

``mx.load`` reads only the GGUF tensor types that map onto MLX's affine format (Q4_0,
Q4_1, Q8_0) and float ones; K-quants (Q4_K, Q5_K, Q6_K, ...) and Q5_0/Q5_1 it cannot
read. The ``gguf`` package dequantizes every type llama.cpp writes, so the converters
for such files (:mod:`kvmetal.models.gemma3_convert`) read through here. The header is
parsed (and checked against the file) by :mod:`kvmetal.models.gguf_header` rather than
with ``gguf.GGUFReader``, which builds an object per array element (36 s for Gemma's
262,144-piece vocabulary on a busy 2-core host; this: ~1 s).

    f = GGUFFile(path)
    f.meta                                  # {key: int | float | bool | str | list}
    f.tensors["blk.0.attn_q.weight"]        # TensorInfo(type "Q5_0", shape (1024, 640), ...)
    w = f.dequantize("blk.0.attn_q.weight") # float32, PyTorch/MLX [out, in] order
"""
from __future__ import annotations

from .gguf_base import GGUFError
from .gguf_header import GGUFHeader, TensorInfo, read_header

__all__ = ["GGUFFile", "TensorInfo"]


def _gguf_package():
    try:
        import gguf
    except ImportError:
        from ..cli_args import install_hint

        raise GGUFError(f"reading K-quantized GGUF files needs llama.cpp's gguf package: {install_hint('gguf')}") \
            from None
    return gguf


class GGUFFile:
    """The metadata and tensor directory of one GGUF file (checked against the file by
    :func:`~kvmetal.models.gguf_header.read_header`); tensors are read on demand."""

    def __init__(self, path, *, header: GGUFHeader | None = None):
        gguf = _gguf_package()
        header = header if header is not None else read_header(path)
        self.path = header.path
        self.meta, self.tensors = header.meta, header.tensors
        for info in self.tensors.values():
            try:
                gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(info.type_id)]
            except (ValueError, KeyError):
                raise GGUFError(f"GGUF tensor {info.name!r} has type id {info.type_id}, which the gguf package "
                                f"does not know") from None

    def dequantize(self, name: str):
        """One tensor as a float32 NumPy array in row-major ``[..., out, in]`` order."""
        import numpy as np

        gguf = _gguf_package()
        info = self.tensors.get(name)
        if info is None:
            raise GGUFError(f"GGUF has no tensor {name!r}")
        kind = gguf.GGMLQuantizationType(info.type_id)
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=(info.nbytes,))
        rows = max(1, int(np.prod(info.shape[:-1])))
        try:
            values = gguf.quants.dequantize(np.array(raw).reshape(rows, info.nbytes // rows), kind)
        except NotImplementedError:
            raise GGUFError(f"GGUF tensor {name!r} has type {info.type}, which the gguf package cannot "
                            f"dequantize") from None
        return np.ascontiguousarray(values, dtype=np.float32).reshape(info.shape)
