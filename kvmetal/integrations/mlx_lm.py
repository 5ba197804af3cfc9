"""Drop-in paged KV cache for mlx-lm models.

    from kvmetal.integrations.mlx_lm import use_paged_cache
    with use_paged_cache(model, block_size=16, k_bits=8, v_bits=4):
        text = mlx_lm.generate(model, tokenizer, prompt)

Two patches, both undone on exit: ``model.make_cache`` returns kvmetal caches (mlx-lm's
``make_prompt_cache`` prefers it, so ``generate``, ``stream_generate`` and
``generate_step`` pick them up unchanged), and the name ``scaled_dot_product_attention``
in the model's module is wrapped so that a layer holding a kvmetal cache attends through
kvmetal: ``paged_attention`` for decode and passes of up to 8 tokens (speculative
verification, short chunks), ``paged_attention_varlen`` for longer passes (a prompt, a
chunk after a cached prefix, a batch of prompts), both reading the pool in place. Any
other cache goes to mlx-lm's own function untouched.

Every ``make_cache()`` of one patch draws its sequences from one shared pool, so
mlx-lm's ``BatchGenerator`` merges, splits and extracts them as table operations; a
cache's blocks go back when the cache is dropped. Patching is atomic per model: a
second ``use_paged_cache`` on a patched model raises, from any thread.
"""
from __future__ import annotations

import sys
import threading

import mlx.core as mx

from .. import ops, quant
from ..kv_format import KVFormat, KVFormatError
from .model_cache import LayerSpec, PagedLayerCache, PagedModelCache, RaggedLayerCache

# model families whose attention we have checked token for token against mlx-lm
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gemma3_text", "gpt_oss")

_patch_lock = threading.Lock()
_patched_modules: dict = {}  # module name -> [original function, number of live patches]
_patched_models: dict = {}  # id(model) -> its live PagedCacheHandle (claimed before any work)


def model_family(model) -> str:
    """The mlx-lm model module a model comes from (e.g. "llama")."""
    return type(model).__module__.rsplit(".", 1)[-1]


def _paged_sdpa_for(original):
    def scaled_dot_product_attention(queries, keys, values, cache=None, scale=None, mask=None, sinks=None, **kwargs):
        if isinstance(cache, (PagedLayerCache, RaggedLayerCache)):
            if kwargs:
                raise NotImplementedError(f"[use_paged_cache] attention options {sorted(kwargs)} are not supported")
            return cache.attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
        if sinks is not None:
            kwargs["sinks"] = sinks
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    scaled_dot_product_attention.__wrapped__ = original
    scaled_dot_product_attention.__kvmetal__ = True
    return scaled_dot_product_attention


def _patch_module(name: str) -> None:
    with _patch_lock:
        if name in _patched_modules:
            _patched_modules[name][1] += 1
            return
        module = sys.modules[name]
        original = module.scaled_dot_product_attention
        module.scaled_dot_product_attention = _paged_sdpa_for(original)
        _patched_modules[name] = [original, 1]


def _unpatch_module(name: str) -> None:
    with _patch_lock:
        entry = _patched_modules[name]
        entry[1] -= 1
        if entry[1] == 0:
            sys.modules[name].scaled_dot_product_attention = entry[0]
            del _patched_modules[name]


def _original_caches(model) -> list:
    """The caches mlx-lm itself would build for ``model``."""
    make = getattr(type(model), "make_cache", None)
    if make is not None:
        return make(model)
    from mlx_lm.models.cache import KVCache

    return [KVCache() for _ in model.layers]


