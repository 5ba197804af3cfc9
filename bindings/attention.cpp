#include "attention.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "query_q8.h"
#include "output_row.h"
#include "sparse_v.h"
#include "split_merge.h"
#include "thread_pool.h"

namespace kvmetal {
namespace {

constexpr int kItemsPerThread = 8;  // enough items to balance uneven ones (and
                                    // threads that the OS pauses)

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

struct TokenRange {
  int lo = 0, hi = 0;  // [lo, hi)
  bool empty() const { return hi <= lo; }
};

// Cached tokens of sequence s. A paged length is clamped to what its block
// table holds: a guard, so no length makes the kernel read past the table.
int cached_len(const AttentionParams& p, int s) {
  if (!p.paged) return p.contiguous_len;
  const int64_t capacity = p.max_blocks * p.block_size;
  return static_cast<int>(std::clamp<int64_t>(p.seq_lens[s], 0, capacity));
}

// The tokens query row l (of L) sees: t <= p_l = len - L + l, and with a
// sliding window w only t > p_l - w. Empty when p_l < 0.
TokenRange row_range(const AttentionParams& p, int len, int l) {
  const int64_t hi = static_cast<int64_t>(len) - p.query_len + l + 1;
  const int64_t lo = p.first_visible(hi - 1);
  return {static_cast<int>(lo), static_cast<int>(std::max<int64_t>(hi, 0))};
}

// The tokens any query row of sequence s may see: out-of-window blocks are
// never visited.
TokenRange live_range(const AttentionParams& p, int s) {
  const int len = cached_len(p, s);
  return {row_range(p, len, 0).lo, len};
}

// Tokens are split in whole tiles so each tile is read by one item only;
// out-of-window blocks are never visited.
int tile_rows(const AttentionParams& p) { return p.paged ? p.block_size : kMaxTileRows; }

TokenRange split_range(const AttentionParams& p, TokenRange live, int split, int splits) {
  const int unit = tile_rows(p);
  const int64_t first = live.lo / unit;
  const int64_t n_units = ceil_div(live.hi, unit) - first;
  const int64_t per = ceil_div(n_units, splits);
  const int64_t a = (first + std::min(n_units, split * per)) * unit;
  const int64_t b = (first + std::min(n_units, (split + 1) * per)) * unit;
  return {static_cast<int>(std::max<int64_t>(a, live.lo)), static_cast<int>(std::min<int64_t>(b, live.hi))};
}

// Tiles in a live range: the most splits that can all get work.
int tile_count(const AttentionParams& p, TokenRange live) {
  if (live.empty()) return 0;
  return ceil_div(live.hi, tile_rows(p)) - live.lo / tile_rows(p);
}

// Partials of one (sequence, kv head, split): m[R], l[R], acc[R][D] (float32)
// for its R = L * G query rows, row j = l * G + g.
struct PartialLayout {
  int R, D;
  int64_t floats_per_item() const { return static_cast<int64_t>(R) * (D + 2); }
};

struct Scratch {
  std::vector<float> q, k_tile, v_tile, scores, corr, ones;
  std::vector<float> kept_w[2], kept_corr[2];  // sparse V: the two units in flight (KeptRows)
  QueryQ8Rows q8;  // the query rows as int8, when 8-bit K is scored in integers
  void fit(int query_rows, int R, int D) {
    ones.assign(R, 1.f);
    q.resize(static_cast<size_t>(query_rows) * D);
    k_tile.resize(static_cast<size_t>(kMaxTileRows) * D);
    v_tile.resize(static_cast<size_t>(kMaxTileRows) * D);
    scores.resize(static_cast<size_t>(R) * kMaxTileRows);
    corr.resize(R);
    for (int i = 0; i < 2; ++i) {
      kept_w[i].resize(static_cast<size_t>(R) * kMaxTileRows);
      kept_corr[i].resize(R);
    }
  }
};

// Streams a coming (tile, head) unit's K and V rows toward L2 a few lines at
// a time while the current unit computes. Measured here: float16 decode went
// from 13 to 16-17 GB/s on two cores. The hardware prefetcher stops at each
// 4 KiB page (a scattered block), and one burst of prefetches only queues
// behind itself; spread over the K pieces and V segments of the current unit
// they overlap the arithmetic.
class Prefetcher {
 public:
  // Queue the rows [row0, row0 + n) of (outer, head) of a cache (and, for a
  // quantized one, their scales and biases). Rows that touch in memory join
  // one range, so a block's rows cost one entry and step() is a plain walk
  // over lines.
  void add(const KVView& view, int64_t outer, int head, int row0, int n) {
    const int64_t elem = view.quantized ? 4 : float_kind_size(view.kind);
    add_rows(view.row_address(outer, head, row0), view.stride[2] * elem, view.row_bytes(), n);
    if (view.quantized) {
      const int64_t sz = float_kind_size(view.fmt.scale_kind);
      const int64_t bytes = sz * (view.D / view.fmt.group_size);
      add_rows(view.scales + sz * view.offset(view.scale_stride, outer, head, row0), view.scale_stride[2] * sz, bytes, n);
      add_rows(view.biases + sz * view.offset(view.bias_stride, outer, head, row0), view.bias_stride[2] * sz, bytes, n);
    }
  }
  // Issue the next 1/pieces of the queued lines.
  void step(int pieces) {
    if (!per_step_) {
      int64_t lines = 0;
      for (int i = 0; i < count_; ++i) lines += (ranges_[i].end - line_start(ranges_[i].begin) + 63) / 64;
      per_step_ = (lines + pieces - 1) / std::max(1, pieces);
      if (count_) next_ = line_start(ranges_[0].begin);
    }
    for (int64_t issued = 0; issued < per_step_ && range_ < count_;) {
      const char* end = ranges_[range_].end;
      for (; issued < per_step_ && next_ < end; next_ += 64, ++issued) __builtin_prefetch(next_, 0, 2);
      if (next_ >= end && ++range_ < count_) next_ = line_start(ranges_[range_].begin);
    }
  }
  void reset() { count_ = range_ = per_step_ = 0; }

