// Sparse V on the CPU (docs/kernels.md, "Sparse V"): one tile's V accumulation that
// skips the keys no query row needs. Shared by the decode walker (attention.cpp) and
// the cascade items (cascade.cpp), so both skip by the same rule.
#pragma once

#include <algorithm>
#include <cstdint>

#include "tile_math.h"

namespace kvmetal {

// One run of a tile's rows that a caller reads in one piece (a block's rows);
// an invalid one is padding (its weights are 0, it is never read).
struct SparseVSegment {
  int n = 0;
  bool valid = true;
};

// Sparse V's seeds: the running max m of each of R rows starts at the best real
// score among the first key the first query row sees (an attention sink in most
// models) and the kSparseVRecentSeeds newest keys every row sees, so a split's
// first keys can be skipped too (from -inf they never were). `seed_scores` holds
// the rows' capped scores of the n <= kMaxTileRows seed keys, kMaxTileRows apart,
// -inf where a row does not see the seed: m stays a score the row sees, never
// above its final max (the bound of docs/kernels.md). The seeds' weights join l
// where their tiles are walked. (kvmetal/reference.py, sparse_v_seeds.)
constexpr int kSparseVRecentSeeds = kMaxTileRows - 1;  // with the first key: one tile of seeds

// The decode walker scores its seeds once per (sequence, kv head), not per split,
// so it can afford more of the newest keys on a long sequence: one per 128 keys,
// up to 255 (under 1% more scoring). Any real score a row sees keeps the bound, so
// this superset of the oracle's seeds only skips more (Gemma-3-270M at 32K: 255
// newest reach 0.95 of the final-max rate, 31 newest 0.84).
inline int sparse_v_recent_seeds(int len) {
  return std::clamp(len / 128, kSparseVRecentSeeds, 8 * kMaxTileRows - 1);
}

inline void seed_running_max(const float* seed_scores, int R, int n, float* m) {
  for (int j = 0; j < R; ++j)
    for (int i = 0; i < n; ++i) m[j] = std::max(m[j], seed_scores[j * kMaxTileRows + i]);
}

// p: R query rows of a tile's `rows` weights exp(s - m_running), kMaxTileRows
// apart (m_running: the max over the keys so far, this tile included). Weights
// below tau are zeroed (the denominator keeps them); returns the rows some query
// row still needs, bit r for row r: only their V rows are read.
inline uint32_t sparse_v_keep(float tau, float* p, int R, int rows) {
  // Branch-free passes the compiler vectorizes; the bits are gathered once.
  uint8_t need[kMaxTileRows] = {};
  for (int j = 0; j < R; ++j) {
    float* row = p + j * kMaxTileRows;
    for (int r = 0; r < rows; ++r) {
      const bool kept = row[r] >= tau;
      row[r] = kept ? row[r] : 0.f;
      need[r] |= kept;
    }
  }
  uint32_t keep = 0;
  for (int r = 0; r < rows; ++r) keep |= static_cast<uint32_t>(need[r]) << r;
  return keep;
}

// One tile's sparse V accumulation, run by run (cascade.cpp): p as for
// sparse_v_keep; segment_at(i) -> SparseVSegment, for i < count.
// accumulate_rows(i, r0, n, p_run, c): acc = acc * c + p_run . V over rows
// [r0, r0 + n) of segment i. The first run accumulated rescales by corr, the
// others add on top (c = ones, R ones); with no run at all acc is rescaled here.
template <typename SegmentAt, typename AccumulateRows>
void accumulate_sparse_v(float tau, float* p, int R, int D, int rows, int count, SegmentAt segment_at,
                         const float* corr, const float* ones, float* acc, AccumulateRows accumulate_rows) {
  const uint32_t keep = sparse_v_keep(tau, p, R, rows);
  auto need = [keep](int r) { return (keep >> r) & 1u; };
  bool rescaled = false;
  for (int i = 0, off = 0; i < count; ++i) {
    const SparseVSegment sg = segment_at(i);
    if (sg.valid)
      for (int a = 0; a < sg.n;) {
        if (!need(off + a)) {
          ++a;
          continue;
        }
        int b = a + 1;
        while (b < sg.n && need(off + b)) ++b;
        accumulate_rows(i, a, b - a, p + off + a, rescaled ? ones : corr);
        rescaled = true;
        a = b;
      }
    off += sg.n;
  }
  if (!rescaled)
    for (int j = 0; j < R; ++j)
      for (int d = 0; d < D; ++d) acc[static_cast<int64_t>(j) * D + d] *= corr[j];
}

}  // namespace kvmetal
