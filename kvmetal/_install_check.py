"""Import-time checks that turn a broken install into one clear ImportError.

The compiled extension (``kvmetal._ext``) links against libmlx's C++ ABI, which is not
stable across MLX releases: loaded under another MLX it fails with an undefined symbol
deep inside the first op. The build records the MLX version it compiled against in
``kvmetal/_build_info.py`` (a plain Python file, readable without loading the extension);
here it is compared with the MLX this process runs, when something first asks for the
extension (``kvmetal/__init__.py``).
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent


def mismatch_message(built: str, running: str, *, platform: str = sys.platform) -> str:
    """The error for an extension built against MLX ``built`` running under ``running``."""
    mlx = "mlx" if platform == "darwin" else "mlx[cpu]"  # on Linux libmlx ships in mlx-cpu
    return (
        f"kvmetal's compiled extension was built against MLX {built}, but this Python runs MLX {running}; "
        f"libmlx's C++ ABI differs between versions, so the extension cannot load. Fix it with one of:\n"
        f"  pip install \"{mlx}=={built}\"\n"
        f"      (the MLX kvmetal was built with)\n"
        f"  pip install scikit-build-core \"nanobind>=3,<4\" && pip install --force-reinstall --no-deps "
        f"--no-cache-dir --no-build-isolation <kvmetal source dir>\n"
        f"      (rebuild kvmetal against MLX {running})")


def _inside_source_checkout() -> bool:
    root = PACKAGE_DIR.parent
    return (root / "pyproject.toml").is_file() and (root / "bindings").is_dir()


def pinned_mlx_version(root: Path | None = None) -> str | None:
    """The MLX version ``pyproject.toml`` pins (``mlx==X`` / ``mlx[cpu]==X``) in a source
    checkout, else None."""
    import re

    try:
        text = ((root or PACKAGE_DIR.parent) / "pyproject.toml").read_text()
    except OSError:
        return None
    found = re.search(r'"mlx(?:\[cpu\])?==([0-9][0-9A-Za-z.+-]*)', text)
    return found.group(1) if found else None


def missing_extension_message(*, platform: str = sys.platform) -> str:
    if _inside_source_checkout():
        mlx = "mlx" if platform == "darwin" else "mlx[cpu]"
        pin = pinned_mlx_version()
        mlx_req = f"\"{mlx}=={pin}\"" if pin else f"\"{mlx}\" (at the version pyproject.toml pins)"
        return (
            f"kvmetal was imported from the source tree {PACKAGE_DIR}, which has no compiled extension "
            f"(kvmetal._ext). Python puts the current directory first on sys.path, so running it from the "
            f"repository root shadows the installed package. Run Python from another directory, or install "
            f"for development (it builds the extension where this tree can find it):\n"
            f"  pip install scikit-build-core \"nanobind>=3,<4\" {mlx_req} && "
            f"pip install --no-build-isolation -e \".[test]\"")
    return (f"kvmetal's compiled extension (kvmetal._ext) is missing from {PACKAGE_DIR}; "
            f"reinstall kvmetal: pip install --force-reinstall --no-deps kvmetal")


def extension_problem() -> str | None:
    """Why ``kvmetal._ext`` cannot load in this process (the message of the ImportError
    that ``from kvmetal import _ext`` raises), or None when it can. Read when something
    first needs the extension, not at ``import kvmetal``: what needs no compiled kernel
    (budget, convert-gguf, the simulator, the reference) runs without one."""
    if importlib.util.find_spec("kvmetal._ext") is None:
        return missing_extension_message()
    try:
        from . import _build_info
    except ImportError:
        return None  # a build older than the record
    import mlx.core as mx

    if _build_info.MLX_VERSION != mx.__version__:
        return mismatch_message(_build_info.MLX_VERSION, mx.__version__)
    return None
