// Shared MSL helpers for the kvmetal kernels.
//
// This text is passed as `header=` to mx.fast.metal_kernel (followed by the
// helper section of the kernel's family file), so it must stand alone: no
// #include of our own files, no `#pragma once` (MLX pastes it into one
// translation unit per kernel).
//
// Row sources of gather_kv_rows: row t of the current (sequence, kv head) is
// read through a "rows" object in TASKS pieces of TASK_ELEMS elements each. A
// float cache reads a vec4 per task; a quantized cache dequantizes one whole
// group per task, so every packed word, scale and bias is loaded exactly once.
// The attention kernels read rows their own way (attention.metal).
#ifndef KVMETAL_COMMON_H
#define KVMETAL_COMMON_H

#include <metal_stdlib>
using namespace metal;

// Full unrolling of a loop over register arrays (fragments, rows): an array the
// compiler cannot index with constants after unrolling goes to memory.
#define KV_UNROLL _Pragma("clang loop unroll(full)")

// A finite stand-in for -inf: Metal compiles with fast math, which may assume
// no infinities, and exp(KV_NEG_BIG - m) still underflows to exactly 0.
static constant constexpr const float KV_NEG_BIG = -1.0e30f;

// ---------------------------------------------------------------- vec4 loads

// Element-wise construction and widening, spelled so that the same code means
// the same thing to Apple's compiler, the simulator and the clang MSL check.
inline float4 kv_float4(float a, float b, float c, float d) {
  float4 v;
  v.x = a;
  v.y = b;
  v.z = c;
  v.w = d;
  return v;
}
inline float2 kv_float2(float a, float b) {
  float2 v;
  v.x = a;
  v.y = b;
  return v;
}
// Two half4s as one 16-byte unit (a uint4 store of threadgroup memory).
inline uint4 kv_join16(half4 a, half4 b) {
  const uint2 lo = as_type<uint2>(a);
  const uint2 hi = as_type<uint2>(b);
  uint4 w;
  w.x = lo.x;
  w.y = lo.y;
  w.z = hi.x;
  w.w = hi.y;
  return w;
}
inline float4 kv_widen(half4 h) { return kv_float4(float(h.x), float(h.y), float(h.z), float(h.w)); }
inline float4 kv_widen(float4 v) { return v; }

// One vectorized load of four elements, widened to float.
inline float4 kv_load4(const device float* p) { return *reinterpret_cast<const device float4*>(p); }
inline float4 kv_load4(const device half* p) { return kv_widen(*reinterpret_cast<const device half4*>(p)); }
// bfloat vectors exist only on newer Metal; four scalar loads are the portable form.
inline float4 kv_load4(const device bfloat16_t* p) {
  return kv_float4(static_cast<float>(p[0]), static_cast<float>(p[1]), static_cast<float>(p[2]),
                   static_cast<float>(p[3]));
}

// MLX binds every input with fewer than 8 elements as `const constant T*` (e.g. a
// quantized decode's scales at T <= 7, or its 2-bit data at T = 1). Metal has no
// cast from `constant` to `device`, so every load helper that takes a device
// pointer has a constant overload, with scalar loads.
template <typename T>
inline float4 kv_load4(const constant T* p) {
  return kv_float4(static_cast<float>(p[0]), static_cast<float>(p[1]), static_cast<float>(p[2]),
                   static_cast<float>(p[3]));
}

template <typename TO, typename PO>
inline void kv_store4(PO dst, float4 v) {
  dst[0] = static_cast<TO>(v.x);
  dst[1] = static_cast<TO>(v.y);
  dst[2] = static_cast<TO>(v.z);
  dst[3] = static_cast<TO>(v.w);
}

// ------------------------------------------------------- affine dequantization

// Dequantize one group of GS values packed BITS each, little-endian along the
// row (MLX's layout; 3/5/6-bit values straddle word boundaries). Each of the
// GS * BITS / 32 words is loaded once; a 64-bit window holds the bits in flight.
template <int BITS, int GS, typename TO, typename PW, typename PO>
inline void kv_dequant_group(PW words, size_t word_step, float scale, float bias, PO dst) {
  constexpr uint64_t MASK = (uint64_t(1) << BITS) - 1;
  uint64_t window = 0;
  int have = 0;
  int next = 0;
  for (int i = 0; i < GS; i++) {
    if (have < BITS) {
      window |= uint64_t(words[next * word_step]) << have;
      next++;
      have += 32;
    }
    dst[i] = static_cast<TO>(scale * float(uint(window & MASK)) + bias);
    window >>= BITS;
    have -= BITS;
  }
}

