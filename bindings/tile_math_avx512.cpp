// AVX-512F tile kernels (16 floats per register, 32 registers). Compiled alone
// with -mavx512f -mavx2 -mfma -mf16c (see CMakeLists.txt) and handed out only
// when __builtin_cpu_supports("avx512f") and head_dim % 16 == 0. On CPUs that
// have it this halves the FMA count of the attention loop, which is what
// bounds float16 decode on two cores. What it shares with the AVX2 kernels is
// in tile_math_x86.h; here are the 16-lane register set and micro-kernels.
#if defined(__x86_64__) || defined(_M_X64)

#include "tile_math_x86.h"

namespace kvmetal {
namespace {

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

struct Avx512 {
  KVMETAL_X86_REGISTER_OPS(512)
  // 32 registers: up to 4 heads x 4 column registers of accumulators.
  static constexpr int kMaxColumnRegs = 4;

  static __m256i load_half(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }
  static void store_half(void* p, __m256i x) { _mm256_storeu_si256(static_cast<__m256i*>(p), x); }
  static float hsum(Reg v) { return _mm512_reduce_add_ps(v); }
  static Reg round(Reg x) { return _mm512_roundscale_ps(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC); }
  static Reg zero_below(Reg x, Reg lo, Reg y) {
    return _mm512_maskz_mov_ps(static_cast<__mmask16>(~_mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ)), y);
  }

  // 4 heads x 4 rows: 16 accumulators, each K and q register used 4 times.
  template <typename T>
  static void scores_4x4(const float* q, const T* k, int64_t stride, int D, float* out) {
    // The first step multiplies (the same as an FMA onto zero): zeroing the
    // array in a loop would let GCC turn it into a memset of a stack copy.
    __m512 acc[16];
    {
      __m512 kr[4];
      for (int r = 0; r < 4; ++r) kr[r] = load(k + r * stride);
      for (int h = 0; h < 4; ++h) {
        __m512 qh = _mm512_loadu_ps(q + h * D);
        for (int r = 0; r < 4; ++r) acc[4 * h + r] = _mm512_mul_ps(qh, kr[r]);
      }
    }
    for (int d = 16; d < D; d += 16) {
      __m512 kr[4];
      for (int r = 0; r < 4; ++r) kr[r] = load(k + r * stride + d);
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

  // NH heads against the tile: four heads in 4x4 blocks of rows, then every
  // head count one row at a time (the leftovers of the blocking).
  template <int NH, typename T>
  static void scores_heads(const float* q, const T* k, int64_t stride, int n, int D, float* out) {
    int r = 0;
    if constexpr (NH == 4)
      for (; r + 4 <= n; r += 4) scores_4x4(q, k + r * stride, stride, D, out + r);
    scores_rows<Avx512, NH, T>(q, k, stride, r, n, D, out);
  }

  // The tail is a masked load and store.
  static void exp_inplace(float* x, int n) {
    int i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, exp_approx<Avx512>(_mm512_loadu_ps(x + i)));
    if (i < n) {
      const __mmask16 m = static_cast<__mmask16>((1u << (n - i)) - 1);
      _mm512_mask_storeu_ps(x + i, m, exp_approx<Avx512>(_mm512_maskz_loadu_ps(m, x + i)));
    }
  }

  // The softmax row passes, masked past n (n <= 32: two registers at most).
  static __mmask16 rows_mask(int n, int r0) {
    const int k = n - r0;
    return k >= 16 ? static_cast<__mmask16>(0xFFFF) : k <= 0 ? static_cast<__mmask16>(0) : static_cast<__mmask16>((1u << k) - 1);
  }
  static float tile_max(float* s, int n) {
    const __m512 neg_inf = _mm512_set1_ps(-__builtin_inff());
    __m512 mx = _mm512_mask_loadu_ps(neg_inf, rows_mask(n, 0), s);
    if (n > 16) mx = _mm512_max_ps(mx, _mm512_mask_loadu_ps(neg_inf, rows_mask(n, 16), s + 16));
    return _mm512_reduce_max_ps(mx);
  }
  // s[r] = exp(s[r] - ref) for r < n; returns their sum.
  static float exp_sum(float* s, int n, float ref) {
    const __m512 mn = _mm512_set1_ps(ref);
    __m512 sum = _mm512_setzero_ps();
    for (int r0 = 0; r0 < n; r0 += 16) {
      const __mmask16 m = rows_mask(n, r0);
      const __m512 e = _mm512_maskz_mov_ps(m, exp_approx<Avx512>(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + r0), mn)));
      _mm512_mask_storeu_ps(s + r0, m, e);
      sum = _mm512_add_ps(sum, e);
    }
    return _mm512_reduce_add_ps(sum);
  }

  // One group of GS values, 16 per step: lane i of a step takes word
  // (i * BITS / 32) of the step's words and shifts it right by (i * BITS) % 32.
  template <int BITS, int GS>
  __attribute__((always_inline)) static void dequant_group(const uint32_t* w, float scale, float bias, float* o) {
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
    const __m512 sc = _mm512_set1_ps(scale);
    const __m512 bi = _mm512_set1_ps(bias);
    const __m512 table = _mm512_fmadd_ps(sc, _mm512_cvtepi32_ps(level), bi);  // used by 2/4 bits only
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
};

constexpr TileKernels kAvx512 = make_tile_kernels<Avx512>("avx512");

}  // namespace

const TileKernels& avx512_tile_kernels() { return kAvx512; }

}  // namespace kvmetal

#endif
