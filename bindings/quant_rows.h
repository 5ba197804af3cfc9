// MLX affine quantization of one head row (head_dim values), the format of
// mx.quantize: value j of a row occupies bits [j*bits, (j+1)*bits) of the
// row's little-endian bit stream (uint32 words for 2/4/8 bits, byte packs of
// 3 or 5 bytes for 3/5/6 bits: the same stream), and each group of
// group_size values has a scale and a bias with  x ~= scale * q + bias.
#pragma once

#include <cstdint>

#include "float_convert.h"

namespace kvmetal {

struct QuantFormat {
  int bits = 0;        // 2, 3, 4, 5, 6 or 8
  int group_size = 0;  // 32, 64 or 128
  FloatKind scale_kind = FloatKind::f32;  // dtype of scales and biases
};

// out[d] = scale[g] * q[d] + bias[g] for d < D (g = d / group_size).
void dequantize_row(const uint32_t* words, const void* scales, const void* biases, const QuantFormat& fmt, int D,
                    float* out);

// Quantize x[0..D) like mx.quantize does for that row alone: words gets
// D * bits / 32 uint32, scales/biases get D / group_size values.
void quantize_row(const float* x, const QuantFormat& fmt, int D, uint32_t* words, void* scales, void* biases);

}  // namespace kvmetal
