"""``--prompt-cache-dir``: published prefix blocks kept on disk across restarts.

Layout of the directory::

    DIR/<fingerprint>/index.json          fingerprint, one small entry per segment
    DIR/<fingerprint>/seg-<hash>.safetensors
    DIR/<fingerprint>/lock                held (flock) by the one server using it

A *segment* is a run of full blocks ``[start, end)`` of one token chain; its file holds
the blocks' K/V arrays and the chain's token ids up to ``end`` (``tokens``, int32), and
it is keyed by the chain hash of its last block. An index entry is
``{start, end, parent, bytes, used, uses, sum}``: ``parent`` is the segment holding
block ``start - 1`` (a segment cannot load without it), ``bytes`` its file size,
``used`` a logical clock for LRU eviction, ``uses`` how many later requests ran through
it, ``sum`` the checksum of its arrays (``segment_file.checksum``). The fingerprint
covers the model (config, weight file names, sizes and sampled bytes) and the cache
format (block size, K/V bits, layer groups), so a server never loads blocks written by
another model or format: the subdirectory differs, and the fingerprint inside
``index.json`` is checked again. A corrupt index, a missing or unreadable segment, bytes
that do not match their checksum, a token chain that does not match its key, or arrays
of the wrong shape or dtype are skipped with a warning, never loaded.

Two tiers. The pool's prefix cache is the hot tier; this store is the cold one, and it
is read twice: at start (``load``: every segment that fits goes into the pool) and on
demand (``plan_restore``, ``read_part``, ``install_part``; ``restorer`` drives them): a
request whose prompt continues a chain that is on disk but no longer in the pool gets
those blocks read back (one read per segment file, off the engine thread) instead of
recomputed. Every full block a request publishes reaches the disk when the request
finishes (write-through), so a block the pool evicts later is already there: eviction
from the pool never waits for a write.

Crash safety (SQLite's rule: a write is whole or absent). Every file is written to a
temporary name, fsynced, checked against the size its header promises, and renamed
over its final name (then the directory is fsynced). The index is rewritten once per
*save batch* (the segments of one engine step), after the batch's segment files are
in place, and only it makes a segment visible: a crash leaves at most a temporary file
or a segment no index names, and the next start deletes both. Evicted segments leave
the index first and are deleted after. One server at a time uses a directory: a second
one finds the lock taken and refuses to start (``StoreInUse``). A failed write (full or
read-only disk) turns saving off with one warning; requests never fail for it.

``max_bytes`` bounds what the store keeps on disk (segment files and the index): past
it the least recently used segments are evicted whole, each with the segments that
extend it, those that ``PIN_USES`` or more requests ran through (a shared system
prompt, which every session's segments extend) after all others. A segment is used
when it is saved, loaded, restored, or a finishing request's prompt runs through it.

Writing: when a request finishes, the engine thread slices its full, un-evicted blocks
that are not on disk yet (one small gather per layer, evaluated; the file writer gets
NumPy views of them) and queues them; ``flush`` (the worker calls it after every engine
step) hands the batch to the writer: with ``background_writes`` (the server) a thread of
the store's own computes the checksums and writes the files with NumPy (MLX stays on the
engine thread, see ``worker``), so a long turn's segment never stalls running streams;
a later ``flush`` takes in the finished segments and has the index rewritten, on the
same thread, after them. Loading (at start, on the engine thread): each segment is added
as a sequence whose full blocks the pool then publishes, its rows are written, and the
sequence is freed, so the blocks sit in the pool's prefix cache exactly like those of a
finished request.
"""
from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import struct
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..integrations.model_cache import _pool_arrays
from .segment_file import DTYPES, Buffers, SegmentError, checksum, read_segment, to_mlx, to_numpy, write_segment

log = logging.getLogger("kvmetal.serve")

STORE_FORMAT = 4  # 2: the chain's tokens live in the segment file; 3: entries carry parent, bytes, used;
# 4: and ``sum``, the checksum of the segment's arrays (``segment_file.checksum``)
_SAMPLE = 1 << 20  # bytes read from each end of a weight file for the fingerprint
PIN_USES = 2  # a segment that this many later requests ran through is evicted after all others


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
    for pool, window, chunk in zip(model_cache.pools, model_cache.windows, model_cache.chunks):
        group = {"window": window, "layers": pool.num_layers, "kv_heads": pool.num_kv_heads,
                 "head_dim": pool.head_dim, "dtype": str(pool.dtype), "k_bits": pool.k_bits, "v_bits": pool.v_bits}
        if chunk is not None:  # a chunk layer group (llama4); absent elsewhere, so older formats still match
            group["chunk"] = chunk
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


