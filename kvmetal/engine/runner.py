"""The engine's runner: run a scheduled batch through the model in one ragged pass, and land its tokens.

The batch is packed as ``[T, 1]`` token rows (T = tokens of the step) with each row's
position as the cache's ``offset``, so unmodified mlx-lm model code runs it; attention is
one ``paged_attention_varlen`` call per layer (a step of decodes only runs
``paged_attention``). Hidden states are sliced before the LM head: logits come only for
rows that sample (decodes, and the last token of a prompt whose prefill completes).
A decode row with speculative drafts brings its last token and the drafts, and every one
of its rows gets logits: ``sampler.verify`` judges them, and ``land`` truncates the
rejected drafts' slots and emits the accepted tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.core as mx

from ..integrations.heads import split_model
from .sampler import TokenLogprobs, read_logprobs, top_pairs, top_parts, verify


@dataclass
class Flight:
    """A launched pass: the requests it samples, their tokens and logprob parts (graphs)."""

    requests: list
    tokens: mx.array  # int32 [S]
    logprobs: dict  # row -> (chosen logprob, top ids, top logprobs)
    verifications: list = field(default_factory=list)  # sampler.Verification of decodes with drafts
    decoding: list = field(default_factory=list)  # per sampled request: a decode row (not a prompt's last)


class Runner:
    """Launches passes over ``cache`` and reads their tokens; counts steps and their time.
    What landing a pass changes in the cache's room (ids of tokens taken on the device,
    rejected drafts) it reports to ``scheduler``, the one owner of that room.

    ``step_seconds`` is cumulative: "host" schedules, reserves blocks and builds the pass's
    graph (index arrays, sampling); "device" launches the pass and waits for its tokens
    (with pipelined steps, only what did not overlap the host's work); "sample" turns the
    read tokens into events."""

    def __init__(self, model, cache, sampler, scheduler, states=None):
        try:
            self.body, self.head = split_model(model)
        except NotImplementedError:  # a family heads.py does not split: the whole model, logits sliced after
            self.body, self.head = (lambda inputs, caches: model(inputs, cache=caches)), (lambda logits: logits)
        self.states = states  # SequenceStates of a model whose layout is not plain (None: plain)
        self.cache = cache  # read here (the pass's layer caches); its room changes only through the scheduler
        self.scheduler = scheduler
        self.sampler = sampler
        self.steps = 0  # forward passes (one per step that had work)
        self.decode_steps = 0  # steps that decoded at least one running request
        self.last_step_tokens = 0  # tokens of the last step's forward pass
        self.prompt_tokens_computed = 0
        self.step_seconds = {"host": 0.0, "device": 0.0, "sample": 0.0}
        self.step_start = 0.0  # when the current step began (the host's share starts there)
        self.decode_passes = 0  # decode rows landed (one per request and pass)
        self.decode_tokens = 0  # tokens those rows emitted (more than one with accepted drafts)
        self.verify_passes = 0  # decode rows that carried drafts
        self.drafted_tokens = 0  # drafts those rows carried
        self.accepted_tokens = 0  # drafts accepted

    def launch(self, batch: list, previous: Flight | None, *, wait: bool) -> Flight | None:
        """Launch ``batch`` [(request, new tokens)] as one pass (room is reserved) and the
        sampling of the rows of requests whose every token is then computed. Decodes whose
        input is still in flight (``previous``) take it on the device. ``wait``: a pass
        that samples nothing is evaluated before returning."""
        rows, inputs, sampled, drafted = 0, [], [], []
        later_rows, later_src = [], []  # decode rows fed from the previous pass's tokens
        for request, n in batch:
            if request.draft:  # speculative: the last token and its drafts, each row judged
                inputs += [request.output[-1]] + request.draft
                drafted.append((request, rows))
                rows += n
                continue
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
        if decodes == len(batch) and not drafted:
            caches = self.cache.layer_caches(ids, starts)
        else:
            caches = self.cache.ragged_layer_caches(ids, starts, [n for _, n in batch], decodes=decodes)
        if self.states is not None:
            caches = self.states.model_cache(caches, self._segments(batch))
        token_ids = mx.array(inputs, dtype=mx.int32)
        if later_rows:
            token_ids[mx.array(later_rows, dtype=mx.int32)] = previous.tokens[mx.array(later_src, dtype=mx.int32)]
        hidden = self.body(token_ids[:, None], caches)  # [T, 1, hidden]
        wanted = [row for _, row in sampled] + [row + i for r, row in drafted for i in range(len(r.draft) + 1)]
        if len(wanted) < rows or drafted:  # logits only for the rows that sample (or verify)
            hidden = hidden[mx.array(wanted, dtype=mx.int32)]
        logits = self.head(hidden)[:, -1, :]
        for request, n in batch:
            if not request.decoding:
                self.prompt_tokens_computed += n
            request.computed += n
        self.steps += 1
        self.decode_steps += any(r.decoding for r, _ in batch)
        self.last_step_tokens = rows
        requests = [r for r, _ in sampled]
        writes = [p.arrays() for p in self.cache.pools]
        flight = None
        if requests or drafted:
            tokens, logprobs = mx.zeros((0,), dtype=mx.int32), {}
            if requests:
                decoding = [r.decoding for r in requests]
                tokens, logprobs = self.sampler.sample(requests, logits[:len(requests)])
            verifications, at = [], len(requests)
            for request, _ in drafted:
                d = len(request.draft)
                verifications.append(verify(request, logits[at:at + d + 1], request.draft,
                                            batch_sampler=self.sampler.batch))
                at += d + 1
            flight = Flight(requests, tokens, logprobs, verifications, decoding if requests else [])
            for i, request in enumerate(requests):
                request.decoding = True
                request.pending = (flight, i)
        # Launch the pass (a step of prefill only writes its K/V); its tokens are read by
        # land, at once or, with pipelined steps, during the next step. The launch counts as
        # device time: on MLX's CPU backend async_eval returns only once most of it ran.
        built = time.perf_counter()
        self.step_seconds["host"] += built - self.step_start
        mx.async_eval(writes if flight is None else [flight.tokens, flight.logprobs, writes,
                                                     [v.arrays() for v in flight.verifications]])
        if flight is None and wait:
            mx.eval(writes)
        self.step_seconds["device"] += time.perf_counter() - built
        return flight

    def _segments(self, batch: list) -> list:
        """Per request of the pass: (first row, rows, its native caches). A request that
        starts from token 0 (new, or preempted and recomputed) gets fresh ones: recurrent
        state is rebuilt from the tokens, as the paged K/V is."""
        segments, row = [], 0
        for request, n in batch:
            if request.computed == 0:
                request.states = self.states.new()
            assert request.states is not None, "a request resumed past token 0 without its recurrent state"
            segments.append((row, n, request.states))
            row += n
        return segments

    def land(self, flight: Flight, emit) -> list:
        """Read a launched pass's tokens and turn them into events (``emit(request, token,
        logprobs) -> Event``). Requests that ended while it was in flight (aborted, or
        stopped by the token before) drop theirs."""
        clock = self.step_seconds
        waited = time.perf_counter()
        tokens = flight.tokens.tolist()
        logprobs = read_logprobs(flight.requests, flight.logprobs)
        outcomes = [v.outcome() for v in flight.verifications]
        read = time.perf_counter()
        clock["device"] += read - waited
        events = []
        for request, token, lp, decoding in zip(flight.requests, tokens, logprobs, flight.decoding):
            if request.pending is not None and request.pending[0] is flight:
                request.pending = None
            if request.finished:
                continue
            if request.input_later:  # the pass launched since took this token as input
                request.input_later = False
                self.scheduler.input_landed(request, token)
            self.decode_passes += decoding
            self.decode_tokens += decoding
            events.append(emit(request, token, lp))
        for v, (m, emitted) in zip(flight.verifications, outcomes):
            events += self._land_verification(v, m, emitted, emit)
        clock["sample"] += time.perf_counter() - read
        return events

    def _land_verification(self, v, m: int, emitted: list, emit) -> list:
        """Keep the cache slots of the ``m`` accepted drafts (their blocks are published
        now), drop the others, and emit the tokens up to a stop or ``max_tokens``."""
        request, d = v.request, len(v.draft)
        request.speculation.draft = []
        if request.finished:  # aborted while in flight: its blocks are gone
            return []
        request.computed -= d - m
        self.scheduler.drafts_landed(request, v.draft[:m])
        request.speculation.record(d, m)
        self.verify_passes += 1
        self.decode_passes += 1
        self.drafted_tokens += d
        self.accepted_tokens += m
        rows = _verified_logprobs(request, v, emitted)
        events = []
        for token, lp in zip(emitted, rows):
            self.decode_tokens += 1
            events.append(emit(request, token, lp))
            if request.finished:  # a stop token or max_tokens: nothing after it is emitted
                break
        return events


Forward = Runner  # its name before the engine had a package of its own


def _verified_logprobs(request, v, emitted: list) -> list:
    """``TokenLogprobs`` of each emitted token under its row (None without logprobs)."""
    if v.rows is None:
        return [None] * len(emitted)
    import numpy as np

    rows = np.array(v.rows[:len(emitted)], dtype=np.float32)
    n = min(request.logprobs, rows.shape[-1])
    out = []
    for row, token in zip(rows, emitted):  # the top as the sampler's rows choose it (ties by id)
        top, values, ties = top_parts(row, n, xp=np)
        out.append(TokenLogprobs(float(row[token]), top_pairs(top.tolist(), values.tolist(), ties, n,
                                                             lambda row=row: row)))
    return out
