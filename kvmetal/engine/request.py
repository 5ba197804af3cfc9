"""What the engine's parts share about a request: its state, its events, its errors, and
the checks of ``Engine.add_request``'s arguments (``check_request``)."""
from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..cache import _is_int
from .sampler import SamplingParams, TokenLogprobs

OP = "Engine.add_request"


class ArgumentTypeError(TypeError, ValueError):
    """An argument of the wrong type: a TypeError, and still a ValueError, which is what
    these checks raised for a wrong type before (callers that caught that keep working)."""


def check_int(op: str, name: str, value, minimum: int = 1, *, what: str | None = None) -> int:
    """``value`` as an int >= ``minimum`` (NumPy integers too, never a bool):
    ``ArgumentTypeError`` for another type, ValueError below ``minimum``; both messages
    name ``name`` (``what``: what it must be, if not "an int >= minimum")."""
    message = f"[{op}] {name} must be {what or f'an int >= {minimum}'}, got {value!r}"
    if not _is_int(value):
        raise ArgumentTypeError(message)
    if value < minimum:
        raise ValueError(message)
    return int(value)


def check_request(prompt, *, max_tokens, sampling, logprobs, priority, speculative, vocab: int | None) -> tuple:
    """The checks of ``Engine.add_request``'s own arguments (those the engine's state does
    not decide); returns (prompt as a list of ints, max_tokens, logprobs, priority) as ints.
    A wrong type raises a TypeError (``ArgumentTypeError``), a wrong value a ValueError,
    each naming the argument. ``vocab``: the model's vocabulary size (None: unknown)."""
    if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
        raise TypeError(f"[{OP}] prompt must be a sequence of token ids (tokenize text first), "
                        f"got {type(prompt).__name__}")
    if isinstance(prompt, (mx.array, np.ndarray)):  # a 1-D array of ids, as mlx-lm passes prompts
        if prompt.ndim != 1:
            raise ValueError(f"[{OP}] prompt must be 1-D token ids, got shape {tuple(prompt.shape)}")
        prompt = np.array(prompt).tolist()
    prompt = list(prompt)
    if not prompt:
        raise ValueError(f"[{OP}] prompt must hold at least one token")
    bound = f" and < {vocab} (the vocabulary)" if vocab is not None else ""
    for t in prompt:
        check_int(OP, "prompt token ids", t, 0, what=f"ints >= 0{bound}")
        if vocab is not None and t >= vocab:
            raise ValueError(f"[{OP}] prompt token ids must be ints >= 0{bound}, got {t!r}")
    max_tokens = check_int(OP, "max_tokens", max_tokens)
    if sampling is not None and not isinstance(sampling, SamplingParams):
        raise TypeError(f"[{OP}] sampling must be a SamplingParams or None, got {sampling!r}")
    if logprobs is not None:
        logprobs = check_int(OP, "logprobs", logprobs, 0, what="an int >= 0 or None")
    if sampling is not None and vocab is not None:
        for name, ids in (("logit_bias", [t for t, _ in sampling.logit_bias]),
                          ("xtc_special_tokens", sampling.xtc_special_tokens)):
            if any(t >= vocab for t in ids):
                raise ValueError(f"[{OP}] {name} token ids must be < {vocab} (the vocabulary), got {max(ids)}")
    if not _is_int(priority):
        raise ArgumentTypeError(f"[{OP}] priority must be an int, got {priority!r}")
    if not isinstance(speculative, bool):
        raise ArgumentTypeError(f"[{OP}] speculative must be a bool, got {speculative!r}")
    return [int(t) for t in prompt], max_tokens, logprobs, int(priority)


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
    states: list | None = None  # its own recurrent-state caches (models that keep them), while it runs

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