 private:
  struct Range {
    const char* begin;
    const char* end;
  };
  static const char* line_start(const char* p) {
    return reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(p) & ~uintptr_t{63});
  }
  // n rows of `bytes` each, `step` bytes apart: one range when they touch.
  void add_rows(const char* first, int64_t step, int64_t bytes, int n) {
    if (step == bytes) return add_range(first, bytes * n);
    for (int r = 0; r < n; ++r) add_range(first + r * step, bytes);
  }
  void add_range(const char* p, int64_t bytes) {
    if (count_ && ranges_[count_ - 1].end == p) ranges_[count_ - 1].end += bytes;
    else if (count_ < kMaxRanges) ranges_[count_++] = {p, p + bytes};
  }
  static constexpr int kMaxRanges = 6 * kMaxTileRows;  // K, V, and quantized scales and biases
  Range ranges_[kMaxRanges];
  int count_ = 0, range_ = 0;
  int64_t per_step_ = 0;
  const char* next_ = nullptr;
};

// A run of rows [row0, row0 + n) of one (outer, kv head): one block of a
// paged cache, or up to a tile of a contiguous one. A block id outside
// [0, num_blocks) makes the segment padding: masked, never read.
struct Segment {
  int64_t outer = 0;
  int row0 = 0, n = 0;
  bool valid = true;
};
constexpr int kMaxSegments = kMaxTileRows / 8;

// Up to kMaxTileRows consecutive tokens from `first`, as segments. One softmax
// step (and one accumulator rescale) serves the whole tile.
struct Tile {
  int first = 0, rows = 0, count = 0;
  bool has_padding = false;
  Segment seg[kMaxSegments];
};

constexpr int kPieceRows = 4;      // K is scored 4 rows at a time, a prefetch step after each
constexpr int kPrefetchAhead = 3;  // units (tile, kv head) between a prefetch and its use
// Widening float16/bfloat16 in registers repeats the conversion for every 4
// query rows; past 8 rows a scratch copy converted once is cheaper.
constexpr int kMaxRowsInPlace = 8;

// One work item: kv heads [kvh0, kvh1) of sequence s over the token range
// `range`. The item walks the range tile by tile and, for each tile, every kv
// head of its chunk, so consecutive reads are the adjacent (block, head) tiles
// of one block: long sequential runs that the hardware prefetcher follows,
// where one head at a time would jump between scattered 4-8 KiB pieces.
//
// Per (tile, kv head) unit: score K (in place, or converted once into
// scratch), softcap, mask, online-softmax update, accumulate V.
class ItemWalker {
 public:
  ItemWalker(const AttentionParams& p, const KVView& k, const KVView& v, const TileKernels& tk, int s, int kvh0,
             int kvh1, TokenRange range)
      : p_(p), k_(k), v_(v), tk_(tk), s_(s), kvh0_(kvh0), kvh1_(kvh1), range_(range),
        G_(p.num_heads / p.num_kv_heads), R_(G_ * p.query_len), D_(p.head_dim), len_(cached_len(p, s)),
        first_hi_(row_range(p, len_, 0).hi), last_lo_(row_range(p, len_, p.query_len - 1).lo),
        k_in_place_(in_place(k)), v_in_place_(in_place(v)), k_int8_(int8_scores(k)),
        k_u8_(!k_int8_ && codes_in_place(k, 8, tk.scores_u8 != nullptr)),
        v_u4_(codes_in_place(v, 4, tk.accumulate_u4 != nullptr)),
        k_half_scores_(k.kind == FloatKind::f16 ? tk.scores_f16 : tk.scores_bf16),
        v_half_accumulate_(v.kind == FloatKind::f16 ? tk.accumulate_f16 : tk.accumulate_bf16),
        sc_(scratch()) {}

