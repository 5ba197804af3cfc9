"""What the paged decode kernel reads, measured by the simulator's traffic counters.

Bytes loaded count every access (not just distinct bytes), so "read once" means
each live K/V row leaves device memory once whatever the GQA factor, a sliding
window skips the blocks before it, and a K8/V4 cache reads well under half the
bytes of float16.
"""
import pytest

from kvmetal.backends import metal_layout
from kvmetal.sim.traffic import paged_call

TOKENS, HEAD_DIM, KV_HEADS, BLOCK_SIZE = 4096, 128, 2, 16
ROW_BYTES_F16 = HEAD_DIM * 2


@pytest.mark.parametrize("gqa", [1, 4, 8])
def test_paged_decode_reads_each_live_row_once(gqa):
    call, figures = paged_call(TOKENS, num_kv_heads=KV_HEADS, gqa=gqa, head_dim=HEAD_DIM)
    live = 2 * TOKENS * KV_HEADS * ROW_BYTES_F16  # K and V
    assert figures["live_bytes"] == live
    assert figures["loaded_bytes"] <= 1.02 * live, figures["loaded_over_live"]
    # Every live row was read (the kernel did not skip work either).
    assert call.buffers["key_data"].distinct_loaded == live // 2
    assert call.buffers["value_data"].distinct_loaded == live // 2


def test_sliding_window_skips_out_of_window_blocks():
    window = 1024
    _, figures = paged_call(TOKENS, num_kv_heads=KV_HEADS, gqa=4, head_dim=HEAD_DIM, sliding_window=window)
    bound = 2 * KV_HEADS * (window + BLOCK_SIZE) * ROW_BYTES_F16  # window + one block per kv head, K and V
    assert figures["loaded_bytes"] <= bound
    assert figures["loaded_bytes"] >= 2 * KV_HEADS * window * ROW_BYTES_F16


def test_k8v4_reads_under_042_of_float16():
    _, f16 = paged_call(TOKENS, num_kv_heads=KV_HEADS, gqa=4, head_dim=HEAD_DIM)
    _, k8v4 = paged_call(TOKENS, num_kv_heads=KV_HEADS, gqa=4, head_dim=HEAD_DIM, k_bits=8, v_bits=4, group_size=64)
    assert k8v4["loaded_bytes"] <= 0.42 * f16["loaded_bytes"], k8v4["loaded_bytes"] / f16["loaded_bytes"]
    assert k8v4["loaded_bytes"] <= 1.02 * k8v4["live_bytes"]


def test_one_long_sequence_fills_the_gpu():
    _, figures = paged_call(32768, num_kv_heads=8, gqa=1, head_dim=64)
    assert figures["threadgroups"] >= 4 * metal_layout.FALLBACK_GPU_CORES
    assert figures["loaded_bytes"] <= 1.02 * figures["live_bytes"]


def test_bench_rows_without_metal_are_labelled_sim_traffic():
    import mlx.core as mx

    from kvmetal.benchmarks.sim_cases import SIM_LABEL, traffic_rows

    if mx.metal.is_available():
        pytest.skip("on a Mac the rows are timings")
    rows = traffic_rows(lambda message: None)
    assert rows and all(SIM_LABEL in r["note"] and r["seconds"] is None for r in rows)
    assert all(r["loaded_over_live"] <= 1.02 for r in rows)
