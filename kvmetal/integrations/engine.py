"""Continuous batching over one paged cache, one forward pass per step.

Requests join and leave at any step. Each ``step()`` builds ONE ragged batch under a
token budget (``max_num_batched_tokens``) and runs it through the model once:

1. every running decode (one token each) comes first;
2. then the next chunk of each partly prefilled prompt (oldest first);
3. then new prompts' first chunks, while the budget lasts. A prompt's leading full
   blocks that another request already computed are shared (prefix hashing); a chunk
   that completes a block publishes it at once, and a prompt whose next block another
   request is still prefilling waits for it instead of computing it a second time.

The batch is packed as ``[T, 1]`` token rows (T = tokens of the step) with each row's
position as the cache's ``offset``, so unmodified mlx-lm model code runs it; per layer,
the decode rows run ``paged_attention`` and the prompt rows ``paged_attention_varlen``.
Hidden states are sliced before the LM head: logits come only for rows that sample
(decodes, and the last token of a prompt whose prefill completes). A long prompt
therefore never stalls the running requests: they get a token every step while it is
chunked in. A finished request's blocks are freed at once.

When a fixed-size pool runs dry, the most recently admitted request (decoding or still
prefilling) is preempted: its blocks are freed and it waits to be recomputed from its
tokens so far (vLLM's recompute preemption), resuming from whatever of its blocks are
still published, so the output does not change. A request that could not grow even
with the whole pool to itself finishes early with reason ``"length"`` (the cache is
full) while the others keep running; a prompt that cannot fit even in an empty pool is
rejected by ``add_request``.

Batch invariance: a request gets the same tokens alone and in any batch, however its
prompt is chunked. Each token's attention runs the same kernel whatever shares its pass
(decode rows the decode kernel, prompt rows the varlen one) and both cut a sequence's keys
into split windows at fixed positions, chosen per sequence, never per batch; sampling is
per request (``SamplingParams``): greedy, or temperature / top-p / top-k / min-p / XTC
with the request's own random key. What is not kvmetal's can still differ: MLX's matmuls
where their result depends on the batch's row count (docs/serve.md, "Batch invariance"),
the ``cascade`` option, and a preempted request, whose generated tokens are recomputed
as a prompt (by the varlen kernel). A request's logits processors (mlx-lm's repetition /
presence / frequency penalties and logit bias) run on its own row of the batch's logits,
over its own tokens; ``logprobs`` reports the chosen token's log-probability (and the top
alternatives) under those processed logits.
"""
from __future__ import annotations

import itertools
import math
import random
import time
from collections import deque
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from ..cache import KVCacheFull, _is_int
from .heads import body, lm_head
from .mlx_lm import use_paged_cache

