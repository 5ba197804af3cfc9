"""The disk tier on demand: a returning request's prefix blocks come back from the
prefix store instead of being recomputed, without running streams waiting for the disk.

When an "add" command arrives, the worker asks ``hold``: if the prompt continues a
chain whose next blocks are on disk but not in the pool, a restore thread reads those
segment files (NumPy, one read each, in chain order) and the request is held back. Each
loop iteration the worker calls ``ready``: every segment read by then goes into the pool
on the engine thread (a copy per layer array, no per-row work), so the engine installs
one segment while the thread reads the next; a request whose segments are all in goes
to the engine, whose scheduler then finds the blocks cached. The restored blocks stay
owned by a holding sequence until the step after the request joined (``release``), so
nothing recycles them before its admission; after that they are ordinary cached blocks.

A read that fails, a segment that is damaged or does not match the prompt, or a pool
with no room ends the restore there as a *miss*: a warning (damaged segments are
dropped from the store), the segments installed before it stay (they are whole), and
the request is added as it came, so the rest is recomputed: never a wrong token.
Requests that return to the same chain at once both read it; the second finds the
blocks cached and restores nothing.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..cache import KVCacheFull
from .prefix_store import DamagedSegment, RestorePlan, read_part
from .segment_file import Buffers

log = logging.getLogger("kvmetal.serve")


@dataclass
class _Held:
    command: list
    plan: RestorePlan
    parts: list  # one future per segment, in chain order
    started: float
    seq: tuple
    next: int = 0  # the next part to install
    restored: int = 0  # tokens installed so far
    read_bytes: int = 0  # of the parts installed


class Restorer:
    """Restores for one ``PrefixStore``; every method runs on the engine thread.

    Args:
        store: the server's ``PrefixStore``.
        wake: called (from the restore thread) when a read finishes, so that an idle
            engine loop notices at once.
        keep_buffer_bytes: read buffers kept for the next restores (a fresh buffer pays
            a page fault per 4 KB, slower than the disk here).
    """

    def __init__(self, store, wake, keep_buffer_bytes: int = 256 << 20):
        self.store = store
        self._wake = wake
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmetal-restore")
        self._buffers = Buffers(keep_buffer_bytes)
        self._held: dict = {}  # request id -> _Held, in arrival order
        self._holding: list = []  # sequences owning restored blocks until the next step ends

    @property
    def in_flight(self) -> int:
        """Requests waiting for their blocks."""
        return len(self._held)

    def hold(self, request_id, command: list, prompt) -> bool:
        """Start reading ``prompt``'s blocks that are only on disk; True: the request waits
        for them (``ready`` hands its command back), False: add it now."""
        try:
            plan = self.store.plan_restore(prompt)
        except (TypeError, ValueError, OverflowError):  # bad token ids: add_request says why
            return False
        if plan is None:
            return False
        parts = [self._reader.submit(read_part, plan, i, self._buffers) for i in range(len(plan.segments))]
        for part in parts:
            part.add_done_callback(lambda _: self._wake())
        self._held[request_id] = _Held(command, plan, parts, time.perf_counter(), ("kvmetal-restore", request_id))
        return True

    def cancel(self, request_id) -> bool:
        """Forget a held request (aborted or timed out before its blocks came)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        self._stop_reading(held)
        if held.seq in self.store.model_cache:
            self.store.model_cache.free(held.seq)  # what it installed stays cached
        return True

    def ready(self) -> list:
        """Install every segment read by now; the commands of the held requests that have
        all theirs in (or met a miss), in arrival order."""
        out = []
        for request_id, held in list(self._held.items()):
            done = self._install_ready_parts(held)
            if done:
                del self._held[request_id]
                self._account(held)
                out.append(held.command)
        return out

    def release(self) -> None:
        """Free the holding sequences of the restores handed over before this step."""
        cache = self.store.model_cache
        for seq in self._holding:
            if seq in cache:
                cache.free(seq)
        self._holding.clear()

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ internals

    def _install_ready_parts(self, held: _Held) -> bool:
        """Install the parts read so far, in order; True once the request can go on."""
        store, plan = self.store, held.plan
        while held.next < len(held.parts) and held.parts[held.next].done():
            i, held.next = held.next, held.next + 1
            try:
                data = held.parts[i].result()
                try:
                    held.restored += store.install_part(plan, i, data, held.seq)
                    held.read_bytes += plan.segments[i].bytes
                finally:  # mx.array copied what it took from the views: the buffer is free again
                    self._buffers.give([data.buffer])
            except DamagedSegment as e:
                store.drop_segment(e.key, str(e))
                return self._miss(held, i)
            except KVCacheFull:
                log.info("prompt cache: no room in the KV pool to restore %d tokens; they are recomputed",
                         (plan.end - plan.segments[i].lo) * store.block_size)
                return self._miss(held, i)
            except Exception as e:  # anything else: recompute rather than stop serving
                log.warning("prompt cache: a restore failed (%s: %s); its tokens are recomputed",
                            type(e).__name__, e)
                return self._miss(held, i)
        return held.next == len(held.parts)

    def _miss(self, held: _Held, i: int) -> bool:
        """Part ``i`` failed: the rest of the plan is recomputed (what is in stays)."""
        self._stop_reading(held)
        self.store.restore_misses += 1
        self.store.restore_missed_tokens += (held.plan.end - held.plan.segments[i].lo) * self.store.block_size
        return True

    def _stop_reading(self, held: _Held) -> None:
        for part in held.parts[held.next:]:
            if not part.cancel():  # under way: its buffer comes back when it is done
                part.add_done_callback(self._give_back)
        held.next = len(held.parts)

    def _give_back(self, part) -> None:
        if not part.cancelled() and part.exception() is None:
            self._buffers.give([part.result().buffer])

    def _account(self, held: _Held) -> None:
        store = self.store
        if held.restored:
            store.restores += 1
            store.restored_tokens += held.restored
            store.restore_bytes += held.read_bytes
            store.restore_seconds += time.perf_counter() - held.started
        if held.seq in store.model_cache:
            self._holding.append(held.seq)  # freed after the step that admits the request
