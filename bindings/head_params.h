// What every CPU attention op (decode, varlen, cascade) is given the same way:
// the query heads and their scaling, the paged cache's block shape, and the
// query, sink and output arrays. Each op's params struct extends it.
//
// It also owns the ops' attention variant, the CPU side of KvVariant in
// kernels/kvmetal_common.h: the softcap and the sliding window are applied
// here and nowhere else, so the three ops cannot drift apart.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "float_kind.h"

namespace kvmetal {

struct HeadParams {
  int num_seqs = 0;      // S (B for contiguous decode)
  int num_heads = 0;     // H, query heads
  int num_kv_heads = 0;  // Hkv, H % Hkv == 0
  int head_dim = 0;      // D
  float scale = 1.f;
  bool has_softcap = false;
  float softcap = 0.f;
  int sliding_window = 0;  // 0: none; else a query at position p sees keys (p - w, p]
  int min_tokens_per_split = 1;  // no KV split of fewer tokens (from Python)

  int block_size = 0;      // paged caches
  int64_t num_blocks = 0;  // paged caches: block ids outside [0, num_blocks) are padding

  const char* query = nullptr;  // row-major, q_kind (each op gives the layout)
  FloatKind q_kind = FloatKind::f32;
  const float* sinks = nullptr;  // [H] or null
  char* out = nullptr;           // the query's layout and dtype

  // softcap * tanh(s / softcap) on n scores of each of `rows` rows, `stride` apart
  // (a no-op without a softcap).
  void cap_scores(float* scores, int rows, int n, int stride) const {
    if (!has_softcap) return;
    for (int j = 0; j < rows; ++j)
      for (int r = 0; r < n; ++r) {
        float& x = scores[static_cast<int64_t>(j) * stride + r];
        x = softcap * std::tanh(x / softcap);
      }
  }

  // The first key a query at position pos sees (the window's start, or 0).
  int64_t first_visible(int64_t pos) const {
    return sliding_window > 0 ? std::max<int64_t>(0, pos - sliding_window + 1) : 0;
  }
};

}  // namespace kvmetal
