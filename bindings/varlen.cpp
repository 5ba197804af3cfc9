#include "varlen.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "output_row.h"
#include "split_merge.h"
#include "thread_pool.h"

namespace kvmetal {
namespace {

constexpr int kKeyTile = kMaxTileRows;  // keys per step: whole blocks, as block_size divides 32
constexpr int kItemsPerThread = 8;      // items enough to balance uneven ones

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// Query positions per tile (times G heads = the tile's rows): enough rows per
// K/V tile that converting it is a small part of the work, few enough that the
// queries and accumulators stay in L1/L2.
int tile_positions(int G, int D) { return std::max(1, (D <= 128 ? 64 : 32) / G); }

// One sequence's run: query rows [row0, row0 + n), the last n of its len cached tokens.
struct Run {
  int row0 = 0, n = 0, len = 0;
};

// Runs from query_start_loc, guarded: starts clamped to [0, T] and never
// before the previous run's end (so no two runs write one row), lengths
// clamped to the table.
std::vector<Run> make_runs(const VarlenParams& p) {
  std::vector<Run> runs(p.num_seqs);
  const int64_t capacity = p.max_blocks * p.block_size;
  int end = 0;
  for (int s = 0; s < p.num_seqs; ++s) {
    const int a = std::max(end, std::clamp(p.query_start_loc[s], 0, p.num_tokens));
    const int b = std::max(a, std::clamp(p.query_start_loc[s + 1], 0, p.num_tokens));
    runs[s] = Run{a, b - a, static_cast<int>(std::clamp<int64_t>(p.seq_lens[s], 0, capacity))};
    end = b;
  }
  return runs;
}

struct KeyRange {
  int lo = 0, hi = 0;  // [lo, hi)
};

// Split windows. Every row's keys are cut at the multiples of `tokens` (min_tokens_per_split
// rounded up to whole key tiles), whatever tile, chunk or batch the row is in; each window
// gets its own online-softmax state and the states are merged in order (merge_partials).
// Whether a tile's windows run as separate items (few tiles for the threads) or one after
// another in one item changes nothing in the arithmetic: a row's output depends on its own
// keys only, never on what it is batched or chunked with.
struct Windows {
  int64_t tokens = kKeyTile;
  int64_t first(KeyRange keys) const { return keys.lo / tokens; }
  int count(KeyRange keys) const {
    return keys.hi > keys.lo ? static_cast<int>(ceil_div(keys.hi, tokens) - first(keys)) : 1;
  }
  KeyRange window(KeyRange keys, int k) const {
    const int64_t a = (first(keys) + k) * tokens, b = a + tokens;
    return KeyRange{static_cast<int>(std::max<int64_t>(a, keys.lo)), static_cast<int>(std::min<int64_t>(b, keys.hi))};
  }
};

// A query tile: run positions [i0, i1) of sequence s, and the keys any of its
// rows sees (causal tiles past its last position, and window tiles before its
// first position's window, are outside the range and never visited).
struct QueryTile {
  int s = 0, i0 = 0, i1 = 0;
  KeyRange keys;
  int windows = 1;       // split windows its keys span (Windows)
  int64_t partial = -1;  // first partial slot of (kv head 0, window 0) when its windows are separate items, else -1
};

// The position of run row i, and what it sees.
int64_t position(const Run& r, int i) { return static_cast<int64_t>(r.len) - r.n + i; }

KeyRange visible_keys(const VarlenParams& p, const Run& r, int i0, int i1) {
  const int64_t hi = std::max<int64_t>(0, position(r, i1 - 1) + 1);
  const int64_t lo = std::min(p.first_visible(position(r, i0)), hi);
  return KeyRange{static_cast<int>(lo), static_cast<int>(hi)};
}

struct Scratch {
  std::vector<float> q, k, v, scores, corr, state;
  void fit(int R, int D) {
    q.resize(static_cast<size_t>(R) * D);
    k.resize(static_cast<size_t>(kKeyTile) * D);
    v.resize(static_cast<size_t>(kKeyTile) * D);
    scores.resize(static_cast<size_t>(R) * kMaxTileRows);
    corr.resize(R);
  }
};

Scratch& scratch() {
  thread_local Scratch sc;
  return sc;
}

// The online-softmax state of R rows: m[R], l[R], acc[R][D] (float32), one block.
struct State {
  float* m;
  float* l;
  float* acc;
  State(float* base, int R) : m(base), l(base + R), acc(base + 2 * R) {}
};

class TileWalker {
 public:
  TileWalker(const VarlenParams& p, const KVView& k, const KVView& v, const TileKernels& tk, const Run& run,
             const QueryTile& tile, int kvh)
      : p_(p), k_(k), v_(v), tk_(tk), run_(run), tile_(tile), kvh_(kvh), G_(p.num_heads / p.num_kv_heads),
        R_((tile.i1 - tile.i0) * G_), D_(p.head_dim), sc_(scratch()) {
    sc_.fit(R_, D_);
  }

