"""Install checks: the MLX pin, the recorded build version, and the import-time errors."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import mlx.core as mx
import pytest

from kvmetal import _install_check

ROOT = Path(__file__).resolve().parents[1]


def test_extension_records_the_mlx_it_was_built_against():
    from kvmetal import _build_info, _ext

    assert _ext.mlx_version == _build_info.MLX_VERSION == mx.__version__


@pytest.mark.skipif(not (ROOT / "pyproject.toml").exists(), reason="needs the source tree")
def test_mlx_is_pinned_to_one_version_at_build_and_run_time():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    pins = project["build-system"]["requires"] + project["project"]["dependencies"]
    mlx_pins = [p for p in pins if re.match(r"mlx(\[cpu\])?\W", p)]
    versions = {re.search(r"==([\w.]+)", p).group(1) for p in mlx_pins if "==" in p}
    assert len(mlx_pins) == 4 and len(versions) == 1, mlx_pins
    assert versions == {mx.__version__}  # this environment runs the pinned MLX


def _run_python(code: str, cwd: Path, *flags) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_mlx_mismatch_raises_an_import_error_naming_both_versions(tmp_path):
    # Pretend the running MLX is another release: what needs no extension still imports
    # and runs (issue 35), the extension itself is refused before it loads.
    result = _run_python("import mlx.core as mx; mx.__version__ = '0.0.1'; import kvmetal, kvmetal.budget as b; "
                         "print(b.PRESETS['llama-3-8b'].num_layers); from kvmetal import _ext", tmp_path)
    assert result.returncode != 0 and result.stdout.strip() == "32", result.stderr
    last = result.stderr[result.stderr.index("ImportError"):]
    assert f"built against MLX {mx.__version__}" in last and "runs MLX 0.0.1" in last
    assert f'=={mx.__version__}"' in last and "pip install" in last


@pytest.mark.skipif(not (ROOT / "bindings").is_dir(), reason="needs the source tree")
def test_source_tree_without_extension_explains_the_shadowing(tmp_path):
    # A copy of the checkout with no build: what `python` from the repo root sees after
    # `pip install .`. -S skips site's .pth files (an editable install's import redirect);
    # site-packages stays reachable through PYTHONPATH, after the current directory.
    shutil.copytree(ROOT / "kvmetal", tmp_path / "kvmetal",
                    ignore=shutil.ignore_patterns("_ext*", "_build_info.py", "__pycache__", "kernels"))
    (tmp_path / "bindings").mkdir()
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    packages = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    prefix = f"import sys; sys.path[1:1] = {packages!r}; "
    # What needs no extension still imports (the budget arithmetic, the simulator) ...
    budget = _run_python(prefix + "import kvmetal.budget as b; print(b.PRESETS['llama-3-8b'].num_layers)",
                         tmp_path, "-S")
    assert budget.returncode == 0 and budget.stdout.strip() == "32", budget.stderr
    # ... and the first op, which needs the compiled backend, explains the shadowing.
    code = prefix + ("import mlx.core as mx, kvmetal as kv\n"
                     "with kv.use_backend('cpu'):\n"
                     "    kv.gather_kv_cache(mx.zeros((1, 1, 8, 64)), mx.zeros((1, 1, 8, 64)),\n"
                     "                       mx.array([[0]], dtype=mx.int32), mx.array([1], dtype=mx.int32))")
    result = _run_python(code, tmp_path, "-S")
    assert result.returncode != 0
    assert "imported from the source tree" in result.stderr and "Run Python from another directory" in result.stderr
    assert "cannot import name '_ext'" not in result.stderr


def test_mismatch_message_has_the_fix_commands():
    text = _install_check.mismatch_message("0.32.4", "0.32.0", platform="linux")
    assert "MLX 0.32.4" in text and "MLX 0.32.0" in text
    assert 'pip install "mlx[cpu]==0.32.4"' in text and "--no-build-isolation" in text
    assert 'pip install "mlx==0.32.4"' in _install_check.mismatch_message("0.32.4", "0.32.0", platform="darwin")


def test_every_public_name_is_exported():
    import kvmetal

    for name in kvmetal.__all__:
        assert getattr(kvmetal, name) is not None, name
