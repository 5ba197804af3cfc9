// What the AVX2 and AVX-512 tile kernels share, written once over a register
// set V: a struct that tile_math_avx2.cpp and tile_math_avx512.cpp each define
// for their width, holding
//   - the float ops of KVMETAL_X86_REGISTER_OPS (Reg, kLanes, set1, load, fmadd ...);
//   - load_half, store_half, round, zero_below, hsum, and kMaxColumnRegs (the
//     widest column block of accumulate);
//   - the micro-kernels, which differ between widths on purpose:
//     scores_heads<NH, T>, dequant_group<BITS, GS>, exp_inplace, and the
//     softmax row passes tile_max and exp_sum.
// make_tile_kernels<V>(name) builds the TileKernels table from them.
//
// Include this only from those two files. Everything here is in an anonymous
// namespace: each file compiles it with its own -m flags, and under LTO a
// symbol with external linkage defined in both could resolve to the AVX-512
// copy for the AVX2 path too (SIGILL on a CPU without AVX-512).
#pragma once

#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "tile_math_x86.h is for the AVX2 / AVX-512 translation units (-mavx2 -mfma -mf16c)"
#endif

#include <immintrin.h>

#include <cstdint>
#include <iterator>
#include <type_traits>

#include "tile_math.h"

// The register ops whose intrinsics differ between the widths only in their
// _mm256 / _mm512 prefix and __m256 / __m512 type; a register set expands this
// with W = 256 or 512. The 16-bit loads and stores use the register set's
// load_half / store_half (kLanes 16-bit values: half a register).
#define KVMETAL_X86_REGISTER_OPS(W)                                                         \
  using Reg = __m##W;                                                                       \
  static constexpr int kLanes = W / 32;                                                     \
  static Reg set1(float x) { return _mm##W##_set1_ps(x); }                                  \
  static Reg load(const float* p) { return _mm##W##_loadu_ps(p); }                          \
  static void store(float* p, Reg x) { _mm##W##_storeu_ps(p, x); }                          \
  static Reg add(Reg a, Reg b) { return _mm##W##_add_ps(a, b); }                            \
  static Reg mul(Reg a, Reg b) { return _mm##W##_mul_ps(a, b); }                            \
  static Reg min(Reg a, Reg b) { return _mm##W##_min_ps(a, b); }                            \
  static Reg max(Reg a, Reg b) { return _mm##W##_max_ps(a, b); }                            \
  static Reg fmadd(Reg a, Reg b, Reg c) { return _mm##W##_fmadd_ps(a, b, c); }              \
  static Reg fnmadd(Reg a, Reg b, Reg c) { return _mm##W##_fnmadd_ps(a, b, c); }            \
  /* kLanes float16 (raw bits) or bfloat16 values, widened; kLanes float16 values, narrowed. */ \
  static Reg load(const uint16_t* p) { return _mm##W##_cvtph_ps(load_half(p)); }             \
  static Reg load(const Bf16* p) {                                                          \
    return _mm##W##_castsi##W##_ps(_mm##W##_slli_epi32(_mm##W##_cvtepu16_epi32(load_half(p)), 16)); \
  }                                                                                         \
  static void store_f16(uint16_t* p, Reg x) {                                               \
    store_half(p, _mm##W##_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));      \
  }                                                                                         \
  /* 2^n for whole numbers n in the normal exponent range, built in the exponent bits. */  \
  static Reg exp2i(Reg n) {                                                                 \
    const auto e = _mm##W##_add_epi32(_mm##W##_cvtps_epi32(n), _mm##W##_set1_epi32(127));   \
    return _mm##W##_castsi##W##_ps(_mm##W##_slli_epi32(e, 23));                             \
  }

namespace kvmetal {
namespace {

// bfloat16 raw bits, a distinct type so the templated kernels pick the
// bfloat16 widening load.
struct Bf16 {
  uint16_t bits;
};

// Entry i of a quantized cache's scales or biases, as float32.
inline float scale_at(const void* base, int64_t i, FloatKind kind) {
  if (kind == FloatKind::f32) return static_cast<const float*>(base)[i];
  const uint16_t bits = static_cast<const uint16_t*>(base)[i];
  if (kind == FloatKind::f16) return _cvtsh_ss(bits);
  return _mm_cvtss_f32(_mm_castsi128_ps(_mm_cvtsi32_si128(static_cast<int>(bits) << 16)));
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

// Scores of 4 heads for 2 rows: s0[h] / s1[h] hold head h's products for
// rows 0 / 1 (summed down to 8 lanes). One 8-way horizontal sum puts head h's
// two scores in lanes 2h, 2h + 1, stored as one 8-byte pair at out[h * kMaxTileRows].
__attribute__((always_inline)) inline void store_scores_4x2(const __m256* s0, const __m256* s1, float* out) {
  const __m256 v[8] = {s0[0], s1[0], s0[1], s1[1], s0[2], s1[2], s0[3], s1[3]};
  const __m256 t = hsum8(v);
  const __m128 lo = _mm256_castps256_ps128(t), hi = _mm256_extractf128_ps(t, 1);
  _mm_storel_pi(reinterpret_cast<__m64*>(out), lo);
  _mm_storeh_pi(reinterpret_cast<__m64*>(out + kMaxTileRows), lo);
  _mm_storel_pi(reinterpret_cast<__m64*>(out + 2 * kMaxTileRows), hi);
  _mm_storeh_pi(reinterpret_cast<__m64*>(out + 3 * kMaxTileRows), hi);
}

// One tile of quantized rows: packed words and their scales and biases.
struct QuantTile {
  const uint32_t* words;
  int64_t word_stride;
  const void* scales;
  int64_t scale_stride;
  const void* biases;
  int64_t bias_stride;
  FloatKind scale_kind;
};

// exp(x) to about 2 ulp: x = n ln2 + r with |r| <= ln2 / 2 (ln2 in a high part
// exact in float32 and a low part), a degree-6 polynomial for exp(r), and 2^n
// built in the exponent bits. Inputs below kExpMin flush to 0 (the softmax
// only ever feeds x <= 0); NaN stays NaN.
constexpr float kExpMin = -87.3f;
constexpr float kExpMax = 88.3f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
// Horner coefficients of (exp(r) - 1 - r) / r^2, highest degree first.
constexpr float kExpPoly[] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                              4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

template <typename V>
inline typename V::Reg exp_approx(typename V::Reg x) {
  using Reg = typename V::Reg;
  const Reg lo = V::set1(kExpMin);
  const Reg in = x;
  // Operand order keeps a NaN input NaN (min/max return the second operand).
  x = V::max(lo, V::min(V::set1(kExpMax), x));
  const Reg n = V::round(V::mul(x, V::set1(kLog2e)));
  Reg r = V::fnmadd(n, V::set1(kLn2Hi), x);
  r = V::fnmadd(n, V::set1(kLn2Lo), r);
  Reg y = V::set1(kExpPoly[0]);
  for (size_t i = 1; i < std::size(kExpPoly); ++i) y = V::fmadd(y, r, V::set1(kExpPoly[i]));
  y = V::fmadd(y, V::mul(r, r), V::add(r, V::set1(1.f)));
  return V::zero_below(in, lo, V::mul(y, V::exp2i(n)));
}

// dst[r * D + d] = float(src[r * stride + d]); T is uint16_t (float16 bits) or Bf16.
template <typename V, typename T>
void rows_to_f32(const uint16_t* src, int64_t stride, int n, int D, float* dst) {
  const T* s = reinterpret_cast<const T*>(src);
  for (int r = 0; r < n; ++r)
    for (int d = 0; d < D; d += V::kLanes) V::store(dst + r * D + d, V::load(s + r * stride + d));
}

template <typename V>
void to_f16(const float* src, int n, uint16_t* dst) {
  int i = 0;
  for (; i + V::kLanes <= n; i += V::kLanes) V::store_f16(dst + i, V::load(src + i));
  for (; i < n; ++i) dst[i] = static_cast<uint16_t>(_cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
}

// Calls f(std::integral_constant<int, NH>{}, g) over the G query heads in
// blocks of NH = 4 and one block of the 1-3 left over: a compile-time head
// count lets the micro-kernels keep their accumulators in registers.
template <typename F>
inline void over_head_blocks(int G, F&& f) {
  int g = 0;
  for (; g + 4 <= G; g += 4) f(std::integral_constant<int, 4>{}, g);
  switch (G - g) {
    case 3: f(std::integral_constant<int, 3>{}, g); break;
    case 2: f(std::integral_constant<int, 2>{}, g); break;
    case 1: f(std::integral_constant<int, 1>{}, g); break;
    default: break;
  }
}

// Scores of NH heads against rows [r0, n) of the tile, one row at a time (the
// rows a micro-kernel's row blocking leaves over).
template <typename V, int NH, typename T>
void scores_rows(const float* q, const T* k, int64_t stride, int r0, int n, int D, float* out) {
  for (int r = r0; r < n; ++r) {
    typename V::Reg acc[NH];
    for (int h = 0; h < NH; ++h) acc[h] = V::set1(0.f);
    for (int d = 0; d < D; d += V::kLanes) {
      const auto kr = V::load(k + r * stride + d);
      for (int h = 0; h < NH; ++h) acc[h] = V::fmadd(V::load(q + h * D + d), kr, acc[h]);
    }
    for (int h = 0; h < NH; ++h) out[h * kMaxTileRows + r] = V::hsum(acc[h]);
  }
}

template <typename V, typename T>
void scores_t(const float* q, int G, const T* k, int64_t stride, int n, int D, float* out) {
  over_head_blocks(G, [&](auto nh, int g) {
    V::template scores_heads<decltype(nh)::value, T>(q + g * D, k, stride, n, D, out + g * kMaxTileRows);
  });
}

// NH heads' accumulators for W registers of columns stay in registers while
// the tile's rows stream through.
template <typename V, int NH, int W, typename T>
void accumulate_cols(const float* p, const float* corr, const T* v, int64_t stride, int n, int D, int d,
                     float* acc) {
  constexpr int L = V::kLanes;
  typename V::Reg a[NH][W];
  for (int h = 0; h < NH; ++h) {
    const auto c = V::set1(corr[h]);
    for (int w = 0; w < W; ++w) a[h][w] = V::mul(V::load(acc + h * D + d + L * w), c);
  }
#pragma GCC unroll 2
  for (int r = 0; r < n; ++r) {
    typename V::Reg x[W];
    for (int w = 0; w < W; ++w) x[w] = V::load(v + r * stride + d + L * w);
    for (int h = 0; h < NH; ++h) {
      const auto ph = V::set1(p[h * kMaxTileRows + r]);
      for (int w = 0; w < W; ++w) a[h][w] = V::fmadd(ph, x[w], a[h][w]);
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int w = 0; w < W; ++w) V::store(acc + h * D + d + L * w, a[h][w]);
}

// Column blocks as wide as the register file allows (V::kMaxColumnRegs), then narrower ones.
template <typename V, int NH, typename T>
void accumulate_heads(const float* p, const float* corr, const T* v, int64_t stride, int n, int D, float* acc) {
  constexpr int L = V::kLanes;
  int d = 0;
  if constexpr (V::kMaxColumnRegs >= 4)
    for (; d + 4 * L <= D; d += 4 * L) accumulate_cols<V, NH, 4, T>(p, corr, v, stride, n, D, d, acc);
  if constexpr (V::kMaxColumnRegs == 3)
    for (; d + 3 * L <= D; d += 3 * L) accumulate_cols<V, NH, 3, T>(p, corr, v, stride, n, D, d, acc);
  for (; d + 2 * L <= D; d += 2 * L) accumulate_cols<V, NH, 2, T>(p, corr, v, stride, n, D, d, acc);
  for (; d < D; d += L) accumulate_cols<V, NH, 1, T>(p, corr, v, stride, n, D, d, acc);
}

template <typename V, typename T>
void accumulate_t(const float* p, const float* corr, int G, const T* v, int64_t stride, int n, int D, float* acc) {
  over_head_blocks(G, [&](auto nh, int g) {
    accumulate_heads<V, decltype(nh)::value, T>(p + g * kMaxTileRows, corr + g, v, stride, n, D, acc + g * D);
  });
}

// One online-softmax step (see TileKernels::softmax_update). V::tile_max and
// V::exp_sum are the vectorized row passes; the G rescale factors share one
// exp call.
template <typename V>
void softmax_update(float* scores, int G, int n, float* m, float* l, float* corr) {
  for (int g = 0; g < G; ++g) {
    const float tile_max = V::tile_max(scores + g * kMaxTileRows, n);
    const float m_new = m[g] > tile_max ? m[g] : tile_max;
    // A row that has seen only masked (-inf) scores keeps m = -inf: exps are
    // then taken against 0 (all 0) instead of -inf - -inf = NaN.
    corr[g] = m[g] - (m_new == -__builtin_inff() ? 0.f : m_new);
    m[g] = m_new;
  }
  V::exp_inplace(corr, G);
  for (int g = 0; g < G; ++g) {
    const float sum = V::exp_sum(scores + g * kMaxTileRows, n, m[g] == -__builtin_inff() ? 0.f : m[g]);
    l[g] = l[g] * corr[g] + sum;
  }
}

template <typename V>
void scores_bf16(const float* q, int G, const uint16_t* k, int64_t stride, int n, int D, float* out) {
  scores_t<V>(q, G, reinterpret_cast<const Bf16*>(k), stride, n, D, out);
}

template <typename V>
void accumulate_bf16(const float* p, const float* corr, int G, const uint16_t* v, int64_t stride, int n, int D,
                     float* acc) {
  accumulate_t<V>(p, corr, G, reinterpret_cast<const Bf16*>(v), stride, n, D, acc);
}

// n rows of a tile, group by group: V::dequant_group<BITS, GS>(words, scale,
// bias, out) writes one group's GS values.
template <typename V, int BITS, int GS>
void dequant_rows_t(const QuantTile& t, int n, int D, float* dst) {
  for (int r = 0; r < n; ++r) {
    const uint32_t* w = t.words + r * t.word_stride;
    float* o = dst + static_cast<int64_t>(r) * D;
    for (int g = 0; g < D / GS; ++g, w += GS * BITS / 32, o += GS) {
      const float scale = scale_at(t.scales, r * t.scale_stride + g, t.scale_kind);
      const float bias = scale_at(t.biases, r * t.bias_stride + g, t.scale_kind);
      V::template dequant_group<BITS, GS>(w, scale, bias, o);
    }
  }
}

// ---- 8-bit K in integer arithmetic (256-bit, shared by both tables: the
// AVX-512F table needs AVX-512BW for 512-bit byte multiplies, so it reuses these).
//
// maddubs multiplies unsigned by signed bytes and adds pairs into int16 with
// saturation: w (0..255) times qi (-127..127) could overflow a pair. So the
// words are made signed, w' = w - 128 (one xor), and their sign moves onto
// the query: |w'| * sign(qi, w') = qi * w', a pair at most 2 * 128 * 127 < 2^15
// (|w'| = 128 fits the unsigned operand; qi is never -128, so its negation is exact).
// Then qi . w = qi . w' + 128 * sum(qi), folded into the per-group constants.

// Scales or biases of one row's groups as float32, lanes past the groups untouched.
template <FloatKind KIND>
inline void row_floats(const void* base, int64_t first, int groups, float* out) {
  for (int g = 0; g < groups; ++g) out[g] = scale_at(base, first + g, KIND);
}

// Four registers' horizontal sums in lanes 0-3.
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1));
}

// NH query rows against rows [0, n) of K, one row at a time; GS = group size,
// KIND = dtype of the scales and biases.
template <int NH, int GS, FloatKind KIND>
void scores_k8_heads(const QueryQ8& q, int64_t j0, const QuantRows& k, int n, int D, float* out) {
  constexpr int kChunks = GS / 32;  // 32-byte chunks per group
  const int groups = D / GS;
  const __m256i flip = _mm256_set1_epi8(static_cast<char>(0x80));
  const __m256i ones = _mm256_set1_epi16(1);
  const int8_t* qi = q.qi + j0 * D;
  const float* qs = q.scale + j0 * kMaxQ8Groups;
  const float* qis = q.qi_sum + j0 * kMaxQ8Groups;
  // Per-group constants of each head: 128 * qs * sum(qi) (the unsigned offset)
  // and qs * sum(qi) (the bias), against the row's scales and biases.
  __m256 offset[NH], bias_w[NH];
  for (int h = 0; h < NH; ++h) {
    bias_w[h] = _mm256_loadu_ps(qis + h * kMaxQ8Groups);
    offset[h] = _mm256_mul_ps(bias_w[h], _mm256_set1_ps(128.f));
  }
  alignas(32) float sc[kMaxQ8Groups] = {}, bi[kMaxQ8Groups] = {};  // lanes past the groups stay 0
  for (int r = 0; r < n; ++r) {
    const uint8_t* w = k.bytes + r * k.byte_stride;
    row_floats<KIND>(k.scales, r * k.scale_stride, groups, sc);
    row_floats<KIND>(k.biases, r * k.bias_stride, groups, bi);
    const __m256 scv = _mm256_load_ps(sc), biv = _mm256_load_ps(bi);
    __m256 acc[4];
    for (int h = 0; h < NH; ++h) acc[h] = _mm256_fmadd_ps(scv, offset[h], _mm256_mul_ps(biv, bias_w[h]));
    for (int g = 0; g < groups; ++g) {
      __m256i isum[NH];
      for (int c = 0; c < kChunks; ++c) {
        const int d = (g * kChunks + c) * 32;
        const __m256i wv = _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + d)), flip);
        const __m256i wa = _mm256_abs_epi8(wv);
        for (int h = 0; h < NH; ++h) {
          const __m256i s = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qi + h * D + d)), wv);
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wa, s), ones);
          isum[h] = c ? _mm256_add_epi32(isum[h], p) : p;
        }
      }
      const __m256 sg = _mm256_set1_ps(sc[g]);
      for (int h = 0; h < NH; ++h)
        acc[h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[h]), _mm256_mul_ps(sg, _mm256_set1_ps(qs[h * kMaxQ8Groups + g])),
                                 acc[h]);
    }
    for (int h = NH; h < 4; ++h) acc[h] = _mm256_setzero_ps();
    alignas(16) float sums[4];
    _mm_store_ps(sums, hsum4(acc[0], acc[1], acc[2], acc[3]));
    for (int h = 0; h < NH; ++h) out[h * kMaxTileRows + r] = sums[h];
  }
}

template <int GS, FloatKind KIND>
void scores_k8_kind(const QueryQ8& q, int G, const QuantRows& k, int n, int D, float* out) {
  over_head_blocks(G, [&](auto nh, int g) {
    scores_k8_heads<decltype(nh)::value, GS, KIND>(q, g, k, n, D, out + g * kMaxTileRows);
  });
}

template <int GS>
void scores_k8_gs(const QueryQ8& q, int G, const QuantRows& k, int n, int D, float* out) {
  switch (k.scale_kind) {
    case FloatKind::f32: scores_k8_kind<GS, FloatKind::f32>(q, G, k, n, D, out); break;
    case FloatKind::f16: scores_k8_kind<GS, FloatKind::f16>(q, G, k, n, D, out); break;
    default: scores_k8_kind<GS, FloatKind::bf16>(q, G, k, n, D, out); break;
  }
}


void scores_k8(const QueryQ8& q, int G, const QuantRows& k, int n, int D, float* out) {
  switch (k.group_size) {
    case 32: scores_k8_gs<32>(q, G, k, n, D, out); break;
    case 64: scores_k8_gs<64>(q, G, k, n, D, out); break;
    default: scores_k8_gs<128>(q, G, k, n, D, out); break;
  }
}

// ---- 8-bit K and 4-bit V read without dequantizing them (256-bit, shared by
// both tables). A group dequantizes to s * w + b, so
//   q . (s w + b)             = s (q . w) + b sum(q)                    (scores)
//   sum_r p_r (s_r w_r + b_r) = sum_r (p_r s_r) w_r + sum_r p_r b_r      (accumulate)
// and the integer codes w are only widened to float in registers: no
// dequantized row is written out and read back.

// Rows [0, n) of a tile's per-group scales (or biases) as float32,
// out[r * groups + g]; rows stored back to back convert 8 values at a time.
template <FloatKind KIND>
inline void tile_floats(const void* base, int64_t row_stride, int groups, int n, float* out) {
  const int total = n * groups;
  if (row_stride != groups) {
    for (int r = 0; r < n; ++r)
      for (int g = 0; g < groups; ++g) out[r * groups + g] = scale_at(base, r * row_stride + g, KIND);
    return;
  }
  int i = 0;
  if constexpr (KIND == FloatKind::f32) {
    const float* src = static_cast<const float*>(base);
    for (; i + 8 <= total; i += 8) _mm256_storeu_ps(out + i, _mm256_loadu_ps(src + i));
  } else {
    const __m128i* src = static_cast<const __m128i*>(base);
    for (; i + 8 <= total; i += 8) {
      const __m128i h = _mm_loadu_si128(src + i / 8);
      _mm256_storeu_ps(out + i, KIND == FloatKind::f16
                                    ? _mm256_cvtph_ps(h)
                                    : _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)));
    }
  }
  for (; i < total; ++i) out[i] = scale_at(base, i, KIND);
}

// One 8-bit K row against NH heads: f[h] holds head h's score summed down to
// 8 lanes. qsum[h * kMaxQ8Groups + g] is head h's query over group g summed
// down to 8 lanes (times the group's bias it gives b * sum(q)); sc / bi are
// the row's scales and biases.
template <int NH, int GS, int DC>
__attribute__((always_inline)) inline void u8_row_dots(const float* __restrict q, const __m256* qsum, const uint8_t* w,
                                                       const float* sc, const float* bi, int D_, __m256* f) {
  const int D = DC ? DC : D_;
#pragma GCC unroll 8
  for (int g = 0; g < D / GS; ++g) {
    __m256 a[NH];
#pragma GCC unroll 16
    for (int step = 0; step < GS / 8; ++step) {
      const int d = g * GS + 8 * step;
      const __m256 x = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w + d))));
      for (int h = 0; h < NH; ++h)
        a[h] = step ? _mm256_fmadd_ps(_mm256_loadu_ps(q + h * D + d), x, a[h]) : _mm256_mul_ps(_mm256_loadu_ps(q + h * D + d), x);
    }
    const __m256 s = _mm256_set1_ps(sc[g]), b = _mm256_set1_ps(bi[g]);
    for (int h = 0; h < NH; ++h) {
      f[h] = g ? _mm256_fmadd_ps(a[h], s, f[h]) : _mm256_mul_ps(a[h], s);
      f[h] = _mm256_fmadd_ps(qsum[h * kMaxQ8Groups + g], b, f[h]);
    }
  }
}

