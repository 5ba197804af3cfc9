"""The engine thread: the only thread that touches the model, the cache and MLX.

HTTP handlers (async, on uvicorn's event loop in another thread) talk to it through a
command queue (add, abort, stop) and receive their tokens through a per-request
``sink`` callable, which the handler makes thread-safe (``loop.call_soon_threadsafe``).
The loop steps the Engine while any request is live and waits on the queue otherwise.

Ending requests on the engine thread: a request past its deadline (``--timeout``) is
aborted there, whatever its HTTP handler is doing (e.g. blocked on a slow reader), and
its client gets ``RequestTimeout``. ``shutdown(timeout)`` drains: new requests are
refused, running ones go on up to ``timeout`` seconds, then what is left is ended with
"the server is shutting down" (its full prompt blocks saved first), the prefix store
writes what it has queued, and ``serve_forever`` returns. Across ranks these decisions
are rank 0's and travel as ordinary commands (abort, stop), so every rank applies them.
"""
from __future__ import annotations

import logging
import queue
import time
import traceback
from collections import deque
from dataclasses import dataclass

from ..engine.engine import Engine, Event

log = logging.getLogger("kvmetal.serve")


class LoopSink:
    """A sink that puts deliveries on an asyncio queue of ``loop``; the worker hands all of
    one step's deliveries for a loop over in one thread-safe call (one wake-up per step,
    not one per token)."""

    def __init__(self, loop, queue_):
        self.loop, self.queue = loop, queue_

    def __call__(self, delivery) -> None:
        _call_soon(self.loop, self.queue.put_nowait, delivery)


def _call_soon(loop, fn, arg) -> None:
    try:
        loop.call_soon_threadsafe(fn, arg)
    except RuntimeError:  # the loop is closed (HTTP shut down first): nobody is waiting
        pass


def _put_all(items) -> None:
    for q, delivery in items:
        q.put_nowait(delivery)


def deliver(pairs) -> None:
    """Hand (sink, delivery) pairs over, batching those of LoopSinks per event loop."""
    by_loop: dict = {}
    for sink, delivery in pairs:
        if isinstance(sink, LoopSink):
            by_loop.setdefault(sink.loop, []).append((sink.queue, delivery))
        else:
            sink(delivery)
    for loop, items in by_loop.items():
        _call_soon(loop, _put_all, items)


class RequestTimeout(Exception):
    """A request ran past its ``--timeout``; the engine aborted it and freed its blocks."""


SHUTDOWN_MESSAGE = "the server is shutting down"
TIMEOUT_MESSAGE = "the request ran past the server's --timeout and was ended; its KV blocks were freed"


@dataclass(frozen=True)
class Delivery:
    """What a request's sink receives: an engine event, or an error (then nothing follows)."""

    event: Event | None
    cached_prompt_tokens: int = 0
    error: BaseException | None = None


