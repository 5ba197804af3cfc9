"""Continuous batching over one paged cache, one forward pass per step.

Requests join and leave at any step. Each ``step()`` is a loop over three parts, each
with one job:

- the scheduler (``scheduler.py``) picks the step's ragged batch under a token budget
  and reserves its cache room: every running decode (one token each), then prefill
  chunks; it admits, chunks and preempts, by a policy (``scheduling_policy``);
- the runner (``runner.py``) runs that batch through the model once and samples the rows
  whose prompt is complete, and later lands their tokens;
- the sampler (``sampler.py``) picks each row's token by its request's settings.

With ``speculative``, each step first drafts tokens for the decoding requests
(``proposers.py``: prompt lookup, or a smaller model); a decode row then carries its
drafts, which the pass verifies with the exact acceptance rule (``sampler.verify``).

The batch is packed as ``[T, 1]`` token rows (T = tokens of the step) with each row's
position as the cache's ``offset``, so unmodified mlx-lm model code runs it; per layer,
the decode rows run ``paged_attention`` and the prompt rows ``paged_attention_varlen``.
Hidden states are sliced before the LM head: logits come only for rows that sample
(decodes, and the last token of a prompt whose prefill completes). A long prompt
therefore never stalls the running requests: they get a token every step while it is
chunked in. A finished request's blocks are freed at once.

When a fixed-size pool runs dry the policy's victim (FCFS: the most recently admitted
request, decoding or still prefilling) is preempted: its blocks are freed and it waits to
be recomputed from its tokens so far (vLLM's recompute preemption), resuming from
whatever of its blocks are still published, so the output does not change. A request
that could not grow even with the whole pool to itself finishes early with reason
``"length"`` (the cache is full) while the others keep running; a prompt that cannot fit
even in an empty pool is rejected by ``add_request``.

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
import logging
import random
import time

import mlx.core as mx

from ..integrations.mlx_lm import use_paged_cache
from ..kv_format import KVFormat
from .proposers import DraftState, ModelDrafter, NgramProposer, SpeculativeConfig
from .request import Event, Request, RequestTooLarge, check_int, check_request
from .runner import Runner
from .sampler import Sampler, SamplingParams, TokenLogprobs, greedy
from .scheduler import DEFAULT_MAX_NUM_BATCHED_TOKENS, POLICIES, PRIORITY_POLICIES

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_MAX_NUM_BATCHED_TOKENS", "Engine", "Event", "Request", "RequestTooLarge", "SamplingParams",
           "TokenLogprobs", "greedy"]


def _part(part: str, name: str, doc: str) -> property:
    """A read-only attribute of one of the engine's parts, read through the engine."""
    return property(lambda self: getattr(getattr(self, part), name), doc=doc)


