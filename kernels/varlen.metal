// Paged varlen attention: query tiles of prefill chunks (any mix of sequences
// and lengths) against the paged cache, with 8x8 simdgroup_matrix MMA.
//
// File layout as in attention.metal: the helper section (before the first
// `//@kernel`) is appended to kvmetal_common.h and passed as `header=`.
//
// Design (docs/kernels.md, "Varlen prefill"):
// - One threadgroup per (query tile, kv head, split). A query tile is BQ = 8 *
//   NSG * RF / DS consecutive rows of one sequence's rows enumerated position-major over
//   the G query heads of the kv head (row r = position r / G, head r % G), so
//   the G heads share every K/V tile: each K/V row leaves device memory once
//   per kv head and query tile.
// - Simdgroup sg owns the 8 rows [8 sg, 8 sg + 8) of the tile (RF 1, DS 1; RF row
//   fragments, shared by DS simdgroups over D / DS dims each: see the kernel's
//   Grid note): its Q (pre-scaled), S and O live in simdgroup_float8x8 fragments; a lane holds row fm
//   of every fragment (Apple's layout: fm = (lane / 4 & 4) + (lane / 2) % 4), so
//   the online-softmax state (m, l) of a row is one scalar per lane and a row
//   reduction is simd_shuffle_xor by 1 and 8.
// - K/V tiles of BK tokens are copied from the paged blocks into threadgroup
//   memory in the storage type (quantized rows dequantized once into the tile,
//   K in float32 and V in the scales' float type (metal.py picks TK, TV), by
//   every thread in runs of whole words); lanes
//   read fragments from the tile by their own coordinates, each fragment's two
//   elements in one vector load: V row-major, K transposed (KT = 1, dims as
//   rows) so that a K fragment's two keys are adjacent (rows padded by 16 bytes
//   against bank conflicts). Fragment loops are unrolled (KV_UNROLL). Two
//   barriers per tile (load, use; DS > 1 a third: the scores' exchange; SKV a fourth:
//   V filled into K's buffer after the scores) and one per threadgroup (the first
//   tile's block ids); no double buffer, so the tiles fit the budget at BK = 32 for
//   D = 128 half.
// - Key range of a tile: [first visible key of its first row, last row's
//   position]: tiles above the causal diagonal are never visited, tiles before
//   the sliding window never loaded. Splits cut that range in whole K/V tiles;
//   every split writes partials (max in log2 units, sum, unnormalized acc) that
//   attention_reduce merges with kv_fold_splits (and the sinks).
// - Index guards (validate=False): seq_lens clamped to the block table, n to
//   the length, block ids outside [0, N) read as zero rows, query and output
//   rows bounded by the launch's own sizes.

// The tile table row of one query tile (kvmetal/backends/metal_layout.py builds it).
struct KvVarlenTile {
  int seq;    // sequence index into block_tables / seq_lens
  int r0;     // first row of the tile in the sequence's (position, head) rows
  int q0;     // query row (token) of the sequence's first new position
  int o0;     // partial row block of that token (rows (o0 + i) * H + head)
  int n;      // new positions of the sequence (its last n cached positions)
  int pad0;
  int pad1;
  int pad2;
};

// Threadgroup row stride of a K/V tile: D elements plus 16 bytes, so that the
// lanes reading one fragment column-wise (rows LD apart) spread over banks.
template <int D, typename TT>
struct KvVarlenStride {
  static constant constexpr const int LD = D + 16 / int(sizeof(TT));
};

// The transposed K tile (KT = 1): dim d of key r at d * LDT + r, so a lane's two
// fragment columns (keys fn, fn + 1 of one dim) are adjacent: one vector load. Rows
// are padded by 8 bytes (keeps them 8-byte aligned for float2, and costs little at
// small BK), which spreads a fragment's 8 rows over the banks.
template <int BK, typename TT>
struct KvVarlenStrideT {
  static constant constexpr const int LDT = BK + 8 / int(sizeof(TT));
};

