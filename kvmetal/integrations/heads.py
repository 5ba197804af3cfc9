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
slices the logits. A vision-language wrapper is split at its ``language_model``.
"""
from __future__ import annotations

import mlx.core as mx

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
    derives from its cache before the body (positions, masks) is compared too. A model
    that cannot run the probe, or fails it, is not split."""
    prompt = mx.arange(PROBE_TOKENS, dtype=mx.int32)[None]
    more = mx.arange(PROBE_TOKENS, PROBE_TOKENS + 2, dtype=mx.int32)[None]
    try:
        split_cache, whole_cache = _original_caches(model), _original_caches(model)
        for x in (prompt, more):
            split, whole = head(body(x, split_cache)), model(x, cache=whole_cache)
            if split.shape != whole.shape or not bool(mx.array_equal(split, whole)):
                return False
        return True
    except Exception:  # any failure of the probe only means: do not split this model
        return False


def split_model(model) -> tuple:
    """``(body, head)``: ``body(inputs [B, L], cache) -> hidden [B, L, hidden]`` and
    ``head(hidden) -> logits [B, L, vocab]``. NotImplementedError where the model cannot
    be split exactly (the caller runs the whole model)."""
    family = model_family(model)
    parts = _parts(model)
    if parts is None or (family not in SUPPORTED_FAMILIES and not _probe(model, *parts)):
        raise NotImplementedError(f"[heads] {family}: its logits are not lm_head(model.model(x)), "
                                  f"so hidden states cannot be sliced before the head")
    # No listed family softcaps its final logits in mlx-lm 0.32 (gemma3_text included); a
    # version that adds it fails the head(body(x)) == model(x) test rather than drifting.
    return parts


def lm_head(model):
    """``hidden [B, L, hidden] -> logits [B, L, vocab]`` for ``model`` (see split_model)."""
    return split_model(model)[1]


def body(model):
    """``(inputs [B, L], cache) -> hidden [B, L, hidden]``: the model without its head."""
    return split_model(model)[0]
