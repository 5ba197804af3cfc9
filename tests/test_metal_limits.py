"""Per-configuration launch limits of the metal kernels, from their descriptions.

Apple GPUs cap threadgroup memory at 32 KiB and threads per threadgroup at 1024
(kvmetal.chips). The simulator enforces both, but only on the launches a test
makes; here every offered configuration (dtype, head_dim, block size, GQA, query
tokens, K/V format) is checked, without launching, against the one description
both backends launch from.
"""
import itertools

import mlx.core as mx
import pytest

from kvmetal import chips, ops
from kvmetal.backends import metal_layout, metal_specs

HEAD_DIMS = ops.SUPPORTED_HEAD_DIMS  # every configuration the API offers
BLOCK_SIZES = ops.SUPPORTED_BLOCK_SIZES
ITEMSIZES = (2, 4)  # float16 and bfloat16, float32: all a dtype changes in a layout
GQA = tuple(range(1, 17))
BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)


def _within_limits(geometry: metal_specs.Geometry):
    assert geometry.threadgroup_bytes <= chips.THREADGROUP_MEMORY_LIMIT, geometry
    assert geometry.threads_per_threadgroup <= chips.THREADS_PER_THREADGROUP_LIMIT, geometry
    assert all(g >= 1 for g in geometry.grid) and all(t >= 1 for t in geometry.threadgroup), geometry


QUERY_TOKENS = tuple(range(1, 9))
KV_FORMATS = ((0, 32), (8, 64), (4, 64), (2, 32), (3, 32), (5, 32), (6, 64), (4, 128))


