"""Shared helpers for the simulator tests (tests/test_sim*.py)."""
from __future__ import annotations

import mlx.core as mx
import numpy as np

import kvmetal.sim as sim


def run1(source, inputs, out_shape, out_dtype=mx.float32, *, grid, threadgroup, names=None, header="",
         template=None, init_value=None, **kw):
    """Build a one-output kernel from `source` and run it; returns the output as NumPy."""
    names = names or [f"in{i}" for i in range(len(inputs))]
    k = sim.metal_kernel(name=kw.pop("name", "t"), input_names=names, output_names=["out"], source=source,
                         header=header, ensure_row_contiguous=kw.pop("ensure_row_contiguous", True),
                         atomic_outputs=kw.pop("atomic_outputs", False))
    (out,) = k(inputs=inputs, output_shapes=[out_shape], output_dtypes=[out_dtype], grid=grid,
               threadgroup=threadgroup, template=template, init_value=init_value, **kw)
    return np.array(out.astype(mx.float32) if out.dtype == mx.bfloat16 else out)