// Elements per task of a tile fill: 8 for a float row (one or two 16-byte copies).
// A quantized row is dequantized in runs of whole words within one group, as long
// as the threadgroup's NT threads all get work (a group per task left half of them
// idle at D 128, group 64): the group halved while a thread would get fewer than
// `per_thread` elements, down to the shortest run (2, 4, 8 bits: 16, 8, 8 values;
// 3, 5, 6 bits: 32). Longer runs read each scale and bias fewer times.
constexpr int kv_fill_run(int bits) {
  return 32 % bits != 0 ? 32 : (32 / bits > 8 ? 32 / bits : 8);
}
constexpr int kv_fill_halve(int task, int run, int per_thread) {
  return task / 2 >= run && task > per_thread ? task / 2 : task;
}
constexpr int kv_fill_task(int bits, int group, int per_thread) {
  // (No loop: groups are 32..128 values, so four halvings reach any run; and the
  // simulator instruments loops, which a constexpr function may not hold.)
  return bits == 0 ? 8
                   : kv_fill_halve(kv_fill_halve(kv_fill_halve(kv_fill_halve(
                         group, kv_fill_run(bits), per_thread), kv_fill_run(bits), per_thread),
                         kv_fill_run(bits), per_thread), kv_fill_run(bits), per_thread);
}

// Element i of a run written down a column of the transposed tile (stride LDT).
template <typename TT>
struct KvTileColumn {
  threadgroup TT* p;
  int stride;
  threadgroup TT& operator[](int i) const {
    return p[i * stride];
  }
};

// Packed words of a run, loaded NV at a time (16 or 8 bytes: the run starts on such a
// boundary whenever the row width W and the run's NW words are multiples of NV).
template <int NV>
struct KvWordLoad {
  template <typename P>
  static void load(P src, thread uint* w, int u) {
    w[u] = reinterpret_cast<const device uint*>(src)[u];
  }
};
template <>
struct KvWordLoad<2> {
  template <typename P>
  static void load(P src, thread uint* w, int u) {
    const uint2 v = reinterpret_cast<const device uint2*>(src)[u];
    w[2 * u] = v.x;
    w[2 * u + 1] = v.y;
  }
};
template <>
struct KvWordLoad<4> {
  template <typename P>
  static void load(P src, thread uint* w, int u) {
    const uint4 v = reinterpret_cast<const device uint4*>(src)[u];
    w[4 * u] = v.x;
    w[4 * u + 1] = v.y;
    w[4 * u + 2] = v.z;
    w[4 * u + 3] = v.w;
  }
};

// Copy the tile of tokens [t0, t0 + BK) of one (sequence, kv head) into
// threadgroup memory: row-major (rows LD apart), or transposed (KT: columns LDT
// apart). Either way consecutive threads take consecutive tasks of one cache row
// (issue 41, P7): a simdgroup's loads cover whole rows (a float row in 16-byte
// loads, a packed row's runs of words in 16-byte loads where aligned), and the
// transposed tile takes each element down its column. Rows outside [lo, hi) or in
// a block outside [0, N) are zeros (never NaN into the MMA) with ok = 0. The tile's
// block ids come from threadgroup memory (`bid`, kv_varlen_load_blocks: one device
// load per block, not one per task; issue 41).
template <int BK, int D, int BS, int BITS, int GS, bool KT, int NT, typename TT, typename PD, typename PS,
          typename PB>