class Engine:
    """Continuous-batching generation for an mlx-lm model.

    Args:
        model: an mlx-lm model of a family ``use_paged_cache`` supports.
        block_size, num_blocks: the paged cache (``num_blocks=None`` grows).
        kv_format: how it stores K and V (``kvmetal.KVFormat``), as ``use_paged_cache`` takes it;
        k_bits, v_bits, k_group_size, v_group_size: the same as loose arguments.
        prefix_sharing: share full prompt blocks between requests with equal prefixes; None
            (default): on, unless the model keeps recurrent state (see below).
        sampler: logits [S, V] -> token ids [S] for requests without ``sampling``; greedy by default.
        keep_finished: keep finished requests in ``requests`` (a server turns this off).
        on_finish: called with a request that finished normally, before its blocks are
            freed (a prefix store reads them there).
        max_num_batched_tokens: tokens one step's forward pass computes: the running
            decodes (one each, always all of them) and, in what is left, prefill chunks.
            Bounds the time of a step, so running requests see no stall beyond it while
            long prompts arrive.
        scheduling_policy: a name in ``scheduler.POLICIES`` ("fcfs", the default, is first
            come first served under a fixed budget); ``scheduler_options`` are its own
            keyword arguments.
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
        speculative: a ``proposers.SpeculativeConfig`` (or its method name, "ngram"):
            decode rows carry drafted tokens that one pass verifies (proposers.py), for
            every request that does not turn it off (``add_request(speculative=False)``).
            ``draft_model``: with method "model", the smaller mlx-lm model (same
            vocabulary) that drafts, greedily, on its own paged pool.
            Same greedy tokens, same sampling distribution; a step in which a request
            drafts is not pipelined; across ranks (``token_sync``) nothing is drafted.
            None (default): off.
    Models with recurrent-state layers (hybrids: mlx-lm gives those layers an
    ``ArraysCache``/``MambaCache``) run too: each request owns its own state, made fresh
    when it starts from token 0 (new, or preempted and recomputed) and dropped when it
    ends, and in a pass the modules that take that state run once per request
    (``SequenceStates``). A state holds every token so far and cannot be cut back or
    shared by block, so for such models prefix sharing is off (None resolves to False,
    True is refused) and so is speculative decoding (refused): both would resume a
    sequence from a token the state has not seen, or has seen past.
    Use as a context manager, or call ``close()`` to restore the model; a closed
    engine raises ``RuntimeError``.
    """

    def __init__(self, model, *, block_size: int = 16, num_blocks: int | None = None, k_bits: int | None = None,
                 v_bits: int | None = None, prefix_sharing: bool | None = None, sampler=greedy,
                 keep_finished: bool = True, on_finish=None,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 k_group_size: int | None = None, v_group_size: int | None = None, async_steps: bool = False,
                 scheduling_policy: str = "fcfs", scheduler_options: dict | None = None,
                 cascade: bool = False, tokenizer=None, kv_format: KVFormat | None = None,
                 speculative: SpeculativeConfig | str | None = None, draft_model=None):
        self.model = model
        if isinstance(speculative, str):
            speculative = SpeculativeConfig(method=speculative)
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise ValueError(f"[Engine] speculative must be a SpeculativeConfig, a method name or None, "
                             f"got {speculative!r}")
        if (draft_model is not None) != (speculative is not None and speculative.method == "model"):
            raise ValueError("[Engine] draft_model goes with speculative method 'model', and only with it")
        if draft_model is not None:
            vocab = [getattr(getattr(m, "args", None), "vocab_size", None) for m in (model, draft_model)]
            if None not in vocab and vocab[0] != vocab[1]:
                raise ValueError(f"[Engine] draft_model must share the model's vocabulary: vocab_size "
                                 f"{vocab[1]} != {vocab[0]}")
        self.speculative = speculative
        self.eos_token_ids = _eos_ids(model, tokenizer)  # a request's stop tokens unless it gives its own
        # checked before the model is patched: a bad value leaks nothing
        check_int("Engine", "max_num_batched_tokens", max_num_batched_tokens)
        if scheduling_policy not in POLICIES:
            raise ValueError(f"[Engine] scheduling_policy must be one of {sorted(POLICIES)}, "
                             f"got {scheduling_policy!r}")
        self.handle = use_paged_cache(model, block_size=block_size, num_blocks=num_blocks, kv_format=kv_format,
                                      k_bits=k_bits, v_bits=v_bits, k_group_size=k_group_size,
                                      v_group_size=v_group_size)
        try:
            self.cache = self.handle.new_model_cache(cascade=bool(cascade))
            self.states = None if self.handle.layout.plain else self.handle.sequence_states()
            if self.states is not None and self.states.recurrent:
                prefix_sharing = _recurrent_options(model, prefix_sharing, speculative)
            elif prefix_sharing is None:
                prefix_sharing = True
            self.scheduler = POLICIES[scheduling_policy](
                self.cache, block_size=block_size, prefix_sharing=prefix_sharing, finish=self._finish,
                max_num_batched_tokens=max_num_batched_tokens, **(scheduler_options or {}))
        except BaseException:
            self.handle.undo()
            raise
        self.proposer = None  # what drafts (speculative decoding)
        if draft_model is not None:
            try:
                self.proposer = ModelDrafter(draft_model, block_size=block_size)
            except BaseException:
                self.handle.undo()
                raise
        elif speculative is not None:
            self.proposer = NgramProposer()
        self.sampler = Sampler(sampler)
        self.runner = Runner(model, self.cache, self.sampler, self.scheduler, self.states)
        self.block_size = block_size
        self.prefix_sharing = prefix_sharing
        self.keep_finished = keep_finished
        self.on_finish = on_finish
        self.max_num_batched_tokens = max_num_batched_tokens
        self.async_steps = bool(async_steps)
        self._flight = None  # the launched pass whose tokens were not read yet (async steps)
        self.requests: dict = {}
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        self.closed = False
        self.generated_tokens = 0

    waiting = _part("scheduler", "waiting", "Requests waiting for admission, in queue order.")
    running = _part("scheduler", "running", "Admitted requests (prefilling or decoding), in admission order.")
    preemptions = _part("scheduler", "preemptions", "Requests preempted so far.")
    prompt_tokens_cached = _part("scheduler", "prompt_tokens_cached", "Prompt tokens admissions found shared.")
    steps = _part("runner", "steps", "Forward passes (one per step that had work).")
    decode_steps = _part("runner", "decode_steps", "Steps that decoded at least one running request.")
    last_step_tokens = _part("runner", "last_step_tokens", "Tokens of the last step's forward pass.")
    prompt_tokens_computed = _part("runner", "prompt_tokens_computed", "Prompt tokens run through the model.")
    step_seconds = _part("runner", "step_seconds", "Seconds of steps by part: host, device, sample.")
    decode_passes = _part("runner", "decode_passes", "Decode rows landed (one per request and pass).")
    decode_tokens = _part("runner", "decode_tokens", "Tokens the decode rows emitted.")
    drafted_tokens = _part("runner", "drafted_tokens", "Drafted tokens verified (speculative decoding).")
    accepted_tokens = _part("runner", "accepted_tokens", "Drafted tokens accepted.")
    verify_passes = _part("runner", "verify_passes", "Decode rows that carried drafts.")

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens (0 before any draft)."""
        return self.accepted_tokens / self.drafted_tokens if self.drafted_tokens else 0.0

    @property
    def tokens_per_pass(self) -> float:
        """Tokens a decoding request gets per forward pass (1 without speculation)."""
        return self.decode_tokens / self.decode_passes if self.decode_passes else 0.0

    @property
    def token_sync(self):
        """Across ranks (``kvmetal serve`` under mlx.launch): maps this rank's sampled tokens
        to rank 0's, so that every rank appends the same tokens and stays in lockstep."""
        return self.sampler.token_sync

    @token_sync.setter
    def token_sync(self, share) -> None:
        self.sampler.token_sync = share

    @property
    def _head(self):
        return self.runner.head

    @_head.setter
    def _head(self, head) -> None:  # tests count the rows that reach the LM head
        self.runner.head = head

    # ------------------------------------------------------------------ capacity

    @property
    def max_prompt_tokens(self) -> int | None:
        """Most prompt tokens one request can bring with the whole pool to itself (None: the
        pool grows). A prompt is written whole into every layer group, window groups too."""
        return self.cache.capacity_tokens

    @property
    def max_sequence_tokens(self) -> int | None:
        """Most tokens (prompt and output) one request can reach alone (None: no bound)."""
        return self.scheduler.max_sequence_tokens

    # ------------------------------------------------------------------ requests

    def add_request(self, prompt, *, max_tokens: int, request_id=None, sampling: SamplingParams | None = None,
                    stop_token_ids=None, logprobs: int | None = None, priority: int = 0,
                    speculative: bool = True):
        """Queue a prompt (token ids); it joins the batch at the next ``step()``.

        ``stop_token_ids``: tokens that end this request (the last one is emitted); None:
        the engine's ``eos_token_ids``, () for none.
        ``logprobs``: every event of this request carries ``TokenLogprobs`` with this
        many top alternatives (0: only the chosen token's); None: none.
        ``priority``: lower is served first and preempted last, under a policy that reads
        it ("priority", "adaptive"); other policies refuse anything but 0.
        ``speculative``: False keeps this request off the engine's speculative decoding.
        Raises ``RequestTooLarge`` (a ValueError) when the prompt cannot fit even in an
        empty pool; a request that outgrows the pool later finishes with "length"."""
        self._check_open("add_request")
        vocab = getattr(getattr(self.model, "args", None), "vocab_size", None)
        prompt, max_tokens, logprobs, priority = check_request(
            prompt, max_tokens=max_tokens, sampling=sampling, logprobs=logprobs, priority=priority,
            speculative=speculative, vocab=vocab)
        if priority and not self.scheduler.uses_priority:
            raise ValueError(f"[Engine.add_request] priority {priority} needs a scheduling policy that reads it "
                             f"({', '.join(PRIORITY_POLICIES)}); this engine's is {self.scheduler.name!r}")
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
        request = Request(request_id, prompt, max_tokens, sampling=sampling, stop_token_ids=stops, logprobs=logprobs,
                          priority=priority, arrival=next(self._arrivals))
        if sampling is not None:
            processors, request.history = sampling.logits_processors()
            request.processors = tuple(processors)
        if sampling is not None and not sampling.greedy:
            seed = random.getrandbits(63) if sampling.seed is None else sampling.seed
            request.key = mx.random.key(seed)
        # The engine's own batch sampler can only be verified when it is greedy.
        if speculative and self.speculative is not None and (sampling is not None or self.sampler.batch is greedy):
            request.speculation = DraftState(self.speculative, prompt)
        self.requests[request_id] = request
        self.scheduler.enqueue(request)
        return request_id

    def abort(self, request_id) -> bool:
        """Drop a waiting or running request and free its blocks; False if it is not live."""
        self._check_open("abort")
        request = self.requests.get(request_id)
        if request is None or request.finished:
            return False
        self.scheduler.remove(request)
        self._finish(request, "abort")
        return True

    def has_work(self) -> bool:
        return self.scheduler.has_work() or self._flight is not None

    @property
    def pipelined(self) -> bool:
        """Whether steps overlap (``async_steps``, and not across ranks)."""
        return self.async_steps and self.token_sync is None

    # ------------------------------------------------------------------ stepping

    def step(self) -> list:
        """One forward pass: every running decode, then prefill chunks under the token
        budget. Returns the new tokens (and requests that ended without one)."""
        self._check_open("step")
        self.runner.step_start = start = time.perf_counter()
        events = []
        if self.speculative is not None:
            self._draft(events)
        batch = self.scheduler.schedule(events, self._settle)
        previous, self._flight = self._flight, None
        flight = None
        drafts = any(r.draft for r, _ in batch)
        if batch:
            decodes = sum(1 for r, _ in batch if r.decoding)
            flight = self.runner.launch(batch, previous, wait=not self.pipelined or drafts)
        if previous is not None:  # read while the device computes this step's pass
            self._land(previous, events)
        if flight is not None:
            if self.pipelined and not drafts:
                self._flight = flight
            else:
                self._land(flight, events)
        if batch:  # the step as its clients see it (pipelined: mostly this pass's launch)
            self.scheduler.observe(sum(n for _, n in batch), decodes, time.perf_counter() - start)
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

    def _draft(self, events: list) -> None:
        """Draft for every decoding request that speculates; its newest token must be read
        first (a pass in flight is landed). Drafts never pass ``max_tokens``, the longest
        sequence the pool holds, or the step's token budget."""
        if self.token_sync is not None:
            return  # across ranks every rank would judge drafts itself (rounding could part them): off
        speculating = [r for r in self.scheduler.running if r.decoding and r.speculation is not None
                       and r.speculation.active]
        if not speculating:
            return
        if any(r.pending is not None for r in speculating):
            self._settle(events)
        limit = self.max_sequence_tokens
        wanted = []
        for request in speculating:
            if request.finished:
                continue
            room = request.max_tokens - len(request.output) - 1  # the pass also yields one token of its own
            if limit is not None:
                room = min(room, limit - request.num_tokens)
            wanted.append((request, min(room, self.speculative.num_draft_tokens)))
        budget = self.max_num_batched_tokens - sum(1 for r in self.scheduler.running if r.decoding)
        for (request, _), draft in zip(wanted, self.proposer.propose(wanted, budget)):
            request.speculation.draft = draft

    def _settle(self, events: list) -> bool:
        """Read the pass in flight, if any (the scheduler needs every token's id to preempt)."""
        if self._flight is None:
            return False
        flight, self._flight = self._flight, None
        self._land(flight, events)
        return True

    def _land(self, flight, events: list) -> None:
        events += self.runner.land(flight, self._emit)
        self.scheduler.retire()

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
        self.scheduler.finished(request)  # blocks go back right away
        return self._finish(request, reason, token, logprobs)

    def _finish(self, request: Request, reason: str, token: int | None = None,
                logprobs: TokenLogprobs | None = None) -> Event:
        request.finish_reason = reason
        request.states = None
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
            if self.proposer is not None:
                self.proposer.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _recurrent_options(model, prefix_sharing, speculative) -> bool:
    """Prefix sharing for a model with recurrent state: off (a request's state covers all
    its tokens, so it cannot start after a shared prefix); speculative decoding refused
    (rejected drafts would have to be taken back out of the state)."""
    from ..integrations.mlx_lm import model_family

    family = model_family(model)
    if speculative is not None:
        raise ValueError(f"[Engine] speculative decoding is not supported for {family}: its recurrent-state layers "
                         f"cannot take rejected drafts back out of their state; leave speculative None")
    if prefix_sharing:
        raise ValueError(f"[Engine] prefix_sharing=True is not supported for {family}: a request's recurrent state "
                         f"covers all its tokens, so it cannot start after a prefix shared by block; pass "
                         f"prefix_sharing=None or False")
    if prefix_sharing is None:
        log.info("%s keeps recurrent state: prefix sharing is off", family)
    return False


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
