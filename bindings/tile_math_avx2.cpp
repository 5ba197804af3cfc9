// AVX2 + FMA + F16C tile kernels. This file alone is compiled with
// -mavx2 -mfma -mf16c (see CMakeLists.txt) and its table is only handed out
// when __builtin_cpu_supports says the CPU has all three, so the rest of the
// library stays baseline x86-64.
#if defined(__x86_64__) || defined(_M_X64)

#include <immintrin.h>

#include "tile_math.h"

namespace kvmetal {
namespace {

// bfloat16 raw bits, a distinct type so the templated kernels pick the
// bfloat16 widening load.
struct Bf16 {
  uint16_t bits;
};

inline float hsum(__m256 v) {
  __m128 lo = _mm256_castps256_ps128(v);
  __m128 hi = _mm256_extractf128_ps(v, 1);
  lo = _mm_add_ps(lo, hi);
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
  return _mm_cvtss_f32(lo);
}

void f16_rows(const uint16_t* src, int64_t stride, int n, int D, float* dst) {
  for (int r = 0; r < n; ++r) {
    const uint16_t* s = src + r * stride;
    float* o = dst + r * D;
    for (int d = 0; d < D; d += 8) {
      _mm256_storeu_ps(o + d, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + d))));
    }
  }
}

void bf16_rows(const uint16_t* src, int64_t stride, int n, int D, float* dst) {
  for (int r = 0; r < n; ++r) {
    const uint16_t* s = src + r * stride;
    float* o = dst + r * D;
    for (int d = 0; d < D; d += 8) {
      __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(s + d)));
      _mm256_storeu_ps(o + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
    }
  }
}

// Horizontal sums of 8 registers at once: lane i of the result is the sum of
// v[i] (21 uops instead of 8 separate reductions' 48).
inline __m256 hsum8(const __m256* v) {
  const __m256 t0 = _mm256_hadd_ps(v[0], v[1]), t1 = _mm256_hadd_ps(v[2], v[3]);
  const __m256 t2 = _mm256_hadd_ps(v[4], v[5]), t3 = _mm256_hadd_ps(v[6], v[7]);
  const __m256 u0 = _mm256_hadd_ps(t0, t1), u1 = _mm256_hadd_ps(t2, t3);
  // u0 = [s0 s1 s2 s3 | s0' s1' s2' s3'] (low/high 128-bit halves of v0..v3), u1 likewise for v4..v7.
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// 8 values of a K/V row as float32 (float16 raw bits widened in registers).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline __m256 load8(const Bf16* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

// NH query heads against the tile, two rows at a time (2 * NH independent
// accumulators keep both FMA ports busy).
template <int NH, typename T>
void scores_heads(const float* q, const T* k, int64_t stride, int n, int D, float* out) {
  int r = 0;
  for (; r + 2 <= n; r += 2) {
    const T* k0 = k + r * stride;
    const T* k1 = k0 + stride;
    __m256 a0[NH], a1[NH];
    for (int h = 0; h < NH; ++h) a0[h] = a1[h] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
      __m256 x0 = load8(k0 + d);
      __m256 x1 = load8(k1 + d);
      for (int h = 0; h < NH; ++h) {
        __m256 qh = _mm256_loadu_ps(q + h * D + d);
        a0[h] = _mm256_fmadd_ps(qh, x0, a0[h]);
        a1[h] = _mm256_fmadd_ps(qh, x1, a1[h]);
      }
    }
    if constexpr (NH == 4) {
      // All 8 sums at once: lane 2h + j holds row r + j of head h.
      __m256 v[8] = {a0[0], a1[0], a0[1], a1[1], a0[2], a1[2], a0[3], a1[3]};
      alignas(32) float sums[8];
      _mm256_store_ps(sums, hsum8(v));
      for (int h = 0; h < 4; ++h) {
        out[h * kMaxTileRows + r] = sums[2 * h];
        out[h * kMaxTileRows + r + 1] = sums[2 * h + 1];
      }
    } else {
      for (int h = 0; h < NH; ++h) {
        out[h * kMaxTileRows + r] = hsum(a0[h]);
        out[h * kMaxTileRows + r + 1] = hsum(a1[h]);
      }
    }
  }
  if (r < n) {
    const T* k0 = k + r * stride;
    __m256 a0[NH];
    for (int h = 0; h < NH; ++h) a0[h] = _mm256_setzero_ps();
    for (int d = 0; d < D; d += 8) {
      __m256 x0 = load8(k0 + d);
      for (int h = 0; h < NH; ++h) a0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), x0, a0[h]);
    }
    for (int h = 0; h < NH; ++h) out[h * kMaxTileRows + r] = hsum(a0[h]);
  }
}

