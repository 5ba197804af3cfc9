"""The prefix store as a second tier, on demand: a returning session's blocks, evicted
from the pool while the server ran, come back from disk instead of being recomputed.

The worker's loop is driven by hand (``iterate``) on the test's thread with the tiny
layout model; the sessions, the flood that evicts them and the returning turn are token
lists. Reference tokens come from a pool large enough that nothing is ever evicted.
"""
from __future__ import annotations

import json
import os
import random
import time

import mlx.core as mx
import numpy as np
import pytest

from kvmetal.engine.engine import Engine
from kvmetal.engine.sampler import SamplingParams
from kvmetal.kv_format import KVFormat
from kvmetal.serve import segment_file
from kvmetal.serve.prefix_store import PrefixStore
from kvmetal.serve.worker import EngineWorker
from kvcases import kv_layout_model

BS = 16
FORMATS = {"float32": None, "K8/V4": KVFormat(k_bits=8, v_bits=4, k_group_size=32, v_group_size=32)}


def tokens(seed: int, n: int) -> list:
    rng = random.Random(seed)
    return [rng.randrange(1, 250) for _ in range(n)]


def make_worker(tmp_path, num_blocks, kv_format=None, store=True, max_bytes=None, background=False):
    def build():
        return Engine(kv_layout_model(), block_size=BS, num_blocks=num_blocks, keep_finished=False,
                      kv_format=kv_format, async_steps=True)
    factory = None
    if store:
        def factory(engine):
            return PrefixStore(tmp_path / "store", {"model": "tiny"}, engine.cache, max_bytes=max_bytes,
                               background_writes=background)
    worker = EngineWorker(build, prefix_store_factory=factory)
    worker.setup()
    return worker


def run(worker, prompt, max_tokens=6, sampling=None, request_id=None):
    """Submit one request and turn the loop until it finishes; its tokens."""
    got = []
    request_id = request_id if request_id is not None else f"r{time.monotonic_ns()}"
    worker.submit(request_id, prompt, max_tokens=max_tokens, sampling=sampling, stop_token_ids=(), sink=got.append)
    deadline = time.monotonic() + 60
    while not (got and (got[-1].error is not None or got[-1].event.finished)):
        assert time.monotonic() < deadline, "the request did not finish"
        worker.iterate()
    assert got[-1].error is None, got[-1].error
    return [d.event.token for d in got if d.event.token is not None]


def close(worker):
    worker.stop()
    worker.serve_forever()


def sessions(rounds, sampling=None):
    """Three sessions sharing a system prompt take turns; each turn appends its answer
    and a new user message. Yields (session, prompt) and expects the answer sent back."""
    system = tokens(0, 40)
    history = {s: system + tokens(100 + s, 70) for s in range(3)}
    for turn in range(rounds):
        for s in range(3):
            answer = yield s, history[s]
            history[s] = history[s] + answer + tokens(1000 * turn + s, 30)


def replay(worker, rounds=3, sampling=None) -> list:
    answers, script = [], sessions(rounds)
    s, prompt = next(script)
    while True:
        answer = run(worker, prompt, sampling=sampling)
        answers.append(answer)
        try:
            s, prompt = script.send(answer)
        except StopIteration:
            return answers


@pytest.mark.parametrize("fmt,writes", [("float32", "inline"), ("K8/V4", "inline"), ("K8/V4", "background")])
def test_returning_sessions_restore_from_disk_with_the_tokens_of_a_pool_that_never_evicts(tmp_path, fmt, writes):
    hot = make_worker(tmp_path / "hot", None, FORMATS[fmt], store=False)
    try:
        expected = replay(hot)
    finally:
        close(hot)
    # 20 blocks hold one session's context, not three: every return finds its tail gone
    tier = make_worker(tmp_path, 20, FORMATS[fmt], background=writes == "background")
    try:
        got = replay(tier)
        m = tier.snapshot()
    finally:
        close(tier)
    assert got == expected
    # (a background writer may not have finished a segment when its session returns)
    assert m["prompt_cache_restores"] >= (1 if writes == "background" else 3)
    assert m["prompt_cache_restore_misses"] == 0
    assert m["prompt_cache_restored_tokens"] >= 3 * 6 * BS
    assert m["prompt_cache_restore_bytes"] > 0 and m["prompt_cache_restore_seconds"] > 0
    computed = m["prompt_tokens"] - m["prompt_tokens_cached"]
    # what was restored was not computed again: only new turns' tokens (and block tails)
    assert computed < m["prompt_tokens"] - m["prompt_cache_restored_tokens"]


def test_seeded_sampling_is_the_same_with_the_tier(tmp_path):
    sampling = SamplingParams(temperature=0.8, seed=7)
    hot = make_worker(tmp_path / "hot", None, store=False)
    try:
        expected = replay(hot, rounds=2, sampling=sampling)
    finally:
        close(hot)
    tier = make_worker(tmp_path, 20)
    try:
        assert replay(tier, rounds=2, sampling=sampling) == expected
        assert tier.snapshot()["prompt_cache_restores"] >= 1
    finally:
        close(tier)


