// AVX-512F tile kernels (16 floats per register, 32 registers). Compiled alone
// with -mavx512f -mavx2 -mfma -mf16c (see CMakeLists.txt) and handed out only
// when __builtin_cpu_supports("avx512f") and head_dim % 16 == 0. On CPUs that
// have it this halves the FMA count of the attention loop, which is what
// bounds float16 decode on two cores.
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

void f16_rows(const uint16_t* src, int64_t stride, int n, int D, float* dst) {
  for (int r = 0; r < n; ++r) {
    const uint16_t* s = src + r * stride;
    float* o = dst + r * D;
    for (int d = 0; d < D; d += 16)
      _mm512_storeu_ps(o + d, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + d))));
  }
}

void bf16_rows(const uint16_t* src, int64_t stride, int n, int D, float* dst) {
  for (int r = 0; r < n; ++r) {
    const uint16_t* s = src + r * stride;
    float* o = dst + r * D;
    for (int d = 0; d < D; d += 16) {
      __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + d)));
      _mm512_storeu_ps(o + d, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
    }
  }
}

// 16 values of a K/V row as float32: float rows as they are, float16 rows
// (raw bits) widened in registers, so float16 caches need no scratch copy.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const Bf16* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

// Horizontal sums of 16 registers at once: lane 4c + p of the result is the
// sum of v[4p + c]. A transpose-and-add tree, 45 instructions instead of 16
// separate reductions (128).
__attribute__((always_inline)) inline __m512 hsum16(const __m512* v) {
  __m512 t[8], u[4], w[2];
  for (int i = 0; i < 8; ++i)
    t[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  for (int i = 0; i < 4; ++i)
    u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(t[2 * i], t[2 * i + 1], 0xDD));
  for (int i = 0; i < 2; ++i)
    w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44), _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88), _mm512_shuffle_ps(w[0], w[1], 0xDD));
}

// 4 heads x 4 rows: 16 accumulators, each K and q register used 4 times.
template <typename T>
void scores_4x4(const float* q, const T* k, int64_t stride, int D, float* out) {
  // The first step multiplies (the same as an FMA onto zero): zeroing the
  // array in a loop would let GCC turn it into a memset of a stack copy.
  __m512 acc[16];
  {
    __m512 kr[4];
    for (int r = 0; r < 4; ++r) kr[r] = load16(k + r * stride);
    for (int h = 0; h < 4; ++h) {
      __m512 qh = _mm512_loadu_ps(q + h * D);
      for (int r = 0; r < 4; ++r) acc[4 * h + r] = _mm512_mul_ps(qh, kr[r]);
    }
  }
  for (int d = 16; d < D; d += 16) {
    __m512 kr[4];
    for (int r = 0; r < 4; ++r) kr[r] = load16(k + r * stride + d);
    for (int h = 0; h < 4; ++h) {
      __m512 qh = _mm512_loadu_ps(q + h * D + d);
      for (int r = 0; r < 4; ++r) acc[4 * h + r] = _mm512_fmadd_ps(qh, kr[r], acc[4 * h + r]);
    }
  }
  alignas(64) float sums[16];
  _mm512_store_ps(sums, hsum16(acc));
  // acc index 4h + r  ->  lane 4r + h.
  for (int h = 0; h < 4; ++h)
    for (int r = 0; r < 4; ++r) out[h * kMaxTileRows + r] = sums[4 * r + h];
}

// Any head count, one row at a time (the leftovers of the 4x4 blocking).
template <int NH, typename T>
void scores_rows(const float* q, const T* k, int64_t stride, int r0, int n, int D, float* out) {
  for (int r = r0; r < n; ++r) {
    __m512 acc[NH];
    for (int h = 0; h < NH; ++h) acc[h] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
      __m512 kr = load16(k + r * stride + d);
      for (int h = 0; h < NH; ++h) acc[h] = _mm512_fmadd_ps(_mm512_loadu_ps(q + h * D + d), kr, acc[h]);
    }
    for (int h = 0; h < NH; ++h) out[h * kMaxTileRows + r] = _mm512_reduce_add_ps(acc[h]);
  }
}

