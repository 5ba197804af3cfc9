"""Smoke test of an installed kvmetal wheel (CI and cibuildwheel run it from outside the
source tree): the extension loads against the installed MLX, the Metal sources shipped
inside the package, and one paged decode on the cpu backend matches the NumPy oracle."""
from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

import kvmetal as kv
from kvmetal import _build_info, _ext, reference


def main() -> int:
    package = Path(kv.__file__).resolve().parent
    assert "site-packages" in str(package), f"kvmetal imported from {package}, not from an installed wheel"
    assert _ext.mlx_version == _build_info.MLX_VERSION == mx.__version__, (
        _ext.mlx_version, _build_info.MLX_VERSION, mx.__version__)
    kernels = sorted(p.name for p in (package / "kernels").glob("*.metal"))
    assert {"attention.metal", "cache_write.metal", "cache_copy.metal"} <= set(kernels), kernels
    assert (package / "kernels" / "kvmetal_common.h").is_file()

    kc = mx.random.normal((4, 2, 16, 64), key=mx.random.key(0))
    vc = mx.random.normal((4, 2, 16, 64), key=mx.random.key(1))
    query = mx.random.normal((1, 4, 64), key=mx.random.key(2))
    tables, lens = mx.array([[2, 0, 3]], dtype=mx.int32), mx.array([40], dtype=mx.int32)
    with kv.use_backend("cpu"):
        out = kv.paged_attention(query, kc, vc, tables, lens)
    want = reference.paged_attention(*(np.array(a) for a in (query, kc, vc, tables, lens)))
    err = float(np.max(np.abs(np.array(out) - want)))
    assert err < 1e-4, err
    print(f"wheel smoke test ok: kvmetal {kv.__version__} from {package}, MLX {mx.__version__}, "
          f"{len(kernels)} Metal sources, paged_attention max error {err:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
