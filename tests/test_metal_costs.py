"""Issue 9's "must show" cost limits of the decode kernels, measured by the
simulator's counters (kvmetal.sim.traffic) at 4K tokens (docs/kernels.md: 8K).

Loads: every live K/V row once (<= 1.02x), K8/V4 <= 0.42x float16, every packed
word once. Threadgroup memory: register mode <= 2 KiB plus the merge's chunk
(metal_layout.REGISTER_MERGE_FLOATS, issue 41 P5) and <= 8 KiB at D <= 128, <= 16 KiB
at D 256; shared mode <= its tile budget (metal_layout.tile_memory_budget, issue 41 P6)
plus 1 KiB. At D 128: no simd_sum-class
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
MULTIPASS = {("paged", 128, 16, 8, False): 2, ("paged", 128, 16, 8, True): 3, ("paged", 256, 8, 8, False): 2,
             ("decode", 128, 8, 8, True): 2}  # K/V passes of the cases past one block of rows


def _costs(kernel, head_dim, gqa, query_len, quantized, tokens=TOKENS, **kw):
    fn = traffic.paged_costs if kernel == "paged" else traffic.decode_costs
    return fn(tokens, head_dim=head_dim, gqa=gqa, query_len=query_len, **(K8V4 if quantized else {}), **kw)


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_decode_kernel_costs_meet_the_limits(case):
    kernel, head_dim, gqa, query_len, quantized = case
    fig = _costs(*case)
    # K/V once per block of rows: one block, except where the thread cap (384) and the
    # register estimate (within 128 since issue 41, P1) leave fewer rows per launch than
    # G x L: 128 rows float16 2 (8 simdgroups x 8), K8/V4 3 (11 x 4); 64 rows at D 256 2.
    passes = metal_layout.attention_layout(head_dim=head_dim, gqa=gqa, query_len=query_len, k_bits=8 if quantized else 0,
                                    k_group=64, k_itemsize=2, v_bits=4 if quantized else 0, v_group=64,
                                    v_itemsize=2, block_size=16).row_passes
    assert passes == MULTIPASS.get(case, 1)
    assert fig["loaded_over_live"] <= 1.02 * passes
    assert fig["data_loaded_once"] or passes > 1  # every K/V row (every packed word) exactly once
    memory = fig["threadgroup_memory"]
    layout = metal_layout.attention_layout(head_dim=head_dim, gqa=gqa, query_len=query_len,
                                           k_bits=8 if quantized else 0, k_group=64, k_itemsize=2,
                                           v_bits=4 if quantized else 0, v_group=64, v_itemsize=2, block_size=16)
    if layout.tile == 0:  # register mode: issue 9's 2 KiB, plus the merge's chunk of rows (issue 41, P5)
        assert memory <= 2048 + 4 * metal_layout.REGISTER_MERGE_FLOATS
        assert memory <= (8192 if head_dim <= 128 else 16384)
    else:  # shared mode: the K/V tiles' budget (issue 41, P6: 16 KiB, before 7.5 / 15.5) and 1 KiB
        assert memory <= metal_layout.tile_memory_budget(head_dim) + 1024
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
    # chips.PIPELINE_THREAD_LIMIT, not 1536) x the rows the register estimate allows (8
    # within 128 registers: 4 passes; 11 and 3 passes before issue 41, P1).
    # Each pass streams the split's K/V rows once.
    layout = metal_layout.attention_layout(head_dim=64, gqa=48, query_len=8, k_bits=0, k_group=32, k_itemsize=2,
                                    v_bits=0, v_group=32, v_itemsize=2, block_size=16)
    call, fig = traffic.paged_call(512, head_dim=64, gqa=48, query_len=8, num_splits=2)
    assert call.threadgroup[0] == metal_layout.MAX_SHARED_SIMDGROUPS * 32 == chips.PIPELINE_THREAD_LIMIT == 384
    assert layout.row_passes == 4 and layout.rows_per_simdgroup == 8
    assert 3.98 <= fig["loaded_over_live"] <= 4.02


@pytest.mark.parametrize("gqa", [4, 8])
def test_register_mode_merge_takes_a_barrier_per_chunk_of_rows(gqa):
    """Issue 41, P5: the register-mode merge publishes a chunk of rows per barrier
    (metal_layout.merge_rows): 2 x chunks - 1 barriers a split, where the merge row by
    row took 1 + 2 x rows (4K tokens: 16 windows of 256, every one non-empty)."""
    fig = _costs("paged", 128, gqa, 1, False)
    layout = metal_layout.attention_layout(head_dim=128, gqa=gqa, query_len=1, k_bits=0, k_group=64, k_itemsize=2,
                                           v_bits=0, v_group=64, v_itemsize=2, block_size=16)
    assert layout.tile == 0 and layout.simdgroups == 4
    chunks = -(-gqa // metal_layout.merge_rows(128, layout.simdgroups, gqa))
    assert chunks == (1 if gqa == 4 else 2)
    assert fig["barriers"] == fig["threadgroups"] * (2 * chunks - 1)
    assert fig["barriers"] < fig["threadgroups"] * (1 + 2 * gqa)


def test_tile_budget_is_a_parameter(monkeypatch):
    """Issue 41, P6: 16 KiB tiles give float16 D 128 16-token tiles (a barrier per 16 keys);
    KVMETAL_METAL_TILE_KIB sets another budget for a Mac to compare (7.5: the old 4 tokens)."""
    def layout():
        return metal_layout.attention_layout(head_dim=128, gqa=16, query_len=1, k_bits=0, k_group=64,
                                             k_itemsize=2, v_bits=0, v_group=64, v_itemsize=2, block_size=16)

    monkeypatch.delenv("KVMETAL_METAL_TILE_KIB", raising=False)
    assert layout().tile == 16 and layout().threadgroup_bytes <= 16 * 1024 + 1024
    monkeypatch.setenv("KVMETAL_METAL_TILE_KIB", "7.5")
    assert layout().tile == 4 and layout().threadgroup_bytes <= 8 * 1024
    few = _costs("paged", 128, 16, 1, False, tokens=1024, num_splits=4)
    monkeypatch.delenv("KVMETAL_METAL_TILE_KIB")
    many = _costs("paged", 128, 16, 1, False, tokens=1024, num_splits=4)
    assert many["barriers"] * 3 < few["barriers"]  # a barrier per tile (+1 a split)
    for bad in ("0", "x", "64"):
        monkeypatch.setenv("KVMETAL_METAL_TILE_KIB", bad)
        with pytest.raises(ValueError):
            layout()