// DC: head_dim when fixed at compile time (0: D), so a row's groups unroll.
template <int NH, int GS, FloatKind KIND, int DC>
void scores_u8_heads(const float* __restrict q, const QuantRows& k, int n, int D_, float* __restrict out) {
  const int D = DC ? DC : D_;
  const int groups = D / GS;
  __m256 qsum[NH * kMaxQ8Groups];
  for (int h = 0; h < NH; ++h)
    for (int g = 0; g < groups; ++g) {
      __m256 t = _mm256_loadu_ps(q + h * D + g * GS);
      for (int d = 8; d < GS; d += 8) t = _mm256_add_ps(t, _mm256_loadu_ps(q + h * D + g * GS + d));
      qsum[h * kMaxQ8Groups + g] = t;
    }
  alignas(32) float sc[kMaxTileRows * kMaxQ8Groups], bi[kMaxTileRows * kMaxQ8Groups];
  tile_floats<KIND>(k.scales, k.scale_stride, groups, n, sc);
  tile_floats<KIND>(k.biases, k.bias_stride, groups, n, bi);
  int r = 0;
  if constexpr (NH == 4) {
    for (; r + 2 <= n; r += 2) {
      __m256 f0[4], f1[4];
      u8_row_dots<4, GS, DC>(q, qsum, k.bytes + r * k.byte_stride, sc + r * groups, bi + r * groups, D, f0);
      u8_row_dots<4, GS, DC>(q, qsum, k.bytes + (r + 1) * k.byte_stride, sc + (r + 1) * groups, bi + (r + 1) * groups, D, f1);
      store_scores_4x2(f0, f1, out + r);
    }
  }
  // One row at a time: its NH heads' sums in one hsum4, whose order is hsum8's, so
  // a score has the same bits whether its row was paired above (4 heads: a
  // speculative decode row's L * G query rows) or not (a plain decode's G rows).
  for (; r < n; ++r) {
    __m256 f[4];
    u8_row_dots<NH, GS, DC>(q, qsum, k.bytes + r * k.byte_stride, sc + r * groups, bi + r * groups, D, f);
    if constexpr (NH == 1) {  // the same order, without three empty registers
      const __m256 t = _mm256_hadd_ps(_mm256_hadd_ps(f[0], f[0]), _mm256_hadd_ps(f[0], f[0]));
      out[r] = _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(t), _mm256_extractf128_ps(t, 1)));
      continue;
    }
    for (int h = NH; h < 4; ++h) f[h] = _mm256_setzero_ps();
    alignas(16) float sums[4];
    _mm_store_ps(sums, hsum4(f[0], f[1], f[2], f[3]));
    for (int h = 0; h < NH; ++h) out[h * kMaxTileRows + r] = sums[h];
  }
}

