"""The engine's sampler: one token per sampling row of a pass, by each request's settings,
and the acceptance rule of speculative drafts.

Greedy, or temperature / top-p / top-k / min-p / XTC with the request's own random key,
so a seeded request gives the same tokens whatever it is batched with, however its prompt
is chunked and however often it is preempted. A request's logits processors (mlx-lm's
repetition / presence / frequency penalties and logit bias) run on its own row of the
batch's logits, over its own tokens; ``logprobs`` reports the chosen token's
log-probability (and the top alternatives) under those processed logits. Nothing here is
evaluated: the pass and its sampling are launched together.

Speculative acceptance (``verify``): a decode row with ``d`` drafts has ``d + 1`` rows of
logits; row ``i`` judges draft ``i`` by the standard rejection rule with the target
distribution ``p`` of the row after the request's processors and sampling filters (what the
sampler would draw from): accept draft ``x`` with probability ``min(1, p(x) / q(x))``, else
sample from ``normalize(max(0, p - q))``. Every proposer's draft is a point mass
(``q(x) = 1``), so ``x`` is accepted with probability ``p(x)`` and a rejection samples ``p``
without ``x``; the first rejected draft is replaced by that token, and when every draft is
accepted the last row adds a bonus token. Greedy requests accept while the draft is the
argmax. The output distribution is that of plain decoding; greedy output is the same tokens
(each row's logits are computed by the same kernels as a one-token decode at that position).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from ..cache import _is_int
from ..seeds import check_seed


@dataclass(frozen=True)
class SamplingParams:
    """How one request picks its tokens (mlx-lm's names and meanings).

    temperature 0 is greedy; top_p 1 / top_k 0 / min_p 0 / xtc_probability 0 switch that
    filter off; seed makes sampling reproducible (None draws one). The penalties and
    ``logit_bias`` ({token id: added logit}) are mlx-lm's logits processors
    (``make_logits_processors``), applied before greedy or sampled picks; a penalty of 0
    is off, and each looks at the last ``*_context_size`` tokens (prompt included; 0: all
    of them, as in mlx-lm). ``xtc_special_tokens`` are never cut by XTC."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 0.0
    repetition_context_size: int = 20
    presence_penalty: float = 0.0
    presence_context_size: int = 20
    frequency_penalty: float = 0.0
    frequency_context_size: int = 20
    logit_bias: tuple = ()  # ((token id, bias), ...); a dict is accepted and normalized
    xtc_probability: float = 0.0
    xtc_threshold: float = 0.1
    xtc_special_tokens: tuple = ()

    def __post_init__(self):
        inf = float("inf")
        checks = (("temperature", self.temperature, 0.0, inf), ("top_p", self.top_p, 0.0, 1.0),
                  ("min_p", self.min_p, 0.0, 1.0), ("repetition_penalty", self.repetition_penalty, 0.0, inf),
                  ("presence_penalty", self.presence_penalty, -inf, inf),
                  ("frequency_penalty", self.frequency_penalty, -inf, inf),
                  ("xtc_probability", self.xtc_probability, 0.0, 1.0), ("xtc_threshold", self.xtc_threshold, 0.0, 0.5))
        for name, value, low, high in checks:
            _check_number(name, value, low, high)
        for name in ("top_k", "seed", "repetition_context_size", "presence_context_size", "frequency_context_size"):
            value = getattr(self, name)
            if name == "seed":
                if value is not None:  # what mx.random.seed takes (kvmetal/seeds.py), like generate and serve
                    check_seed(value, name="[SamplingParams] seed")
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"[SamplingParams] {name} must be an int, got {value!r}")
            if name != "seed" and value < 0:
                raise ValueError(f"[SamplingParams] {name} must be >= 0, got {value!r}")
        bias = self.logit_bias.items() if isinstance(self.logit_bias, dict) else self.logit_bias
        try:
            bias = tuple(sorted((_token_id("logit_bias", t), b) for t, b in bias))
        except (TypeError, ValueError) as e:
            raise type(e)(f"[SamplingParams] logit_bias must map token ids to numbers: {e}") from None
        for _, b in bias:
            _check_number("logit_bias value", b, -inf, inf)
        object.__setattr__(self, "logit_bias", tuple((t, float(b)) for t, b in bias))
        object.__setattr__(self, "xtc_special_tokens",
                           tuple(_token_id("xtc_special_tokens", t) for t in self.xtc_special_tokens))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def logits_processors(self) -> tuple:
        """(mlx-lm's processors for these settings, how many trailing tokens they read:
        None for all of them)."""
        from mlx_lm.sample_utils import make_logits_processors

        processors = make_logits_processors(
            dict(self.logit_bias) or None, self.repetition_penalty, self.repetition_context_size,
            self.presence_penalty, self.presence_context_size, self.frequency_penalty, self.frequency_context_size)
        sizes = [size for penalty, size in ((self.repetition_penalty, self.repetition_context_size),
                                            (self.presence_penalty, self.presence_context_size),
                                            (self.frequency_penalty, self.frequency_context_size)) if penalty != 0]
        history = None if 0 in sizes else max(sizes, default=1)  # mlx-lm's tokens[-0:] is every token
        return processors, history


