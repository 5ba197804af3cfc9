"""Speculative drafts: who proposes the tokens a decode row carries for one pass to verify.

A decode row carries its request's last token and up to ``num_draft_tokens`` drafted
tokens (at most ``MAX_DRAFT_TOKENS``: the decode kernel takes 1-8 query tokens per
sequence); the pass computes the target's logits at every one of them, and the sampler's
acceptance rule (``sampler.verify``) judges them: the output distribution is that of plain
decoding, greedy output the same tokens. Accepted drafts keep their cache slots, the rest
are truncated.

A ``Proposer`` drafts for a step's speculating requests, all at once:

- ``NgramProposer`` (prompt lookup, ``ngram_draft``): the longest suffix of the request's
  tokens (``ngram_max`` down to ``ngram_min`` tokens) that occurred before, prompt and
  output alike; its most recent earlier occurrence's continuation is the draft (a point
  mass, ``q(x) = 1``).
- ``ModelDrafter`` (a smaller model with the same tokenizer, on its own paged pool): each
  step it catches up with every drafting request's tokens (one ragged pass: the whole
  prompt the first time, afterwards the few tokens the last verification emitted) and
  then proposes tokens greedily, one pass each, all requests batched. A greedy draft is a
  deterministic function of the request's tokens, i.e. a point mass too, so the acceptance
  rule is exact for sampled requests as well. What the draft cache holds past the accepted
  tokens is truncated at the next call (the longest common prefix is kept).

Speculation turns itself off for a request whose acceptance rate over its last ``window``
drafted tokens falls below ``min_acceptance`` (``DraftState.record``; a step without a
match simply drafts nothing).
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..integrations.heads import split_model
from ..integrations.mlx_lm import use_paged_cache
from ..ops import MAX_QUERY_TOKENS

MAX_DRAFT_TOKENS = MAX_QUERY_TOKENS - 1  # one query row is the request's last token
METHODS = ("ngram", "model")  # prompt lookup; a draft model (Engine(draft_model=...), ModelDrafter)


@dataclass(frozen=True)
class SpeculativeConfig:
    """How an engine drafts.

    method: "ngram" (prompt lookup) or "model" (greedy drafts of a smaller model with the
    same vocabulary: ``Engine(draft_model=...)``). num_draft_tokens: drafted tokens per decode row
    (1..MAX_DRAFT_TOKENS). ngram_max / ngram_min: longest / shortest suffix matched.
    min_acceptance, window: a request's speculation turns off once its acceptance over
    its last ``window`` drafted tokens is below ``min_acceptance`` (0: never)."""

    method: str = "ngram"
    num_draft_tokens: int = 4
    ngram_max: int = 3
    ngram_min: int = 2
    min_acceptance: float = 0.2
    window: int = 32

    def __post_init__(self):
        op = "SpeculativeConfig"
        if self.method not in METHODS:
            raise ValueError(f"[{op}] method must be one of {METHODS}, got {self.method!r}")
        for name, low, high in (("num_draft_tokens", 1, MAX_DRAFT_TOKENS), ("ngram_max", 1, 64),
                                ("ngram_min", 1, 64), ("window", 1, 1 << 20)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"[{op}] {name} must be an int in [{low}, {high}], got {value!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(f"[{op}] ngram_min ({self.ngram_min}) must be <= ngram_max ({self.ngram_max})")
        value = self.min_acceptance
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
            raise ValueError(f"[{op}] min_acceptance must be a number in [0, 1], got {value!r}")


class DraftState:
    """One request's speculation: its token history (numpy, grown as output arrives),
    the draft of the current step and its acceptance record."""

    def __init__(self, config: SpeculativeConfig, prompt: list):
        self.config = config
        self.active = True
        self.history = np.asarray(prompt, dtype=np.int64)
        self.draft: list = []  # this step's drafted tokens (empty: a plain decode row)
        self.recent: list = []  # (drafted, accepted) of the last verifications, within ``window`` drafts
        self.drafted = self.accepted = 0  # totals

    def propose(self, tokens: list, limit: int) -> list:
        """Draft at most ``limit`` tokens after ``tokens`` (the request's prompt and output)."""
        self.draft = []
        if not self.active or limit < 1:
            return self.draft
        if len(tokens) != len(self.history):
            self.history = np.concatenate([self.history, np.asarray(tokens[len(self.history):], dtype=np.int64)])
        c = self.config
        self.draft = ngram_draft(self.history, ngram_max=c.ngram_max, ngram_min=c.ngram_min,
                                 num_tokens=min(limit, c.num_draft_tokens))
        return self.draft

    def record(self, drafted: int, accepted: int) -> None:
        """A verification's outcome; turns speculation off when it does not pay."""
        self.drafted += drafted
        self.accepted += accepted
        self.recent.append((drafted, accepted))
        c = self.config
        while sum(d for d, _ in self.recent[1:]) >= c.window:
            self.recent.pop(0)
        drafted_recent = sum(d for d, _ in self.recent)
        if drafted_recent >= c.window and sum(a for _, a in self.recent) < c.min_acceptance * drafted_recent:
            self.active = False



class Proposer:
    """What drafts a step's tokens: ``propose(wanted, budget)`` with ``wanted`` the
    speculating requests and the most tokens each may carry [(request, n)], in order; one
    draft (a list of token ids, at most n) per entry, at most ``budget`` tokens in all,
    earlier entries served first."""

    def propose(self, wanted: list, budget: int) -> list:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the proposer holds (a draft model's pool)."""


class NgramProposer(Proposer):
    """Prompt lookup, from each request's own ``DraftState`` (its token history)."""

    def propose(self, wanted: list, budget: int) -> list:
        drafts = []
        for request, n in wanted:
            draft = request.speculation.propose(request.known_tokens, min(n, budget))
            budget -= len(draft)
            drafts.append(draft)
        return drafts


def ngram_draft(tokens, *, ngram_max: int, ngram_min: int, num_tokens: int) -> list:
    """Prompt lookup: the continuation (up to ``num_tokens``) of the most recent earlier
    occurrence of the longest suffix of ``tokens`` with ``ngram_min..ngram_max`` tokens;
    [] when none occurred."""
    a = np.asarray(tokens)
    last = a.size - 1
    if last < 1 or num_tokens < 1:
        return []
    # ends[e]: tokens ending at e (< last) match the suffix over the current length
    ends = a[:last] == a[last]
    found = None
    for n in range(1, min(ngram_max, last) + 1):
        if n > 1:
            ends[:n - 1] = False
            ends[n - 1:] &= a[:last - n + 1] == a[last - n + 1]
        if not ends.any():
            break
        if n >= ngram_min:
            found = int(np.flatnonzero(ends)[-1])
    if found is None:
        return []
    return a[found + 1:found + 1 + num_tokens].tolist()


class ModelDrafter(Proposer):
    """Greedy drafts of ``model`` (an mlx-lm model sharing the target's vocabulary).

    ``block_size``, ``num_blocks``: the draft model's own pool (None: it grows)."""

    def __init__(self, model, *, block_size: int = 16, num_blocks: int | None = None):
        self.model = model
        self.handle = use_paged_cache(model, block_size=block_size, num_blocks=num_blocks)
        try:
            if not self.handle.layout.plain:
                where = self.handle.layout.native[0] if self.handle.layout.native else "a CacheList entry"
                raise ValueError(f"[ModelDrafter] a draft model must have a K/V attention cache in every layer; "
                                 f"{where} is not one")
            self.cache = self.handle.new_model_cache(cascade=False)
            self.body, self.head = split_model(model)  # drafts need the head alone (NotImplementedError)
        except BaseException:
            self.handle.undo()
            raise
        self.held: dict = {}  # request id -> the tokens whose K/V the draft cache holds

    @property
    def vocab_size(self):
        return getattr(getattr(self.model, "args", None), "vocab_size", None)

    def propose(self, wanted: list, budget: int) -> list:
        """Greedy drafts of exactly the tokens each entry may take: n, within what ``budget`` leaves."""
        rooms = []
        for _, n in wanted:
            rooms.append(min(n, budget))  # n <= 0: none (a negative n, as before the move, adds to the budget)
            budget -= rooms[-1]
        return self.draft([(r.request_id, r.known_tokens, n) for (r, _), n in zip(wanted, rooms)])

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
