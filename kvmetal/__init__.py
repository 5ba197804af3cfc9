"""kvmetal: paged and quantized KV-cache attention for MLX.

    import kvmetal as kv
    kc, vc = kv.reshape_and_cache(key, value, kc, vc, slot_mapping)
    out = kv.paged_attention(query, kc, vc, block_tables, seq_lens)

Backends: "metal" (Apple GPU, hand-written kernels), "cpu" (native C++), "sim"
(the metal backend's kernels run by a CPU simulator). See ``kv.use_backend``.
"""
from ._install_check import check_installation

# A clear ImportError for an MLX ABI mismatch now, and for a missing extension (a source
# tree shadowing the installed package) when something asks for kvmetal._ext.
_HAVE_EXTENSION = check_installation()

from .backends import available_backends, current_backend, use_backend  # noqa: E402
from .ops import (copy_blocks, decode_attention, gather_kv_cache, paged_attention,  # noqa: E402
                  paged_attention_cascade, paged_attention_varlen, reshape_and_cache)
from .quant import QuantizedKV  # noqa: E402

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
]


def __getattr__(name):
    if name == "_ext" and not _HAVE_EXTENSION:
        # `from kvmetal import _ext` lands here when the compiled module is absent.
        from ._install_check import missing_extension_message

        raise ImportError(missing_extension_message())
    # The cache pulls in more machinery; load it on first use.
    if name in ("PagedKVCache", "KVCacheFull"):
        from . import cache

        return getattr(cache, name)
    raise AttributeError(f"module 'kvmetal' has no attribute {name!r}")