template <typename T>
void scores_t(const float* q, int G, const T* k, int64_t stride, int n, int D, float* out) {
  int g = 0;
  for (; g + 4 <= G; g += 4) scores_heads<4, T>(q + g * D, k, stride, n, D, out + g * kMaxTileRows);
  switch (G - g) {
    case 3: scores_heads<3, T>(q + g * D, k, stride, n, D, out + g * kMaxTileRows); break;
    case 2: scores_heads<2, T>(q + g * D, k, stride, n, D, out + g * kMaxTileRows); break;
    case 1: scores_heads<1, T>(q + g * D, k, stride, n, D, out + g * kMaxTileRows); break;
    default: break;
  }
}

// NH heads' accumulators for W * 8 columns stay in registers while the tile's
// rows stream through.
template <int NH, int W, typename T>
void accumulate_cols(const float* p, const float* corr, const T* v, int64_t stride, int n, int D, int d,
                     float* acc) {
  __m256 a[NH][W];
  for (int h = 0; h < NH; ++h) {
    __m256 c = _mm256_set1_ps(corr[h]);
    for (int w = 0; w < W; ++w) a[h][w] = _mm256_mul_ps(_mm256_loadu_ps(acc + h * D + d + 8 * w), c);
  }
  for (int r = 0; r < n; ++r) {
    __m256 x[W];
    for (int w = 0; w < W; ++w) x[w] = load8(v + r * stride + d + 8 * w);
    for (int h = 0; h < NH; ++h) {
      __m256 ph = _mm256_broadcast_ss(p + h * kMaxTileRows + r);
      for (int w = 0; w < W; ++w) a[h][w] = _mm256_fmadd_ps(ph, x[w], a[h][w]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(acc + h * D + d + 8 * w, a[h][w]);
}

template <int NH, typename T>
void accumulate_heads(const float* p, const float* corr, const T* v, int64_t stride, int n, int D, float* acc) {
  int d = 0;
  for (; d + 16 <= D; d += 16) accumulate_cols<NH, 2, T>(p, corr, v, stride, n, D, d, acc);
  if (d < D) accumulate_cols<NH, 1, T>(p, corr, v, stride, n, D, d, acc);
}

template <typename T>
void accumulate_t(const float* p, const float* corr, int G, const T* v, int64_t stride, int n, int D, float* acc) {
  int g = 0;
  for (; g + 4 <= G; g += 4)
    accumulate_heads<4, T>(p + g * kMaxTileRows, corr + g, v, stride, n, D, acc + g * D);
  switch (G - g) {
    case 3: accumulate_heads<3, T>(p + g * kMaxTileRows, corr + g, v, stride, n, D, acc + g * D); break;
    case 2: accumulate_heads<2, T>(p + g * kMaxTileRows, corr + g, v, stride, n, D, acc + g * D); break;
    case 1: accumulate_heads<1, T>(p + g * kMaxTileRows, corr + g, v, stride, n, D, acc + g * D); break;
    default: break;
  }
}

void scores(const float* q, int G, const float* k, int64_t stride, int n, int D, float* out) {
  scores_t(q, G, k, stride, n, D, out);
}
void scores_f16(const float* q, int G, const uint16_t* k, int64_t stride, int n, int D, float* out) {
  scores_t(q, G, k, stride, n, D, out);
}
void accumulate(const float* p, const float* corr, int G, const float* v, int64_t stride, int n, int D, float* acc) {
  accumulate_t(p, corr, G, v, stride, n, D, acc);
}
void accumulate_f16(const float* p, const float* corr, int G, const uint16_t* v, int64_t stride, int n, int D,
                    float* acc) {
  accumulate_t(p, corr, G, v, stride, n, D, acc);
}
void scores_bf16(const float* q, int G, const uint16_t* k, int64_t stride, int n, int D, float* out) {
  scores_t(q, G, reinterpret_cast<const Bf16*>(k), stride, n, D, out);
}
void accumulate_bf16(const float* p, const float* corr, int G, const uint16_t* v, int64_t stride, int n, int D,
                     float* acc) {
  accumulate_t(p, corr, G, reinterpret_cast<const Bf16*>(v), stride, n, D, acc);
}

// exp(x) to about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2, a degree-6
// polynomial for exp(r), and 2^n built in the exponent bits. Inputs below
// -87.3 flush to 0 (the softmax only ever feeds x <= 0).
inline __m256 exp8(__m256 x) {
  const __m256 lo = _mm256_set1_ps(-87.3f);
  __m256 underflow = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  // Operand order keeps a NaN input NaN (min/max return the second operand).
  x = _mm256_max_ps(lo, _mm256_min_ps(_mm256_set1_ps(88.3f), x));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(underflow, y);
}

void exp_inplace(float* x, int n) {
  int i = 0;
  for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp8(_mm256_loadu_ps(x + i)));
  if (i < n) {
    alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int j = i; j < n; ++j) tmp[j - i] = x[j];
    _mm256_store_ps(tmp, exp8(_mm256_load_ps(tmp)));
    for (int j = i; j < n; ++j) x[j] = tmp[j - i];
  }
}

void to_f16(const float* src, int n, uint16_t* dst) {
  int i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = static_cast<uint16_t>(_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

inline float hmax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

// Vectorized along the tile's rows; the rows past n are padded with -inf
// (exp gives 0, max ignores them). The G rescale factors share one exp call.
void softmax_update(float* scores, int G, int n, float* m, float* l, float* corr) {
  const int n8 = (n + 7) & ~7;
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * kMaxTileRows;
    for (int r = n; r < n8; ++r) sg[r] = -__builtin_inff();
    __m256 mx = _mm256_loadu_ps(sg);
    for (int r = 8; r < n8; r += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(sg + r));
    const float m_new = m[g] > hmax(mx) ? m[g] : hmax(mx);
    // A row that has seen only masked (-inf) scores keeps m = -inf: exps are
    // then taken against 0 (all 0) instead of -inf - -inf = NaN.
    corr[g] = m[g] - (m_new == -__builtin_inff() ? 0.f : m_new);
    m[g] = m_new;
  }
  exp_inplace(corr, G);
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * kMaxTileRows;
    const __m256 mn = _mm256_set1_ps(m[g] == -__builtin_inff() ? 0.f : m[g]);
    __m256 sum = _mm256_setzero_ps();
    for (int r = 0; r < n8; r += 8) {
      __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + r), mn));
      _mm256_storeu_ps(sg + r, e);
      sum = _mm256_add_ps(sum, e);
    }
    l[g] = l[g] * corr[g] + hsum(sum);
  }
}

