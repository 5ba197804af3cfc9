// kvmetal.sim: checked device pointers, atomics and threadgroup storage.
// A `device T*` parameter becomes dptr<T>: every access is bounds-checked
// (error names kernel, buffer and index) and counted (bytes loaded/stored,
// plus a byte map of what was loaded, for "distinct bytes read").
#pragma once
#include "abi.h"
#include "msl_types.h"

namespace kmsl {

[[noreturn, gnu::noinline, gnu::cold]] inline void fail_access(const KmslCounter* c, const char* what, int64_t off,
                                                                int64_t width, int64_t align) {
  const KmslBuf* b = c->buf;
  char msg[512];
  int kind = KMSL_OUT_OF_BOUNDS;
  const char* kernel = kmsl_rt_kernel_name();
  int64_t rel = off - b->start;
  int64_t index = width ? (rel >= 0 ? rel / width : -((-rel + width - 1) / width)) : 0;
  if (off >= 0 && off + width <= b->size) {
    kind = KMSL_MISALIGNED;
    __builtin_snprintf(msg, sizeof(msg),
                       "[%s] misaligned %s of %lld bytes from buffer '%s' at index %lld (byte offset %lld, "
                       "needs %lld-byte alignment)",
                       kernel, what, (long long)width, b->name, (long long)index, (long long)rel, (long long)align);
  } else {
    __builtin_snprintf(msg, sizeof(msg),
                       "[%s] out-of-bounds %s of buffer '%s' at index %lld (element of %lld bytes at byte offset "
                       "%lld; the buffer holds %lld bytes from its start)",
                       kernel, what, b->name, (long long)index, (long long)width, (long long)rel,
                       (long long)(b->size - b->start));
  }
  kmsl_rt_fail(kind, msg);
}

// Address spaces of checked pointers: device (1) and constant (2), as in the
// clang MSL check's stub. MLX binds inputs under 8 elements and the
// <name>_shape/_strides buffers as `constant`; Metal has no cast between the two
// (nor to threadgroup/thread memory), so neither has one here.
enum { KMSL_DEVICE = 1, KMSL_CONSTANT = 2 };
template <class T, int AS = KMSL_DEVICE> struct dptr;
template <class T> using cptr = dptr<T, KMSL_CONSTANT>;
template <class T> T declval_();
template <class T> struct dref;
template <class T> struct is_dref { static constexpr bool value = false; };
template <class T> struct is_dref<dref<T>> { static constexpr bool value = true; };

// Reference to one element behind a writable device pointer: reads count as
// loads, assignments as stores.
template <class T> struct dref {
  T* p;
  int64_t off;
  KmslCounter* c;
  operator T() const {
    c->loads += sizeof(T);
    c->load_ops++;
    __builtin_memset(c->buf->touched + off, 1, sizeof(T));
    return *p;
  }
  T get() const { return T(*this); }
  const dref& operator=(const T& v) const {
    c->stores += sizeof(T);
    c->store_ops++;
    __builtin_memset(c->buf->written + off, 1, sizeof(T));
    *p = v;
    return *this;
  }
  const dref& operator=(const dref& o) const { return *this = T(o); }
#define KMSL_DREF_OP(op) \
  template <class U> const dref& operator op##=(const U& v) const { T x = T(*this); x op## = v; return *this = x; }
  KMSL_DREF_OP(+) KMSL_DREF_OP(-) KMSL_DREF_OP(*) KMSL_DREF_OP(/) KMSL_DREF_OP(%)
  KMSL_DREF_OP(&) KMSL_DREF_OP(|) KMSL_DREF_OP(^) KMSL_DREF_OP(<<) KMSL_DREF_OP(>>)
#undef KMSL_DREF_OP
  dptr<T> operator&() const;
  // Arithmetic reads the element first, so `out[i] * 2.0f` works for vector elements too.
#define KMSL_DREF_BIN(op) \
  template <class U> auto operator op(const U& u) const -> decltype(kmsl::declval_<T>() op u) { return T(*this) op u; }
  KMSL_DREF_BIN(+) KMSL_DREF_BIN(-) KMSL_DREF_BIN(*) KMSL_DREF_BIN(/)
#undef KMSL_DREF_BIN
};
#define KMSL_DREF_RBIN(op)                                                                       \
  template <class U, class T, class = enable_if_t<!is_dref<U>::value>>                           \
  auto operator op(const U& u, const dref<T>& r) -> decltype(u op kmsl::declval_<T>()) {         \
    return u op T(r);                                                                            \
  }
KMSL_DREF_RBIN(+) KMSL_DREF_RBIN(-) KMSL_DREF_RBIN(*) KMSL_DREF_RBIN(/)
#undef KMSL_DREF_RBIN

template <class T> struct is_atomic { static constexpr bool value = false; };

template <class T, int AS> struct dptr {
  using elem = typename remove_cv<T>::type;
  char* base = nullptr;
  int64_t off = 0;
  int64_t size = 0;
  KmslCounter* c = nullptr;

  dptr() = default;
  explicit dptr(KmslCounter* ctr) : base(ctr->buf->data), off(ctr->buf->start), size(ctr->buf->size), c(ctr) {}
  dptr(char* b, int64_t o, int64_t s, KmslCounter* ctr) : base(b), off(o), size(s), c(ctr) {}
  // Pointer casts (`(device const half4*)p`) keep the buffer and the byte offset.
  template <class U, enable_if_t<!is_same<U, T>::value && !is_same<const U, T>::value, int> = 0>
  explicit dptr(const dptr<U, AS>& o) : base(o.base), off(o.off), size(o.size), c(o.c) {}
  // Adding const is implicit.
  template <class U, enable_if_t<is_same<const U, T>::value && !is_same<U, T>::value, int> = 0>
  dptr(const dptr<U, AS>& o) : base(o.base), off(o.off), size(o.size), c(o.c) {}
  // A cast across address spaces does not compile in Metal, so it does not here.
  template <class U, int B, enable_if_t<B != AS, int> = 0>
  explicit dptr(const dptr<U, B>&) {
    static_assert(B == AS, "MSL: no cast between the constant and device address spaces (MLX binds inputs "
                           "under 8 elements as constant: give the helper a constant overload)");
  }

  int64_t checked(int64_t i, const char* what) const {
    int64_t o = off + i * (int64_t)sizeof(T);
    if (__builtin_expect(o < 0 || o + (int64_t)sizeof(T) > size || ((uintptr_t)(base + o) % alignof(T)) != 0, 0))
      fail_access(c, what, o, sizeof(T), alignof(T));
    return o;
  }
  void count_load(int64_t o) const {
    c->loads += sizeof(T);
    c->load_ops++;
    __builtin_memset(c->buf->touched + o, 1, sizeof(T));
  }
  void count_store(int64_t o) const {
    c->stores += sizeof(T);
    c->store_ops++;
    __builtin_memset(c->buf->written + o, 1, sizeof(T));
  }

  // const element: a load; atomic element: a read-modify-write; else a proxy.
  template <class I> decltype(auto) operator[](I i) const {
    if constexpr (is_const<T>::value) {
      int64_t o = checked((int64_t)i, "load");
      count_load(o);
      return *(const elem*)(base + o);
    } else if constexpr (is_atomic<elem>::value) {
      int64_t o = checked((int64_t)i, "atomic access");
      count_load(o);
      count_store(o);
      return *(elem*)(base + o);
    } else {
      int64_t o = checked((int64_t)i, "access");
      return dref<T>{(T*)(base + o), o, c};
    }
  }
  decltype(auto) operator*() const { return (*this)[0]; }
  auto operator->() const {
    if constexpr (is_const<T>::value) {
      int64_t o = checked(0, "load");
      count_load(o);
      return (const elem*)(base + o);
    } else {
      int64_t o = checked(0, "access");
      count_load(o);
      count_store(o);
      return (T*)(base + o);
    }
  }
  template <class I> dptr operator+(I i) const { return dptr(base, off + (int64_t)i * (int64_t)sizeof(T), size, c); }
  template <class I> dptr operator-(I i) const { return dptr(base, off - (int64_t)i * (int64_t)sizeof(T), size, c); }
  template <class U> int64_t operator-(const dptr<U, AS>& o) const { return (off - o.off) / (int64_t)sizeof(T); }
  template <class I> dptr& operator+=(I i) { off += (int64_t)i * (int64_t)sizeof(T); return *this; }
  template <class I> dptr& operator-=(I i) { off -= (int64_t)i * (int64_t)sizeof(T); return *this; }
  dptr& operator++() { off += sizeof(T); return *this; }
  dptr& operator--() { off -= sizeof(T); return *this; }
  dptr operator++(int) { dptr r = *this; off += sizeof(T); return r; }
  dptr operator--(int) { dptr r = *this; off -= sizeof(T); return r; }
  template <class U> bool operator==(const dptr<U, AS>& o) const { return base + off == o.base + o.off; }
  template <class U> bool operator!=(const dptr<U, AS>& o) const { return base + off != o.base + o.off; }
  template <class U> bool operator<(const dptr<U, AS>& o) const { return base + off < o.base + o.off; }
  template <class U> bool operator<=(const dptr<U, AS>& o) const { return base + off <= o.base + o.off; }
  template <class U> bool operator>(const dptr<U, AS>& o) const { return base + off > o.base + o.off; }
  template <class U> bool operator>=(const dptr<U, AS>& o) const { return base + off >= o.base + o.off; }
  explicit operator bool() const { return base != nullptr; }
};
template <class I, class T, int AS> dptr<T, AS> operator+(I i, const dptr<T, AS>& p) { return p + i; }

template <class T> dptr<T> dref<T>::operator&() const {
  return dptr<T>(c->buf->data, off, c->buf->size, c);
}

// reinterpret_cast<> in kernels is rewritten to kmsl_cast<>, which also handles dptr.
template <class T> struct is_dptr { static constexpr bool value = false; };
template <class T, int AS> struct is_dptr<dptr<T, AS>> { static constexpr bool value = true; };
template <class To, class From> To kmsl_cast(From&& f) {
  if constexpr (is_dptr<decay_t<To>>::value) {
    static_assert(is_dptr<decay_t<From>>::value,
                  "MSL: a threadgroup or thread pointer cannot be cast to the device or constant address space");
    return To(f);
  } else {
    static_assert(!is_dptr<decay_t<From>>::value,
                  "MSL: a device or constant pointer cannot be cast to the threadgroup or thread address space");
    return reinterpret_cast<To>(f);
  }
}

// Every index into a threadgroup array is checked (translate.py wraps it).
template <class I> inline I tg_index(I i, int64_t extent, const char* name) {
  if (__builtin_expect((int64_t)i < 0 || (int64_t)i >= extent, 0)) {
    char msg[256];
    __builtin_snprintf(msg, sizeof(msg), "[%s] out-of-bounds access of threadgroup array '%s' at index %lld (it has %lld elements)",
                       kmsl_rt_kernel_name(), name, (long long)i, (long long)extent);
    kmsl_rt_fail(KMSL_OUT_OF_BOUNDS, msg);
  }
  return i;
}

// Threadgroup declarations become slots in the per-threadgroup arena (poisoned 0xFF).
template <class A> A* tg_array(int slot, const char* name) {
  return (A*)kmsl_rt_tg_alloc(slot, sizeof(A), alignof(A), name);
}

}  // namespace kmsl

