"""kvmetal: paged and quantized KV-cache attention for MLX.

    import kvmetal as kv
    kc, vc = kv.reshape_and_cache(key, value, kc, vc, slot_mapping)
    out = kv.paged_attention(query, kc, vc, block_tables, seq_lens)

Backends: "metal" (Apple GPU, hand-written kernels), "cpu" (native C++), "sim"
(the metal backend's kernels run by a CPU simulator). See ``kv.use_backend``.
"""
import importlib as _importlib

__version__ = "0.1.0"

__all__ = [
    "reshape_and_cache",
    "paged_attention",
    "paged_attention_varlen",
    "paged_attention_cascade",
    "gather_kv_cache",
    "decode_attention",
    "copy_blocks",
    "use_backend",
    "current_backend",
    "available_backends",
    "QuantizedKV",
    "PagedKVCache",
    "KVCacheFull",
    "KVFormat",
]

# Public names are loaded on first use (PEP 562), so ``import kvmetal`` loads neither MLX
# nor the extension: the ``kvmetal`` command puts OpenBLAS under MLX before MLX loads
# (kvmetal/models/blas.py), and what needs no compiled kernel (budget, convert-gguf, the
# simulator, the reference) runs whatever state the extension is in.
_HOME = {name: "ops" for name in __all__[:7]}
_HOME.update(use_backend="backends", current_backend="backends", available_backends="backends",
             QuantizedKV="quant", PagedKVCache="cache", KVCacheFull="cache", KVFormat="kv_format")


def __getattr__(name):
    if name == "_ext":
        # `from kvmetal import _ext` lands here before the module loads: an extension built
        # for another MLX, or a source tree without one, is one clear ImportError.
        from ._install_check import extension_problem

        problem = extension_problem()
        if problem:
            raise ImportError(problem)
        return _importlib.import_module(f"{__name__}._ext")
    home = _HOME.get(name)
    if home is not None:
        value = getattr(_importlib.import_module(f"{__name__}.{home}"), name)
        globals()[name] = value
        return value
    if not name.startswith("_"):  # a submodule, as `import kvmetal; kvmetal.backends` found it before
        try:
            return _importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module 'kvmetal' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_HOME))
