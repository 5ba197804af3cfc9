// Scalar conversions between float32 and the 16-bit float storage formats.
// Rows are handled as raw uint16_t bits; MLX's own half types do the rounding
// (round to nearest even, NaN preserved), so we match what MLX's astype does.
#pragma once

#include <cstdint>
#include <cstring>

#include "float_kind.h"
#include "mlx/types/half_types.h"

namespace kvmetal {

inline float f16_to_f32(uint16_t bits) {
  mlx::core::float16_t h;
  std::memcpy(&h, &bits, 2);
  return static_cast<float>(h);
}

inline uint16_t f32_to_f16(float x) {
  mlx::core::float16_t h(x);
  uint16_t bits;
  std::memcpy(&bits, &h, 2);
  return bits;
}

// bf16 is the top half of a float32: widening is a shift.
inline float bf16_to_f32(uint16_t bits) {
  uint32_t w = static_cast<uint32_t>(bits) << 16;
  float x;
  std::memcpy(&x, &w, 4);
  return x;
}

inline uint16_t f32_to_bf16(float x) {
  mlx::core::bfloat16_t b(x);
  uint16_t bits;
  std::memcpy(&bits, &b, 2);
  return bits;
}

inline float load_as_f32(const void* base, int64_t i, FloatKind kind) {
  switch (kind) {
    case FloatKind::f32:
      return static_cast<const float*>(base)[i];
    case FloatKind::f16:
      return f16_to_f32(static_cast<const uint16_t*>(base)[i]);
    default:
      return bf16_to_f32(static_cast<const uint16_t*>(base)[i]);
  }
}

inline void store_from_f32(void* base, int64_t i, float x, FloatKind kind) {
  switch (kind) {
    case FloatKind::f32:
      static_cast<float*>(base)[i] = x;
      break;
    case FloatKind::f16:
      static_cast<uint16_t*>(base)[i] = f32_to_f16(x);
      break;
    default:
      static_cast<uint16_t*>(base)[i] = f32_to_bf16(x);
      break;
  }
}

inline int float_kind_size(FloatKind kind) { return kind == FloatKind::f32 ? 4 : 2; }

}  // namespace kvmetal
