// kvmetal.sim: Metal scalar and vector types on the host: half, bfloat, vec<T,N>.
// Kept free of <cmath>/<cstdlib> so the only math overloads a kernel sees are
// the MSL ones (no ambiguity with ::abs(int) and friends).
#pragma once
#include <stdint.h>
#include <stddef.h>

namespace kmsl {
template <class T> struct ident { using type = T; };
template <class T> using ident_t = typename ident<T>::type;
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { using type = T; };
template <bool B, class T = void> using enable_if_t = typename enable_if<B, T>::type;
template <bool C, class A, class B> struct cond { using type = A; };
template <class A, class B> struct cond<false, A, B> { using type = B; };
template <class A, class B> struct is_same { static constexpr bool value = false; };
template <class A> struct is_same<A, A> { static constexpr bool value = true; };
template <class T> struct remove_cv { using type = T; };
template <class T> struct remove_cv<const T> { using type = T; };
template <class T> struct remove_cv<volatile T> { using type = T; };
template <class T> struct remove_cv<const volatile T> { using type = T; };
template <class T> struct remove_ref { using type = T; };
template <class T> struct remove_ref<T&> { using type = T; };
template <class T> struct remove_ref<T&&> { using type = T; };
template <class T> using decay_t = typename remove_cv<typename remove_ref<T>::type>::type;
template <class T> struct is_const { static constexpr bool value = false; };
template <class T> struct is_const<const T> { static constexpr bool value = true; };
template <class T> struct is_pointer { static constexpr bool value = false; };
template <class T> struct is_pointer<T*> { static constexpr bool value = true; };
}  // namespace kmsl

// half is the compiler's _Float16 where C++ has it (g++ >= 12 on x86-64, g++ >= 13,
// clang where __FLT16_MAX__ is defined); otherwise a 16-bit class like bfloat.
#if !defined(KMSL_SOFT_HALF)
#if (defined(__clang__) && defined(__FLT16_MAX__)) || \
    (!defined(__clang__) && defined(__GNUC__) && (__GNUC__ >= 13 || (__GNUC__ >= 12 && defined(__x86_64__))))
#define KMSL_NATIVE_HALF 1
#endif
#endif

