"""Capture a real model's decode attention (Q, K, V of every layer) at a long context.

Random data has nothing for sparse V to skip (its scores are flat), so the sparse-V
benchmark (``kvmetal bench --cases sparse_v_captured``) decodes over these tensors.
Any mlx-lm model directory (or ``default``, SmolLM2) works: the model reads the prose
of ``pydoc_data.topics`` through kvmetal's paged cache (exact, cpu or metal backend),
prefilled in chunks up to ``tokens - 1`` positions, then decodes one token while every
layer's ``paged_attention`` call is kept. Each layer stores its query [H, D] and the
keys/values it sees [Hkv, T, D] as float16 (a sliding-window layer only its window,
so the benchmark runs them without a window), plus its scale and softcap.

    python -m kvmetal.benchmarks.attention_capture --model default --tokens 8192
    # -> $XDG_CACHE_HOME/kvmetal/captures/<model>-<tokens>.npz (printed)

Layout of the .npz: ``q{i}``, ``k{i}``, ``v{i}`` for captured layer i (``layers`` lists
them), ``scale`` and ``softcap`` [layers] (softcap 0 = none), ``meta`` a JSON string.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

CHUNK = 512


def capture_root() -> Path:
    """``$KVMETAL_CAPTURE_DIR``, else ``$XDG_CACHE_HOME/kvmetal/captures`` (``~/.cache``)."""
    if os.environ.get("KVMETAL_CAPTURE_DIR"):
        return Path(os.environ["KVMETAL_CAPTURE_DIR"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "kvmetal" / "captures"


def default_path(model_path: Path, tokens: int) -> Path:
    return capture_root() / f"{model_path.name}-{tokens}.npz"


def text_stream(tokenizer, n: int) -> np.ndarray:
    """The first n token ids of ``pydoc_data.topics`` (the stdlib's prose; ~100K tokens)."""
    from pydoc_data.topics import topics

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) < n:
        raise ValueError(f"[attention_capture] the text has {len(ids)} tokens, fewer than {n}")
    return np.array(ids[:n], dtype=np.int64)


class _Calls:
    """Keeps the arguments of ``ops.paged_attention`` calls while ``armed``."""

    def __init__(self):
        from .. import ops

        self.ops, self.original = ops, ops.paged_attention
        self.armed, self.calls = False, []

    def __enter__(self):
        def wrapped(*args, **kwargs):
            if self.armed:
                self.calls.append((args, dict(kwargs)))
            return self.original(*args, **kwargs)

        self.ops.paged_attention = wrapped
        return self

    def __exit__(self, *exc):
        self.ops.paged_attention = self.original


def _layer_tensors(args, kwargs) -> dict:
    """One decode call -> q [H, D], k/v [Hkv, T, D] float16 (the keys the query sees)."""
    from .. import reference

    query, kc, vc, tables, lens = args
    q = reference.to_f64(query).reshape(-1, query.shape[-2], query.shape[-1])[-1]  # the last query row
    n = int(np.array(lens)[0])
    table = reference.to_int(tables)[0]
    k = reference.sequence_rows(reference.to_f64(kc), table, n)
    v = reference.sequence_rows(reference.to_f64(vc), table, n)
    window = kwargs.get("sliding_window")
    if window:
        k, v = k[:, -window:], v[:, -window:]
    head_dim = q.shape[-1]
    scale = kwargs.get("scale")
    return {"q": q.astype(np.float16), "k": k.astype(np.float16), "v": v.astype(np.float16),
            "scale": head_dim ** -0.5 if scale is None else float(scale),
            "softcap": float(kwargs.get("softcap") or 0.0), "window": window}


def capture(model_spec: str | None, tokens: int, *, layers=None, progress=None) -> dict:
    """Decode position ``tokens - 1`` of the text after an exact prefill of the positions
    before it; returns {layer: _layer_tensors(...)} for ``layers`` (default: all)."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache
    from mlx_lm.utils import load

    from ..commands.common import resolve_model
    from ..integrations.mlx_lm import use_paged_cache

    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    path = resolve_model(model_spec)
    model, tokenizer = load(str(path))
    stream = text_stream(tokenizer, tokens)
    out = {}
    with use_paged_cache(model), _Calls() as calls:
        cache = make_prompt_cache(model)
        for pos in range(0, tokens - 1, CHUNK):  # exact prefill
            mx.eval(model.model(mx.array(stream[None, pos:min(tokens - 1, pos + CHUNK)]), cache=cache))
            say(f"  prefill {min(tokens - 1, pos + CHUNK)}/{tokens - 1}")
        calls.armed = True
        mx.eval(model(mx.array(stream[None, tokens - 1:tokens]), cache=cache))
        calls.armed = False
        wanted = range(len(calls.calls)) if layers is None else layers
        for i in wanted:
            out[i] = _layer_tensors(*calls.calls[i])
    return {"model": str(path), "tokens": tokens, "layers": out}


def save(result: dict, path: Path) -> Path:
    layers = sorted(result["layers"])
    arrays = {}
    for i in layers:
        for name in ("q", "k", "v"):
            arrays[f"{name}{i}"] = result["layers"][i][name]
    arrays["scale"] = np.array([result["layers"][i]["scale"] for i in layers])
    arrays["softcap"] = np.array([result["layers"][i]["softcap"] for i in layers])
    meta = {"model": result["model"], "tokens": result["tokens"], "layers": layers,
            "windows": [result["layers"][i]["window"] for i in layers]}
    arrays["meta"] = np.array(json.dumps(meta))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.tmp.npz")
    np.savez_compressed(tmp, **arrays)
    os.replace(tmp, path)
    return path


def load_capture(path) -> tuple[dict, list]:
    """(meta, [(layer, q [H, D], k [Hkv, T, D], v, scale, softcap), ...]) of a saved capture."""
    with np.load(path) as z:
        meta = json.loads(str(z["meta"]))
        rows = [(i, z[f"q{i}"], z[f"k{i}"], z[f"v{i}"], float(z["scale"][j]), float(z["softcap"][j]))
                for j, i in enumerate(meta["layers"])]
    return meta, rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default", help="mlx-lm model directory, repo id, or 'default' (SmolLM2)")
    ap.add_argument("--tokens", type=int, default=8192, help="context length (the decoded position is tokens - 1)")
    ap.add_argument("--layers", default=None, help="comma-separated layer indices (default: all)")
    ap.add_argument("--out", default=None, help="output .npz (default: under the capture cache directory)")
    args = ap.parse_args(argv)
    from ..models.blas import preload_openblas_and_reexec

    preload_openblas_and_reexec(["-m", __spec__.name, *sys.argv[1:]] if __spec__ else None)  # float32 models on Linux: MLX's reference BLAS is ~30x slower
    layers = None if args.layers is None else [int(x) for x in args.layers.split(",")]
    result = capture(args.model, args.tokens, layers=layers)
    out = Path(args.out) if args.out else default_path(Path(result["model"]), args.tokens)
    print(save(result, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
