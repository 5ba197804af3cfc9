"""The engine's scheduler: which requests a step's one pass computes, and how many tokens each.

Each step it reserves cache room for a ragged batch under a token budget:

1. every running decode (one token each) comes first;
2. then the next chunk of each partly prefilled prompt (oldest first);
3. then new prompts' first chunks, in queue order, while the budget lasts. A prompt's
   leading full blocks that another request already computed are shared (prefix
   hashing); a prompt whose next block another request is still prefilling waits for
   it instead of computing it a second time.

When a fixed-size pool runs dry a victim is preempted: its blocks are freed and it waits
to be recomputed from its tokens so far (vLLM's recompute preemption). A request that
could not grow even with the whole pool to itself finishes early with "length".

The mechanics (reserving blocks, preempting, admitting) live in ``Scheduler``; the
policy is a few methods a subclass overrides: ``enqueue`` / ``requeue`` (queue order),
``budget`` (tokens this step), ``chunk_limit`` (a partial prefill's share), ``victim``
(whom to preempt) and ``observe`` (what a step cost). A new policy is a subclass
registered in ``POLICIES``, which ``kvmetal serve --scheduling-policy`` lists:

- ``fcfs``: first come first served under the fixed budget (``max_num_batched_tokens``);
  the victim is the most recently admitted request (vLLM's FCFS);
- ``priority``: the queue is ordered by request ``priority`` (lower first), then arrival;
  the victim is the least important running request, the latest arrival among equals
  (vLLM's priority policy);
- ``adaptive``: ``priority``, with a budget learnt from measured step times: with no
  running decodes nobody is stalled, so prompts prefill ``prefill_tokens`` at a time;
  with decodes a step is kept near ``step_ratio`` times a decode-only step, never over
  ``max_num_batched_tokens``; and while requests wait, a partly prefilled prompt takes
  at most half of the step's prefill tokens, so new prompts are not starved behind it.

Every policy takes ``long_prefill_tokens`` (vLLM's ``long_prefill_token_threshold``):
while requests wait, a partly prefilled prompt computes at most that many tokens a step.

The scheduler is the only part of the engine that changes the cache's room (``add_sequence``,
``append``, ``truncate``, ``free``, ``provide_ids``): the runner and the engine report what a
landed pass did (``input_landed``, ``drafts_landed``, ``finished``) and it applies that.
"""
from __future__ import annotations

import math
from collections import deque

from ..backends import VARLEN_SHORT_RUN
from ..cache import KVCacheFull
from .request import Request, check_int

DEFAULT_MAX_NUM_BATCHED_TOKENS = 256  # tokens one step computes (decodes included); measured: docs/integration.md


# A step's prefill budget of at least this many tokens always moves a prompt under
# prompt_chunk's rule (what is left is taken whole, or a chunk of 9+ leaves 9+).
MIN_PREFILL_CHUNK = 2 * VARLEN_SHORT_RUN + 2


def prompt_chunk(n: int, left: int) -> int:
    """The most tokens, at most ``n``, of a prompt with ``left`` tokens still to compute
    that one chunk may take, 0 for none this step: neither the chunk nor what it leaves
    is a short run (1..VARLEN_SHORT_RUN tokens) unless it is all that is left. A prompt's
    rows then run the same attention kernel whatever its chunks are (on Metal a short run
    takes the decode kernel, whose bits differ), so its tokens do not follow the batch."""
    if n >= left:
        return left
    n = min(n, left - VARLEN_SHORT_RUN - 1)
    return n if n > VARLEN_SHORT_RUN else 0


