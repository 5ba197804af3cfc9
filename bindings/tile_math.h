// The float32 inner loops of decode attention, on a tile of KV rows.
//
// A tile is n <= 32 consecutive rows of one (block or batch entry, kv head),
// each row head_dim floats, rows `stride` floats apart. The attention loop
// converts (or dequantizes) a K or V tile to float32 once, then runs every
// query head of the group over it, so each row is read from memory once.
//
// Two implementations: a portable one (any compiler, any CPU; arm64 gets NEON
// from auto-vectorization, NEON being baseline there) and, on x86-64, an
// AVX2+FMA+F16C one and an AVX-512F one, each compiled in its own translation
// unit and chosen at run time with __builtin_cpu_supports, so the default build
// runs on any x86-64.
#pragma once

#include <cstdint>
#include <string>

#include "float_kind.h"

namespace kvmetal {

constexpr int kMaxTileRows = 32;

// Query rows quantized to int8 for scoring 8-bit K in integer arithmetic
// (query_q8.h fills it): per (query row j, group g) of group_size values,
// q ~= scale * qi with |qi| <= 127. Per-group arrays are kMaxQ8Groups apart.
constexpr int kMaxQ8Groups = 8;  // head_dim 256 / group size 32
struct QueryQ8 {
  const int8_t* qi;      // [rows, D]
  const float* scale;    // [rows, kMaxQ8Groups]: the group's scale
  const float* qi_sum;   // [rows, kMaxQ8Groups]: scale * sum(qi) of the group (times the K bias)
};

// n rows of an 8- or 4-bit MLX-affine cache: packed bytes, per-group scales and biases.
struct QuantRows {
  const uint8_t* bytes;
  int64_t byte_stride;
  const void* scales;
  int64_t scale_stride;
  const void* biases;
  int64_t bias_stride;
  FloatKind scale_kind;
  int group_size;  // 32, 64 or 128
};

struct TileKernels {
  const char* name;
  // dst[r * D + d] = float(src[r * stride + d]) for r < n, d < D.
  void (*f16_rows_to_f32)(const uint16_t* src, int64_t stride, int n, int D, float* dst);
  void (*bf16_rows_to_f32)(const uint16_t* src, int64_t stride, int n, int D, float* dst);
  // scores[g * kMaxTileRows + r] = dot(q[g * D ...], k[r * stride ...]) for g < G, r < n.
  void (*scores)(const float* q, int G, const float* k, int64_t stride, int n, int D, float* scores);
  // acc[g * D + d] = acc[g * D + d] * corr[g] + sum_r p[g * kMaxTileRows + r] * v[r * stride + d].
  void (*accumulate)(const float* p, const float* corr, int G, const float* v, int64_t stride, int n, int D,
                     float* acc);
  // x[i] = exp(x[i]) for i < n.
  void (*exp_inplace)(float* x, int n);
  // One online-softmax step for G heads over a tile of n scores each
  // (scores[g * kMaxTileRows + r]; entries past n may be overwritten):
  //   m_new = max(m[g], max_r s);  corr[g] = exp(m[g] - m_new);  s <- exp(s - m_new);
  //   l[g] = l[g] * corr[g] + sum_r s;  m[g] = m_new.
  void (*softmax_update)(float* scores, int G, int n, float* m, float* l, float* corr);
  // Dequantize n rows of an MLX-affine cache (bits 2, 4 or 8 only; null when
  // the implementation has none; group_size 32, 64 or 128):
  // dst[r * D + d] = scale * q + bias; scale_kind is the dtype of scales and biases.
  void (*dequant_rows)(const uint32_t* words, int64_t word_stride, const void* scales, int64_t scale_stride,
                       const void* biases, int64_t bias_stride, FloatKind scale_kind, int bits, int group_size, int n,
                       int D, float* dst);
  // As scores / accumulate, on float16 rows (raw bits) read in place and
  // widened in registers (null when the implementation has none).
  void (*scores_f16)(const float* q, int G, const uint16_t* k, int64_t stride, int n, int D, float* scores);
  void (*accumulate_f16)(const float* p, const float* corr, int G, const uint16_t* v, int64_t stride, int n, int D,
                         float* acc);
  // The same on bfloat16 rows (raw bits; widening is a 16-bit shift).
  void (*scores_bf16)(const float* q, int G, const uint16_t* k, int64_t stride, int n, int D, float* scores);
  void (*accumulate_bf16)(const float* p, const float* corr, int G, const uint16_t* v, int64_t stride, int n, int D,
                          float* acc);
  // dst[i] = float16/bfloat16 bits of src[i] (round to nearest even).
  void (*f32_to_f16)(const float* src, int n, uint16_t* dst);
  // Scores of G quantized query rows against n rows of 8-bit K, in integer
  // arithmetic: per group  s * qs * (qi . w) + b * qs * sum(qi)  (null when the
  // implementation has none: K is then dequantized and scored in float).
  // Layout of scores as in `scores`; D % 32 == 0 and D / group_size <= kMaxQ8Groups.
  void (*scores_k8)(const QueryQ8& q, int G, const QuantRows& k, int n, int D, float* scores);
  // Scores of G float query rows against n rows of 8-bit K read without
  // dequantizing them: per group  s * (q . w) + b * sum(q)  with w the raw
  // bytes widened to float, which is q . (s * w + b) regrouped (null when the
  // implementation has none). Layout as in `scores`; D % 16 == 0 and
  // D / group_size <= kMaxQ8Groups.
  void (*scores_u8)(const float* q, int G, const QuantRows& k, int n, int D, float* scores);
  // As accumulate, on n rows of 4-bit V read without dequantizing them:
  // per group  sum_r (p_r s_r) w_r + sum_r p_r b_r. acc is kept in nibble
  // order (nibble_order_to_natural below): every 16 columns, the 8 even ones
  // then the 8 odd ones, which is how one byte's two nibbles widen. Null when
  // the implementation has none; D % 16 == 0 and D / group_size <= kMaxQ8Groups.
  void (*accumulate_u4)(const float* p, const float* corr, int G, const QuantRows& v, int n, int D, float* acc);
};

// A row of D accumulators (D % 16 == 0) from nibble order back to column order.
inline void nibble_order_to_natural(float* row, int D) {
  for (int c = 0; c < D; c += 16) {
    float t[16];
    for (int j = 0; j < 8; ++j) {
      t[2 * j] = row[c + j];
      t[2 * j + 1] = row[c + 8 + j];
    }
    for (int j = 0; j < 16; ++j) row[c + j] = t[j];
  }
}

// The best implementation this CPU supports (chosen once) for head_dim D:
// avx512 needs D % 16 == 0, avx2 D % 8 == 0; anything else runs portable.
const TileKernels& tile_kernels(int D);

// The widest implementation this CPU supports (for reporting).
const TileKernels& best_tile_kernels();

// Use nothing wider than `name` ("portable", "avx2", "avx512") from now on;
// tests use it to check every implementation the CPU can run. False if unknown.
bool cap_tile_level(const std::string& name);

// Score 8-bit K against int8 queries (TileKernels::scores_k8) where the CPU
// has the kernel. Off by default: on AVX2 it measured about as fast as
// dequantizing K into float (docs/cpu.md) and adds the int8 query's error.
void set_int8_k_scores(bool on);
bool int8_k_scores();

#if defined(__x86_64__) || defined(_M_X64)
// Defined in tile_math_avx2.cpp; only call when the CPU has avx2, fma and f16c.
const TileKernels& avx2_tile_kernels();
// Defined in tile_math_avx512.cpp; only call when the CPU also has avx512f.
const TileKernels& avx512_tile_kernels();
#endif

}  // namespace kvmetal