  // Partials of kv head kvh go to partial(kvh) (PartialLayout). Sparse V:
  // seed(kvh) is where seeds() left kv head kvh's R seed maxima (the start of m).
  template <typename PartialAt, typename SeedAt>
  void run(PartialAt partial, SeedAt seed) {
    for (int kvh = kvh0_; kvh < kvh1_; ++kvh) reset_state(partial(kvh));
    if (range_.empty()) return;
    sc_.fit((kvh1_ - kvh0_) * R_, R_, D_);
    load_queries();
    if (p_.sparse_v > 0.f)
      for (int kvh = kvh0_; kvh < kvh1_; ++kvh) std::copy_n(seed(kvh), R_, partial(kvh));
    Tile cur = tile_at(range_.lo), next;
    for (;;) {
      const bool more = cur.first + cur.rows < range_.hi;
      if (more) next = tile_at(cur.first + cur.rows);
      // K pieces, then (exact) V segments
      pieces_ = (cur.rows + kPieceRows - 1) / kPieceRows + (p_.sparse_v > 0.f ? 0 : cur.count);
      for (int kvh = kvh0_; kvh < kvh1_; ++kvh) {
        // Queue the unit kPrefetchAhead units on (this tile's heads, then the
        // next tile's): one unit ahead left the loads waiting on memory.
        const int A = std::min(kPrefetchAhead, kvh1_ - kvh0_);
        if (kvh + A < kvh1_) queue_prefetch(&cur, kvh + A);
        else queue_prefetch(more ? &next : nullptr, kvh0_ + (kvh + A - kvh1_));
        step(cur, kvh, partial(kvh));
      }
      if (!more) break;
      cur = next;
    }
    if (p_.sparse_v > 0.f) accumulate_kept(kept_[pending_]);
    // 4-bit V accumulated in nibble order (TileKernels::accumulate_u4) goes back to column order.
    if (v_u4_)
      for (int kvh = kvh0_; kvh < kvh1_; ++kvh)
        for (int j = 0; j < R_; ++j) nibble_order_to_natural(partial(kvh) + 2 * R_ + static_cast<int64_t>(j) * D_, D_);
  }

 private:
  static Scratch& scratch() {
    thread_local Scratch sc;
    return sc;
  }

  // Rows read where they are: float32, and float16/bfloat16 widened in registers.
  bool in_place(const KVView& view) const {
    if (view.quantized) return false;
    const bool widen = view.kind == FloatKind::f16 ? tk_.scores_f16 != nullptr : tk_.scores_bf16 != nullptr;
    return view.kind == FloatKind::f32 || (widen && R_ <= kMaxRowsInPlace);
  }

  // 8-bit K scored in integer arithmetic against int8 queries (when switched
  // on and the CPU has a kernel for it; else K is dequantized and scored in float).
  bool int8_scores(const KVView& view) const {
    return int8_k_scores() && view.quantized && view.fmt.bits == 8 && tk_.scores_k8 && view.D % 32 == 0 &&
           (view.fmt.group_size == 32 || view.fmt.group_size == 64 || view.fmt.group_size == 128) &&
           view.D / view.fmt.group_size <= kMaxQ8Groups;
  }

  // K (8-bit) or V (4-bit) codes read in place by scores_u8 / accumulate_u4,
  // never dequantized into scratch.
  bool codes_in_place(const KVView& view, int bits, bool have_kernel) const {
    return have_kernel && view.quantized && view.fmt.bits == bits && view.D % 16 == 0 &&
           (view.fmt.group_size == 32 || view.fmt.group_size == 64 || view.fmt.group_size == 128) &&
           view.D / view.fmt.group_size <= kMaxQ8Groups;
  }

  // m = -inf, l = 0, acc = 0: the state of a row that has seen nothing.
  void reset_state(float* part) const {
    std::fill(part, part + R_, kNegInf);
    std::fill(part + R_, part + 2 * R_ + static_cast<int64_t>(R_) * D_, 0.f);
  }

  // The chunk's query rows, pre-scaled (scores come out already times
  // `scale`): kv head c of the chunk, then token l, then head g of its group.
  void load_queries() {
    const int rows = (kvh1_ - kvh0_) * R_;
    for (int j = 0; j < rows; ++j) {
      const int c = j / R_, l = j % R_ / G_, g = j % G_;
      const int64_t src = p_.row_offset(s_, l, (kvh0_ + c) * G_ + g);
      float* dst = sc_.q.data() + static_cast<int64_t>(j) * D_;
      for (int d = 0; d < D_; ++d) dst[d] = load_as_f32(p_.query, src + d, p_.q_kind) * p_.scale;
    }
    if (k_int8_) sc_.q8.quantize(sc_.q.data(), rows, D_, k_.fmt.group_size);
  }

  Segment segment_at(int t) const {
    if (!p_.paged) return Segment{s_, t, std::min(kMaxTileRows - t % kMaxTileRows, range_.hi - t), true};
    const int64_t block = p_.block_tables[static_cast<int64_t>(s_) * p_.max_blocks + t / p_.block_size];
    const int row0 = t % p_.block_size;
    return Segment{block, row0, std::min(p_.block_size - row0, range_.hi - t), block >= 0 && block < p_.num_blocks};
  }

