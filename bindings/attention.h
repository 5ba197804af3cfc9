// Split-KV decode attention on the CPU, 1 to 8 query tokens per sequence.
//
// Work items are (sequence, chunk of kv heads, split): a split is a range of
// whole tiles (a tile = up to 32 consecutive tokens: the rows of one or more
// blocks, or 32 rows of a contiguous cache). For each tile and each kv head
// of its chunk, an item reads the K and V rows once (float32, and
// float16/bfloat16 widened in registers, in place; quantized rows dequantized
// once into a scratch tile) and updates the online-softmax state (max, sum,
// float32 accumulator) of every query row of that kv head: G query heads x L
// query tokens. So every K/V row is read from memory once per step whatever
// the GQA factor and the query length. Items write float32 partials; a reduce
// step merges the splits (and the attention sinks) into the output. The split
// count only changes rounding; chunking and thread count change nothing (each
// (sequence, kv head, split) is computed the same way).
//
// Causal rule: the L query tokens are the last L cached positions; query token
// l sits at p_l = len - L + l and sees cached tokens t with t <= p_l (and, with
// a sliding window w, t > p_l - w). A row that sees nothing outputs zeros.
//
// Memory safety does not depend on the caller: a length is clamped to
// [0, max_blocks * block_size] and a block id outside [0, num_blocks) is
// padding (its tokens are masked, never read).
#pragma once

#include <cstdint>

#include "head_params.h"
#include "kv_view.h"

namespace kvmetal {

struct AttentionParams : HeadParams {
  // num_seqs is S (paged) or B (contiguous).
  int query_len = 1;       // L, query tokens per sequence
  int num_splits = 0;      // 0: pick a count that keeps every core busy (no split below min_tokens_per_split)
  // Sparse V (0 = exact): after a tile's softmax step, a query row whose weight
  // exp(s - m_running) of a key is below this does not accumulate the key's V row
  // (the weight stays in l), and a key no row of the tile needs has its V row
  // neither read nor prefetched.
  float sparse_v = 0.f;

  // Where each sequence's tokens are (block_size, num_blocks: HeadParams).
  bool paged = false;
  const int32_t* block_tables = nullptr;   // paged, [S, max_blocks] row-major
  int64_t max_blocks = 0;                  // paged
  const int32_t* seq_lens = nullptr;       // paged, [S]
  int contiguous_len = 0;                  // contiguous: T, the same for all

  // Query and output rows (HeadParams) are row-major [S, L, H, D] when paged,
  // [B, H, L, D] when contiguous (the layout of mx.fast.scaled_dot_product_attention);
  // the sinks are shared by the L rows of a head.

  // First element of query/output row (s, l, h).
  int64_t row_offset(int s, int l, int h) const {
    const int64_t row = paged ? (static_cast<int64_t>(s) * query_len + l) * num_heads + h
                              : (static_cast<int64_t>(s) * num_heads + h) * query_len + l;
    return row * head_dim;
  }
};

void decode_attention(const AttentionParams& p, const KVView& k, const KVView& v);

}  // namespace kvmetal