inline float scale_at(const void* base, int64_t i, int kind) {
  if (kind == 0) return static_cast<const float*>(base)[i];
  const uint16_t bits = static_cast<const uint16_t*>(base)[i];
  if (kind == 1) return _cvtsh_ss(bits);
  return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(static_cast<int>(bits) << 16)));
}

// 8 values per step, one scale and bias per group (groups are >= 32 values):
// 8-bit values widen from 8 bytes; 4- and 2-bit values are shifted out of one
// broadcast word (of its low or high half for 2 bits) lane by lane.
template <int BITS, int GS>
void dequant_rows_t(const uint32_t* words, int64_t word_stride, const void* scales, int64_t scale_stride,
                    const void* biases, int64_t bias_stride, int scale_kind, int n, int D, float* dst) {
  const __m256i shift = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(BITS));
  const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
  for (int r = 0; r < n; ++r) {
    const uint32_t* w = words + r * word_stride;
    float* o = dst + static_cast<int64_t>(r) * D;
    for (int g = 0; g < D / GS; ++g, w += GS * BITS / 32, o += GS) {
      const __m256 sc = _mm256_set1_ps(scale_at(scales, r * scale_stride + g, scale_kind));
      const __m256 bi = _mm256_set1_ps(scale_at(biases, r * bias_stride + g, scale_kind));
#pragma GCC unroll 16
      for (int step = 0; step < GS / 8; ++step) {
        __m256i v;
        if constexpr (BITS == 8) {
          v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + 2 * step)));
        } else if constexpr (BITS == 4) {
          v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(w[step])), shift), mask);
        } else {
          const uint32_t half = w[step / 2] >> (16 * (step % 2));
          v = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int>(half)), shift), mask);
        }
        _mm256_storeu_ps(o + 8 * step, _mm256_fmadd_ps(sc, _mm256_cvtepi32_ps(v), bi));
      }
    }
  }
}

template <int BITS>
void dequant_rows_bits(const uint32_t* words, int64_t word_stride, const void* scales, int64_t scale_stride,
                       const void* biases, int64_t bias_stride, int scale_kind, int group_size, int n, int D,
                       float* dst) {
  switch (group_size) {
    case 32: dequant_rows_t<BITS, 32>(words, word_stride, scales, scale_stride, biases, bias_stride, scale_kind, n, D, dst); break;
    case 64: dequant_rows_t<BITS, 64>(words, word_stride, scales, scale_stride, biases, bias_stride, scale_kind, n, D, dst); break;
    default: dequant_rows_t<BITS, 128>(words, word_stride, scales, scale_stride, biases, bias_stride, scale_kind, n, D, dst); break;
  }
}

void dequant_rows(const uint32_t* words, int64_t word_stride, const void* scales, int64_t scale_stride,
                  const void* biases, int64_t bias_stride, int scale_kind, int bits, int group_size, int n, int D,
                  float* dst) {
  switch (bits) {
    case 8: dequant_rows_bits<8>(words, word_stride, scales, scale_stride, biases, bias_stride, scale_kind, group_size, n, D, dst); break;
    case 4: dequant_rows_bits<4>(words, word_stride, scales, scale_stride, biases, bias_stride, scale_kind, group_size, n, D, dst); break;
    default: dequant_rows_bits<2>(words, word_stride, scales, scale_stride, biases, bias_stride, scale_kind, group_size, n, D, dst); break;
  }
}

const TileKernels kAvx2{"avx2",      f16_rows,       bf16_rows, scores,     accumulate,     exp_inplace,
                        softmax_update, dequant_rows, scores_f16, accumulate_f16, scores_bf16, accumulate_bf16, to_f16};

}  // namespace

const TileKernels& avx2_tile_kernels() { return kAvx2; }

}  // namespace kvmetal

#endif
