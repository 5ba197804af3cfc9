// kvmetal.sim: simdgroup collectives, quad collectives and barriers.
// Each call yields to the scheduler; the scheduler resolves one call site of
// one simdgroup at a time, over the lanes that reached it (Metal's rule: a
// collective inside a branch combines only the lanes that took the branch).
// The call site is a number translate.py gives each call in the MSL text
// (else the return address of the noinline overloads).
#pragma once
#include "abi.h"
#include "msl_math.h"

namespace metal {
enum class mem_flags { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4, mem_threadgroup_imageblock = 8,
                       mem_object_data = 16 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(int(a) | int(b)); }
}  // namespace metal

namespace kmsl {

template <class T> const T& in_of(const KmslGroup* g, int l) { return *(const T*)g->lanes[l]->in; }
template <class T> T& out_of(const KmslGroup* g, int l) { return *(T*)g->lanes[l]->out; }
inline bool active(const KmslGroup* g, int l) { return (g->active >> l) & 1u; }

struct op_add { template <class T> T operator()(const T& a, const T& b) const { return T(a + b); } };
struct op_mul { template <class T> T operator()(const T& a, const T& b) const { return T(a * b); } };
struct op_max { template <class T> T operator()(const T& a, const T& b) const { using metal::max; return max(a, b); } };
struct op_min { template <class T> T operator()(const T& a, const T& b) const { using metal::min; return min(a, b); } };
struct op_and { template <class T> T operator()(const T& a, const T& b) const { return T(a & b); } };
struct op_or { template <class T> T operator()(const T& a, const T& b) const { return T(a | b); } };
struct op_xor { template <class T> T operator()(const T& a, const T& b) const { return T(a ^ b); } };

// Reduction over the active lanes of each W-lane group (W = 32: simdgroup, 4: quad).
template <class T, class Op, int W> int resolve_reduce(KmslGroup* g) {
  for (int q = 0; q < 32; q += W) {
    bool have = false;
    T acc{};
    for (int l = q; l < q + W; l++)
      if (active(g, l)) {
        acc = have ? Op()(acc, in_of<T>(g, l)) : in_of<T>(g, l);
        have = true;
      }
    for (int l = q; l < q + W; l++)
      if (active(g, l)) out_of<T>(g, l) = acc;
  }
  return 0;
}

template <class T, class Op, bool Inclusive> int resolve_prefix(KmslGroup* g) {
  bool have = false;
  T acc{};
  for (int l = 0; l < 32; l++) {
    if (!active(g, l)) continue;
    const T x = in_of<T>(g, l);
    if (Inclusive) {
      acc = have ? Op()(acc, x) : x;
      out_of<T>(g, l) = acc;
    } else {
      out_of<T>(g, l) = have ? acc : T(0);
      acc = have ? Op()(acc, x) : x;
    }
    have = true;
  }
  return 0;
}

enum ShuffleKind { SH_INDEX, SH_XOR, SH_UP, SH_DOWN, SH_ROTATE_DOWN, SH_ROTATE_UP, SH_BROADCAST_FIRST };

// Each lane reads the value of a source lane; a source lane that is inactive
// yields poison (all bits set), or an error under strict mode.
template <class T, int Kind, int W> int resolve_shuffle(KmslGroup* g) {
  int first = __builtin_ctz(g->active);
  for (int l = 0; l < 32; l++) {
    if (!active(g, l)) continue;
    int64_t a = g->lanes[l]->arg;
    int q = l / W * W, i = l % W, src;
    switch (Kind) {
      case SH_INDEX: src = q + (int)(a % W); break;
      case SH_XOR: src = q + (int)((i ^ a) % W); break;
      case SH_UP: src = i - a < 0 ? l : l - (int)a; break;
      case SH_DOWN: src = i + a >= W ? l : l + (int)a; break;
      case SH_ROTATE_DOWN: src = q + (int)((i + a) % W); break;
      case SH_ROTATE_UP: src = q + (int)(((i - a) % W + W) % W); break;
      default: src = first; break;
    }
    if (active(g, src)) {
      out_of<T>(g, l) = in_of<T>(g, src);
    } else {
      if (g->strict) {
        __builtin_snprintf(g->err, 256, "lane %d reads lane %d, which is inactive or does not exist (strict mode)", l, src);
        return 1;
      }
      __builtin_memset(&out_of<T>(g, l), 0xff, sizeof(T));
    }
  }
  return 0;
}

inline int resolve_nothing(KmslGroup*) { return 0; }

inline int resolve_ballot(KmslGroup* g) {
  uint64_t mask = 0;
  for (int l = 0; l < 32; l++)
    if (active(g, l) && in_of<bool>(g, l)) mask |= 1ull << l;
  for (int l = 0; l < 32; l++)
    if (active(g, l)) out_of<uint64_t>(g, l) = mask;
  return 0;
}
inline int resolve_all(KmslGroup* g) {  // every active lane's b is true
  uint64_t mask = 0;
  for (int l = 0; l < 32; l++)
    if (active(g, l) && in_of<bool>(g, l)) mask |= 1ull << l;
  for (int l = 0; l < 32; l++)
    if (active(g, l)) out_of<bool>(g, l) = mask == uint64_t(g->active);
  return 0;
}
inline int resolve_active_mask(KmslGroup* g) {
  for (int l = 0; l < 32; l++)
    if (active(g, l)) out_of<uint64_t>(g, l) = g->active;
  return 0;
}
inline int resolve_is_first(KmslGroup* g) {
  int first = __builtin_ctz(g->active);
  for (int l = 0; l < 32; l++)
    if (active(g, l)) out_of<bool>(g, l) = l == first;
  return 0;
}

// `words`: the instructions the collective counts as (KmslCollective::words).
template <class R, class T>
inline R collective(const void* site, const char* op, int (*resolve)(KmslGroup*), const T& x, int64_t arg,
                    int32_t words = 1) {
  R out;
  KmslCollective c{site, op, resolve, &x, &out, arg, words};
  kmsl_rt_collective(&c);
  return out;
}
// A value collective (reduction, scan, shuffle, broadcast) is one instruction per
// 32-bit word of its value: a float2 shuffle is two, a float4 sum four.
template <class T> constexpr int32_t value_words() { return int32_t((sizeof(T) + 3) / 4); }
#define KMSL_SITE kmsl::site_t(__builtin_return_address(0))
// A call site: translate.py numbers every collective/barrier call in the MSL
// text (robust to the optimizer duplicating code); calls it did not rewrite
// fall back to the return address.
struct site_t {
  const void* p;
  explicit site_t(const void* ra) : p(ra) {}
  explicit site_t(int id) : p((const void*)(uintptr_t)(id + 1)) {}
};
}  // namespace kmsl