// ---------------------------------------------------------------- row sources

// Where one cache row starts, in elements of each of the row's arrays.
struct KvRowAt {
  size_t data;
  size_t scale;
  size_t bias;
  size_t data_step;   // element stride along the row (1 except in odd strided views)
  size_t scale_step;  // group stride of scales/biases
  size_t bias_step;
};

// Paged cache [num_blocks, Hkv, BS, W]: token t of one (sequence, kv head) is
// row (block_tables[t / BS] * Hkv + kvh) * BS + t % BS. W is the row width of
// the data array (D, or D * BITS / 32 words) and NG the groups per row.
template <int BS, int W, int NG, typename PT>
struct PagedRowIndex {
  PT table;  // this sequence's block table row (device or constant int*)
  int num_kv_heads;
  int kvh;
  KvRowAt operator()(int t) const {
    size_t row = (size_t(table[t / BS]) * num_kv_heads + kvh) * BS + (t % BS);
    return KvRowAt{row * W, row * NG, row * NG, 1, 1, 1};
  }
};

// Float rows: data [..., D] of the cache's float type (PD's element type);
// scales/biases are unused placeholders.
template <int BITS, int GS, int D, typename PD, typename PS>
struct FloatRows {
  static constant constexpr const int TASKS = D / 4;
  static constant constexpr const int TASK_ELEMS = 4;
  PD data;
  PS scales;
  PS biases;
  template <typename TO, typename PO>
  void read(KvRowAt at, int task, PO dst) const {
    if (at.data_step == 1) {
      kv_store4<TO>(dst + task * 4, kv_load4(data + at.data + task * 4));
    } else {
      const size_t e = at.data + task * 4 * at.data_step;
      kv_store4<TO>(dst + task * 4,
                    kv_float4(static_cast<float>(data[e]), static_cast<float>(data[e + at.data_step]),
                              static_cast<float>(data[e + 2 * at.data_step]),
                              static_cast<float>(data[e + 3 * at.data_step])));
    }
  }
};

// Quantized rows: data uint32 [..., D * BITS / 32], scales/biases [..., D / GS]
// of the cache's float type (PS's element type).
template <int BITS, int GS, int D, typename PD, typename PS>
struct QuantRows {
  static constant constexpr const int TASKS = D / GS;
  static constant constexpr const int TASK_ELEMS = GS;
  static constant constexpr const int GROUP_WORDS = GS * BITS / 32;
  PD data;
  PS scales;
  PS biases;
  template <typename TO, typename PO>
  void read(KvRowAt at, int task, PO dst) const {
    const float s = static_cast<float>(scales[at.scale + task * at.scale_step]);
    const float b = static_cast<float>(biases[at.bias + task * at.bias_step]);
    kv_dequant_group<BITS, GS, TO>(data + at.data + task * GROUP_WORDS * at.data_step, at.data_step,
                                   s, b, dst + task * GS);
  }
};

// BITS == 0 selects the float cache, any other value the quantized one.
template <int BITS, int GS, int D, typename PD, typename PS>
struct RowsSelect {
  typedef QuantRows<BITS, GS, D, PD, PS> type;
};
template <int GS, int D, typename PD, typename PS>
struct RowsSelect<0, GS, D, PD, PS> {
  typedef FloatRows<0, GS, D, PD, PS> type;
};

// Row width (elements of the data array) and groups per row of a cache.
template <int BITS, int GS, int D>
struct RowShape {
  static constant constexpr const int WIDTH = BITS ? D * BITS / 32 : D;
  static constant constexpr const int GROUPS = BITS ? D / GS : 1;
};

// ------------------------------------------------------------ kernel params

