"""``--prompt-cache-dir``: published prefix blocks kept on disk across restarts.

Layout of the directory::

    DIR/<fingerprint>/index.json          fingerprint, one {start, end} entry per segment
    DIR/<fingerprint>/seg-<hash>.safetensors

A *segment* is a run of full blocks ``[start, end)`` of one token chain; its file holds
the blocks' K/V arrays and the chain's token ids up to ``end`` (``tokens``, int32), and
it is keyed by the chain hash of its last block. The index entries stay small (no
tokens), so rewriting the index when a request finishes costs little. The fingerprint covers the model (config, weight file names, sizes and sampled
bytes) and the cache format (block size, K/V bits, layer groups), so a server never
loads blocks written by another model or format: the subdirectory differs, and the
fingerprint inside ``index.json`` is checked again. A corrupt index, a missing or
unreadable segment, a token chain that does not match its key, or arrays of the wrong
shape or dtype are skipped with a warning, never loaded. A directory written with
another ``STORE_FORMAT`` has another fingerprint, so it is never read (a warning says so).

Writing: when a request finishes, the engine thread slices its full, un-evicted
blocks that are not on disk yet (one small gather per layer), saves them as one
segment and rewrites the index atomically. (On the engine thread, not a writer
thread: MLX must stay on one thread, see ``worker``.)
Loading (at start, on the engine thread): each segment is added as a sequence whose
full blocks the pool then publishes, its rows are written, and the sequence is freed,
so the blocks sit in the pool's prefix cache exactly like those of a finished request.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..integrations.model_cache import _pool_arrays

log = logging.getLogger("kvmetal.serve")

STORE_FORMAT = 2  # 2: the chain's tokens live in the segment file, not in index.json
_SAMPLE = 1 << 20  # bytes read from each end of a weight file for the fingerprint


def chain_hashes(tokens, block_size: int) -> list:
    """Hex chain hash of every full block of ``tokens`` (each covers all blocks before it)."""
    out, previous = [], b""
    for i in range(len(tokens) // block_size):
        data = np.asarray(tokens[i * block_size:(i + 1) * block_size], dtype=np.int64).tobytes()
        previous = hashlib.blake2b(previous + data, digest_size=16).digest()
        out.append(previous.hex())
    return out


def model_identity(model_dir) -> dict:
    """What identifies a model directory's weights without reading all of them."""
    model_dir = Path(model_dir)
    digest = hashlib.sha256()
    config = model_dir / "config.json"
    if config.is_file():
        digest.update(config.read_bytes())
    files = sorted(p for p in model_dir.iterdir() if p.suffix == ".safetensors")
    for path in files:
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            digest.update(f.read(_SAMPLE))
            if size > 2 * _SAMPLE:
                f.seek(size - _SAMPLE)
                digest.update(f.read(_SAMPLE))
    return {"model": digest.hexdigest()}


def cache_format(model_cache) -> dict:
    """The layout a block must have to be loaded into ``model_cache``."""
    groups = []
    for pool, window in zip(model_cache.pools, model_cache.windows):
        group = {"window": window, "layers": pool.num_layers, "kv_heads": pool.num_kv_heads,
                 "head_dim": pool.head_dim, "dtype": str(pool.dtype), "k_bits": pool.k_bits, "v_bits": pool.v_bits}
        for name in ("group_size", "k_group_size", "v_group_size"):  # whichever the pool has
            if hasattr(pool, name):
                group[name] = getattr(pool, name)
        groups.append(group)
    return {"block_size": model_cache.block_size, "groups": groups}


def _named_arrays(pools):
    """(group, name, array) for every K/V array of every layer of ``pools``, named as a
    segment file stores it (``g<group>.l<layer>.<k|v>.<part>``)."""
    for g, pool in enumerate(pools):
        for layer in range(pool.num_layers):
            for kind, caches in (("k", pool.key_caches), ("v", pool.value_caches)):
                for j, array in enumerate(_pool_arrays(caches[layer])):
                    yield g, f"g{g}.l{layer}.{kind}.{j}", array


