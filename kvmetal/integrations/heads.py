"""Split an mlx-lm model into its body and its LM head, so the engine can slice hidden
states before the head: a step over T tokens needs logits only for the rows that sample
(decode rows, the last token of a finished prefill), and a prefill chunk's other rows
would cost T x vocab for nothing.

Each supported family's head, as its ``Model.__call__`` applies it after ``self.model``
(tests check ``head(body(x)) == model(x)`` per family, so a change in mlx-lm shows up).
"""
from __future__ import annotations

from .mlx_lm import SUPPORTED_FAMILIES, model_family


def _tied(model) -> bool:
    # gemma3_text keeps the flag on the model, the others on their args
    if hasattr(model, "tie_word_embeddings"):
        return bool(model.tie_word_embeddings)
    return bool(getattr(model.args, "tie_word_embeddings", False))


def lm_head(model):
    """``hidden [B, L, hidden] -> logits [B, L, vocab]`` for ``model``'s family."""
    family = model_family(model)
    if family not in SUPPORTED_FAMILIES:
        raise NotImplementedError(f"[lm_head] model family {family!r} is not supported")
    if family != "gpt_oss" and _tied(model):
        return lambda h: model.model.embed_tokens.as_linear(h)
    # No family here softcaps its final logits in mlx-lm 0.32 (gemma3_text included); a
    # version that adds it fails the head(body(x)) == model(x) test rather than drifting.
    return model.lm_head


def body(model):
    """``(inputs [B, L], cache) -> hidden [B, L, hidden]``: the model without its head."""
    inner = model.model
    return lambda inputs, cache: inner(inputs, cache)
