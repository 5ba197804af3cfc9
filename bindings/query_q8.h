// Query rows quantized to int8, once per decode work item, so 8-bit K can be
// scored in integer arithmetic (TileKernels::scores_k8). Each (row, group) of
// group_size values gets its own scale, qs = max|q| / 127, and qi = round(q / qs).
// Both terms of a group's score use the same qs * qi, so the score is exactly
// (qs * qi) . (s * w + b): the only error is that of qs * qi against q. (An
// exact float sum(q) in the bias term would not cancel: b * sum(q - qs * qi)
// with |b| up to the group's largest value, several times the error.)
#pragma once

#include <cstdint>
#include <vector>

#include "tile_math.h"

namespace kvmetal {

class QueryQ8Rows {
 public:
  // Quantize `rows` float rows of D values (rows D apart), groups of group_size.
  void quantize(const float* q, int rows, int D, int group_size);
  // The rows as the kernels read them.
  QueryQ8 view() const { return {qi_.data(), scale_.data(), qi_sum_.data()}; }

 private:
  std::vector<int8_t> qi_;
  std::vector<float> scale_, qi_sum_;
};

}  // namespace kvmetal
