"""mlx-lm's sampling rule computed exactly, a deliberately peaked model, and a
goodness-of-fit check of seeded draws against the exact distribution.

mlx-lm (``mlx_lm.sample_utils.make_sampler``) filters the *untempered* log-probabilities
(top-p, then min-p, then top-k; each sets removed tokens to -inf), then draws from
``softmax(logprobs / temperature)`` over what is left:

- top-p keeps a token when the probability mass of the tokens more likely than it is
  below ``top_p`` (so the most likely token always stays);
- min-p keeps a token when ``p >= min_p * max(p)``;
- top-k keeps the ``top_k`` most likely tokens.

Each filter keeps a prefix of the tokens sorted by probability and judges it by the
untempered probabilities, so together they keep the shortest of the three prefixes.

The model: a tiny random llama whose ``lm_head`` is replaced by a rank-one matrix that
maps the prompt's last hidden state onto chosen logits: eight candidate tokens share
almost all the mass (0.42 down to 0.005) and the rest of the vocabulary sits 40 nats
lower. A few hundred draws then resolve the distribution.
"""
from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

# Candidate logits, most likely first (probabilities about .42 .26 .15 .085 .047 .021 .010 .005);
# the tail is TAIL below the top one.
CANDIDATE_LOGITS = (4.0, 3.5, 3.0, 2.4, 1.8, 1.0, 0.3, -0.5)
TAIL = -40.0
DRAWS = 300
# Chi-square test level: with fixed seeds the test is deterministic; at 1e-4 a correct
# sampler fails for one seed set in 10,000.
ALPHA = 1e-4


def target_logits(vocab_size: int, candidates) -> np.ndarray:
    logits = np.full(vocab_size, TAIL, dtype=np.float64)
    logits[list(candidates)] = CANDIDATE_LOGITS
    return logits


def peak_lm_head(model, prompt, logits: np.ndarray) -> None:
    """Replace ``model.lm_head`` (a llama from mlx-lm) by the rank-one map h -> logits for
    the last hidden state h of ``prompt``; other hidden states get logits along the same
    direction, which is all the test needs (it only samples the first token)."""
    hidden = model.model(mx.array(prompt)[None])[0, -1].astype(mx.float32)
    h = np.array(hidden, dtype=np.float64)
    weight = np.outer(logits, h) / float(h @ h)
    model.lm_head.weight = mx.array(weight.astype(np.float32)).astype(model.lm_head.weight.dtype)
    mx.eval(model.parameters())


def first_token_logits(model, prompt) -> np.ndarray:
    """The model's own next-token logits after ``prompt`` (mlx-lm's forward, its own cache), float64."""
    return np.array(model(mx.array(prompt)[None])[0, -1].astype(mx.float32), dtype=np.float64)


def mlx_lm_distribution(logits, *, temperature: float, top_p: float = 1.0, top_k: int = 0,
                        min_p: float = 0.0, margin: float = 0.01) -> np.ndarray:
    """The exact probability of each token under mlx-lm's rule (see the module docstring).

    Refuses (AssertionError) a configuration where a filter decision sits within
    ``margin`` (relative) of its threshold: there float32 rounding, not the rule, would
    decide, and the test would check nothing useful."""
    logits = np.asarray(logits, np.float64)
    logp = logits - np.logaddexp.reduce(logits)
    p = np.exp(logp)
    order = np.argsort(-p, kind="stable")
    sorted_p = p[order]
    above = np.concatenate([[0.0], np.cumsum(sorted_p)[:-1]])  # mass of the more likely tokens
    keep = np.ones(p.size, bool)
    if 0 < top_p < 1:
        keep &= above < top_p
        near = np.abs(above - top_p) < margin * top_p
        assert not near[1:].any(), f"top_p={top_p} is too close to a cumulative mass {above[near]}"
    if min_p > 0:
        floor = min_p * sorted_p[0]
        keep &= sorted_p >= floor
        near = np.abs(sorted_p - floor) < margin * floor
        assert not near.any(), f"min_p={min_p} is too close to a probability {sorted_p[near]}"
    if 0 < top_k < p.size:
        keep &= np.arange(p.size) < top_k
    tempered = np.where(keep, logp[order] / temperature, -np.inf)
    q_sorted = np.exp(tempered - tempered.max())
    q_sorted /= q_sorted.sum()
    q = np.zeros_like(q_sorted)
    q[order] = q_sorted
    return q