namespace metal {

enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release, memory_order_acq_rel,
                    memory_order_seq_cst };
enum thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };

template <class T> struct atomic {
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<ulong> atomic_ulong;

}  // namespace metal

namespace kmsl {
template <class T> struct is_atomic<metal::atomic<T>> { static constexpr bool value = true; };
template <class T> metal::atomic<T>* atomic_obj(metal::atomic<T>* p) { return p; }
template <class T> metal::atomic<T>* atomic_obj(volatile metal::atomic<T>* p) { return (metal::atomic<T>*)p; }
template <class T> metal::atomic<T>* atomic_obj(const dptr<metal::atomic<T>>& p) { return &p[0]; }
template <class T> struct atomic_value { using type = void; };
template <class T> struct atomic_value<metal::atomic<T>*> { using type = T; };
template <class T> struct atomic_value<volatile metal::atomic<T>*> { using type = T; };
template <class T> struct atomic_value<dptr<metal::atomic<T>>> { using type = T; };
template <class P> using atomic_t = typename atomic_value<decay_t<P>>::type;

// Read-modify-write with a CAS loop (works for float as well as integers).
template <class T, class F> T atomic_rmw(T* addr, F f) {
  if constexpr (sizeof(T) == 4 || sizeof(T) == 8) {
    using B = typename cond<sizeof(T) == 4, uint32_t, uint64_t>::type;
    B* baddr = (B*)addr;
    B oldb = __atomic_load_n(baddr, __ATOMIC_RELAXED);
    for (;;) {
      T cur;
      __builtin_memcpy(&cur, &oldb, sizeof(T));
      T next = f(cur);
      B nextb;
      __builtin_memcpy(&nextb, &next, sizeof(T));
      if (__atomic_compare_exchange_n(baddr, &oldb, nextb, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return cur;
    }
  } else {  // 1- and 2-byte atomics do not exist in MSL device memory; plain RMW
    T old = *addr;
    *addr = f(old);
    return old;
  }
}
}  // namespace kmsl

namespace metal {
template <class P> kmsl::atomic_t<P> atomic_load_explicit(P obj, memory_order = memory_order_relaxed) {
  auto* a = kmsl::atomic_obj(obj);
  return kmsl::atomic_rmw(&a->value, [](auto x) { return x; });
}
template <class P> void atomic_store_explicit(P obj, kmsl::ident_t<kmsl::atomic_t<P>> v, memory_order = memory_order_relaxed) {
  auto* a = kmsl::atomic_obj(obj);
  kmsl::atomic_rmw(&a->value, [v](auto) { return v; });
}
#define KMSL_ATOMIC_RMW(name, expr)                                                                   \
  template <class P>                                                                                  \
  kmsl::atomic_t<P> name(P obj, kmsl::ident_t<kmsl::atomic_t<P>> v, memory_order = memory_order_relaxed) { \
    using T = kmsl::atomic_t<P>;                                                                      \
    auto* a = kmsl::atomic_obj(obj);                                                                  \
    return kmsl::atomic_rmw(&a->value, [v](T x) { return T(expr); });                                 \
  }
KMSL_ATOMIC_RMW(atomic_exchange_explicit, v)
KMSL_ATOMIC_RMW(atomic_fetch_add_explicit, x + v)
KMSL_ATOMIC_RMW(atomic_fetch_sub_explicit, x - v)
KMSL_ATOMIC_RMW(atomic_fetch_and_explicit, x & v)
KMSL_ATOMIC_RMW(atomic_fetch_or_explicit, x | v)
KMSL_ATOMIC_RMW(atomic_fetch_xor_explicit, x ^ v)
KMSL_ATOMIC_RMW(atomic_fetch_min_explicit, v < x ? v : x)
KMSL_ATOMIC_RMW(atomic_fetch_max_explicit, x < v ? v : x)
#undef KMSL_ATOMIC_RMW
// Fences order device memory between threads; OS threads here see each other's
// writes through the RMW loop above, so a full fence is enough.
template <class F, class... Rest> inline void atomic_thread_fence(F, Rest...) { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

template <class P>
bool atomic_compare_exchange_weak_explicit(P obj, kmsl::atomic_t<P>* expected, kmsl::ident_t<kmsl::atomic_t<P>> desired,
                                           memory_order = memory_order_relaxed, memory_order = memory_order_relaxed) {
  using T = kmsl::atomic_t<P>;
  auto* a = kmsl::atomic_obj(obj);
  bool ok = false;
  T want = *expected;
  T old = kmsl::atomic_rmw(&a->value, [&](T x) {
    ok = __builtin_memcmp(&x, &want, sizeof(T)) == 0;
    return ok ? desired : x;
  });
  if (!ok) *expected = old;
  return ok;
}
}  // namespace metal
