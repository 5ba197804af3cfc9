"""A small kernel written for the simulator's own tests (tests/test_sim_attention.py).

A split-KV ("flash decoding") attention pair: a partials kernel where one
threadgroup owns (kv head, split), stages K/V tiles in threadgroup memory so
they are read once for all query heads of the group (one simdgroup per query
head), and a reduce kernel that merges the float32 partials.
"""
from __future__ import annotations

import mlx.core as mx
import numpy as np

from kvmetal.sim import metal_kernel

PARTIALS_SOURCE = """
    // q [Hq, D]; k, v [Hkv, T, D]; pmax, psum [Hq, NS]; pacc [Hq, NS, D]
    uint kvh = threadgroup_position_in_grid.y;
    uint split = threadgroup_position_in_grid.z;
    uint sg = simdgroup_index_in_threadgroup;
    uint lane = thread_index_in_simdgroup;
    uint tid = thread_index_in_threadgroup;
    uint h = kvh * G + sg;
    int T = seq_len;
    int per = (T + NS - 1) / NS;
    int t0 = int(split) * per;
    int t1 = min(T, t0 + per);

    threadgroup float ks[TT * D];
    threadgroup float vs[TT * D];

    // Read the query
    float qv[D / 32];
    for (int j = 0; j < D / 32; j++) qv[j] = float(q[h * D + lane + 32 * j]) * scale;

    float m = -INFINITY;
    float s = 0.0f;
    float acc[D / 32];
    for (int j = 0; j < D / 32; j++) acc[j] = 0.0f;

    for (int base = t0; base < t1; base += TT) {
        int n = min(TT, t1 - base);
        // Stage the K/V tile once for all G query heads
        device const KT* krow = k + (size_t(kvh) * T + base) * D;
        device const KT* vrow = v + (size_t(kvh) * T + base) * D;
        for (int e = int(tid); e < n * D; e += 32 * G) {
            ks[e] = float(krow[e]);
            vs[e] = float(vrow[e]);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int t = 0; t < n; t++) {
            float d = 0.0f;
            for (int j = 0; j < D / 32; j++) d += qv[j] * ks[t * D + lane + 32 * j];
            float score = simd_sum(d);
            float m_new = max(m, score);
            float c = metal::exp(m - m_new);
            float p = metal::exp(score - m_new);
            s = s * c + p;
            for (int j = 0; j < D / 32; j++) acc[j] = acc[j] * c + p * vs[t * D + lane + 32 * j];
            m = m_new;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    uint p_idx = h * NS + split;
    if (lane == 0) {
        pmax[p_idx] = m;
        psum[p_idx] = s;
    }
    for (int j = 0; j < D / 32; j++) pacc[p_idx * D + lane + 32 * j] = acc[j];
"""

REDUCE_SOURCE = """
    // pmax, psum [Hq, NS]; pacc [Hq, NS, D] -> out [Hq, D]
    uint h = threadgroup_position_in_grid.y;
    uint lane = thread_index_in_simdgroup;
    float M = -INFINITY;
    for (int i = 0; i < NS; i++) M = max(M, pmax[h * NS + i]);
    float total = 0.0f;
    float o[D / 32];
    for (int j = 0; j < D / 32; j++) o[j] = 0.0f;
    for (int i = 0; i < NS; i++) {
        float w = metal::exp(pmax[h * NS + i] - M);
        total += psum[h * NS + i] * w;
        for (int j = 0; j < D / 32; j++) o[j] += pacc[(h * NS + i) * D + lane + 32 * j] * w;
    }
    for (int j = 0; j < D / 32; j++) out[h * D + lane + 32 * j] = OT(o[j] / total);
"""

_partials = None
_reduce = None


def split_kv_attention(q, k, v, *, num_splits: int, tile: int = 16):
    """Decode attention for one sequence: q [Hq, D], k/v [Hkv, T, D] -> out [Hq, D] in q's dtype."""
    global _partials, _reduce
    if _partials is None:
        _partials = metal_kernel("sim_example_attn_partials", ["q", "k", "v", "seq_len", "scale"],
                                 ["pmax", "psum", "pacc"], PARTIALS_SOURCE)
        _reduce = metal_kernel("sim_example_attn_reduce", ["pmax", "psum", "pacc"], ["out"], REDUCE_SOURCE)
    partials, reduce = _partials, _reduce
    hq, d = q.shape
    hkv, t, _ = k.shape
    g = hq // hkv
    ns = num_splits
    pmax, psum, pacc = partials(
        inputs=[q, k, v, t, d ** -0.5], output_shapes=[(hq, ns), (hq, ns), (hq, ns, d)],
        output_dtypes=[mx.float32] * 3, grid=(32 * g, hkv, ns), threadgroup=(32 * g, 1, 1),
        template=[("KT", k.dtype), ("D", d), ("G", g), ("TT", tile), ("NS", ns)])
    (out,) = reduce(inputs=[pmax, psum, pacc], output_shapes=[(hq, d)], output_dtypes=[q.dtype],
                    grid=(32, hq, 1), threadgroup=(32, 1, 1), template=[("OT", q.dtype), ("D", d), ("NS", ns)])
    return out


def attention_oracle(q, k, v) -> np.ndarray:
    """float64 softmax(q k^T / sqrt(D)) v, query head h reading kv head h // G."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    v = np.asarray(v, np.float64)
    hq, d = q.shape
    g = hq // k.shape[0]
    out = np.empty((hq, d))
    for h in range(hq):
        s = k[h // g] @ q[h] / np.sqrt(d)
        p = np.exp(s - s.max())
        out[h] = p @ v[h // g] / p.sum()
    return out
