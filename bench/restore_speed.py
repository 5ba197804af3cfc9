"""How fast the disk tier brings a session back, against a plain sequential read of the
same files in the same run (issue 42, item 2).

    python bench/restore_speed.py                          # SmolLM2, 8K tokens, float32 and K8/V4
    python bench/restore_speed.py --tokens 32768 --formats k8v4 --json bench/restore_speed_smollm2.json

For each K/V format, an ``Engine`` on the real model holds a context of ``--tokens``
tokens whose blocks carry random bytes (I/O speed does not depend on the values; a
prefill this long would take minutes on this CPU); the prefix store writes them as the
server does when a request finishes, one segment per ``--segment-tokens`` (a turn of an
agent session). Then, ``--runs`` times: a flood evicts the blocks from the pool, and

- ``dd``: every segment file read sequentially through one 1 MiB buffer (what ``dd
  bs=1M`` does), the yardstick;
- ``read``: ``read_part`` for every segment, what the restore thread does: one read per
  segment into one buffer, the checksum verified;
- ``restore``: the server's path (``Restorer``): the restore thread reads the segments in
  order while this thread, standing for the engine loop, installs each one read so far
  (``install_part``: NumPy views to MLX, slice updates into the pool, evaluated), until
  the request could go on: the time a returning request waits for its blocks;
- ``install``: the part of ``restore`` spent on this thread (the engine thread's time,
  the only part running streams can feel).

"cold" runs drop the files from the page cache first (``posix_fadvise(DONTNEED)``) so
the bytes come from the disk, as they do for a session that idled; "warm" runs read
from the page cache. Reported: GB/s of file bytes for each, restore / dd, and the
engine thread's milliseconds per restore (the only part running streams can feel).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

FORMATS = {"float": dict(), "k8v4": dict(k_bits=8, v_bits=4, k_group_size=32, v_group_size=32)}


def drop_from_page_cache(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def dd_read(paths) -> int:
    """Sequential reads through one 1 MiB buffer; returns the bytes read."""
    buffer = memoryview(bytearray(1 << 20))
    total = 0
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            while n := os.readv(fd, [buffer]):
                total += n
        finally:
            os.close(fd)
    return total


def build_session(model, fmt: dict, tokens: int, segment_tokens: int, root: Path):
    """An engine whose pool held a ``tokens``-token context, written to the store in
    segments of ``segment_tokens``; returns (engine, store, the context's token ids)."""
    import mlx.core as mx
    import numpy as np

    from kvmetal.engine.engine import Engine
    from kvmetal.kv_format import KVFormat
    from kvmetal.serve.prefix_store import PrefixStore

    bs = 16
    engine = Engine(model, block_size=bs, num_blocks=2 * tokens // bs + 8, keep_finished=False,
                    kv_format=KVFormat(**fmt) if fmt else None)
    store = PrefixStore(root, {"model": "restore-speed"}, engine.cache)
    rng = np.random.default_rng(0)
    context = rng.integers(1, 30000, size=tokens + 1).tolist()
    for end in range(segment_tokens, tokens + 1, segment_tokens):  # one finishing turn per segment
        seq = ("turn", end)
        engine.cache.add_sequence(seq, context[:end])
        for pool in engine.cache.pools:
            ids = mx.array(pool.allocator.block_table(seq), dtype=mx.int32)
            for caches in (pool.key_caches, pool.value_caches):
                for layer in range(pool.num_layers):
                    for part in _parts(caches[layer]):
                        noise = mx.random.randint(0, 1 << 15, part[ids].shape).astype(mx.uint16)
                        part[ids] = noise.view(part.dtype) if part.dtype.size == 2 else noise.astype(part.dtype)
            mx.eval(pool.arrays())
        store.record(seq, context[:end])
        engine.cache.free(seq)
        store.flush()
    return engine, store, context


def _parts(cache) -> list:
    from kvmetal.integrations.model_cache import _pool_arrays

    return list(_pool_arrays(cache))


def flood(engine) -> None:
    """Evict every cached block: a sequence as large as the pool, then freed."""
    pool = engine.cache.pools[0]
    n = pool.allocator.num_free * pool.allocator.block_size
    engine.cache.add_sequence(("flood",), num_tokens=n)
    engine.cache.free(("flood",))


def measure(engine, store, context, runs: int, cold: bool) -> dict:
    """Best and median seconds of ``runs`` restores of ``context`` after a flood, the
    yardstick read of the same files in each run."""
    from kvmetal.serve.prefix_store import read_part
    from kvmetal.serve.restorer import Restorer
    from kvmetal.serve.segment_file import Buffers

    times = {"dd": [], "read": [], "install": [], "restore": []}
    buffers = Buffers(keep_bytes=4 << 30)  # warm buffers, as a long-running server has them
    restorer = Restorer(store, wake=lambda: None, keep_buffer_bytes=4 << 30)
    for run in range(runs + 1):  # run 0 warms the buffers up and is not counted
        flood(engine)
        plan = store.plan_restore(context)
        assert plan is not None and plan.first == 0, "the flood left blocks in the pool"
        paths = [g.path for g in plan.segments]
        nbytes = plan.nbytes
        if cold:
            drop_from_page_cache(paths)
        t = time.perf_counter()
        assert dd_read(paths) == nbytes
        times["dd"].append(time.perf_counter() - t)
        # the reads alone, as the restore thread does them (one read per file + checksum)
        if cold:
            drop_from_page_cache(paths)
        t = time.perf_counter()
        parts = [read_part(plan, i, buffers) for i in range(len(plan.segments))]
        times["read"].append(time.perf_counter() - t)
        buffers.give(p.buffer for p in parts)
        # the server's path: the restore thread reads while the engine thread installs
        if cold:
            drop_from_page_cache(paths)
        flood(engine)
        engine_seconds = [0.0]
        install_part = store.install_part

        def timed_install(*args):
            t0 = time.perf_counter()
            try:
                return install_part(*args)
            finally:
                engine_seconds[0] += time.perf_counter() - t0

        store.install_part = timed_install
        try:
            t = time.perf_counter()
            assert restorer.hold(("bench", run), ["add"], context)
            while not restorer.ready():
                time.sleep(0.0002)  # the engine loop's turn
            times["restore"].append(time.perf_counter() - t)
        finally:
            del store.install_part
            restorer.release()
        times["install"].append(engine_seconds[0])
        if run == 0:
            times = {k: [] for k in times}
    restorer.close()
    best = {k: min(v) for k, v in times.items()}
    return {"bytes": nbytes, "segments": len(plan.segments), "restored_tokens": plan.end * store.block_size,
            "seconds_best": best, "seconds_median": {k: statistics.median(v) for k, v in times.items()},
            "gb_per_s": {k: nbytes / v / 1e9 for k, v in best.items()},
            "restore_over_dd": best["dd"] / best["restore"], "read_over_dd": best["dd"] / best["read"],
            "engine_thread_ms": best["install"] * 1e3}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="mlx-lm model directory (default: SmolLM2, kvmetal's named model)")
    parser.add_argument("--tokens", type=int, default=8192, help="context tokens restored (default 8192)")
    parser.add_argument("--segment-tokens", type=int, default=2048, help="tokens per segment file (default 2048)")
    parser.add_argument("--formats", default="float,k8v4", help="comma-separated: " + ",".join(FORMATS))
    parser.add_argument("--runs", type=int, default=5, help="timed restores per format and cache state (best kept)")
    parser.add_argument("--dir", help="where the segment files go (default: a temporary directory under /tmp)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args(argv)
    if args.tokens % args.segment_tokens or args.segment_tokens % 16:
        parser.error("--tokens must be a multiple of --segment-tokens, itself a multiple of 16")
    formats = args.formats.split(",")
    for name in formats:
        if name not in FORMATS:
            parser.error(f"--formats: {name!r} is not one of {', '.join(FORMATS)}")

    import mlx.core as mx
    from mlx_lm import load

    from kvmetal.models.named import named_model_path

    model_dir = args.model or str(named_model_path("smollm2"))
    model, _ = load(model_dir)
    results = {"command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "model": model_dir,
               "backend": "cpu (mlx " + mx.__version__ + ")", "host": platform.node(), "cpus": os.cpu_count(),
               "date": time.strftime("%Y-%m-%d %H:%M"), "tokens": args.tokens,
               "segment_tokens": args.segment_tokens, "formats": {}}
    print(f"restore of a {args.tokens}-token context ({args.segment_tokens} tokens per segment), best of "
          f"{args.runs}; model {Path(model_dir).name}; GB/s of segment-file bytes")
    print("| format | cache | MB | segments | dd GB/s | read GB/s | restore GB/s | restore/dd | "
          "engine-thread ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for name in formats:
            engine, store, context = build_session(model, FORMATS[name], args.tokens, args.segment_tokens,
                                                   Path(tmp) / name)
            try:
                for cold in (True, False):
                    r = measure(engine, store, context, args.runs, cold)
                    results["formats"].setdefault(name, {})["cold" if cold else "warm"] = r
                    g = r["gb_per_s"]
                    print(f"| {name} | {'cold' if cold else 'warm'} | {r['bytes'] / 1e6:.0f} | {r['segments']} | "
                          f"{g['dd']:.2f} | {g['read']:.2f} | {g['restore']:.2f} | "
                          f"{r['restore_over_dd']:.2f} | {r['engine_thread_ms']:.0f} |")
            finally:
                store.close()
                engine.close()
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
