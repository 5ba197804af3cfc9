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
(vLLM's recompute preemption), so the output does not change. A request that could
not grow even with the whole pool to itself finishes early with reason ``"length"``
(the cache is full) while the others keep running; a prompt that cannot fit even in
an empty pool is rejected by ``add_request``.

Sampling is per request (``SamplingParams``): greedy, or temperature / top-p / top-k /
min-p / XTC with the request's own random key, so a seeded request gives the same tokens
whatever it is batched with and however often it is preempted. A request's logits
processors (mlx-lm's repetition / presence / frequency penalties and logit bias) run on
its own row of the batch's logits, over its own tokens; ``logprobs`` reports the chosen
token's log-probability (and the top alternatives) under those processed logits.
"""
from __future__ import annotations

import itertools
import math
import random
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..cache import KVCacheFull, _is_int
from .mlx_lm import use_paged_cache


class RequestTooLarge(ValueError):
    """A request needs more KV cache than the whole (fixed) pool holds.

    ``requested`` and ``fits`` are token counts, for error messages."""

    def __init__(self, message: str, *, requested: int, fits: int):
        super().__init__(message)
        self.requested = requested
        self.fits = fits


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
            if value is None and name == "seed":
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
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        """``len(self.tokens)`` without building the list (read every decode step)."""
        return len(self.prompt) + len(self.output)


@dataclass(frozen=True)
class Event:
    """One generated token, or (``token`` None) a request that ended without one."""

    request_id: object
    token: int | None
    finished: bool
    finish_reason: str | None = None
    logprobs: TokenLogprobs | None = None  # when the request asked for them


def greedy(logits: mx.array) -> mx.array:
    return mx.argmax(logits, axis=-1)


def _check_count(op: str, name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"[{op}] {name} must be an int >= 1, got {value!r}")
    return value


class Engine:
    """Continuous-batching generation for an mlx-lm model.

    Args:
        model: an mlx-lm model of a family ``use_paged_cache`` supports.
        block_size, num_blocks, k_bits, v_bits: the paged cache (``num_blocks=None`` grows).
        k_group_size, v_group_size: quantization group sizes, passed to ``use_paged_cache``
            when given (None: its default).
        prefix_sharing: share full prompt blocks between requests with equal prefixes.
        sampler: logits [S, V] -> token ids [S] for requests without ``sampling``; greedy by default.
        keep_finished: keep finished requests in ``requests`` (a server turns this off).
        on_finish: called with a request that finished normally, before its blocks are
            freed (a prefix store reads them there).
        max_prefill_tokens: prompt tokens one step may compute before it decodes (at least
            one prompt is always admitted); bounds the pause running requests see when
            many prompts arrive at once. None: admit everything that fits.
    Use as a context manager, or call ``close()`` to restore the model; a closed
    engine raises ``RuntimeError``.
    """

    def __init__(self, model, *, block_size: int = 16, num_blocks: int | None = None, k_bits: int | None = None,
                 v_bits: int | None = None, prefix_sharing: bool = True, sampler=greedy,
                 keep_finished: bool = True, on_finish=None, max_prefill_tokens: int | None = None,
                 k_group_size: int | None = None, v_group_size: int | None = None):
        self.model = model
        if max_prefill_tokens is not None:  # checked before the model is patched: a bad value leaks nothing
            _check_count("Engine", "max_prefill_tokens", max_prefill_tokens)
        groups = {k: v for k, v in (("k_group_size", k_group_size), ("v_group_size", v_group_size)) if v is not None}
        self.handle = use_paged_cache(model, block_size=block_size, num_blocks=num_blocks, k_bits=k_bits,
                                      v_bits=v_bits, **groups)
        try:
            self.cache = self.handle.new_model_cache()
        except BaseException:
            self.handle.undo()
            raise
        self.block_size = block_size
        self.prefix_sharing = prefix_sharing
        self.sampler = sampler
        self.keep_finished = keep_finished
        self.on_finish = on_finish
        self.max_prefill_tokens = max_prefill_tokens
        # Across ranks (``kvmetal serve`` under mlx.launch): maps this rank's sampled tokens to
        # rank 0's, so that every rank appends the same tokens and stays in lockstep.
        self.token_sync = None
        self.waiting: deque = deque()
        self.running: list = []  # in admission order
        self.requests: dict = {}
        self._ids = itertools.count()
        self.closed = False
        self.decode_steps = 0
        self.preemptions = 0
        self.prompt_tokens_computed = 0
        self.prompt_tokens_cached = 0  # tokens admissions found through prefix sharing
        self.generated_tokens = 0

    # ------------------------------------------------------------------ capacity

    @property
    def max_prompt_tokens(self) -> int | None:
        """Most prompt tokens one request can bring with the whole pool to itself (None: the
        pool grows). A prompt is written whole into every layer group, window groups too."""
        if self.cache.growable:
            return None
        return min(p.allocator.num_blocks for p in self.cache.pools) * self.block_size

    @property
    def max_sequence_tokens(self) -> int | None:
        """Most tokens (prompt and output) one request can reach alone (None: no bound).
        Only full-attention groups bound it: window groups release blocks as decode moves."""
        full = [p for p, w in zip(self.cache.pools, self.cache.windows) if w is None]
        if self.cache.growable or not full:
            return None
        return min(p.allocator.num_blocks for p in full) * self.block_size

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt, *, max_tokens: int, request_id=None, sampling: SamplingParams | None = None,
                    stop_token_ids=(), logprobs: int | None = None):
        """Queue a prompt (token ids); it joins the batch at the next ``step()``.

        ``logprobs``: every event of this request carries ``TokenLogprobs`` with this
        many top alternatives (0: only the chosen token's); None: none.
        Raises ``RequestTooLarge`` (a ValueError) when the prompt cannot fit even in an
        empty pool; a request that outgrows the pool later finishes with "length"."""
        self._check_open("add_request")
        if isinstance(prompt, (str, bytes)) or not hasattr(prompt, "__iter__"):
            raise TypeError(f"[Engine.add_request] prompt must be a sequence of token ids (tokenize text "
                            f"first), got {type(prompt).__name__}")
        if isinstance(prompt, (mx.array, np.ndarray)):  # a 1-D array of ids, as mlx-lm passes prompts
            if prompt.ndim != 1:
                raise ValueError(f"[Engine.add_request] prompt must be 1-D token ids, got shape {tuple(prompt.shape)}")
            prompt = np.array(prompt).tolist()
        prompt = list(prompt)
        if not prompt:
            raise ValueError("[Engine.add_request] prompt must hold at least one token")
        vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
        for t in prompt:
            if not _is_int(t) or t < 0 or (vocab is not None and t >= vocab):
                bound = f" and < {vocab} (the vocabulary)" if vocab is not None else ""
                raise ValueError(f"[Engine.add_request] prompt token ids must be ints >= 0{bound}, got {t!r}")
        prompt = [int(t) for t in prompt]
        _check_count("Engine.add_request", "max_tokens", max_tokens)
        if sampling is not None and not isinstance(sampling, SamplingParams):
            raise TypeError(f"[Engine.add_request] sampling must be a SamplingParams or None, got {sampling!r}")
        if logprobs is not None and (isinstance(logprobs, bool) or not isinstance(logprobs, int) or logprobs < 0):
            raise ValueError(f"[Engine.add_request] logprobs must be an int >= 0 or None, got {logprobs!r}")
        if sampling is not None and vocab is not None:
            for name, ids in (("logit_bias", [t for t, _ in sampling.logit_bias]),
                              ("xtc_special_tokens", sampling.xtc_special_tokens)):
                if any(t >= vocab for t in ids):
                    raise ValueError(f"[Engine.add_request] {name} token ids must be < {vocab} (the vocabulary), "
                                     f"got {max(ids)}")
        limit = self.max_prompt_tokens
        if limit is not None and len(prompt) > limit:
            raise RequestTooLarge(
                f"[Engine.add_request] a prompt of {len(prompt)} tokens needs "
                f"{-(-len(prompt) // self.block_size)} blocks of {self.block_size}, but the whole pool holds "
                f"{limit // self.block_size} blocks ({limit} tokens)", requested=len(prompt), fits=limit)
        if request_id is None:
            request_id = next(self._ids)
            while request_id in self.requests:  # skip ids a caller chose
                request_id = next(self._ids)
        elif request_id in self.requests:
            raise ValueError(f"[Engine.add_request] request id {request_id!r} is already in use")
        request = Request(request_id, prompt, max_tokens, sampling=sampling,
                          stop_token_ids=frozenset(int(t) for t in stop_token_ids), logprobs=logprobs)
        if sampling is not None:
            processors, request.history = sampling.logits_processors()
            request.processors = tuple(processors)
        if sampling is not None and not sampling.greedy:
            seed = random.getrandbits(63) if sampling.seed is None else sampling.seed
            request.key = mx.random.key(seed)
        self.requests[request_id] = request
        self.waiting.append(request)
        return request_id

    def abort(self, request_id) -> bool:
        """Drop a waiting or running request and free its blocks; False if it is not live."""
        self._check_open("abort")
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        if request in self.running:
            self.running.remove(request)
            self.cache.free(request_id)
        else:
            self.waiting.remove(request)
        self._finish(request, "abort")
        return True

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ stepping

    def step(self) -> list:
        """Admit what fits, decode every running request once; returns the new tokens."""
        self._check_open("step")
        events = self._admit()
        if self.running:
            events += self._decode()
        return events

    def run(self, prompts, max_tokens) -> list:
        """Generate for every prompt (all join at once); returns each one's tokens."""
        max_tokens = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
        ids = [self.add_request(p, max_tokens=m) for p, m in zip(prompts, max_tokens)]
        outputs = {}
        while self.has_work():
            for event in self.step():
                if event.token is not None:
                    outputs.setdefault(event.request_id, []).append(event.token)
        return [outputs.get(i, []) for i in ids]

    # ------------------------------------------------------------------ internals

    def _check_open(self, op: str) -> None:
        if self.closed:
            raise RuntimeError(f"[Engine.{op}] the engine was closed; create a new Engine")

    def _admit(self) -> list:
        events = []
        budget = self.max_prefill_tokens
        computed = 0
        while self.waiting:
            request = self.waiting[0]
            tokens = request.tokens  # a preempted request resumes from here
            if budget is not None and computed and computed + len(tokens) > budget:
                break  # decode first; the rest joins at the next steps
            try:
                if self.prefix_sharing:
                    start = self.cache.add_sequence(request.request_id, tokens)
                else:
                    start = self.cache.add_sequence(request.request_id, num_tokens=len(tokens))
            except KVCacheFull:
                if self.running:
                    break  # wait for running requests to finish
                # Alone in the pool and still too big: only a resumed request that grew gets here.
                self.waiting.popleft()
                events.append(self._finish(request, "length"))
                continue
            self.waiting.popleft()
            request.cached_prompt_tokens = start
            self.prompt_tokens_cached += start
            self.prompt_tokens_computed += len(tokens) - start
            computed += len(tokens) - start
            caches = self.cache.layer_caches([request.request_id], [start])
            logits = self.model(mx.array(tokens[start:])[None], cache=caches)
            [token], [logprobs] = self._sample([request], logits[:, -1, :])
            events.append(self._emit(request, token, logprobs))
            if not request.finished:
                self.running.append(request)
        return events

    def _decode(self) -> list:
        # Room for one more token per running request. One that could not grow even with
        # the pool to itself ends ("length"); otherwise preempt the newest until all fit.
        events = []
        limit = self.max_sequence_tokens  # fixed within a step
        while True:
            appended = []
            try:
                for request in self.running:
                    if limit is not None and request.num_tokens > limit:
                        raise _Outgrown(request)
                    self._append(request)
                    appended.append(request)
                break
            except (KVCacheFull, _Outgrown) as e:
                for request in appended:  # undo this step's appends, then make room
                    self.cache.truncate(request.request_id, self.cache.num_tokens(request.request_id) - 1)
                if isinstance(e, _Outgrown):
                    self.running.remove(e.request)
                    self.cache.free(e.request.request_id)
                    events.append(self._finish(e.request, "length"))
                elif len(self.running) == 1:  # alone and still no room: the pool cannot hold it
                    request = self.running.pop()
                    self.cache.free(request.request_id)
                    events.append(self._finish(request, "length"))
                else:
                    self._preempt(self.running[-1])
                if not self.running:
                    return events
        ids = [r.request_id for r in self.running]
        offsets = [r.num_tokens - 1 for r in self.running]
        inputs = mx.array([[r.output[-1]] for r in self.running])
        logits = self.model(inputs, cache=self.cache.layer_caches(ids, offsets))
        tokens, logprobs = self._sample(self.running, logits[:, -1, :])
        self.decode_steps += 1
        events += [self._emit(r, t, lp) for r, t, lp in zip(self.running, tokens, logprobs)]
        self.running = [r for r in self.running if not r.finished]
        return events

    def _sample(self, requests: list, logits: mx.array) -> tuple:
        """One token per row of ``logits`` [S, V], each by its request's sampling, and
        each request's ``TokenLogprobs`` (None where it asked for none)."""
        tokens, rows = self._pick(requests, logits)
        if self.token_sync is not None:
            tokens = self.token_sync(tokens)  # logprobs then describe rank 0's tokens
        return tokens, _token_logprobs(requests, rows, tokens)

    def _pick(self, requests: list, logits: mx.array) -> tuple:
        """(token ids, {row: log-softmax of the processed row} for requests wanting logprobs)."""
        if all(r.plain for r in requests):
            return [int(t) for t in self.sampler(logits).tolist()], {}
        picks, rows = [], {}
        argmax = None
        for i, r in enumerate(requests):
            row = logits[i:i + 1]
            if r.processors:  # this request's own penalties, on its own row
                history = mx.array(r.tokens if r.history is None else r.tokens[-r.history:])
                for processor in r.processors:
                    row = processor(history, row)
            if r.sampling is None:
                picks.append(self.sampler(row)[0])
            elif r.sampling.greedy and not r.processors:
                argmax = mx.argmax(logits, axis=-1) if argmax is None else argmax
                picks.append(argmax[i])
            elif r.sampling.greedy:
                picks.append(mx.argmax(row[0]))
            else:
                r.key, key = mx.random.split(r.key)
                picks.append(_sample_row(row[0], r.sampling, key))
            if r.logprobs is not None:
                rows[i] = _log_softmax(row[0])
        picks = mx.stack(picks)
        mx.eval(picks, *rows.values())
        return [int(t) for t in picks.tolist()], rows

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

    def _emit(self, request: Request, token: int, logprobs: TokenLogprobs | None = None) -> Event:
        request.output.append(token)
        self.generated_tokens += 1
        reason = None
        if token in request.stop_token_ids:
            reason = "stop"
        elif len(request.output) >= request.max_tokens:
            reason = "length"
        if reason is None:
            return Event(request.request_id, token, False, logprobs=logprobs)
        if self.on_finish is not None:
            self.on_finish(request)
        self.cache.free(request.request_id)  # blocks go back right away
        return self._finish(request, reason, token, logprobs)

    def _finish(self, request: Request, reason: str, token: int | None = None,
                logprobs: TokenLogprobs | None = None) -> Event:
        request.finish_reason = reason
        if not self.keep_finished:
            self.requests.pop(request.request_id, None)
        return Event(request.request_id, token, True, reason, logprobs)

    @property
    def peak_nbytes(self) -> int:
        """Peak bytes of the pools (they only grow), i.e. what kvmetal held."""
        return self.cache.nbytes

    @property
    def peak_used_bytes(self) -> int:
        """Peak bytes of blocks owned by live requests (what a right-sized pool needs)."""
        return self.cache.peak_used_bytes

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.handle.undo()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


class _Outgrown(Exception):
    def __init__(self, request: Request):
        self.request = request


def _log_softmax(row: mx.array) -> mx.array:
    row = row.astype(mx.float32)  # reported numbers: no float16 rounding
    return row - mx.logsumexp(row, axis=-1, keepdims=True)


def _token_logprobs(requests: list, rows: dict, tokens: list) -> list:
    """Each request's ``TokenLogprobs`` for its chosen token (rows are evaluated)."""
    out = [None] * len(requests)
    if not rows:
        return out
    wanted = {}
    for i, row in rows.items():
        n = min(requests[i].logprobs, row.shape[-1])
        top = mx.argpartition(-row, kth=n - 1)[:n] if n else mx.array([], dtype=mx.uint32)
        wanted[i] = (row[tokens[i]], top, row[top])
    mx.eval(wanted)
    for i, (chosen, top, values) in wanted.items():
        pairs = sorted(zip(top.tolist(), values.tolist()), key=lambda p: (-p[1], p[0]))
        out[i] = TokenLogprobs(float(chosen.item()), tuple((int(t), float(v)) for t, v in pairs))
    return out


def _sample_row(logits: mx.array, sampling: SamplingParams, key: mx.array) -> mx.array:
    """Sample one token from ``logits`` [V] with mlx-lm's filters (in mlx-lm's order) and an
    explicit key."""
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
    return mx.random.categorical(logprobs * (1 / sampling.temperature), key=key)[0]


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