  Tile tile_at(int t) const {
    Tile tile;
    tile.first = t;
    do {
      Segment& sg = tile.seg[tile.count++];
      sg = segment_at(t + tile.rows);
      tile.rows += sg.n;
      tile.has_padding |= !sg.valid;
    } while (p_.paged && tile.count < kMaxSegments && t + tile.rows < range_.hi &&
             tile.rows + p_.block_size <= kMaxTileRows);
    return tile;
  }

  void queue_prefetch(const Tile* tile, int head) {
    prefetcher_.reset();
    if (!tile) return;
    // All of the unit's K first: it is read first.
    for (int i = 0; i < tile->count; ++i)
      if (tile->seg[i].valid) prefetcher_.add(k_, tile->seg[i].outer, head, tile->seg[i].row0, tile->seg[i].n);
    if (p_.sparse_v > 0.f) return;  // sparse V: only kept V rows are prefetched, when known (keep_rows)
    for (int i = 0; i < tile->count; ++i)
      if (tile->seg[i].valid) prefetcher_.add(v_, tile->seg[i].outer, head, tile->seg[i].row0, tile->seg[i].n);
  }

  void step(const Tile& tile, int kvh, float* part) {
    float* m = part;
    float* l = part + R_;
    float* acc = part + 2 * R_;
    float* scores = sc_.scores.data();
    score(tile, kvh, sc_.q.data() + static_cast<int64_t>(kvh - kvh0_) * R_ * D_, scores);
    p_.cap_scores(scores, R_, tile.rows, kMaxTileRows);
    mask(tile, scores);
    // Online softmax: new running max, rescale factors, probabilities.
    if (p_.sparse_v <= 0.f) {
      tk_.softmax_update(scores, R_, tile.rows, m, l, sc_.corr.data());
      return accumulate(tile, kvh, scores, acc);
    }
    // Sparse V: this unit's kept rows are found (and their V rows prefetched)
    // now, and accumulated after the next unit's scores, by when they have
    // arrived; the previous unit's are accumulated now. Each kv head's
    // accumulator still sees its units in order, so nothing else changes.
    const int cur = 1 - pending_;
    tk_.softmax_update(scores, R_, tile.rows, m, l, sc_.kept_corr[cur].data());
    keep_rows(tile, kvh, scores, acc, cur);
    accumulate_kept(kept_[pending_]);
    pending_ = cur;
  }

 public:
  // Sparse V (sparse_v.h, seed_running_max): the seed maxima of the chunk's kv
  // heads, seed(kvh)[j] for its R rows. Seeds are the first key row 0 sees and
  // the sparse_v_recent_seeds(len) newest keys every row sees (up to len - L), each
  // masked for the rows that do not see it; padding is never a seed. Computed
  // once per (sequence, kv head) and shared by its splits.
  template <typename SeedAt>
  void seeds(SeedAt seed) {
    const int first = row_range(p_, len_, 0).lo, newest = len_ - p_.query_len;
    const int recent = std::max(first, newest - sparse_v_recent_seeds(len_) + 1);
    std::vector<int> at;
    if (first >= 0 && first < recent && first < len_) at.push_back(first);
    for (int t = std::max(recent, 0); t <= newest && t < len_; ++t) at.push_back(t);
    for (int kvh = kvh0_; kvh < kvh1_; ++kvh) std::fill_n(seed(kvh), R_, kNegInf);
    if (at.empty()) return;
    sc_.fit((kvh1_ - kvh0_) * R_, R_, D_);
    load_queries();
    float* scores = sc_.scores.data();
    for (int kvh = kvh0_; kvh < kvh1_; ++kvh)
      for (size_t c0 = 0; c0 < at.size(); c0 += kMaxTileRows) {  // a tile's worth of seeds at a time
        const int* chunk = at.data() + c0;
        const int n = static_cast<int>(std::min<size_t>(kMaxTileRows, at.size() - c0));
        // One segment per run of seeds inside a block.
        for (int i = 0; i < n;) {
          Tile tile;
          tile.count = 1;
          tile.seg[0] = seed_segment(chunk[i]);
          int b = i + 1;
          while (b < n && chunk[b] == chunk[b - 1] + 1 && (!p_.paged || chunk[b] % p_.block_size)) ++b;
          tile.seg[0].n = tile.rows = b - i;
          score(tile, kvh, sc_.q.data() + static_cast<int64_t>(kvh - kvh0_) * R_ * D_, scores + i);
          if (!tile.seg[0].valid)  // padding is never a seed
            for (int j = 0; j < R_; ++j) std::fill_n(scores + j * kMaxTileRows + i, b - i, kNegInf);
          i = b;
        }
        p_.cap_scores(scores, R_, n, kMaxTileRows);
        for (int l = 0; l < p_.query_len; ++l) {
          const TokenRange seen = row_range(p_, len_, l);
          for (int i = 0; i < n; ++i)
            if (chunk[i] < seen.lo || chunk[i] >= seen.hi)
              for (int g = 0; g < G_; ++g) scores[(l * G_ + g) * kMaxTileRows + i] = kNegInf;
        }
        seed_running_max(scores, R_, n, seed(kvh));
      }
  }

