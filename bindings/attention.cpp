#include "attention.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <cstdint>
#include <vector>

#include "thread_pool.h"

namespace kvmetal {
namespace {

constexpr int kMinTokensPerSplit = 256;  // below this a split costs more than it saves
constexpr int kItemsPerThread = 8;       // enough items to balance uneven ones (and
                                         // threads that the OS pauses)

int ceil_div(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

struct TokenRange {
  int lo = 0, hi = 0;  // [lo, hi)
  bool empty() const { return hi <= lo; }
};

// The tokens the query may see: all of them, or the last `sliding_window`.
TokenRange live_range(const AttentionParams& p, int s) {
  const int len = p.paged ? p.seq_lens[s] : p.contiguous_len;
  const int lo = p.sliding_window > 0 ? std::max(0, len - p.sliding_window) : 0;
  return {lo, len};
}

// Tokens are split in whole tiles so each tile is read by one item only;
// out-of-window blocks are never visited.
int tile_rows(const AttentionParams& p) { return p.paged ? p.block_size : kMaxTileRows; }

TokenRange split_range(const AttentionParams& p, TokenRange live, int split, int splits) {
  const int unit = tile_rows(p);
  const int first = live.lo / unit;
  const int n_units = ceil_div(live.hi, unit) - first;
  const int per = ceil_div(n_units, splits);
  const int a = (first + std::min(n_units, split * per)) * unit;
  const int b = (first + std::min(n_units, (split + 1) * per)) * unit;
  return {std::max(a, live.lo), std::min(b, live.hi)};
}

// Partials of one item: m[G], l[G], acc[G][D] (float32).
struct PartialLayout {
  int G, D;
  int64_t floats_per_item() const { return static_cast<int64_t>(G) * (D + 2); }
};

struct Scratch {
  std::vector<float> q, k_tile, v_tile, scores, corr, ones;
  void fit(int query_rows, int G, int D) {
    ones.assign(G, 1.f);
    q.resize(static_cast<size_t>(query_rows) * D);
    k_tile.resize(static_cast<size_t>(kMaxTileRows) * D);
    v_tile.resize(static_cast<size_t>(kMaxTileRows) * D);
    scores.resize(static_cast<size_t>(G) * kMaxTileRows);
    corr.resize(G);
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

// One work item: kv heads [kvh0, kvh1) of sequence s over `range`. The item
// walks the range tile by tile and, for each tile, every kv head of its
// chunk, so consecutive reads are the adjacent (block, head) tiles of one
// block: long sequential runs that the hardware prefetcher follows, where one
// head at a time would jump between scattered 4-8 KiB pieces.
// Partials of (s, kvh, split) go to partial(kvh).
template <typename PartialAt>
void attend_item(const AttentionParams& p, const KVView& k, const KVView& v, const TileKernels& tk, int s, int kvh0,
                 int kvh1, TokenRange range, PartialAt partial) {
  const int G = p.num_heads / p.num_kv_heads;
  const int D = p.head_dim;
  const int HC = kvh1 - kvh0;
  for (int kvh = kvh0; kvh < kvh1; ++kvh) {
    float* part = partial(kvh);
    std::fill(part, part + G, -std::numeric_limits<float>::infinity());
    std::fill(part + G, part + 2 * G + static_cast<int64_t>(G) * D, 0.f);
  }
  if (range.empty()) return;

  thread_local Scratch sc;
  sc.fit(HC * G, G, D);

  // The chunk's query rows, pre-scaled: scores come out already times `scale`.
  for (int j = 0; j < HC * G; ++j) {
    const int64_t row = (static_cast<int64_t>(s) * p.num_heads + kvh0 * G + j) * D;
    for (int d = 0; d < D; ++d) sc.q[static_cast<int64_t>(j) * D + d] = load_as_f32(p.query, row + d, p.q_kind) * p.scale;
  }

  // A tile is up to kMaxTileRows consecutive tokens, made of segments: runs
  // of rows [row0, row0 + n) of one (outer, kvh), i.e. one block of a paged
  // cache. One softmax step (and one accumulator rescale) serves the whole
  // tile. Rows the kernels can read in place (float32; float16/bfloat16 where
  // the CPU widens them in registers) are used where they are, segment by segment;
  // other rows are converted (or dequantized) once into a scratch tile.
  struct Segment {
    int64_t outer;
    int row0, n;
  };
  constexpr int kMaxSegments = kMaxTileRows / 8;
  auto segment_at = [&](int t) {
    if (p.paged) {
      const int row0 = t % p.block_size;
      return Segment{p.block_tables[static_cast<int64_t>(s) * p.max_blocks + t / p.block_size], row0,
                     std::min(p.block_size - row0, range.hi - t)};
    }
    return Segment{s, t, std::min(kMaxTileRows - t % kMaxTileRows, range.hi - t)};
  };
  // Fills segs for the tile starting at token t; returns the segment count.
  auto tile_at = [&](int t, Segment* segs, int* rows) {
    int count = 0;
    *rows = 0;
    do {
      segs[count] = segment_at(t + *rows);
      *rows += segs[count++].n;
    } while (p.paged && count < kMaxSegments && t + *rows < range.hi && *rows + p.block_size <= kMaxTileRows);
    return count;
  };
  // Widening float16/bfloat16 in registers repeats the conversion for every 4
  // query heads; past 8 heads a scratch copy converted once is cheaper.
  auto half_scores = [&](const KVView& view) { return view.kind == FloatKind::f16 ? tk.scores_f16 : tk.scores_bf16; };
  auto half_accumulate = [&](const KVView& view) {
    return view.kind == FloatKind::f16 ? tk.accumulate_f16 : tk.accumulate_bf16;
  };
  auto in_place = [&](const KVView& view) {
    return !view.quantized && (view.kind == FloatKind::f32 || (half_scores(view) && G <= 8));
  };
  const bool k_in_place = in_place(k), v_in_place = in_place(v);
  const auto k_half_scores = half_scores(k);
  const auto v_half_accumulate = half_accumulate(v);
  // A converted tile: all segments into scratch, rows D floats apart.
  auto convert = [&](const KVView& view, int kvh, const Segment* segs, int count, float* scratch) {
    int64_t stride;
    for (int i = 0, off = 0; i < count; off += segs[i++].n)
      view.tile(segs[i].outer, kvh, segs[i].row0, segs[i].n, scratch + static_cast<int64_t>(off) * D, &stride, tk);
    return static_cast<const float*>(scratch);
  };
  constexpr int kPieceRows = 4;  // K is scored 4 rows at a time, a prefetch step after each
  constexpr int kPrefetchAhead = 3;  // units (tile, kv head) between a prefetch and its use
  Prefetcher prefetcher;

  Segment cur[kMaxSegments], next[kMaxSegments];
  int cur_rows;
  int cur_count = tile_at(range.lo, cur, &cur_rows);
  for (int t = range.lo; t < range.hi;) {
    const int n = cur_rows;
    t += n;
    int next_rows = 0, next_count = 0;
    if (t < range.hi) next_count = tile_at(t, next, &next_rows);

    for (int kvh = kvh0; kvh < kvh1; ++kvh) {
      float* part = partial(kvh);
      float* m = part;
      float* l = part + G;
      float* acc = part + 2 * G;
      const float* q = sc.q.data() + static_cast<int64_t>(kvh - kvh0) * G * D;

      // Queue the unit kPrefetchAhead units on (this tile's heads, then the
      // next tile's): one unit ahead left the loads waiting on memory.
      prefetcher.reset();
      const int A = std::min(kPrefetchAhead, kvh1 - kvh0);
      const Segment* ahead = kvh + A < kvh1 ? cur : next;
      const int ahead_count = kvh + A < kvh1 ? cur_count : next_count;
      const int ahead_head = kvh + A < kvh1 ? kvh + A : kvh0 + (kvh + A - kvh1);
      // All of the unit's K first: it is read first.
      for (int i = 0; i < ahead_count; ++i) prefetcher.add(k, ahead[i].outer, ahead_head, ahead[i].row0, ahead[i].n);
      for (int i = 0; i < ahead_count; ++i) prefetcher.add(v, ahead[i].outer, ahead_head, ahead[i].row0, ahead[i].n);
      const int pieces = (n + kPieceRows - 1) / kPieceRows + cur_count;  // K pieces, then V segments

      float* scores = sc.scores.data();
      for (int i = 0, off = 0; i < cur_count; off += cur[i++].n) {
        const Segment& sg = cur[i];
        // Other rows: the whole segment converted in one call, then scored
        // from scratch piece by piece like the rows read in place.
        const float* k_rows = nullptr;
        int64_t k_stride = D;
        if (!k_in_place) k_rows = k.tile(sg.outer, kvh, sg.row0, sg.n, sc.k_tile.data(), &k_stride, tk);
        for (int r = 0; r < sg.n; r += kPieceRows) {
          const int pn = std::min(kPieceRows, sg.n - r);
          if (!k_in_place) {
            tk.scores(q, G, k_rows + r * k_stride, k_stride, pn, D, scores + off + r);
          } else if (k.kind == FloatKind::f32) {
            tk.scores(q, G, k.f32_row(sg.outer, kvh, sg.row0 + r), k.stride[2], pn, D, scores + off + r);
          } else {
            k_half_scores(q, G, k.u16_row(sg.outer, kvh, sg.row0 + r), k.stride[2], pn, D, scores + off + r);
          }
          prefetcher.step(pieces);
        }
      }
      if (p.has_softcap) {
        for (int g = 0; g < G; ++g)
          for (int r = 0; r < n; ++r) {
            float& x = scores[g * kMaxTileRows + r];
            x = p.softcap * std::tanh(x / p.softcap);
          }
      }
      // Online softmax: new running max, rescale factors, probabilities.
      tk.softmax_update(scores, G, n, m, l, sc.corr.data());

      if (v_in_place) {
        // The first segment rescales the accumulators; the others add on top.
        for (int i = 0, off = 0; i < cur_count; off += cur[i++].n) {
          const Segment& sg = cur[i];
          const float* corr = i == 0 ? sc.corr.data() : sc.ones.data();
          if (v.kind == FloatKind::f32)
            tk.accumulate(scores + off, corr, G, v.f32_row(sg.outer, kvh, sg.row0), v.stride[2], sg.n, D, acc);
          else
            v_half_accumulate(scores + off, corr, G, v.u16_row(sg.outer, kvh, sg.row0), v.stride[2], sg.n, D, acc);
          prefetcher.step(pieces);
        }
      } else {
        const float* v_rows = convert(v, kvh, cur, cur_count, sc.v_tile.data());
        for (int i = 0; i < cur_count; ++i) prefetcher.step(pieces);
        tk.accumulate(scores, sc.corr.data(), G, v_rows, D, n, D, acc);
      }
    }

    std::copy(next, next + next_count, cur);
    cur_count = next_count;
    cur_rows = next_rows;
  }
}

// Merge the splits of one (sequence, query head); sinks join the denominator.
void reduce_head(const AttentionParams& p, const TileKernels& tk, const float* partials, const PartialLayout& lay,
                 int splits, int s, int h, float* tmp) {
  const int G = lay.G;
  const int D = lay.D;
  const int kvh = h / G;
  const int g = h % G;
  const int64_t first_item = (static_cast<int64_t>(s) * p.num_kv_heads + kvh) * splits;
  auto item = [&](int i) { return partials + (first_item + i) * lay.floats_per_item(); };

  float M = -std::numeric_limits<float>::infinity();
  for (int i = 0; i < splits; ++i) M = std::max(M, item(i)[g]);
  if (p.sinks) M = std::max(M, p.sinks[h]);

  std::fill(tmp, tmp + D, 0.f);
  float L = 0.f;
  for (int i = 0; i < splits; ++i) {
    const float* part = item(i);
    if (part[G + g] == 0.f) continue;  // empty split
    const float w = std::exp(part[g] - M);
    L += part[G + g] * w;
    const float* acc = part + 2 * G + static_cast<int64_t>(g) * D;
    for (int d = 0; d < D; ++d) tmp[d] += acc[d] * w;
  }
  if (p.sinks) L += std::exp(p.sinks[h] - M);
  const float inv = L > 0.f ? 1.f / L : 0.f;
  for (int d = 0; d < D; ++d) tmp[d] *= inv;

  const int64_t row = (static_cast<int64_t>(s) * p.num_heads + h) * D;
  switch (p.q_kind) {
    case FloatKind::f32:
      std::copy(tmp, tmp + D, reinterpret_cast<float*>(p.out) + row);
      break;
    case FloatKind::f16:
      tk.f32_to_f16(tmp, D, reinterpret_cast<uint16_t*>(p.out) + row);
      break;
    default:
      for (int d = 0; d < D; ++d) reinterpret_cast<uint16_t*>(p.out)[row + d] = f32_to_bf16(tmp[d]);
      break;
  }
}


// How the work is cut: `splits` token ranges per sequence, and kv heads in
// chunks of `heads_per_item`. Whole sequences' heads per item read the cache
// most sequentially; chunks shrink only when that leaves too few items.
struct Grid {
  int splits = 1;
  int heads_per_item = 1;
};

Grid plan(const AttentionParams& p) {
  int max_tokens = 0;
  for (int s = 0; s < p.num_seqs; ++s) {
    TokenRange r = live_range(p, s);
    max_tokens = std::max(max_tokens, r.hi - r.lo);
  }
  const int64_t target = static_cast<int64_t>(kItemsPerThread) * ThreadPool::instance().num_threads();
  const int cap = std::max(1, max_tokens / kMinTokensPerSplit);
  Grid g;
  g.heads_per_item = p.num_kv_heads;
  for (;;) {
    const int64_t base = static_cast<int64_t>(p.num_seqs) * (p.num_kv_heads / g.heads_per_item);
    g.splits = p.num_splits > 0 ? p.num_splits : std::max(1, std::min(ceil_div(target, base), cap));
    if (base * g.splits >= target || g.heads_per_item % 2) return g;
    g.heads_per_item /= 2;
  }
}

}  // namespace

int resolve_num_splits(const AttentionParams& p) { return p.num_seqs ? plan(p).splits : 1; }

void decode_attention(const AttentionParams& p, const KVView& k, const KVView& v) {
  if (p.num_seqs == 0 || p.num_heads == 0 || p.head_dim == 0) return;  // empty output
  const TileKernels& tk = tile_kernels(p.head_dim);
  const Grid grid = plan(p);
  const int splits = grid.splits;
  const int chunks = p.num_kv_heads / grid.heads_per_item;
  const PartialLayout lay{p.num_heads / p.num_kv_heads, p.head_dim};
  // Partials of (s, kvh, split), whatever the chunking.
  std::vector<float> partials(static_cast<size_t>(p.num_seqs) * p.num_kv_heads * splits * lay.floats_per_item());

  ThreadPool& pool = ThreadPool::instance();
  const int64_t n_items = static_cast<int64_t>(p.num_seqs) * chunks * splits;
  pool.parallel_for(n_items, [&](int64_t item) {
    const int split = static_cast<int>(item % splits);
    const int chunk = static_cast<int>(item / splits % chunks);
    const int s = static_cast<int>(item / splits / chunks);
    const TokenRange range = split_range(p, live_range(p, s), split, splits);
    const int kvh0 = chunk * grid.heads_per_item;
    auto partial = [&](int kvh) {
      return partials.data() + ((static_cast<int64_t>(s) * p.num_kv_heads + kvh) * splits + split) * lay.floats_per_item();
    };
    attend_item(p, k, v, tk, s, kvh0, kvh0 + grid.heads_per_item, range, partial);
  });

  pool.parallel_for(p.num_seqs, [&](int64_t s) {
    std::vector<float> tmp(p.head_dim);
    for (int h = 0; h < p.num_heads; ++h) {
      reduce_head(p, tk, partials.data(), lay, splits, static_cast<int>(s), h, tmp.data());
    }
  });
}

}  // namespace kvmetal
