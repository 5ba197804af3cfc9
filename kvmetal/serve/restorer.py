"""The disk tier on demand: a returning request's prefix blocks come back from the
prefix store instead of being recomputed, without running streams waiting for the disk.

When an "add" command arrives, the worker asks ``hold``: if the prompt continues a
chain whose next blocks are on disk but not in the pool, a restore thread reads those
segment files (NumPy, one read each) and the request is held back. Each loop iteration
the worker calls ``ready``: finished reads are put into the pool on the engine thread
(a copy per layer array, no per-row work) and their requests go to the engine, whose
scheduler then finds the blocks cached. The restored blocks stay owned by a holding
sequence until the step after the request joined (``release``), so nothing recycles
them before its admission; after that they are ordinary cached blocks.

A read that fails, a segment that is damaged or does not match the prompt, or a pool
with no room turns the restore into a *miss*: a warning (damaged segments are dropped
from the store), and the request is added as it came, so its tokens are recomputed:
never a wrong token. Requests that return to the same chain at once both read it; the
second install finds the blocks cached and restores nothing.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from ..cache import KVCacheFull
from .prefix_store import DamagedSegment, RestorePlan, read_plan
from .segment_file import Buffers

log = logging.getLogger("kvmetal.serve")


@dataclass
class _Held:
    command: list
    plan: RestorePlan
    future: object
    started: float


class Restorer:
    """Restores for one ``PrefixStore``; every method runs on the engine thread.

    Args:
        store: the server's ``PrefixStore``.
        wake: called (from the restore thread) when a read finishes, so that an idle
            engine loop notices at once.
    """

    def __init__(self, store, wake):
        self.store = store
        self._wake = wake
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmetal-restore")
        self._buffers = Buffers()
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
        future = self._reader.submit(read_plan, plan, self._buffers)
        future.add_done_callback(lambda _: self._wake())
        self._held[request_id] = _Held(command, plan, future, time.perf_counter())
        return True

    def cancel(self, request_id) -> bool:
        """Forget a held request (aborted or timed out before its blocks came)."""
        held = self._held.pop(request_id, None)
        if held is None:
            return False
        if not held.future.cancel():  # under way: its buffers come back when it is done
            held.future.add_done_callback(self._give_back)
        return True

    def _give_back(self, future) -> None:
        if not future.cancelled() and future.exception() is None:
            self._buffers.give(d.buffer for d in future.result().values())

    def ready(self) -> list:
        """The commands of held requests whose reads finished, their blocks installed (or
        not: a miss), in arrival order."""
        out = []
        for request_id, held in list(self._held.items()):
            if not held.future.done():
                continue
            del self._held[request_id]
            self._install(request_id, held)
            out.append(held.command)
        return out

    def release(self) -> None:
        """Free the holding sequences of the restores installed before this step."""
        cache = self.store.model_cache
        for seq in self._holding:
            if seq in cache:
                cache.free(seq)
        self._holding.clear()

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)

    def _install(self, request_id, held: _Held) -> None:
        store, plan = self.store, held.plan
        seq = ("kvmetal-restore", request_id)
        wanted = (plan.end - plan.first) * store.block_size
        try:
            segments = held.future.result()
            try:
                restored = store.install(plan, segments, seq)
            finally:  # mx.array copied what it took from the views: the buffers are free again
                self._buffers.give(d.buffer for d in segments.values())
        except DamagedSegment as e:
            store.drop_segment(e.key, str(e))
            self._miss(wanted)
            return
        except KVCacheFull:
            log.info("prompt cache: no room in the KV pool to restore %d tokens; they are recomputed", wanted)
            self._miss(wanted)
            return
        except Exception as e:  # anything else: recompute rather than stop serving
            log.warning("prompt cache: a restore failed (%s: %s); its tokens are recomputed", type(e).__name__, e)
            self._miss(wanted)
            return
        if restored:
            self._holding.append(seq)
            store.restores += 1
            store.restored_tokens += restored
            store.restore_bytes += plan.nbytes
            store.restore_seconds += time.perf_counter() - held.started
        else:  # another request brought the same blocks back first
            store.model_cache.free(seq)

    def _miss(self, tokens: int) -> None:
        self.store.restore_misses += 1
        self.store.restore_missed_tokens += tokens