 private:
  // The one-row segment of token t (its block's row in a paged cache).
  Segment seed_segment(int t) const {
    if (!p_.paged) return Segment{s_, t, 1, true};
    const int64_t block = p_.block_tables[static_cast<int64_t>(s_) * p_.max_blocks + t / p_.block_size];
    return Segment{block, t % p_.block_size, 1, block >= 0 && block < p_.num_blocks};
  }

  // scores[j * kMaxTileRows + r] = q_j . k_r for the tile's rows; padding
  // segments are left to mask().
  void score(const Tile& tile, int kvh, const float* q, float* scores) {
    for (int i = 0, off = 0; i < tile.count; off += tile.seg[i++].n) {
      const Segment& sg = tile.seg[i];
      if (!sg.valid) continue;
      // Rows not read in place: the whole segment converted in one call, then
      // scored from scratch piece by piece like the rows read in place.
      if (k_int8_) {  // one call per segment (the kernel's per-call setup is per head block), then its prefetch steps
        tk_.scores_k8(query_q8(kvh), R_, k_.quant_rows(sg.outer, kvh, sg.row0), sg.n, D_, scores + off);
        for (int r = 0; r < sg.n; r += kPieceRows) prefetcher_.step(pieces_);
        continue;
      }
      if (k_u8_) {  // likewise: the kernel sums the query per group once per call
        tk_.scores_u8(q, R_, k_.quant_rows(sg.outer, kvh, sg.row0), sg.n, D_, scores + off);
        for (int r = 0; r < sg.n; r += kPieceRows) prefetcher_.step(pieces_);
        continue;
      }
      const float* k_rows = nullptr;
      int64_t k_stride = D_;
      if (!k_in_place_) k_rows = k_.tile(sg.outer, kvh, sg.row0, sg.n, sc_.k_tile.data(), &k_stride, tk_);
      for (int r = 0; r < sg.n; r += kPieceRows) {
        const int pn = std::min(kPieceRows, sg.n - r);
        float* out = scores + off + r;
        if (!k_in_place_) {
          tk_.scores(q, R_, k_rows + r * k_stride, k_stride, pn, D_, out);
        } else if (k_.kind == FloatKind::f32) {
          tk_.scores(q, R_, k_.f32_row(sg.outer, kvh, sg.row0 + r), k_.stride[2], pn, D_, out);
        } else {
          k_half_scores_(q, R_, k_.u16_row(sg.outer, kvh, sg.row0 + r), k_.stride[2], pn, D_, out);
        }
        prefetcher_.step(pieces_);
      }
    }
  }

  // The int8 query rows of kv head kvh (R_ rows from row (kvh - kvh0_) * R_).
  QueryQ8 query_q8(int kvh) const {
    QueryQ8 q = sc_.q8.view();
    const int64_t j = static_cast<int64_t>(kvh - kvh0_) * R_;
    q.qi += j * D_;
    q.scale += j * kMaxQ8Groups;
    q.qi_sum += j * kMaxQ8Groups;
    return q;
  }

  // -inf where a query row must not look: padding segments, and tokens
  // outside the row's causal range (and window). With one query token only
  // padding is masked: its range is the item's whole range.
  void mask(const Tile& tile, float* scores) const {
    const int n = tile.rows;
    if (tile.has_padding) {
      for (int i = 0, off = 0; i < tile.count; off += tile.seg[i++].n)
        if (!tile.seg[i].valid)
          for (int j = 0; j < R_; ++j) std::fill_n(scores + j * kMaxTileRows + off, tile.seg[i].n, kNegInf);
    }
    if (tile.first + n <= first_hi_ && tile.first >= last_lo_) return;  // every row sees the whole tile
    for (int l = 0; l < p_.query_len; ++l) {
      const TokenRange seen = row_range(p_, len_, l);
      const int a = std::clamp(seen.lo - tile.first, 0, n);
      const int b = std::max(a, std::clamp(seen.hi - tile.first, 0, n));
      for (int g = 0; g < G_; ++g) {
        float* row = scores + (l * G_ + g) * kMaxTileRows;
        std::fill(row, row + a, kNegInf);
        std::fill(row + b, row + n, kNegInf);
      }
    }
  }

