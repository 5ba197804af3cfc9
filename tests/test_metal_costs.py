"""Issue 9's "must show" cost limits of the decode kernels, measured by the
simulator's counters (kvmetal.sim.traffic) at 4K tokens (docs/kernels.md: 8K).

Loads: every live K/V row once (<= 1.02x), K8/V4 <= 0.42x float16, every packed
word once. Threadgroup memory: <= 2 KiB for one-token GQA <= 8 at D <= 128,
<= 8 KiB at D <= 128, <= 16 KiB at D 256. At D 128: no simd_sum-class
reduction in the token loop (<= 0.25 per token x row), <= 1.15 transcendentals
per token x row, >= 8 bytes per load for float caches. Register mode has no
barrier in the token loop: its barrier count per call does not grow with tokens.
"""
import pytest

from kvmetal import chips
from kvmetal.backends import metal_layout
from kvmetal.sim import traffic

TOKENS = 4096
K8V4 = dict(k_bits=8, v_bits=4)

CASES = [  # kernel, head_dim, GQA, L, quantized
    ("paged", 128, 1, 1, False), ("paged", 128, 8, 1, False), ("paged", 128, 4, 8, False),
    ("paged", 128, 16, 8, False), ("paged", 128, 8, 1, True), ("paged", 128, 16, 8, True),
    ("paged", 64, 4, 1, True), ("paged", 256, 8, 8, False), ("decode", 128, 4, 1, False),
    ("decode", 128, 8, 8, True),
]


def _costs(kernel, head_dim, gqa, query_len, quantized, tokens=TOKENS, **kw):
    fn = traffic.paged_costs if kernel == "paged" else traffic.decode_costs
    return fn(tokens, head_dim=head_dim, gqa=gqa, query_len=query_len, **(K8V4 if quantized else {}), **kw)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_decode_kernel_costs_meet_the_limits(case):
    kernel, head_dim, gqa, query_len, quantized = case
    fig = _costs(*case)
    # K/V once per block of rows: one block, except where the thread cap (384) and the
    # register estimate leave fewer rows per launch than G x L (128 rows of K8/V4: 2).
    passes = metal_layout.attention_layout(head_dim=head_dim, gqa=gqa, query_len=query_len, k_bits=8 if quantized else 0,
                                    k_group=64, k_itemsize=2, v_bits=4 if quantized else 0, v_group=64,
                                    v_itemsize=2, block_size=16).row_passes
    assert passes == (2 if (gqa * query_len, quantized) == (128, True) else 1)
    assert fig["loaded_over_live"] <= 1.02 * passes
    assert fig["data_loaded_once"] or passes > 1  # every K/V row (every packed word) exactly once
    memory = fig["threadgroup_memory"]
    if query_len == 1 and gqa <= 8 and head_dim <= 128:
        assert memory <= 2048
    assert memory <= (8192 if head_dim <= 128 else 16384)
    assert fig["reductions_per_token_row"] <= 0.25
    if head_dim == 128:
        assert fig["transcendentals_per_token_row"] <= 1.15
        if not quantized:
            assert fig["bytes_per_load"] >= 8


def test_k8v4_loads_under_042_of_float16():
    f16 = _costs("paged", 128, 4, 1, False)
    k8v4 = _costs("paged", 128, 4, 1, True)
    assert k8v4["loaded_bytes"] <= 0.42 * f16["loaded_bytes"]


@pytest.mark.parametrize("gqa,query_len", [(4, 1), (1, 8)])
def test_register_mode_barriers_do_not_grow_with_tokens(gqa, query_len):
    short = _costs("paged", 128, gqa, query_len, False, tokens=2048, num_splits=8)
    long = _costs("paged", 128, gqa, query_len, False, tokens=8192, num_splits=8)
    assert short["barriers"] == long["barriers"] > 0  # the end-of-split merge only


def test_sliding_window_loads_only_the_window():
    fig = _costs("paged", 128, 4, 1, False, sliding_window=1000)
    assert fig["loaded_over_live"] <= 1.02  # live = the window's rows


def test_multipass_shared_mode_caps_the_threadgroup_and_reads_kv_once_per_pass():
    # 48 query heads per kv head with L = 8: 384 rows, passes of 12 simdgroups (384 threads,
    # chips.PIPELINE_THREAD_LIMIT, not 1536) x the rows the register estimate allows.
    # Each pass streams the split's K/V rows once.
    layout = metal_layout.attention_layout(head_dim=64, gqa=48, query_len=8, k_bits=0, k_group=32, k_itemsize=2,
                                    v_bits=0, v_group=32, v_itemsize=2, block_size=16)
    call, fig = traffic.paged_call(512, head_dim=64, gqa=48, query_len=8, num_splits=2)
    assert call.threadgroup[0] == metal_layout.MAX_SHARED_SIMDGROUPS * 32 == chips.PIPELINE_THREAD_LIMIT == 384
    assert layout.row_passes == 3 and layout.rows_per_simdgroup == 11
    assert 2.98 <= fig["loaded_over_live"] <= 3.02
