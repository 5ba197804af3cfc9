// KVView: how the kernels see one K or V cache, float or quantized.
//
// Both cache layouts are addressed as (outer, head, row):
//   paged      [num_blocks, num_kv_heads, block_size, head_dim]  outer = block id
//   contiguous [B, num_kv_heads, T, head_dim]                    outer = batch entry
// with arbitrary element strides for the three leading axes (so a sliced view
// of a bigger cache is read in place) and unit stride along head_dim.
#pragma once

#include <cstdint>

#include "float_convert.h"
#include "quant_rows.h"
#include "tile_math.h"

namespace kvmetal {

struct KVView {
  int D = 0;                // head_dim (logical, dequantized)
  bool quantized = false;
  FloatKind kind = FloatKind::f32;  // element type of a float cache
  const char* data = nullptr;       // float elements, or packed uint32 words
  int64_t stride[3] = {0, 0, 0};    // in elements of `data` (words when quantized)
  // Quantized caches only: per-row scales and biases, their own strides.
  QuantFormat fmt;
  const char* scales = nullptr;
  const char* biases = nullptr;
  int64_t scale_stride[3] = {0, 0, 0};
  int64_t bias_stride[3] = {0, 0, 0};

  int64_t offset(const int64_t* s, int64_t outer, int64_t head, int64_t row) const {
    return outer * s[0] + head * s[1] + row * s[2];
  }

  // First element of a row of a float32 / float16 cache.
  const float* f32_row(int64_t outer, int head, int row) const {
    return reinterpret_cast<const float*>(data) + offset(stride, outer, head, row);
  }
  const uint16_t* u16_row(int64_t outer, int head, int row) const {
    return reinterpret_cast<const uint16_t*>(data) + offset(stride, outer, head, row);
  }

  // Where a row starts in memory, and how many bytes of `data` it spans
  // (the packed words of a quantized row; its scales are a few bytes more).
  const char* row_address(int64_t outer, int head, int row) const {
    return data + offset(stride, outer, head, row) * (quantized ? 4 : float_kind_size(kind));
  }
  int64_t row_bytes() const {
    return quantized ? static_cast<int64_t>(D) * fmt.bits / 8 : static_cast<int64_t>(D) * float_kind_size(kind);
  }

  // Rows from `row` on of an 8- or 4-bit cache, as the kernels that read codes in place see them.
  QuantRows quant_rows(int64_t outer, int head, int row) const {
    const int sz = float_kind_size(fmt.scale_kind);
    return {reinterpret_cast<const uint8_t*>(row_address(outer, head, row)), stride[2] * 4,
            scales + sz * offset(scale_stride, outer, head, row), scale_stride[2],
            biases + sz * offset(bias_stride, outer, head, row), bias_stride[2], fmt.scale_kind, fmt.group_size};
  }

  // Rows [row0, row0 + n) of (outer, head) as float32. float32 rows are read
  // where they are (no copy); other types are converted or dequantized into
  // `scratch` ([n, D]). *row_stride gets the distance between returned rows.
  const float* tile(int64_t outer, int head, int row0, int n, float* scratch, int64_t* row_stride,
                    const TileKernels& tk) const {
    if (quantized && tk.dequant_rows && (fmt.bits == 2 || fmt.bits == 4 || fmt.bits == 8) &&
        (fmt.group_size == 32 || fmt.group_size == 64 || fmt.group_size == 128) && D % 16 == 0) {
      tk.dequant_rows(reinterpret_cast<const uint32_t*>(data) + offset(stride, outer, head, row0), stride[2],
                      scales + float_kind_size(fmt.scale_kind) * offset(scale_stride, outer, head, row0),
                      scale_stride[2], biases + float_kind_size(fmt.scale_kind) * offset(bias_stride, outer, head, row0),
                      bias_stride[2], fmt.scale_kind, fmt.bits, fmt.group_size, n, D, scratch);
      *row_stride = D;
      return scratch;
    }
    if (quantized) {
      const int sz = float_kind_size(fmt.scale_kind);
      for (int r = 0; r < n; ++r) {
        const int64_t row = row0 + r;
        dequantize_row(reinterpret_cast<const uint32_t*>(data) + offset(stride, outer, head, row),
                       scales + sz * offset(scale_stride, outer, head, row),
                       biases + sz * offset(bias_stride, outer, head, row), fmt, D, scratch + r * D);
      }
      *row_stride = D;
      return scratch;
    }
    switch (kind) {
      case FloatKind::f32:
        *row_stride = stride[2];
        return reinterpret_cast<const float*>(data) + offset(stride, outer, head, row0);
      case FloatKind::f16:
        tk.f16_rows_to_f32(reinterpret_cast<const uint16_t*>(data) + offset(stride, outer, head, row0), stride[2], n,
                           D, scratch);
        break;
      default:
        tk.bf16_rows_to_f32(reinterpret_cast<const uint16_t*>(data) + offset(stride, outer, head, row0), stride[2], n,
                            D, scratch);
        break;
    }
    *row_stride = D;
    return scratch;
  }
};

}  // namespace kvmetal