  int rows() const { return R_; }

  // Attend over `keys` (a part of the tile's range) into `st`.
  void run(KeyRange keys, State st) {
    std::fill(st.m, st.m + R_, kNegInf);
    std::fill(st.l, st.l + R_, 0.f);
    std::fill(st.acc, st.acc + static_cast<int64_t>(R_) * D_, 0.f);
    if (keys.hi <= keys.lo) return;
    load_queries();
    for (int t0 = keys.lo; t0 < keys.hi;) {
      const int t1 = std::min(keys.hi, (t0 / kKeyTile + 1) * kKeyTile);
      step(t0, t1, st);
      t0 = t1;
    }
  }

  // The merge of `count` window states, `stride` floats apart, into the output rows: the
  // same merge_partials as reduce() below (sinks join the denominator; zeros for a row
  // that saw nothing), so a row's output does not depend on where its windows ran.
  void write(const float* states, int count, int64_t stride, float* tmp) const {
    for (int j = 0; j < R_; ++j) {
      const int h = kvh_ * G_ + j % G_;
      merge_partials(
          [&](auto f) {
            for (int k = 0; k < count; ++k) {
              const float* part = states + k * stride;
              f(part[j], part[R_ + j], part + 2 * R_ + static_cast<int64_t>(j) * D_);
            }
          },
          D_, p_.sinks ? p_.sinks + h : nullptr, tmp);
      store_row(p_, tk_, tile_row(j), h, tmp);
    }
  }

  // Query row (global index) of tile row j.
  int tile_row(int j) const { return run_.row0 + tile_.i0 + j / G_; }

  static void store_row(const VarlenParams& p, const TileKernels& tk, int row, int h, const float* x) {
    const int64_t at = (static_cast<int64_t>(row) * p.num_heads + h) * p.head_dim;
    store_output_row(tk, p.q_kind, x, p.head_dim, p.out, at);
  }

 private:
  // Tile row j = (position i - i0) * G + g: query head kvh * G + g, pre-scaled
  // (scores come out already times `scale`).
  void load_queries() {
    for (int j = 0; j < R_; ++j) {
      const int64_t src = (static_cast<int64_t>(tile_row(j)) * p_.num_heads + kvh_ * G_ + j % G_) * D_;
      float* dst = sc_.q.data() + static_cast<int64_t>(j) * D_;
      for (int d = 0; d < D_; ++d) dst[d] = load_as_f32(p_.query, src + d, p_.q_kind) * p_.scale;
    }
  }

  // Keys [t0, t1) of one cache as float32 rows D apart in dst; padding blocks
  // are zeros and marked in pad_ (a bit per row).
  void load_tile(const KVView& view, int t0, int t1, float* dst) {
    pad_ = 0;
    const int32_t* table = p_.block_tables + static_cast<int64_t>(tile_.s) * p_.max_blocks;
    for (int t = t0; t < t1;) {
      const int64_t block = table[t / p_.block_size];
      const int row0 = t % p_.block_size;
      const int n = std::min(p_.block_size - row0, t1 - t);
      float* out = dst + static_cast<int64_t>(t - t0) * D_;
      if (block >= 0 && block < p_.num_blocks) {
        int64_t stride;
        const float* rows = view.tile(block, kvh_, row0, n, out, &stride, tk_);
        if (rows != out)  // float32 rows come back in place: copy them next to the others
          for (int r = 0; r < n; ++r) std::memcpy(out + static_cast<int64_t>(r) * D_, rows + r * stride, D_ * 4);
      } else {
        std::fill_n(out, static_cast<int64_t>(n) * D_, 0.f);
        pad_ |= ((n == 32 ? ~0u : ((1u << n) - 1)) << (t - t0));
      }
      t += n;
    }
  }