inline void kv_varlen_load_tile(PD data, PS scales, PB biases, const threadgroup int* bid, int num_blocks,
                                int num_kv_heads, int kvh, int t0, int lo, int hi, threadgroup TT* tile,
                                threadgroup int* ok, int tid, bool write_ok) {
  constexpr int W = BITS ? D * BITS / 32 : D;   // data elements per row
  constexpr int NG = BITS ? D / GS : 1;         // groups per row
  constexpr int TASK = kv_fill_task(BITS, GS, D * BK / NT);  // elements per task
  constexpr int TASKS = D / TASK;
  constexpr int LD = KvVarlenStride<D, TT>::LD;
  constexpr int LDT = KvVarlenStrideT<BK, TT>::LDT;
  constexpr int NW = BITS ? TASK * BITS / 32 : 1;  // packed words per task
  constexpr int NV = (W % 4 == 0 && NW % 4 == 0) ? 4 : ((W % 2 == 0 && NW % 2 == 0) ? 2 : 1);
  for (int i = tid; i < BK * TASKS; i += NT) {
    const int r = i / TASKS;
    const int task = i % TASKS;
    const int t = t0 + r;
    bool good = t >= lo && t < hi;
    size_t row = 0;
    if (good) {
      const int block = bid[t / BS - t0 / BS];
      good = uint(block) < uint(num_blocks);
      row = (size_t(good ? block : 0) * uint(num_kv_heads) + uint(kvh)) * BS + uint(t % BS);
    }
    KvTileColumn<TT> dst;
    dst.p = KT ? tile + task * TASK * LDT + r : tile + r * LD + task * TASK;
    dst.stride = KT ? LDT : 1;
    if (!good) {
      for (int e = 0; e < TASK; e++) {
        dst[e] = TT(0.0f);
      }
    } else if (BITS) {
      const int group = task * TASK / GS;
      const float s = float(scales[row * NG + group]);
      const float b = float(biases[row * NG + group]);
      uint words[NW];
      for (int u = 0; u < NW / NV; u++) {
        KvWordLoad<NV>::load(data + row * W + task * NW, words, u);
      }
      kv_dequant_group<BITS ? BITS : 1, TASK, TT>(words, 1, s, b, dst);
    } else {
      // 8 elements: one 16-byte load (half, bfloat) or two (float), in the storage type.
      constexpr int U = TASK * int(sizeof(TT)) / 16;
      constexpr int PER = 16 / int(sizeof(TT));
      const device uint4* src = reinterpret_cast<const device uint4*>(data + row * W + task * TASK);
      for (int u = 0; u < U; u++) {
        if (KT) {
          uint4 w = src[u];
          const thread TT* e = reinterpret_cast<const thread TT*>(&w);
          for (int k = 0; k < PER; k++) {
            dst[u * PER + k] = e[k];
          }
        } else {
          *reinterpret_cast<threadgroup uint4*>(dst.p + u * PER) = src[u];
        }
      }
    }
    if (write_ok && task == 0) {
      ok[r] = good ? 1 : 0;
      if (!good) {
        ok[BK] = t0;  // the tile has a masked row (every such writer stores the same value)
      }
    }
  }
}

// Blocks a K/V tile of BK tokens starting at a multiple of BK can touch.
template <int BK, int BS>
struct KvVarlenSlots {
  static constant constexpr const int N = (BK + BS - 1) / BS + 1;
};

// The block ids of the K/V tile at t0 into bid[0, N): thread s < N loads block t0 / BS + s
// of the sequence's table if the block holds a key of [lo, t_end) in the tile, else
// writes -1 (never an index past the table: t_end <= the clamped length). Written between
// barriers its readers are on the other side of.
template <int BK, int BS, typename PT>
inline void kv_varlen_load_blocks(PT table, int t0, int lo, int t_end, threadgroup int* bid, int tid) {
  if (tid < KvVarlenSlots<BK, BS>::N) {
    const int b = t0 / BS + tid;
    bid[tid] = b * BS < min(t0 + BK, t_end) && (b + 1) * BS > lo ? table[b] : -1;
  }
}

