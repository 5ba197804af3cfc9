"""Test processes run MLX's float32 matmuls on OpenBLAS, as the kvmetal command does
(kvmetal/models/blas.py): loaded here, before any test module imports MLX."""
from kvmetal.models.blas import use_openblas

use_openblas()