def check_mlx_lm_filters_agree(logits, *, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0) -> None:
    """The oracle's kept set is the one mlx-lm's own filter functions keep on these logits
    (ties the hand-written rule to the installed mlx-lm)."""
    from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

    logits = np.asarray(logits, np.float64)
    logprobs = mx.array((logits - np.logaddexp.reduce(logits)).astype(np.float32))[None]
    if 0 < top_p < 1:
        logprobs = apply_top_p(logprobs, top_p)
    if min_p > 0:
        logprobs = apply_min_p(logprobs, min_p)
    if 0 < top_k < logits.size:
        logprobs = apply_top_k(logprobs, top_k)
    theirs = np.isfinite(np.array(logprobs[0]))
    ours = mlx_lm_distribution(logits, temperature=1.0, top_p=top_p, top_k=top_k, min_p=min_p) > 0
    np.testing.assert_array_equal(ours, theirs)


def chi_square_quantile(dof: int, alpha: float) -> float:
    """Upper ``alpha`` quantile of chi-square(dof), Wilson-Hilferty (good to ~1% here)."""
    z = _normal_upper_quantile(alpha)
    k = float(dof)
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def _normal_upper_quantile(alpha: float) -> float:
    lo, hi = 0.0, 10.0
    for _ in range(100):  # bisection on the normal tail 0.5 * erfc(z / sqrt 2)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if 0.5 * math.erfc(mid / math.sqrt(2)) > alpha else (lo, mid)
    return lo


def assert_matches_distribution(draws, expected: np.ndarray, *, alpha: float = ALPHA) -> None:
    """Seeded draws (token ids) vs the exact distribution: no token the rule removes ever
    appears, and a chi-square test (bins with an expected count under 5 pooled) passes."""
    draws = np.asarray(draws, np.int64)
    n = draws.size
    impossible = sorted({int(t) for t in draws if expected[t] == 0})
    assert not impossible, f"drew tokens the sampling rule removes: {impossible}"
    counts = np.bincount(draws, minlength=expected.size).astype(np.float64)
    support = np.flatnonzero(expected > 0)
    if support.size == 1:
        assert counts[support[0]] == n, "a one-token distribution must always draw that token"
        return
    want = expected[support] * n
    got = counts[support]
    order = np.argsort(-want)
    want, got = want[order], got[order]
    big = want >= 5
    bins_want = list(want[big]) + ([want[~big].sum()] if (~big).any() else [])
    bins_got = list(got[big]) + ([got[~big].sum()] if (~big).any() else [])
    bins_want, bins_got = np.array(bins_want), np.array(bins_got)
    if bins_want.size < 2:  # everything pooled into one bin: compare its count alone
        return
    stat = float(((bins_got - bins_want) ** 2 / bins_want).sum())
    limit = chi_square_quantile(bins_want.size - 1, alpha)
    assert stat <= limit, (f"chi-square {stat:.1f} > {limit:.1f} ({bins_want.size} bins, {n} draws): "
                           f"observed {bins_got.astype(int).tolist()} vs expected {np.round(bins_want, 1).tolist()}")


# (name, SamplingParams keywords) the statistical tests run; every filter alone and together.
CONFIGS = [
    ("t1", dict(temperature=1.0)),
    ("t0.5", dict(temperature=0.5)),
    ("t2", dict(temperature=2.0)),
    ("top_p", dict(temperature=1.0, top_p=0.75)),
    ("top_k", dict(temperature=1.0, top_k=3)),
    ("min_p", dict(temperature=1.0, min_p=0.08)),
    ("t1.5+top_p+top_k", dict(temperature=1.5, top_p=0.95, top_k=4)),
    ("t0.7+top_p+min_p", dict(temperature=0.7, top_p=0.9, min_p=0.03)),
    ("t2+min_p+top_k", dict(temperature=2.0, min_p=0.15, top_k=6)),
]
# Argmax limits: every draw is the most likely token.
ARGMAX_CONFIGS = [
    ("t->0", dict(temperature=1e-3)),
    ("tiny top_p", dict(temperature=1.0, top_p=1e-6)),
    ("top_k=1", dict(temperature=3.0, top_k=1)),
]
