// kvmetal.sim: the metal::, metal::fast:: and metal::precise:: math library.
// half and bfloat compute through float and round back, like the GPU's fast paths.
#pragma once
#include "abi.h"
#include "msl_types.h"

namespace kmsl {
typedef signed char schar_t;
typedef unsigned char uchar_t;
typedef unsigned short ushort_t;
typedef unsigned int uint_t;
typedef unsigned long ulong_t;
typedef long long llong_t;
typedef unsigned long long ullong_t;
}  // namespace kmsl

// Transcendental calls are counted per lane and component (KmslStats::math);
// the indices follow kMathNames in rt.cpp.
namespace kmsl {
inline void count_math(int k) {
  if (kmsl_tls_stats) kmsl_tls_stats->math[k]++;
}
// Every loop condition calls this (translate.py): the watchdog's hook.
inline bool tick() {
  KmslStats* s = kmsl_tls_stats;
  if (s && __builtin_expect(--s->tick_budget <= 0, 0)) kmsl_rt_tick();
  return true;
}
}  // namespace kmsl

namespace metal {


#define KMSL_F_UNARY_N(name, expr, count)                                             \
  inline float name(float x) { count; return expr; }                                  \
  inline half name(half x) { return half(name(float(x))); }                           \
  inline bfloat name(bfloat x) { return bfloat(name(float(x))); }                     \
  template <class T, int N> vec<T, N> name(const vec<T, N>& a) {                      \
    vec<T, N> r;                                                                      \
    for (int i = 0; i < N; i++) r.v[i] = name(a.v[i]);                                \
    return r;                                                                         \
  }
#define KMSL_F_UNARY(name, expr) KMSL_F_UNARY_N(name, expr, (void)0)
#define KMSL_F_TRANS(name, expr) KMSL_F_UNARY_N(name, expr, kmsl::count_math(KMSL_MATH_##name))
// tanh, exp, exp2, log and rsqrt come in a precise and a fast form (below);
// metal::<name> is the fast one when the kernel is built with a "relaxed" or
// "fast" math mode (KMSL_FAST_MATH, set by translate.cpp_source), as on a Mac.
KMSL_F_TRANS(exp10, __builtin_powf(10.0f, x))
KMSL_F_TRANS(expm1, __builtin_expm1f(x))
KMSL_F_TRANS(log2, __builtin_log2f(x))
KMSL_F_TRANS(log10, __builtin_log10f(x))
KMSL_F_TRANS(log1p, __builtin_log1pf(x))
KMSL_F_UNARY(sqrt, __builtin_sqrtf(x))
KMSL_F_UNARY(cbrt, __builtin_cbrtf(x))
KMSL_F_TRANS(sin, __builtin_sinf(x))
KMSL_F_TRANS(cos, __builtin_cosf(x))
KMSL_F_TRANS(tan, __builtin_tanf(x))
KMSL_F_TRANS(asin, __builtin_asinf(x))
KMSL_F_TRANS(acos, __builtin_acosf(x))
KMSL_F_TRANS(atan, __builtin_atanf(x))
KMSL_F_TRANS(sinh, __builtin_sinhf(x))
KMSL_F_TRANS(cosh, __builtin_coshf(x))
KMSL_F_TRANS(asinh, __builtin_asinhf(x))
KMSL_F_TRANS(acosh, __builtin_acoshf(x))
KMSL_F_TRANS(atanh, __builtin_atanhf(x))
KMSL_F_TRANS(erf, __builtin_erff(x))
KMSL_F_UNARY(floor, __builtin_floorf(x))
KMSL_F_UNARY(ceil, __builtin_ceilf(x))
KMSL_F_UNARY(round, __builtin_roundf(x))
KMSL_F_UNARY(rint, __builtin_rintf(x))
KMSL_F_UNARY(trunc, __builtin_truncf(x))
KMSL_F_UNARY(fabs, __builtin_fabsf(x))
KMSL_F_UNARY(fract, x - __builtin_floorf(x))
KMSL_F_UNARY(saturate, x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x))
KMSL_F_UNARY(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f))

}  // namespace metal

// Metal's fast math functions, written from their documented behaviour: the
// formulas the fast forms use, with denormal inputs and results flushed to zero.
// Fast tanh is (e^2x - 1) / (e^2x + 1): NaN (inf / inf) once e^2x overflows,
// for x above about 44.4.
namespace kmsl {
inline float ftz(float x) { return __builtin_fabsf(x) < 1.17549435e-38f ? __builtin_copysignf(0.0f, x) : x; }
inline float fast_exp2f(float x) { return ftz(__builtin_exp2f(ftz(x))); }
inline float fast_expf(float x) { return fast_exp2f(ftz(x) * 1.44269504088896341f); }
inline float fast_logf(float x) { return __builtin_log2f(ftz(x)) * 0.693147180559945309f; }
inline float fast_rsqrtf(float x) { return 1.0f / __builtin_sqrtf(ftz(x)); }
inline float fast_tanhf(float x) {
  const float e = fast_exp2f(2.0f * 1.44269504088896341f * ftz(x));
  return (e - 1.0f) / (e + 1.0f);
}
}  // namespace kmsl