class StoreInUse(RuntimeError):
    """Another server holds the directory's lock."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _temp_name(path: Path) -> Path:
    """Where ``path`` is written before the rename (the suffix stays: MLX adds a missing one)."""
    return path.with_name(f".tmp-{os.getpid()}-{path.name}")


def write_atomically(path: Path, write, check=None) -> int:
    """``write(temp)``, fsync, ``check(temp)`` (raises if the file is short), rename over
    ``path``, fsync the directory; returns the file's size. On any failure the temporary
    file is removed and ``path`` is untouched."""
    tmp = _temp_name(path)
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        if check is not None:
            check(tmp)
        size = tmp.stat().st_size
        os.replace(tmp, path)
    except BaseException:
        with _suppress_os_error():
            tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)
    return size


class _suppress_os_error:
    def __enter__(self):
        return self

    def __exit__(self, kind, _value, _tb):
        return kind is not None and issubclass(kind, OSError)


def _check_safetensors(data_bytes: int):
    """A check for ``write_atomically``: the file is as long as its header says. (MLX's
    writer may not report a short write, e.g. on a full disk.)"""
    def check(path: Path) -> None:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
        if len(head) < 8 or size != 8 + struct.unpack("<Q", head)[0] + data_bytes:
            raise OSError(errno.EIO, f"{path.name} is {size} bytes, short of what its header promises")
    return check


class PrefixStore:
    """Persistent prefix blocks for one model and cache format.

    Args:
        directory: ``--prompt-cache-dir``.
        identity: ``model_identity(model_dir)`` (or any dict naming the weights).
        model_cache: the engine's ``PagedModelCache``.
        max_bytes: ``--prompt-cache-max-bytes``: segment files and index together stay
            under it (None: no bound).
        background_writes: write files on a writer thread of the store's own (the server
            does: a segment of a long turn takes a second to write on a slow disk, which
            running streams must not wait for); False writes them inside ``flush``.
    Raises ``StoreInUse`` when another server uses the directory.
    """

    def __init__(self, directory, identity: dict, model_cache, *, max_bytes: int | None = None,
                 background_writes: bool = False):
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int)
                                      or max_bytes < 1):
            raise ValueError(f"[PrefixStore] max_bytes must be an int >= 1 or None, got {max_bytes!r}")
        self.model_cache = model_cache
        self.block_size = model_cache.block_size
        self.max_bytes = max_bytes
        self.fingerprint = {"store_format": STORE_FORMAT, **identity, "cache": cache_format(model_cache)}
        key = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        self.root = Path(directory) / key
        self.entries: dict = {}  # chain hash of a segment's last block -> index entry
        self.known: set = set()  # chain hashes on disk or on their way there
        self._segment_of: dict = {}  # chain hash -> the segment holding that block
        self._hashes: dict = {}  # segment -> the chain hashes of its blocks
        self._pending: list = []  # (key, entry, arrays, hashes) waiting for flush
        self._clock = 0  # logical time of the last use
        self._dirty = False  # entries changed (uses) since the index was written
        self.loaded_blocks = 0
        self.saved_blocks = 0
        self.evicted_segments = 0
        self.discarded_files = 0  # temporary or unindexed files removed at start
        self.warnings = 0
        self.bytes_on_disk = 0  # as of the last index write (``disk_bytes`` computes it now)
        # the on-demand tier (``restorer``): what came back from disk
        self.restores = 0  # requests whose blocks were read back
        self.restored_tokens = 0
        self.restore_seconds = 0.0  # read start to rows in the pool, summed
        self.restore_bytes = 0  # bytes read by restores
        self.restore_misses = 0  # restores that failed (unreadable, corrupt, no room): recomputed
        self.restore_missed_tokens = 0
        self.saving = True
        self._writer = _Writer(background_writes)
        self._lock_fd = None
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            self._lock()
        except OSError as e:
            self._disable(f"the directory cannot be written ({e})")

    def _lock(self) -> None:
        fd = os.open(self.root / "lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise StoreInUse(f"--prompt-cache-dir {self.root.parent} is in use by another kvmetal serve "
                             f"(pid {holder}); give each server its own directory") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def _warn(self, message: str) -> None:
        self.warnings += 1
        log.warning("prompt cache %s: %s", self.root, message)

    def _disable(self, why: str) -> None:
        """Stop saving (once, with one warning); what is loaded stays usable."""
        if self.saving:
            self.saving = False
            self._pending.clear()
            self._warn(f"{why}; saving is off until restart, requests are served as before")

    @property
    def disk_bytes(self) -> int:
        """What the store keeps on disk: its segment files and its index."""
        return sum(e["bytes"] for e in self.entries.values()) + len(self._index_text())

    # ------------------------------------------------------------------ loading

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

    def _remove_leftovers(self, indexed: set) -> None:
        """Delete what a crash can leave: temporary files, segments no index names."""
        if not self.saving:  # not ours to clean (another writer may be mid-write)
            return
        for path in self.root.iterdir():
            name = path.name
            stray = name.startswith(".tmp-") or (name.startswith("seg-") and name.endswith(".safetensors")
                                                 and name[4:-12] not in indexed)
            if stray and path.is_file():
                with _suppress_os_error():
                    path.unlink()
                    self.discarded_files += 1

    def load(self) -> int:
        """Load every valid segment into the pool's prefix cache; returns the blocks loaded.

        Invalid segments are dropped from the index (and deleted); the index is written
        again if anything changed, or if it is over ``max_bytes``."""
        self._note_other_formats()
        entries = self._read_index()
        self._remove_leftovers(set(entries))
        # Parents first: a parent holds block ``start - 1`` of each child, so it starts
        # earlier (it may end later: a child can branch off the middle of a segment).
        ordered = sorted(entries.items(), key=lambda kv: (kv[1].get("start", 0), kv[1].get("end", 0))
                         if isinstance(kv[1], dict) else (0, 0))
        self.known = set()
        changed = False
        full = False
        for key, entry in ordered:
            if full:  # kept on disk for a server with a larger pool
                if _entry_ok(entry):
                    self._add_entry(key, _clean_entry(entry), [])
                continue
            try:
                loaded, hashes = self._load_entry(key, entry)
            except Exception as e:  # a damaged file must not stop the server
                why = str(e) if isinstance(e, _Skip) else f"{type(e).__name__}: {e}"
                self._warn(f"segment {key[:12]}: {why}; skipped")
                changed = True
                with _suppress_os_error():
                    (self.root / f"seg-{key}.safetensors").unlink(missing_ok=True)
                continue
            if loaded is None:
                self._warn("the KV pool is full; the remaining segments stay on disk")
                full = True
                self._add_entry(key, _clean_entry(entry), [])
                continue
            self._add_entry(key, _clean_entry(entry), hashes[entry["start"]:entry["end"]])
            self.loaded_blocks += loaded
        self.bytes_on_disk = self.disk_bytes
        if self.saving and (changed or self._evict()):
            try:
                self._save_index()
            except OSError as e:
                self._disable(f"could not rewrite the index ({e})")
        return self.loaded_blocks

    def _add_entry(self, key: str, entry: dict, hashes: list) -> None:
        self.entries[key] = entry
        self._hashes[key] = hashes
        self.known.update(hashes)
        for h in hashes:
            self._segment_of[h] = key
        self._clock = max(self._clock, entry["used"])

    def _load_entry(self, key: str, entry) -> tuple:
        """(blocks loaded, or None when the pool is full; the chain hashes of the segment's tokens)."""
        bs = self.block_size
        if not _entry_ok(entry):
            raise _Skip("entry fields are malformed")
        start, end = entry["start"], entry["end"]
        path = self.root / f"seg-{key}.safetensors"
        if not path.is_file():
            raise _Skip("its file is missing")
        if path.stat().st_size != entry["bytes"]:
            raise _Skip(f"its file is {path.stat().st_size} bytes, the index says {entry['bytes']}")
        arrays = mx.load(str(path))
        if checksum({name: to_numpy(a) for name, a in arrays.items()}) != entry["sum"]:
            raise _Skip("its bytes do not match its checksum")
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
        # Only free blocks: recycling cached ones would evict segments loaded before this
        # one (the parents of later ones), so a store larger than the pool would report
        # sound segments as damaged.
        if not all(p.allocator.can_add(probe, recycle_cached=False) for p in pools):
            return None, hashes
        seq = ("kvmetal-prefix-store", key)
        first = self.model_cache.add_sequence(seq, probe) // bs
        try:
            self._write_blocks(seq, first, [(start, end, lambda name: arrays[name])])
        finally:
            self.model_cache.free(seq)
        return end - first, hashes

    def _write_blocks(self, seq, first: int, parts: list) -> None:
        """Write the rows of ``seq``'s blocks from ``first`` on: ``parts`` are (start, end,
        array of name) for runs of blocks [start, end) in chain order. If a write fails the
        blocks are withdrawn from the prefix cache (their rows never arrived)."""
        pools = self.model_cache.pools
        tables = [pool.allocator.block_table(seq) for pool in pools]
        try:
            for start, end, array in parts:
                lo = max(first, start)
                if lo >= end:
                    continue
                writers = [_block_writer(table[lo:end]) for table in tables]
                for g, name, target in _named_arrays(pools):
                    writers[g](target, array(name)[lo - start:end - start])
            mx.eval([pool.arrays() for pool in pools])
        except BaseException:
            for pool in pools:
                pool.allocator.unpublish(seq, first)
            raise

    def _check_arrays(self, arrays: dict, num_blocks: int, numpy: bool = False) -> None:
        """Every K/V array the pool needs is there with its shape and dtype (``numpy``:
        the arrays are ``segment_file``'s (view, dtype name), compared by the MLX dtype
        they become)."""
        for _, name, target in _named_arrays(self.model_cache.pools):
            got = arrays.get(name)
            if numpy and got is not None:
                got, dtype = got[0], DTYPES[got[1]][1]
            else:
                dtype = None if got is None else got.dtype
            want = (num_blocks, *target.shape[1:])
            if got is None or tuple(got.shape) != want or dtype != target.dtype:
                found = None if got is None else f"{tuple(got.shape)} {dtype}"
                raise _Skip(f"array {name} is {found}, expected {want} {target.dtype}")

    # ------------------------------------------------------------------ the tier on demand

    def plan_restore(self, prompt: list) -> "RestorePlan | None":
        """What of ``prompt``'s chain is on disk but not in the pool (None: nothing).

        Only whole blocks the pool would share count: those before the prompt's last
        token (a request always computes at least its last token)."""
        bs = self.block_size
        blocks = (len(prompt) - 1) // bs
        if blocks == 0 or not self.entries:
            return None
        have = min(p.allocator.cached_prefix(prompt) for p in self.model_cache.pools) // bs
        if have >= blocks:
            return None
        hashes = chain_hashes(prompt[: blocks * bs], bs)
        end, segments = have, []
        # Block by block: a segment may go on past where the prompt leaves its chain.
        while end < blocks:
            key = self._segment_of.get(hashes[end])
            entry = self.entries.get(key)
            if entry is None:  # not on disk (or queued, not written yet)
                break
            if not segments or segments[-1].key != key:
                segments.append(_Segment(key, self.root / f"seg-{key}.safetensors", entry["bytes"],
                                         entry["start"], entry["end"], entry["sum"], lo=end, hi=end + 1))
            else:
                segments[-1] = replace(segments[-1], hi=end + 1)
            end += 1
        if not segments:
            return None
        return RestorePlan(list(prompt[: end * bs]), have, end, segments)

    def install_part(self, plan: "RestorePlan", i: int, data, seq) -> int:
        """Put segment ``i`` of ``plan`` (``read_part``'s ``data``) into the pool: blocks
        ``[lo, hi)`` of holding sequence ``seq``, which part 0 starts and each later part
        extends (the caller frees it once the request that asked is admitted; until then
        the blocks cannot be recycled). Parts go in order, one engine iteration or several
        apart: each leaves only whole, written blocks published. Returns the tokens this
        part restored (0: the pool had them already).

        Raises ``DamagedSegment`` for a segment that must not be loaded (the caller drops
        it with ``drop_segment``) and ``KVCacheFull`` when the pool has no room; the pool
        is as the previous part left it then."""
        bs, g = self.block_size, plan.segments[i]
        got = data.arrays
        stored, kind = got.get("tokens", (None, None))  # everything is checked before the pool changes
        if kind != "I32" or stored.shape != (g.end * bs,):
            raise DamagedSegment(g.key, "its token array is malformed")
        if not np.array_equal(stored[: g.hi * bs], plan.tokens[: g.hi * bs]):
            raise DamagedSegment(g.key, "its tokens are not the chain it is filed under")
        try:
            self._check_arrays(got, g.end - g.start, numpy=True)
        except _Skip as e:
            raise DamagedSegment(g.key, str(e)) from None
        cache = self.model_cache
        tail = [0]  # one token past the blocks, so that every full block may be shared
        if i == 0:
            first = cache.add_sequence(seq, plan.tokens[: g.hi * bs] + tail) // bs
        else:
            first = g.lo
            cache.truncate(seq, g.lo * bs)  # the extra token goes; the blocks before stay
            cache.append(seq, plan.tokens[g.lo * bs: g.hi * bs] + tail)
        try:
            self._write_blocks(seq, first, [(g.start, g.hi, lambda name: to_mlx(*got[name]))])
        except BaseException:
            cache.free(seq)
            raise
        self._touch([g.key])
        return max(0, g.hi - max(first, g.lo)) * bs

    def drop_segment(self, key: str, why: str) -> None:
        """Forget a segment found damaged on demand, with the segments that extend it;
        their files go and the index is rewritten at the next ``flush``."""
        if key not in self.entries:  # evicted (its file deleted) since the plan was made: no damage
            log.info("prompt cache %s: %s (evicted meanwhile); its tokens are recomputed", self.root, why)
            return
        self._warn(f"{why}; dropped, its tokens are recomputed")
        for k in self._with_descendants(key):
            self._forget(k, self._hashes.get(k, []))
            with _suppress_os_error():
                (self.root / f"seg-{k}.safetensors").unlink(missing_ok=True)
        self._dirty = True

    # ------------------------------------------------------------------ saving

    def _touch(self, keys) -> None:
        """Mark segments used now (LRU) and count the use (pinning: ``_evict``)."""
        self._clock += 1
        for key in keys:
            entry = self.entries.get(key)
            if entry is not None and entry["used"] != self._clock:
                entry["used"] = self._clock
                entry["uses"] = entry.get("uses", 0) + 1
                self._dirty = True

    def record(self, seq_id, tokens: list) -> None:
        """Queue the full blocks of a finishing sequence that are not on disk yet (``flush``
        writes them), and mark the segments its prompt ran through as used.

        Called on the engine thread before the sequence is freed; ``tokens`` are the
        token ids its cache holds. The blocks' rows are copied now (the pool reuses them)."""
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
        self._touch({self._segment_of[h] for h in hashes[:start] if h in self._segment_of})
        if start == end or not self.saving:
            return
        ids = [mx.array(table[start:end], dtype=mx.int32) for table in tables]
        arrays = {name: source[ids[g]] for g, name, source in _named_arrays(pools)}
        arrays["tokens"] = mx.array(np.asarray(tokens[: end * bs], dtype=np.int32))
        mx.eval(list(arrays.values()))
        host = {name: to_numpy(a) for name, a in arrays.items()}  # views, no copy
        parent = self._segment_of.get(hashes[start - 1]) if start else None
        entry = {"start": start, "end": end, "parent": parent, "bytes": 0, "used": 0, "uses": 0, "sum": ""}
        key = hashes[end - 1]
        # the MLX arrays travel along: they own the memory the views show
        self._pending.append((key, entry, host, arrays, hashes[start:end]))
        self.known.update(hashes[start:end])
        for h in hashes[start:end]:
            self._segment_of[h] = key

    def flush(self) -> None:
        """Hand the queued segments to the writer, take in what it finished, evict past
        ``max_bytes`` and have the index rewritten once (when anything changed).

        With ``background_writes`` the files are written on the writer thread and this
        returns at once; a segment joins ``entries`` (and can be restored) once its file
        is whole, and the index names it at the next flush after that."""
        self._collect()
        pending, self._pending = self._pending, []
        if not self.saving:
            return
        if pending:
            self._writer.submit(self._write_segments, pending)
            self._collect()  # an inline writer has just written them
        if self.saving and self._dirty:
            evicted = self._evict()
            text = self._index_text()
            self._dirty = False
            self.bytes_on_disk = sum(e["bytes"] for e in self.entries.values()) + len(text)
            self._writer.submit(self._write_index, text, evicted)
            self._collect()

    def _collect(self) -> None:
        """Take in the writer's finished work (engine thread)."""
        for results in self._writer.results():
            for item in results:
                if item[0] == "segment":
                    _, key, entry, hashes = item
                    parent = entry["parent"]
                    if parent is not None and parent not in self.entries:  # evicted or failed meanwhile
                        self._forget(key, hashes)
                        with _suppress_os_error():  # in no index: safe to delete at any time
                            (self.root / f"seg-{key}.safetensors").unlink(missing_ok=True)
                        continue
                    self._touch(())
                    entry["used"] = self._clock
                    self.entries[key] = entry
                    self._hashes[key] = hashes
                    self.saved_blocks += entry["end"] - entry["start"]
                    self._dirty = True
                elif item[0] == "skip":  # larger than the whole budget: never kept
                    self._forget(*item[1:])
                else:  # "failed": what was not written is forgotten, saving stops
                    _, why, lost = item
                    for key, hashes in lost:
                        self._forget(key, hashes)
                    self._disable(f"could not write ({why})")

    def _write_segments(self, pending: list) -> list:
        """Write segment files (writer thread: NumPy and the file system only)."""
        out = []
        for n, (key, entry, host, _, hashes) in enumerate(pending):
            try:
                data = sum(a.nbytes for a, _ in host.values())
                if self.max_bytes is not None and data > self.max_bytes:
                    out.append(("skip", key, hashes))
                    continue
                entry = {**entry, "sum": checksum(host)}
                entry["bytes"] = write_atomically(self.root / f"seg-{key}.safetensors",
                                                  lambda tmp: write_segment(tmp, host), _check_safetensors(data))
                out.append(("segment", key, entry, hashes))
            except Exception as e:  # a full or read-only disk; the next start deletes what was written
                out.append(("failed", e, [(k, h) for k, _, _, _, h in pending[n:]]))
                break
        return out

    def _write_index(self, text: str, evicted: list) -> list:
        """Rewrite the index, then delete the files of the segments it no longer names."""
        try:
            write_atomically(self.root / "index.json", lambda tmp: tmp.write_text(text))
        except Exception as e:
            return [("failed", e, [])]
        for key in evicted:
            with _suppress_os_error():
                (self.root / f"seg-{key}.safetensors").unlink(missing_ok=True)
        return []

    def _forget(self, key: str, hashes: list) -> None:
        self.entries.pop(key, None)
        self._hashes.pop(key, None)
        for h in hashes:
            self.known.discard(h)
            if self._segment_of.get(h) == key:
                del self._segment_of[h]

    def _evict(self) -> list:
        """Drop least recently used segments (each with those that extend it) until the
        store fits ``max_bytes``; returns the keys dropped (their files still exist)."""
        if self.max_bytes is None:
            return []
        dropped = []
        while self.entries and self.disk_bytes > self.max_bytes:
            oldest = min(self.entries, key=lambda k: (self.entries[k].get("uses", 0) >= PIN_USES,
                                                      self.entries[k]["used"], -self.entries[k]["end"]))
            for key in self._with_descendants(oldest):
                self._forget(key, self._hashes.get(key, []))
                dropped.append(key)
                self.evicted_segments += 1
        return dropped

    def _with_descendants(self, key: str) -> list:
        out, todo = [], [key]
        while todo:
            k = todo.pop()
            out.append(k)
            todo += [c for c, e in self.entries.items() if e.get("parent") == k and c not in out]
        return out

    def _index_text(self) -> str:
        return json.dumps({"fingerprint": self.fingerprint, "entries": self.entries})

    def _save_index(self) -> None:
        text = self._index_text()
        write_atomically(self.root / "index.json", lambda tmp: tmp.write_text(text))
        self._dirty = False
        self.bytes_on_disk = sum(e["bytes"] for e in self.entries.values()) + len(text)

    def close(self) -> None:
        """Write what is queued (and the latest uses), wait for the writer, then release
        the directory."""
        try:
            self.flush()
            self._writer.drain()
            self.flush()  # index the segments the writer finished last
            self._writer.drain()
            self._collect()
        finally:
            self._writer.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)  # releases the flock
                self._lock_fd = None


