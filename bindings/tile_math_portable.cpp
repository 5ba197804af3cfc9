// Portable tile kernels: plain loops written so compilers vectorize them
// (NEON on arm64, SSE2 on baseline x86-64), plus the run-time choice of the
// best implementation.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <string>

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#endif

#include "float_convert.h"
#include "tile_math.h"

namespace kvmetal {
namespace {

void f16_rows(const uint16_t* src, int64_t stride, int n, int D, float* dst) {
  for (int r = 0; r < n; ++r)
    for (int d = 0; d < D; ++d) dst[r * D + d] = f16_to_f32(src[r * stride + d]);
}

void bf16_rows(const uint16_t* src, int64_t stride, int n, int D, float* dst) {
  for (int r = 0; r < n; ++r)
    for (int d = 0; d < D; ++d) dst[r * D + d] = bf16_to_f32(src[r * stride + d]);
}

// Eight independent partial sums: lanes a compiler can map onto SIMD registers
// without reassociating a single float sum (which strict IEEE forbids).
inline float dot(const float* a, const float* b, int D) {
  float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int d = 0;
  for (; d + 8 <= D; d += 8)
    for (int j = 0; j < 8; ++j) part[j] += a[d + j] * b[d + j];
  float s = 0.f;
  for (; d < D; ++d) s += a[d] * b[d];
  for (int j = 0; j < 8; ++j) s += part[j];
  return s;
}

void scores(const float* q, int G, const float* k, int64_t stride, int n, int D, float* out) {
  for (int r = 0; r < n; ++r) {
    const float* kr = k + r * stride;
    for (int g = 0; g < G; ++g) out[g * kMaxTileRows + r] = dot(q + g * D, kr, D);
  }
}

void accumulate(const float* p, const float* corr, int G, const float* v, int64_t stride, int n, int D, float* acc) {
  for (int g = 0; g < G; ++g) {
    float* a = acc + g * D;
    const float c = corr[g];
    for (int d = 0; d < D; ++d) a[d] *= c;
    for (int r = 0; r < n; ++r) {
      const float pr = p[g * kMaxTileRows + r];
      const float* vr = v + r * stride;
      for (int d = 0; d < D; ++d) a[d] += pr * vr[d];
    }
  }
}

void exp_inplace(float* x, int n) {
  for (int i = 0; i < n; ++i) x[i] = std::exp(x[i]);
}

void to_f16(const float* src, int n, uint16_t* dst) {
  for (int i = 0; i < n; ++i) dst[i] = f32_to_f16(src[i]);
}

void softmax_update(float* scores, int G, int n, float* m, float* l, float* corr) {
  for (int g = 0; g < G; ++g) {
    float* sg = scores + g * kMaxTileRows;
    float tile_max = sg[0];
    for (int r = 1; r < n; ++r) tile_max = std::max(tile_max, sg[r]);
    const float m_new = std::max(m[g], tile_max);
    // A row that has seen only masked (-inf) scores keeps m = -inf: exps are
    // then taken against 0 (all 0) instead of -inf - -inf = NaN.
    const float ref = m_new == -INFINITY ? 0.f : m_new;
    corr[g] = std::exp(m[g] - ref);  // exp(-inf) = 0 on the first tile
    m[g] = m_new;
    float sum = 0.f;
    for (int r = 0; r < n; ++r) {
      sg[r] = std::exp(sg[r] - ref);
      sum += sg[r];
    }
    l[g] = l[g] * corr[g] + sum;
  }
}

const TileKernels kPortable{"portable",  f16_rows, bf16_rows, scores,  accumulate, exp_inplace,
                            softmax_update, nullptr,  nullptr,   nullptr, nullptr, nullptr, to_f16, nullptr, nullptr, nullptr};

enum class Level { portable, avx2, avx512 };

Level cpu_level() {
#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
  __builtin_cpu_init();
  // clang has no "f16c" for __builtin_cpu_supports: read CPUID leaf 1, ECX bit 29.
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  const bool f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29));
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && f16c;
  if (avx2 && __builtin_cpu_supports("avx512f")) return Level::avx512;
  if (avx2) return Level::avx2;
#endif
  return Level::portable;
}

// Tests may cap the level (to run the narrower kernels on a wider CPU).
std::atomic<int> g_level_cap{static_cast<int>(Level::avx512)};
std::atomic<bool> g_int8_k_scores{false};

}  // namespace

bool cap_tile_level(const std::string& name) {
  Level cap;
  if (name == "portable") cap = Level::portable;
  else if (name == "avx2") cap = Level::avx2;
  else if (name == "avx512") cap = Level::avx512;
  else return false;
  g_level_cap = static_cast<int>(cap);
  return true;
}

void set_int8_k_scores(bool on) { g_int8_k_scores = on; }
bool int8_k_scores() { return g_int8_k_scores.load(); }

const TileKernels& tile_kernels(int D) {
  static const Level cpu = cpu_level();
  const Level level = static_cast<Level>(std::min(static_cast<int>(cpu), g_level_cap.load()));
#if defined(__x86_64__) || defined(_M_X64)
  if (level == Level::avx512 && D % 16 == 0) return avx512_tile_kernels();
  if (level != Level::portable && D % 8 == 0) return avx2_tile_kernels();
#else
  (void)level;
  (void)D;
#endif
  return kPortable;
}

const TileKernels& best_tile_kernels() { return tile_kernels(256); }

}  // namespace kvmetal