//@kernel paged_varlen_partials
// Inputs:  query [T, H, D] TQ; key_data [N, Hkv, BS, WK] (TK, or uint32 packed);
//          key_scales/key_biases [N, Hkv, BS, D/KGS] TK (placeholders for a float
//          cache); value_* likewise; block_tables int32 [S, M]; seq_lens int32
//          [S]; tiles int32 [num_tiles, 8] (KvVarlenTile); params int32 KvAttnParams
//          (num_tokens = T, query_len = rows of the partials / H)
// Outputs: part_max, part_sum float32 [R, splits]; part_acc float32 [R, splits, D]
// Grid:    threadgroups (num_tiles, Hkv, splits), NSG * 32 threads each; BQ = 8 * NSG * RF / DS.
// DS (split-D, issue 41 P1): DS simdgroups share each row fragment, each holding the Q and
// O fragments of D / DS dims (the registers of D 256 in one simdgroup spill; D 512 takes
// DS 4); their partial scores meet in threadgroup memory (one more barrier per K/V tile),
// and each adds all DS of them in the same order, so they agree bit for bit.
// SKV (sequential K/V, issue 40): one buffer holds the K tile, then (after the scores) the
// V tile, where the two side by side would pass 32 KiB (D 512, float32 K tile).
const device KvAttnParams& p = kv_params<KvAttnParams>(params);
static_assert(DS == 1 || DS == 2 || DS == 4, "DS is 1, 2 or 4");
static_assert(NSG % DS == 0 && D % (8 * DS) == 0, "DS divides the simdgroups and the fragments");
constexpr int BQ = 8 * NSG * RF / DS;
constexpr int NT = NSG * 32;
constexpr int DH = D / DS;   // dims of one simdgroup's Q and O fragments
constexpr int DF = DH / 8;   // fragments along them
constexpr int SLD = BK + 4;  // row stride of tile_s (floats; 16 bytes of pad)
constexpr int TILE_S = DS > 1 ? NSG * RF * 8 * SLD : 4;
constexpr int KF = BK / 8;   // fragments along the keys
constexpr bool QTG = RF > 1; // Q staged in threadgroup memory (RF > 1), else in registers
const int tile_index = int(threadgroup_position_in_grid.x);
const int kvh = int(threadgroup_position_in_grid.y);
const int split = int(threadgroup_position_in_grid.z);
const int tid = int(thread_index_in_threadgroup);
const int sg = int(simdgroup_index_in_threadgroup);
const int lane = int(thread_index_in_simdgroup);
const int rsg = sg / DS;        // the row fragments' simdgroup index
const int dh0 = sg % DS * DH;   // first dim of this simdgroup's Q and O fragments
const int num_heads = p.num_heads;
const int num_splits = p.num_splits;
const int out_rows = p.query_len;  // partial rows / H
// Threadgroup memory (metal_layout.py mirrors it in varlen_threadgroup_bytes).
// The tiles are uint4 arrays (16-byte aligned rows for the copies), used as TK / TV / TQ.
constexpr int KLD = KvVarlenStride<D, TK>::LD;
constexpr int KLDT = KvVarlenStrideT<BK, TK>::LDT;
constexpr int VLD = KvVarlenStride<D, TV>::LD;
constexpr int QLD = KvVarlenStride<D, TQ>::LD;
constexpr int TILE_K16_OWN = ((KT ? D * KLDT : BK * KLD) * int(sizeof(TK)) + 15) / 16;
constexpr int TILE_V16_OWN = (BK * VLD * int(sizeof(TV)) + 15) / 16;
// SKV: the V tile reuses the K tile's buffer (the larger of the two; V's own is a placeholder).
constexpr int TILE_K16 = SKV && TILE_V16_OWN > TILE_K16_OWN ? TILE_V16_OWN : TILE_K16_OWN;
constexpr int TILE_V16 = SKV ? 1 : TILE_V16_OWN;
constexpr int TILE_Q16 = QTG ? (BQ * QLD * int(sizeof(TQ)) + 15) / 16 : 1;
threadgroup uint4 tile_k_raw[TILE_K16];
threadgroup uint4 tile_v_raw[TILE_V16];
threadgroup uint4 tile_q_raw[TILE_Q16];
threadgroup int tile_ok[BK + 1];  // row flags; [BK]: t0 of the last tile with a masked row
threadgroup int tile_bid[BK / 8 + 1];  // block ids of the next K/V tile (KvVarlenSlots)
threadgroup float tile_s[TILE_S];        // DS > 1: each simdgroup's partial scores
static_assert(KvVarlenSlots<BK, BS>::N <= BK / 8 + 1, "block size >= 8");
threadgroup TK* tile_k = reinterpret_cast<threadgroup TK*>(tile_k_raw);
threadgroup TV* tile_v = reinterpret_cast<threadgroup TV*>(SKV ? tile_k_raw : tile_v_raw);
threadgroup TQ* tile_q = reinterpret_cast<threadgroup TQ*>(tile_q_raw);

