// Cache maintenance kernels: gather a paged cache into a contiguous one,
// write new rows into slots, copy whole blocks.
#pragma once

#include <cstdint>
#include <vector>

#include "kv_view.h"

namespace kvmetal {

struct GatherParams {
  int num_seqs = 0, num_kv_heads = 0, head_dim = 0, max_len = 0, block_size = 0;
  int64_t num_blocks = 0;
  const int32_t* block_tables = nullptr;  // [S, max_blocks] row-major
  int64_t max_blocks = 0;
  const int32_t* seq_lens = nullptr;  // [S]
  char* out = nullptr;                // [S, Hkv, max_len, D] row-major, out_kind
  FloatKind out_kind = FloatKind::f32;
};

// out[s, h, t] = cache row of token t of sequence s (dequantized), zero for
// t >= seq_len. Guards: seq_len is clamped to [0, min(max_len, table capacity)]
// and a token whose block id is outside [0, num_blocks) gets a zero row.
void gather_kv(const GatherParams& p, const KVView& cache);

// Which array of a cache a write targets: a float cache, or one of the three
// arrays of a quantized one. Each is written by its own MLX primitive, because
// MLX donates an input buffer to an output only for single-output primitives
// (sibling outputs each hold a reference to the inputs).
enum class CachePart { float_rows, quant_data, quant_scales, quant_biases };

struct RowTarget {
  CachePart part = CachePart::float_rows;
  char* ptr = nullptr;             // row-major [num_blocks, Hkv, block_size, last]
  int64_t num_blocks = 0;
  int64_t stride[3] = {0, 0, 0};   // in elements
  FloatKind kind = FloatKind::f32; // float rows / scales / biases element type
  QuantFormat fmt;                 // quantized parts
};

// Write rows[i, h] (row-major [T, Hkv, D], rows_kind) to the cache slot
// slots[i] (negative: skip), converted or quantized (each row on its own, like
// mx.quantize) into the target array. A slot past the cache is skipped too (a
// guard: ops rejects it when validating).
void write_rows(const char* rows, FloatKind rows_kind, int num_tokens, int num_kv_heads, int head_dim,
                const std::vector<int64_t>& slots, int block_size, const RowTarget& target);

// block dst[i] = block src[i] (as it was before the call), for a row-major
// array of num_blocks blocks `block_bytes` apart. A pair with an id outside
// [0, num_blocks) is skipped (a guard: ops rejects it when validating).
void copy_blocks(char* data, int64_t num_blocks, int64_t block_bytes, const std::vector<int64_t>& src,
                 const std::vector<int64_t>& dst);

}  // namespace kvmetal
