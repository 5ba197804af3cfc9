// Shared MSL helpers for the kvmetal kernels.
//
// This text is passed as `header=` to mx.fast.metal_kernel (followed by the
// helper section of the kernel's family file), so it must stand alone: no
// #include of our own files, no `#pragma once` (MLX pastes it into one
// translation unit per kernel).
//
// Row sources. Every kernel that reads the KV cache does it through a "rows"
// object: row t of the current (sequence, kv head) is read in TASKS pieces of
// TASK_ELEMS elements each. A float cache reads a vec4 per task; a quantized
// cache dequantizes one whole group per task, so every packed word, scale and
// bias is loaded exactly once.
#ifndef KVMETAL_COMMON_H
#define KVMETAL_COMMON_H

#include <metal_stdlib>
using namespace metal;

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
inline float4 kv_widen(half4 h) { return kv_float4(float(h.x), float(h.y), float(h.z), float(h.w)); }

// One vectorized load of four elements, widened to float.
inline float4 kv_load4(const device float* p) { return *reinterpret_cast<const device float4*>(p); }
inline float4 kv_load4(const device half* p) { return kv_widen(*reinterpret_cast<const device half4*>(p)); }
// bfloat vectors exist only on newer Metal; four scalar loads are the portable form.
inline float4 kv_load4(const device bfloat16_t* p) {
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
  // From one row to the next inside a block (tiles never straddle blocks).
  KvRowAt row_step() const { return KvRowAt{W, NG, NG, 0, 0, 0}; }
};

// Contiguous cache [B, Hkv, T, W] read in place through its element strides
// (a sliced view is never copied); a unit last stride takes the vector path.
struct StridedRowIndex {
  KvRowAt first;  // offsets of (b, kvh, t = 0) and the strides along the row
  KvRowAt step;   // strides along t (its *_step fields are unused)
  KvRowAt operator()(int t) const {
    return KvRowAt{first.data + size_t(t) * step.data, first.scale + size_t(t) * step.scale,
                   first.bias + size_t(t) * step.bias, first.data_step, first.scale_step,
                   first.bias_step};
  }
  KvRowAt row_step() const { return KvRowAt{step.data, step.scale, step.bias, 0, 0, 0}; }
};

// Row `base` advanced by r rows of `step` (the *_step fields of base are kept).
inline KvRowAt kv_advance(KvRowAt base, KvRowAt step, int r) {
  return KvRowAt{base.data + size_t(r) * step.data, base.scale + size_t(r) * step.scale,
                 base.bias + size_t(r) * step.bias, base.data_step, base.scale_step, base.bias_step};
}

// Float rows: data TE [..., D]; scales/biases are unused placeholders.
template <int BITS, int GS, int D, typename TE, typename PD, typename PS>
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

// Quantized rows: data uint32 [..., D * BITS / 32], scales/biases TE [..., D / GS].
template <int BITS, int GS, int D, typename TE, typename PD, typename PS>
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
template <int BITS, int GS, int D, typename TE, typename PD, typename PS>
struct RowsSelect {
  typedef QuantRows<BITS, GS, D, TE, PD, PS> type;
};
template <int GS, int D, typename TE, typename PD, typename PS>
struct RowsSelect<0, GS, D, TE, PD, PS> {
  typedef FloatRows<0, GS, D, TE, PD, PS> type;
};

// Row width (elements of the data array) and groups per row of a cache.
template <int BITS, int GS, int D>
struct RowShape {
  static constant constexpr const int WIDTH = BITS ? D * BITS / 32 : D;
  static constant constexpr const int GROUPS = BITS ? D / GS : 1;
};

#endif  // KVMETAL_COMMON_H