// 4-bit V: the weights p_r s_r of every (head, group, row) and the bias terms
// sum_r p_r b_r first (8 rows at a time), then the rows stream through NH
// heads x 16 columns of accumulators: one 8-byte load is 16 values, its low
// nibbles the even columns and its high nibbles the odd ones.
template <int NH, int GS, FloatKind KIND>
void accumulate_u4_heads(const float* p, const float* corr, const QuantRows& v, int n, int D, float* acc) {
  const int groups = D / GS;
  alignas(32) float sc[kMaxTileRows * kMaxQ8Groups], bi[kMaxTileRows * kMaxQ8Groups];
  tile_floats<KIND>(v.scales, v.scale_stride, groups, n, sc);
  tile_floats<KIND>(v.biases, v.bias_stride, groups, n, bi);
  const int n8 = (n + 7) & ~7;
  for (int i = n * groups; i < n8 * groups; ++i) sc[i] = bi[i] = 0.f;  // the gathers below read them
  // pw[(h * groups + g) * kMaxTileRows + r] = p_hr * s_rg; bsum[h * groups + g] sums p_hr * b_rg.
  alignas(32) float pw[NH * kMaxQ8Groups * kMaxTileRows];
  __m256 bsum[NH * kMaxQ8Groups];
  for (int i = 0; i < NH * groups; ++i) bsum[i] = _mm256_setzero_ps();
  const __m256i iota = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i idx = _mm256_mullo_epi32(iota, _mm256_set1_epi32(groups));
  for (int r0 = 0; r0 < n; r0 += 8) {
    // Rows past n are not this call's: masked loads read zeros there.
    const __m256i live = _mm256_cmpgt_epi32(_mm256_set1_epi32(n - r0), iota);
    __m256 pv[NH];
    for (int h = 0; h < NH; ++h) pv[h] = _mm256_maskload_ps(p + h * kMaxTileRows + r0, live);
    for (int g = 0; g < groups; ++g) {
      const __m256 s = _mm256_i32gather_ps(sc + r0 * groups + g, idx, 4);
      const __m256 b = _mm256_i32gather_ps(bi + r0 * groups + g, idx, 4);
      for (int h = 0; h < NH; ++h) {
        _mm256_store_ps(pw + (h * groups + g) * kMaxTileRows + r0, _mm256_mul_ps(pv[h], s));
        bsum[h * groups + g] = _mm256_fmadd_ps(pv[h], b, bsum[h * groups + g]);
      }
    }
  }
  float beta[NH * kMaxQ8Groups];
  for (int i = 0; i < NH * groups; ++i) {
    __m128 x = _mm_add_ps(_mm256_castps256_ps128(bsum[i]), _mm256_extractf128_ps(bsum[i], 1));
    x = _mm_add_ps(x, _mm_movehl_ps(x, x));
    beta[i] = _mm_cvtss_f32(_mm_add_ss(x, _mm_movehdup_ps(x)));
  }
  const __m256i low = _mm256_set1_epi32(0xF);
  const int64_t stride = v.byte_stride;
  for (int c = 0; c < D / 16; ++c) {
    const int g = c * 16 / GS;
    __m256 a[NH][2];
    for (int h = 0; h < NH; ++h) {
      const __m256 cv = _mm256_set1_ps(corr[h]), bv = _mm256_set1_ps(beta[h * groups + g]);
      a[h][0] = _mm256_fmadd_ps(_mm256_loadu_ps(acc + h * D + 16 * c), cv, bv);
      a[h][1] = _mm256_fmadd_ps(_mm256_loadu_ps(acc + h * D + 16 * c + 8), cv, bv);
    }
    const float* wt = pw + g * kMaxTileRows;  // head h's weights h * groups * kMaxTileRows further
    const uint8_t* w = v.bytes + 8 * c;
#pragma GCC unroll 2
    for (int r = 0; r < n; ++r, w += stride) {
      const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(w)));
      const __m256 even = _mm256_cvtepi32_ps(_mm256_and_si256(x, low));
      const __m256 odd = _mm256_cvtepi32_ps(_mm256_srli_epi32(x, 4));
      for (int h = 0; h < NH; ++h) {
        const __m256 ph = _mm256_broadcast_ss(wt + h * groups * kMaxTileRows + r);
        a[h][0] = _mm256_fmadd_ps(ph, even, a[h][0]);
        a[h][1] = _mm256_fmadd_ps(ph, odd, a[h][1]);
      }
    }
    for (int h = 0; h < NH; ++h) {
      _mm256_storeu_ps(acc + h * D + 16 * c, a[h][0]);
      _mm256_storeu_ps(acc + h * D + 16 * c + 8, a[h][1]);
    }
  }
}