def _layouts(head_dim, block_size):
    """Every layout the backend can pick at this head_dim and block size (the query of the
    cache's element size: float32 with float32, 16-bit with 16-bit)."""
    for itemsize, gqa, query_len, (kbits, kgs), (vbits, vgs) in itertools.product(
            ITEMSIZES, GQA, QUERY_TOKENS, KV_FORMATS, KV_FORMATS[:3]):
        if head_dim % kgs or head_dim % vgs:
            continue
        # A float cache's rows, or a quantized cache's scales and biases, have the cache dtype.
        layout = metal_layout.attention_layout(head_dim=head_dim, gqa=gqa, query_len=query_len, k_bits=kbits,
                                        k_group=kgs, k_itemsize=itemsize, v_bits=vbits, v_group=vgs,
                                        v_itemsize=itemsize, block_size=block_size, q_itemsize=itemsize)
        yield itemsize, gqa, query_len, kbits, kgs, vbits, vgs, layout


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_attention_limits_every_configuration(head_dim):
    for block_size in BLOCK_SIZES:
        for itemsize, gqa, query_len, kbits, kgs, vbits, vgs, layout in _layouts(head_dim, block_size):
            rows = gqa * query_len
            for name in ("paged_attention_partials", "decode_attention_partials"):
                _within_limits(metal_specs.SPECS[name].geometry(splits=3, num_kv_heads=8, num_seqs=2, layout=layout))
            # Registers (estimated_registers): every layout within the 128 a thread has
            # (chips.PIPELINE_REGISTER_LIMIT; issue 41, P1), register mode included (one row
            # too: its fewest-register key group fits), and every launch within what a
            # pipeline of that many registers allows.
            per = layout.rows_per_simdgroup
            registers = layout.registers(head_dim=head_dim, k_bits=kbits, v_bits=vbits, q_itemsize=itemsize,
                                         k_itemsize=itemsize, v_itemsize=itemsize)
            assert registers <= chips.PIPELINE_REGISTER_LIMIT, (layout, registers)
            assert metal_layout.REGISTER_MODE_LIMIT == chips.PIPELINE_REGISTER_LIMIT
            if per < rows:
                assert per <= metal_layout.SHARED_ROW_LIMIT, layout
            else:
                assert per <= metal_layout.ROW_REGISTER_LIMIT
            assert layout.threads <= min(chips.PIPELINE_THREAD_LIMIT, chips.max_threads_for_registers(registers))
            # 16-bit float and 4/8-bit caches keep up to 4 rows in register mode at D <= 128,
            # 3 at D 192 / 256, 2 at D 512, one fewer with float32 (more rows: shared mode's
            # smaller row blocks); wide atoms (2/3/5/6 bits: 16 or 32 values an atom) keep 1.
            most = 4 if head_dim <= 128 else 3 if head_dim <= 256 else 2
            if kbits in (0, 4, 8) and vbits in (0, 4, 8) and rows <= most - (itemsize == 4):
                assert per == rows, layout
            if rows == 1:
                assert per == rows, layout
            # Issue 9's threadgroup memory budget: 2 KiB for one-token GQA <= 8 at D <= 128
            # (register mode; plus the merge's chunk of rows since issue 41, P5), 8 KiB at
            # D <= 128, 16 KiB at D 256; shared mode: its tile budget (issue 41, P6) + 1 KiB.
            if query_len == 1 and gqa <= 8 and head_dim <= 128 and per == rows:
                assert layout.threadgroup_bytes <= 2048 + 4 * metal_layout.REGISTER_MERGE_FLOATS, layout
            if per == rows:
                assert layout.threadgroup_bytes <= (8192 if head_dim <= 128 else 16384), layout
            else:
                assert layout.threadgroup_bytes <= metal_layout.tile_memory_budget(head_dim) + 1024, layout
            assert per * layout.simdgroups * layout.row_passes >= rows  # shared mode past 128 rows: passes
            if per < rows:  # shared mode: tiles never straddle a block
                assert layout.tile >= 1 and block_size % layout.tile == 0 and metal_layout.SPLIT_UNIT % layout.tile == 0
            else:
                assert layout.tile == 0 and layout.simdgroups == metal_layout.REGISTER_SIMDGROUPS
            # Quantized atoms: whole words inside one group, aligned in every row.
            for bits, group, words in ((kbits, kgs, layout.key_atom_words), (vbits, vgs, layout.value_atom_words)):
                if bits:
                    values = words * 32 // bits
                    assert values % 4 == 0 and group % values == 0 and (head_dim * bits // 32) % words == 0
                else:
                    assert words == 0
        _within_limits(metal_specs.SPECS["attention_reduce"].geometry(rows=8 * 16))
        _within_limits(metal_specs.SPECS["cache_rows_convert"].geometry(tokens=5, num_kv_heads=8,
                                                                  head_dim=head_dim))
        _within_limits(metal_specs.SPECS["gather_kv_rows"].geometry(tasks=head_dim // 4, max_len=40, num_rows=16))
        _within_limits(metal_specs.SPECS["copy_blocks_gather"].geometry(width=8 * block_size * head_dim, count=3))


@pytest.mark.parametrize("head_dim", HEAD_DIMS)
def test_quantized_limits_every_configuration(head_dim):
    for bits, group_size in itertools.product(BITS, GROUP_SIZES):
        if head_dim % group_size:
            continue
        groups = head_dim // group_size
        _within_limits(metal_specs.SPECS["cache_rows_quantize"].geometry(tokens=5, num_kv_heads=8, groups=groups))
        _within_limits(metal_specs.SPECS["gather_kv_rows"].geometry(tasks=groups, max_len=40, num_rows=16))


def test_split_count_fills_fallback_gpu_for_one_long_sequence():
    cores = metal_layout.FALLBACK_GPU_CORES
    layout = metal_layout.attention_layout(head_dim=128, gqa=1, query_len=1, k_bits=0, k_group=32, k_itemsize=2,
                                    v_bits=0, v_group=32, v_itemsize=2, block_size=16)
    splits = metal_layout.choose_num_splits(32768, 8, cores=cores, threadgroup_bytes=layout.threadgroup_bytes,
                                     threads=layout.threads)
    geometry = metal_specs.SPECS["paged_attention_partials"].geometry(splits=splits, num_kv_heads=8, num_seqs=1,
                                                                layout=layout)
    assert geometry.threadgroups >= 4 * cores
    # Short sequences are not over-split, big batches not split at all.
    assert metal_layout.choose_num_splits(300, 8, cores=cores) == 2
    assert metal_layout.choose_num_splits(32768, 256, cores=cores) == 1
    assert metal_layout.choose_num_splits(10**7, 1, cores=cores) == metal_layout.MAX_SPLITS


def test_splits_follow_the_threadgroups_that_fit_per_core():
    """Occupancy, not a fixed count: a kernel with more threadgroup memory or more
    threads per threadgroup fits fewer threadgroups per core, so it gets fewer splits."""
    small = metal_layout.threadgroups_per_core(2 * 1024, 128)
    big_memory = metal_layout.threadgroups_per_core(16 * 1024, 128)
    many_threads = metal_layout.threadgroups_per_core(2 * 1024, 512)
    assert small > big_memory and small > many_threads
    assert big_memory == metal_layout.CORE_THREADGROUP_MEMORY // (16 * 1024)
    assert many_threads == metal_layout.CORE_THREADS // 512
    args = dict(cores=10)
    assert (metal_layout.choose_num_splits(10**6, 1, threadgroup_bytes=16 * 1024, **args)
            < metal_layout.choose_num_splits(10**6, 1, threadgroup_bytes=2 * 1024, **args))


def test_gpu_core_count_fallback_without_metal():
    if mx.metal.is_available():
        assert metal_layout.gpu_core_count() >= 1
    else:
        assert metal_layout.gpu_core_count() == metal_layout.FALLBACK_GPU_CORES


def test_variant_names_spell_the_specialisation():
    spec = metal_specs.SPECS["paged_attention_partials"]
    name = spec.variant(dict(TQ=mx.float32, TK=mx.float16, TV=mx.bfloat16, D=128, G=4, BS=16, QL=2, NSG=4, RPS=8, LPK=16, TT=0,
                             KBITS=8, KGS=64, KAW=2, VBITS=4, VGS=64, VAW=1, PF=1, SV=0, TP=mx.float32))
    assert name == ("kvmetal_paged_attention_partials_tqf32_tkf16_tvbf16_d128_g4_bs16_ql2_nsg4_rps8_lpk16_tt0"
                    "_kbits8_kgs64_kaw2_vbits4_vgs64_vaw1_pf1_sv0_tpf32")


def test_every_description_has_a_body_and_no_spurious_injected_names():
    for name, spec in metal_specs.SPECS.items():
        header, body = metal_specs.kernel_text(name)
        assert body.strip(), name
        # MLX adds <input>_shape/_strides buffers by substring search: only the
        # strided kernel may mention strides, and no body mentions _shape.
        for input_name in spec.inputs:
            assert f"{input_name}_shape" not in body
            if spec.row_contiguous:
                assert f"{input_name}_strides" not in body
