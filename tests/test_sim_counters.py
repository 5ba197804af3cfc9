"""kvmetal.sim cost counters: what each one counts, on kernels with known answers."""
from __future__ import annotations

import mlx.core as mx

import kvmetal.sim as sim
from kvcases import run1


def _traced(src, inputs, out_shape, **kw):
    with sim.trace() as t:
        run1(src, inputs, out_shape, **kw)
    return t.calls[0]


def test_barriers_count_once_per_threadgroup_execution():
    src = """
    threadgroup float buf[64];
    uint i = thread_index_in_threadgroup;
    for (int r = 0; r < 3; r++) {
      buf[i] = inp[i] + float(r);
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    out[thread_position_in_grid.x] = buf[63 - i];
    """
    call = _traced(src, [mx.ones(64)], (256,), grid=(256, 1, 1), threadgroup=(64, 1, 1), names=["inp"])
    assert call.barriers == 3 * 4  # 3 per threadgroup, 4 threadgroups
    assert call.threadgroup_memory == 256 and call.threadgroups == 4


def test_collectives_count_once_per_simdgroup_by_kind():
    src = """
    float x = inp[thread_position_in_grid.x];
    float s = simd_sum(x);
    float m = simd_max(x);
    float y = simd_shuffle_xor(x, ushort(1)) + simd_shuffle_xor(x, ushort(2)) + simd_broadcast(x, ushort(0));
    out[thread_position_in_grid.x] = s + m + y;
    """
    call = _traced(src, [mx.ones(128)], (128,), grid=(128, 1, 1), threadgroup=(64, 1, 1), names=["inp"])
    simdgroups = 4
    assert call.collectives == {"simd_sum": simdgroups, "simd_max": simdgroups,
                                "simd_shuffle_xor": 2 * simdgroups, "simd_broadcast": simdgroups}
    assert call.reductions == 2 * simdgroups and call.shuffles == 3 * simdgroups


def test_a_vote_counts_once_per_simdgroup():
    src = """
    float x = inp[thread_position_in_grid.x];
    out[thread_position_in_grid.x] = float(simd_all(x > 0.0f)) + 2.0f * float(simd_any(x > 1.0f));
    """
    call = _traced(src, [mx.ones(128)], (128,), grid=(128, 1, 1), threadgroup=(64, 1, 1), names=["inp"])
    assert call.collectives == {"simd_all": 4, "simd_any": 4}
    assert call.votes == 8 and call.shuffles == 0  # a ballot each (cost_model: simd_vote_cycles)


def test_value_collectives_count_per_32_bit_word():
    # A float2 shuffle is two shuffle instructions, a float4 sum four; a half is one word.
    src = """
    float x = inp[thread_position_in_grid.x];
    float2 a = simd_shuffle_xor(float2(x, 2.0f * x), ushort(1));
    float4 b = simd_sum(float4(x));
    half c = simd_shuffle_xor(half(x), ushort(2));
    out[thread_position_in_grid.x] = a.x + a.y + b.x + b.w + float(c);
    """
    call = _traced(src, [mx.ones(64)], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1), names=["inp"])
    assert call.collectives == {"simd_shuffle_xor": 2 * (2 + 1), "simd_sum": 2 * 4}


def test_a_shuffle_whose_lanes_read_different_lanes_counts_apart():
    # simd_shuffle with one source lane for all lanes is a broadcast; with lanes reading
    # different lanes it is a permutation (an instruction sequence on Apple GPUs, 32 cycles
    # a word in metal-benchmarks), counted as simd_shuffle_lanes and charged so by the model.
    src = """
    float x = inp[thread_position_in_grid.x];
    const ushort lane = ushort(thread_index_in_simdgroup);
    float same = simd_shuffle(x, ushort(3));
    float2 spread = simd_shuffle(float2(x, x), ushort(lane / 8));
    out[thread_position_in_grid.x] = same + spread.x + spread.y;
    """
    call = _traced(src, [mx.arange(64).astype(mx.float32)], (64,), grid=(64, 1, 1), threadgroup=(64, 1, 1),
                   names=["inp"])
    assert call.collectives == {"simd_shuffle": 2, "simd_shuffle_lanes": 2 * 2}
    assert call.shuffles == 2 and call.lane_shuffles == 4
    from kvmetal.sim import cost_model as cm

    work = cm.work_from_call(call, fma_lanes=0.0)
    F = {k: f.value for k, f in cm.FIGURES.items()}
    assert work.lane_shuffles == 4 and cm.issue_cycles(work) >= 4 * F["simd_shuffle_lanes_cycles"]


def test_transcendentals_count_per_lane_and_component():
    src = """
    uint i = thread_position_in_grid.x;
    float4 v = float4(inp[i]);
    float4 e = exp2(v);                         // 4 lane calls
    out[i] = exp(inp[i]) + tanh(inp[i]) + e.x + log(2.0f + inp[i]) + sqrt(inp[i]);  // sqrt is not counted
    """
    call = _traced(src, [mx.ones(64)], (64,), grid=(64, 1, 1), threadgroup=(32, 1, 1), names=["inp"])
    assert call.math == {"exp2": 4 * 64, "exp": 64, "tanh": 64, "log": 64}
    assert call.transcendentals == 7 * 64


def test_load_instructions_and_bytes_per_load():
    src = """
    uint i = thread_position_in_grid.x;
    half4 a = *(device const half4*)(h + 4 * i);    // one 8-byte load
    float b = f[i];                                  // one 4-byte load
    out[i] = float(a.x) + b;
    """
    h = mx.ones(4 * 32, dtype=mx.float16)
    f = mx.ones(32)
    call = _traced(src, [h, f], (32,), grid=(32, 1, 1), threadgroup=(32, 1, 1), names=["h", "f"])
    assert call.buffers["h"].load_ops == 32 and call.buffers["h"].loaded == 32 * 8
    assert call.buffers["h"].bytes_per_load == 8.0
    assert call.buffers["f"].load_ops == 32 and call.bytes_per_load("f") == 4.0
    assert call.buffers["out"].store_ops == 32 and call.buffers["out"].stored == 32 * 4
    assert call.bytes_per_load("h", "f") == (32 * 8 + 32 * 4) / 64
