"""OpenBLAS under MLX's float32 matmuls on Linux (kvmetal/models/blas.py, bindings/blas_shim/).

Each check runs in a fresh interpreter: the library must be in place before MLX loads.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap

import pytest

from kvmetal.models import blas

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MLX's Linux wheel links the reference "
                                                                            "BLAS; elsewhere there is nothing to switch")


def _python(code: str, **env) -> str:
    environ = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "KVMETAL_NO_OPENBLAS")}
    # From outside the source tree: `python -c` puts the working directory first on sys.path,
    # and a checkout's kvmetal/ (no extension, no shim) would shadow the installed one.
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
                         env={**environ, **env}, cwd=tempfile.gettempdir())
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


needs_openblas = pytest.mark.skipif(blas.wheel_openblas() is None or blas.shim_library() is None,
                                    reason="scipy-openblas32 or kvmetal's shim is not installed")


@needs_openblas
def test_openblas_serves_mlx_and_a_rows_bits_do_not_depend_on_the_row_count():
    out = _python("""
        from kvmetal.models import blas
        assert blas.use_openblas() is not None
        import mlx.core as mx
        import numpy as np
        assert blas.sgemm_provider() == blas.shim_library() and blas.fast_blas_loaded()
        assert blas.reference_blas_note() is None
        rng = np.random.default_rng(0)
        for k, n in ((576, 192), (576, 576), (1536, 576), (128, 64), (64, 8), (576, 4096)):
            w = mx.array(rng.standard_normal((n, k)).astype(np.float32))
            x = mx.array(rng.standard_normal((300, k)).astype(np.float32))
            big = x @ w.T
            for m in list(range(1, 34)) + [47, 48, 49, 64, 96, 129, 257]:  # 48: the shim's row blocks
                assert mx.array_equal(x[:m] @ w.T, big[:m]), (k, n, m)   # padded or not, the same bits
            for off in range(1, 13):  # a row at any place in its call (a batch's rows move)
                assert mx.array_equal(x[off:off + 48] @ w.T, big[off:off + 48]), (k, n, "offset", off)
            xt = mx.array(rng.standard_normal((k, 40)).astype(np.float32))  # A transposed
            assert all(mx.array_equal(xt[:, :m].T @ w.T, (xt.T @ w.T)[:m]) for m in (1, 2, 5, 17))
            want = np.asarray(x, dtype=np.float64) @ np.asarray(w, dtype=np.float64).T
            assert np.abs(np.asarray(big) - want).max() < 1e-3 * np.abs(want).max()
        import ctypes
        shim = ctypes.CDLL(blas.shim_library())
        assert shim.cblas_dgemm and shim.cblas_cgemm  # every BLAS symbol libmlx imports
        print("ok")
    """)
    assert out.strip() == "ok"


@needs_openblas
def test_opting_out_or_importing_mlx_first_keeps_the_reference_blas():
    out = _python("""
        from kvmetal.models import blas
        print(blas.use_openblas(), blas.fast_blas_loaded(), blas.reference_blas_note())
    """, KVMETAL_NO_OPENBLAS="1")
    assert out.split()[:2] == ["None", "False"] and out.strip().endswith("None")  # asked for: no note
    out = _python("""
        import mlx.core as mx
        from kvmetal.models import blas
        print(blas.use_openblas(), blas.fast_blas_loaded())
        print(blas.reference_blas_note())
    """)
    first, note = out.strip().splitlines()
    assert first == "None False" and "use_openblas() before the first import of mlx" in note


@needs_openblas
def test_the_kvmetal_command_loads_it_before_mlx():
    out = _python("""
        import contextlib, io
        from kvmetal import cli
        with contextlib.redirect_stdout(io.StringIO()):
            assert cli.main(["budget", "-m", "llama-3-8b", "--context", "8K"]) == 0
        from kvmetal.models import blas
        import ctypes
        print(blas.fast_blas_loaded(), ctypes.CDLL(blas.wheel_openblas()).scipy_openblas_get_num_threads())
    """)
    loaded, threads = out.split()
    assert loaded == "True" and int(threads) == blas.default_threads()


def test_import_kvmetal_loads_no_mlx():
    # What lets the command load OpenBLAS first, and `kvmetal budget` run beside a broken extension.
    out = _python("import sys, kvmetal, kvmetal.cli, kvmetal.models.blas; print('mlx.core' in sys.modules)")
    assert out.strip() == "False"