def _check_number(name: str, value, low: float, high: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"[SamplingParams] {name} must be a number, got {value!r}")
    if not (_finite(value) and low <= value <= high):
        if math.isinf(low):
            bound = "finite"
        else:
            bound = f">= {low} and finite" if math.isinf(high) else f"in [{low}, {high}]"
        raise ValueError(f"[SamplingParams] {name} must be {bound}, got {value!r}")


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


def _token_id(name: str, value) -> int:
    """A token id from an int or a decimal string (JSON object keys are strings)."""
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} token ids must be ints >= 0, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the ``top`` most likely tokens
    (``((token id, logprob), ...)``, most likely first), under the processed logits."""

    logprob: float
    top: tuple = ()

def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


class Sampler:
    """Picks the tokens of a pass's sampling rows.

    ``batch``: logits [S, V] -> token ids [S] for requests without ``sampling``.
    ``token_sync``: across ranks, maps this rank's tokens to rank 0's (None: one rank)."""

    def __init__(self, batch=greedy):
        self.batch = batch
        self.token_sync = None

    def sample(self, requests: list, logits: mx.array) -> tuple:
        """One token per row of ``logits`` [S, V], each by its request's sampling (int32
        [S], not evaluated), and the parts of each request's ``TokenLogprobs``."""
        tokens, rows = self.pick(requests, logits)
        if self.token_sync is not None:  # rank 0's tokens; logprobs then describe them
            mx.eval(tokens, *rows.values())
            tokens = mx.array(self.token_sync([int(t) for t in tokens.tolist()]))
        tokens = tokens.astype(mx.int32)
        return tokens, _logprob_parts(requests, rows, tokens)

    def pick(self, requests: list, logits: mx.array) -> tuple:
        """(token ids [S], {row: log-softmax of the processed row} for requests wanting
        logprobs), as graphs: nothing is evaluated here."""
        if all(r.plain for r in requests):
            return self.batch(logits), {}
        picks, rows = [], {}
        argmax = None
        for i, r in enumerate(requests):
            row = logits[i:i + 1]
            if r.processors:  # this request's own penalties, on its own row
                history = processor_history(r)
                for processor in r.processors:
                    row = processor(history, row)
            if r.sampling is None:
                picks.append(self.batch(row)[0])
            elif r.sampling.greedy and not r.processors:
                argmax = mx.argmax(logits, axis=-1) if argmax is None else argmax
                picks.append(argmax[i])
            elif r.sampling.greedy:
                picks.append(mx.argmax(row[0]))
            else:
                r.key, key = mx.random.split(r.key)
                picks.append(_sample_row(row[0], r.sampling, key))
            if r.logprobs is not None:
                rows[i] = log_softmax(row[0])
        return mx.stack(picks), rows


def processor_history(request) -> mx.array:
    """The tokens a request's logits processors read: its last ``history`` (None: all),
    the one still in flight included (taken on the device)."""
    known = request.known_tokens
    if request.pending is None:
        return mx.array(known if request.history is None else known[-request.history:])
    flight, j = request.pending
    tail = known if request.history is None else (known[-(request.history - 1):] if request.history > 1 else [])
    return mx.concatenate([mx.array(tail, dtype=mx.int32), flight.tokens[j:j + 1]])


def log_softmax(row: mx.array) -> mx.array:
    row = row.astype(mx.float32)  # reported numbers: no float16 rounding
    return row - mx.logsumexp(row, axis=-1, keepdims=True)


def top_parts(row, n: int, xp=mx) -> tuple:
    """A row's ``n`` most likely tokens as its partition picks them: (ids, their values,
    how many of the row's values equal the n-th largest). ``xp``: ``mx`` (graphs, the
    sampler's rows) or ``numpy`` (rows on the host, the speculative verification's).
    ``top_pairs`` turns them into one answer for both."""
    if n == 0:
        return xp.zeros((0,), dtype=xp.int32), xp.zeros((0,), dtype=row.dtype), 0
    top = mx.argpartition(-row, kth=n - 1)[:n] if xp is mx else xp.argpartition(-row, n - 1)[:n]
    values = row[top]
    return top, values, (row == values.min()).sum()


