"""A tiny llama GGUF written from scratch, its header fields by offset, mutations of them,
and a runner that converts each mutated file in a child process (so a segfault is seen).

    data, fields = tiny_llama_gguf()
    inputs = mutations(data, fields, seed=0)      # [(label, bytes)]
    outcomes = run_inputs(paths, workdir)         # one outcome per path: "converted",
                                                  # "error: <one line>", "signal N", "raised ..."

``python tests/gguf_fuzz.py LIST RESULTS`` is the child: it converts every file named in
LIST (one path a line) with :func:`kvmetal.models.convert_gguf` and appends one JSON line
per file to RESULTS as soon as it is done.
"""
from __future__ import annotations

import json
import os
import random
import struct
import subprocess
import sys
from pathlib import Path

U32, I32, F32, BOOL, STRING, ARRAY, U64 = 4, 5, 6, 7, 8, 9, 10
HIDDEN, VOCAB = 32, 8


class _Writer:
    """GGUF bytes with the offset of every count, length, type and offset field recorded."""

    def __init__(self):
        self.buf = bytearray()
        self.fields = []  # (label, offset, struct format)

    def put(self, fmt: str, value, label: str | None = None):
        if label is not None:
            self.fields.append((label, len(self.buf), fmt))
        self.buf += struct.pack("<" + fmt, value)

    def string(self, s: str, label: str):
        raw = s.encode()
        self.put("Q", len(raw), f"strlen {label}")
        self.buf += raw

    def kv(self, key: str, kind: int, value, inner: int | None = None):
        self.string(key, f"key {key}")
        self.put("I", kind, f"type {key}")
        if kind == ARRAY:
            self.put("I", inner, f"array type {key}")
            self.put("Q", len(value), f"array len {key}")
            for i, v in enumerate(value):
                if inner == STRING:
                    self.string(v, f"{key}[{i}]")
                else:
                    self.put({U32: "I", I32: "i", F32: "f"}[inner], v)
        elif kind == STRING:
            self.string(value, f"value {key}")
        else:
            self.put({U32: "I", I32: "i", F32: "f", BOOL: "?", U64: "Q"}[kind], value,
                     "alignment" if key == "general.alignment" else None)


