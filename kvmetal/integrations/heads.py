"""Split an mlx-lm model into its body and its LM head, so the engine can slice hidden
states before the head: a step over T tokens needs logits only for the rows that sample
(decode rows, the last token of a finished prefill), and a prefill chunk's other rows
would cost T x vocab for nothing.

The split is mlx-lm's common shape: ``Model.__call__`` runs ``self.model`` (embeddings,
layers, final norm) and then ``self.lm_head``, or the tied embeddings, and nothing else.
For the families kvmetal checks in depth (SUPPORTED_FAMILIES; tests check
``head(body(x)) == model(x)`` per family, so a change in mlx-lm shows up) it is taken as
is; any other model is split the same way only if a probe (a prompt, then two more
tokens, on mlx-lm's own caches) gives ``model(x, cache)`` bit for bit, so a family that
scales or softcaps its logits after the head, or derives anything from its cache before
the body, is never split wrongly: it is refused, and the engine runs the whole model and
slices the logits. A vision-language wrapper is split at its ``language_model``. A model
whose call does more after its backbone (gemma2's softcap, cohere's logit scale, another
attribute name) is split around the backbone it runs first (``_stand_in_parts``), under
the same probe.
"""
from __future__ import annotations

import contextlib
import threading

import mlx.core as mx
import mlx.nn as nn

from .mlx_lm import SUPPORTED_FAMILIES, _original_caches, model_family

PROBE_TOKENS = 3  # prompt tokens of the probe that checks an unlisted family's split (2 more follow)


def _tied(model) -> bool:
    # gemma3_text keeps the flag on the model, the others on their args
    if hasattr(model, "tie_word_embeddings"):
        return bool(model.tie_word_embeddings)
    return bool(getattr(getattr(model, "args", None), "tie_word_embeddings", False))


def _parts(model):
    """(body, head) in mlx-lm's common shape, or None where the model lacks the parts. A
    vision-language wrapper that hands its text to ``self.language_model`` is split there."""
    wrapped = getattr(model, "language_model", None)
    if getattr(model, "model", None) is None and wrapped is not None and wrapped is not model:
        return _parts(wrapped)
    inner = getattr(model, "model", None)
    if inner is None or not callable(inner):
        return None
    if model_family(model) != "gpt_oss" and _tied(model):
        embed = getattr(inner, "embed_tokens", None)
        if embed is None or not hasattr(embed, "as_linear"):
            return None
        head = embed.as_linear
    else:
        head = getattr(model, "lm_head", None)
        if head is None or not callable(head):
            return None
    return (lambda inputs, cache: inner(inputs, cache)), head


def _probe(model, body, head) -> bool:
    """Whether ``head(body(x, cache))`` is ``model(x, cache=cache)`` bit for bit over two
    passes (a prompt, then more tokens after it) on mlx-lm's own caches, so what a model
    derives from its cache before the body (positions, masks) is compared too, and the
    head of the last row alone is that row's logits (the head is row by row). A model
    that cannot run the probe, or fails it, is not split."""
    prompt = mx.arange(PROBE_TOKENS, dtype=mx.int32)[None]
    more = mx.arange(PROBE_TOKENS, PROBE_TOKENS + 2, dtype=mx.int32)[None]
    try:
        split_cache, whole_cache = _original_caches(model), _original_caches(model)
        for x in (prompt, more):
            hidden, whole = body(x, split_cache), model(x, cache=whole_cache)
            split, last = head(hidden), head(hidden[:, -1:])  # the engine hands the head chosen rows
            if split.shape != whole.shape or not bool(mx.array_equal(split, whole)):
                return False
            # Row by row, up to rounding: a matrix-vector product need not give a matrix
            # product's bits (on a GPU), but a head that mixes rows would be far off.
            if not bool(mx.allclose(last, whole[:, -1:], rtol=1e-3, atol=1e-4)):
                return False
        return True
    except Exception:  # any failure of the probe only means: do not split this model
        return False


class _StandIn:
    """Stands in for a model's child module during one call: calls ``call``, and hands
    every attribute read (``self.model.embed_tokens`` ...) to the real module."""

    def __init__(self, real, call):
        self._real, self._call = real, call

    def __call__(self, *args, **kwargs):
        return self._call(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._real, name)


class _BodyDone(Exception):
    """Ends a model's call once its backbone has run (the split's body)."""


_stand_in_lock = threading.Lock()


@contextlib.contextmanager
def _standing_in(model, name: str, stand: _StandIn):
    # An instance attribute shadows the child kept in the module's dict for one call only.
    with _stand_in_lock:
        model.__dict__[name] = stand
        try:
            yield
        finally:
            model.__dict__.pop(name, None)


def _backbone(model):
    """(name, module) of the child module ``Model.__call__`` runs first, from one traced
    pass over a token (None where that pass fails or calls none)."""
    children = {n: c for n, c in model.children().items() if isinstance(c, nn.Module)}
    order = []
    with _stand_in_lock:
        try:
            for name, real in children.items():
                model.__dict__[name] = _StandIn(real, lambda *a, _n=name, _r=real, **k: order.append(_n) or _r(*a, **k))
            model(mx.zeros((1, 1), dtype=mx.int32))
        except Exception:
            return None
        finally:
            for name in children:
                model.__dict__.pop(name, None)
    return (order[0], children[order[0]]) if order else None


def _stand_in_parts(model):
    """(body, head) around whatever ``Model.__call__`` does after its backbone (a logit
    scale, a softcap, another head name): the body runs the call until the backbone
    returns, the head runs the call with the backbone standing in for the hidden states."""
    found = _backbone(model)
    if found is None:
        return None
    name, real = found

    def body(inputs, cache):
        out = []

        def run(*args, **kwargs):
            out.append(real(*args, **kwargs))
            raise _BodyDone

        with _standing_in(model, name, _StandIn(real, run)):
            try:
                model(inputs, cache=cache)
            except _BodyDone:
                return out[0]
        raise RuntimeError(f"[heads] {model_family(model)}: its {name} did not run")

    def head(hidden):
        with _standing_in(model, name, _StandIn(real, lambda *args, **kwargs: hidden)):
            return model(mx.zeros(hidden.shape[:2], dtype=mx.int32), cache=None)

    return body, head


def split_model(model) -> tuple:
    """``(body, head)``: ``body(inputs [B, L], cache) -> hidden [B, L, hidden]`` and
    ``head(hidden) -> logits [B, L, vocab]``. A listed family takes mlx-lm's common shape;
    any other model the common shape, else the stand-in split, whichever passes the probe.
    NotImplementedError where neither does (the caller runs the whole model)."""
    family = model_family(model)
    parts = _parts(model)
    if parts is not None and family in SUPPORTED_FAMILIES:
        # No listed family softcaps its final logits in mlx-lm 0.32 (gemma3_text included); a
        # version that adds it fails the head(body(x)) == model(x) test rather than drifting.
        return parts
    if parts is not None and _probe(model, *parts):
        return parts
    parts = _stand_in_parts(model)  # traced only where the common shape does not hold
    if parts is not None and _probe(model, *parts):
        return parts
    raise NotImplementedError(f"[heads] {family}: no split of its call into a body and a head gives model(x) "
                              f"bit for bit, so hidden states cannot be sliced before the head")


def lm_head(model):
    """``hidden [B, L, hidden] -> logits [B, L, vocab]`` for ``model`` (see split_model)."""
    return split_model(model)[1]


def body(model):
    """``(inputs [B, L], cache) -> hidden [B, L, hidden]``: the model without its head."""
    return split_model(model)[0]