class _Writer:
    """Runs the store's file writes in submission order, on one thread of its own
    (``background``) or inline; ``results`` hands their outcomes back in order."""

    def __init__(self, background: bool):
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvmetal-store-writer") \
            if background else None
        self._done: deque = deque()  # outcomes of inline jobs
        self._futures: deque = deque()

    def submit(self, job, *args) -> None:
        if self._thread is None:
            self._done.append(job(*args))
        else:
            self._futures.append(self._thread.submit(job, *args))

    def results(self) -> list:
        out = list(self._done)
        self._done.clear()
        while self._futures and self._futures[0].done():
            out.append(self._futures.popleft().result())
        return out

    def drain(self) -> None:
        for future in list(self._futures):
            future.exception()  # waits; the outcome stays for ``results``

    def close(self) -> None:
        if self._thread is not None:
            self._thread.shutdown(wait=True)


@dataclass(frozen=True)
class _Segment:
    key: str
    path: Path
    bytes: int
    start: int
    end: int
    sum: str
    lo: int  # the blocks [lo, hi) it brings back for this plan
    hi: int


@dataclass
class RestorePlan:
    """Blocks [first, end) of ``tokens``' chain come back from ``segments``, in chain
    order, each bringing its blocks [lo, hi) (a segment may hold more of its chain)."""

    tokens: list
    first: int
    end: int
    segments: list

    @property
    def nbytes(self) -> int:
        return sum(g.bytes for g in self.segments)