template <typename T>
void scores_t(const float* q, int G, const T* k, int64_t stride, int n, int D, float* out) {
  int g = 0;
  for (; g + 4 <= G; g += 4) {
    int r = 0;
    for (; r + 4 <= n; r += 4) scores_4x4(q + g * D, k + r * stride, stride, D, out + g * kMaxTileRows + r);
    scores_rows<4, T>(q + g * D, k, stride, r, n, D, out + g * kMaxTileRows);
  }
  switch (G - g) {
    case 3: scores_rows<3, T>(q + g * D, k, stride, 0, n, D, out + g * kMaxTileRows); break;
    case 2: scores_rows<2, T>(q + g * D, k, stride, 0, n, D, out + g * kMaxTileRows); break;
    case 1: scores_rows<1, T>(q + g * D, k, stride, 0, n, D, out + g * kMaxTileRows); break;
    default: break;
  }
}

// NH heads x W registers of columns stay in registers while the rows stream.
template <int NH, int W, typename T>
void accumulate_cols(const float* p, const float* corr, const T* v, int64_t stride, int n, int D, int d,
                     float* acc) {
  __m512 a[NH][W];
  for (int h = 0; h < NH; ++h) {
    __m512 c = _mm512_set1_ps(corr[h]);
    for (int w = 0; w < W; ++w) a[h][w] = _mm512_mul_ps(_mm512_loadu_ps(acc + h * D + d + 16 * w), c);
  }
  for (int r = 0; r < n; ++r) {
    __m512 x[W];
    for (int w = 0; w < W; ++w) x[w] = load16(v + r * stride + d + 16 * w);
    for (int h = 0; h < NH; ++h) {
      __m512 ph = _mm512_set1_ps(p[h * kMaxTileRows + r]);
      for (int w = 0; w < W; ++w) a[h][w] = _mm512_fmadd_ps(ph, x[w], a[h][w]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int w = 0; w < W; ++w) _mm512_storeu_ps(acc + h * D + d + 16 * w, a[h][w]);
}

template <int NH, typename T>
void accumulate_heads(const float* p, const float* corr, const T* v, int64_t stride, int n, int D, float* acc) {
  int d = 0;
  for (; d + 64 <= D; d += 64) accumulate_cols<NH, 4, T>(p, corr, v, stride, n, D, d, acc);
  for (; d + 32 <= D; d += 32) accumulate_cols<NH, 2, T>(p, corr, v, stride, n, D, d, acc);
  for (; d < D; d += 16) accumulate_cols<NH, 1, T>(p, corr, v, stride, n, D, d, acc);
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

// Same polynomial as the AVX2 exp8 (about 2 ulp; NaN stays NaN; below -87.3 -> 0).
inline __m512 exp16(__m512 x) {
  const __m512 lo = _mm512_set1_ps(-87.3f);
  __mmask16 underflow = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_max_ps(lo, _mm512_min_ps(_mm512_set1_ps(88.3f), x));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 y = _mm512_set1_ps(1.9875691500e-4f);
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.3981999507e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(8.3334519073e-3f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(4.1665795894e-2f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(1.6666665459e-1f));
  y = _mm512_fmadd_ps(y, r, _mm512_set1_ps(5.0000001201e-1f));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  __m512i e = _mm512_slli_epi32(_mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~underflow), y);
}

void exp_inplace(float* x, int n) {
  int i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp16(_mm512_loadu_ps(x + i)));
  if (i < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(x + i, m, exp16(_mm512_maskz_loadu_ps(m, x + i)));
  }
}

void to_f16(const float* src, int n, uint16_t* dst) {
  int i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i), h);
  }
  for (; i < n; ++i) dst[i] = static_cast<uint16_t>(_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Vectorized along the tile's rows (masked past n); the G rescale factors
// share one exp call.
void softmax_update(float* scores, int G, int n, float* m, float* l, float* corr) {
  const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
  const __mmask16 m0 = n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1);
  const __mmask16 m1 = n <= 16 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << (n - 16)) - 1);
  for (int g = 0; g < G; ++g) {
    const float* sg = scores + g * kMaxTileRows;
    __m512 mx = _mm512_mask_loadu_ps(neg_inf, m0, sg);
    if (m1) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(neg_inf, m1, sg + 16));
    const float tile_max = _mm512_reduce_max_ps(mx);
    const float m_new = m[g] > tile_max ? m[g] : tile_max;
    // A row that has seen only masked (-inf) scores keeps m = -inf: exps are
    // then taken against 0 (all 0) instead of -inf - -inf = NaN.
    corr[g] = m[g] - (m_new == -__builtin_inff() ? 0.f : m_new);
    m[g] = m_new;
  }
  exp_inplace(corr, G);
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * kMaxTileRows;
    const __m512 mn = _mm512_set1_ps(m[g] == -__builtin_inff() ? 0.f : m[g]);
    __m512 e = _mm512_maskz_mov_ps(m0, exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(neg_inf, m0, sg), mn)));
    _mm512_mask_storeu_ps(sg, m0, e);
    __m512 sum = e;
    if (m1) {
      e = _mm512_maskz_mov_ps(m1, exp16(_mm512_sub_ps(_mm512_mask_loadu_ps(neg_inf, m1, sg + 16), mn)));
      _mm512_mask_storeu_ps(sg + 16, m1, e);
      sum = _mm512_add_ps(sum, e);
    }
    l[g] = l[g] * corr[g] + _mm512_reduce_add_ps(sum);
  }
}

