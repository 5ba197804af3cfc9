"""Test processes run MLX's float32 matmuls on OpenBLAS, as the kvmetal command does
(kvmetal/models/blas.py): loaded here, before any test module imports MLX.

Every test gets the marker of its area, derived from its file's name by AREAS below, so
``pytest -m kernels`` is the inner loop of a kernel change and ``pytest -m "engine and not
slow"`` of an engine change (tests/README.md). A test file that matches no area stops the
collection: name it after its area, or add its prefix here."""
from pathlib import Path

import pytest

from kvmetal.models.blas import use_openblas

use_openblas()

# File-name prefixes (after "test_") of each area, first match wins; the markers are
# declared in pyproject.toml. Longer prefixes come before the shorter ones they extend.
AREAS = (
    ("engine", ("varlen_mlx_lm", "cascade_engine", "engine", "mlx_lm", "cache", "batch_invariance",
                "greedy_quant")),
    ("serve", ("serve",)),
    ("models", ("real_model", "blas", "gguf", "named")),
    ("tools", ("bench", "varlen_bench", "sparse_v_bench", "budget", "chips", "cli", "docs", "import_cycles",
               "install", "macho", "macos_crossbuild", "selfcheck")),
    ("kernels", ("metal", "sim", "varlen", "cascade", "ops", "cpu", "sparse_v", "quant", "kv_format", "query_tokens",
                 "cost_model", "head_dims", "kv_tanh", "split_reduce", "edge_inputs", "empty_sequences", "errors",
                 "index_guards", "bad_input_sweep")),
)


def area_of(path) -> str:
    """The area of a test file, from its name; ValueError for a file no area claims."""
    stem = Path(path).stem.removeprefix("test_")
    matches = [(len(prefix), area) for area, prefixes in AREAS for prefix in prefixes if stem.startswith(prefix)]
    if not matches:
        raise ValueError(f"{Path(path).name} belongs to no test area: add its prefix to AREAS in tests/conftest.py")
    return max(matches)[1]  # the longest prefix: test_varlen_mlx_lm is engine, test_varlen_errors kernels


def pytest_collection_modifyitems(config, items):
    for item in items:
        item.add_marker(getattr(pytest.mark, area_of(item.path)))
