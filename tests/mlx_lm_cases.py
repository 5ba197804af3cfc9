"""mlx-lm's BatchGenerator run to the end over a model's caches, shared by the batching tests
and the all-architectures sweep."""
from __future__ import annotations

import mlx.core as mx
from mlx_lm.generate import BatchGenerator

GREEDY = lambda lp: mx.argmax(lp, axis=-1)  # noqa: E731


def prompts():
    return [list(range(3, 3 + n)) for n in (5, 37, 12, 20, 1, 29)]


def batch_generate(model, max_tokens):
    gen = BatchGenerator(model, sampler=GREEDY, prefill_batch_size=3, completion_batch_size=4)
    uids = gen.insert(prompts(), max_tokens=max_tokens)
    out = {u: [] for u in uids}
    caches = {}
    while len(caches) < len(uids):
        for r in gen.next_generated():
            out[r.uid].append(r.token)
            if r.finish_reason is not None:
                caches[r.uid] = r.prompt_cache
    gen.close()
    return [out[u] for u in uids], [caches[u] for u in uids]


def mlx_lm_greedy(model, prompt, max_tokens):
    """mlx-lm's own greedy tokens for one prompt alone (its own caches, no kvmetal)."""
    from mlx_lm.generate import generate_step

    return [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens, sampler=GREEDY)]


class TinyGreedy:
    """One tiny architecture (arch_sweep), built on first use, and mlx-lm's greedy tokens per
    prompt, each computed once: what a module of Engine-against-mlx-lm tests compares to."""

    def __init__(self, name: str, steps: int):
        self.name, self.steps = name, steps
        self._model = None
        self._expected: dict = {}

    def model(self):
        if self._model is None:
            from kvmetal.integrations import arch_sweep

            self._model = arch_sweep.build(self.name)
        return self._model

    def expected(self, prompt, steps=None):
        steps = self.steps if steps is None else steps
        key = (tuple(prompt), steps)
        if key not in self._expected:
            self._expected[key] = mlx_lm_greedy(self.model(), prompt, steps)
        return self._expected[key]
