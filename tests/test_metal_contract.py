"""The named kernel contract: the KvAttnParams struct and its one packer, and
launch(name, **inputs) checked against SPECS before anything runs."""
import re

import mlx.core as mx
import numpy as np
import pytest

from kvmetal.backends import metal_specs
from kvmetal.sim.backend import sim_backend


def _struct_fields(text: str, name: str) -> list:
    body = re.search(r"struct\s+" + name + r"\s*\{(.*?)\};", text, re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    return [(m.group(2), "f" if m.group(1) == "float" else "i")
            for m in re.finditer(r"\b(int|float)\s+(\w+)\s*;", body)]


def test_param_struct_matches_the_msl_struct_field_for_field():
    header = metal_specs._find("kvmetal_common.h").read_text()
    assert _struct_fields(header, "KvAttnParams") == list(metal_specs.ATTENTION_PARAMS.fields)
    assert _struct_fields(header, "KvGatherParams") == list(metal_specs.GATHER_PARAMS.fields)
    for name, spec in metal_specs.SPECS.items():  # no positional parameter vectors left
        assert "dims" not in spec.inputs and "scalars" not in spec.inputs, name


def test_packer_stores_ints_and_floats_bit_for_bit():
    packed = np.array(metal_specs.ATTENTION_PARAMS.pack(num_kv_heads=3, query_len=8, scale=0.125, softcap=30.0))
    names = [n for n, _ in metal_specs.ATTENTION_PARAMS.fields]
    assert packed.dtype == np.int32 and packed.size >= 8
    assert packed[names.index("num_kv_heads")] == 3 and packed[names.index("query_len")] == 8
    assert packed[names.index("scale")].view(np.float32) == np.float32(0.125)
    assert packed[names.index("softcap")].view(np.float32) == np.float32(30.0)
    assert packed[names.index("window")] == 0
    with pytest.raises(TypeError, match="no field"):
        metal_specs.ATTENTION_PARAMS.pack(nope=1)


def test_launch_checks_inputs_against_specs():
    backend = sim_backend()
    geometry = metal_specs.SPECS["copy_blocks_gather"].geometry(width=4, count=1)
    blocks, src = mx.zeros((2, 4)), mx.array([1], dtype=mx.int32)
    with pytest.raises(TypeError, match=r"missing \['src'\]"):
        backend.launch("copy_blocks_gather", dict(T=mx.float32), geometry, [(1, 4)], [mx.float32], blocks=blocks)
    with pytest.raises(TypeError, match=r"unexpected \['extra'\]"):
        backend.launch("copy_blocks_gather", dict(T=mx.float32), geometry, [(1, 4)], [mx.float32], blocks=blocks,
                       src=src, extra=src)
    with pytest.raises(TypeError, match="must be an mx.array"):
        backend.launch("copy_blocks_gather", dict(T=mx.float32), geometry, [(1, 4)], [mx.float32], blocks=blocks,
                       src=[1])
    with pytest.raises(TypeError, match=r"template values \['T'\]"):
        backend.launch("copy_blocks_gather", {}, geometry, [(1, 4)], [mx.float32], blocks=blocks, src=src)
    (out,) = backend.launch("copy_blocks_gather", dict(T=mx.float32), geometry, [(1, 4)], [mx.float32],
                            blocks=mx.arange(8, dtype=mx.float32).reshape(2, 4), src=src)
    assert out.tolist() == [[4.0, 5.0, 6.0, 7.0]]


def test_attention_kernels_compile_relaxed_and_writes_safe():
    assert metal_specs.SPECS["paged_attention_partials"].math_mode == "relaxed"
    assert metal_specs.SPECS["attention_reduce"].math_mode == "relaxed"
    assert metal_specs.SPECS["cache_rows_quantize"].math_mode == "safe"