// The attention kernels' scalar parameters: one struct read from an int32
// buffer (floats stored bit-for-bit). kvmetal/backends/metal_specs.py packs it from
// ATTENTION_PARAMS, whose field list must match this struct, in this order.
struct KvAttnParams {
  int num_kv_heads;
  int num_heads;
  int query_len;    // L: query rows per sequence and head (1..8)
  int num_splits;
  int max_blocks;   // paged: block-table width M; contiguous: unused
  int num_blocks;   // paged: N, the guard for block ids; contiguous: unused
  int window;       // sliding window (0 = off)
  int num_tokens;   // contiguous: T; paged: unused
  float scale;
  float softcap;    // 0 = off
  int head_div;     // reduce: head of row r is (r / head_div) % num_heads
  float sparse_v;   // sparse V threshold tau on exp2(s - m_running); read only by SV = 1 kernels
  int split_tokens; // > 0: split k of a sequence is its k-th window of this many tokens, cut at
                    // the multiples of split_tokens (batch invariance); 0: num_splits equal runs
  int split_max;    // split_div > 0: a sequence of length len gets windows of
  int split_div;    // clamp(pow2ceil(len) / div, split_tokens, split_max), div = split_div, and
  int split_grow;   // split_div * split_grow once the window has doubled (attention.metal)
};

// A kernel's parameter struct P, read in place from its int32 `params` buffer
// (packed with at least 8 entries, so MLX binds it as device memory).
template <typename P, typename PI>
inline const device P& kv_params(PI params) {
  return *reinterpret_cast<const device P*>(params);
}

// gather_kv_rows' parameters (metal_specs.GATHER_PARAMS packs them).
struct KvGatherParams {
  int num_kv_heads;
  int max_blocks;
  int max_len;
  int num_blocks;  // N, the guard for block ids
};

// ---------------------------------------------------------- softmax states

// log2(e): scores are kept in log2 units (scaled by scale * log2(e)) so
// every exponential is one exp2.
static constant constexpr const float KV_LOG2E = 1.44269504088896341f;

// ------------------------------------------------------- attention variant
//
// What an attention kernel does to a score, defined once for decode, varlen and
// cascade (after FlashInfer's attention variants): the score's scale, the
// softcap, the causal and sliding-window masks, the sinks' place in the
// softmax, and the exponential. Kernels call these and never spell the math
// themselves: tools/msl_check.py fails on exp2 / exp / tanh / log / rsqrt
// called anywhere but in the one helper that owns it (kv_exp2 below), because
// the attention kernels build with relaxed (fast) math on macOS 15+, where a
// bare tanh is NaN past |x| ~ 44 and silently drops the highest-scoring keys.

// The kernels' one exponential. Every argument is a difference of log2-unit
// scores (<= 0 once the running max is in) or a bounded tanh argument, where
// fast exp2 is exact enough and cannot overflow into the result.
inline float kv_exp2(float x) {
  return exp2(x);
}

// tanh exact to a few ulp over the whole float range, finite under fast math
// (Metal's fast tanh is (e^2x - 1) / (e^2x + 1), NaN once e^2x overflows, x > ~44).
// - |x| < 0.625: x + x y P(y), y = x^2, P a degree-5 fit of (tanh(x) / x - 1) / y
//   (Chebyshev nodes, float64; under 1 ulp evaluated in float32). A softcap far
//   above the scores lives here: (1 - e) / (1 + e) lost ~ulp / |x| of relative
//   precision and was 0 below |x| ~ 3e-8, so a cap of 1e30 gave uniform attention
//   (issue 41, defect 2). Tiny x returns x itself (y underflows).
// - 0.625 <= |x| < 9.5: (1 - e) / (1 + e), e = 2^(-2 log2(e) |x|) in (0, 0.29]:
//   nothing overflows and 1 - e loses no digits.
// - |x| >= 9.5 (inf too): +-1 (tanh rounds to 1 in float32 past ~9.01).
// A NaN argument fails every compare and takes the exponential: NaN out.
inline float kv_tanh(float x) {
  const float a = fabs(x);
  const float y = a < 0.625f ? x * x : 0.0f;
  const float poly = -0.3333333432674408f +
                     y * (0.13333304226398468f +
                          y * (-0.05395938456058502f +
                               y * (0.02176983468234539f + y * (-0.00834665633738041f + y * 0.0022955394815653563f))));
  const float e = kv_exp2(-2.0f * KV_LOG2E * a);
  const float curved = copysign((1.0f - e) / (1.0f + e), x);
  return a < 0.625f ? x + x * y * poly : (a >= 9.5f ? copysign(1.0f, x) : curved);
}