  // acc = acc * corr + p . V over the tile.
  void accumulate(const Tile& tile, int kvh, const float* p, float* acc) {
    const float* corr = sc_.corr.data();
    if (!v_in_place_ && !v_u4_) {
      const float* v_rows = convert_v(tile, kvh);
      for (int i = 0; i < tile.count; ++i) prefetcher_.step(pieces_);
      tk_.accumulate(p, corr, R_, v_rows, D_, tile.rows, D_, acc);
      return;
    }
    // The first segment read rescales the accumulators; the others add on top.
    bool rescaled = false;
    for (int i = 0, off = 0; i < tile.count; off += tile.seg[i++].n) {
      const Segment& sg = tile.seg[i];
      if (sg.valid) {
        const float* c = rescaled ? sc_.ones.data() : corr;
        if (v_u4_)
          tk_.accumulate_u4(p + off, c, R_, v_.quant_rows(sg.outer, kvh, sg.row0), sg.n, D_, acc);
        else if (v_.kind == FloatKind::f32)
          tk_.accumulate(p + off, c, R_, v_.f32_row(sg.outer, kvh, sg.row0), v_.stride[2], sg.n, D_, acc);
        else
          v_half_accumulate_(p + off, c, R_, v_.u16_row(sg.outer, kvh, sg.row0), v_.stride[2], sg.n, D_, acc);
        rescaled = true;
      }
      prefetcher_.step(pieces_);
    }
    if (!rescaled)  // a tile of padding only
      for (int j = 0; j < R_; ++j)
        for (int d = 0; d < D_; ++d) acc[static_cast<int64_t>(j) * D_ + d] *= corr[j];
  }

  // Sparse V: one unit's kept V rows (sparse_v_keep), where they are, with
  // their weights compacted (row i of the tile's kept ones at column i) and the
  // unit's rescale factors, in scratch slot `slot`. acc null: nothing pending.
  struct KeptRows {
    float* acc = nullptr;
    int kvh = 0, n = 0, slot = 0;
    int64_t outer[kMaxTileRows];
    int row[kMaxTileRows];
  };

  void keep_rows(const Tile& tile, int kvh, float* p, float* acc, int slot) {
    KeptRows& kept = kept_[slot];
    kept.acc = acc;
    kept.kvh = kvh;
    kept.slot = slot;
    kept.n = 0;
    uint32_t keep = sparse_v_keep(p_.sparse_v, p, R_, tile.rows);  // padding: weight 0, never kept
    float* w = sc_.kept_w[slot].data();
    for (int i = 0, off = 0; i < tile.count && keep; off += tile.seg[i++].n) {
      const Segment& sg = tile.seg[i];
      for (uint32_t in_seg = keep & (sg.n == 32 ? ~0u : ((1u << sg.n) - 1) << off); in_seg; in_seg &= in_seg - 1) {
        const int r = __builtin_ctz(in_seg);
        const int at = kept.n++;
        kept.outer[at] = sg.outer;
        kept.row[at] = sg.row0 + r - off;
        for (int j = 0; j < R_; ++j) w[j * kMaxTileRows + at] = p[j * kMaxTileRows + r];
        prefetch_v_row(sg.outer, kvh, sg.row0 + r - off);
      }
    }
  }

  // A V row (and, quantized, its scales and biases) toward L2.
  void prefetch_v_row(int64_t outer, int kvh, int row) const {
    const char* a = v_.row_address(outer, kvh, row);
    for (int64_t b = 0; b < v_.row_bytes(); b += 64) __builtin_prefetch(a + b, 0, 2);
    if (v_.quantized) {
      const int64_t sz = float_kind_size(v_.fmt.scale_kind);
      __builtin_prefetch(v_.scales + sz * v_.offset(v_.scale_stride, outer, kvh, row), 0, 2);
      __builtin_prefetch(v_.biases + sz * v_.offset(v_.bias_stride, outer, kvh, row), 0, 2);
    }
  }

