"""The engine thread: the only thread that touches the model, the cache and MLX.

HTTP handlers (async, on uvicorn's event loop) talk to it through a command queue
(add, abort, stop) and receive their tokens through a per-request ``sink`` callable,
which the handler makes thread-safe (``loop.call_soon_threadsafe``). The thread
steps the Engine while any request is live and sleeps on the queue otherwise.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import deque
from dataclasses import dataclass

from ..integrations.engine import Engine, Event

log = logging.getLogger("kvmetal.serve")


@dataclass(frozen=True)
class Delivery:
    """What a request's sink receives: an engine event, or an error (then nothing follows)."""

    event: Event | None
    cached_prompt_tokens: int = 0
    error: BaseException | None = None


class EngineWorker:
    """Runs ``build()`` (which returns an ``Engine``) and then the engine loop on one thread.

    Args:
        build: called on the engine thread; returns the Engine (model loading included).
        prefix_store_factory: optional, called on the engine thread with the engine;
            returns a ``PrefixStore`` whose segments are loaded before serving starts.
        kv_cap_bytes: the ``--kv-memory`` cap (None: the pool grows), for metrics.
    """

    def __init__(self, build, *, prefix_store_factory=None, kv_cap_bytes: int | None = None, context=None):
        self._build = build
        self._context = context  # a context manager factory entered on the engine thread (backend)
        self._store_factory = prefix_store_factory
        self.kv_cap_bytes = kv_cap_bytes
        self.engine: Engine | None = None
        self.store = None
        self._commands: queue.Queue = queue.Queue()
        self._sinks: dict = {}
        self._ready = threading.Event()
        self._startup_error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, name="kvmetal-engine", daemon=True)
        self._stopped = False
        self.failed: str | None = None  # why the engine loop died, if it did
        # metrics, written by the engine thread only
        self.finished = {"stop": 0, "length": 0, "abort": 0, "error": 0}
        self.peak_kv_used_bytes = 0
        self.peak_kv_pool_bytes = 0
        self._recent: deque = deque()  # (time, generated tokens) over the last window
        self._recent_lock = threading.Lock()
        self.max_prompt_tokens: int | None = None
        self.max_sequence_tokens: int | None = None

    # ------------------------------------------------------------------ control (any thread)

    def start(self, timeout: float | None = None) -> None:
        """Start the thread and wait until the engine is built (re-raises its error)."""
        self._thread.start()
        self._ready.wait(timeout)
        if self._startup_error is not None:
            raise self._startup_error

    def submit(self, request_id, prompt: list, *, max_tokens: int, sampling, stop_token_ids, sink) -> None:
        self._check_alive()
        self._commands.put(("add", request_id, dict(prompt=prompt, max_tokens=max_tokens, sampling=sampling,
                                                    stop_token_ids=stop_token_ids), sink))

    def abort(self, request_id) -> None:
        self._commands.put(("abort", request_id, None, None))

    def stop(self, timeout: float = 30) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._commands.put(("stop", None, None, None))
        self._thread.join(timeout)

    def _check_alive(self) -> None:
        if self._stopped or self.failed:
            raise RuntimeError(self.failed or "the engine is shutting down")

    # ------------------------------------------------------------------ the engine thread

    def _main(self) -> None:
        import contextlib

        with (self._context or contextlib.nullcontext)():
            self._serve()

    def _serve(self) -> None:
        try:
            self.engine = self._build()
            self.max_prompt_tokens = self.engine.max_prompt_tokens
            self.max_sequence_tokens = self.engine.max_sequence_tokens
            if self._store_factory is not None:
                self.store = self._store_factory(self.engine)
                self.engine.on_finish = self._record_prefix
                self.store.load()
            self._update_peaks()
        except BaseException as e:  # reported to start()
            self._startup_error = e
            self._ready.set()
            return
        self._ready.set()
        try:
            self._loop()
        except BaseException as e:
            self.failed = f"the engine thread died: {type(e).__name__}: {e}"
            log.error("%s\n%s", self.failed, traceback.format_exc())
            self._fail_all(RuntimeError(self.failed))
        finally:
            if self.store is not None:
                self.store.close()
            self.engine.close()
            self._fail_pending_commands()

    def _loop(self) -> None:
        engine = self.engine
        while True:
            try:
                command = self._commands.get(timeout=None if not engine.has_work() else 0)
            except queue.Empty:
                command = None
            while command is not None:
                if command[0] == "stop":
                    self._fail_all(RuntimeError("the server is shutting down"))
                    return
                self._apply(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if engine.has_work():
                self._step()

    def _apply(self, command) -> None:
        kind, request_id, kwargs, sink = command
        engine = self.engine
        if kind == "add":
            try:
                engine.add_request(request_id=request_id, **kwargs)
            except (ValueError, TypeError) as e:
                sink(Delivery(None, error=e))
                return
            self._sinks[request_id] = sink
        elif kind == "abort":
            if engine.abort(request_id):
                self.finished["abort"] += 1
            self._sinks.pop(request_id, None)

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
        for event in events:
            request = engine.requests.get(event.request_id)
            sink = self._sinks.get(event.request_id)
            if event.token is not None:
                generated += 1
            if event.finished:
                self._sinks.pop(event.request_id, None)
                self.finished[event.finish_reason] = self.finished.get(event.finish_reason, 0) + 1
            if sink is not None:
                cached = request.cached_prompt_tokens if request is not None else 0
                sink(Delivery(event, cached))
        with self._recent_lock:
            self._recent.append((now, generated))
            while self._recent and now - self._recent[0][0] > 10:
                self._recent.popleft()
        self._update_peaks()

    def _fail_all(self, error: BaseException) -> None:
        for request_id, sink in list(self._sinks.items()):
            try:
                self.engine.abort(request_id)
            except Exception:  # the engine may be the thing that broke
                pass
            self.finished["error"] += 1
            sink(Delivery(None, error=error))
        self._sinks.clear()

    def _fail_pending_commands(self) -> None:
        """Requests submitted while the loop was ending get an error instead of silence."""
        while True:
            try:
                kind, _, _, sink = self._commands.get_nowait()
            except queue.Empty:
                return
            if kind == "add":
                sink(Delivery(None, error=RuntimeError(self.failed or "the server is shutting down")))

    def _record_prefix(self, request) -> None:
        seq = request.request_id
        held = self.engine.cache.num_tokens(seq)
        try:
            self.store.record(seq, request.tokens[:held])
        except Exception as e:  # persisting is best effort; serving goes on
            log.warning("prompt cache: could not save a prefix (%s)", e)

    def _update_peaks(self) -> None:
        cache = self.engine.cache
        self.peak_kv_used_bytes = max(self.peak_kv_used_bytes, cache.used_bytes, cache.peak_used_bytes)
        self.peak_kv_pool_bytes = max(self.peak_kv_pool_bytes, cache.nbytes)

    # ------------------------------------------------------------------ metrics (any thread)

    def snapshot(self) -> dict:
        """Numbers for ``/metrics``; read without locks (each value is one attribute read)."""
        engine = self.engine
        cache = engine.cache
        pool_bytes, used_bytes = cache.nbytes, cache.used_bytes
        with self._recent_lock:
            recent = list(self._recent)
        span = recent[-1][0] - recent[0][0] if len(recent) > 1 else 0.0
        rate = sum(n for _, n in recent[1:]) / span if span > 0 else 0.0
        prompt_total = engine.prompt_tokens_cached + engine.prompt_tokens_computed
        return {
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
            "kv_pool_bytes": pool_bytes,
            "kv_used_bytes": used_bytes,
            "kv_free_bytes": (self.kv_cap_bytes if self.kv_cap_bytes is not None else pool_bytes) - used_bytes,
            "kv_cap_bytes": self.kv_cap_bytes,
            "kv_peak_used_bytes": max(self.peak_kv_used_bytes, used_bytes),
            "kv_peak_pool_bytes": max(self.peak_kv_pool_bytes, pool_bytes),
            "prompt_cache_loaded_blocks": self.store.loaded_blocks if self.store is not None else 0,
            "prompt_cache_saved_blocks": self.store.saved_blocks if self.store is not None else 0,
        }