// Group size and scale dtype become template arguments (F is a functor
// template taking <GS, KIND>).
template <template <int, FloatKind> class F, typename... A>
inline void with_group_and_kind(int group_size, FloatKind kind, A&&... a) {
  auto by_kind = [&](auto gs) {
    constexpr int GS = decltype(gs)::value;
    switch (kind) {
      case FloatKind::f32: F<GS, FloatKind::f32>::run(a...); break;
      case FloatKind::f16: F<GS, FloatKind::f16>::run(a...); break;
      default: F<GS, FloatKind::bf16>::run(a...); break;
    }
  };
  switch (group_size) {
    case 32: by_kind(std::integral_constant<int, 32>{}); break;
    case 64: by_kind(std::integral_constant<int, 64>{}); break;
    default: by_kind(std::integral_constant<int, 128>{}); break;
  }
}

template <int GS, FloatKind KIND>
struct ScoresU8 {
  static void run(const float* q, int G, const QuantRows& k, int n, int D, float* out) {
    over_head_blocks(G, [&](auto nh, int g) {
      constexpr int NH = decltype(nh)::value;
      if (D == 128) scores_u8_heads<NH, GS, KIND, 128>(q + g * D, k, n, D, out + g * kMaxTileRows);
      else scores_u8_heads<NH, GS, KIND, 0>(q + g * D, k, n, D, out + g * kMaxTileRows);
    });
  }
};