namespace metal {

struct simd_vote {
  typedef uint64_t vote_t;
  vote_t bits;
  explicit operator vote_t() const { return bits; }
  bool all() const { return bits == 0xffffffffull; }
  bool any() const { return bits != 0; }
};

#define KMSL_REDUCE(name, Op, W)                                                                   \
  template <class T> T name(kmsl::site_t s, T x) {                                                 \
    return kmsl::collective<T>(s.p, #name, &kmsl::resolve_reduce<T, kmsl::Op, W>, x, 0,            \
                                 kmsl::value_words<T>());                                          \
  }                                                                                                \
  template <class T> [[gnu::noinline]] T name(T x) { return name(KMSL_SITE, x); }
KMSL_REDUCE(simd_sum, op_add, 32)
KMSL_REDUCE(simd_product, op_mul, 32)
KMSL_REDUCE(simd_max, op_max, 32)
KMSL_REDUCE(simd_min, op_min, 32)
KMSL_REDUCE(simd_and, op_and, 32)
KMSL_REDUCE(simd_or, op_or, 32)
KMSL_REDUCE(simd_xor, op_xor, 32)
KMSL_REDUCE(quad_sum, op_add, 4)
KMSL_REDUCE(quad_product, op_mul, 4)
KMSL_REDUCE(quad_max, op_max, 4)
KMSL_REDUCE(quad_min, op_min, 4)
#undef KMSL_REDUCE

#define KMSL_PREFIX(name, Op, Incl)                                                                 \
  template <class T> T name(kmsl::site_t s, T x) {                                                  \
    return kmsl::collective<T>(s.p, #name, &kmsl::resolve_prefix<T, kmsl::Op, Incl>, x, 0,          \
                                 kmsl::value_words<T>());                                           \
  }                                                                                                 \
  template <class T> [[gnu::noinline]] T name(T x) { return name(KMSL_SITE, x); }
KMSL_PREFIX(simd_prefix_inclusive_sum, op_add, true)
KMSL_PREFIX(simd_prefix_exclusive_sum, op_add, false)
KMSL_PREFIX(simd_prefix_inclusive_product, op_mul, true)
KMSL_PREFIX(simd_prefix_exclusive_product, op_mul, false)
#undef KMSL_PREFIX

#define KMSL_SHUFFLE(name, Kind, W)                                                                          \
  template <class T, class I> T name(kmsl::site_t s, T x, I arg) {                                           \
    return kmsl::collective<T>(s.p, #name, &kmsl::resolve_shuffle<T, kmsl::Kind, W>, x, (int64_t)arg,        \
                                 kmsl::value_words<T>());                                                    \
  }                                                                                                          \
  template <class T, class I> [[gnu::noinline]] T name(T x, I arg) { return name(KMSL_SITE, x, arg); }
KMSL_SHUFFLE(simd_shuffle, SH_INDEX, 32)
KMSL_SHUFFLE(simd_shuffle_xor, SH_XOR, 32)
KMSL_SHUFFLE(simd_shuffle_up, SH_UP, 32)
KMSL_SHUFFLE(simd_shuffle_down, SH_DOWN, 32)
KMSL_SHUFFLE(simd_shuffle_rotate_down, SH_ROTATE_DOWN, 32)
KMSL_SHUFFLE(simd_shuffle_rotate_up, SH_ROTATE_UP, 32)
KMSL_SHUFFLE(simd_broadcast, SH_INDEX, 32)
KMSL_SHUFFLE(quad_shuffle, SH_INDEX, 4)
KMSL_SHUFFLE(quad_shuffle_xor, SH_XOR, 4)
KMSL_SHUFFLE(quad_shuffle_up, SH_UP, 4)
KMSL_SHUFFLE(quad_shuffle_down, SH_DOWN, 4)
KMSL_SHUFFLE(quad_broadcast, SH_INDEX, 4)
#undef KMSL_SHUFFLE

template <class T> T simd_broadcast_first(kmsl::site_t s, T x) {
  return kmsl::collective<T>(s.p, "simd_broadcast_first", &kmsl::resolve_shuffle<T, kmsl::SH_BROADCAST_FIRST, 32>, x, 0, kmsl::value_words<T>());
}
template <class T> [[gnu::noinline]] T simd_broadcast_first(T x) { return simd_broadcast_first(KMSL_SITE, x); }
inline simd_vote simd_ballot(kmsl::site_t s, bool b) {
  return simd_vote{kmsl::collective<uint64_t>(s.p, "simd_ballot", &kmsl::resolve_ballot, b, 0)};
}
[[gnu::noinline]] inline simd_vote simd_ballot(bool b) { return simd_ballot(KMSL_SITE, b); }
inline bool simd_all(kmsl::site_t s, bool b) {
  return kmsl::collective<bool>(s.p, "simd_all", &kmsl::resolve_all, b, 0);
}
[[gnu::noinline]] inline bool simd_all(bool b) { return simd_all(KMSL_SITE, b); }
inline bool simd_any(kmsl::site_t s, bool b) {
  return kmsl::collective<uint64_t>(s.p, "simd_any", &kmsl::resolve_ballot, b, 0) != 0;
}
[[gnu::noinline]] inline bool simd_any(bool b) { return simd_any(KMSL_SITE, b); }
inline simd_vote simd_active_threads_mask(kmsl::site_t s) {
  return simd_vote{kmsl::collective<uint64_t>(s.p, "simd_active_threads_mask", &kmsl::resolve_active_mask, 0, 0)};
}
[[gnu::noinline]] inline simd_vote simd_active_threads_mask() { return simd_active_threads_mask(KMSL_SITE); }
inline bool simd_is_first(kmsl::site_t s) {
  return kmsl::collective<bool>(s.p, "simd_is_first", &kmsl::resolve_is_first, 0, 0);
}
[[gnu::noinline]] inline bool simd_is_first() { return simd_is_first(KMSL_SITE); }

inline void threadgroup_barrier(kmsl::site_t s, mem_flags = mem_flags::mem_none) {
  kmsl_rt_barrier(s.p, "threadgroup_barrier");
}
[[gnu::noinline]] inline void threadgroup_barrier(mem_flags f = mem_flags::mem_none) { threadgroup_barrier(KMSL_SITE, f); }
inline void simdgroup_barrier(kmsl::site_t s, mem_flags = mem_flags::mem_none) {
  kmsl::collective<int>(s.p, "simdgroup_barrier", &kmsl::resolve_nothing, 0, 0);
}
[[gnu::noinline]] inline void simdgroup_barrier(mem_flags f = mem_flags::mem_none) { simdgroup_barrier(KMSL_SITE, f); }

}  // namespace metal