  void step(int t0, int t1, State st) {
    const int n = t1 - t0;
    float* scores = sc_.scores.data();
    load_tile(k_, t0, t1, sc_.k.data());
    tk_.scores(sc_.q.data(), R_, sc_.k.data(), D_, n, D_, scores);
    p_.cap_scores(scores, R_, n, kMaxTileRows);
    mask(t0, n, scores);
    tk_.softmax_update(scores, R_, n, st.m, st.l, sc_.corr.data());
    load_tile(v_, t0, t1, sc_.v.data());
    tk_.accumulate(scores, sc_.corr.data(), R_, sc_.v.data(), D_, n, D_, st.acc);
  }

  // -inf where a row must not look: padding, and keys outside its causal
  // range (and window). Rows of one position share their range.
  void mask(int t0, int n, float* scores) const {
    if (pad_)
      for (int r = 0; r < n; ++r)
        if (pad_ >> r & 1u)
          for (int j = 0; j < R_; ++j) scores[j * kMaxTileRows + r] = kNegInf;
    const int64_t first = position(run_, tile_.i0), last = position(run_, tile_.i1 - 1);
    const int w = p_.sliding_window;
    if (t0 + n <= first + 1 && (w == 0 || t0 > last - w)) return;  // every row sees the whole tile
    for (int i = tile_.i0; i < tile_.i1; ++i) {
      const int64_t pos = position(run_, i);
      const int64_t a = std::clamp<int64_t>(p_.first_visible(pos) - t0, 0, n);
      const int64_t b = std::clamp<int64_t>(pos + 1 - t0, a, n);
      for (int g = 0; g < G_; ++g) {
        float* row = scores + ((i - tile_.i0) * G_ + g) * kMaxTileRows;
        std::fill(row, row + a, kNegInf);
        std::fill(row + b, row + n, kNegInf);
      }
    }
  }