template <int GS, FloatKind KIND>
struct AccumulateU4 {
  static void run(const float* p, const float* corr, int G, const QuantRows& v, int n, int D, float* acc) {
    over_head_blocks(G, [&](auto nh, int g) {
      accumulate_u4_heads<decltype(nh)::value, GS, KIND>(p + g * kMaxTileRows, corr + g, v, n, D, acc + g * D);
    });
  }
};

void scores_u8(const float* q, int G, const QuantRows& k, int n, int D, float* out) {
  with_group_and_kind<ScoresU8>(k.group_size, k.scale_kind, q, G, k, n, D, out);
}

void accumulate_u4(const float* p, const float* corr, int G, const QuantRows& v, int n, int D, float* acc) {
  with_group_and_kind<AccumulateU4>(v.group_size, v.scale_kind, p, corr, G, v, n, D, acc);
}

// Bit width and group size become template arguments, so each group's steps
// unroll into straight-line code.
template <typename V, int BITS>
void dequant_rows_bits(const QuantTile& tile, int group_size, int n, int D, float* dst) {
  switch (group_size) {
    case 32: dequant_rows_t<V, BITS, 32>(tile, n, D, dst); break;
    case 64: dequant_rows_t<V, BITS, 64>(tile, n, D, dst); break;
    default: dequant_rows_t<V, BITS, 128>(tile, n, D, dst); break;
  }
}