const device KvVarlenTile& tl = reinterpret_cast<const device KvVarlenTile*>(tiles)[tile_index];
const int seq = tl.seq;
const int len = clamp(seq_lens[seq], 0, p.max_blocks * BS);
const int n = clamp(tl.n, 0, len);
const int rows = n * G;
const int r0 = tl.r0;
const int r_end = min(r0 + BQ, rows);
// (block_tables is a `constant` buffer when it has fewer than 8 entries: keep its type.)
const decltype(block_tables) table = block_tables + size_t(seq) * p.max_blocks;

// This lane's row (fm) and columns (fn, fn + 1) of every fragment; simdgroup sg owns
// dims [dh0, dh0 + DH) of the RF row fragments rsg * RF + f, f < RF (rows
// 8 (rsg * RF + f) + [0, 8) of the tile).
const int qid = lane / 4;
const int fm = (qid & 4) + (lane / 2) % 4;
const int fn = (qid & 2) * 2 + (lane % 2) * 2;
int pos[RF];
int head[RF];
int q_row[RF];
int o_row[RF];
bool row_ok[RF];
bool rows_ok = true;
KV_UNROLL
for (int f = 0; f < RF; f++) {
  const int r = r0 + (rsg * RF + f) * 8 + fm;
  const int pos_i = r / G;                     // new position index of the row
  head[f] = kvh * G + r % G;
  pos[f] = len - n + pos_i;                    // its cached position
  q_row[f] = tl.q0 + pos_i;
  o_row[f] = tl.o0 + pos_i;
  row_ok[f] = r < r_end && q_row[f] >= 0 && q_row[f] < p.num_tokens && o_row[f] >= 0 && o_row[f] < out_rows &&
              head[f] < num_heads;
  rows_ok = rows_ok && row_ok[f];
}

// Keys of the tile: [lo, hi); the split's share in whole K/V tiles. With
// split_tokens > 0 (a multiple of BK) split k is the k-th window of [lo, hi) cut at
// the multiples of split_tokens, so a row's windows, their K/V tiles (BK-aligned)
// and the reduce's fold of them are the same whatever tile or chunk the row is in
// (a window or tile the row cannot see leaves it unchanged: the reduce skips a
// split that saw nothing); with 0, num_splits equal runs of tiles.
const int pos_first = len - n + min(r0, max(rows - 1, 0)) / G;
const int pos_last = len - n + max(r_end - 1, 0) / G;
const KvVariant var = kv_variant(p.scale, p.softcap, p.window);
const int lo = var.first_visible(pos_first);
const int hi = r_end > r0 ? pos_last + 1 : 0;
const int t_start = lo / BK * BK;
const int n_tiles = hi > t_start ? (hi - t_start + BK - 1) / BK : 0;
const int per_split = p.split_tokens > 0 ? p.split_tokens / BK : (n_tiles + num_splits - 1) / num_splits;
const int w_begin = p.split_tokens > 0 ? (lo / p.split_tokens + split) * p.split_tokens : t_start + split * per_split * BK;
const int t_begin = max(t_start, w_begin);
const int t_end = min(hi, w_begin + per_split * BK);

