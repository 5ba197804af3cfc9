// Decode attention: split-KV partials over a paged or a contiguous cache, and
// the reduce that merges the splits.
//
// File layout (read by kvmetal/backends/metal.py): everything before the first
// `//@kernel` line is this family's helper section, appended to
// kvmetal_common.h and passed as `header=`; each `//@kernel NAME` line starts
// the body of one mx.fast.metal_kernel (MLX writes the signature).
//
// Threadgroup organisation of the partial kernels: one threadgroup per
// (split, kv head, sequence) with NSG simdgroups. Per tile of TT tokens all
// NSG * 32 threads load the K and V rows once (vectorized, dequantized in
// registers for a quantized cache) into float threadgroup tiles; then
// simdgroup s serves query heads s, s + NSG, ... of the kv head's G heads,
// lanes splitting head_dim in float4 chunks. So each K/V row leaves device
// memory once whatever the GQA factor.

// Online-softmax attention of this kv head's G query heads over tokens
// [lo, hi), tiles starting at tile0 (a multiple of TT); writes one split's
// float32 partials (running max, sum of exp, unnormalised accumulator).
template <int D, int G, int TT, int NSG, typename KR, typename VR, typename KI, typename VI,
          typename PQ>
inline void kv_attend_split(
    KR krows, VR vrows, KI kindex, VI vindex,
    PQ q,  // [G, D] query rows of this kv head, query dtype
    int lo, int hi, int tile0, float scale, float softcap,
    threadgroup float4* ktile4,  // [TT, D / 4]
    threadgroup float4* vtile4,  // [TT, D / 4]
    threadgroup float4* merge,   // [NSG, D / 4] accumulators, then [NSG] (max, sum, -, -)
    uint tid, uint sg, uint lane,
    device float* part_max,  // [.., splits]  row part_row0 + g * head_stride
    device float* part_sum,
    device float* part_acc,  // [.., splits, D]
    int part_row0, int head_stride) {
  constexpr int C4 = D / 4;                  // float4 chunks per row
  constexpr int CPL = (C4 + 31) / 32;        // chunks per lane
  // With fewer heads than simdgroups (G = 1, 2) the simdgroups also split each
  // tile's tokens into P phases, and merge their states at the end.
  constexpr int P = G < NSG ? NSG / G : 1;   // token phases
  constexpr int SPP = NSG / P;               // simdgroups per phase
  constexpr int HPS = (G + SPP - 1) / SPP;   // heads per simdgroup
  constexpr int NT = NSG * 32;
  const int phase = int(sg) / SPP;
  const int slot = int(sg) % SPP;
  const KvRowAt kstep = kindex.row_step();
  const KvRowAt vstep = vindex.row_step();
  threadgroup float* ktile = reinterpret_cast<threadgroup float*>(ktile4);
  threadgroup float* vtile = reinterpret_cast<threadgroup float*>(vtile4);

  // Read the query (pre-scaled) and reset the running state.
  float4 qr[HPS][CPL];
  float4 acc[HPS][CPL];
  float mrun[HPS];
  float lrun[HPS];
  for (int j = 0; j < HPS; j++) {
    const int g = slot + j * SPP;
    for (int c = 0; c < CPL; c++) {
      const int idx = int(lane) + 32 * c;
      qr[j][c] = (g < G && idx < C4) ? kv_load4(q + g * D + idx * 4) * scale : float4(0.0f);
      acc[j][c] = float4(0.0f);
    }
    mrun[j] = KV_NEG_BIG;
    lrun[j] = 0.0f;
  }

  for (int t0 = tile0; t0 < hi; t0 += TT) {
    // Load the tile's live rows (tokens outside [lo, hi) are never read).
    // A tile lies inside one block: locate its first row once (one block-table
    // read per tile), then step row by row.
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const KvRowAt kfirst = kindex(t0);
    const KvRowAt vfirst = vindex(t0);
    for (int i = int(tid); i < TT * KR::TASKS; i += NT) {
      const int r = i / KR::TASKS;
      if (t0 + r >= lo && t0 + r < hi) {
        krows.template read<float>(kv_advance(kfirst, kstep, r), i % KR::TASKS, ktile + r * D);
      }
    }
    for (int i = int(tid); i < TT * VR::TASKS; i += NT) {
      const int r = i / VR::TASKS;
      if (t0 + r >= lo && t0 + r < hi) {
        vrows.template read<float>(kv_advance(vfirst, vstep, r), i % VR::TASKS, vtile + r * D);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    // Score, online softmax and accumulate, one token at a time.
    const int r_end = min(hi, t0 + TT) - t0;
    for (int r = max(lo, t0) - t0 + phase; r < r_end; r += P) {
      const threadgroup float4* krow = ktile4 + r * C4;
      const threadgroup float4* vrow = vtile4 + r * C4;
      for (int j = 0; j < HPS; j++) {
        if (slot + j * SPP >= G) {
          break;  // uniform across the simdgroup
        }
        float s = 0.0f;
        for (int c = 0; c < CPL; c++) {
          const int idx = int(lane) + 32 * c;
          if (idx < C4) {
            s += dot(qr[j][c], krow[idx]);
          }
        }
        s = simd_sum(s);
        if (softcap > 0.0f) {
          s = softcap * tanh(s / softcap);
        }
        const float m_new = max(mrun[j], s);
        const float correction = exp(mrun[j] - m_new);
        const float p = exp(s - m_new);
        lrun[j] = lrun[j] * correction + p;
        for (int c = 0; c < CPL; c++) {
          const int idx = int(lane) + 32 * c;
          if (idx < C4) {
            acc[j][c] = acc[j][c] * correction + p * vrow[idx];
          }
        }
        mrun[j] = m_new;
      }
    }
  }

  // Merge the token phases (one head per simdgroup when P > 1): every phase
  // publishes (max, sum, accumulator), phase 0 combines them.
  if (P > 1) {
    threadgroup float4* stats = merge + NSG * C4;
    if (lane == 0) {
      stats[sg] = kv_float4(mrun[0], lrun[0], 0.0f, 0.0f);
    }
    for (int c = 0; c < CPL; c++) {
      const int idx = int(lane) + 32 * c;
      if (idx < C4) {
        merge[int(sg) * C4 + idx] = acc[0][c];
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (phase == 0) {
      float m_all = KV_NEG_BIG;
      for (int p = 0; p < P; p++) {
        m_all = max(m_all, stats[p * SPP + slot].x);
      }
      float l_all = 0.0f;
      for (int c = 0; c < CPL; c++) {
        acc[0][c] = float4(0.0f);
      }
      for (int p = 0; p < P; p++) {
        const int from = p * SPP + slot;
        const float w = exp(stats[from].x - m_all);
        l_all += w * stats[from].y;
        for (int c = 0; c < CPL; c++) {
          const int idx = int(lane) + 32 * c;
          if (idx < C4) {
            acc[0][c] += w * merge[from * C4 + idx];
          }
        }
      }
      mrun[0] = m_all;
      lrun[0] = l_all;
    }
  }

  // Write this split's partials.
  for (int j = 0; j < HPS; j++) {
    const int g = slot + j * SPP;
    if (g >= G || phase != 0) {
      break;
    }
    const int prow = part_row0 + g * head_stride;
    if (lane == 0) {
      part_max[prow] = mrun[j];
      part_sum[prow] = lrun[j];
    }
    for (int c = 0; c < CPL; c++) {
      const int idx = int(lane) + 32 * c;
      if (idx < C4) {
        *reinterpret_cast<device float4*>(part_acc + size_t(prow) * D + idx * 4) = acc[j][c];
      }
    }
  }
}

// The token range [lo, hi) and first tile of one split. Splits cut the live
// range [window start, len) into equal runs of whole tiles, so a sliding
// window never assigns out-of-window blocks to anyone.
struct KvSplitRange {
  int lo;
  int hi;
  int tile0;
};

template <int TT>
inline KvSplitRange kv_split_range(int len, int window, int split, int num_splits) {
  const int first = window > 0 ? max(0, len - window) : 0;
  const int start = (first / TT) * TT;
  const int tiles = (len - start + TT - 1) / TT;
  const int per = (tiles + num_splits - 1) / num_splits * TT;
  const int begin = start + split * per;
  return KvSplitRange{max(first, begin), min(len, begin + per), begin};
}

//@kernel paged_attention_partials
// Inputs:  query [S, H, D] TQ; key_data [N, Hkv, BS, WK] (TK, or uint32 packed)
//          key_scales/key_biases [N, Hkv, BS, D/KGS] TK (8-element placeholders
//          for a float cache); value_* likewise; block_tables int32 [S, M];
//          seq_lens int32 [S]; scalars float32 [scale, softcap (0 = off), ...];
//          dims int32 [Hkv, M, window (0 = off), num_splits, H, ...]
// Outputs: part_max, part_sum float32 [S, H, splits]; part_acc float32 [S, H, splits, D]
// Grid:    threadgroups (splits, Hkv, S), NSG * 32 threads each.
const int split = int(threadgroup_position_in_grid.x);
const int kvh = int(threadgroup_position_in_grid.y);
const int seq = int(threadgroup_position_in_grid.z);
const int num_kv_heads = dims[0];
const int max_blocks = dims[1];
const int num_splits = dims[3];
const int num_heads = num_kv_heads * G;
const KvSplitRange range = kv_split_range<TT>(seq_lens[seq], dims[2], split, num_splits);

typedef typename RowsSelect<KBITS, KGS, D, TK, decltype(key_data), decltype(key_scales)>::type KRowsT;
typedef typename RowsSelect<VBITS, VGS, D, TV, decltype(value_data), decltype(value_scales)>::type VRowsT;
typedef PagedRowIndex<BS, RowShape<KBITS, KGS, D>::WIDTH, RowShape<KBITS, KGS, D>::GROUPS,
                      decltype(block_tables)> KIndexT;
typedef PagedRowIndex<BS, RowShape<VBITS, VGS, D>::WIDTH, RowShape<VBITS, VGS, D>::GROUPS,
                      decltype(block_tables)> VIndexT;
const KRowsT krows = {key_data, key_scales, key_biases};
const VRowsT vrows = {value_data, value_scales, value_biases};
const KIndexT kindex = {block_tables + seq * max_blocks, num_kv_heads, kvh};
const VIndexT vindex = {block_tables + seq * max_blocks, num_kv_heads, kvh};

threadgroup float4 ktile[TT * D / 4];
threadgroup float4 vtile[TT * D / 4];
threadgroup float4 merge[NSG * (D / 4 + 1)];
kv_attend_split<D, G, TT, NSG>(
    krows, vrows, kindex, vindex, query + size_t(seq * num_heads + kvh * G) * D,
    range.lo, range.hi, range.tile0, scalars[0], scalars[1], ktile, vtile, merge,
    thread_index_in_threadgroup, simdgroup_index_in_threadgroup, thread_index_in_simdgroup,
    part_max, part_sum, part_acc, (seq * num_heads + kvh * G) * num_splits + split, num_splits);

//@kernel decode_attention_partials
// Inputs:  query [B, H, 1, D] TQ (row-contiguous); key_data [B, Hkv, T, WK] (TK, or
//          uint32 packed) read in place through key_data_strides (any view); key_scales/key_biases [B, Hkv, T, D/KGS] (4-D placeholders for a
//          float cache); value_* likewise; scalars float32 [scale, softcap, ...];
//          dims int32 [Hkv, T, 0, num_splits, H, ...]
// Outputs: part_max, part_sum float32 [B, H, splits]; part_acc float32 [B, H, splits, D]
// Grid:    threadgroups (splits, Hkv, B), NSG * 32 threads each.
const int split = int(threadgroup_position_in_grid.x);
const int kvh = int(threadgroup_position_in_grid.y);
const int batch = int(threadgroup_position_in_grid.z);
const int num_kv_heads = dims[0];
const int num_splits = dims[3];
const int num_heads = num_kv_heads * G;
const KvSplitRange range = kv_split_range<TT>(dims[1], 0, split, num_splits);

typedef typename RowsSelect<KBITS, KGS, D, TK, decltype(key_data), decltype(key_scales)>::type KRowsT;
typedef typename RowsSelect<VBITS, VGS, D, TV, decltype(value_data), decltype(value_scales)>::type VRowsT;
const KRowsT krows = {key_data, key_scales, key_biases};
const VRowsT vrows = {value_data, value_scales, value_biases};
const StridedRowIndex kindex = {
    KvRowAt{size_t(batch * key_data_strides[0] + kvh * key_data_strides[1]),
            size_t(batch * key_scales_strides[0] + kvh * key_scales_strides[1]),
            size_t(batch * key_biases_strides[0] + kvh * key_biases_strides[1]),
            size_t(key_data_strides[3]), size_t(key_scales_strides[3]), size_t(key_biases_strides[3])},
    KvRowAt{size_t(key_data_strides[2]), size_t(key_scales_strides[2]), size_t(key_biases_strides[2]),
            0, 0, 0}};
const StridedRowIndex vindex = {
    KvRowAt{size_t(batch * value_data_strides[0] + kvh * value_data_strides[1]),
            size_t(batch * value_scales_strides[0] + kvh * value_scales_strides[1]),
            size_t(batch * value_biases_strides[0] + kvh * value_biases_strides[1]),
            size_t(value_data_strides[3]), size_t(value_scales_strides[3]),
            size_t(value_biases_strides[3])},
    KvRowAt{size_t(value_data_strides[2]), size_t(value_scales_strides[2]),
            size_t(value_biases_strides[2]), 0, 0, 0}};

threadgroup float4 ktile[TT * D / 4];
threadgroup float4 vtile[TT * D / 4];
threadgroup float4 merge[NSG * (D / 4 + 1)];
kv_attend_split<D, G, TT, NSG>(
    krows, vrows, kindex, vindex, query + size_t(batch * num_heads + kvh * G) * D,
    range.lo, range.hi, range.tile0, scalars[0], scalars[1], ktile, vtile, merge,
    thread_index_in_threadgroup, simdgroup_index_in_threadgroup, thread_index_in_simdgroup,
    part_max, part_sum, part_acc, (batch * num_heads + kvh * G) * num_splits + split, num_splits);

//@kernel attention_reduce
// Inputs:  part_max, part_sum float32 [R, splits]; part_acc float32 [R, splits, D]
//          (R = sequences * H); sinks float32 [H] (ignored unless HAS_SINKS);
//          dims int32 [Hkv, -, -, num_splits, H, ...]
// Outputs: out [R, D] TQ (the caller reshapes it)
// Grid:    one threadgroup of 32 threads per row r = seq * H + h.
const int row = int(threadgroup_position_in_grid.x);
const int lane = int(thread_index_in_threadgroup);
const int num_splits = dims[3];
const int head = row % dims[4];

// The merged max (the sink logit joins it) and softmax denominator.
float m = KV_NEG_BIG;
for (int s = 0; s < num_splits; s++) {
  m = max(m, part_max[row * num_splits + s]);
}
float denom = 0.0f;
if (HAS_SINKS) {
  m = max(m, sinks[head]);
  denom = exp(sinks[head] - m);
}
for (int s = 0; s < num_splits; s++) {
  denom += part_sum[row * num_splits + s] * exp(part_max[row * num_splits + s] - m);
}
const float inv_denom = 1.0f / denom;

for (int c = lane; c < D / 4; c += 32) {
  float4 o = float4(0.0f);
  for (int s = 0; s < num_splits; s++) {
    const float w = exp(part_max[row * num_splits + s] - m);
    o += w * kv_load4(part_acc + (size_t(row) * num_splits + s) * D + c * 4);
  }
  kv_store4<TQ>(out + size_t(row) * D + c * 4, o * inv_denom);
}
