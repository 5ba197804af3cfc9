"""Drop-in paged KV cache for mlx-lm models.

    from kvmetal.integrations.mlx_lm import use_paged_cache
    with use_paged_cache(model, block_size=16, k_bits=8, v_bits=4):
        text = mlx_lm.generate(model, tokenizer, prompt)

Which layers kvmetal serves is decided from the model, not from a list of families
(``analyse_model``): the caches its own ``make_cache()`` builds (K/V caches become paged
layers, recurrent-state caches stay mlx-lm's) and what its layers call in two lazy probe
passes; what kvmetal cannot reproduce exactly is refused up front, naming the layer.

Two patches, both undone on exit: ``model.make_cache`` returns kvmetal caches (mlx-lm's
``make_prompt_cache`` prefers it, so ``generate``, ``stream_generate`` and
``generate_step`` pick them up unchanged), and the name ``scaled_dot_product_attention``
in every module the model's layers come from is wrapped so that a layer holding a kvmetal
cache attends through kvmetal (families that attend by hand, ``HAND_ATTENTION``, have
their attention class's ``__call__`` wrapped instead): ``paged_attention`` for decode
and passes of up to 8 tokens (speculative verification, short chunks),
``paged_attention_varlen`` for longer passes (a prompt, a chunk after a cached prefix, a
batch of prompts), both reading the pool in place. A call over rows a kvmetal cache's
``keys_and_values()`` returned (a layer attending over another layer's K/V: gemma3n's KV
sharing, afm7's KV reuse) runs on that cache's pool, whatever cache (or none) it passes.
Any other cache goes to mlx-lm's own function untouched. Every ``make_cache()`` of one
patch draws its sequences from one shared pool, so mlx-lm's ``BatchGenerator`` merges,
splits and extracts them as table operations; a cache's blocks go back when the cache is
dropped. Patching is atomic per model: a second ``use_paged_cache`` on a patched model
raises, from any thread.
"""
from __future__ import annotations

import dataclasses
import sys
import threading
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from .. import ops
from ..kv_format import KVFormat, KVFormatError
from . import chunked
from .model_cache import LayerSpec, PagedLayerCache, PagedModelCache, RaggedLayerCache, read_owner

# What kvmetal checks token for token in depth (engine, batching, speculative tests), and the
# families whose LM head heads.py knows: the Engine slices their hidden states before the head
# (others run the whole model and slice the logits: exact, with a prefill chunk's T x vocab
# logits computed; a draft model must be one of these). ``use_paged_cache`` does not consult this list: it
# decides per layer from the caches mlx-lm builds and the calls the model makes (see
# ``analyse_model``); tests/test_mlx_lm_all_models.py checks every architecture mlx-lm ships.
SUPPORTED_FAMILIES = ("llama", "qwen2", "qwen3", "phi3", "gemma3_text", "gpt_oss")

_patch_lock = threading.Lock()
_patched_modules: dict = {}  # module name -> [original function, number of live patches]
_patched_models: dict = {}  # id(model) -> its live PagedCacheHandle (claimed before any work)
_probes: dict = {}  # id(cache) -> _Probe, for the caches of a running analyse_model pass


class UnsupportedModel(NotImplementedError):
    """What ``use_paged_cache`` raises for a model (or one of its layers) it cannot serve exactly."""


def model_family(model) -> str:
    """The mlx-lm model module a model comes from (e.g. "llama")."""
    return type(model).__module__.rsplit(".", 1)[-1]


def _paged_sdpa_for(original):
    def scaled_dot_product_attention(queries, keys, values, cache=None, scale=None, mask=None, sinks=None, **kwargs):
        if not isinstance(cache, (PagedLayerCache, RaggedLayerCache)):
            cache = read_owner(keys) or cache  # rows a kvmetal cache's keys_and_values() gave (afm7 passes no cache)
        if isinstance(cache, (PagedLayerCache, RaggedLayerCache)):
            if kwargs:
                raise NotImplementedError(f"[use_paged_cache] attention options {sorted(kwargs)} are not supported")
            return _paged_attention(cache, queries, keys, values, scale, mask, sinks)
        if _probes:
            _record_attention(queries, keys, values, cache, mask, sinks, kwargs)
        if sinks is not None:
            kwargs["sinks"] = sinks
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, **kwargs)

    scaled_dot_product_attention.__wrapped__ = original
    scaled_dot_product_attention.__kvmetal__ = True
    return scaled_dot_product_attention


_head_permutations: dict = {}  # head_order -> (order, inverse) as int32 arrays, None for the identity


def _head_permutation(order: tuple):
    got = _head_permutations.get(order, False)
    if got is False:
        inverse = sorted(range(len(order)), key=order.__getitem__)
        got = None if list(order) == inverse == list(range(len(order))) else (
            mx.array(order, dtype=mx.int32), mx.array(inverse, dtype=mx.int32))
        _head_permutations[order] = got
    return got


def _paged_attention(cache, queries, keys, values, scale, mask, sinks):
    """kvmetal's attention for a call that passes a kvmetal cache (or rows one read): over the
    rows of the layer whose ``update_and_fetch`` returned ``keys`` (another layer's, where the
    model attends over a shared layer's rows) or whose ``keys_and_values()`` did (K/V sharing
    and reuse: that layer's pool, with the plan of the pass that wrote it), the query heads put
    into kvmetal's grouping and back where the model rearranged the kv heads
    (``LayerSpec.head_order``), in the dtype mlx's own attention gives for these arguments (a
    model that casts the fetched keys to float32 gets float32)."""
    owner = read_owner(keys)
    if owner is not None:
        owner.check_read(queries)
        cache = owner
    else:
        cache = cache.model_cache.fetch_owner(keys) or cache
    spec = cache.model_cache.specs[cache.layer]
    order = spec.head_order
    if order is None and keys.shape[1] != spec.num_kv_heads:
        raise NotImplementedError(f"[use_paged_cache] the model attends over {keys.shape[1]} kv heads, its cache "
                                  f"holds {spec.num_kv_heads}, and the cache does not know how the model maps its "
                                  f"query heads onto them (a cache loaded from a file?); make it under use_paged_cache")
    perm = None if order is None else _head_permutation(order)
    if perm is not None:
        queries = mx.take(queries, perm[0], axis=1)
        sinks = None if sinks is None else mx.take(sinks, perm[0], axis=0)
    out = cache.attention(queries, keys, values, scale=scale, mask=mask, sinks=sinks)
    if perm is not None:
        out = mx.take(out, perm[1], axis=1)
    if keys.dtype != out.dtype or values.dtype != out.dtype:
        out = out.astype(mx.result_type(out, keys, values))
    return out


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