// Q, scaled into log2 units (unless softcapped): RF = 1 keeps the simdgroup's fragments
// (pre-scaled) in registers; RF > 1 stages the tile's BQ rows in threadgroup memory in
// 16-byte row copies (visible after the first K/V tile's barrier) and scales the scores.
const float qscale = var.q_scale;
const float sscale = QTG ? qscale : 1.0f;
simdgroup_float8x8 qf[QTG ? 1 : DF];
simdgroup_float8x8 of[RF][DF];
if (QTG) {
  constexpr int QPER = 16 / int(sizeof(TQ));
  constexpr int QT = D / QPER;  // 16-byte chunks per row
  for (int i = tid; i < BQ * QT; i += NT) {
    const int rr = i / QT;
    const int c = i % QT;
    const int r = r0 + rr;
    const int qr = tl.q0 + r / G;
    const int h = kvh * G + r % G;
    const bool ok = r < r_end && qr >= 0 && qr < p.num_tokens && h < num_heads;
    const device uint4* src = reinterpret_cast<const device uint4*>(query + (size_t(ok ? qr : 0) * num_heads +
                                                                              uint(ok ? h : 0)) * D);
    *reinterpret_cast<threadgroup uint4*>(tile_q + rr * QLD + c * QPER) = ok ? src[c] : uint4(0);
  }
} else {
  KV_UNROLL
  for (int j = 0; j < DF; j++) {
    KV_UNROLL
    for (int e = 0; e < 2; e++) {
      const float x =
          row_ok[0] ? float(query[(size_t(q_row[0]) * num_heads + head[0]) * D + dh0 + j * 8 + fn + e]) : 0.0f;
      qf[QTG ? 0 : j].thread_elements()[e] = x * qscale;
    }
  }
}
float m[RF];
float l[RF];
KV_UNROLL
for (int f = 0; f < RF; f++) {
  KV_UNROLL
  for (int j = 0; j < DF; j++) {
    of[f][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  }
  m[f] = KV_NEG_BIG;
  l[f] = 0.0f;
}

// Block ids of the first K/V tile; each later tile's are loaded after the barrier that
// ends the previous fill (the fill reads them) and published by the barrier that ends
// the tile (one barrier per threadgroup here, none per tile).
if (t_begin < t_end) {
  kv_varlen_load_blocks<BK, BS>(table, t_begin, lo, t_end, tile_bid, tid);
}
threadgroup_barrier(mem_flags::mem_threadgroup);

for (int t0 = t_begin; t0 < t_end; t0 += BK) {
  kv_varlen_load_tile<BK, D, BS, KBITS, KGS, KT != 0, NT, TK>(key_data, key_scales, key_biases, tile_bid,
                                                              p.num_blocks, p.num_kv_heads, kvh, t0, lo, t_end,
                                                              tile_k, tile_ok, tid, true);
  if (!SKV) {
    kv_varlen_load_tile<BK, D, BS, VBITS, VGS, false, NT, TV>(value_data, value_scales, value_biases, tile_bid,
                                                               p.num_blocks, p.num_kv_heads, kvh, t0, lo, t_end,
                                                               tile_v, tile_ok, tid, false);
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (!SKV && t0 + BK < t_end) {  // (SKV: after the V fill, which reads this tile's ids)
    kv_varlen_load_blocks<BK, BS>(table, t0 + BK, lo, t_end, tile_bid, tid);
  }

  // S = Q K^T: fragment (f, kb) holds keys t0 + 8 kb + [0, 8) of row fragment f. Each K
  // fragment loaded serves the RF row fragments.
  simdgroup_float8x8 sf[RF][KF];
  KV_UNROLL
  for (int f = 0; f < RF; f++) {
    KV_UNROLL
    for (int kb = 0; kb < KF; kb++) {
      sf[f][kb] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    }
  }
  KV_UNROLL
  for (int j = 0; j < DF; j++) {
    simdgroup_float8x8 qa[RF];
    KV_UNROLL
    for (int f = 0; f < RF; f++) {
      if (QTG) {  // row (rsg RF + f) 8 + fm, dims dh0 + j 8 + fn, fn + 1
        const float2 x = KvVec2<TQ>::load(tile_q + ((rsg * RF + f) * 8 + fm) * QLD + dh0 + j * 8 + fn);
        qa[f].thread_elements()[0] = x.x;
        qa[f].thread_elements()[1] = x.y;
      } else {
        qa[f] = qf[QTG ? 0 : j];
      }
    }
    KV_UNROLL
    for (int kb = 0; kb < KF; kb++) {
      simdgroup_float8x8 kt;  // (dim, key) = K[key][dim]
      if (KT) {  // keys fn, fn + 1 of dim dh0 + j * 8 + fm: adjacent in the transposed tile
        const float2 x = KvVec2<TK>::load(tile_k + (dh0 + j * 8 + fm) * KLDT + kb * 8 + fn);
        kt.thread_elements()[0] = x.x;
        kt.thread_elements()[1] = x.y;
      } else {
        kt.thread_elements()[0] = float(tile_k[(kb * 8 + fn) * KLD + dh0 + j * 8 + fm]);
        kt.thread_elements()[1] = float(tile_k[(kb * 8 + fn + 1) * KLD + dh0 + j * 8 + fm]);
      }
      KV_UNROLL
      for (int f = 0; f < RF; f++) {
        simdgroup_multiply_accumulate(sf[f][kb], qa[f], kt, sf[f][kb]);
      }
    }
  }

  // Split-D: the full scores are the sum of the DS simdgroups' partial ones (over their
  // dims), exchanged through tile_s. Every simdgroup of a row fragment adds the DS partials
  // in the order of their dims (d = 0, 1, ..), so all hold the same bits and run the same
  // softmax (at DS 2 the same bits as own + other: IEEE addition commutes exactly).
  if (DS > 1) {
    KV_UNROLL
    for (int f = 0; f < RF; f++) {
      KV_UNROLL
      for (int kb = 0; kb < KF; kb++) {
        *reinterpret_cast<threadgroup float2*>(tile_s + ((sg * RF + f) * 8 + fm) * SLD + kb * 8 + fn) =
            kv_float2(sf[f][kb].thread_elements()[0], sf[f][kb].thread_elements()[1]);
      }
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const int sg0 = rsg * DS;  // the row fragments' first simdgroup (dims 0 .. DH)
    KV_UNROLL
    for (int f = 0; f < RF; f++) {
      KV_UNROLL
      for (int kb = 0; kb < KF; kb++) {
        float2 sum =
            *reinterpret_cast<const threadgroup float2*>(tile_s + ((sg0 * RF + f) * 8 + fm) * SLD + kb * 8 + fn);
        KV_UNROLL
        for (int d = 1; d < DS; d++) {
          sum += *reinterpret_cast<const threadgroup float2*>(
              tile_s + (((sg0 + d) * RF + f) * 8 + fm) * SLD + kb * 8 + fn);
        }
        sf[f][kb].thread_elements()[0] = sum.x;
        sf[f][kb].thread_elements()[1] = sum.y;
      }
    }
  }

  // SKV: every simdgroup is done with the K tile (the exchange's barrier, or this one at
  // DS 1); V takes its buffer, then the next tile's block ids go in.
  if (SKV) {
    if (DS == 1) {
      threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    kv_varlen_load_tile<BK, D, BS, VBITS, VGS, false, NT, TV>(value_data, value_scales, value_biases, tile_bid,
                                                               p.num_blocks, p.num_kv_heads, kvh, t0, lo, t_end,
                                                               tile_v, tile_ok, tid, false);
    threadgroup_barrier(mem_flags::mem_threadgroup);
    if (t0 + BK < t_end) {
      kv_varlen_load_blocks<BK, BS>(table, t0 + BK, lo, t_end, tile_bid, tid);
    }
  }

  // Masks only on edge tiles (issue 41, P8): a lane whose rows are all live and see every
  // key of the tile (no row of the tile masked: the fill stamps tile_ok[BK] with t0 when
  // one is; the first and last keys visible, so every key between) skips the per-element
  // test. (tile_ok[BK] is never initialised: a stale value equal to t0 only sends the
  // tile down the masked path, which is always right.)
  bool full = tile_ok[BK] != t0 && rows_ok;
  KV_UNROLL
  for (int f = 0; f < RF; f++) {
    full = full && var.visible(t0, pos[f]) && var.visible(t0 + BK - 1, pos[f]);
  }
  float factor[RF];
  KV_UNROLL
  for (int f = 0; f < RF; f++) {
    // Online softmax over the tile: mask, row max, probabilities, row sum.
    // A key's weight is chosen by its visibility flag, not by its score: a NaN score
    // of a visible key (a NaN in its K row) gives a NaN weight and a NaN row, as in
    // decode (issue 41, R3; comparing the score dropped it silently).
    float tile_max = KV_NEG_BIG;
    bool vis[KF][2];
    KV_UNROLL
    for (int kb = 0; kb < KF; kb++) {
      KV_UNROLL
      for (int e = 0; e < 2; e++) {
        const int c = kb * 8 + fn + e;
        vis[kb][e] = full || (row_ok[f] && tile_ok[c] != 0 && var.visible(t0 + c, pos[f]));
        const float s = vis[kb][e] ? var.logit(sf[f][kb].thread_elements()[e] * sscale) : KV_NEG_BIG;
        sf[f][kb].thread_elements()[e] = s;
        tile_max = max(tile_max, s);
      }
    }
    tile_max = max(tile_max, simd_shuffle_xor(tile_max, ushort(1)));
    tile_max = max(tile_max, simd_shuffle_xor(tile_max, ushort(8)));
    const float m_new = max(m[f], tile_max);
    // Rescale only when the max rises (issue 41, R2): a tile the row cannot see, or one
    // below its max, leaves (l, O) as they are, not times exp2(0) (exact 1 only if
    // the fast exp2 is exact there).
    factor[f] = m_new > m[f] ? kv_weight(m[f], m_new) : 1.0f;
    float tile_sum = 0.0f;
    KV_UNROLL
    for (int kb = 0; kb < KF; kb++) {
      KV_UNROLL
      for (int e = 0; e < 2; e++) {
        const float s = sf[f][kb].thread_elements()[e];
        const float pr = vis[kb][e] ? kv_weight(s, m_new) : 0.0f;
        sf[f][kb].thread_elements()[e] = pr;
        tile_sum += pr;
      }
    }
    tile_sum += simd_shuffle_xor(tile_sum, ushort(1));
    tile_sum += simd_shuffle_xor(tile_sum, ushort(8));
    l[f] = l[f] * factor[f] + tile_sum;
    m[f] = m_new;
  }

  // O = O * factor + P V: fragment (f, j) holds dims 8 j + [0, 8) of row fragment f;
  // each V fragment loaded serves the RF row fragments.
  KV_UNROLL
  for (int j = 0; j < DF; j++) {
    KV_UNROLL
    for (int f = 0; f < RF; f++) {
      of[f][j].thread_elements()[0] *= factor[f];
      of[f][j].thread_elements()[1] *= factor[f];
    }
    KV_UNROLL
    for (int kb = 0; kb < KF; kb++) {
      simdgroup_float8x8 vf;  // (key, dim): dims fn, fn + 1 adjacent in the row-major tile
      const float2 x = KvVec2<TV>::load(tile_v + (kb * 8 + fm) * VLD + dh0 + j * 8 + fn);
      vf.thread_elements()[0] = x.x;
      vf.thread_elements()[1] = x.y;
      KV_UNROLL
      for (int f = 0; f < RF; f++) {
        simdgroup_multiply_accumulate(of[f][j], sf[f][kb], vf, of[f][j]);
      }
    }
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
}

// Partials of this split: row (o_row * H + head), unnormalized accumulator.
KV_UNROLL
for (int f = 0; f < RF; f++) {
  if (row_ok[f]) {
    const size_t at = (size_t(o_row[f]) * num_heads + head[f]) * num_splits + split;
    if (fn == 0 && dh0 == 0) {
      part_max[at] = m[f];
      part_sum[at] = l[f];
    }
    KV_UNROLL
    for (int j = 0; j < DF; j++) {
      part_acc[at * D + dh0 + j * 8 + fn] = of[f][j].thread_elements()[0];
      part_acc[at * D + dh0 + j * 8 + fn + 1] = of[f][j].thread_elements()[1];
    }
  }
}
