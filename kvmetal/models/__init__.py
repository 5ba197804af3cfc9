"""Real models for kvmetal: GGUF conversion and the named models (SmolLM2-135M-Instruct,
the default, and Gemma-3-270M).

    from kvmetal.models import default_model_path, named_model_path, convert_gguf
    path = default_model_path()                 # SmolLM2: float32 on Linux, 4-bit on a Mac
    path = default_model_path(dtype="keep")     # the GGUF's 4-bit weights
    path = named_model_path("gemma3")           # Gemma-3-270M (base), float32 on Linux
"""
from .default import DefaultModelMissing, default_dtype, default_model_path, find_gguf
from .gguf import GGUFError, convert_gguf
from .named import MODELS, ModelMissing, named_model_path

__all__ = ["DefaultModelMissing", "GGUFError", "MODELS", "ModelMissing", "convert_gguf", "default_dtype",
           "default_model_path", "find_gguf", "named_model_path"]
