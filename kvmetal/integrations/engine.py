"""Continuous batching over one paged cache.

Requests join and leave at any step. Each ``step()``:

1. admits waiting requests while the pool has room: a prompt's leading full blocks
   that another request already computed are shared (prefix hashing), only the rest
   runs through the model (one sequence per prefill pass);
2. decodes every running request in ONE forward pass: one batched ``paged_attention``
   call per layer over all of them;
3. frees a finished request's blocks at once.

When a fixed-size pool runs dry mid-decode, the most recently admitted request is
preempted: its blocks are freed and it waits to be recomputed from its tokens so far
(vLLM's recompute preemption), so the output does not change.
"""
from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx

from ..cache import KVCacheFull
from .mlx_lm import use_paged_cache


@dataclass
class Request:
    request_id: object
    prompt: list
    max_tokens: int
    output: list = field(default_factory=list)
    cached_prompt_tokens: int = 0  # prompt tokens found through prefix sharing (last admission)

    @property
    def finished(self) -> bool:
        return len(self.output) >= self.max_tokens


@dataclass(frozen=True)
class Event:
    """One generated token."""

    request_id: object
    token: int
    finished: bool


def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


class Engine:
    """Continuous-batching greedy (or ``sampler``) generation for an mlx-lm model.

    Args:
        model: an mlx-lm model of a family ``use_paged_cache`` supports.
        block_size, num_blocks, k_bits, v_bits: the paged cache (``num_blocks=None`` grows).
        prefix_sharing: share full prompt blocks between requests with equal prefixes.
        sampler: logits [S, V] -> token ids [S]; greedy by default.
    Use as a context manager, or call ``close()`` to restore the model.
    """

    def __init__(self, model, *, block_size: int = 16, num_blocks: int | None = None, k_bits: int | None = None,
                 v_bits: int | None = None, prefix_sharing: bool = True, sampler=greedy):
        self.model = model
        self.handle = use_paged_cache(model, block_size=block_size, num_blocks=num_blocks, k_bits=k_bits,
                                      v_bits=v_bits)
        self.cache = self.handle.new_model_cache()
        self.prefix_sharing = prefix_sharing
        self.sampler = sampler
        self.waiting: deque = deque()
        self.running: list = []  # in admission order
        self.requests: dict = {}
        self._ids = itertools.count()
        self.decode_steps = 0
        self.preemptions = 0
        self.prompt_tokens_computed = 0

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt, *, max_tokens: int, request_id=None):
        """Queue a prompt (token ids); it joins the batch at the next ``step()``."""
        prompt = [int(t) for t in prompt]
        if not prompt:
            raise ValueError("[Engine.add_request] prompt must hold at least one token")
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ValueError(f"[Engine.add_request] max_tokens must be an int >= 1, got {max_tokens!r}")
        request_id = next(self._ids) if request_id is None else request_id
        if request_id in self.requests:
            raise ValueError(f"[Engine.add_request] request id {request_id!r} is already in use")
        request = Request(request_id, prompt, max_tokens)
        self.requests[request_id] = request
        self.waiting.append(request)
        return request_id

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list:
        """Admit what fits, decode every running request once; returns the new tokens."""
        events = self._admit()
        if self.running:
            events += self._decode()
        return events

    def run(self, prompts, max_tokens) -> list:
        """Generate for every prompt (all join at once); returns each one's tokens."""
        max_tokens = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        ids = [self.add_request(p, max_tokens=m) for p, m in zip(prompts, max_tokens)]
        while self.has_work():
            self.step()
        return [self.requests[i].output for i in ids]

    # ------------------------------------------------------------------ internals

    def _admit(self) -> list:
        events = []
        while self.waiting:
            request = self.waiting[0]
            tokens = request.prompt + request.output  # a preempted request resumes from here
            try:
                if self.prefix_sharing:
                    start = self.cache.add_sequence(request.request_id, tokens)
                else:
                    start = self.cache.add_sequence(request.request_id, num_tokens=len(tokens))
            except KVCacheFull:
                if not self.running:
                    raise KVCacheFull(f"[Engine] request {request.request_id!r} needs more blocks than the "
                                      f"whole pool holds ({len(tokens)} tokens)") from None
                break  # wait for running requests to finish
            self.waiting.popleft()
            request.cached_prompt_tokens = start
            self.prompt_tokens_computed += len(tokens) - start
            caches = self.cache.layer_caches([request.request_id], [start])
            logits = self.model(mx.array(tokens[start:])[None], cache=caches)
            token = int(self.sampler(logits[:, -1, :]).item())
            events.append(self._emit(request, token))
            if not request.finished:
                self.running.append(request)
        return events

    def _decode(self) -> list:
        # Room for one more token per running request; preempt the newest until it fits.
        while True:
            appended = []
            try:
                for request in self.running:
                    self._append(request)
                    appended.append(request)
                break
            except KVCacheFull:
                for request in appended:  # undo this step's appends, then make room
                    self.cache.truncate(request.request_id, self.cache.num_tokens(request.request_id) - 1)
                self._preempt(self.running[-1])
                if not self.running:
                    return []
        ids = [r.request_id for r in self.running]
        offsets = [len(r.prompt) + len(r.output) - 1 for r in self.running]
        inputs = mx.array([[r.output[-1]] for r in self.running])
        logits = self.model(inputs, cache=self.cache.layer_caches(ids, offsets))
        tokens = self.sampler(logits[:, -1, :]).tolist()
        self.decode_steps += 1
        events = [self._emit(r, int(t)) for r, t in zip(self.running, tokens)]
        self.running = [r for r in self.running if not r.finished]
        return events

    def _append(self, request: Request) -> None:
        token = request.output[-1]
        if self.prefix_sharing:
            self.cache.append(request.request_id, [token])
        else:
            self.cache.append(request.request_id, num_tokens=1)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.cache.free(request.request_id)
        self.waiting.appendleft(request)
        self.preemptions += 1

    def _emit(self, request: Request, token: int) -> Event:
        request.output.append(token)
        if request.finished:
            self.cache.free(request.request_id)  # blocks go back right away
        return Event(request.request_id, token, request.finished)

    @property
    def peak_nbytes(self) -> int:
        """Peak bytes of the pools (they only grow), i.e. what kvmetal held."""
        return self.cache.nbytes

    @property
    def peak_used_bytes(self) -> int:
        """Peak bytes of blocks owned by live requests (what a right-sized pool needs)."""
        return self.cache.peak_used_bytes

    def close(self) -> None:
        self.handle.undo()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False