def _q8_0(rows: int, cols: int, rng: random.Random) -> bytes:
    out = bytearray()
    for _ in range(rows * cols // 32):
        out += struct.pack("<e", 0.01) + bytes(rng.randrange(256) for _ in range(32))
    return bytes(out)


def tiny_llama_gguf(seed: int = 0) -> tuple[bytes, list]:
    """(file bytes, header fields) of a 1-layer llama (hidden 32, vocab 8) that
    ``kvmetal convert-gguf`` converts: F32 tensors and one Q8_0."""
    rng = random.Random(seed)
    tokens = ["a", "b", "c", "ab", "<s>", "</s>", "Ġ", "bc"]
    metadata = [
        ("general.architecture", STRING, "llama", None),
        ("general.alignment", U32, 32, None),
        ("llama.block_count", U32, 1, None),
        ("llama.embedding_length", U32, HIDDEN, None),
        ("llama.feed_forward_length", U32, 64, None),
        ("llama.attention.head_count", U32, 4, None),
        ("llama.attention.head_count_kv", U32, 2, None),
        ("llama.attention.layer_norm_rms_epsilon", F32, 1e-5, None),
        ("llama.context_length", U32, 128, None),
        ("tokenizer.ggml.model", STRING, "gpt2", None),
        ("tokenizer.ggml.tokens", ARRAY, tokens, STRING),
        ("tokenizer.ggml.token_type", ARRAY, [1, 1, 1, 1, 3, 3, 1, 1], I32),
        ("tokenizer.ggml.merges", ARRAY, ["a b", "b c"], STRING),
        ("tokenizer.ggml.bos_token_id", U32, 4, None),
        ("tokenizer.ggml.eos_token_id", U32, 5, None),
        ("tokenizer.ggml.add_bos_token", BOOL, False, None),
        ("general.scores", ARRAY, [0.5, 0.25], F32),
    ]
    tensors = [  # name, GGUF dims (fastest first), type, bytes
        ("token_embd.weight", (HIDDEN, VOCAB), 0, struct.pack(f"<{HIDDEN * VOCAB}f",
                                                               *(rng.uniform(-1, 1) for _ in range(HIDDEN * VOCAB)))),
        ("output_norm.weight", (HIDDEN,), 0, struct.pack(f"<{HIDDEN}f", *([1.0] * HIDDEN))),
        ("blk.0.attn_norm.weight", (HIDDEN,), 0, struct.pack(f"<{HIDDEN}f", *([1.0] * HIDDEN))),
        ("blk.0.attn_q.weight", (HIDDEN, HIDDEN), 8, _q8_0(HIDDEN, HIDDEN, rng)),
        ("blk.0.attn_k.weight", (HIDDEN, 16), 1, struct.pack(f"<{HIDDEN * 16}e",
                                                             *(rng.uniform(-1, 1) for _ in range(HIDDEN * 16)))),
    ]
    w = _Writer()
    w.buf += b"GGUF"
    w.put("I", 3, "version")
    w.put("Q", len(tensors), "tensor_count")
    w.put("Q", len(metadata), "kv_count")
    for key, kind, value, inner in metadata:
        w.kv(key, kind, value, inner)
    offset = 0
    for name, dims, kind, data in tensors:
        w.string(name, f"tensor {name}")
        w.put("I", len(dims), f"n_dims {name}")
        for i, d in enumerate(dims):
            w.put("Q", d, f"dim{i} {name}")
        w.put("I", kind, f"ggml type {name}")
        w.put("Q", offset, f"offset {name}")
        offset += -(-len(data) // 32) * 32
    w.buf += bytes(-len(w.buf) % 32)
    for _, _, _, data in tensors:
        w.buf += data + bytes(-len(data) % 32)
    return bytes(w.buf), w.fields


def _patched(data: bytes, offset: int, fmt: str, value) -> bytes:
    return data[:offset] + struct.pack("<" + fmt, value) + data[offset + struct.calcsize("<" + fmt):]


def _edge_values(data: bytes, fields: list, type_values, other_values):
    """(label, offset, format, value) for every field of ``fields`` set to each of its edge
    values but its own, in range: ``type_values(top)`` for type fields, ``other_values(value,
    top)`` for counts, lengths and offsets (``top``: the field's largest value)."""
    for label, offset, fmt in fields:
        (value,) = struct.unpack_from("<" + fmt, data, offset)
        top = (1 << (8 * struct.calcsize("<" + fmt))) - 1
        is_type = label.startswith(("type ", "array type ", "ggml type "))
        candidates = type_values(top) if is_type else other_values(value, top)
        for v in sorted(c for c in candidates if 0 <= c <= top and c != value):
            yield label, offset, fmt, v


def mutations(data: bytes, fields: list, *, seed: int = 0, flips: int = 200) -> list:
    """[(label, bytes)]: every header field set to edge values, truncations, random byte flips."""
    rng = random.Random(seed)
    out = []
    edges = _edge_values(data, fields, lambda top: set(range(0, 42)) | {top, 1 << 31},
                         lambda value, top: {value + 1, value - 1, value + 32, value * 2, 0, 1, top, top // 2 + 1,
                                             1 << 32, rng.randrange(top + 1)})
    for label, offset, fmt, v in edges:
        out.append((f"{label}={v}", _patched(data, offset, fmt, v)))
    header_end = max(offset for _, offset, _ in fields) + 8
    for cut in sorted(set(range(0, header_end, 7)) | {header_end, len(data) - 1, len(data) - 100, len(data) // 2}):
        out.append((f"truncated at {cut}", data[:cut]))
    for i in range(flips):
        pos = rng.randrange(header_end)
        b = bytearray(data)
        b[pos] ^= 1 << rng.randrange(8)
        out.append((f"flip {i} at byte {pos}", bytes(b)))
    return out


def header_fields(data: bytes, *, array_items: int = 2, tensors: int = 24) -> list:
    """The (label, offset, format) of the counts, lengths, types and offsets in a real GGUF's
    header (``data``: at least the header's bytes); a long array's first ``array_items``
    string lengths only, the first ``tensors`` tensor entries only."""
    fields, pos = [], 4

    def take(fmt, label=None):
        nonlocal pos
        if label is not None:
            fields.append((label, pos, fmt))
        (value,) = struct.unpack_from("<" + fmt, data, pos)
        pos += struct.calcsize("<" + fmt)
        return value

    def string(label=None):
        nonlocal pos
        n = take("Q", label)
        text = data[pos:pos + n].decode("utf-8", "replace")
        pos += n
        return text

    scalars = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
    take("I", "version")
    n_tensors, n_kv = take("Q", "tensor_count"), take("Q", "kv_count")
    for _ in range(n_kv):
        key = string(None)
        fields.append((f"strlen key {key}", pos - 8 - len(key.encode()), "Q"))
        kind = take("I", f"type {key}")
        if kind == STRING:
            string(f"strlen value {key}")
        elif kind == ARRAY:
            inner = take("I", f"array type {key}")
            count = take("Q", f"array len {key}")
            if inner == STRING:
                for i in range(count):
                    string(f"strlen {key}[{i}]" if i < array_items else None)
            else:
                pos += count * struct.calcsize("<" + scalars[inner])
        else:
            take(scalars[kind], "alignment" if key == "general.alignment" else None)
    for t in range(n_tensors):
        name = string(f"tensor {t}" if t < tensors else None)
        label = (lambda what: f"{what} {name}") if t < tensors else (lambda what: None)
        n_dims = take("I", label("n_dims"))
        for i in range(n_dims):
            take("Q", label(f"dim{i}"))
        take("I", label("ggml type"))
        take("Q", label("offset"))
    return fields


def field_patches(data: bytes, fields: list, *, seed: int = 0, flips: int = 60) -> list:
    """[(label, (offset, bytes))]: each field of :func:`header_fields` set to edge values, and
    single-bit flips in the header, as patches of a large file (not copies of it)."""
    rng = random.Random(seed)
    out = []
    edges = _edge_values(data, fields, lambda top: set(range(15)) | {30, 40, top},
                         lambda value, top: {value + 1, value - 1, 0, top, 1 << 32})
    for label, offset, fmt, v in edges:
        out.append((f"{label}={v}", (offset, struct.pack("<" + fmt, v))))
    header_end = max(offset for _, offset, _ in fields) + 8
    for _ in range(flips):
        pos = rng.randrange(header_end)
        out.append((f"flip at byte {pos}", (pos, bytes([data[pos] ^ (1 << rng.randrange(8))]))))
    return out


def run_patches(source: Path, patches: list, workdir: Path, *, timeout: float = 3600) -> list:
    """Like :func:`run_inputs` for a large file: ``patches`` are [(offset, bytes)] applied in
    turn to one copy of ``source`` (restored after each), converted in child processes."""
    import shutil

    workdir = Path(workdir)
    copy = workdir / source.name
    shutil.copyfile(source, copy)
    outcomes: list = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                     os.environ.get("PYTHONPATH")])))
    while len(outcomes) < len(patches):
        todo, results = workdir / "patches.jsonl", workdir / "results.jsonl"
        todo.write_text("".join(json.dumps([o, b.hex()]) + "\n" for o, b in patches[len(outcomes):]))
        results.write_text("")
        proc = subprocess.run([sys.executable, __file__, "--patches", str(copy), str(todo), str(results),
                               str(workdir / "out")], env=env, capture_output=True, text=True, timeout=timeout)
        done = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
        outcomes += [d["outcome"] for d in done]
        if proc.returncode != 0 and len(outcomes) < len(patches):
            offset, blob = patches[len(outcomes)]
            with open(copy, "r+b") as f, open(source, "rb") as g:  # undo the patch the child died on
                g.seek(offset)
                f.seek(offset)
                f.write(g.read(len(blob)))
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            outcomes.append(f"{how}: {proc.stderr.strip()[-300:]}")
    return outcomes