class Scheduler:
    """First come, first served, under a fixed token budget (the engine's default).

    Args:
        cache: the engine's ``PagedModelCache``.
        finish: ``(request, reason) -> Event``: ends a request (the engine's bookkeeping).
        max_num_batched_tokens: tokens one step computes, decodes included.
        long_prefill_tokens: while requests wait, the most tokens a partly prefilled prompt
            computes in a step (None: no bound).
    """

    name = "fcfs"
    uses_priority = False  # whether requests' ``priority`` changes anything

    def __init__(self, cache, *, block_size: int, prefix_sharing: bool, finish,
                 max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
                 long_prefill_tokens: int | None = None):
        if long_prefill_tokens is not None:
            check_int("Scheduler", "long_prefill_tokens", long_prefill_tokens)
        self.cache = cache
        self.block_size = block_size
        self.prefix_sharing = prefix_sharing
        self.finish = finish
        self.max_num_batched_tokens = max_num_batched_tokens
        self.long_prefill_tokens = long_prefill_tokens
        self.waiting: deque = deque()
        self.running: list = []  # in admission order
        self.preemptions = 0
        self.prompt_tokens_cached = 0  # tokens admissions found through prefix sharing

    # ------------------------------------------------------------------ policy

    def enqueue(self, request: Request) -> None:
        """A new request joins the queue."""
        self.waiting.append(request)

    def requeue(self, request: Request) -> None:
        """A preempted request goes back to the queue (FCFS: first in line)."""
        self.waiting.appendleft(request)

    def budget(self, decodes: int) -> int:
        """Tokens this step's pass computes, ``decodes`` of them running decodes."""
        return self.max_num_batched_tokens

    def chunk_limit(self, request: Request, budget: int) -> int | None:
        """Most tokens a partly prefilled prompt gets this step, ``budget`` prefill tokens
        being left (None: what is left)."""
        return self.long_prefill_tokens if self.waiting else None

    def victim(self) -> Request:
        """The running request to preempt when the pool runs dry (FCFS: the newest admitted)."""
        return self.running[-1]

    def observe(self, tokens: int, decodes: int, seconds: float) -> None:
        """A step's pass computed ``tokens`` rows (``decodes`` of them decodes) in ``seconds``."""

    # ------------------------------------------------------------------ the engine's calls

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, request: Request) -> None:
        """Drop a live request (aborted) and free its blocks."""
        if request in self.running:
            self.running.remove(request)
            self.cache.free(request.request_id)
        else:
            self.waiting.remove(request)

    # ------------------------------------------------------------------ what a landed pass did

    def finished(self, request: Request) -> None:
        """A running request ended with a token: its blocks go back at once (it leaves
        ``running`` at ``retire``)."""
        self.cache.free(request.request_id)

    def input_landed(self, request: Request, token: int) -> None:
        """A decode's input, taken on the device from the pass before, has its id now
        (its slot was reserved with ``ids_later``)."""
        self.cache.provide_ids(request.request_id, [token])

    def drafts_landed(self, request: Request, accepted: list) -> None:
        """A verified decode row: the cache keeps its first ``request.computed`` tokens (the
        accepted drafts' slots, whose ids come now and publish their blocks) and drops the
        rejected drafts' slots."""
        self.cache.truncate(request.request_id, request.computed)
        if accepted:  # a sequence without prefix hashing ignores them
            self.cache.provide_ids(request.request_id, accepted)

    def retire(self) -> None:
        """Forget running requests that finished (their blocks are already freed)."""
        self.running = [r for r in self.running if not r.finished]

    def schedule(self, events: list, settle) -> list:
        """This step's batch [(request, new tokens)], room reserved: decodes first, then
        prefill chunks. ``settle(events)`` reads the pass in flight, if any (True), so
        that preemption can recompute from known tokens."""
        decodes = self._reserve_decodes(events, settle)
        # A decode row is its input token and its drafts (speculative decoding), all counted by
        # the budget; equal counts side by side (one decode-kernel call per count).
        rows = sorted(((r, 1 + len(r.draft)) for r in decodes), key=lambda rn: rn[1])
        chunks = self._reserve_prefills(self.budget(len(decodes)) - sum(n for _, n in rows), events)
        return rows + chunks

    # ------------------------------------------------------------------ mechanics

    def _reserve_decodes(self, events: list, settle) -> list:
        """Room for one more token per decoding request. One that could not grow even with
        the pool to itself ends ("length"); otherwise preempt victims until all fit."""
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
                drafts = [r for r in self.running if r.draft]
                if drafts:  # drafts never preempt anyone: drop them first
                    for request in drafts:
                        request.speculation.draft = []
                    continue
                # Making room needs every token's id (preemption recomputes from them):
                # read the pass in flight first, then schedule again.
                if settle(events):
                    continue
                if isinstance(e, _Outgrown):
                    self.running.remove(e.request)
                    self.cache.free(e.request.request_id)
                    events.append(self.finish(e.request, "length"))
                elif len(self.running) == 1:  # alone and still no room: the pool cannot hold it
                    request = self.running.pop()
                    self.cache.free(request.request_id)
                    events.append(self.finish(request, "length"))
                else:
                    self._preempt(self.victim())

    def _reserve_prefills(self, budget: int, events: list) -> list:
        """(request, tokens) chunks for this step: partly prefilled prompts first (oldest
        first), then new ones in queue order, while ``budget`` tokens last and the pool has room."""
        chunks = []
        for request in [r for r in self.running if not r.decoding]:
            if budget <= 0:
                return chunks
            if request not in self.running:
                continue  # preempted below to make room for an older one
            share = self._share(request, budget)
            if not share:
                continue  # the budget left is too short for a chunk of it (prompt_chunk)
            n = self._grow_chunk(request, share)
            while not n and not chunks and not any(r.decoding for r in self.running):
                # Nothing else runs this step: prefills hold the pool. Preempt victims until it
                # fits or is the victim (no deadlock); alone and still no room, it cannot fit.
                if len(self.running) == 1:
                    self.running.remove(request)
                    self.cache.free(request.request_id)
                    events.append(self.finish(request, "length"))
                    break
                victim = self.victim()
                self._preempt(victim)
                if victim is request:
                    break
                n = self._grow_chunk(request, share)
            if not n:
                if request.finished or request not in self.running:
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

    def _share(self, request: Request, budget: int) -> int:
        """A partly prefilled prompt's chunk this step: what is left of it, within the budget
        and the policy's limit (prompt_chunk's rule)."""
        left = request.num_tokens - request.computed
        n = min(budget, left)
        limit = self.chunk_limit(request, budget)
        if limit is not None:
            n = min(n, max(limit, MIN_PREFILL_CHUNK))
        return self._chunk(n, left)

    def _chunk(self, n: int, left: int) -> int:
        """prompt_chunk's rule, where the budget lets every prompt move under it."""
        if self.max_num_batched_tokens < MIN_PREFILL_CHUNK:
            return min(n, left)
        return prompt_chunk(n, left)

    def _grow_chunk(self, request: Request, n: int) -> int:
        """Reserve the next ``n`` tokens of a partly prefilled request, or as many as fit."""
        tokens = request.tokens
        left = request.num_tokens - request.computed
        while n:
            try:
                self._append(request, tokens[request.computed:request.computed + n])
                return n
            except KVCacheFull:
                n = self._chunk(n // 2, left)
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
        left = len(tokens) - start
        n = min(budget, left)
        if room is not None and not alone:
            n = min(n, room * self.block_size)  # more can never fit: fewer halvings below
        n = self._chunk(n, left)
        if not n and left and not alone:
            return None  # too little budget or room for a chunk of it this step
        while n:
            try:
                if self.prefix_sharing:
                    got = self.cache.add_sequence(request.request_id, tokens[:start + n])
                else:
                    got = self.cache.add_sequence(request.request_id, num_tokens=n)
                break
            except KVCacheFull:
                n = self._chunk(n // 2, left)
        if not n:
            if not alone:
                return None
            # Alone in the pool and still too big: only a resumed request that grew gets here.
            self.waiting.remove(request)
            events.append(self.finish(request, "length"))
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

    def _append_input(self, request: Request) -> None:
        """Room for a decode's input token: its id, or a slot whose id comes when it lands;
        then its drafts, whose ids are given (and blocks published) only once accepted."""
        if request.draft:
            self._append(request, [request.output[-1]])
            try:
                self.cache.append(request.request_id, num_tokens=len(request.draft), ids_later=self.prefix_sharing)
            except KVCacheFull:
                self.cache.truncate(request.request_id, request.computed)
                raise
        elif request.pending is None:
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
        request.states = None  # recurrent state is recomputed with the K/V
        if request.speculation is not None:
            request.speculation.draft = []
        self.requeue(request)
        self.preemptions += 1

    @property
    def max_sequence_tokens(self) -> int | None:
        """Most tokens (prompt and output) one request can reach alone (None: no bound).
        Only full-attention groups bound it: window groups release blocks as decode moves."""
        return self.cache.full_capacity_tokens


class _Outgrown(Exception):
    def __init__(self, request: Request):
        self.request = request


class PriorityScheduler(Scheduler):
    """Requests by ``priority`` (lower first), then arrival; the victim is the least
    important running request, the latest arrival among equals (vLLM's priority policy)."""

    name = "priority"
    uses_priority = True

    def enqueue(self, request: Request) -> None:
        key = _rank(request)
        at = next((i for i, r in enumerate(self.waiting) if _rank(r) > key), len(self.waiting))
        self.waiting.insert(at, request)

    requeue = enqueue  # a preempted request keeps its place by priority and arrival

    def victim(self) -> Request:
        return max(self.running, key=_rank)


def _rank(request: Request) -> tuple:
    return request.priority, request.arrival


class AdaptiveScheduler(PriorityScheduler):
    """``priority``'s order, with a token budget learnt from measured step times.

    Args (beyond ``Scheduler``'s):
        prefill_tokens: the budget of a step without running decodes (nobody to stall);
            at least ``max_num_batched_tokens``.
        step_ratio: with decodes, a step's target time is this many decode-only steps
            (both learnt as moving averages); ``max_num_batched_tokens`` stays the cap.
    """

    name = "adaptive"
    smoothing = 0.2  # weight of the newest step in the moving averages

    def __init__(self, cache, *, prefill_tokens: int = 2048, step_ratio: float = 2.0, **options):
        super().__init__(cache, **options)
        check_int("AdaptiveScheduler", "prefill_tokens", prefill_tokens)
        if isinstance(step_ratio, bool) or not isinstance(step_ratio, (int, float)) or not step_ratio >= 1 \
                or math.isinf(step_ratio):
            raise ValueError(f"[AdaptiveScheduler] step_ratio must be a finite number >= 1, got {step_ratio!r}")
        self.prefill_tokens = max(prefill_tokens, self.max_num_batched_tokens)
        self.step_ratio = float(step_ratio)
        self.decode_seconds = None  # a decode-only step (moving average)
        self.token_seconds = None  # what one prefill token adds to a step (moving average)

    def budget(self, decodes: int) -> int:
        cap = self.max_num_batched_tokens
        if not decodes:
            return self.prefill_tokens
        if self.decode_seconds is None or self.token_seconds is None:
            return cap  # nothing measured yet
        room = (self.step_ratio - 1) * self.decode_seconds / max(self.token_seconds, 1e-9)
        return min(cap, decodes + max(self.block_size, MIN_PREFILL_CHUNK, int(room)))

    def chunk_limit(self, request: Request, budget: int) -> int | None:
        limit = super().chunk_limit(request, budget)
        if not self.waiting:
            return limit
        half = max(self.block_size, budget // 2)  # the other half is for new prompts
        return half if limit is None else min(limit, half)

    def observe(self, tokens: int, decodes: int, seconds: float) -> None:
        prefill = tokens - decodes
        if decodes and not prefill:
            self.decode_seconds = _average(self.decode_seconds, seconds, self.smoothing)
        elif prefill >= self.block_size and (self.decode_seconds is not None or not decodes):
            base = self.decode_seconds if decodes else 0.0
            self.token_seconds = _average(self.token_seconds, max(seconds - base, 0.0) / prefill, self.smoothing)


def _average(mean: float | None, value: float, weight: float) -> float:
    return value if mean is None else (1 - weight) * mean + weight * value


# What Engine(scheduling_policy=...) and --scheduling-policy accept, by name.
POLICIES = {policy.name: policy for policy in (Scheduler, PriorityScheduler, AdaptiveScheduler)}
PRIORITY_POLICIES = tuple(name for name, policy in POLICIES.items() if policy.uses_priority)