def read_part(plan: RestorePlan, i: int, buffers: Buffers | None = None):
    """Segment ``i`` of ``plan`` as ``SegmentData``: one read of its file into a buffer of
    ``buffers`` (the caller gives it back after ``install_part``), its checksum verified.
    NumPy only: a restore thread runs this (MLX stays on the engine thread). Raises
    ``DamagedSegment``."""
    g = plan.segments[i]
    try:
        data = read_segment(g.path, g.bytes, buffers)
    except (OSError, SegmentError) as e:
        raise DamagedSegment(g.key, str(e) if isinstance(e, SegmentError) else f"unreadable ({e})") from None
    if checksum(data.arrays) != g.sum:
        if buffers is not None:
            buffers.give([data.buffer])
        raise DamagedSegment(g.key, "its bytes do not match its checksum")
    return data


def _block_writer(ids: list):
    """A function ``(target, rows)`` putting ``rows[i]`` at ``target[ids[i]]`` in place.

    Runs of consecutive ids (either direction: the allocator hands a recycled chain's
    blocks back in the order its owner released them) become slice updates, which MLX
    does at memory speed; a scatter (what ``target[ids] = rows`` is) moves ~1 GB/s on
    the CPU. Ids scattered all over fall back to the scatter."""
    runs, i = [], 0  # (first row, rows, first id, step)
    while i < len(ids):
        step = 1 if i + 1 < len(ids) and ids[i + 1] == ids[i] + 1 else -1
        j = i + 1
        while j < len(ids) and ids[j] == ids[j - 1] + step:
            j += 1
        runs.append((i, j - i, ids[i], step))
        i = j
    if len(runs) > max(1, len(ids) // 2):
        index = mx.array(ids, dtype=mx.int32)

        def scatter(target, rows):
            target[index] = rows
        return scatter

    def slices(target, rows):
        for row, n, first, step in runs:
            if step == 1:
                target[first:first + n] = rows[row:row + n]
            else:
                target[first - n + 1:first + 1] = rows[row:row + n][::-1]
    return slices


def _entry_ok(entry) -> bool:
    if not isinstance(entry, dict):
        return False
    start, end, size, used = (entry.get(k) for k in ("start", "end", "bytes", "used"))
    ints = all(isinstance(v, int) and not isinstance(v, bool) for v in (start, end, size, used))
    parent = entry.get("parent")
    return (ints and 0 <= start < end and size > 0 and (parent is None or isinstance(parent, str))
            and isinstance(entry.get("sum"), str))


def _clean_entry(entry: dict) -> dict:
    uses = entry.get("uses")  # absent in indexes written before pinning
    return {**{k: entry.get(k) for k in ("start", "end", "parent", "bytes", "used", "sum")},
            "uses": uses if isinstance(uses, int) and not isinstance(uses, bool) and uses >= 0 else 0}


class _Skip(Exception):
    """A segment that must not be loaded (the message says why)."""


class DamagedSegment(Exception):
    """A segment found unreadable or inconsistent on demand: ``key`` names it, ``why`` says why."""

    def __init__(self, key: str, why: str):
        super().__init__(f"segment {key[:12]}: {why}")
        self.key, self.why = key, why