def _attention_modules(model) -> list:
    """The modules whose ``scaled_dot_product_attention`` the model's layers call: the
    module of every class in the model (a family may borrow another's attention class)."""
    names = {type(model).__module__}
    names.update(type(m).__module__ for _, m in model.named_modules())
    return sorted(n for n in names if n in sys.modules
                  and callable(getattr(sys.modules[n], "scaled_dot_product_attention", None)))


# Families that attend by hand over the keys their cache returns, mapped onto kvmetal's
# attention variant: (module, class) -> a replacement for the class's __call__, taking the
# original. It runs the family's own code for any other cache (mlx-lm's, during the probe
# too, where it marks the probed layer as mapped). The sweep re-checks each against mlx-lm.
def _gemma2_attention(original):
    """gemma2: scores softcapped (c * tanh(s / c)) before the mask and softmax."""
    def __call__(self, x, mask=None, cache=None):
        if not isinstance(cache, (PagedLayerCache, RaggedLayerCache)):
            probe = _probes.get(id(cache)) if _probes else None
            if probe is not None:
                probe.mapped = f"softcap {self.attn_logit_softcapping}"
            return original(self, x, mask=mask, cache=cache)
        b, n, _ = x.shape
        queries, keys, values = chunked.project_heads(self, x)
        queries = self.rope(queries, offset=cache.offset)
        keys = self.rope(keys, offset=cache.offset)
        keys, values = cache.update_and_fetch(keys, values)
        out = cache.attention(queries, keys, values, scale=self.scale, mask=mask,
                              softcap=float(self.attn_logit_softcapping))
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))

    return __call__


def _gpt_bigcode_model(original):
    """gpt_bigcode: learned absolute positions from ``np.arange(cache[0].offset, ... + L)``,
    which takes one int; over kvmetal caches whose offset is an array (a position per
    sequence, or per row of an Engine pass) each row gets its own positions."""
    def __call__(self, inputs, cache=None):
        first = cache[0] if cache else None
        if not isinstance(first, (PagedLayerCache, RaggedLayerCache)) or not isinstance(first.offset, mx.array):
            return original(self, inputs, cache=cache)
        from mlx_lm.models import gpt_bigcode

        _, n = inputs.shape
        positions = first.offset.reshape(-1, 1) + mx.arange(n)[None]  # [B, L]
        hidden = self.wte(inputs) + self.wpe(positions)
        mask = gpt_bigcode.create_attention_mask(hidden, first)
        for layer, c in zip(self.h, cache):
            hidden = layer(hidden, mask, cache=c)
        return self.ln_f(hidden)

    return __call__


def _plamo2_attention(original):
    """plamo2: plain softmax attention, but through ``mx.fast.scaled_dot_product_attention``
    called directly (no cache argument, no module-level name to wrap)."""
    def __call__(self, hidden_states, mask=None, cache=None):
        if not isinstance(cache, (PagedLayerCache, RaggedLayerCache)):
            probe = _probes.get(id(cache)) if _probes else None
            if probe is not None:
                probe.mapped = "softmax attention called as mx.fast.scaled_dot_product_attention"
            return original(self, hidden_states, mask=mask, cache=cache)
        b, n, _ = hidden_states.shape
        q, k, v = mx.split(self.qkv_proj(hidden_states), [self.q_proj_dim, self.q_proj_dim + self.k_proj_dim], axis=-1)
        q = q.reshape(b, n, self.q_num_heads, self.qk_dim).transpose(0, 2, 1, 3)
        k = k.reshape(b, n, self.k_num_heads, self.qk_dim).transpose(0, 2, 1, 3)
        v = v.reshape(b, n, self.v_num_heads, self.v_dim).transpose(0, 2, 1, 3)
        q = mx.fast.rms_norm(q, weight=None, eps=1e-6) * self.q_weight[:, None]
        k = mx.fast.rms_norm(k, weight=None, eps=1e-6) * self.k_weight[:, None]
        q = self.rope(q, offset=cache.offset)
        k = self.rope(k, offset=cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = cache.attention(q, k, v, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, self.q_num_heads * self.v_dim))

    return __call__


HAND_ATTENTION = {("mlx_lm.models.gemma2", "Attention"): _gemma2_attention,
                  ("mlx_lm.models.plamo2", "Attention"): _plamo2_attention,
                  # absolute positions from an int offset (per-row positions in an Engine pass)
                  ("mlx_lm.models.gpt_bigcode", "GPTBigCodeModel"): _gpt_bigcode_model,
                  # llama4's chunk mask becomes the chunk rule's marker; per-row positions (chunked.py)
                  ("mlx_lm.models.llama4", "LlamaModel"): chunked.llama4_model,
                  ("mlx_lm.models.llama4", "Attention"): chunked.llama4_attention}
_patched_classes: dict = {}  # class -> [its own __call__ or None (inherited), number of live patches]


def _hand_attention_classes(model) -> list:
    found = {type(m) for _, m in model.named_modules()
             if (type(m).__module__, type(m).__name__) in HAND_ATTENTION}
    return sorted(found, key=lambda c: (c.__module__, c.__name__))


