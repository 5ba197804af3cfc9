"""kvmetal.sim runs the function MLX would generate: compare with MLX's own verbose source.

MLX on Linux cannot run a Metal kernel, but inside mx.export_function it still
prints the Metal source it would compile (verbose=True).
"""
from __future__ import annotations

import mlx.core as mx
import pytest

import kvmetal.sim as sim

SOURCE = """
uint elem = thread_position_in_grid.x;
uint lane = thread_index_in_simdgroup;
T tmp = inp[elem] + T(small[0]) + T(sc) + T(inp_shape[0]) + T(inp_strides[0]);
out[elem] = tmp + T(threads_per_threadgroup.x + simdgroup_index_in_threadgroup + threadgroup_position_in_grid.y);
aux[elem] = inp_ndim + int(grid_size.x) + int(quadgroup_index_in_threadgroup);
"""

CASES = {
    "template_scalars_constants": dict(
        input_names=["inp", "small", "sc"], output_names=["out", "aux"], source=SOURCE, atomic=False,
        inputs=lambda: [mx.zeros((4, 8)), mx.zeros((3,), dtype=mx.int32), 2.0],
        dtypes=[mx.float32, mx.int32], template=[("T", mx.float32), ("N", 4), ("B", True)]),
    "half_bfloat_atomic": dict(
        input_names=["inp", "small", "sc"], output_names=["out", "aux"], source=SOURCE, atomic=True,
        inputs=lambda: [mx.zeros((16,), dtype=mx.float16), mx.zeros((9,), dtype=mx.bfloat16), mx.array(3)],
        dtypes=[mx.float32, mx.int32], template=[("T", mx.float16)]),
    "no_template_no_attributes": dict(
        input_names=["a", "b"], output_names=["o"], source="o[0] = a[0] + b[0];", atomic=False,
        inputs=lambda: [mx.zeros((2, 3), dtype=mx.uint32), mx.zeros((10,), dtype=mx.int64)],
        dtypes=[mx.uint32], template=None),
}


def _mlx_source(capfd, case, tmp_path) -> str:
    k = mx.fast.metal_kernel(name="sig", input_names=case["input_names"], output_names=case["output_names"],
                             source=case["source"], atomic_outputs=case["atomic"])
    arrays = case["inputs"]()

    def f(*arrs):
        it = iter(arrs)
        ins = [next(it) if isinstance(x, mx.array) else x for x in arrays]
        return k(inputs=ins, output_shapes=[(8,)] * len(case["dtypes"]), output_dtypes=case["dtypes"],
                 grid=(8, 1, 1), threadgroup=(8, 1, 1), template=case["template"], verbose=True)

    capfd.readouterr()
    mx.export_function(str(tmp_path / "k.mlxfn"), f, *[a for a in arrays if isinstance(a, mx.array)])
    return capfd.readouterr().out


@pytest.mark.parametrize("case", sorted(CASES))
def test_generated_source_is_mlx_source(case, capfd, tmp_path):
    c = CASES[case]
    printed = _mlx_source(capfd, c, tmp_path)
    assert "[[kernel]] void custom_kernel_sig" in printed
    k = sim.metal_kernel(name="sig", input_names=c["input_names"], output_names=c["output_names"],
                         source=c["source"], atomic_outputs=c["atomic"])
    arrays = [x if isinstance(x, mx.array) else mx.array(x) for x in c["inputs"]()]
    specs = [sim.signature.InputSpec(n, a.dtype, a.ndim, a.size) for n, a in zip(c["input_names"], arrays)]
    _, ours = k.metal_source(specs, c["dtypes"], c["template"] or [])
    assert printed == f"Generated source code for `sig`:\n```\n{ours}\n```\n"


def test_verbose_prints_what_mlx_prints(capfd, tmp_path):
    c = CASES["template_scalars_constants"]
    printed = _mlx_source(capfd, c, tmp_path)
    k = sim.metal_kernel(name="sig", input_names=c["input_names"], output_names=c["output_names"],
                         source=c["source"])
    k(inputs=c["inputs"](), output_shapes=[(8,)] * 2, output_dtypes=c["dtypes"], grid=(8, 1, 1),
      threadgroup=(8, 1, 1), template=c["template"], verbose=True)
    assert capfd.readouterr().out == printed


def test_substring_detection_quirk_is_reproduced():
    # MLX adds k_shape because "block_shape" contains it: the simulator must bind it too.
    src = "int block_shape = 2; out[0] = k[0] * float(block_shape);"
    k = sim.metal_kernel(name="quirk", input_names=["k"], output_names=["out"], source=src)
    spec = sim.signature.InputSpec("k", mx.float32, 1, 16)
    _, text = k.metal_source([spec], [mx.float32], [])
    assert "const constant int* k_shape [[buffer(1)]]" in text
    (o,) = k(inputs=[mx.full((16,), 3.0)], output_shapes=[(1,)], output_dtypes=[mx.float32], grid=(1, 1, 1),
             threadgroup=(1, 1, 1))
    assert o.item() == 6.0