  // acc = acc * corr + w . V over a unit's kept rows, in one call of the exact
  // path's kernel. Rows read in place are first copied next to each other, as
  // they are stored (4-bit V: codes, then scales, then biases): each copy is a
  // short sequential read, measured faster on captured attention than
  // accumulating the scattered rows where they are.
  void accumulate_kept(KeptRows& kept) {
    float* acc = kept.acc;
    if (!acc) return;
    kept.acc = nullptr;
    const float* w = sc_.kept_w[kept.slot].data();
    const float* corr = sc_.kept_corr[kept.slot].data();
    const int n = kept.n, kvh = kept.kvh;
    if (n == 0) {
      for (int j = 0; j < R_; ++j)
        for (int d = 0; d < D_; ++d) acc[static_cast<int64_t>(j) * D_ + d] *= corr[j];
      return;
    }
    char* buf = reinterpret_cast<char*>(sc_.v_tile.data());  // room for kMaxTileRows float32 rows
    if (v_u4_) {
      const int64_t row_bytes = v_.row_bytes(), groups = D_ / v_.fmt.group_size;
      const int64_t sz = float_kind_size(v_.fmt.scale_kind);
      char* scales = buf + n * row_bytes;
      char* biases = scales + n * groups * sz;
      for (int i = 0; i < n; ++i) {
        const QuantRows q = v_.quant_rows(kept.outer[i], kvh, kept.row[i]);
        std::copy_n(reinterpret_cast<const char*>(q.bytes), row_bytes, buf + i * row_bytes);
        std::copy_n(static_cast<const char*>(q.scales), groups * sz, scales + i * groups * sz);
        std::copy_n(static_cast<const char*>(q.biases), groups * sz, biases + i * groups * sz);
      }
      const QuantRows rows{reinterpret_cast<const uint8_t*>(buf), row_bytes, scales, groups, biases, groups,
                           v_.fmt.scale_kind, v_.fmt.group_size};
      return tk_.accumulate_u4(w, corr, R_, rows, n, D_, acc);
    }
    if (v_in_place_) {
      const int64_t row_bytes = v_.row_bytes();
      for (int i = 0; i < n; ++i)
        std::copy_n(v_.row_address(kept.outer[i], kvh, kept.row[i]), row_bytes, buf + i * row_bytes);
      if (v_.kind == FloatKind::f32)
        return tk_.accumulate(w, corr, R_, reinterpret_cast<const float*>(buf), D_, n, D_, acc);
      return v_half_accumulate_(w, corr, R_, reinterpret_cast<const uint16_t*>(buf), D_, n, D_, acc);
    }
    // Converted (or dequantized) into scratch, a run of adjacent rows per call.
    float* dst = sc_.v_tile.data();
    for (int i = 0; i < n;) {
      int b = i + 1;
      while (b < n && kept.outer[b] == kept.outer[i] && kept.row[b] == kept.row[b - 1] + 1) ++b;
      int64_t stride;
      float* out = dst + static_cast<int64_t>(i) * D_;
      const float* rows = v_.tile(kept.outer[i], kvh, kept.row[i], b - i, out, &stride, tk_);
      if (rows != out)  // float32 rows come back in place
        for (int r = 0; r < b - i; ++r) std::copy_n(rows + r * stride, D_, out + static_cast<int64_t>(r) * D_);
      i = b;
    }
    tk_.accumulate(w, corr, R_, dst, D_, n, D_, acc);
  }

  // The tile's V rows as float32 in scratch, rows D apart (zeros for padding).
  const float* convert_v(const Tile& tile, int kvh) {
    float* scratch = sc_.v_tile.data();
    int64_t stride;
    for (int i = 0, off = 0; i < tile.count; off += tile.seg[i++].n) {
      const Segment& sg = tile.seg[i];
      float* dst = scratch + static_cast<int64_t>(off) * D_;
      if (!sg.valid) {
        std::fill_n(dst, static_cast<int64_t>(sg.n) * D_, 0.f);
        continue;
      }
      const float* rows = v_.tile(sg.outer, kvh, sg.row0, sg.n, dst, &stride, tk_);
      if (rows != dst)  // float32 rows come back in place: copy them next to the others
        for (int r = 0; r < sg.n; ++r) std::copy_n(rows + r * stride, D_, dst + static_cast<int64_t>(r) * D_);
    }
    return scratch;
  }

  const AttentionParams& p_;
  const KVView& k_;
  const KVView& v_;
  const TileKernels& tk_;
  const int s_, kvh0_, kvh1_;
  const TokenRange range_;
  const int G_, R_, D_;
  const int len_;
  const int first_hi_;  // every query row sees all of [last_lo_, first_hi_)
  const int last_lo_;
  const bool k_in_place_, v_in_place_, k_int8_, k_u8_, v_u4_;
  decltype(TileKernels::scores_f16) k_half_scores_;
  decltype(TileKernels::accumulate_f16) v_half_accumulate_;
  Scratch& sc_;
  Prefetcher prefetcher_;
  int pieces_ = 1;
  KeptRows kept_[2];
  int pending_ = 0;  // the kept_ slot accumulated next
};

// Merge the splits of query row (s, l, h); sinks join the denominator.
void reduce_row(const AttentionParams& p, const TileKernels& tk, const float* partials, const PartialLayout& lay,
                int splits, int s, int l, int h, float* tmp) {
  const int G = p.num_heads / p.num_kv_heads;
  const int R = lay.R;
  const int D = lay.D;
  const int kvh = h / G;
  const int j = l * G + h % G;
  const int64_t first_item = (static_cast<int64_t>(s) * p.num_kv_heads + kvh) * splits;
  auto item = [&](int i) { return partials + (first_item + i) * lay.floats_per_item(); };

  merge_partials(
      [&](auto f) {
        for (int i = 0; i < splits; ++i) {
          const float* part = item(i);
          f(part[j], part[R + j], part + 2 * R + static_cast<int64_t>(j) * D);
        }
      },
      D, p.sinks ? p.sinks + h : nullptr, tmp);

  const int64_t row = p.row_offset(s, l, h);
  store_output_row(tk, p.q_kind, tmp, D, p.out, row);
}

// How the work is cut: `splits` token ranges per sequence, and kv heads in
// chunks of `heads_per_item`. Whole sequences' heads per item read the cache
// most sequentially; chunks shrink only when that leaves too few items.
//
// Automatic splits are windows: every sequence's tokens are cut at the multiples of
// `window` (min_tokens_per_split rounded up to whole tiles), so its partials, and its
// output, depend on its own tokens only, never on the batch it is in (`splits` is the
// most windows any sequence spans; a sequence's extra ones are empty and merge as
// nothing). A requested split count cuts each range in that many parts instead, capped
// at the tiles of the longest range (more splits would be empty, and an absurd count
// must not size the partials).
struct WorkPlan {
  int splits = 1;
  int heads_per_item = 1;
  int window = 0;  // > 0: automatic windows of this many tokens; 0: split_range
};

TokenRange window_range(TokenRange live, int k, int window) {
  const int64_t a = (static_cast<int64_t>(live.lo / window) + k) * window;
  const int64_t lo = std::max<int64_t>(a, live.lo), hi = std::min<int64_t>(a + window, live.hi);
  return hi > lo ? TokenRange{static_cast<int>(lo), static_cast<int>(hi)} : TokenRange{};
}

WorkPlan plan(const AttentionParams& p) {
  WorkPlan w;
  int max_tiles = 1;
  if (p.num_splits <= 0) w.window = ceil_div(std::max(1, p.min_tokens_per_split), kMaxTileRows) * kMaxTileRows;
  for (int s = 0; s < p.num_seqs; ++s) {
    const TokenRange r = live_range(p, s);
    max_tiles = std::max(max_tiles, tile_count(p, r));
    if (w.window && !r.empty()) w.splits = std::max(w.splits, ceil_div(r.hi, w.window) - r.lo / w.window);
  }
  if (!w.window) w.splits = std::min(p.num_splits, max_tiles);
  const int64_t target = static_cast<int64_t>(kItemsPerThread) * ThreadPool::instance().num_threads();
  w.heads_per_item = p.num_kv_heads;
  for (;;) {
    const int64_t base = static_cast<int64_t>(p.num_seqs) * (p.num_kv_heads / w.heads_per_item);
    if (base * w.splits >= target || w.heads_per_item % 2) return w;
    w.heads_per_item /= 2;
  }
}

}  // namespace