def _swap_call(cls, make, patched: dict) -> None:
    """Wrap ``cls.__call__`` with ``make`` once, however many live patches ask for it:
    ``patched`` counts them and keeps the class's own ``__call__`` (None: inherited)."""
    with _patch_lock:
        if cls in patched:
            patched[cls][1] += 1
            return
        own = vars(cls).get("__call__")
        cls.__call__ = make(cls.__call__)
        patched[cls] = [own, 1]


def _restore_call(cls, patched: dict) -> None:
    """Undo one :func:`_swap_call`; the last one puts the class's own ``__call__`` back."""
    with _patch_lock:
        entry = patched[cls]
        entry[1] -= 1
        if entry[1] == 0:
            if entry[0] is None:
                del cls.__call__
            else:
                cls.__call__ = entry[0]
            del patched[cls]


class SequenceState:
    """Stands in, during one of the Engine's ragged passes, for a native (recurrent-state)
    cache entry: the module that takes it runs once per sequence, on that sequence's rows
    and with that sequence's own mlx-lm cache (``SequenceStates``). A pass packs every
    sequence's tokens on one axis; a conv or scan over that axis would mix sequences."""

    def __init__(self, index: int, segments: list):
        self.index = index  # which native entry of a sequence's caches
        self.segments = segments  # per sequence: (first row, rows, its native caches)

    def make_mask(self, n: int):
        return None  # each sequence runs alone and unpadded (mlx-lm's create_ssm_mask asks)

    def __bool__(self) -> bool:
        return True


def _sequence_rows(value, start: int, n: int, rows: int):
    """A sequence's rows of a packed ``[rows, 1, ...]`` array as ``[1, n, ...]``; the pass's
    per-row positions (an integer ``[rows]`` array, the caches' ``offset``, which a model may
    hand its recurrent layers: bailing_moe_linear's rope) as the sequence's first position,
    a one-element vector (its rows are consecutive positions); anything else as is."""
    if isinstance(value, mx.array) and value.ndim >= 2 and value.shape[0] == rows and value.shape[1] == 1:
        return value[start:start + n].swapaxes(0, 1)
    if (isinstance(value, mx.array) and value.ndim == 1 and value.shape[0] == rows
            and mx.issubdtype(value.dtype, mx.integer)):
        return value[start:start + 1]
    return value


def _packed_rows(outs: list):
    first = outs[0]
    if isinstance(first, mx.array):
        return mx.concatenate([o.swapaxes(0, 1) for o in outs], axis=0)
    if isinstance(first, tuple):
        return tuple(_packed_rows([o[i] for o in outs]) for i in range(len(first)))
    if first is None:
        return None
    raise UnsupportedModel(f"[use_paged_cache] a recurrent-state module returned a {type(first).__name__}; "
                           f"kvmetal's Engine can only pack arrays (or tuples of them) back into a pass")


def _per_sequence(original):
    def __call__(self, *args, **kwargs):
        proxy = next((a for a in (*args, *kwargs.values()) if isinstance(a, SequenceState)), None)
        if proxy is None:
            return original(self, *args, **kwargs)
        rows = sum(n for _, n, _ in proxy.segments)

        def own(value, start, n, states):
            if isinstance(value, SequenceState):
                return states[value.index]
            return _sequence_rows(value, start, n, rows)

        outs = [original(self, *(own(a, *seg) for a in args), **{k: own(v, *seg) for k, v in kwargs.items()})
                for seg in proxy.segments]
        return _packed_rows(outs)

    __call__.__wrapped__ = original
    return __call__


_sequence_classes: dict = {}  # class -> [its own __call__ or None (inherited), number of live patches]


