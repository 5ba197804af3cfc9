// Paged varlen attention on the CPU: ragged runs of query rows (prefill
// chunks and decode rows in one call) read straight from the paged cache.
//
// Sequence s owns query rows [qsl[s], qsl[s + 1]): its last n_s cached
// positions. Row i of the run sits at p = len - n_s + i and sees cached tokens
// t <= p (and, with a sliding window w, t > p - w). A row that sees nothing
// outputs zeros.
//
// Work items are (sequence, kv head, query tile[, KV split]). A query tile
// packs BQ consecutive positions x the G query heads of its kv head (R = BQ * G
// rows), so each K/V tile of up to 32 tokens is converted (or dequantized) to
// float32 once per query tile and serves all R rows: the tile math of
// tile_math.h runs R x 32 scores, the online softmax and R x D accumulators
// over it. Key tiles past the query tile's last position (causal) and before
// its first position's window are never visited. When there are too few query
// tiles to keep the threads busy (decode rows, a short chunk after a long
// prefix), a tile's key range is split and the float32 partials are merged.
//
// Memory safety does not depend on the caller: query_start_loc is clamped to
// [0, T] and made non-decreasing (rows no run owns output zeros), a length is
// clamped to [0, max_blocks * block_size], and a block id outside
// [0, num_blocks) is padding (its tokens are masked, never read).
#pragma once

#include <cstdint>

#include "head_params.h"
#include "kv_view.h"

namespace kvmetal {

struct VarlenParams : HeadParams {
  // num_seqs is S; query, sinks and out (HeadParams) are [T, H, D] row-major.
  int num_tokens = 0;        // T, query rows
  const int32_t* block_tables = nullptr;  // [S, max_blocks] row-major
  int64_t max_blocks = 0;
  const int32_t* seq_lens = nullptr;         // [S]
  const int32_t* query_start_loc = nullptr;  // [S + 1]
};

void paged_attention_varlen(const VarlenParams& p, const KVView& k, const KVView& v);

}  // namespace kvmetal
