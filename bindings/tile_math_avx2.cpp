// AVX2 + FMA + F16C tile kernels. This file alone is compiled with
// -mavx2 -mfma -mf16c (see CMakeLists.txt) and its table is only handed out
// when __builtin_cpu_supports says the CPU has all three, so the rest of the
// library stays baseline x86-64. What it shares with the AVX-512 kernels is in
// tile_math_x86.h; here are the 8-lane register set and micro-kernels.
#if defined(__x86_64__) || defined(_M_X64)

#include "tile_math_x86.h"

namespace kvmetal {
namespace {

inline float hmax(__m256 v) {
  __m128 x = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  x = _mm_max_ps(x, _mm_movehl_ps(x, x));
  x = _mm_max_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
}

struct Avx2 {
  KVMETAL_X86_REGISTER_OPS(256)
  // NH (<= 4) heads x 3 column registers of accumulators, the 3 rows' values
  // and one broadcast weight fill the 16 registers.
  static constexpr int kMaxColumnRegs = 3;

  static __m128i load_half(const void* p) { return _mm_loadu_si128(static_cast<const __m128i*>(p)); }
  static void store_half(void* p, __m128i x) { _mm_storeu_si128(static_cast<__m128i*>(p), x); }
  // ((x0 + x1) + (x2 + x3)) + ((x4 + x5) + (x6 + x7)): the order of hsum8 and hsum4,
  // so a score has the same bits from the paired-row kernel (store_scores_4x2) and
  // from the one-row tail; with another order a row's score depended on whether a
  // tile gave it a partner, i.e. on its batch or chunk (tests/test_batch_invariance.py).
  static float hsum(Reg v) {
    const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(v, v), _mm256_hadd_ps(v, v));
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
  }
  static Reg round(Reg x) { return _mm256_round_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  // y, with 0 in the lanes where x < lo.
  static Reg zero_below(Reg x, Reg lo, Reg y) { return _mm256_andnot_ps(_mm256_cmp_ps(x, lo, _CMP_LT_OQ), y); }

  // One K row against NH query heads: s[h] holds head h's products summed
  // down to 8 lanes. Two accumulators per head (alternate 8-column steps)
  // give 2 * NH independent FMA chains, and each q load folds into its FMA
  // (no register holds q). DC is head_dim when fixed at compile time (0: D).
  template <int NH, int DC, typename T>
  __attribute__((always_inline)) static void row_dots(const float* q, const T* kr, int D, __m256* s) {
    const int Dn = DC ? DC : D;
    __m256 a0[NH], a1[NH];
    {
      const __m256 x = load(kr);
      for (int h = 0; h < NH; ++h) a0[h] = _mm256_mul_ps(_mm256_loadu_ps(q + h * Dn), x);
    }
    int d = 8;
    if (Dn >= 16) {
      const __m256 x = load(kr + 8);
      for (int h = 0; h < NH; ++h) a1[h] = _mm256_mul_ps(_mm256_loadu_ps(q + h * Dn + 8), x);
      d = 16;
    } else {
      for (int h = 0; h < NH; ++h) a1[h] = _mm256_setzero_ps();
    }
#pragma GCC unroll 16
    for (; d + 16 <= Dn; d += 16) {
      const __m256 x0 = load(kr + d), x1 = load(kr + d + 8);
      for (int h = 0; h < NH; ++h) {
        a0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * Dn + d), x0, a0[h]);
        a1[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * Dn + d + 8), x1, a1[h]);
      }
    }
    if (d < Dn) {  // D % 16 == 8
      const __m256 x = load(kr + d);
      for (int h = 0; h < NH; ++h) a0[h] = _mm256_fmadd_ps(_mm256_loadu_ps(q + h * Dn + d), x, a0[h]);
    }
    for (int h = 0; h < NH; ++h) s[h] = _mm256_add_ps(a0[h], a1[h]);
  }

  // NH query heads against rows [0, n) of the tile. Four heads go two rows at
  // a time into one 8-way horizontal sum whose lanes (2h, 2h + 1) are head h's
  // two scores, stored as one 8-byte pair.
  template <int NH, int DC, typename T>
  static void scores_heads_d(const float* q, const T* k, int64_t stride, int n, int D, float* out) {
    int r = 0;
    if constexpr (NH == 4) {
      for (; r + 2 <= n; r += 2) {
        __m256 s0[4], s1[4];
        row_dots<4, DC>(q, k + r * stride, D, s0);
        row_dots<4, DC>(q, k + (r + 1) * stride, D, s1);
        store_scores_4x2(s0, s1, out + r);
      }
    }
    for (; r < n; ++r) {
      __m256 s[NH];
      row_dots<NH, DC>(q, k + r * stride, D, s);
      for (int h = 0; h < NH; ++h) out[h * kMaxTileRows + r] = hsum(s[h]);
    }
  }

  // The common head sizes get their column loop unrolled at compile time.
  template <int NH, typename T>
  static void scores_heads(const float* q, const T* k, int64_t stride, int n, int D, float* out) {
    if (D == 128) scores_heads_d<NH, 128>(q, k, stride, n, D, out);
    else if (D == 64) scores_heads_d<NH, 64>(q, k, stride, n, D, out);
    else scores_heads_d<NH, 0>(q, k, stride, n, D, out);
  }

  // The tail goes through an 8-float buffer.
  static void exp_inplace(float* x, int n) {
    int i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(x + i, exp_approx<Avx2>(_mm256_loadu_ps(x + i)));
    if (i < n) {
      alignas(32) float tmp[8] = {0, 0, 0, 0, 0, 0, 0, 0};
      for (int j = i; j < n; ++j) tmp[j - i] = x[j];
      _mm256_store_ps(tmp, exp_approx<Avx2>(_mm256_load_ps(tmp)));
      for (int j = i; j < n; ++j) x[j] = tmp[j - i];
    }
  }

  // The softmax row passes: the rows past n are padded with -inf up to a
  // multiple of 8 by tile_max (max ignores them; exp_sum gives them 0).
  static float tile_max(float* s, int n) {
    const int n8 = (n + 7) & ~7;
    for (int r = n; r < n8; ++r) s[r] = -__builtin_inff();
    __m256 mx = _mm256_loadu_ps(s);
    for (int r = 8; r < n8; r += 8) mx = _mm256_max_ps(mx, _mm256_loadu_ps(s + r));
    return hmax(mx);
  }
  // s[r] = exp(s[r] - ref); returns their sum, added up in double: a float sum's
  // bits would depend on which lane each key falls in, i.e. on where the tile
  // starts (a sliding window's first tile starts at the window in one walker and at
  // a block boundary in another), and a row would round differently by chunk.
  static float exp_sum(float* s, int n, float ref) {
    const __m256 mn = _mm256_set1_ps(ref);
    __m256d sum = _mm256_setzero_pd();
    for (int r = 0; r < n; r += 8) {
      const __m256 e = exp_approx<Avx2>(_mm256_sub_ps(_mm256_loadu_ps(s + r), mn));
      _mm256_storeu_ps(s + r, e);
      sum = _mm256_add_pd(sum, _mm256_add_pd(_mm256_cvtps_pd(_mm256_castps256_ps128(e)),
                                             _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1))));
    }
    const __m128d h = _mm_add_pd(_mm256_castpd256_pd128(sum), _mm256_extractf128_pd(sum, 1));
    return static_cast<float>(_mm_cvtsd_f64(_mm_add_sd(h, _mm_unpackhi_pd(h, h))));
  }

  // One group of GS values, 8 per step (groups are >= 32 values): 8-bit values
  // widen from 8 bytes; 4- and 2-bit values are shifted out of one broadcast
  // word (of its low or high half for 2 bits) lane by lane.
  template <int BITS, int GS>
  __attribute__((always_inline)) static void dequant_group(const uint32_t* w, float scale, float bias, float* o) {
    const __m256i shift = _mm256_mullo_epi32(_mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), _mm256_set1_epi32(BITS));
    const __m256i mask = _mm256_set1_epi32((1 << BITS) - 1);
    const __m256 sc = _mm256_set1_ps(scale);
    const __m256 bi = _mm256_set1_ps(bias);
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
};

constexpr TileKernels kAvx2 = make_tile_kernels<Avx2>("avx2");

}  // namespace

const TileKernels& avx2_tile_kernels() { return kAvx2; }

}  // namespace kvmetal

#endif
