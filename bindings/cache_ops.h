// Cache maintenance kernels: gather a paged cache into a contiguous one,
// write new rows into slots, copy whole blocks.
#pragma once

#include <cstdint>
#include <vector>

#include "kv_view.h"

namespace kvmetal {

struct GatherParams {
  int num_seqs = 0, num_kv_heads = 0, head_dim = 0, max_len = 0, block_size = 0;
  const int32_t* block_tables = nullptr;  // [S, max_blocks] row-major
  int64_t max_blocks = 0;
  const int32_t* seq_lens = nullptr;  // [S]
  char* out = nullptr;                // [S, Hkv, max_len, D] row-major, out_kind
  FloatKind out_kind = FloatKind::f32;
};

// out[s, h, t] = cache row of token t of sequence s (dequantized), zero for t >= seq_len.
void gather_kv(const GatherParams& p, const KVView& cache);

// Write rows[i, h] (row-major [T, Hkv, D], rows_kind) to the cache slot
// slots[i] (negative: skip), converting or quantizing to the cache's format.
// `cache` points at a writable, row-major cache [num_blocks, Hkv, block_size, ...].
void write_rows(const char* rows, FloatKind rows_kind, int num_tokens, int num_kv_heads,
                const std::vector<int64_t>& slots, int block_size, const KVView& cache);

// block dst[i] = block src[i] (as it was before the call), for a row-major
// array whose blocks are `block_bytes` apart.
void copy_blocks(char* data, int64_t block_bytes, const std::vector<int64_t>& src, const std::vector<int64_t>& dst);

}  // namespace kvmetal
