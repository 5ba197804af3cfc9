#include "query_q8.h"

#include <algorithm>
#include <cmath>

namespace kvmetal {

void QueryQ8Rows::quantize(const float* q, int rows, int D, int group_size) {
  const size_t values = static_cast<size_t>(rows) * D;
  const size_t groups = static_cast<size_t>(rows) * kMaxQ8Groups;
  qi_.resize(values);
  // Groups past D / group_size stay 0: the kernels read all kMaxQ8Groups lanes.
  scale_.assign(groups, 0.f);
  qi_sum_.assign(groups, 0.f);
  for (int j = 0; j < rows; ++j) {
    for (int g = 0; g < D / group_size; ++g) {
      const int64_t first = static_cast<int64_t>(j) * D + g * group_size;
      const float* x = q + first;
      float amax = 0.f;
      bool finite = true;
      for (int i = 0; i < group_size; ++i) {
        amax = std::max(amax, std::fabs(x[i]));
        finite &= std::isfinite(x[i]);
      }
      // A zero group gets qs = 0 (qi = 0). So does a non-finite one, whose
      // scores are made NaN (as they would be in float) through qi_sum.
      const float qs = finite && amax > 0.f ? amax / 127.f : 0.f;
      const float inv = qs > 0.f ? 1.f / qs : 0.f;
      int isum = 0;
      for (int i = 0; i < group_size; ++i) {
        const float r = std::nearbyint(x[i] * inv);
        const int v = r > 127.f ? 127 : r < -127.f ? -127 : r == r ? static_cast<int>(r) : 0;  // NaN -> 0
        qi_[first + i] = static_cast<int8_t>(v);
        isum += v;
      }
      const size_t at = static_cast<size_t>(j) * kMaxQ8Groups + g;
      scale_[at] = qs;
      qi_sum_[at] = finite ? qs * static_cast<float>(isum) : __builtin_nanf("");
    }
  }
}

}  // namespace kvmetal
