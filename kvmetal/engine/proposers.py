"""Speculative decoding on the paged cache: drafting by prompt lookup, and exact acceptance.

A decode row carries its request's last token and up to ``num_draft_tokens`` drafted
tokens (at most ``MAX_DRAFT_TOKENS``: the decode kernel takes 1-8 query tokens per
sequence); the pass computes the target's logits at every one of them. Row ``i`` judges
draft ``i``; the first rejected draft is replaced by a token sampled at its row, and when
every draft is accepted the last row adds a bonus token. Accepted drafts keep their
cache slots, the rest are truncated.

Acceptance is the standard speculative rejection rule with the target distribution ``p``
of the row after the request's processors and sampling filters (what the sampler would
draw from): accept draft ``x`` with probability ``min(1, p(x) / q(x))``, else sample from
``normalize(max(0, p - q))``. A prompt-lookup draft is a point mass (``q(x) = 1``), so
``x`` is accepted with probability ``p(x)`` and a rejection samples ``p`` without ``x``.
Greedy requests accept while the draft is the argmax. The output distribution is that of
plain decoding; greedy output is the same tokens (each row's logits are computed by the
same kernels as a one-token decode at that position).

Drafting (``ngram_draft``): the longest suffix of the request's tokens (``ngram_max``
down to ``ngram_min`` tokens) that occurred before, prompt and output alike; its most
recent earlier occurrence's continuation is the draft. Speculation turns itself off for
a request whose acceptance rate over its last ``window`` drafted tokens falls below
``min_acceptance`` (a step without a match simply drafts nothing).
"""
from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..ops import MAX_QUERY_TOKENS

MAX_DRAFT_TOKENS = MAX_QUERY_TOKENS - 1  # one query row is the request's last token
METHODS = ("ngram", "model")  # prompt lookup; a draft model (Engine(draft_model=...), draft_model.py)


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


# ---------------------------------------------------------------------------- verification


@dataclass
class Verification:
    """One request's verification graphs: ``accept`` bool [d] (draft i accepted at row i),
    ``alt`` int32 [d + 1] (row i's replacement for a rejected draft; the bonus at row d),
    and with logprobs, ``rows`` float32 [d + 1, V]: each row's log-softmax."""

    request: object
    draft: list
    accept: mx.array
    alt: mx.array
    rows: mx.array | None = None

    def arrays(self) -> list:
        return [a for a in (self.accept, self.alt, self.rows) if a is not None]

    def outcome(self) -> tuple:
        """(accepted drafts, emitted tokens); read the arrays (evaluated by the caller)."""
        accept = self.accept.tolist()
        alt = self.alt.tolist()
        m = next((i for i, ok in enumerate(accept) if not ok), len(self.draft))
        return m, self.draft[:m] + [int(alt[m])]


def verify(request, logits: mx.array, draft: list, *, batch_sampler) -> Verification:
    """The graphs judging ``draft`` from ``logits`` [d + 1, V] (row i: the target's logits
    after the request's last token and draft[:i]); nothing is evaluated here."""
    from .sampler import _history, _log_softmax, _sampling_logits

    d = len(draft)
    rows = logits
    if request.processors:  # row i's processors read the drafts before it as history
        history = _history(request)
        processed = []
        for i in range(d + 1):
            row = logits[i:i + 1]
            h = history if i == 0 else mx.concatenate([history, mx.array(draft[:i], dtype=history.dtype)])
            if request.history is not None:
                h = h[-request.history:]
            for processor in request.processors:
                row = processor(h, row)
            processed.append(row)
        rows = mx.concatenate(processed)
    drafted = mx.array(draft, dtype=mx.int32)
    sampling = request.sampling
    if sampling is None or sampling.greedy:
        target = (batch_sampler(rows) if sampling is None else mx.argmax(rows, axis=-1)).astype(mx.int32)
        accept, alt = target[:d] == drafted, target
    else:
        request.key, key = mx.random.split(request.key)
        keys = mx.random.split(key, 2 * (d + 1))
        scaled, cats = [], []
        for i in range(d + 1):
            s, k = _sampling_logits(rows[i], sampling, keys[2 * i])
            scaled.append(s[0])
            cats.append(k)
        scaled = mx.stack(scaled)  # [d + 1, V]: what the sampler draws from
        p_draft = mx.softmax(scaled[:d], axis=-1)[mx.arange(d), drafted] if d else mx.zeros((0,))
        u = mx.stack([mx.random.uniform(key=keys[2 * i + 1]) for i in range(d)]) if d else mx.zeros((0,))
        accept = u < p_draft
        residual = residual_logits(scaled, drafted)
        alt = mx.stack([mx.random.categorical(residual[i], key=cats[i]) for i in range(d + 1)]).astype(mx.int32)
    lp = None
    if request.logprobs is not None:
        lp = mx.stack([_log_softmax(rows[i]) for i in range(d + 1)])
    return Verification(request, list(draft), accept, alt, lp)


def residual_logits(scaled: mx.array, drafted: mx.array) -> mx.array:
    """Where a rejected draft's replacement is drawn from: row i's distribution without
    draft i, renormalised (``max(0, p - q)`` for a point-mass q); the bonus row (the
    last) keeps every token. ``scaled`` [d + 1, V] logits, ``drafted`` int32 [d]."""
    removed = mx.concatenate([drafted, mx.array([-1], dtype=mx.int32)])[:, None]
    return mx.where(mx.arange(scaled.shape[-1])[None] == removed, -mx.inf, scaled)