namespace metal {
namespace precise {
KMSL_F_TRANS(exp, __builtin_expf(x))
KMSL_F_TRANS(exp2, __builtin_exp2f(x))
KMSL_F_TRANS(log, __builtin_logf(x))
KMSL_F_TRANS(tanh, __builtin_tanhf(x))
KMSL_F_UNARY(rsqrt, 1.0f / __builtin_sqrtf(x))
}  // namespace precise
namespace fast {
KMSL_F_TRANS(exp, kmsl::fast_expf(x))
KMSL_F_TRANS(exp2, kmsl::fast_exp2f(x))
KMSL_F_TRANS(log, kmsl::fast_logf(x))
KMSL_F_TRANS(tanh, kmsl::fast_tanhf(x))
KMSL_F_UNARY(rsqrt, kmsl::fast_rsqrtf(x))
}  // namespace fast
#if KMSL_FAST_MATH
using fast::exp; using fast::exp2; using fast::log; using fast::tanh; using fast::rsqrt;
#else
using precise::exp; using precise::exp2; using precise::log; using precise::tanh; using precise::rsqrt;
#endif
#undef KMSL_F_UNARY
#undef KMSL_F_TRANS
#undef KMSL_F_UNARY_N

#define KMSL_F_BINARY(name, expr)                                                       \
  inline float name(float x, float y) { return expr; }                                  \
  inline half name(half x, half y) { return half(name(float(x), float(y))); }           \
  inline bfloat name(bfloat x, bfloat y) { return bfloat(name(float(x), float(y))); }   \
  template <class T, int N> vec<T, N> name(const vec<T, N>& a, const vec<T, N>& b) {    \
    vec<T, N> r;                                                                        \
    for (int i = 0; i < N; i++) r.v[i] = name(a.v[i], b.v[i]);                          \
    return r;                                                                           \
  }                                                                                     \
  template <class T, int N> vec<T, N> name(const vec<T, N>& a, kmsl::ident_t<T> b) {    \
    vec<T, N> r;                                                                        \
    for (int i = 0; i < N; i++) r.v[i] = name(a.v[i], b);                               \
    return r;                                                                           \
  }
KMSL_F_BINARY(pow, (kmsl::count_math(KMSL_MATH_pow), __builtin_powf(x, y)))
KMSL_F_BINARY(powr, (kmsl::count_math(KMSL_MATH_powr), __builtin_powf(x, y)))
KMSL_F_BINARY(fmin, __builtin_fminf(x, y))
KMSL_F_BINARY(fmax, __builtin_fmaxf(x, y))
KMSL_F_BINARY(fmod, __builtin_fmodf(x, y))
KMSL_F_BINARY(atan2, (kmsl::count_math(KMSL_MATH_atan2), __builtin_atan2f(x, y)))
KMSL_F_BINARY(copysign, __builtin_copysignf(x, y))
KMSL_F_BINARY(fdim, __builtin_fdimf(x, y))
KMSL_F_BINARY(step, y < x ? 0.0f : 1.0f)
KMSL_F_BINARY(divide, x / y)
// MSL min/max on floats follow fmin/fmax (a NaN operand yields the other one).
KMSL_F_BINARY(min, __builtin_fminf(x, y))
KMSL_F_BINARY(max, __builtin_fmaxf(x, y))
#undef KMSL_F_BINARY

#define KMSL_I_MINMAX(T)                                        \
  inline T min(T a, T b) { return b < a ? b : a; }              \
  inline T max(T a, T b) { return a < b ? b : a; }              \
  inline T clamp(T x, T lo, T hi) { return min(max(x, lo), hi); }
KMSL_I_MINMAX(char)
KMSL_I_MINMAX(kmsl::schar_t)
KMSL_I_MINMAX(kmsl::uchar_t)
KMSL_I_MINMAX(short)
KMSL_I_MINMAX(kmsl::ushort_t)
KMSL_I_MINMAX(int)
KMSL_I_MINMAX(kmsl::uint_t)
KMSL_I_MINMAX(long)
KMSL_I_MINMAX(kmsl::ulong_t)
KMSL_I_MINMAX(kmsl::llong_t)
KMSL_I_MINMAX(kmsl::ullong_t)
#undef KMSL_I_MINMAX
inline float clamp(float x, float lo, float hi) { return fmin(fmax(x, lo), hi); }
inline half clamp(half x, half lo, half hi) { return fmin(fmax(x, lo), hi); }
inline bfloat clamp(bfloat x, bfloat lo, bfloat hi) { return fmin(fmax(x, lo), hi); }
template <class T, int N> vec<T, N> clamp(const vec<T, N>& x, const vec<T, N>& lo, const vec<T, N>& hi) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r.v[i] = clamp(x.v[i], lo.v[i], hi.v[i]);
  return r;
}
template <class T, int N> vec<T, N> clamp(const vec<T, N>& x, kmsl::ident_t<T> lo, kmsl::ident_t<T> hi) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r.v[i] = clamp(x.v[i], lo, hi);
  return r;
}

