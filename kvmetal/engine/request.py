"""What the engine's parts share about a request: its state, its events, its errors."""
from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx

from .sampler import SamplingParams, TokenLogprobs


class RequestTooLarge(ValueError):
    """A request needs more KV cache than the whole (fixed) pool holds.

    ``requested`` and ``fits`` are token counts, for error messages."""

    def __init__(self, message: str, *, requested: int, fits: int):
        super().__init__(message)
        self.requested = requested
        self.fits = fits


@dataclass
class Request:
    request_id: object
    prompt: list
    max_tokens: int
    output: list = field(default_factory=list)
    cached_prompt_tokens: int = 0  # prompt tokens found through prefix sharing (last admission)
    sampling: SamplingParams | None = None  # None: the engine's sampler
    stop_token_ids: frozenset = frozenset()
    finish_reason: str | None = None  # "stop", "length" or "abort" once finished
    key: mx.array | None = None  # this request's random state (sampling with temperature)
    logprobs: int | None = None  # report logprobs with this many top alternatives (None: none)
    processors: tuple = ()  # mlx-lm logits processors: (tokens, logits [1, V]) -> logits
    history: int | None = None  # trailing tokens the processors read (None: all)
    computed: int = 0  # leading tokens whose K/V are in the cache (while running)
    decoding: bool = False  # prefill done since the last admission: one token per step
    pending: tuple | None = None  # (_Flight, row): its newest token, sampled but not read yet
    input_later: bool = False  # the cache holds a slot for the pending token, its id not given yet
    priority: int = 0  # lower is served first (vLLM's rule), for policies that read it
    arrival: int = 0  # the order the engine received requests in
    speculation: object = None  # speculative.DraftState while the request may draft (None: never)

    @property
    def draft(self) -> list:
        """Tokens drafted for this step's decode row (speculative decoding; [] for none)."""
        return self.speculation.draft if self.speculation is not None else []

    @property
    def plain(self) -> bool:
        """Picked by the engine's batch sampler, nothing else to compute."""
        return self.sampling is None and self.logprobs is None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def tokens(self) -> list:
        """Prompt and output so far: what a preempted request is recomputed from."""
        assert self.pending is None, "a token still in flight has no id yet"
        return self.known_tokens

    @property
    def known_tokens(self) -> list:
        """Prompt and output ids read so far (a token still in flight is not among them)."""
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, a pending one included (read every decode step)."""
        return len(self.prompt) + len(self.output) + (self.pending is not None)


@dataclass(frozen=True)
class Event:
    """One generated token, or (``token`` None) a request that ended without one."""

    request_id: object
    token: int | None
    finished: bool
    finish_reason: str | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them