def layer_specs(model) -> list:
    """Per layer: the attention window and the K/V row shape and dtype.

    Windows come from the caches mlx-lm would build (a ``RotatingKVCache(max_size=W)``
    layer attends to the last W tokens); shapes from one probe token through the model."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    caches = _original_caches(model)
    windows = []
    for i, c in enumerate(caches):
        if type(c) is KVCache:
            windows.append(None)
        elif type(c) is RotatingKVCache and c.keep == 0:
            windows.append(int(c.max_size))
        else:
            raise NotImplementedError(f"[use_paged_cache] layer {i} uses {type(c).__name__}"
                                      f"{f'(keep={c.keep})' if hasattr(c, 'keep') else ''}, which kvmetal does not model")
    model(mx.array([[0]]), cache=caches)
    specs = []
    for i, (c, window) in enumerate(zip(caches, windows)):
        if c.keys is None or c.keys.shape[-1] != c.values.shape[-1]:
            raise NotImplementedError(f"[use_paged_cache] layer {i}: keys and values must share head_dim")
        specs.append(LayerSpec(window, int(c.keys.shape[1]), int(c.keys.shape[-1]), c.keys.dtype))
    return specs


class PagedCacheHandle:
    """An active ``use_paged_cache`` patch; ``undo()`` (or leaving the ``with``) restores the model."""

    def __init__(self, model, *, block_size: int, num_blocks: int | None, kv_format: KVFormat,
                 sparse_v: float | None = None):
        self.model = model
        self.kv_format = kv_format
        self.options = dict(block_size=block_size, num_blocks=num_blocks, kv_format=kv_format, sparse_v=sparse_v)
        self.active = False
        with _patch_lock:  # claim the model first: a second patch, from any thread, fails here
            if id(model) in _patched_models:
                raise ValueError("[use_paged_cache] this model already uses a paged cache; undo that one first")
            _patched_models[id(model)] = self
        try:
            self.specs = layer_specs(model)
            self._module = type(model).__module__
            self._had_instance_make_cache = "make_cache" in vars(model)
            self._instance_make_cache = vars(model).get("make_cache")
            _patch_module(self._module)
        except BaseException:
            with _patch_lock:
                del _patched_models[id(model)]
            raise
        model.make_cache = self.make_cache
        self._shared = None
        self.active = True

    def new_model_cache(self, **overrides) -> PagedModelCache:
        """An empty paged cache for this model (the engine adds its own sequences);
        ``overrides`` replace PagedModelCache options (the Engine's ``cascade``)."""
        return PagedModelCache(self.specs, **{**self.options, **overrides})

    @property
    def shared_cache(self) -> PagedModelCache:
        """The pool every ``make_cache()`` of this patch draws its sequences from."""
        if self._shared is None:
            self._shared = self.new_model_cache()
        return self._shared

    def make_cache(self) -> list:
        """What ``model.make_cache()`` returns while patched: one-sequence layer caches
        (a batch in the first forward pass widens them) whose blocks live in the shared
        pool until the caches are dropped."""
        _refuse_dropped_options()
        return self.shared_cache.owned_layer_caches(1)

    def undo(self) -> None:
        with _patch_lock:
            if not self.active:
                return
            self.active = False
            if self._had_instance_make_cache:
                self.model.make_cache = self._instance_make_cache
            else:
                vars(self.model).pop("make_cache", None)
            del _patched_models[id(self.model)]
        _unpatch_module(self._module)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()
        return False


def _refuse_dropped_options() -> None:
    """mlx-lm's ``make_prompt_cache(model, max_kv_size=N)`` calls ``model.make_cache()``
    without passing ``max_kv_size`` on (it would build a rotating cache otherwise): the
    option would be silently lost, so refuse it here."""
    from mlx_lm.models import cache as mlx_cache

    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code is mlx_cache.make_prompt_cache.__code__:
            if frame.f_locals.get("max_kv_size") is not None:
                raise NotImplementedError(
                    f"[use_paged_cache] max_kv_size={frame.f_locals['max_kv_size']} is not supported: mlx-lm "
                    "would keep 4 sink tokens plus a rotating window, which kvmetal's paged cache does not "
                    "model. Drop max_kv_size (cap memory with use_paged_cache(num_blocks=...)) or undo the patch")
            return
        frame = frame.f_back


def _register_for_load_prompt_cache() -> None:
    """mlx-lm's ``load_prompt_cache`` finds cache classes by name in its cache module."""
    from mlx_lm.models import cache as mlx_cache

    if getattr(mlx_cache, PagedLayerCache.__name__, None) is not PagedLayerCache:
        setattr(mlx_cache, PagedLayerCache.__name__, PagedLayerCache)


def use_paged_cache(model, *, block_size: int = 16, num_blocks: int | None = None, kv_format: KVFormat | None = None,
                    k_bits: int | None = None, v_bits: int | None = None, k_group_size: int | None = None,
                    v_group_size: int | None = None, sparse_v: float | None = None) -> PagedCacheHandle:
    """Make an mlx-lm ``model`` keep its KV cache in kvmetal's paged pools.

    Args:
        model: an mlx-lm model of a supported family (``SUPPORTED_FAMILIES``).
        block_size: tokens per block (8, 16 or 32).
        num_blocks: blocks per pool; None grows the pool on demand.
        kv_format: how K and V are stored (``kvmetal.KVFormat(k_bits=8, v_bits=4)``): bits and
            group size per side; a group size left None is 32, or the largest supported size
            that divides the model's head_dim (``kvmetal.kv_format.default_group_size``).
        k_bits, v_bits, k_group_size, v_group_size: the same as loose arguments (instead of
            ``kv_format``).
        sparse_v: sparse-V threshold tau of the decode passes (None or 0: exact); see
            ``kvmetal.paged_attention`` and docs/kernels.md ("Sparse V").
    Returns:
        A handle: use it as a context manager or call ``undo()``.
    """
    family = model_family(model)
    if family not in SUPPORTED_FAMILIES:
        raise NotImplementedError(f"[use_paged_cache] model family {family!r} is not supported; "
                                  f"supported: {', '.join(SUPPORTED_FAMILIES)}")
    if block_size not in ops.SUPPORTED_BLOCK_SIZES:
        raise ValueError(f"[use_paged_cache] block_size must be one of {ops.SUPPORTED_BLOCK_SIZES}, got {block_size!r}")
    if num_blocks is not None and (not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks < 1):
        raise ValueError(f"[use_paged_cache] num_blocks must be None or an int >= 1, got {num_blocks!r}")
    kv_format = KVFormat.coerce(kv_format, k_bits=k_bits, v_bits=v_bits, k_group_size=k_group_size,
                                v_group_size=v_group_size, owner="use_paged_cache")
    sparse_v = ops.sparse_v_threshold("use_paged_cache", sparse_v)
    _register_for_load_prompt_cache()
    handle = PagedCacheHandle(model, block_size=block_size, num_blocks=num_blocks, kv_format=kv_format,
                              sparse_v=sparse_v)
    try:  # a group size that does not divide a layer's head_dim: refused before any pass
        for spec in handle.specs:
            kv_format.for_head_dim(spec.head_dim)
    except KVFormatError as exc:
        handle.undo()
        raise KVFormatError(f"[use_paged_cache] {exc}") from None
    return handle


try:  # so that load_prompt_cache finds PagedLayerCache even before (or after) a patch
    _register_for_load_prompt_cache()
except ImportError:  # mlx-lm not installed: nothing to register with
    pass