def _damage_every_segment(root, how):
    for path in root.rglob("seg-*.safetensors"):
        data = bytearray(path.read_bytes())
        if how == "flip":  # one bit of one K/V array: the size, header and token ids stay right
            length = int.from_bytes(data[:8], "little")
            header = json.loads(bytes(data[8:8 + length]))
            begin, end = header["g0.l1.v.0"]["data_offsets"]
            data[8 + length + (begin + end) // 2] ^= 0x10
        elif how == "truncate":
            data = data[: len(data) // 2]
        path.write_bytes(bytes(data))


@pytest.mark.parametrize("how", ["flip", "truncate", "delete"])
def test_a_damaged_or_missing_segment_is_recomputed_with_a_warning_never_loaded(tmp_path, how, caplog):
    hot = make_worker(tmp_path / "hot", None, store=False)
    try:
        expected = replay(hot, rounds=2)
    finally:
        close(hot)
    tier = make_worker(tmp_path, 20)
    try:
        script = sessions(2)
        s, prompt = next(script)
        answers = []
        for i in range(6):
            if i == 3:  # every first-turn segment is on disk and evicted from the pool
                root = tier.store.root
                if how == "delete":
                    for path in root.glob("seg-*.safetensors"):
                        os.unlink(path)
                else:
                    _damage_every_segment(root, how)
            answers.append(run(tier, prompt))
            if i < 5:
                s, prompt = script.send(answers[-1])
        m = tier.snapshot()
    finally:
        close(tier)
    assert answers == expected
    assert m["prompt_cache_restore_misses"] >= 1 and m["prompt_cache_warnings"] >= 1
    if how == "flip":  # only the checksum can tell: the segments were never loaded
        assert m["prompt_cache_restored_tokens"] == 0 and "checksum" in caplog.text


def test_an_abort_while_blocks_are_read_back_frees_nothing_twice(tmp_path):
    tier = make_worker(tmp_path, 20)
    try:
        script = sessions(3)
        s, prompt = next(script)
        while tier.store.plan_restore(prompt) is None:  # until a session returns to blocks only on disk
            s, prompt = script.send(run(tier, prompt))
        got = []
        tier.submit("late", prompt, max_tokens=4, sampling=None, stop_token_ids=(), sink=got.append)
        tier._apply(tier._collect(wait=False)[0])  # held: its read is under way
        assert tier.restorer.in_flight == 1
        tier.abort("late")
        for _ in range(5):
            tier.iterate()
        assert tier.restorer.in_flight == 0 and tier.finished["abort"] == 1 and not got
        assert tier.engine.cache.used_bytes == 0
        assert run(tier, prompt)  # the same prompt again: restored, served
    finally:
        close(tier)


def test_segment_reader_reads_what_mlx_wrote(tmp_path):
    arrays = {"a": mx.arange(12, dtype=mx.float32).reshape(3, 4), "b": mx.array([1, 2, 3], dtype=mx.int32),
              "c": mx.ones((2, 5), dtype=mx.bfloat16) * 1.5, "d": mx.zeros((4,), dtype=mx.uint32) + 7}
    path = tmp_path / "x.safetensors"
    mx.save_safetensors(str(path), arrays)
    buffers = segment_file.Buffers()
    got = segment_file.read_segment(path, path.stat().st_size, buffers)
    for name, array in arrays.items():
        back = segment_file.to_mlx(*got.arrays[name])
        assert back.dtype == array.dtype and mx.array_equal(back, array).item(), name
    assert segment_file.checksum(got.arrays) == segment_file.checksum(
        {n: segment_file.to_numpy(a) for n, a in arrays.items()})
    buffers.give([got.buffer])  # reused by the next read of a file that fits
    assert segment_file.read_segment(path, path.stat().st_size, buffers).buffer is got.buffer
    with pytest.raises(segment_file.SegmentError, match="index says"):
        segment_file.read_segment(path, path.stat().st_size + 1)
    raw = np.fromfile(path, dtype=np.uint8)
    raw[:8] = np.frombuffer((10**9).to_bytes(8, "little"), dtype=np.uint8)
    with pytest.raises(segment_file.SegmentError, match="header claims"):
        segment_file.parse(raw)


def test_a_prompt_that_leaves_a_segment_midway_restores_the_blocks_it_shares(tmp_path, caplog):
    long = tokens(5, 10 * BS + 3)
    branch = long[: 6 * BS] + tokens(7, 2 * BS)
    hot = make_worker(tmp_path / "hot", None, store=False)
    try:
        expected = run(hot, branch)
    finally:
        close(hot)
    tier = make_worker(tmp_path, 20)
    try:
        run(tier, long)  # one segment of 10 blocks on disk
        run(tier, tokens(6, 15 * BS))  # the flood: long's blocks leave the pool, tail first
        plan = tier.store.plan_restore(branch)
        assert plan is not None and plan.first < 6 and plan.end == 6 and len(plan.segments) == 1
        assert run(tier, branch) == expected
        m = tier.snapshot()
        assert m["prompt_cache_restored_tokens"] == (6 - plan.first) * BS and m["prompt_cache_restore_misses"] == 0
        assert "dropped" not in caplog.text
    finally:
        close(tier)