#define KMSL_I_ABS(T) inline T abs(T a) { return a < 0 ? T(-a) : a; }
KMSL_I_ABS(char)
KMSL_I_ABS(kmsl::schar_t)
KMSL_I_ABS(short)
KMSL_I_ABS(int)
KMSL_I_ABS(long)
KMSL_I_ABS(kmsl::llong_t)
#undef KMSL_I_ABS
inline unsigned char abs(unsigned char a) { return a; }
inline unsigned short abs(unsigned short a) { return a; }
inline unsigned int abs(unsigned int a) { return a; }
inline unsigned long abs(unsigned long a) { return a; }
inline float abs(float x) { return __builtin_fabsf(x); }
inline half abs(half x) { return half(__builtin_fabsf(float(x))); }
inline bfloat abs(bfloat x) { return bfloat(__builtin_fabsf(float(x))); }
template <class T, int N> vec<T, N> abs(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r.v[i] = abs(a.v[i]);
  return r;
}

inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) { return half(__builtin_fmaf(float(a), float(b), float(c))); }
inline bfloat fma(bfloat a, bfloat b, bfloat c) { return bfloat(__builtin_fmaf(float(a), float(b), float(c))); }
template <class T, int N> vec<T, N> fma(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r.v[i] = fma(a.v[i], b.v[i], c.v[i]);
  return r;
}
inline float mix(float a, float b, float t) { return a + (b - a) * t; }
inline half mix(half a, half b, half t) { return half(mix(float(a), float(b), float(t))); }
inline bfloat mix(bfloat a, bfloat b, bfloat t) { return bfloat(mix(float(a), float(b), float(t))); }
template <class T, int N> vec<T, N> mix(const vec<T, N>& a, const vec<T, N>& b, const vec<T, N>& t) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r.v[i] = mix(a.v[i], b.v[i], t.v[i]);
  return r;
}
template <class T, int N> vec<T, N> mix(const vec<T, N>& a, const vec<T, N>& b, kmsl::ident_t<T> t) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r.v[i] = mix(a.v[i], b.v[i], t);
  return r;
}

template <class T> T select(T a, T b, bool c) { return c ? b : a; }
template <class T, int N> vec<T, N> select(const vec<T, N>& a, const vec<T, N>& b, const vec<bool, N>& c) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r.v[i] = c.v[i] ? b.v[i] : a.v[i];
  return r;
}

#define KMSL_F_PRED(name, expr)                                                 \
  inline bool name(float x) { return expr; }                                    \
  inline bool name(half x) { return name(float(x)); }                           \
  inline bool name(bfloat x) { return name(float(x)); }                         \
  template <class T, int N> vec<bool, N> name(const vec<T, N>& a) {             \
    vec<bool, N> r;                                                             \
    for (int i = 0; i < N; i++) r.v[i] = name(a.v[i]);                          \
    return r;                                                                   \
  }
KMSL_F_PRED(isnan, __builtin_isnan(x))
KMSL_F_PRED(isinf, __builtin_isinf(x))
KMSL_F_PRED(isfinite, __builtin_isfinite(x))
KMSL_F_PRED(signbit, __builtin_signbit(x) != 0)
#undef KMSL_F_PRED

inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }
template <int N> bool all(const vec<bool, N>& v) {
  for (int i = 0; i < N; i++)
    if (!v.v[i]) return false;
  return true;
}
template <int N> bool any(const vec<bool, N>& v) {
  for (int i = 0; i < N; i++)
    if (v.v[i]) return true;
  return false;
}

template <class T, int N> T dot(const vec<T, N>& a, const vec<T, N>& b) {
  T s = T(a.v[0] * b.v[0]);
  for (int i = 1; i < N; i++) s = T(s + a.v[i] * b.v[i]);
  return s;
}
template <class T, int N> T length_squared(const vec<T, N>& a) { return dot(a, a); }
template <class T, int N> T length(const vec<T, N>& a) { return sqrt(dot(a, a)); }
template <class T, int N> T distance(const vec<T, N>& a, const vec<T, N>& b) { return length(a - b); }
template <class T, int N> vec<T, N> normalize(const vec<T, N>& a) { return a * rsqrt(dot(a, a)); }
template <class T> vec<T, 3> cross(const vec<T, 3>& a, const vec<T, 3>& b) {
  return vec<T, 3>(a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x);
}