def _state_modules(model, layout) -> list:
    """The model's classes whose calls take its native caches: per native entry, the
    innermost module (of mlx-lm's) a lazy two-token pass hands that cache to. Such a
    class must never take a K/V cache (it would then see a whole pass's rows at once)."""
    family = model_family(model)
    originals = _original_caches(model)
    natives = layout.natives(originals)
    native_ids = {id(c): i for i, c in enumerate(natives)}
    kv_ids = {id(c) for c in _kv_caches(originals)}
    found, kv_takers, depth = {}, set(), [0]

    def recorder(original):
        def __call__(self, *args, **kwargs):
            depth[0] += 1
            try:
                for a in (*args, *kwargs.values()):
                    i = native_ids.get(id(a))
                    if i is not None and natives[i] is a and depth[0] >= found.get(i, (0, None))[0]:
                        found[i] = (depth[0], type(self))
                    if id(a) in kv_ids:
                        kv_takers.add(type(self))
                return original(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return __call__

    classes = sorted({type(m) for _, m in model.named_modules() if type(m).__module__.startswith("mlx_lm.")},
                     key=lambda c: (c.__module__, c.__qualname__))
    recording: dict = {}  # the recorder wraps whatever __call__ is there now (a live patch too)
    with _analyse_lock:
        for cls in classes:
            _swap_call(cls, recorder, recording)
        try:
            model(mx.array([[0, 1]]), cache=originals)
        except Exception as exc:
            raise UnsupportedModel(f"[use_paged_cache] {family}: a probe pass with mlx-lm's own caches failed: "
                                   f"{type(exc).__name__}: {exc}") from exc
        finally:
            for cls in reversed(classes):
                _restore_call(cls, recording)
    out = []
    for i, name in enumerate(layout.native):
        if i not in found:
            _refuse(family, name, "no module of the model takes its recurrent-state cache as an argument, so "
                                  "kvmetal's Engine cannot run it once per sequence")
        cls = found[i][1]
        if cls in kv_takers:
            _refuse(family, name, f"{cls.__name__} takes both this recurrent-state cache and a K/V cache, so "
                                  f"kvmetal's Engine cannot run its recurrent part once per sequence")
        out.append(cls)
    return sorted(set(out), key=lambda c: (c.__module__, c.__qualname__))


def _kv_caches(caches: list) -> list:
    from mlx_lm.models.cache import ArraysCache, CacheList

    out = []
    for c in caches:
        if isinstance(c, CacheList):
            out += _kv_caches(list(c.caches))
        elif not isinstance(c, ArraysCache):
            out.append(c)
    return out


class SequenceStates:
    """The Engine's side of a model with recurrent-state layers (``ArraysCache``,
    ``MambaCache``): every sequence owns mlx-lm's own caches for those layers (``new()``,
    from the model's ``make_cache``), and in a pass the module that takes such a cache runs
    once per sequence (its classes' ``__call__`` is wrapped while this lives; ``close()``
    restores them). K/V layers stay paged and batched."""

    def __init__(self, handle):
        self.handle = handle
        self.layout = handle.layout
        self.classes = _state_modules(handle.model, self.layout)
        for cls in self.classes:
            _swap_call(cls, _per_sequence, _sequence_classes)
        self.active = True

    @property
    def recurrent(self) -> bool:
        """Whether any entry keeps recurrent state (a CacheList of K/V caches alone keeps none)."""
        return bool(self.layout.native)

    def new(self) -> list:
        """Fresh native caches for one sequence (empty state: it starts at token 0)."""
        return self.layout.natives(_original_caches(self.handle.model))

    def model_cache(self, paged: list, segments: list) -> list:
        """The cache list one pass gives the model: ``paged`` (the pass's layer caches) and,
        for the native entries, stand-ins over ``segments`` [(first row, rows, native caches)]."""
        return self.layout.assemble(paged, [SequenceState(i, segments) for i in range(len(self.layout.native))])

    def close(self) -> None:
        if self.active:
            self.active = False
            for cls in self.classes:
                _restore_call(cls, _sequence_classes)


def _original_caches(model) -> list:
    """The caches mlx-lm itself would build for ``model`` (its own ``make_cache``, one set
    on the instance included, never a kvmetal patch's)."""
    own = vars(model).get("make_cache")
    if isinstance(getattr(own, "__self__", None), PagedCacheHandle):
        own = own.__self__._instance_make_cache
    if own is not None:
        return own()
    make = getattr(type(model), "make_cache", None)
    if make is not None:
        return make(model)
    from mlx_lm.models.cache import KVCache

    return [KVCache() for _ in model.layers]


@dataclass
class ModelLayout:
    """Which of a model's caches kvmetal keeps, from ``analyse_model``.

    ``template`` mirrors what the model's ``make_cache()`` returns: per entry an int (the
    index of a paged layer in ``specs``), None (mlx-lm's own cache stays: recurrent state,
    or a cache the model never writes) or a tuple of those (a ``CacheList``)."""

    template: list
    specs: list
    names: list  # per paged layer: "layer 3", or "layer 3.1" inside a CacheList
    native: list  # names of the entries that keep mlx-lm's own cache
    chunked: list = field(default_factory=list)  # names of the paged layers with chunked attention (llama4;
                                                 # their specs carry the chunk)

    @property
    def plain(self) -> bool:
        """Every entry is a paged layer, in order (no recurrent state, no CacheList)."""
        return self.template == list(range(len(self.specs)))

    def fill(self, paged: list, originals: list | None) -> list:
        """A prompt cache: the paged layer caches where the template has them, mlx-lm's
        own (from ``originals``, a fresh ``make_cache()``) elsewhere."""
        if self.plain:
            return paged
        return self.assemble(paged, self.natives(originals))

    def natives(self, originals: list) -> list:
        """The entries of ``originals`` (a ``make_cache()``) that keep mlx-lm's cache, in order."""
        out = []

        def walk(t, original):
            if t is None:
                out.append(original)
            elif isinstance(t, tuple):
                for s, o in zip(t, original.caches):
                    walk(s, o)

        for t, o in zip(self.template, originals):
            walk(t, o)
        return out

    def assemble(self, paged: list, natives: list) -> list:
        """The model's cache list from its paged layer caches and its native entries (in
        the order ``natives`` gives them), CacheLists rebuilt where the template has them."""
        from mlx_lm.models.cache import CacheList

        rest = iter(natives)

        def one(t):
            if t is None:
                return next(rest)
            if isinstance(t, int):
                return paged[t]
            return CacheList(*(one(s) for s in t))

        return [one(t) for t in self.template]


@dataclass
class _Probe:
    """What one K/V cache saw during ``analyse_model``'s probe passes."""

    name: str
    cache: object
    window: int | None
    fetches: list = field(default_factory=list)  # per update_and_fetch: (keys, values) it returned
    ticks: list = field(default_factory=list)  # per update_and_fetch: when (_tick)
    calls: list = field(default_factory=list)  # per attention call with this cache: (q shape, keys, values,
                                               # options, when)
    passes: list = field(default_factory=list)  # fetches after each probe pass
    mapped: str | None = None  # a HAND_ATTENTION mapping served this layer's attention (what it maps)
    sources: list = field(default_factory=list)  # per call: (the probe whose rows it reads, head order or None)
    attended: set = field(default_factory=set)  # indices of this cache's fetches some call reads
    orders: set = field(default_factory=set)  # the head orders (or None) of the calls that read them
    shared: bool = False  # another cache's calls read this one's rows
    problem: Exception | None = None  # why one of its calls could not be resolved (raised after the basic checks)
    news: list = field(default_factory=list)  # per update_and_fetch: the new tokens written
    reads: list = field(default_factory=list)  # per keys_and_values() from outside its update_and_fetch (the
                                               # model reading its rows): (fetch index, stale, rows it returned)
    read_modes: set = field(default_factory=set)  # "cache" / "none": whether calls over its read rows pass a cache
    strays: list = field(default_factory=list)
    unattended_reads: int = 0  # reads whose rows no attention call takes as its keys


@dataclass
class _Call:
    """One attention call the probe saw (``cached``: it passed a cache; one passing none
    is recorded only where its keys are rows a probed cache's keys_and_values() returned)."""

    q_shape: tuple
    keys: mx.array
    values: mx.array
    options: list
    when: int
    mask: object
    cached: bool = True


class _ProbeMask(str):
    """A "causal" mask one probed cache's make_mask returned: a str of its own, so that which
    make_mask call made a mask (which window it means) reads off its identity."""


_analyse_lock = threading.Lock()
_stray_calls: list = []  # attention calls during a probe whose cache is not a probed one: (keys, values)
_probe_reads: dict = {}  # id(keys) -> (probe, fetch index, (keys, values), stale): what keys_and_values() gave
_clock = [0]  # orders the probe's fetches and attention calls


def _tick() -> int:
    _clock[0] += 1
    return _clock[0]


def _record_attention(queries, keys, values, cache, mask, sinks, kwargs) -> None:
    probe = _probes.get(id(cache))
    call = _Call(tuple(queries.shape), keys, values, sorted(kwargs), _tick(), mask)
    if probe is not None and probe.cache is cache:
        probe.calls.append(call)
        return
    read = _probe_reads.get(id(keys))
    if read is not None and read[2][0] is keys:  # over rows a cache's keys_and_values() gave, passing no cache
        call.cached = False
        read[0].calls.append(call)
    else:
        _stray_calls.append((keys, values))


def _refuse(family: str, name: str, reason: str):
    raise UnsupportedModel(f"[use_paged_cache] {family} {name}: {reason}")


def _classify(cache, name: str, family: str, probes: list, native: list):
    """Template entry of one cache mlx-lm builds (refuses a type kvmetal cannot stand in for)."""
    from mlx_lm.models import cache as mc

    kind = type(cache)
    # A ChunkedKVCache layer (llama4: a token sees only its own chunk) is paged in a pool of
    # its own (analyse_model sets its spec's chunk): attention runs the chunk rule on the
    # kernels and blocks before a sequence's chunk are released (chunked.py, model_cache.py).
    if kind is mc.KVCache or kind is mc.RotatingKVCache or kind is mc.ChunkedKVCache:
        window = None
        if kind is mc.RotatingKVCache:
            if cache.keep:
                _refuse(family, name, f"RotatingKVCache(max_size={cache.max_size}, keep={cache.keep}) keeps "
                                      f"{cache.keep} sink tokens beside a rotating window, which kvmetal does "
                                      f"not model")
            window = int(cache.max_size)
        probes.append(_Probe(name, cache, window))
        return len(probes) - 1  # provisional: renumbered once the probe knows which layers attend
    if isinstance(cache, mc.ArraysCache):  # recurrent state (MambaCache too): mlx-lm keeps it
        native.append(name)
        return None
    if kind is mc.CacheList:
        return tuple(_classify(c, f"{name}.{j}", family, probes, native) for j, c in enumerate(cache.caches))
    if not callable(getattr(cache, "update_and_fetch", None)):
        _refuse(family, name, f"its cache is a {kind.__name__}, which has no update_and_fetch: the model keeps its "
                              f"own state in it rather than writing K/V rows and attending over the rows it "
                              f"returns (kvmetal stands in for KVCache, RotatingKVCache and ChunkedKVCache)")
    _refuse(family, name, f"its cache is a {kind.__name__}, a cache type kvmetal does not know (it stands in for "
                          f"KVCache and RotatingKVCache, keeps ArraysCache/MambaCache, and looks inside CacheList)")


def _stand_in(rows: mx.array) -> mx.array:
    """Random rows of the shape and dtype of ``rows`` (lazy; distinct heads, no NaN)."""
    return mx.random.normal(rows.shape, key=mx.random.key(_tick())).astype(rows.dtype)


def _instrument(probe: _Probe) -> None:
    fetch = probe.cache.update_and_fetch
    read = getattr(probe.cache, "keys_and_values", None)
    make = getattr(probe.cache, "make_mask", None)
    inside = [False]

    def update_and_fetch(keys, values):
        # The model gets random stand-ins for the rows its cache returns: what it does to them
        # before attending (a lossless cast, a rearrangement of heads) can then be read off the
        # values of its attention call's arguments, whatever the weights.
        inside[0] = True
        try:
            rows = fetch(keys, values)
        finally:
            inside[0] = False
        out = tuple(_stand_in(x) for x in rows)
        probe.fetches.append(out)
        probe.ticks.append(_tick())
        probe.news.append(int(keys.shape[2]))
        return out

    def keys_and_values():  # mlx-lm's caches call it in update_and_fetch: only the model's own reads count
        if inside[0]:
            return read()
        # Every row written so far is what the latest write returned: the model gets its
        # stand-ins again, as arrays of their own, so that its calls over them can be told apart.
        i = len(probe.fetches) - 1
        stale = i < (probe.passes[-1] if probe.passes else 0)  # written in an earlier pass, not this one
        if i < 0:
            probe.reads.append((i, stale, None))
            return read()
        rows = tuple(mx.array(x) for x in probe.fetches[i])
        probe.reads.append((i, stale, rows))
        _probe_reads[id(rows[0])] = (probe, i, rows, stale)
        return rows

    def make_mask(*args, **kwargs):
        mask = make(*args, **kwargs)
        return _ProbeMask(mask) if isinstance(mask, str) else mask

    probe.cache.update_and_fetch = update_and_fetch  # instance attributes, removed after the probe
    if callable(read):
        probe.cache.keys_and_values = keys_and_values
    if callable(make):
        probe.cache.make_mask = make_mask


def _probe_passes(model, caches: list, probes: list, family: str) -> None:
    """Two passes through the model (two prompt tokens, then one decode token) with
    mlx-lm's own caches, recording every write and every attention call in order; each
    write hands the model random stand-ins for its rows. Lazy: only the graph is built
    (``_heads_read`` later evaluates the arguments of a call that are not a fetch itself)."""
    modules, classes = _attention_modules(model), _hand_attention_classes(model)
    for name in modules:
        _patch_module(name)
    for cls in classes:
        _swap_call(cls, HAND_ATTENTION[(cls.__module__, cls.__name__)], _patched_classes)
    with _analyse_lock:
        for p in probes:
            _instrument(p)
            _probes[id(p.cache)] = p
        _stray_calls.clear()
        _probe_reads.clear()
        try:
            for tokens in ([[0, 1]], [[2]]):
                try:
                    model(mx.array(tokens), cache=caches)
                except Exception as exc:
                    raise UnsupportedModel(f"[use_paged_cache] {family}: a probe pass of {len(tokens[0])} token(s) "
                                           f"through the model with mlx-lm's own caches failed: "
                                           f"{type(exc).__name__}: {exc}") from exc
                for p in probes:
                    p.passes.append(len(p.fetches))
        finally:
            strays = list(_stray_calls)
            _stray_calls.clear()
            _probe_reads.clear()
            for p in probes:
                _probes.pop(id(p.cache), None)
                vars(p.cache).pop("update_and_fetch", None)
                vars(p.cache).pop("keys_and_values", None)
                vars(p.cache).pop("make_mask", None)
            for name in modules:
                _unpatch_module(name)
            for cls in classes:
                _restore_call(cls, _patched_classes)
    for p in probes:
        p.strays = [s for s in strays if any(s[0] is k or s[1] is v for k, v in p.fetches)]


def _heads_read(rows: mx.array, fetched: mx.array):
    """Which head of ``fetched`` [B, Hkv, T, D] each head of ``rows`` is, where ``rows`` is
    ``fetched`` with its heads rearranged (tiled, repeated, permuted) and cast losslessly (to
    its own dtype, or float16/bfloat16 to float32); None where it is anything else."""
    lossless = rows.dtype == fetched.dtype or (rows.dtype == mx.float32 and fetched.dtype in (mx.float16, mx.bfloat16))
    if not lossless or rows.ndim != 4 or rows.shape[0] != fetched.shape[0] or rows.shape[2:] != fetched.shape[2:]:
        return None
    a = np.array(rows.astype(mx.float32))
    b = np.array(fetched.astype(rows.dtype).astype(mx.float32))
    same = (a[:, :, None] == b[:, None]).all(axis=(0, 3, 4))  # [heads of rows, Hkv]
    if not (same.sum(axis=1) == 1).all():
        return None
    return [int(j) for j in same.argmax(axis=1)]


def _call_source(probe: _Probe, call: _Call, owners: dict, reads: dict, family: str):
    """(the probe whose fetched rows an attention call of ``probe`` reads, kvmetal's head order
    for it or None). The rows are a fetch itself (of this cache, or of another: a shared layer),
    rows a cache's ``keys_and_values()`` returned (K/V sharing or reuse: ``_check_read``), or
    this cache's latest fetch with its heads rearranged and losslessly cast (read off the
    stand-in values); either must be the latest write of that cache when the call is made."""
    name = probe.name
    q_shape, keys, values, when = call.q_shape, call.keys, call.values, call.when
    hit, read = owners.get(id(keys)), reads.get(id(keys))
    if read is not None:
        source, i, rows, _ = read
        if values is not rows[1]:
            _refuse(family, name, f"it attends over the keys keys_and_values() read from {source.name}'s cache "
                                  f"with other values")
        _check_read(call, read, reads, family)
        source.read_modes.add("cache" if call.cached else "none")
        order = None
    elif hit is not None:
        source, i = hit
        if values is not source.fetches[i][1]:
            _refuse(family, name, f"it attends over the keys of {source.name}'s cache with other values")
        order = None
        if source is not probe:
            source.shared = True
    else:
        source = probe
        i = sum(1 for t in probe.ticks if t < when) - 1
        if i < 0:
            _refuse(family, name, "it attends, before its cache's first write, over keys no cache returned")
        fk, fv = probe.fetches[i]
        kmap, vmap = _heads_read(keys, fk), _heads_read(values, fv)
        if kmap is None or kmap != vmap:
            _refuse(family, name, "the keys/values it attends over are not the ones its cache returned (changed "
                                  "after the fetch beyond a lossless cast or a rearrangement of heads), so kvmetal's "
                                  "paged rows would differ from them")
        heads, hkv = q_shape[1], int(fk.shape[1])
        if heads % len(kmap) or heads % hkv:
            _refuse(family, name, f"queries {q_shape} do not match keys {tuple(keys.shape)} (query heads a multiple "
                                  f"of kv heads)")
        kv_of = [kmap[h // (heads // len(kmap))] for h in range(heads)]  # query head -> fetched kv head
        if any(kv_of.count(j) != heads // hkv for j in range(hkv)):
            _refuse(family, name, f"its query heads read its {hkv} kv heads unevenly ({kv_of}); kvmetal's "
                                  f"kernels give each kv head {heads // hkv} query heads")
        order = tuple(sorted(range(heads), key=kv_of.__getitem__))  # stable: kvmetal's head p is the model's order[p]
    later = [t for t in source.ticks[i + 1:] if t < when]
    if later:
        _refuse(family, name, f"it attends over rows {source.name}'s cache returned before a later write to it")
    source.attended.add(i)
    source.orders.add(order)
    return source, order


def _check_read(call: _Call, read: tuple, reads: dict, family: str) -> None:
    """An attention call over rows ``keys_and_values()`` returned runs, under kvmetal, on the
    reading cache's pool with the plan of its write in this pass, under the mask rule of its
    own attention call over that write: the call must have that pass's new tokens as queries
    and the very mask the cache's own call had (gemma3n: a shared sliding layer reads a
    sliding cache with the sliding mask, a full one a full cache with the full mask)."""
    source, i, _, stale = read
    where = "a layer attends over its rows read with keys_and_values()"
    if stale:
        _refuse(family, source.name, f"{where} before its write of that pass (rows of an earlier pass), which "
                                     f"kvmetal's attention over its pool does not reproduce")
    if call.q_shape[2] != source.news[i]:
        _refuse(family, source.name, f"{where} with {call.q_shape[2]} queries after a write of {source.news[i]} "
                                     f"token(s); kvmetal attends over a cache's rows with the queries of the pass "
                                     f"that wrote them (same new tokens, same positions)")
    end = source.ticks[i + 1] if i + 1 < len(source.ticks) else float("inf")
    own = [c for c in source.calls if id(c.keys) not in reads and source.ticks[i] < c.when < end]
    if not own:
        _refuse(family, source.name, f"{where}, but it has no attention call of its own over that write, so "
                                     f"kvmetal cannot tell which mask rule its rows take")
    if any(c.mask is not call.mask for c in own):
        _refuse(family, source.name, f"{where} with another mask than its own attention call's (a different "
                                     f"window or mask rule), which kvmetal's attention over its pool would not "
                                     f"apply")


def _resolve_calls(probes: list, family: str) -> None:
    """Every recorded attention call's source rows and head order (``_call_source``); a call
    that has none leaves its layer's refusal for ``_layer_spec``."""
    owners = {id(k): (p, i) for p in probes for i, (k, _) in enumerate(p.fetches)}
    reads = {id(rows[0]): (p, i, rows, stale) for p in probes for i, stale, rows in p.reads if rows is not None}
    attended = {id(c.keys) for p in probes for c in p.calls}
    for p in probes:
        p.unattended_reads = sum(1 for _, _, rows in p.reads if rows is None or id(rows[0]) not in attended)
        try:
            p.sources = [_call_source(p, call, owners, reads, family) for call in p.calls]
        except UnsupportedModel as exc:
            p.problem = exc


def _layer_spec(probe: _Probe, family: str):
    """The LayerSpec of a probed K/V cache, None for one the model never writes, or a refusal."""
    name, fetches, calls = probe.name, probe.fetches, probe.calls
    if not fetches:
        return None
    if probe.passes != [1, 2]:
        _refuse(family, name, f"its cache is written {probe.passes[0]} and {probe.passes[1] - probe.passes[0]} times "
                              f"in two passes; kvmetal expects one update_and_fetch per pass")
    keys, values = fetches[0]
    head_dim, v_head_dim = int(keys.shape[-1]), int(values.shape[-1])
    if head_dim != v_head_dim:
        _refuse(family, name, f"K head_dim {head_dim} and V head_dim {v_head_dim} differ (MLA-style attention); "
                              f"kvmetal's pools and kernels hold one head_dim for K and V")
    if any(i < 0 for i, _, _ in probe.reads):
        _refuse(family, name, "the model reads its cache's rows with keys_and_values() before its first write")
    if probe.unattended_reads:
        _refuse(family, name, "the model reads its cache's rows with keys_and_values() and uses them other than as "
                              "the keys and values of an attention call, which kvmetal's attention over its pool "
                              "does not stand in for")
    if probe.problem is not None:
        raise probe.problem
    mapped = not calls and probe.mapped and not probe.strays  # kvmetal's variant stands in (HAND_ATTENTION)
    if not mapped and len(probe.attended) < len(fetches):
        if probe.strays:
            _refuse(family, name, "its keys reach scaled_dot_product_attention without its cache, so kvmetal "
                                  "cannot attend over its paged rows")
        _refuse(family, name, "it attends by hand over the keys its cache returns (not through "
                              "scaled_dot_product_attention), which kvmetal's attention cannot stand in for")
    for call, (source, order) in zip(calls, probe.sources):
        q_shape, options = call.q_shape, call.options
        if options:
            _refuse(family, name, f"attention option(s) {', '.join(options)}, which kvmetal's attention does not model")
        source_keys = source.fetches[0][0]
        if q_shape[-1] != int(source_keys.shape[-1]) or q_shape[1] % int(source_keys.shape[1]):
            _refuse(family, name, f"queries {q_shape} do not match keys {tuple(source_keys.shape)} (head_dim, or "
                                  f"query heads a multiple of kv heads)")
    known = probe.orders - {None}
    if len(known) > 1 or (known and _head_permutation(next(iter(known))) is not None and None in probe.orders):
        _refuse(family, name, "the attention calls over its rows read its kv heads in different arrangements")
    if probe.strays:
        _refuse(family, name, "its keys are also used by another attention call that does not pass its cache")
    if head_dim not in ops.SUPPORTED_HEAD_DIMS:
        _refuse(family, name, f"head_dim {head_dim} is not one kvmetal's kernels serve "
                              f"({', '.join(map(str, ops.SUPPORTED_HEAD_DIMS))})")
    read = "none" if "none" in probe.read_modes else "cache" if probe.read_modes else None
    return LayerSpec(probe.window, int(keys.shape[1]), head_dim, keys.dtype,
                     head_order=next(iter(known)) if known else None, shared=probe.shared, read=read)


def analyse_model(model) -> ModelLayout:
    """Decide per layer what kvmetal can serve, from what mlx-lm builds and what the model calls.

    The caches come from the model's own ``make_cache()``: a ``KVCache`` or
    ``RotatingKVCache`` layer (inside a ``CacheList`` too) becomes a paged layer, an
    ``ArraysCache``/``MambaCache`` (recurrent state) keeps mlx-lm's cache. Two probe
    passes (lazy: a graph; only a call's arguments that are not a fetch itself are
    evaluated) check that each paged layer writes its cache once per pass and that every
    write is attended through ``scaled_dot_product_attention`` with a paged cache and no
    option kvmetal does not model, over the rows a cache returned at its latest write:
    those very arrays (its own, or a shared layer's), or its own with the heads
    rearranged (``LayerSpec.head_order``) and cast losslessly; with one head_dim for K and
    V that kvmetal's kernels serve. Rows the model reads with a cache's ``keys_and_values()``
    (K/V sharing, gemma3n; K/V reuse, afm7) may be attended too, passing that cache or none,
    where kvmetal's attention over that cache's pool gives what mlx-lm's does: read after the
    cache's write in the same pass, attended with that pass's new tokens as queries and the
    very mask the cache's own attention call had (``_check_read``; ``LayerSpec.read``).
    Anything else raises :class:`UnsupportedModel` naming the layer and the reason."""
    family = model_family(model)
    caches = _original_caches(model)
    probes, native = [], []
    template = [_classify(c, f"layer {i}", family, probes, native) for i, c in enumerate(caches)]
    if not probes:
        raise UnsupportedModel(f"[use_paged_cache] {family}: no layer keeps a K/V cache (its {len(caches)} caches "
                               f"hold recurrent state: {', '.join(sorted({type(c).__name__ for c in caches}))}); "
                               f"there is nothing to page, run it without use_paged_cache")
    _probe_passes(model, caches, probes, family)
    _resolve_calls(probes, family)
    specs, names, index = [], [], {}
    for i, p in enumerate(probes):
        spec = _layer_spec(p, family)
        if spec is None:
            native.append(p.name)
            continue
        index[i] = len(specs)
        specs.append(spec)
        names.append(p.name)
    if not specs:
        raise UnsupportedModel(f"[use_paged_cache] {family}: the model never writes its K/V caches in a forward "
                               f"pass; there is nothing to page")

    def renumber(t):
        if t is None:
            return None
        if isinstance(t, int):
            return index.get(t)
        return tuple(renumber(s) for s in t)

    from mlx_lm.models.cache import ChunkedKVCache

    chunk_layers = []
    for i, p in enumerate(probes):  # a chunked layer's spec carries its chunk: its own pool, which releases
        if i in index and isinstance(p.cache, ChunkedKVCache):  # the blocks before a sequence's chunk
            specs[index[i]] = dataclasses.replace(specs[index[i]], chunk=int(p.cache.chunk_size))
            chunk_layers.append(p.name)
    return ModelLayout([renumber(t) for t in template], specs, names, native, chunk_layers)


def layer_specs(model) -> list:
    """Per paged layer: the attention window and the K/V row shape and dtype (see
    ``analyse_model``; windows come from the ``RotatingKVCache(max_size=W)`` mlx-lm builds)."""
    return analyse_model(model).specs


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
            self.layout = analyse_model(model)
            self.specs = self.layout.specs
            self._modules = _attention_modules(model)
            self._classes = _hand_attention_classes(model)
            self._had_instance_make_cache = "make_cache" in vars(model)
            self._instance_make_cache = vars(model).get("make_cache")
            for name in self._modules:
                _patch_module(name)
            for cls in self._classes:
                _swap_call(cls, HAND_ATTENTION[(cls.__module__, cls.__name__)], _patched_classes)
        except BaseException:
            with _patch_lock:
                del _patched_models[id(model)]
            raise
        model.make_cache = self.make_cache
        self._shared = None
        self._states = None
        self.active = True

    def new_model_cache(self, **overrides) -> PagedModelCache:
        """An empty paged cache for this model (the engine adds its own sequences);
        ``overrides`` replace PagedModelCache options (the Engine's ``cascade``). It holds
        the paged layers only: a model whose layout is not plain (recurrent-state layers,
        CacheLists) also needs ``sequence_states()`` to run the Engine's ragged passes. A model
        with chunked attention needs a block size that divides its chunk: the ragged passes
        apply the chunk rule on the kernels only (tables shifted to a chunk start). A model
        whose layers attend over rows read with ``keys_and_values()`` without passing a cache
        (afm7) is refused here: such a layer takes its positions from the rows, which a ragged
        pass does not hold (``LayerSpec.read``)."""
        block_size = overrides.get("block_size", self.options["block_size"])
        for name, spec in zip(self.layout.names, self.specs):
            if spec.read == "none":
                raise UnsupportedModel(
                    f"[use_paged_cache] {model_family(self.model)} {name}: a layer attends over its rows read with "
                    f"keys_and_values() through an attention call that passes no cache, so that layer does not "
                    f"take its positions from a cache (afm7's KV-reuse layers count the rows read); a ragged pass "
                    f"of kvmetal's Engine holds one row per token, so the Engine cannot run it "
                    f"(use_paged_cache with mlx-lm's generate serves it)")
            if spec.chunk is not None and spec.chunk % block_size:
                raise UnsupportedModel(f"[use_paged_cache] {model_family(self.model)} {name}: chunked attention "
                                       f"(chunk {spec.chunk}) needs a block_size that divides the chunk for "
                                       f"kvmetal's Engine, got block_size={block_size}")
        return PagedModelCache(self.specs, **{**self.options, **overrides})

    def sequence_states(self) -> SequenceStates:
        """Per-sequence native caches for the Engine (see ``SequenceStates``); closed by ``undo()``."""
        if self._states is None or not self._states.active:
            self._states = SequenceStates(self)
        return self._states

    @property
    def shared_cache(self) -> PagedModelCache:
        """The pool every ``make_cache()`` of this patch draws its sequences from."""
        if self._shared is None:
            self._shared = PagedModelCache(self.specs, **self.options)
        return self._shared

    def make_cache(self) -> list:
        """What ``model.make_cache()`` returns while patched: one-sequence layer caches
        (a batch in the first forward pass widens them) whose blocks live in the shared
        pool until the caches are dropped."""
        _refuse_dropped_options()
        paged = self.shared_cache.owned_layer_caches(1)
        return self.layout.fill(paged, None if self.layout.plain else _original_caches(self.model))

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
        if self._states is not None:
            self._states.close()
        for name in self._modules:
            _unpatch_module(name)
        for cls in self._classes:
            _restore_call(cls, _patched_classes)

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
        model: an mlx-lm model. Which layers kvmetal serves is decided from the caches the
            model's ``make_cache()`` builds and the calls its layers make (``analyse_model``);
            recurrent-state layers of a hybrid keep mlx-lm's cache, and anything kvmetal cannot
            reproduce exactly is refused here (``UnsupportedModel``, naming the layer).
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