def top_pairs(ids, values, ties: int, n: int, row) -> tuple:
    """The ``n`` (token id, logprob) pairs of ``top_parts``, most likely first and equal
    logprobs by the lower id. Where the partition left out ids tied at the last place
    (``ties`` counts them all; float16 logits make such ties) the lowest are taken from
    ``row()`` (the whole row on the host: only then)."""
    pairs = sorted(zip((int(t) for t in ids), (float(v) for v in values)), key=lambda p: (-p[1], p[0]))[:n]
    if pairs and int(ties) > sum(v == pairs[-1][1] for _, v in pairs):
        last = pairs[-1][1]
        keep = [p for p in pairs if p[1] > last]
        lowest = np.flatnonzero(np.asarray(row()) == last)[:n - len(keep)]
        pairs = keep + [(int(t), last) for t in lowest]
    return tuple(pairs)


def _logprob_parts(requests: list, rows: dict, tokens: mx.array) -> dict:
    """{row: (chosen token's logprob, (top ids, their logprobs, ties at the last place), the
    row)} as graphs."""
    wanted = {}
    for i, row in rows.items():
        wanted[i] = (row[tokens[i]], top_parts(row, min(requests[i].logprobs, row.shape[-1])), row)
    return wanted


def read_logprobs(requests: list, wanted: dict) -> list:
    """Each request's ``TokenLogprobs`` (None where it asked for none)."""
    out = [None] * len(requests)
    if not wanted:
        return out
    mx.eval([(chosen, parts) for chosen, parts, _ in wanted.values()])
    for i, (chosen, (top, values, ties), row) in wanted.items():
        pairs = top_pairs(top.tolist(), values.tolist(), ties.item() if isinstance(ties, mx.array) else ties,
                          top.size, lambda row=row: np.array(row))
        out[i] = TokenLogprobs(float(chosen.item()), pairs)
    return out


def _sample_row(logits: mx.array, sampling: SamplingParams, key: mx.array) -> mx.array:
    """Sample one token from ``logits`` [V] with mlx-lm's filters (in mlx-lm's order) and an
    explicit key."""
    scaled, key = sampling_logits(logits, sampling, key)
    return mx.random.categorical(scaled, key=key)[0]


def sampling_logits(logits: mx.array, sampling: SamplingParams, key: mx.array) -> tuple:
    """(logits [1, V] the sampler draws from: filtered, tempered; the key left for the draw)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    logprobs = (logits - mx.logsumexp(logits, axis=-1, keepdims=True))[None]
    if 0 < sampling.top_p < 1:
        logprobs = apply_top_p(logprobs, sampling.top_p)
    if sampling.min_p > 0:
        logprobs = apply_min_p(logprobs, sampling.min_p)
    if sampling.xtc_probability > 0:
        key, xtc_key = mx.random.split(key)
        logprobs = _apply_xtc(logprobs, sampling, xtc_key)
    if 0 < sampling.top_k < logprobs.shape[-1]:
        logprobs = apply_top_k(logprobs, sampling.top_k)
    return logprobs * (1 / sampling.temperature), key


def _apply_xtc(logprobs: mx.array, sampling: SamplingParams, key: mx.array) -> mx.array:
    """XTC ("exclude top choices"), as mlx-lm's ``apply_xtc`` but drawing from ``key``: with
    probability ``xtc_probability``, every token above ``xtc_threshold`` except the least
    likely of them is removed (special tokens never are)."""
    probs = mx.softmax(logprobs, axis=-1)
    least_above = mx.min(mx.where(probs > sampling.xtc_threshold, probs, mx.inf), axis=-1, keepdims=True)
    cut = probs > least_above
    if sampling.xtc_special_tokens:
        keep = mx.zeros((probs.shape[-1],), dtype=mx.bool_)
        keep[mx.array(sampling.xtc_special_tokens)] = True
        cut = cut & ~keep
    apply = mx.random.uniform(key=key) <= sampling.xtc_probability
    return mx.where(apply & cut, -mx.inf, logprobs)


# ---------------------------------------------------------------------------- speculative acceptance


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
    d = len(draft)
    rows = logits
    if request.processors:  # row i's processors read the drafts before it as history
        history = processor_history(request)
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
            s, k = sampling_logits(rows[i], sampling, keys[2 * i])
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
        lp = mx.stack([log_softmax(rows[i]) for i in range(d + 1)])
    return Verification(request, list(draft), accept, alt, lp)


def residual_logits(scaled: mx.array, drafted: mx.array) -> mx.array:
    """Where a rejected draft's replacement is drawn from: row i's distribution without
    draft i, renormalised (``max(0, p - q)`` for a point-mass q); the bonus row (the
    last) keeps every token. ``scaled`` [d + 1, V] logits, ``drafted`` int32 [d]."""
    removed = mx.concatenate([drafted, mx.array([-1], dtype=mx.int32)])[:, None]
    return mx.where(mx.arange(scaled.shape[-1])[None] == removed, -mx.inf, scaled)