inline float scale_at(const void* base, int64_t i, int kind) {
  if (kind == 0) return static_cast<const float*>(base)[i];
  const uint16_t bits = static_cast<const uint16_t*>(base)[i];
  if (kind == 1) return _cvtsh_ss(bits);
  return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(static_cast<int>(bits) << 16)));
}

// 16 values per step: lane i of a step takes word (i * BITS / 32) of the
// step's words and shifts it right by (i * BITS) % 32. Groups are >= 32
// values, so one scale and bias cover each step. Bit width and group size are
// template arguments so each group's steps unroll into straight-line code.
template <int BITS, int GS>
void dequant_rows_t(const uint32_t* words, int64_t word_stride, const void* scales, int64_t scale_stride,
                    const void* biases, int64_t bias_stride, int scale_kind, int n, int D, float* dst) {
  constexpr int kWordsPerStep = BITS / 2;  // 16 * BITS / 32
  const __m512i bit = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32(BITS));
  const __m512i vidx = _mm512_srli_epi32(bit, 5);
  const __m512i vshift = _mm512_and_si512(bit, _mm512_set1_epi32(31));
  // 2- and 4-bit values index a 16-entry table of their dequantized values
  // (vpermps reads only an index's low 4 bits, so no mask and no int->float
  // conversion); for 2 bits entry i holds level i & 3.
  const __m512i level = _mm512_and_si512(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                         _mm512_set1_epi32((1 << BITS) - 1));
  const __m512 levels = _mm512_cvtepi32_ps(level);
  for (int r = 0; r < n; ++r) {
    const uint32_t* w = words + r * word_stride;
    float* o = dst + static_cast<int64_t>(r) * D;
    for (int g = 0; g < D / GS; ++g, w += GS * BITS / 32, o += GS) {
      const __m512 sc = _mm512_set1_ps(scale_at(scales, r * scale_stride + g, scale_kind));
      const __m512 bi = _mm512_set1_ps(scale_at(biases, r * bias_stride + g, scale_kind));
      const __m512 table = _mm512_fmadd_ps(sc, levels, bi);  // used by 2/4 bits only
#pragma GCC unroll 8
      for (int step = 0; step < GS / 16; ++step) {
        if constexpr (BITS == 8) {  // one byte per value: a plain widening load
          const __m512i v =
              _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + step * kWordsPerStep)));
          _mm512_storeu_ps(o + 16 * step, _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(v), bi));
        } else {
          // Only the step's words matter: a narrow plain load, then the permute picks lanes.
          const __m128i raw = BITS == 4 ? _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + step * kWordsPerStep))
                                        : _mm_cvtsi32_si128(static_cast<int>(w[step * kWordsPerStep]));
          const __m512i v = _mm512_srlv_epi32(_mm512_permutexvar_epi32(vidx, _mm512_castsi128_si512(raw)), vshift);
          _mm512_storeu_ps(o + 16 * step, _mm512_permutexvar_ps(v, table));
        }
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

const TileKernels kAvx512{"avx512",      f16_rows,       bf16_rows,      scores,       accumulate,
                          exp_inplace,   softmax_update, dequant_rows,   scores_f16,   accumulate_f16,
                          scores_bf16,   accumulate_bf16, to_f16};

}  // namespace

const TileKernels& avx512_tile_kernels() { return kAvx512; }

}  // namespace kvmetal

#endif
