"""Per-configuration launch limits of the metal kernels, from their descriptions.

Apple GPUs cap threadgroup memory at 32 KiB and threads per threadgroup at 1024;
the simulator would run past either, so every offered configuration is checked
here against the one description both backends launch from.
"""
import itertools
import math

import mlx.core as mx
import pytest

from kvmetal import ops
from kvmetal.backends import metal

HEAD_DIMS = ops.SUPPORTED_HEAD_DIMS  # every configuration the API offers
BLOCK_SIZES = ops.SUPPORTED_BLOCK_SIZES
DTYPES = (mx.float16, mx.bfloat16, mx.float32)
GQA = tuple(range(1, 17))
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


def _within_limits(geometry: metal.Geometry):
    assert geometry.threadgroup_bytes <= metal.THREADGROUP_MEMORY_LIMIT, geometry
    assert geometry.threads_per_threadgroup <= metal.THREADS_PER_THREADGROUP_LIMIT, geometry
    assert all(g >= 1 for g in geometry.grid) and all(t >= 1 for t in geometry.threadgroup), geometry


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_attention_limits_every_configuration(head_dim):
    for block_size, dtype, gqa in itertools.product(BLOCK_SIZES, DTYPES, GQA):
        tile = metal.tile_tokens(head_dim, block_size)
        # Tiles never straddle a block, and hold at least one row.
        assert tile >= 1 and block_size % tile == 0
        for name in ("paged_attention_partials", "decode_attention_partials"):
            geometry = metal.SPECS[name].geometry(splits=3, num_kv_heads=8, num_seqs=2,
                                                  head_dim=head_dim, tile=tile)
            _within_limits(geometry)
            # Float32 K and V tiles plus the phase-merge scratch (checked against the
            # simulator's count of the declared arrays in test_metal_kernels).
            assert geometry.threadgroup_bytes == 4 * (2 * tile * head_dim + metal.SIMDGROUPS * (head_dim + 4))
        # Heads per simdgroup stay small enough to live in registers.
        assert math.ceil(gqa / metal.SIMDGROUPS) <= 4
        _within_limits(metal.SPECS["attention_reduce"].geometry(rows=8 * gqa))
        _within_limits(metal.SPECS["cache_rows_convert"].geometry(tokens=5, num_kv_heads=8,
                                                                  head_dim=head_dim))
        _within_limits(metal.SPECS["gather_kv_rows"].geometry(tasks=head_dim // 4, max_len=40, num_rows=16))
        _within_limits(metal.SPECS["copy_blocks_gather"].geometry(width=8 * block_size * head_dim, count=3))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_quantized_limits_every_configuration(head_dim):
    for bits, group_size in itertools.product(BITS, GROUP_SIZES):
        if head_dim % group_size:
            continue
        groups = head_dim // group_size
        _within_limits(metal.SPECS["cache_rows_quantize"].geometry(tokens=5, num_kv_heads=8, groups=groups))
        _within_limits(metal.SPECS["gather_kv_rows"].geometry(tasks=groups, max_len=40, num_rows=16))


def test_tile_is_largest_power_of_two_within_budget():
    assert metal.tile_tokens(128, 32) == 16
    assert metal.tile_tokens(64, 32) == 32
    assert metal.tile_tokens(256, 8) == 8
    assert metal.tile_tokens(80, 16) == 16


def test_split_count_fills_fallback_gpu_for_one_long_sequence():
    cores = metal.FALLBACK_GPU_CORES
    splits = metal.choose_num_splits(32768, 8, cores=cores)
    geometry = metal.SPECS["paged_attention_partials"].geometry(
        splits=splits, num_kv_heads=8, num_seqs=1, head_dim=128, tile=metal.tile_tokens(128, 16))
    assert geometry.threadgroups >= 4 * cores
    # Short sequences are not over-split, big batches not split at all.
    assert metal.choose_num_splits(300, 8, cores=cores) == 2
    assert metal.choose_num_splits(32768, 256, cores=cores) == 1
    assert metal.choose_num_splits(10**7, 1, cores=cores) == metal.MAX_SPLITS


def test_gpu_core_count_fallback_without_metal():
    if mx.metal.is_available():
        assert metal.gpu_core_count() >= 1
    else:
        assert metal.gpu_core_count() == metal.FALLBACK_GPU_CORES


def test_variant_names_spell_the_specialisation():
    spec = metal.SPECS["paged_attention_partials"]
    name = spec.variant(dict(TK=mx.float16, TV=mx.bfloat16, D=128, G=4, BS=16, TT=16, NSG=4,
                             KBITS=8, KGS=64, VBITS=4, VGS=64))
    assert name == ("kvmetal_paged_attention_partials_tkf16_tvbf16_d128_g4_bs16_tt16_nsg4"
                    "_kbits8_kgs64_vbits4_vgs64")


def test_every_description_has_a_body_and_no_spurious_injected_names():
    for name, spec in metal.SPECS.items():
        header, body = metal.kernel_text(name)
        assert body.strip(), name
        # MLX adds <input>_shape/_strides buffers by substring search: only the
        # strided kernel may mention strides, and no body mentions _shape.
        for input_name in spec.inputs:
            assert f"{input_name}_shape" not in body
            if spec.row_contiguous:
                assert f"{input_name}_strides" not in body