void decode_attention(const AttentionParams& p, const KVView& k, const KVView& v) {
  if (p.num_seqs == 0 || p.query_len == 0 || p.num_heads == 0 || p.head_dim == 0) return;  // empty output
  const TileKernels& tk = tile_kernels(p.head_dim);
  const WorkPlan work = plan(p);
  const int splits = work.splits;
  const int chunks = p.num_kv_heads / work.heads_per_item;
  const PartialLayout lay{p.num_heads / p.num_kv_heads * p.query_len, p.head_dim};
  // Partials of (s, kvh, split), whatever the chunking.
  std::vector<float> partials(static_cast<size_t>(p.num_seqs) * p.num_kv_heads * splits * lay.floats_per_item());

  ThreadPool& pool = ThreadPool::instance();
  // Sparse V: the seed maxima of (s, kvh), R each, scored once for all splits
  // by the first of their items to start (the others wait for it: a pass of
  // its own would cost a pool wake-up per call, measured ~80 us on two cores).
  const bool sparse = p.sparse_v > 0.f;
  std::vector<float> seeds(sparse ? static_cast<size_t>(p.num_seqs) * p.num_kv_heads * lay.R : 0);
  std::unique_ptr<std::once_flag[]> seeded(sparse ? new std::once_flag[static_cast<size_t>(p.num_seqs) * chunks] : nullptr);
  auto seed_at = [&](int s) {
    return [&, s](int kvh) { return seeds.data() + (static_cast<int64_t>(s) * p.num_kv_heads + kvh) * lay.R; };
  };
  const int64_t n_items = static_cast<int64_t>(p.num_seqs) * chunks * splits;
  pool.parallel_for(n_items, [&](int64_t item) {
    const int split = static_cast<int>(item % splits);
    const int chunk = static_cast<int>(item / splits % chunks);
    const int s = static_cast<int>(item / splits / chunks);
    const TokenRange live = live_range(p, s);
    const TokenRange range = work.window ? window_range(live, split, work.window) : split_range(p, live, split, splits);
    const int kvh0 = chunk * work.heads_per_item;
    if (sparse)
      std::call_once(seeded[static_cast<int64_t>(s) * chunks + chunk], [&] {
        ItemWalker(p, k, v, tk, s, kvh0, kvh0 + work.heads_per_item, live).seeds(seed_at(s));
      });
    auto partial = [&](int kvh) {
      return partials.data() + ((static_cast<int64_t>(s) * p.num_kv_heads + kvh) * splits + split) * lay.floats_per_item();
    };
    ItemWalker(p, k, v, tk, s, kvh0, kvh0 + work.heads_per_item, range).run(partial, seed_at(s));
  });

  pool.parallel_for(p.num_seqs, [&](int64_t s) {
    std::vector<float> tmp(p.head_dim);
    for (int l = 0; l < p.query_len; ++l)
      for (int h = 0; h < p.num_heads; ++h)
        reduce_row(p, tk, partials.data(), lay, splits, static_cast<int>(s), l, h, tmp.data());
  });
}

}  // namespace kvmetal
