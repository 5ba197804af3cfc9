"""``kvmetal serve`` across ranks, under ``mlx.launch`` (tensor parallel over mx.distributed).

    mlx.launch -n 2 --backend ring --python $(which python) $(which kvmetal) serve --model DIR

Every rank loads the model sharded with mlx-lm's ``sharded_load`` (each rank keeps its
share of the attention and kv heads, so its KV pools hold only its kv heads) and runs
the same Engine. Rank 0 alone serves HTTP. Each engine iteration:

1. rank 0 takes what its HTTP side queued (new requests, aborts, stop) and shares that
   list with every rank (``share_commands``: two ``all_sum`` collectives, the length,
   then the bytes; the other ranks contribute zeros);
2. every rank applies the same list to its own Engine and runs the same ``step()``:
   the batched forward pass's collectives keep the ranks together;
3. sampled tokens are rank 0's (``share_tokens``), so no rounding difference between
   ranks can make them append different tokens.

Admission, preemption and prefix hits are then decided by identical allocators fed
identical inputs: they cannot differ between ranks, and nothing else needs to be sent.
The pool size is rank 0's (``--kv-memory`` is a cap per rank).

A rank that dies must not hang the others: every collective runs under a watchdog,
and one that takes longer than ``--rank-timeout`` seconds ends the process with a
clear error (``mlx.launch`` then stops the other ranks). Rank 0 sends an empty command
list at least every 0.5 s while idle, which doubles as the heartbeat.
"""
from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import threading
import time

import mlx.core as mx
import numpy as np

from ..engine.sampler import SamplingParams

log = logging.getLogger("kvmetal.serve")


class RankSync:
    """Rank 0's choices, shared with every rank of ``group``, with a hang watchdog."""

    def __init__(self, group, *, timeout_s: float = 60.0):
        self.group = group
        self.rank, self.size = group.rank(), group.size()
        self.timeout_s = timeout_s
        self._deadline = None  # set while a collective runs
        self._what = ""
        threading.Thread(target=self._watch, name="kvmetal-rank-watchdog", daemon=True).start()

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def _watch(self) -> None:
        while True:
            time.sleep(0.2)
            deadline = self._deadline
            if deadline is not None and time.monotonic() > deadline:
                message = (f"kvmetal serve: rank {self.rank}/{self.size}: {self._what} did not complete in "
                           f"{self.timeout_s:g} s; another rank has probably died. Exiting.")
                log.critical(message)
                print(message, file=sys.stderr, flush=True)
                os._exit(3)

    def _all_sum(self, x: mx.array, what: str) -> mx.array:
        self._what = what
        self._deadline = time.monotonic() + self.timeout_s
        try:
            out = mx.distributed.all_sum(x, group=self.group)
            mx.eval(out)
            return out
        finally:
            self._deadline = None

    def share_bytes(self, data: bytes | None) -> bytes:
        """Rank 0's ``data`` on every rank (the others pass None)."""
        n = len(data) if self.leader else 0
        n = int(self._all_sum(mx.array([n], dtype=mx.int32), "sharing a command list").item())
        if n == 0:
            return b""
        buf = mx.array(np.frombuffer(data, dtype=np.uint8)) if self.leader else mx.zeros((n,), dtype=mx.uint8)
        return np.array(self._all_sum(buf, "sharing a command list")).tobytes()

    def share_commands(self, commands: list | None) -> list:
        """Rank 0's command list (JSON-able tuples) on every rank."""
        data = json.dumps(commands).encode() if self.leader else None
        out = self.share_bytes(data)
        return json.loads(out) if out else []

    def share_tokens(self, tokens: list) -> list:
        """Rank 0's sampled tokens on every rank."""
        mine = mx.array(tokens if self.leader else [0] * len(tokens), dtype=mx.int32)
        return [int(t) for t in self._all_sum(mine, "sharing sampled tokens").tolist()]

    def share_int(self, value: int | None) -> int | None:
        """Rank 0's int (or None) on every rank."""
        v = -1 if value is None else int(value)
        out = int(self._all_sum(mx.array([v if self.leader else 0], dtype=mx.int64), "sharing the pool size").item())
        return None if out == -1 else out


def encode_add(request_id, kwargs: dict) -> list:
    sampling = kwargs["sampling"]
    return ["add", request_id, {"prompt": [int(t) for t in kwargs["prompt"]], "max_tokens": kwargs["max_tokens"],
                                "sampling": None if sampling is None else dataclasses.asdict(sampling),
                                "stop_token_ids": sorted(int(t) for t in kwargs["stop_token_ids"]),
                                "logprobs": kwargs.get("logprobs"), "priority": kwargs.get("priority", 0),
                                "speculative": kwargs.get("speculative", True)}]


def decode_add(kwargs: dict) -> dict:
    """The add_request arguments; SamplingParams turns JSON's lists (logit_bias pairs,
    special tokens) back into its tuples."""
    sampling = kwargs["sampling"]
    return dict(kwargs, sampling=None if sampling is None else SamplingParams(**sampling))
