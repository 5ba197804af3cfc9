"""Real models for kvmetal: GGUF conversion and the default model (SmolLM2-135M-Instruct).

    from kvmetal.models import default_model_path, convert_gguf
    path = default_model_path()                 # float32 on Linux, 4-bit on a Mac
    path = default_model_path(dtype="keep")     # the GGUF's 4-bit weights
"""
from .default import DefaultModelMissing, default_dtype, default_model_path, find_gguf
from .gguf import GGUFError, convert_gguf

__all__ = ["DefaultModelMissing", "GGUFError", "convert_gguf", "default_dtype", "default_model_path", "find_gguf"]
