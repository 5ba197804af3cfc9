"""Drafts from a smaller model (the same tokenizer) on its own paged pool.

Each step the draft model catches up with every drafting request's tokens (a ragged
pass: the whole prompt the first time, afterwards the few tokens the last verification
emitted) and then proposes ``k`` tokens greedily, one pass each, all requests batched.
A greedy draft is a deterministic function of the request's tokens, i.e. a point mass:
the engine's acceptance rule (``speculative.verify``) is then exact for sampled requests
too. What the draft cache holds past the accepted tokens is truncated at the next call
(the longest common prefix of what it holds and the request's tokens is kept).
"""
from __future__ import annotations

import mlx.core as mx

from ..integrations.heads import body, lm_head
from ..integrations.mlx_lm import use_paged_cache


class ModelDrafter:
    """Greedy drafts of ``model`` (an mlx-lm model sharing the target's vocabulary).

    ``block_size``, ``num_blocks``: the draft model's own pool (None: it grows)."""

    def __init__(self, model, *, block_size: int = 16, num_blocks: int | None = None):
        self.model = model
        self.handle = use_paged_cache(model, block_size=block_size, num_blocks=num_blocks)
        try:
            self.cache = self.handle.new_model_cache(cascade=False)
        except BaseException:
            self.handle.undo()
            raise
        self.body, self.head = body(model), lm_head(model)
        self.held: dict = {}  # request id -> the tokens whose K/V the draft cache holds

    @property
    def vocab_size(self):
        return getattr(getattr(self.model, "args", None), "vocab_size", None)

    def draft(self, wanted: list) -> list:
        """Drafts for ``wanted`` [(request id, tokens, at most n)]: one list per entry."""
        live = {rid for rid, _, _ in wanted}
        for rid in [r for r in self.held if r not in live]:  # finished, preempted or not drafting now
            self.forget(rid)
        drafts = {rid: [] for rid, _, _ in wanted}
        every = [rid for rid, _, _ in wanted]
        wanted = [(rid, tokens, n) for rid, tokens, n in wanted if n > 0]
        if not wanted:
            return [drafts[rid] for rid in every]
        # Catch up: every token the draft cache lacks, one ragged pass (prefill rows).
        ids, starts, counts, inputs = [], [], [], []
        for rid, tokens, _ in wanted:
            start = self._keep_common_prefix(rid, tokens)
            if start == len(tokens):  # holds them all: recompute the last one for its logits
                start -= 1
                self.cache.truncate(rid, start)
            if rid in self.cache:
                self.cache.append(rid, num_tokens=len(tokens) - start)
            else:
                self.cache.add_sequence(rid, num_tokens=len(tokens))
            ids.append(rid)
            starts.append(start)
            counts.append(len(tokens) - start)
            inputs += tokens[start:]
            self.held[rid] = list(tokens)
        last = mx.array([sum(counts[:i + 1]) - 1 for i in range(len(counts))], dtype=mx.int32)
        tokens_now = self._pass(ids, starts, counts, inputs, last, decodes=0)
        # Then k tokens greedily: each pass feeds the previous draft.
        active = list(range(len(wanted)))
        while True:
            for i in active:
                drafts[wanted[i][0]].append(tokens_now[i])
            active = [i for i in active if len(drafts[wanted[i][0]]) < wanted[i][2]]
            if not active:
                break
            step_ids = [wanted[i][0] for i in active]
            step_starts = [len(self.held[rid]) for rid in step_ids]
            fed = [drafts[rid][-1] for rid in step_ids]
            for rid, token in zip(step_ids, fed):
                self.cache.append(rid, num_tokens=1)
                self.held[rid].append(token)
            got = self._pass(step_ids, step_starts, [1] * len(step_ids), fed,
                             mx.arange(len(step_ids), dtype=mx.int32), decodes=len(step_ids))
            tokens_now = dict(zip(active, got))
            tokens_now = [tokens_now.get(i) for i in range(len(wanted))]
        return [drafts[rid] for rid in every]

    def forget(self, rid) -> None:
        if rid in self.cache:
            self.cache.free(rid)
        self.held.pop(rid, None)

    def close(self) -> None:
        self.handle.undo()

    def _keep_common_prefix(self, rid, tokens: list) -> int:
        """Truncate the draft cache to the longest common prefix of what it holds and ``tokens``."""
        held = self.held.get(rid)
        if held is None or rid not in self.cache:
            return 0
        n = 0
        limit = min(len(held), len(tokens))
        while n < limit and held[n] == tokens[n]:
            n += 1
        if n < len(held):
            self.cache.truncate(rid, n)
            del held[n:]
        return n

    def _pass(self, ids, starts, counts, inputs, rows: mx.array, *, decodes: int) -> list:
        caches = self.cache.ragged_layer_caches(ids, starts, counts, decodes=decodes)
        hidden = self.body(mx.array(inputs, dtype=mx.int32)[:, None], caches)
        logits = self.head(hidden[rows])[:, -1, :]
        return mx.argmax(logits, axis=-1).tolist()