class PrefixStore:
    """Persistent prefix blocks for one model and cache format.

    Args:
        directory: ``--prompt-cache-dir``.
        identity: ``model_identity(model_dir)`` (or any dict naming the weights).
        model_cache: the engine's ``PagedModelCache``.
    """

    def __init__(self, directory, identity: dict, model_cache):
        self.model_cache = model_cache
        self.block_size = model_cache.block_size
        self.fingerprint = {"store_format": STORE_FORMAT, **identity, "cache": cache_format(model_cache)}
        key = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        self.root = Path(directory) / key
        self.root.mkdir(parents=True, exist_ok=True)
        self.entries: dict = {}  # chain hash of a segment's last block -> entry
        self.known: set = set()  # chain hashes on disk or on their way there
        self.loaded_blocks = 0
        self.saved_blocks = 0
        self.warnings = 0

    # ------------------------------------------------------------------ loading

    def _warn(self, message: str) -> None:
        self.warnings += 1
        log.warning("prompt cache %s: %s", self.root, message)

    def _read_index(self) -> dict:
        path = self.root / "index.json"
        if not path.exists():
            return {}
        try:
            index = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            self._warn(f"index.json is unreadable ({e}); ignoring every segment")
            return {}
        if not isinstance(index, dict) or index.get("fingerprint") != self.fingerprint:
            self._warn("index.json was written for another model or cache format; ignoring it")
            return {}
        entries = index.get("entries")
        if not isinstance(entries, dict):
            self._warn("index.json has no entries table; ignoring it")
            return {}
        return entries

    def _note_other_formats(self) -> None:
        """Warn about directories this model wrote with another STORE_FORMAT (they are not read)."""
        same = {k: v for k, v in self.fingerprint.items() if k != "store_format"}
        for path in self.root.parent.glob("*/index.json"):
            if path.parent == self.root:
                continue
            try:
                fingerprint = json.loads(path.read_text()).get("fingerprint")
            except (OSError, ValueError, AttributeError):
                continue
            if (isinstance(fingerprint, dict) and fingerprint.get("store_format") != STORE_FORMAT
                    and {k: v for k, v in fingerprint.items() if k != "store_format"} == same):
                log.warning("prompt cache %s: written with store format %r, not %d; ignored",
                            path.parent, fingerprint.get("store_format"), STORE_FORMAT)

    def load(self) -> int:
        """Load every valid segment into the pool's prefix cache; returns the blocks loaded."""
        self._note_other_formats()
        entries = self._read_index()
        ordered = sorted(entries.items(), key=lambda kv: kv[1].get("end", 0) if isinstance(kv[1], dict) else 0)
        self.known = set()
        for key, entry in ordered:
            try:
                loaded, hashes = self._load_entry(key, entry)
            except _Skip as e:
                self._warn(f"segment {key[:12]}: {e}; skipped")
                continue
            except Exception as e:  # a damaged file must not stop the server
                self._warn(f"segment {key[:12]}: {type(e).__name__}: {e}; skipped")
                continue
            if loaded is None:
                self._warn("the KV pool is full; the remaining segments stay on disk")
                break
            self.entries[key] = {"start": entry["start"], "end": entry["end"]}
            self.loaded_blocks += loaded
            self.known.update(hashes)
        return self.loaded_blocks

    def _load_entry(self, key: str, entry) -> tuple:
        """(blocks loaded, or None when the pool is full; the chain hashes of the segment's tokens)."""
        bs = self.block_size
        if not isinstance(entry, dict):
            raise _Skip("entry is not an object")
        start, end = entry.get("start"), entry.get("end")
        if (not isinstance(start, int) or isinstance(start, bool) or not isinstance(end, int)
                or isinstance(end, bool) or not 0 <= start < end):
            raise _Skip("entry fields are malformed")
        path = self.root / f"seg-{key}.safetensors"
        if not path.is_file():
            raise _Skip("its file is missing")
        arrays = mx.load(str(path))
        stored = arrays.get("tokens")
        if stored is None or tuple(stored.shape) != (end * bs,) or stored.dtype != mx.int32:
            found = None if stored is None else f"{tuple(stored.shape)} {stored.dtype}"
            raise _Skip(f"its token array is {found}, expected ({end * bs},) int32")
        tokens = stored.tolist()
        hashes = chain_hashes(tokens, bs)
        if hashes[-1] != key:
            raise _Skip("its tokens do not match its chain hash")
        pools = self.model_cache.pools
        probe = tokens + [0]  # one extra token so that every full block may be shared
        have = min(p.allocator.cached_prefix(probe) for p in pools)
        if have >= end * bs:
            return 0, hashes  # already in the pool
        if have < start * bs:
            raise _Skip("the segment before it was not loaded")
        self._check_arrays(arrays, end - start)
        if not all(p.allocator.can_add(probe) for p in pools):
            return None, hashes
        seq = ("kvmetal-prefix-store", key)
        cached = self.model_cache.add_sequence(seq, probe)
        first = cached // bs
        try:
            ids = [mx.array(pool.allocator.block_table(seq)[first:end], dtype=mx.int32) for pool in pools]
            for g, name, target in _named_arrays(pools):
                target[ids[g]] = arrays[name][first - start:]
            mx.eval([pool.arrays() for pool in pools])
        finally:
            self.model_cache.free(seq)
        return end - first, hashes

    def _check_arrays(self, arrays: dict, num_blocks: int) -> None:
        for _, name, target in _named_arrays(self.model_cache.pools):
            got = arrays.get(name)
            want = (num_blocks, *target.shape[1:])
            if got is None or tuple(got.shape) != want or got.dtype != target.dtype:
                found = None if got is None else f"{tuple(got.shape)} {got.dtype}"
                raise _Skip(f"array {name} is {found}, expected {want} {target.dtype}")

    # ------------------------------------------------------------------ saving

    def record(self, seq_id, tokens: list) -> None:
        """Queue the full blocks of a finishing sequence that are not on disk yet.

        Called on the engine thread before the sequence is freed; ``tokens`` are the
        token ids its cache holds."""
        bs = self.block_size
        pools = self.model_cache.pools
        tables = [p.allocator.block_table(seq_id) for p in pools]
        end = min(len(tokens) // bs, *(len(t) for t in tables))
        for i in range(end):  # stop at the first block a sliding window evicted
            if any(t[i] < 0 for t in tables):
                end = i
                break
        if end == 0:
            return
        hashes = chain_hashes(tokens[: end * bs], bs)
        start = 0
        while start < end and hashes[start] in self.known:
            start += 1
        if start == end:
            return
        ids = [mx.array(table[start:end], dtype=mx.int32) for table in tables]
        arrays = {name: source[ids[g]] for g, name, source in _named_arrays(pools)}
        arrays["tokens"] = mx.array(np.asarray(tokens[: end * bs], dtype=np.int32))
        entry = {"start": start, "end": end}
        key = hashes[end - 1]
        try:
            mx.save_safetensors(str(self.root / f"seg-{key}.safetensors"), arrays)
            self.entries[key] = entry
            self._write_index()
        except OSError as e:
            self._warn(f"could not write a segment ({e})")
            return
        self.known.update(hashes[start:end])
        self.saved_blocks += end - start

    def _write_index(self) -> None:
        path = self.root / "index.json"
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"fingerprint": self.fingerprint, "entries": self.entries}))
        os.replace(tmp, path)

    def close(self) -> None:
        """Nothing is buffered (segments are written as requests finish); kept for symmetry."""


class _Skip(Exception):
    """A segment that must not be loaded (the message says why)."""