template <typename V>
void dequant_rows(const uint32_t* words, int64_t word_stride, const void* scales, int64_t scale_stride,
                  const void* biases, int64_t bias_stride, FloatKind scale_kind, int bits, int group_size, int n,
                  int D, float* dst) {
  const QuantTile tile{words, word_stride, scales, scale_stride, biases, bias_stride, scale_kind};
  switch (bits) {
    case 8: dequant_rows_bits<V, 8>(tile, group_size, n, D, dst); break;
    case 4: dequant_rows_bits<V, 4>(tile, group_size, n, D, dst); break;
    default: dequant_rows_bits<V, 2>(tile, group_size, n, D, dst); break;
  }
}

template <typename V>
constexpr TileKernels make_tile_kernels(const char* name) {
  return TileKernels{name,
                     rows_to_f32<V, uint16_t>,
                     rows_to_f32<V, Bf16>,
                     scores_t<V, float>,
                     accumulate_t<V, float>,
                     V::exp_inplace,
                     softmax_update<V>,
                     dequant_rows<V>,
                     scores_t<V, uint16_t>,
                     accumulate_t<V, uint16_t>,
                     scores_bf16<V>,
                     accumulate_bf16<V>,
                     to_f16<V>,
                     scores_k8,
                     scores_u8,
                     accumulate_u4};
}

}  // namespace
}  // namespace kvmetal