inline uint popcount(uint x) { return (uint)__builtin_popcount(x); }
inline int popcount(int x) { return __builtin_popcount((uint)x); }
inline ulong popcount(ulong x) { return (ulong)__builtin_popcountl(x); }
inline uint clz(uint x) { return x ? (uint)__builtin_clz(x) : 32u; }
inline uint ctz(uint x) { return x ? (uint)__builtin_ctz(x) : 32u; }
inline uint mulhi(uint a, uint b) { return (uint)(((uint64_t)a * b) >> 32); }
inline int mulhi(int a, int b) { return (int)(((int64_t)a * b) >> 32); }

namespace fast {
using metal::abs; using metal::acos; using metal::asin; using metal::atan; using metal::atan2;
using metal::ceil; using metal::clamp; using metal::cos; using metal::cosh; using metal::divide;
using metal::exp10; using metal::fabs; using metal::floor;
using metal::fmax; using metal::fmin; using metal::fmod; using metal::fract;
using metal::log10; using metal::log2; using metal::max; using metal::min; using metal::pow;
using metal::powr; using metal::rint; using metal::round; using metal::saturate;
using metal::sin; using metal::sinh; using metal::sqrt; using metal::tan;
using metal::trunc; using metal::length; using metal::normalize; using metal::distance; using metal::dot;
}  // namespace fast
namespace precise {
using namespace metal::fast;  // the others: one form here
}  // namespace precise

// numeric_limits for the MSL scalar types.
template <class T> struct numeric_limits;
#define KMSL_LIMITS(T, lo, hi, mn, eps, inf, qnan)                    \
  template <> struct numeric_limits<T> {                              \
    static constexpr bool is_specialized = true;                     \
    static constexpr T lowest() { return T(lo); }                               \
    static constexpr T max() { return T(hi); }                                  \
    static constexpr T min() { return T(mn); }                                  \
    static constexpr T epsilon() { return T(eps); }                             \
    static constexpr T infinity() { return T(inf); }                            \
    static constexpr T quiet_NaN() { return T(qnan); }                          \
  };
KMSL_LIMITS(float, -3.40282347e38f, 3.40282347e38f, 1.17549435e-38f, 1.1920929e-7f, __builtin_inff(), __builtin_nanf(""))
KMSL_LIMITS(half, -65504.0f, 65504.0f, 6.103515625e-5f, 9.765625e-4f, __builtin_inff(), __builtin_nanf(""))
KMSL_LIMITS(bfloat, -3.38953139e38f, 3.38953139e38f, 1.17549435e-38f, 7.8125e-3f, __builtin_inff(), __builtin_nanf(""))
KMSL_LIMITS(bool, false, true, false, 0, 0, 0)
KMSL_LIMITS(char, -128, 127, -128, 0, 0, 0)
KMSL_LIMITS(kmsl::schar_t, -128, 127, -128, 0, 0, 0)
KMSL_LIMITS(kmsl::uchar_t, 0, 255, 0, 0, 0, 0)
KMSL_LIMITS(short, -32768, 32767, -32768, 0, 0, 0)
KMSL_LIMITS(kmsl::ushort_t, 0, 65535, 0, 0, 0, 0)
KMSL_LIMITS(int, -2147483647 - 1, 2147483647, -2147483647 - 1, 0, 0, 0)
KMSL_LIMITS(kmsl::uint_t, 0u, 4294967295u, 0u, 0, 0, 0)
KMSL_LIMITS(long, -9223372036854775807L - 1, 9223372036854775807L, -9223372036854775807L - 1, 0, 0, 0)
KMSL_LIMITS(kmsl::ulong_t, 0ul, 18446744073709551615ul, 0ul, 0, 0, 0)
#undef KMSL_LIMITS

}  // namespace metal

#define MAXFLOAT 3.40282347e38f
#define HUGE_VALF __builtin_inff()
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define FLT_MAX 3.40282347e38f
#define FLT_MIN 1.17549435e-38f
#define FLT_EPSILON 1.1920929e-7f
#define HALF_MAX 65504.0f
#define HALF_MIN 6.103515625e-5f
#define M_PI_F 3.14159265358979323846f
#define M_E_F 2.71828182845904523536f
#define M_LOG2E_F 1.44269504088896340736f
#define M_LOG10E_F 0.434294481903251827651f
#define M_LN2_F 0.693147180559945309417f
#define M_LN10_F 2.30258509299404568402f
#define M_SQRT2_F 1.41421356237309504880f
#define M_SQRT1_2_F 0.707106781186547524401f
#define M_PI_H M_PI_F
#define M_LOG2E_H M_LOG2E_F