// The first key a query at position pos sees under a sliding window (0 = off).
inline int kv_first_visible(int pos, int window) {
  return window > 0 ? max(0, pos - window + 1) : 0;
}

// The score path of one launch (from KvAttnParams' scale, softcap, window).
struct KvVariant {
  float q_scale;   // scale * log2(e), or scale alone under a softcap: on the query (varlen's
                   // Q fragments) or on q . k (the decode partials, whose q stays 16-bit)
  float softcap;   // 0 = off
  float cap_log2;  // softcap * log2(e)
  int window;      // sliding window, 0 = off

  // q_scale * (q . k) -> the key's logit in log2 units (softcap through kv_tanh).
  float logit(float s) const {
    return softcap > 0.0f ? cap_log2 * kv_tanh(s / softcap) : s;
  }
  // Whether a query at position pos sees key t (causal, sliding window).
  bool visible(int t, int pos) const {
    return t <= pos && (window <= 0 || t > pos - window);
  }
  // The first key a query at position pos sees.
  int first_visible(int pos) const {
    return kv_first_visible(pos, window);
  }
};

inline KvVariant kv_variant(float scale, float softcap, int window) {
  KvVariant v;
  v.softcap = softcap > 0.0f ? softcap : 0.0f;
  v.q_scale = v.softcap > 0.0f ? scale : scale * KV_LOG2E;
  v.cap_log2 = v.softcap * KV_LOG2E;
  v.window = window;
  return v;
}

// A key's weight against the running max m (both in log2 units).
inline float kv_weight(float s, float m) {
  return kv_exp2(s - m);
}

// A sink (one logit per query head, natural units) joins the softmax
// denominator as a key with no value: the state (max, sum) it starts a row with.
inline float kv_sink_logit(float sink) {
  return sink * KV_LOG2E;
}

// The one softmax-state merge: states (m_a, l_a, o_a) and (m_b, l_b, o_b), with
// maxima in log2 units, combine as m = max(m_a, m_b), l = l_a * scale_a +
// l_b * scale_b, o = o_a * scale_a + o_b * scale_b. Used by the simdgroup merge
// inside the partial kernels (the reduces across splits use kv_fold_splits).
struct KvSoftmaxMerge {
  float m;
  float scale_a;
  float scale_b;
};
inline KvSoftmaxMerge kv_softmax_merge(float m_a, float m_b) {
  KvSoftmaxMerge r;
  r.m = max(m_a, m_b);
  r.scale_a = kv_weight(m_a, r.m);
  r.scale_b = kv_weight(m_b, r.m);
  return r;
}

// ------------------------------------------------- storage-type vector loads

// Two adjacent threadgroup elements in one load of their storage type (half2,
// float2, or bfloat as ushort2): an 8x8 fragment's two columns of one lane.
template <typename T>
struct KvVec2;
template <>
struct KvVec2<float> {
  static float2 load(const threadgroup float* p) {
    return *reinterpret_cast<const threadgroup float2*>(p);
  }
};
template <>
struct KvVec2<half> {
  static float2 load(const threadgroup half* p) {
    const half2 v = *reinterpret_cast<const threadgroup half2*>(p);
    return kv_float2(float(v.x), float(v.y));
  }
};
template <>
struct KvVec2<bfloat16_t> {
  static float2 load(const threadgroup bfloat16_t* p) {
    const ushort2 v = *reinterpret_cast<const threadgroup ushort2*>(p);
    return kv_float2(as_type<float>(uint(v.x) << 16), as_type<float>(uint(v.y) << 16));
  }
};