DEFAULT_MAX_NUM_BATCHED_TOKENS = 256  # tokens one step computes (decodes included); measured: docs/integration.md


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
    computed: int = 0  # leading tokens whose K/V are in the cache (while running)
    decoding: bool = False  # prefill done since the last admission: one token per step
    pending: tuple | None = None  # (_Flight, row): its newest token, sampled but not read yet
    input_later: bool = False  # the cache holds a slot for the pending token, its id not given yet

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
        max_num_batched_tokens: tokens one step's forward pass computes: the running
            decodes (one each, always all of them) and, in what is left, prefill chunks.
            Bounds the time of a step, so running requests see no stall beyond it while
            long prompts arrive.
        async_steps: pipeline the steps: ``step()`` schedules and launches its forward pass
            (``mx.async_eval``), feeding decodes the previous pass's sampled tokens on the
            device, and only then reads the previous pass's tokens and returns them. The
            host's scheduling, table building and event handling overlap the device's
            compute; each step's events are the previous pass's (the first step returns
            none), and a request that stops is computed one token past its end (dropped).
            Off (default): ``step()`` returns the tokens of its own pass. Across ranks
            (``token_sync``) steps are never pipelined.
        cascade: decode passes read a prefix that 8 or more running requests share once
            (``paged_attention_cascade``, docs/cascade.md). Off by default: its reduction
            order depends on which requests share the prefix, so with it a request's tokens
            can change with what it is batched with. Without it they cannot: each token's
            attention takes the same kernel and the same KV split windows in any batch
            (decode rows ``paged_attention``, prompt rows ``paged_attention_varlen``).
        tokenizer: an mlx-lm tokenizer (``mlx_lm.load``'s second value): its EOS tokens end
            every request that gives no ``stop_token_ids``. Without one, the model's own
            ``eos_token_id`` (when its args carry one), else none.
    Use as a context manager, or call ``close()`` to restore the model; a closed
    engine raises ``RuntimeError``.
    """

    def __init__(self, model, *, block_size: int = 16, num_blocks: int | None = None, k_bits: int | None = None,
                 v_bits: int | None = None, prefix_sharing: bool = True, sampler=greedy,
                 keep_finished: bool = True, on_finish=None,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 k_group_size: int | None = None, v_group_size: int | None = None, async_steps: bool = False,
                 cascade: bool = False, tokenizer=None):
        self.model = model
        self.eos_token_ids = _eos_ids(model, tokenizer)  # a request's stop tokens unless it gives its own
        # checked before the model is patched: a bad value leaks nothing
        _check_count("Engine", "max_num_batched_tokens", max_num_batched_tokens)
        self._body, self._head = body(model), lm_head(model)
        groups = {k: v for k, v in (("k_group_size", k_group_size), ("v_group_size", v_group_size)) if v is not None}
        self.handle = use_paged_cache(model, block_size=block_size, num_blocks=num_blocks, k_bits=k_bits,
                                      v_bits=v_bits, **groups)
        try:
            self.cache = self.handle.new_model_cache(cascade=bool(cascade))
        except BaseException:
            self.handle.undo()
            raise
        self.block_size = block_size
        self.prefix_sharing = prefix_sharing
        self.sampler = sampler
        self.keep_finished = keep_finished
        self.on_finish = on_finish
        self.max_num_batched_tokens = max_num_batched_tokens
        self.async_steps = bool(async_steps)
        self._flight = None  # the launched pass whose tokens were not read yet (async steps)
        # Across ranks (``kvmetal serve`` under mlx.launch): maps this rank's sampled tokens to
        # rank 0's, so that every rank appends the same tokens and stays in lockstep.
        self.token_sync = None
        self.waiting: deque = deque()
        self.running: list = []  # in admission order
        self.requests: dict = {}
        self._ids = itertools.count()
        self.closed = False
        self.steps = 0  # forward passes (one per step that had work)
        self.decode_steps = 0  # steps that decoded at least one running request
        self.last_step_tokens = 0  # tokens of the last step's forward pass
        # Seconds spent in steps, cumulative: "host" schedules, reserves blocks and builds the
        # pass's graph (index arrays, sampling); "device" launches the pass and waits for its
        # tokens (with async steps, only what did not overlap the host's work); "sample"
        # turns the read tokens into events.
        self.step_seconds = {"host": 0.0, "device": 0.0, "sample": 0.0}
        self._step_start = 0.0
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
                    stop_token_ids=None, logprobs: int | None = None):
        """Queue a prompt (token ids); it joins the batch at the next ``step()``.

        ``stop_token_ids``: tokens that end this request (the last one is emitted); None:
        the engine's ``eos_token_ids``, () for none.
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
        stops = self.eos_token_ids if stop_token_ids is None else frozenset(int(t) for t in stop_token_ids)
        request = Request(request_id, prompt, max_tokens, sampling=sampling, stop_token_ids=stops, logprobs=logprobs)
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
        return bool(self.waiting or self.running or self._flight is not None)

    @property
    def pipelined(self) -> bool:
        """Whether steps overlap (``async_steps``, and not across ranks)."""
        return self.async_steps and self.token_sync is None

    # ------------------------------------------------------------------ stepping

    def step(self) -> list:
        """One forward pass: every running decode, then prefill chunks under the token
        budget. Returns the new tokens (and requests that ended without one)."""
        self._check_open("step")
        self._step_start = time.perf_counter()
        events = []
        decodes = self._reserve_decodes(events)
        chunks = self._reserve_prefills(self.max_num_batched_tokens - len(decodes), events)
        previous, self._flight = self._flight, None
        flight = None
        if decodes or chunks:
            flight = self._forward([(r, 1) for r in decodes] + chunks, bool(decodes), previous)
        if previous is not None:  # read while the device computes this step's pass
            self._land(previous, events)
        if flight is not None:
            if self.pipelined:
                self._flight = flight
            else:
                self._land(flight, events)
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

    def _reserve_decodes(self, events: list) -> list:
        """Room for one more token per decoding request. One that could not grow even with
        the pool to itself ends ("length"); otherwise preempt the newest until all fit."""
        limit = self.max_sequence_tokens  # fixed within a step
        while True:
            appended = []
            try:
                for request in self.running:
                    if not request.decoding:
                        continue
                    if request.pending is not None and len(request.output) + 1 >= request.max_tokens:
                        continue  # its token in flight is its last
                    if limit is not None and request.num_tokens > limit:
                        raise _Outgrown(request)
                    self._append_input(request)
                    appended.append(request)
                return appended
            except (KVCacheFull, _Outgrown) as e:
                for request in appended:  # undo this step's appends, then make room
                    self.cache.truncate(request.request_id, request.computed)
                    request.input_later = False
                if self._flight is not None:
                    # Making room needs every token's id (preemption recomputes from them):
                    # read the pass in flight first, then schedule again.
                    flight, self._flight = self._flight, None
                    self._land(flight, events)
                    continue
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

    def _reserve_prefills(self, budget: int, events: list) -> list:
        """(request, tokens) chunks for this step: partly prefilled prompts first (oldest
        first), then new ones, while ``budget`` tokens last and the pool has room."""
        chunks = []
        for request in [r for r in self.running if not r.decoding]:
            if budget <= 0:
                return chunks
            if request not in self.running:
                continue  # preempted below to make room for an older one
            n = self._grow_chunk(request, min(budget, request.num_tokens - request.computed))
            while not n and not chunks and not any(r.decoding for r in self.running):
                # Nothing else runs this step: prefills hold the pool. Preempt the newest
                # for the oldest (no deadlock); alone and still no room, it cannot fit.
                if self.running[-1] is request:
                    self.running.remove(request)
                    self.cache.free(request.request_id)
                    events.append(self._finish(request, "length"))
                    break
                self._preempt(self.running[-1])
                n = self._grow_chunk(request, min(budget, request.num_tokens - request.computed))
            if not n:
                if request.finished:
                    continue
                return chunks  # the pool is full: decodes get what frees up first
            chunks.append((request, n))
            budget -= n
        for request in list(self.waiting):
            if budget <= 0:
                break
            if self._prefix_in_flight(request):
                continue  # another request is computing its next block: share it next step
            n = self._admit(request, budget, events, alone=not (self.running or chunks))
            if n is None:
                break  # no room: wait for running requests to finish
            if n:
                chunks.append((request, n))
                budget -= n
        return chunks

    def _grow_chunk(self, request: Request, n: int) -> int:
        """Reserve the next ``n`` tokens of a partly prefilled request, or as many as fit."""
        tokens = request.tokens
        while n:
            try:
                self._append(request, tokens[request.computed:request.computed + n])
                return n
            except KVCacheFull:
                n //= 2
        return 0

    def _admit(self, request: Request, budget: int, events: list, *, alone: bool) -> int | None:
        """Start a waiting request with a first chunk of at most ``budget`` tokens after its
        cached prefix. Returns the chunk's length, 0 if the request ended, None if the pool
        has no room for it now."""
        room = self.cache.free_blocks  # None: the pool grows
        if room is not None and not alone:
            # Keep a block per running decode free (its next block boundary): admitting into
            # the last blocks would only preempt someone a few steps later.
            room -= sum(1 for r in self.running if r.decoding)
            if room <= 0:
                return None  # a new sequence takes at least one block: skip hashing its prompt
        tokens = request.tokens  # a preempted request resumes from here
        start = self.cache.cached_prefix(tokens) if self.prefix_sharing else 0
        n = min(budget, len(tokens) - start)
        if room is not None and not alone:
            n = min(n, room * self.block_size)  # more can never fit: fewer halvings below
        while n:
            try:
                if self.prefix_sharing:
                    got = self.cache.add_sequence(request.request_id, tokens[:start + n])
                else:
                    got = self.cache.add_sequence(request.request_id, num_tokens=n)
                break
            except KVCacheFull:
                n //= 2
        if not n:
            if not alone:
                return None
            # Alone in the pool and still too big: only a resumed request that grew gets here.
            self.waiting.remove(request)
            events.append(self._finish(request, "length"))
            return 0
        assert got == start, "the cached prefix of a prompt's first chunk is the prompt's"
        self.waiting.remove(request)
        request.computed = request.cached_prompt_tokens = start
        self.prompt_tokens_cached += start
        self.running.append(request)
        return n

    def _prefix_in_flight(self, request: Request) -> bool:
        """Whether a request still prefilling will publish this prompt's next full block
        (so admitting it now would compute that block twice)."""
        if not self.prefix_sharing:
            return False
        bs = self.block_size
        tokens = request.tokens
        end = self.cache.cached_prefix(tokens) + bs  # the next block this prompt could share
        if end > len(tokens) - 1:  # a block holding the last token is never shared
            return False
        head = tokens[:end]
        return any(not r.decoding and r.num_tokens >= end and r.tokens[:end] == head for r in self.running)

    def _forward(self, batch: list, decoded: bool, previous) -> "_Flight | None":
        """Launch ``batch`` [(request, new tokens)] as one pass (room is reserved) and the
        sampling of the rows of requests whose every token is then computed. Decodes whose
        input is still in flight (``previous``) take it on the device."""
        rows, inputs, sampled = 0, [], []
        later_rows, later_src = [], []  # decode rows fed from the previous pass's tokens
        for request, n in batch:
            if request.decoding and request.pending is not None:
                flight, j = request.pending
                assert flight is previous, "a pending input comes from the pass launched last"
                later_rows.append(rows)
                later_src.append(j)
                inputs.append(0)
            elif request.decoding:
                inputs.append(request.output[-1])
            else:
                inputs += request.tokens[request.computed:request.computed + n]
            rows += n
            if request.computed + n == request.num_tokens:
                sampled.append((request, rows - 1))
        ids = [r.request_id for r, _ in batch]
        starts = [r.computed for r, _ in batch]
        # Decode rows (they lead the batch) take the decode kernel, prompt rows the varlen one,
        # whatever else the pass holds: a request's tokens do not depend on its batch.
        decodes = sum(1 for r, _ in batch if r.decoding)
        if decodes == len(batch):
            caches = self.cache.layer_caches(ids, starts)
        else:
            caches = self.cache.ragged_layer_caches(ids, starts, [n for _, n in batch], decodes=decodes)
        token_ids = mx.array(inputs, dtype=mx.int32)
        if later_rows:
            token_ids[mx.array(later_rows, dtype=mx.int32)] = previous.tokens[mx.array(later_src, dtype=mx.int32)]
        hidden = self._body(token_ids[:, None], caches)  # [T, 1, hidden]
        if len(sampled) < rows:  # logits only for the rows that sample
            hidden = hidden[mx.array([row for _, row in sampled], dtype=mx.int32)]
        logits = self._head(hidden)[:, -1, :]
        for request, n in batch:
            if not request.decoding:
                self.prompt_tokens_computed += n
            request.computed += n
        self.steps += 1
        self.decode_steps += decoded
        self.last_step_tokens = rows
        requests = [r for r, _ in sampled]
        writes = [p.arrays() for p in self.cache.pools]
        flight = None
        if requests:
            tokens, logprobs = self._sample(requests, logits)
            flight = _Flight(requests, tokens, logprobs)
            for i, request in enumerate(requests):
                request.decoding = True
                request.pending = (flight, i)
        # Launch the pass (a step of prefill only writes its K/V); its tokens are read by
        # _land, at once or, with async steps, during the next step. The launch counts as
        # device time: on MLX's CPU backend async_eval returns only once most of it ran.
        built = time.perf_counter()
        self.step_seconds["host"] += built - self._step_start
        mx.async_eval(writes if flight is None else [flight.tokens, flight.logprobs, writes])
        if flight is None and not self.pipelined:
            mx.eval(writes)
        self.step_seconds["device"] += time.perf_counter() - built
        return flight

    def _land(self, flight: "_Flight", events: list) -> None:
        """Read a launched pass's tokens and turn them into events. Requests that ended
        while it was in flight (aborted, or stopped by the token before) drop theirs."""
        clock = self.step_seconds
        waited = time.perf_counter()
        tokens = flight.tokens.tolist()
        logprobs = _read_logprobs(flight.requests, flight.logprobs)
        read = time.perf_counter()
        clock["device"] += read - waited
        for request, token, lp in zip(flight.requests, tokens, logprobs):
            if request.pending is not None and request.pending[0] is flight:
                request.pending = None
            if request.finished:
                continue
            if request.input_later:  # the pass launched since took this token as input
                request.input_later = False
                self.cache.provide_ids(request.request_id, [token])
            events.append(self._emit(request, token, lp))
        self.running = [r for r in self.running if not r.finished]
        clock["sample"] += time.perf_counter() - read

    def _sample(self, requests: list, logits: mx.array) -> tuple:
        """One token per row of ``logits`` [S, V], each by its request's sampling (int32
        [S], not evaluated), and the parts of each request's ``TokenLogprobs``."""
        tokens, rows = self._pick(requests, logits)
        if self.token_sync is not None:  # rank 0's tokens; logprobs then describe them
            mx.eval(tokens, *rows.values())
            tokens = mx.array(self.token_sync([int(t) for t in tokens.tolist()]))
        tokens = tokens.astype(mx.int32)
        return tokens, _logprob_parts(requests, rows, tokens)

    def _pick(self, requests: list, logits: mx.array) -> tuple:
        """(token ids [S], {row: log-softmax of the processed row} for requests wanting
        logprobs), as graphs: nothing is evaluated here."""
        if all(r.plain for r in requests):
            return self.sampler(logits), {}
        picks, rows = [], {}
        argmax = None
        for i, r in enumerate(requests):
            row = logits[i:i + 1]
            if r.processors:  # this request's own penalties, on its own row
                history = _history(r)
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
        return mx.stack(picks), rows

    def _append_input(self, request: Request) -> None:
        """Room for a decode's input token: its id, or a slot whose id comes when it lands."""
        if request.pending is None:
            self._append(request, [request.output[-1]])
        elif self.prefix_sharing:
            self.cache.append(request.request_id, num_tokens=1, ids_later=True)
            request.input_later = True
        else:
            self.cache.append(request.request_id, num_tokens=1)

    def _append(self, request: Request, tokens: list) -> None:
        if self.prefix_sharing:
            self.cache.append(request.request_id, tokens)
        else:
            self.cache.append(request.request_id, num_tokens=len(tokens))

    def _preempt(self, request: Request) -> None:
        assert request.pending is None, "a preempted request is recomputed from known tokens"
        self.running.remove(request)
        self.cache.free(request.request_id)
        request.computed, request.decoding = 0, False
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


@dataclass
class _Flight:
    """A launched pass: the requests it samples, their tokens and logprob parts (graphs)."""

    requests: list
    tokens: mx.array  # int32 [S]
    logprobs: dict  # row -> (chosen logprob, top ids, top logprobs)


def _history(request: Request) -> mx.array:
    """The tokens a request's logits processors read: its last ``history`` (None: all),
    the one still in flight included (taken on the device)."""
    known = request.known_tokens
    if request.pending is None:
        return mx.array(known if request.history is None else known[-request.history:])
    flight, j = request.pending
    tail = known if request.history is None else (known[-(request.history - 1):] if request.history > 1 else [])
    return mx.concatenate([mx.array(tail, dtype=mx.int32), flight.tokens[j:j + 1]])


def _eos_ids(model, tokenizer) -> frozenset:
    """The tokenizer's EOS tokens, else the model config's ``eos_token_id`` (an int or a list)."""
    ids = getattr(tokenizer, "eos_token_ids", None) if tokenizer is not None else None
    if ids is None and tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids = [tokenizer.eos_token_id]
    if ids is None:
        ids = getattr(getattr(model, "args", None), "eos_token_id", None)
    if ids is None:
        return frozenset()
    return frozenset(int(t) for t in (ids if isinstance(ids, (list, tuple, set, frozenset)) else [ids]))


class _Outgrown(Exception):
    def __init__(self, request: Request):
        self.request = request


def _log_softmax(row: mx.array) -> mx.array:
    row = row.astype(mx.float32)  # reported numbers: no float16 rounding
    return row - mx.logsumexp(row, axis=-1, keepdims=True)


def _logprob_parts(requests: list, rows: dict, tokens: mx.array) -> dict:
    """{row: (chosen token's logprob, top ids, their logprobs)} as graphs."""
    wanted = {}
    for i, row in rows.items():
        n = min(requests[i].logprobs, row.shape[-1])
        top = mx.argpartition(-row, kth=n - 1)[:n] if n else mx.array([], dtype=mx.uint32)
        wanted[i] = (row[tokens[i]], top, row[top])
    return wanted


def _read_logprobs(requests: list, wanted: dict) -> list:
    """Each request's ``TokenLogprobs`` (None where it asked for none)."""
    out = [None] * len(requests)
    if not wanted:
        return out
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
