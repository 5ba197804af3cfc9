#include "quant_rows.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

namespace kvmetal {
namespace {

// The row as bytes: MLX writes both its uint32 words and its 3/5-byte packs
// in little-endian order, so byte b of the row holds stream bits [8b, 8b+8).
inline const uint8_t* row_bytes(const uint32_t* words) { return reinterpret_cast<const uint8_t*>(words); }

// Values of a power-of-two bit width never straddle a byte... except 8 fits
// exactly, so both cases reduce to shifts within one byte.
template <int BITS>
inline void unpack_pow2(const uint8_t* bytes, int D, float* q) {
  constexpr int per_byte = 8 / BITS;
  constexpr uint32_t mask = (1u << BITS) - 1;
  for (int b = 0; b < D / per_byte; ++b) {
    uint32_t v = bytes[b];
    for (int k = 0; k < per_byte; ++k) q[b * per_byte + k] = static_cast<float>((v >> (k * BITS)) & mask);
  }
}

// 3, 5 and 6 bits: 8 (or 4 for 6 bits) values per pack of 3/5/3 bytes.
template <int BITS>
inline void unpack_packs(const uint8_t* bytes, int D, float* q) {
  constexpr int per_pack = BITS == 6 ? 4 : 8;
  constexpr int pack_bytes = per_pack * BITS / 8;
  constexpr uint64_t mask = (1u << BITS) - 1;
  for (int p = 0; p < D / per_pack; ++p) {
    uint64_t v = 0;
    for (int b = 0; b < pack_bytes; ++b) v |= static_cast<uint64_t>(bytes[p * pack_bytes + b]) << (8 * b);
    for (int k = 0; k < per_pack; ++k) q[p * per_pack + k] = static_cast<float>((v >> (k * BITS)) & mask);
  }
}

void unpack(const uint32_t* words, int bits, int D, float* q) {
  const uint8_t* bytes = row_bytes(words);
  switch (bits) {
    case 2: unpack_pow2<2>(bytes, D, q); break;
    case 4: unpack_pow2<4>(bytes, D, q); break;
    case 8: unpack_pow2<8>(bytes, D, q); break;
    case 3: unpack_packs<3>(bytes, D, q); break;
    case 5: unpack_packs<5>(bytes, D, q); break;
    default: unpack_packs<6>(bytes, D, q); break;
  }
}

}  // namespace

void dequantize_row(const uint32_t* words, const void* scales, const void* biases, const QuantFormat& fmt, int D,
                    float* out) {
  unpack(words, fmt.bits, D, out);
  for (int g = 0; g < D / fmt.group_size; ++g) {
    const float s = load_as_f32(scales, g, fmt.scale_kind);
    const float b = load_as_f32(biases, g, fmt.scale_kind);
    float* o = out + g * fmt.group_size;
    for (int j = 0; j < fmt.group_size; ++j) o[j] = s * o[j] + b;
  }
}

// The rule of MLX's affine quantizer (CPU and fallback alike): the group's
// extreme with the larger magnitude ("edge") is pinned to an exact level, so
// scale = edge / round(edge / scale0) and bias = edge; a zero-width group gets
// scale eps. Quantization uses the float32 scale/bias; only the stored copies
// are rounded to the scale dtype.
void quantize_row(const float* x, const QuantFormat& fmt, int D, uint32_t* words, void* scales, void* biases) {
  const float n_bins = static_cast<float>((1 << fmt.bits) - 1);
  const float eps = 1e-7f;
  const int n_words = D * fmt.bits / 32;
  std::memset(words, 0, sizeof(uint32_t) * n_words);
  uint8_t* bytes = reinterpret_cast<uint8_t*>(words);
  for (int g = 0; g < D / fmt.group_size; ++g) {
    const float* xg = x + g * fmt.group_size;
    float w_min = std::numeric_limits<float>::infinity();
    float w_max = -w_min;
    for (int j = 0; j < fmt.group_size; ++j) {
      w_max = std::max(w_max, xg[j]);
      w_min = std::min(w_min, xg[j]);
    }
    const bool min_is_edge = std::abs(w_min) > std::abs(w_max);
    float scale = std::max((w_max - w_min) / n_bins, eps);
    scale = min_is_edge ? scale : -scale;
    const float edge = min_is_edge ? w_min : w_max;
    const float q0 = std::rint(edge / scale);
    float bias = 0.f;
    if (q0 != 0.f) {
      scale = edge / q0;
      bias = edge;
    }
    for (int j = 0; j < fmt.group_size; ++j) {
      float q = std::rint((xg[j] - bias) / scale);
      q = std::min(std::max(q, 0.f), n_bins);
      // Scatter the value's bits into the little-endian stream.
      const int64_t bit = static_cast<int64_t>(g * fmt.group_size + j) * fmt.bits;
      const uint32_t v = static_cast<uint32_t>(q);
      for (int k = 0; k < fmt.bits; ++k) {
        if (v >> k & 1u) bytes[(bit + k) >> 3] |= static_cast<uint8_t>(1u << ((bit + k) & 7));
      }
    }
    store_from_f32(scales, g, scale, fmt.scale_kind);
    store_from_f32(biases, g, bias, fmt.scale_kind);
  }
}

}  // namespace kvmetal