// KvVec4<T>: four elements of type T as stored (`type`: float4 (16 bytes), half4
// (8 bytes), or bfloat as ushort4 (8 bytes; a bfloat is the top half of a float, so
// widening is a shift and works on every Metal version)), `widen` to float4, and
// `pack` four scalars into `type` bit for bit.
template <typename T>
struct KvVec4 {
  typedef float4 type;
  static float4 widen(float4 v) { return v; }
  static float4 pack(T a, T b, T c, T d) { return kv_float4(float(a), float(b), float(c), float(d)); }
};
template <>
struct KvVec4<half> {
  typedef half4 type;
  static float4 widen(half4 v) { return kv_widen(v); }
  static half4 pack(half a, half b, half c, half d) {
    half4 v;
    v.x = a;
    v.y = b;
    v.z = c;
    v.w = d;
    return v;
  }
};
template <>
struct KvVec4<bfloat16_t> {
  typedef ushort4 type;
  static float4 widen(ushort4 v) {
    return kv_float4(as_type<float>(uint(v.x) << 16), as_type<float>(uint(v.y) << 16),
                     as_type<float>(uint(v.z) << 16), as_type<float>(uint(v.w) << 16));
  }
  // A bfloat's bits are the top half of its (exact) float: portable to Metal versions
  // where bfloat16_t is MLX's struct rather than a scalar type.
  static ushort bits(bfloat16_t x) { return ushort(as_type<uint>(float(x)) >> 16); }
  static ushort4 pack(bfloat16_t a, bfloat16_t b, bfloat16_t c, bfloat16_t d) {
    ushort4 v;
    v.x = bits(a);
    v.y = bits(b);
    v.z = bits(c);
    v.w = bits(d);
    return v;
  }
};

// Four elements as stored (KvVec4<T>::type, not widened): one vector load, or
// four scalar loads from a constant buffer or `step` elements apart.
template <typename T>
inline typename KvVec4<T>::type kv_raw4(const device T* p) {
  typedef typename KvVec4<T>::type V4;
  return *reinterpret_cast<const device V4*>(p);
}
template <typename T>
inline typename KvVec4<T>::type kv_raw4(const threadgroup T* p) {
  typedef typename KvVec4<T>::type V4;
  return *reinterpret_cast<const threadgroup V4*>(p);
}
template <typename T>
inline typename KvVec4<T>::type kv_raw4(const constant T* p) {
  return KvVec4<T>::pack(p[0], p[1], p[2], p[3]);
}
template <typename T, typename PT>
inline typename KvVec4<T>::type kv_raw4_strided(PT p, size_t step) {
  return KvVec4<T>::pack(p[0], p[step], p[2 * step], p[3 * step]);
}

// AW packed words in as few loads as their alignment allows (uint4, uint2, words).
template <int AW>
inline void kv_words(const device uint32_t* p, thread uint* w) {
  if (AW % 4 == 0) {
    for (int i = 0; i < AW; i += 4) {
      const uint4 v = *reinterpret_cast<const device uint4*>(p + i);
      w[i] = v.x;
      w[i + 1] = v.y;
      w[i + 2] = v.z;
      w[i + 3] = v.w;
    }
  } else if (AW % 2 == 0) {
    for (int i = 0; i < AW; i += 2) {
      const uint2 v = *reinterpret_cast<const device uint2*>(p + i);
      w[i] = v.x;
      w[i + 1] = v.y;
    }
  } else {
    for (int i = 0; i < AW; i++) {
      w[i] = p[i];
    }
  }
}
template <int AW>
inline void kv_words(const threadgroup uint32_t* p, thread uint* w) {
  for (int i = 0; i < AW; i++) {
    w[i] = p[i];
  }
}
template <int AW>
inline void kv_words(const constant uint32_t* p, thread uint* w) {
  for (int i = 0; i < AW; i++) {
    w[i] = p[i];
  }
}
template <int AW>
inline void kv_words_strided(const device uint32_t* p, size_t step, thread uint* w) {
  for (int i = 0; i < AW; i++) {
    w[i] = p[i * step];
  }
}
template <int AW>
inline void kv_words_strided(const constant uint32_t* p, size_t step, thread uint* w) {
  for (int i = 0; i < AW; i++) {
    w[i] = p[i * step];
  }
}

template <int AW>
inline void kv_words_strided(const threadgroup uint32_t* p, size_t step, thread uint* w) {
  for (int i = 0; i < AW; i++) {
    w[i] = p[i * step];
  }
}