class EngineWorker:
    """Builds the Engine and runs its loop on the thread that calls ``serve_forever``.

    That thread should be the main thread: MLX 0.32 may abort the process at exit once
    a secondary thread has evaluated arrays (ml-explore/mlx#3126), so the HTTP server
    runs on a secondary thread instead and never touches MLX; it reads the metrics
    the engine thread publishes.

    Args:
        build: returns the Engine (model loading included); called by ``setup``.
        prefix_store_factory: optional, called with the engine; returns a ``PrefixStore``
            whose segments are loaded before serving starts.
        kv_cap_bytes: the ``--kv-memory`` cap (None: the pool grows), for metrics.
        sync: a ``distributed.RankSync`` when serving across ranks: rank 0's commands
            and sampled tokens are shared with every rank each iteration.
    """

    def __init__(self, build, *, prefix_store_factory=None, kv_cap_bytes: int | None = None, sync=None):
        self._build = build
        self.sync = sync
        self._pending_sinks: dict = {}  # sinks of "add" commands taken off the queue, not yet applied
        self._store_factory = prefix_store_factory
        self.kv_cap_bytes = kv_cap_bytes
        self.engine: Engine | None = None
        self.store = None
        self.restorer = None  # the disk tier on demand (a store, one rank, prefix sharing on)
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict = {}
        self._requests: dict = {}  # the Request of each sink (the engine forgets finished ones)
        self._stopping = False
        self._drain_until: float | None = None  # shutdown(): when running requests are ended
        self._deadlines: dict = {}  # request id -> monotonic time it must be done by (rank 0)
        self.failed: str | None = None  # why the engine loop died, if it did
        self.finished = {"stop": 0, "length": 0, "abort": 0, "error": 0, "timeout": 0}
        self._recent: deque = deque()  # (time, generated tokens) over the last 10 s
        self._recent_tokens = 0  # the sum of the generated tokens in _recent
        self._published: dict = {}
        self.max_prompt_tokens: int | None = None
        self.max_sequence_tokens: int | None = None
        self.uses_priority = False  # whether the engine's scheduling policy reads requests' priority

    # ------------------------------------------------------------------ control (any thread)

    def submit(self, request_id, prompt: list, *, max_tokens: int, sampling, stop_token_ids, sink,
               logprobs: int | None = None, timeout: float | None = None, priority: int = 0,
               speculative: bool = True) -> None:
        """Queue a request. ``timeout``: seconds from now after which the engine aborts it
        (its sink then gets ``RequestTimeout``)."""
        if self._stopping or self.failed:
            raise RuntimeError(self.failed or SHUTDOWN_MESSAGE)
        if timeout is not None:
            self._deadlines[request_id] = time.monotonic() + timeout
        self._commands.put(("add", request_id, dict(prompt=prompt, max_tokens=max_tokens, sampling=sampling,
                                                    stop_token_ids=stop_token_ids, logprobs=logprobs,
                                                    priority=priority, speculative=speculative), sink))

    def abort(self, request_id, reason: str = "abort") -> None:
        """Drop a live request. ``reason`` is what it is counted as: "abort" (the client
        left), or "stop" (a stop string ended it: its prefix is recorded as for any finish)."""
        self._commands.put(("abort", request_id, reason, None))

    def stop(self) -> None:
        """Ask ``serve_forever`` to return now, ending what runs (safe from signal handlers
        and other threads)."""
        self._stopping = True
        self._commands.put(("stop", None, None, None))

    def shutdown(self, timeout: float) -> None:
        """Refuse new requests, let running ones finish for up to ``timeout`` seconds, then
        stop (safe from signal handlers). A second call stops now."""
        if self._drain_until is not None:
            self.stop()
            return
        self._drain_until = time.monotonic() + timeout
        self._stopping = True
        self._commands.put(("wake", None, None, None))  # an idle loop notices at once

    @property
    def stopping(self) -> bool:
        return self._stopping

    def snapshot(self) -> dict:
        """The numbers the engine thread published last (for ``/metrics``)."""
        return dict(self._published)

    # ------------------------------------------------------------------ the engine thread

    def setup(self) -> None:
        """Build the engine, load the prefix store, publish the first metrics."""
        self.engine = self._build()
        self.max_prompt_tokens = self.engine.max_prompt_tokens
        self.max_sequence_tokens = self.engine.max_sequence_tokens
        self.uses_priority = self.engine.scheduler.uses_priority
        if self._store_factory is not None:
            self.store = self._store_factory(self.engine)
            self.engine.on_finish = self._record_prefix
            self.store.load()
            # Across ranks every rank would restore on its own clock and the ranks' block
            # tables would part: there the store is read at start only.
            if self.sync is None and self.engine.prefix_sharing:
                from .restorer import Restorer

                self.restorer = Restorer(self.store, wake=lambda: self._commands.put(("wake", None, None, None)))
        self._publish()

    def serve_forever(self) -> None:
        """Step the engine until ``stop()``; then fail what is left, close the store and the engine."""
        try:
            self._loop()
        except BaseException as e:
            self.failed = f"the engine loop died: {type(e).__name__}: {e}"
            if self.sync is not None:
                self.failed += f" (rank {self.sync.rank} of {self.sync.size}: another rank has probably died)"
            log.error("%s\n%s", self.failed, traceback.format_exc())
            self._fail_all(RuntimeError(self.failed))
            if not isinstance(e, Exception):
                raise
        finally:
            self._stopping = True
            if self.restorer is not None:
                self.restorer.close()
            if self.store is not None:
                try:
                    self.store.close()  # the prefixes queued by the last requests
                except Exception as e:
                    log.warning("prompt cache: could not save on shutdown (%s)", e)
            self.engine.close()
            self._fail_pending_commands()
            self._publish()

    def _loop(self) -> None:
        while self.iterate():
            pass

    def iterate(self) -> bool:
        """One turn of the engine loop: take commands, hand restored requests over, step,
        save, publish. False once a stop command ended every request (tests drive the loop
        with it, on their own thread)."""
        engine, sync = self.engine, self.sync
        commands = []
        if sync is None or sync.leader:
            commands = self._collect(wait=not engine.has_work())
            commands += self._expired()
            if self._drain_until is not None and (time.monotonic() >= self._drain_until
                                                  or not (engine.has_work() or self._pending_sinks
                                                          or any(c[0] == "add" for c in commands))):
                commands.append(["stop", None])
        if sync is not None:
            commands = sync.share_commands(commands)  # rank 0's list, on every rank
        for command in commands:
            if command[0] == "stop":
                self._end_all_for_shutdown()
                return False
            self._apply(command)
        if self.restorer is not None:
            for command in self.restorer.ready():  # their blocks are in: on to the engine
                self._apply(command, restored=True)
        if engine.has_work():
            self._step()
        if self.restorer is not None:
            self.restorer.release()  # the step admitted what was restored before it
        if self.store is not None:
            self.store.flush()  # one save batch per step: the index is written once
        self._publish()
        return True

    def _expired(self) -> list:
        """Abort commands for the requests past their deadline (rank 0 decides)."""
        if not self._deadlines:
            return []
        now = time.monotonic()
        late = [rid for rid, t in self._deadlines.items() if t <= now]
        for rid in late:
            del self._deadlines[rid]
        return [["abort", rid, "timeout"] for rid in late]

    def _end_all_for_shutdown(self) -> None:
        """Save the full prompt blocks of what still runs, then end every live request."""
        if self.store is not None:
            for request in list(self.engine.running):
                if request.request_id in self._sinks:
                    self._record_prefix(request)
        self._fail_all(RuntimeError(SHUTDOWN_MESSAGE))

    def _collect(self, wait: bool) -> list:
        """Drain the queue into JSON-able commands (sinks stay here, by request id).

        Idle, wait up to 0.5 s for the first one, so that signal handlers run promptly
        (and, across ranks, rank 0 sends a heartbeat that often)."""
        from .distributed import encode_add

        commands = []
        try:
            item = self._commands.get(timeout=0.5) if wait else self._commands.get_nowait()
        except queue.Empty:
            return commands
        while True:
            kind, request_id, kwargs, sink = item
            if kind == "add":
                self._pending_sinks[request_id] = sink
                commands.append(encode_add(request_id, kwargs))
            elif kind == "abort":
                commands.append([kind, request_id, kwargs])  # kwargs: the reason
            elif kind == "wake":
                pass
            else:
                commands.append([kind, request_id])
            if kind == "stop":
                return commands
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return commands

    def _apply(self, command, restored: bool = False) -> None:
        """Apply one command; ``restored``: an add whose disk blocks were read back already."""
        from .distributed import decode_add

        kind, request_id = command[0], command[1]
        engine = self.engine
        if kind == "add":
            request = decode_add(command[2])
            if not restored and self.restorer is not None and self.restorer.hold(request_id, command,
                                                                                   request["prompt"]):
                return  # its sink waits in _pending_sinks until ``ready`` hands it back
            sink = self._pending_sinks.pop(request_id, None)  # None on ranks other than 0
            try:
                engine.add_request(request_id=request_id, **request)
            except (ValueError, TypeError) as e:
                if sink is not None:
                    sink(Delivery(None, error=e))
                return
            if sink is not None:
                self._sinks[request_id] = sink
                self._requests[request_id] = engine.requests[request_id]
        elif kind == "abort":
            reason = command[2] if len(command) > 2 else "abort"
            if self.restorer is not None and self.restorer.cancel(request_id):  # still waiting for the disk
                self.finished[reason] = self.finished.get(reason, 0) + 1
                sink = self._pending_sinks.pop(request_id, None)
                self._deadlines.pop(request_id, None)
                if reason == "timeout" and sink is not None:
                    sink(Delivery(None, error=RequestTimeout(TIMEOUT_MESSAGE)))
                return
            request = engine.requests.get(request_id)
            if (reason == "stop" and self.store is not None and request is not None and not request.finished
                    and request in engine.running):
                self._record_prefix(request)  # as Engine.on_finish would for a normal finish
            if engine.abort(request_id):
                self.finished[reason] = self.finished.get(reason, 0) + 1
            sink = self._sinks.pop(request_id, None)
            self._requests.pop(request_id, None)
            self._deadlines.pop(request_id, None)
            if reason == "timeout" and sink is not None:
                sink(Delivery(None, error=RequestTimeout(TIMEOUT_MESSAGE)))

    def _step(self) -> None:
        engine = self.engine
        try:
            events = engine.step()
        except Exception as e:  # keep serving: drop what was live, report it to its clients
            log.error("engine step failed: %s\n%s", e, traceback.format_exc())
            self._fail_all(RuntimeError(f"generation failed: {type(e).__name__}: {e}"))
            return
        now = time.monotonic()
        generated = 0
        out = []
        for event in events:
            sink = self._sinks.get(event.request_id)
            request = self._requests.get(event.request_id)
            if event.token is not None:
                generated += 1
            if event.finished:
                self._sinks.pop(event.request_id, None)
                self._requests.pop(event.request_id, None)
                self._deadlines.pop(event.request_id, None)
                self.finished[event.finish_reason] = self.finished.get(event.finish_reason, 0) + 1
            if sink is not None:
                cached = request.cached_prompt_tokens if request is not None else 0
                out.append((sink, Delivery(event, cached)))
        deliver(out)
        self._recent.append((now, generated))
        self._recent_tokens += generated
        while self._recent and now - self._recent[0][0] > 10:
            self._recent_tokens -= self._recent.popleft()[1]

    def _fail_all(self, error: BaseException) -> None:
        for request_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine may be the thing that broke
                pass
            self.finished["error"] += 1
            sink(Delivery(None, error=error))
        self._sinks.clear()
        self._requests.clear()
        self._deadlines.clear()

    def _fail_pending_commands(self) -> None:
        """Requests submitted while the loop was ending get an error instead of silence."""
        error = RuntimeError(self.failed or SHUTDOWN_MESSAGE)
        for sink in self._pending_sinks.values():
            sink(Delivery(None, error=error))
        self._pending_sinks.clear()
        while True:
            try:
                kind, _, _, sink = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                sink(Delivery(None, error=error))

    def _record_prefix(self, request) -> None:
        seq = request.request_id
        held = self.engine.cache.num_tokens(seq)
        try:
            self.store.record(seq, request.known_tokens[:held])
        except Exception as e:  # persisting is best effort; serving goes on
            log.warning("prompt cache: could not save a prefix (%s)", e)

    def _publish(self) -> None:
        """Compute the metrics here, on the engine thread, and publish them as one dict."""
        engine, cache = self.engine, self.engine.cache
        pool_bytes, used_bytes = cache.nbytes, cache.used_bytes
        recent = self._recent
        span = recent[-1][0] - recent[0][0] if len(recent) > 1 else 0.0
        rate = (self._recent_tokens - recent[0][1]) / span if span > 0 else 0.0  # tokens after the first entry
        prompt_total = engine.prompt_tokens_cached + engine.prompt_tokens_computed
        store = self.store
        self._published = {
            "ranks": self.sync.size if self.sync is not None else 1,
            "requests_running": len(engine.running),
            "requests_waiting": len(engine.waiting),
            "requests_finished": dict(self.finished),
            "generated_tokens": engine.generated_tokens,
            "generation_tokens_per_second": rate,
            "prompt_tokens": prompt_total,
            "prompt_tokens_cached": engine.prompt_tokens_cached,
            "prefix_hit_rate": engine.prompt_tokens_cached / prompt_total if prompt_total else 0.0,
            "preemptions": engine.preemptions,
            "decode_steps": engine.decode_steps,
            "spec_draft_tokens": engine.drafted_tokens,
            "spec_accepted_tokens": engine.accepted_tokens,
            "spec_acceptance_rate": engine.acceptance_rate,
            "spec_verify_passes": engine.verify_passes,
            "decode_tokens_per_pass": engine.tokens_per_pass,
            "cascade_steps": engine.cache.cascade_steps,
            "kv_pool_bytes": pool_bytes,
            "kv_used_bytes": used_bytes,
            "kv_free_bytes": (self.kv_cap_bytes if self.kv_cap_bytes is not None else pool_bytes) - used_bytes,
            "kv_cap_bytes": self.kv_cap_bytes,
            "kv_peak_used_bytes": engine.peak_used_bytes,
            "kv_peak_pool_bytes": engine.peak_nbytes,
            **self._block_counts(),
            "prompt_cache_loaded_blocks": store.loaded_blocks if store is not None else 0,
            "prompt_cache_saved_blocks": store.saved_blocks if store is not None else 0,
            "prompt_cache_warnings": store.warnings if store is not None else 0,
            "prompt_cache_bytes": store.bytes_on_disk if store is not None else 0,
            "prompt_cache_segments": len(store.entries) if store is not None else 0,
            "prompt_cache_discarded_files": store.discarded_files if store is not None else 0,
            "prompt_cache_evicted_segments": store.evicted_segments if store is not None else 0,
            "prompt_cache_saving": int(store.saving) if store is not None else 0,
            **self._restore_counts(),
        }

    def _restore_counts(self) -> dict:
        """The disk tier on demand: what came back, what it cost, what was recomputed."""
        store, restorer = self.store, self.restorer
        names = ("restores", "restored_tokens", "restore_seconds", "restore_bytes", "restore_misses",
                 "restore_missed_tokens")
        counts = {f"prompt_cache_{n}": getattr(store, n) if store is not None else 0 for n in names}
        counts["prompt_cache_restores_in_flight"] = restorer.in_flight if restorer is not None else 0
        return counts

    def _block_counts(self) -> dict:
        """Blocks of every layer-group pool together: owned by live requests, published and
        unowned (the prefix cache), on the free list. Owned + cached + free = total."""
        counts = {"kv_blocks_total": 0, "kv_blocks_owned": 0, "kv_blocks_cached": 0, "kv_blocks_pinned": 0,
                  "kv_blocks_free": 0}
        for pool in self.engine.cache.pools:
            a = pool.allocator
            counts["kv_blocks_total"] += a.num_blocks
            counts["kv_blocks_owned"] += a.num_owned
            counts["kv_blocks_cached"] += a.num_cached
            counts["kv_blocks_pinned"] += a.num_pinned
            counts["kv_blocks_free"] += a.num_free_listed
        return counts
