"""Split an mlx-lm model into its body and its LM head, so the engine can slice hidden
states before the head: a step over T tokens needs logits only for the rows that sample
(decode rows, the last token of a finished prefill), and a prefill chunk's other rows
would cost T x vocab for nothing.

The split is mlx-lm's common shape: ``Model.__call__`` runs ``self.model`` (embeddings,
layers, final norm) and then ``self.lm_head``, or the tied embeddings, and nothing else.
For the families kvmetal checks in depth (SUPPORTED_FAMILIES; tests check
``head(body(x)) == model(x)`` per family, so a change in mlx-lm shows up) it is taken as
is; any other model is split the same way only if one probe pass over a few tokens gives
``model(x)`` bit for bit, so a family that scales or softcaps its logits after the head
(or has no such parts) is never split wrongly: it is refused, and the engine runs the
whole model and slices the logits.
"""
from __future__ import annotations

import mlx.core as mx

from .mlx_lm import SUPPORTED_FAMILIES, model_family

PROBE_TOKENS = 3  # tokens of the probe pass that checks an unlisted family's split


def _tied(model) -> bool:
    # gemma3_text keeps the flag on the model, the others on their args
    if hasattr(model, "tie_word_embeddings"):
        return bool(model.tie_word_embeddings)
    return bool(getattr(getattr(model, "args", None), "tie_word_embeddings", False))


def _parts(model):
    """(body, head) in mlx-lm's common shape, or None where the model lacks the parts."""
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
    """Whether ``head(body(x)) == model(x)`` on a few tokens, bit for bit (a model that
    cannot run the probe without a cache, or fails it, is not split)."""
    x = mx.arange(PROBE_TOKENS, dtype=mx.int32)[None]
    try:
        split, whole = head(body(x, None)), model(x)
        return split.shape == whole.shape and bool(mx.array_equal(split, whole))
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