// One 16-byte unit of a tile row into threadgroup memory: a uint4 load from
// device memory; from a constant buffer (under 8 elements) element by element.
template <typename T>
inline void kv_copy16(const device T* src, threadgroup T* dst) {
  *reinterpret_cast<threadgroup uint4*>(dst) = *reinterpret_cast<const device uint4*>(src);
}
template <typename T>
inline void kv_copy16(const constant T* src, threadgroup T* dst) {
  for (int e = 0; e < int(16 / sizeof(T)); e++) {
    dst[e] = src[e];
  }
}

// ------------------------------------------------- packed values as centred halves
//
// The attention kernels take a packed BITS-bit value n (MLX's layout: little-endian in
// 32-bit words) as the half n - mid, mid = 2^(BITS - 1): exact, since |n - mid| <= 2^(BITS - 1),
// and built from the bits without an int -> float CONVERT (4 cycles on the complex pipeline,
// metal-benchmarks): the 16 bits KV_HALF_MAGIC | m are the half 1024 + m for any m < 1024
// (exponent 10, mantissa m), so a masked field ORed into 0x6400 is already a float, and one
// 32-bit AND and OR build two halves at once, one in each 16-bit half of a word (as_type<half2>).
// The cost model's unpack charge (kvmetal/sim/cost_model.py, unpack_ops) counts these
// instructions per format; tests/test_cost_model.py checks this source still takes this path.
#define KV_HALF_MAGIC 0x6400u
#define KV_HALF_MAGIC2 0x64006400u

// Whether BITS-bit values are built two at a time from whole words (kv_centred_word): no
// value straddles a word and each 16-bit half holds whole values (1, 2, 4, 8 bits); else one
// at a time (kv_centred: 3, 5, 6 bits).
template <int BITS>
struct KvPacked {
  static constant constexpr const bool WORDS = BITS == 1 || BITS == 2 || BITS == 4 || BITS == 8;
};

// The 32 / BITS values of word w, centred (x[e / 4][e % 4]: value e), for KvPacked<BITS>::WORDS.
// A field at bit p < 8 of each 16-bit half (p + BITS <= 8) is masked in place: the half is
// 1024 + 2^p n (exact: below 2048), and n - mid = h * 2^-p - (2^(10 - p) + mid) exactly (one
// FFMA16; an FADD16 at p = 0). The fields at bits 8.. of each half are those of w >> 8. Per
// word: 1 shift, 16 / BITS ANDs and as many ORs, 32 / BITS FFMA16s.
template <int BITS>
inline void kv_centred_word(uint w, thread half4* x) {
  constexpr uint MASK = (1u << BITS) - 1u;
  constexpr int HALF = 16 / BITS;  // values per 16-bit half
  for (int s = 0; s < 16; s += 8) {
    const uint ws = w >> s;
    for (int p = 0; p < 8; p += BITS) {
      // values e (low half) and e + HALF (high half), each 1024 + 2^p n
      const half2 h = as_type<half2>((ws & ((MASK << p) * 0x10001u)) | KV_HALF_MAGIC2);
      const half2 c = h * static_cast<half>(1.0f / float(1 << p)) -
                      static_cast<half>(float((1024 >> p) + (1 << (BITS - 1))));
      const int e = (s + p) / BITS;
      x[e / 4][e % 4] = c.x;
      x[(e + HALF) / 4][(e + HALF) % 4] = c.y;
    }
  }
}

// Value e of a run of BITS-bit values (3, 5, 6 bits may join two words), centred. With e a
// compile-time constant after unrolling: a shift (none at bit 0) and a mask (a shift and an OR
// more when the value straddles words), an OR with the magic and one FADD16.
template <int BITS>
inline half kv_centred(thread const uint* w, int e) {
  const int bit = e * BITS;
  const int wi = bit / 32;
  const int sh = bit % 32;
  uint v = w[wi] >> sh;
  if (sh + BITS > 32) {
    v |= w[wi + 1] << (32 - sh);
  }
  return as_type<half>(ushort((v & ((1u << BITS) - 1u)) | KV_HALF_MAGIC)) -
         static_cast<half>(float(1024 + (1 << (BITS - 1))));
}

#endif  // KVMETAL_COMMON_H
