// Merging float32 partial softmax states of one query row: each partial (a KV
// split, or a cascade's prefix and own tokens) holds its running max m, its sum
// l and its unnormalized accumulator acc[D]. Shared by the decode, varlen and
// cascade reductions.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>

namespace kvmetal {

// The running max of a row that has seen nothing.
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// out[0, D) = the normalized merge of the partials for_each(f) visits, calling
// f(m, l, acc) once per partial; a sink logit (if given) joins the denominator.
// A row that no partial saw (every l == 0) comes out as zeros, sink or not.
template <typename ForEach>
inline void merge_partials(ForEach&& for_each, int D, const float* sink, float* out) {
  float M = kNegInf;
  for_each([&](float m, float l, const float*) {
    if (l > 0.f) M = std::max(M, m);
  });
  if (sink) M = std::max(M, *sink);
  std::fill(out, out + D, 0.f);
  float L = 0.f;
  for_each([&](float m, float l, const float* acc) {
    if (l == 0.f) return;  // a partial that saw nothing
    const float w = std::exp(m - M);
    L += l * w;
    for (int d = 0; d < D; ++d) out[d] += acc[d] * w;
  });
  const bool seen = L > 0.f;
  if (sink) L += std::exp(*sink - M);
  const float inv = seen ? 1.f / L : 0.f;
  for (int d = 0; d < D; ++d) out[d] *= inv;
}

}  // namespace kvmetal
