"""What several commands share: a user's mistake as one line (``UserError``), a ``--model``
argument turned into a model directory (``resolve_model``), and the ``mlx.launch`` group
(``distributed_group``). ``kvmetal generate``, ``kvmetal serve`` and ``kvmetal bench
--model`` use them."""
from __future__ import annotations

import os
import sys
from pathlib import Path


class UserError(Exception):
    """A mistake in the command line or the environment: one line, no traceback."""


def resolve_model(spec: str | None, *, say=None) -> Path:
    """A local model directory, or a repo id through mlx-lm's own download and cache;
    a named model (``kvmetal.models.MODELS``: ``smollm2``, ``gemma3``), optionally as
    ``NAME:DTYPE`` with DTYPE keep/float32/float16/bfloat16, is converted on first use;
    None and ``default[:DTYPE]`` are the default model (smollm2). A local path of the same
    name wins. On Linux, one line on ``say`` (default stderr) when MLX runs on its slow
    reference BLAS."""
    from ..models.blas import reference_blas_note
    from ..models.named import DEFAULT, MODELS

    say = say or (lambda line: print(line, file=sys.stderr, flush=True))
    note = reference_blas_note()
    if note:
        say(note)
    name, _, dtype = (spec or DEFAULT).partition(":")
    name = DEFAULT if name == "default" else name
    if spec is None or (name in MODELS and not Path(spec).exists()):
        from ..models import ModelMissing, named_model_path
        from ..models.gguf import DTYPES

        if dtype and dtype not in DTYPES:
            raise UserError(f"--model {spec!r}: the named model's dtype must be one of {DTYPES}")
        from ..models.named import ModelCacheError

        try:
            return named_model_path(name, dtype or None, progress=say)
        except (ModelMissing, ModelCacheError) as exc:
            raise UserError(str(exc)) from None
    path = Path(spec).expanduser()
    if not path.exists():
        looks_like_repo = spec.count("/") == 1 and not spec.startswith((".", "/", "~"))
        if not looks_like_repo:
            raise UserError(f"--model {spec!r}: no such directory")
        from mlx_lm.utils import _download

        try:
            path = Path(_download(spec))
        except Exception as exc:  # huggingface_hub's errors: offline, unknown repo, no access
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            offline = os.environ.get("HF_HUB_OFFLINE") not in (None, "", "0")
            raise UserError(f"--model {spec!r} is not a local directory and could not be fetched from the "
                            f"Hugging Face Hub{' (HF_HUB_OFFLINE is set)' if offline else ''} nor found in its "
                            f"cache: {type(exc).__name__}: {reason[:200]}") from None
    if not path.is_dir() or not (path / "config.json").is_file():
        raise UserError(f"--model {spec!r} is not a model directory (no config.json)")
    if not any(path.glob("*.safetensors")):
        raise UserError(f"--model {spec!r} has a config.json but no weights (*.safetensors)")
    return path


def distributed_group():
    """The mlx.launch group when launched on several ranks, else None (a plain process).
    ``kvmetal generate`` and ``kvmetal serve`` both start from it."""
    import mlx.core as mx

    if not mx.distributed.is_available():
        return None
    group = mx.distributed.init()
    return group if group.size() > 1 else None
