// Split-KV decode attention on the CPU (one query token per sequence).
//
// Work items are (sequence, chunk of kv heads, split): a split is a range of
// whole tiles (a tile = up to 32 consecutive tokens: the rows of one or more
// blocks, or 32 rows of a contiguous cache). For each tile and each kv head
// of its chunk, an item reads the K and V rows once (float32, and
// float16/bfloat16 widened in registers, in place; quantized rows dequantized
// once into a scratch tile) and
// updates the online-softmax state (max, sum, float32 accumulator) of every
// query head of that kv head's group, so every K/V row is read from memory
// once per step whatever the GQA factor. Items write float32 partials; a
// reduce step merges the splits (and the attention sinks) into the output.
// The split count only changes rounding; chunking and thread count change
// nothing (each (sequence, kv head, split) is computed the same way).
#pragma once

#include <cstdint>

#include "kv_view.h"

namespace kvmetal {

struct AttentionParams {
  int num_seqs = 0;      // S (paged) or B (contiguous)
  int num_heads = 0;     // H, query heads
  int num_kv_heads = 0;  // Hkv, H % Hkv == 0
  int head_dim = 0;      // D
  float scale = 1.f;
  bool has_softcap = false;
  float softcap = 0.f;
  int sliding_window = 0;  // 0: none; else only the last w tokens are seen
  int num_splits = 0;      // 0: pick a count that keeps every core busy

  // Where each sequence's tokens are.
  bool paged = false;
  int block_size = 0;                      // paged
  const int32_t* block_tables = nullptr;   // paged, [S, max_blocks] row-major
  int64_t max_blocks = 0;                  // paged
  const int32_t* seq_lens = nullptr;       // paged, [S]
  int contiguous_len = 0;                  // contiguous: T, the same for all

  const char* query = nullptr;  // [S, H, D] row-major, q_kind
  FloatKind q_kind = FloatKind::f32;
  const float* sinks = nullptr;  // [H] or null
  char* out = nullptr;           // [S, H, D] row-major, q_kind
};

// The split count an item grid would use for `p` (resolves num_splits == 0).
int resolve_num_splits(const AttentionParams& p);

void decode_attention(const AttentionParams& p, const KVView& k, const KVView& v);

}  // namespace kvmetal