def _patch_child(path: str, todo: str, results: str, out: str) -> None:
    import shutil

    from kvmetal.models import GGUFError, convert_gguf

    with open(results, "a") as sink:
        for line in Path(todo).read_text().splitlines():
            offset, blob = json.loads(line)
            blob = bytes.fromhex(blob)
            with open(path, "r+b") as f:
                f.seek(offset)
                original = f.read(len(blob))
                f.seek(offset)
                f.write(blob)
            try:
                convert_gguf(path, out, dtype="keep", overwrite=True)
                outcome = "converted"
            except GGUFError as exc:
                outcome = f"error: {exc}"
            except Exception as exc:  # noqa: BLE001
                outcome = f"raised {type(exc).__name__}: {exc}"
            with open(path, "r+b") as f:
                f.seek(offset)
                f.write(original)
            shutil.rmtree(out, ignore_errors=True)
            sink.write(json.dumps({"offset": offset, "outcome": outcome}) + "\n")
            sink.flush()


def run_inputs(paths: list, workdir: Path, *, timeout: float = 600) -> list:
    """The outcome of converting each file of ``paths``, in child processes: a child that
    dies by a signal is recorded for the file it was on, and a new child goes on after it."""
    workdir = Path(workdir)
    outcomes: list = []
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[1]),
                                                                     os.environ.get("PYTHONPATH")])))
    while len(outcomes) < len(paths):
        todo = workdir / "todo.txt"
        results = workdir / "results.jsonl"
        todo.write_text("".join(f"{p}\n" for p in paths[len(outcomes):]))
        results.write_text("")
        proc = subprocess.run([sys.executable, __file__, str(todo), str(results), str(workdir / "out")],
                              env=env, capture_output=True, text=True, timeout=timeout)
        done = [json.loads(line) for line in results.read_text().splitlines() if line.strip()]
        outcomes += [d["outcome"] for d in done]
        if proc.returncode != 0 and len(outcomes) < len(paths):
            how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
            outcomes.append(f"{how}: {proc.stderr.strip()[-300:]}")
    return outcomes


def _child(todo: str, results: str, out: str) -> None:
    import shutil

    from kvmetal.models import GGUFError, convert_gguf

    with open(results, "a") as sink:
        for path in Path(todo).read_text().splitlines():
            try:
                convert_gguf(path, out, dtype="keep", overwrite=True)
                outcome = "converted"
            except GGUFError as exc:
                outcome = f"error: {exc}"
            except Exception as exc:  # noqa: BLE001 - recorded, and the test fails on it
                outcome = f"raised {type(exc).__name__}: {exc}"
            shutil.rmtree(out, ignore_errors=True)
            sink.write(json.dumps({"path": path, "outcome": outcome}) + "\n")
            sink.flush()


if __name__ == "__main__":
    if sys.argv[1] == "--patches":
        _patch_child(*sys.argv[2:6])
    else:
        _child(*sys.argv[1:4])