  const VarlenParams& p_;
  const KVView& k_;
  const KVView& v_;
  const TileKernels& tk_;
  const Run& run_;
  const QueryTile& tile_;
  const int kvh_, G_, R_, D_;
  Scratch& sc_;
  uint32_t pad_ = 0;
};

// Merge the windows of (tile, kv head) into the output; sinks join the denominator.
void reduce(const VarlenParams& p, const TileKernels& tk, const Run& run, const QueryTile& tile, int kvh,
            const float* partials, int64_t slot_floats, int R) {
  const int G = p.num_heads / p.num_kv_heads, D = p.head_dim;
  std::vector<float> tmp(D);
  const float* first = partials + (tile.partial + static_cast<int64_t>(kvh) * tile.windows) * slot_floats;
  for (int j = 0; j < R; ++j) {
    const int h = kvh * G + j % G;
    merge_partials(
        [&](auto f) {
          for (int k = 0; k < tile.windows; ++k) {
            const float* part = first + k * slot_floats;
            f(part[j], part[R + j], part + 2 * R + static_cast<int64_t>(j) * D);
          }
        },
        D, p.sinks ? p.sinks + h : nullptr, tmp.data());
    TileWalker::store_row(p, tk, run.row0 + tile.i0 + j / G, h, tmp.data());
  }
}

struct Item {
  int tile, kvh, split;
  int64_t cost;
};

}  // namespace

void paged_attention_varlen(const VarlenParams& p, const KVView& k, const KVView& v) {
  if (p.num_tokens == 0 || p.num_heads == 0 || p.head_dim == 0) return;  // empty output
  const TileKernels& tk = tile_kernels(p.head_dim);
  const int G = p.num_heads / p.num_kv_heads, D = p.head_dim;
  const std::vector<Run> runs = make_runs(p);

  // Rows no run owns (only under validate=False) are zeros.
  const int64_t row_bytes = static_cast<int64_t>(p.num_heads) * D * float_kind_size(p.q_kind);
  const int owned_lo = runs.empty() ? 0 : runs.front().row0;
  const int owned_hi = runs.empty() ? 0 : runs.back().row0 + runs.back().n;
  std::memset(p.out, 0, owned_lo * row_bytes);
  std::memset(p.out + owned_hi * row_bytes, 0, (p.num_tokens - owned_hi) * row_bytes);

  // Query tiles, and their split windows as separate items where there are too few tiles
  // for the threads (the output is the same either way: Windows).
  const int BQ = tile_positions(G, D);
  std::vector<QueryTile> tiles;
  for (int s = 0; s < p.num_seqs; ++s)
    for (int i0 = 0; i0 < runs[s].n; i0 += BQ) {
      const int i1 = std::min(runs[s].n, i0 + BQ);
      tiles.push_back(QueryTile{s, i0, i1, visible_keys(p, runs[s], i0, i1)});
    }
  const Windows windows{ceil_div(std::max(1, p.min_tokens_per_split), kKeyTile) * kKeyTile};
  const int64_t base = static_cast<int64_t>(tiles.size()) * p.num_kv_heads;
  const int64_t target = static_cast<int64_t>(kItemsPerThread) * ThreadPool::instance().num_threads();
  const bool spread = base < target;
  const int64_t slot_floats = static_cast<int64_t>(BQ) * G * (D + 2);
  int64_t slots = 0;
  std::vector<Item> items;
  for (int t = 0; t < static_cast<int>(tiles.size()); ++t) {
    QueryTile& tile = tiles[t];
    tile.windows = windows.count(tile.keys);
    const int64_t work = tile.keys.hi - tile.keys.lo;
    const int64_t rows = static_cast<int64_t>(tile.i1 - tile.i0) * G;
    const bool separate = spread && tile.windows > 1;
    if (separate) {
      tile.partial = slots;
      slots += static_cast<int64_t>(p.num_kv_heads) * tile.windows;
    }
    for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) {
      if (!separate) {
        items.push_back(Item{t, kvh, -1, (work + kKeyTile) * rows});
        continue;
      }
      for (int k = 0; k < tile.windows; ++k) {
        const KeyRange w = windows.window(tile.keys, k);
        items.push_back(Item{t, kvh, k, (w.hi - w.lo + kKeyTile) * rows});
      }
    }
  }
  // The longest items first: the dynamic claiming then evens out the tail.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::vector<float> partials(static_cast<size_t>(slots * slot_floats));

  ThreadPool& pool = ThreadPool::instance();
  pool.parallel_for(static_cast<int64_t>(items.size()), [&](int64_t index) {
    const Item& item = items[index];
    const QueryTile& tile = tiles[item.tile];
    TileWalker walker(p, k, v, tk, runs[tile.s], tile, item.kvh);
    if (item.split >= 0) {  // one window of a tile whose windows are separate items: reduce() merges them
      const int64_t at = tile.partial + static_cast<int64_t>(item.kvh) * tile.windows + item.split;
      float* slot = partials.data() + at * slot_floats;
      walker.run(windows.window(tile.keys, item.split), State(slot, walker.rows()));
      return;
    }
    // Every window of the tile, one after another, then the same merge.
    Scratch& sc = scratch();
    const int64_t stride = static_cast<int64_t>(walker.rows()) * (D + 2);
    sc.state.resize(static_cast<size_t>(stride * tile.windows));
    for (int w = 0; w < tile.windows; ++w)
      walker.run(windows.window(tile.keys, w), State(sc.state.data() + w * stride, walker.rows()));
    std::vector<float>& tmp = sc.k;  // free again once the walks are done
    walker.write(sc.state.data(), tile.windows, stride, tmp.data());
  });

  if (slots == 0) return;
  std::vector<std::pair<int, int>> merges;  // (tile, kv head) whose windows were separate items
  for (int t = 0; t < static_cast<int>(tiles.size()); ++t)
    if (tiles[t].partial >= 0)
      for (int kvh = 0; kvh < p.num_kv_heads; ++kvh) merges.emplace_back(t, kvh);
  pool.parallel_for(static_cast<int64_t>(merges.size()), [&](int64_t i) {
    const QueryTile& tile = tiles[merges[i].first];
    reduce(p, tk, runs[tile.s], tile, merges[i].second, partials.data(), slot_floats, (tile.i1 - tile.i0) * G);
  });
}

}  // namespace kvmetal