namespace metal {

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;

// A 16-bit float stored as bits, computed in float, rounded to nearest even on
// conversion. Kind 0: bfloat (8-bit exponent); kind 1: IEEE binary16 half.
template <int Kind> struct f16 {
  uint16_t bits;
  f16() = default;
  static constexpr uint16_t from_float(float f) {
    uint32_t u = __builtin_bit_cast(uint32_t, f);
    if (Kind == 0) {
      if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);  // quiet NaN
      u += 0x7fffu + ((u >> 16) & 1u);
      return uint16_t(u >> 16);
    }
    uint32_t sign = (u >> 16) & 0x8000u, x = u & 0x7fffffffu;
    if (x >= 0x7f800000u) return uint16_t(sign | (x > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (x >= 0x477ff000u) return uint16_t(sign | 0x7c00u);  // rounds to infinity
    if (x < 0x38800000u) {  // half subnormal: round x * 2^24 to an integer, ties to even
      float t = __builtin_bit_cast(float, x) * 16777216.0f;
      uint32_t m = uint32_t((t + 8388608.0f) - 8388608.0f);
      return uint16_t(sign | m);
    }
    uint32_t r = x + 0x0fffu + ((x >> 13) & 1u);
    return uint16_t(sign | ((r - (112u << 23)) >> 13));
  }
  static constexpr float to_float(uint16_t h) {
    if (Kind == 0) return __builtin_bit_cast(float, uint32_t(h) << 16);
    uint32_t sign = uint32_t(h & 0x8000u) << 16, e = (h >> 10) & 0x1fu, m = h & 0x3ffu;
    if (e == 0) {
      float v = float(m) * (1.0f / 16777216.0f);
      return sign ? -v : v;
    }
    if (e == 31) return __builtin_bit_cast(float, sign | 0x7f800000u | (m << 13));
    return __builtin_bit_cast(float, sign | ((e + 112u) << 23) | (m << 13));
  }
  template <class U, class = decltype(float(U()))>
  constexpr f16(U v) : bits(from_float(float(v))) {}
  constexpr operator float() const { return to_float(bits); }
  f16& operator+=(f16 o) { return *this = f16(float(*this) + float(o)); }
  f16& operator-=(f16 o) { return *this = f16(float(*this) - float(o)); }
  f16& operator*=(f16 o) { return *this = f16(float(*this) * float(o)); }
  f16& operator/=(f16 o) { return *this = f16(float(*this) / float(o)); }
  f16& operator++() { return *this += f16(1.0f); }
  f16& operator--() { return *this -= f16(1.0f); }
  constexpr f16 operator-() const {
    f16 r = *this;
    r.bits = uint16_t(bits ^ 0x8000);
    return r;
  }
  constexpr f16 operator+() const { return *this; }
};
typedef f16<0> bfloat;
#if defined(KMSL_NATIVE_HALF)
typedef _Float16 half;
#else
typedef f16<1> half;
#endif

}  // namespace metal

namespace kmsl {
using metal::bfloat;
using metal::half;
template <class T> struct is_arith { static constexpr bool value = false; };
#define KMSL_ARITH(T) template <> struct is_arith<T> { static constexpr bool value = true; };
KMSL_ARITH(bool) KMSL_ARITH(char) KMSL_ARITH(signed char) KMSL_ARITH(unsigned char)
KMSL_ARITH(short) KMSL_ARITH(unsigned short) KMSL_ARITH(int) KMSL_ARITH(unsigned int)
KMSL_ARITH(long) KMSL_ARITH(unsigned long) KMSL_ARITH(long long) KMSL_ARITH(unsigned long long)
KMSL_ARITH(float) KMSL_ARITH(double)
#if defined(KMSL_NATIVE_HALF)
KMSL_ARITH(half)
#endif
#undef KMSL_ARITH
template <class T> struct is_float_like {
  static constexpr bool value = is_same<T, float>::value || is_same<T, double>::value || is_same<T, half>::value;
};
// A 16-bit float with another arithmetic type: floating types promote to float, integers to the 16-bit type.
template <int K, class U>
using f16_result = enable_if_t<is_arith<U>::value, typename cond<is_float_like<U>::value, float, metal::f16<K>>::type>;
}  // namespace kmsl

namespace metal {
#define KMSL_F16_ARITH(op)                                                                           \
  template <int K> f16<K> operator op(f16<K> a, f16<K> b) { return f16<K>(float(a) op float(b)); }  \
  template <int K, class U> kmsl::f16_result<K, U> operator op(f16<K> a, U b) {                      \
    return kmsl::f16_result<K, U>(float(a) op float(b));                                              \
  }                                                                                                  \
  template <int K, class U> kmsl::f16_result<K, U> operator op(U a, f16<K> b) {                      \
    return kmsl::f16_result<K, U>(float(a) op float(b));                                              \
  }
KMSL_F16_ARITH(+)
KMSL_F16_ARITH(-)
KMSL_F16_ARITH(*)
KMSL_F16_ARITH(/)
#undef KMSL_F16_ARITH
#define KMSL_F16_CMP(op)                                                                         \
  template <int K> bool operator op(f16<K> a, f16<K> b) { return float(a) op float(b); }         \
  template <int K, class U, class = kmsl::enable_if_t<kmsl::is_arith<U>::value>>                 \
  bool operator op(f16<K> a, U b) { return float(a) op float(b); }                               \
  template <int K, class U, class = kmsl::enable_if_t<kmsl::is_arith<U>::value>>                 \
  bool operator op(U a, f16<K> b) { return float(a) op float(b); }
KMSL_F16_CMP(==)
KMSL_F16_CMP(!=)
KMSL_F16_CMP(<)
KMSL_F16_CMP(>)
KMSL_F16_CMP(<=)
KMSL_F16_CMP(>=)
#undef KMSL_F16_CMP

// ---------------------------------------------------------------------------
// Vectors. MSL sizes and alignment: a 3-vector occupies 4 elements.
template <class T, int N> struct vec;
template <class T, int N> struct vec_store;
template <class T> struct alignas(2 * sizeof(T)) vec_store<T, 2> {
  union { T v[2]; struct { T x, y; }; struct { T r, g; }; };
};
template <class T> struct alignas(4 * sizeof(T)) vec_store<T, 3> {
  union { T v[4]; struct { T x, y, z; }; struct { T r, g, b; }; };
};
template <class T> struct alignas(4 * sizeof(T)) vec_store<T, 4> {
  union { T v[4]; struct { T x, y, z, w; }; struct { T r, g, b, a; }; };
};

}  // namespace metal

namespace kmsl {
template <int... I> struct sw {};
template <class A> struct ncomp { static constexpr int value = 1; };
template <class T, int N> struct ncomp<metal::vec<T, N>> { static constexpr int value = N; };
template <class T> struct is_vec { static constexpr bool value = false; };
template <class T, int N> struct is_vec<metal::vec<T, N>> { static constexpr bool value = true; };
template <class T, int N, int... I> struct swz_ref;
// Counts the components of a constructor argument (vec or scalar, incl. swizzle refs).
template <class T, int N> constexpr int count_of(const metal::vec<T, N>*) { return N; }
constexpr int count_of(const void*) { return 1; }
template <class A> constexpr int comps = count_of((const decay_t<A>*)nullptr);
}  // namespace kmsl

namespace metal {
template <class T, int N> struct vec : vec_store<T, N> {
  using value_type = T;
  vec() = default;
  vec(kmsl::ident_t<T> s) {  // implicit scalar broadcast, as in MSL
    for (int i = 0; i < N; i++) this->v[i] = s;
  }
  template <class A, class B, class... R,
            kmsl::enable_if_t<(kmsl::comps<A> + kmsl::comps<B> + (0 + ... + kmsl::comps<R>)) == N, int> = 0>
  vec(const A& a, const B& b, const R&... r) {
    int k = 0;
    put(k, a);
    put(k, b);
    (put(k, r), ...);
  }
  template <class U, kmsl::enable_if_t<!kmsl::is_same<U, T>::value, int> = 0>
  explicit vec(const vec<U, N>& o) {  // elementwise value conversion
    for (int i = 0; i < N; i++) this->v[i] = T(o.v[i]);
  }
  T& operator[](int64_t i) { return this->v[i]; }
  const T& operator[](int64_t i) const { return this->v[i]; }
  template <int... I> kmsl::swz_ref<T, N, I...> swz(kmsl::sw<I...>) & { return kmsl::swz_ref<T, N, I...>(*this); }
  template <int... I> vec<T, sizeof...(I)> swz(kmsl::sw<I...>) const& {
    vec<T, sizeof...(I)> r;
    int k = 0;
    ((r.v[k++] = this->v[I]), ...);
    return r;
  }

 private:
  template <class U, int M> void put(int& k, const vec<U, M>& a) {
    for (int i = 0; i < M; i++) this->v[k++] = T(a.v[i]);
  }
  template <class U, kmsl::enable_if_t<!kmsl::is_vec<U>::value, int> = 0> void put(int& k, const U& a) {
    this->v[k++] = T(a);
  }
};
}  // namespace metal

namespace kmsl {
// `v.xy` (rewritten to v.swz(sw<0,1>{})) on an lvalue: a copy that writes back on assignment.
template <class T, int N, int... I> struct swz_ref : metal::vec<T, sizeof...(I)> {
  using base = metal::vec<T, sizeof...(I)>;
  metal::vec<T, N>* src;
  explicit swz_ref(metal::vec<T, N>& s) : src(&s) {
    int k = 0;
    ((this->v[k++] = s.v[I]), ...);
  }
  swz_ref& operator=(const base& o) {
    int k = 0;
    ((src->v[I] = o.v[k++]), ...);
    for (int i = 0; i < (int)sizeof...(I); i++) this->v[i] = o.v[i];
    return *this;
  }
  swz_ref& operator=(const swz_ref& o) { return *this = static_cast<const base&>(o); }
  template <class U> swz_ref& operator+=(const U& o) { return *this = base(static_cast<const base&>(*this) + o); }
  template <class U> swz_ref& operator-=(const U& o) { return *this = base(static_cast<const base&>(*this) - o); }
  template <class U> swz_ref& operator*=(const U& o) { return *this = base(static_cast<const base&>(*this) * o); }
  template <class U> swz_ref& operator/=(const U& o) { return *this = base(static_cast<const base&>(*this) / o); }
};
}  // namespace kmsl

namespace metal {
#define KMSL_VEC_BINOP(op)                                                                   \
  template <class T, int N> vec<T, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {  \
    vec<T, N> r;                                                                             \
    for (int i = 0; i < N; i++) r.v[i] = T(a.v[i] op b.v[i]);                                \
    return r;                                                                                \
  }                                                                                          \
  template <class T, int N> vec<T, N> operator op(const vec<T, N>& a, kmsl::ident_t<T> b) {  \
    vec<T, N> r;                                                                             \
    for (int i = 0; i < N; i++) r.v[i] = T(a.v[i] op b);                                     \
    return r;                                                                                \
  }                                                                                          \
  template <class T, int N> vec<T, N> operator op(kmsl::ident_t<T> a, const vec<T, N>& b) {  \
    vec<T, N> r;                                                                             \
    for (int i = 0; i < N; i++) r.v[i] = T(a op b.v[i]);                                     \
    return r;                                                                                \
  }                                                                                          \
  template <class T, int N, class U> vec<T, N>& operator op##=(vec<T, N>& a, const U& b) {   \
    a = a op b;                                                                              \
    return a;                                                                                \
  }
KMSL_VEC_BINOP(+)
KMSL_VEC_BINOP(-)
KMSL_VEC_BINOP(*)
KMSL_VEC_BINOP(/)
KMSL_VEC_BINOP(%)
KMSL_VEC_BINOP(&)
KMSL_VEC_BINOP(|)
KMSL_VEC_BINOP(^)
KMSL_VEC_BINOP(<<)
KMSL_VEC_BINOP(>>)
#undef KMSL_VEC_BINOP

#define KMSL_VEC_CMP(op)                                                                        \
  template <class T, int N> vec<bool, N> operator op(const vec<T, N>& a, const vec<T, N>& b) {  \
    vec<bool, N> r;                                                                             \
    for (int i = 0; i < N; i++) r.v[i] = a.v[i] op b.v[i];                                      \
    return r;                                                                                   \
  }                                                                                             \
  template <class T, int N> vec<bool, N> operator op(const vec<T, N>& a, kmsl::ident_t<T> b) {  \
    vec<bool, N> r;                                                                             \
    for (int i = 0; i < N; i++) r.v[i] = a.v[i] op b;                                           \
    return r;                                                                                   \
  }                                                                                             \
  template <class T, int N> vec<bool, N> operator op(kmsl::ident_t<T> a, const vec<T, N>& b) {  \
    vec<bool, N> r;                                                                             \
    for (int i = 0; i < N; i++) r.v[i] = a op b.v[i];                                           \
    return r;                                                                                   \
  }
KMSL_VEC_CMP(==)
KMSL_VEC_CMP(!=)
KMSL_VEC_CMP(<)
KMSL_VEC_CMP(>)
KMSL_VEC_CMP(<=)
KMSL_VEC_CMP(>=)
KMSL_VEC_CMP(&&)
KMSL_VEC_CMP(||)
#undef KMSL_VEC_CMP

template <class T, int N> vec<T, N> operator-(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r.v[i] = T(-a.v[i]);
  return r;
}
template <class T, int N> vec<T, N> operator+(const vec<T, N>& a) { return a; }
template <class T, int N> vec<T, N> operator~(const vec<T, N>& a) {
  vec<T, N> r;
  for (int i = 0; i < N; i++) r.v[i] = T(~a.v[i]);
  return r;
}
template <class T, int N> vec<bool, N> operator!(const vec<T, N>& a) {
  vec<bool, N> r;
  for (int i = 0; i < N; i++) r.v[i] = !a.v[i];
  return r;
}

#define KMSL_VEC_NAMES(T, name) \
  typedef vec<T, 2> name##2;    \
  typedef vec<T, 3> name##3;    \
  typedef vec<T, 4> name##4;    \
  typedef vec<T, 2> packed_##name##2; \
  typedef vec<T, 4> packed_##name##4;
KMSL_VEC_NAMES(float, float)
KMSL_VEC_NAMES(half, half)
KMSL_VEC_NAMES(bfloat, bfloat)
KMSL_VEC_NAMES(int, int)
KMSL_VEC_NAMES(uint, uint)
KMSL_VEC_NAMES(short, short)
KMSL_VEC_NAMES(ushort, ushort)
KMSL_VEC_NAMES(char, char)
KMSL_VEC_NAMES(uchar, uchar)
KMSL_VEC_NAMES(bool, bool)
KMSL_VEC_NAMES(long, long)
KMSL_VEC_NAMES(ulong, ulong)
#undef KMSL_VEC_NAMES

// MLX's type names (mlx/backend/metal/kernels/utils.h and get_type_string).
typedef half float16_t;
typedef bfloat bfloat16_t;

template <class To, class From> To as_type(const From& x) {
  static_assert(sizeof(To) == sizeof(From), "as_type: sizes differ");
  To r;
  __builtin_memcpy(&r, &x, sizeof(To));
  return r;
}

}  // namespace metal
