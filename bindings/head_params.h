// What every CPU attention op (decode, varlen, cascade) is given the same way:
// the query heads and their scaling, the paged cache's block shape, and the
// query, sink and output arrays. Each op's params struct extends it.
#pragma once

#include <cstdint>

#include "float_kind.h"

namespace kvmetal {

struct HeadParams {
  int num_seqs = 0;      // S (B for contiguous decode)
  int num_heads = 0;     // H, query heads
  int num_kv_heads = 0;  // Hkv, H % Hkv == 0
  int head_dim = 0;      // D
  float scale = 1.f;
  bool has_softcap = false;
  float softcap = 0.f;
  int min_tokens_per_split = 1;  // no KV split of fewer tokens (from Python)

  int block_size = 0;      // paged caches
  int64_t num_blocks = 0;  // paged caches: block ids outside [0, num_blocks) are padding

  const char* query = nullptr;  // row-major, q_kind (each op gives the layout)
  FloatKind q_kind = FloatKind::f32;
  const float* sinks = nullptr;  // [H] or null
  char* out = nullptr;           // the query's layout and dtype
};

}  // namespace kvmetal
