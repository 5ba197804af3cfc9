// One attention output row, written in the query's dtype: every CPU attention op
// (decode, varlen, cascade) accumulates in float32 and stores through this.
#pragma once

#include <algorithm>
#include <cstdint>

#include "float_convert.h"
#include "float_kind.h"
#include "tile_math.h"

namespace kvmetal {

// out[at .. at + D) = x, converted to `kind` (f32, f16 via the SIMD kernels, else bf16).
inline void store_output_row(const TileKernels& tk, FloatKind kind, const float* x, int D, char* out, int64_t at) {
  switch (kind) {
    case FloatKind::f32:
      std::copy(x, x + D, reinterpret_cast<float*>(out) + at);
      break;
    case FloatKind::f16:
      tk.f32_to_f16(x, D, reinterpret_cast<uint16_t*>(out) + at);
      break;
    default:
      for (int d = 0; d < D; ++d) reinterpret_cast<uint16_t*>(out)[at + d] = f32_to_bf16(x[d]);
      break;
  }
}

}  // namespace kvmetal
