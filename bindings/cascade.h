// Shared-prefix ("cascade") decode attention on the CPU.
//
// Sequence s attends to its prefix's tokens (prefix prefix_of[s], if in
// [0, P)) followed by its own tokens; one query token per sequence.
//
// Work items are (row group, kv head, split). A row group is a token list
// (one block-table row) and the query rows that attend all of it: a prefix and
// its member sequences (G x members rows), or one sequence's own tokens (G
// rows). Each K/V block of a group is converted (or dequantized) to float32
// once per item and serves all its rows, so a shared prefix is read once per
// (kv head, split), not once per member. Items write float32 partial states
// (max, sum, accumulator); a merge folds, per (sequence, head), its prefix
// group's state, its own group's, and the sink.
//
// Memory safety does not depend on the caller: lengths are clamped to their
// tables, a block id outside [0, num_blocks) is padding (never read), and a
// prefix_of outside [0, P) means "no prefix".
#pragma once

#include <cstdint>

#include "head_params.h"
#include "kv_view.h"

namespace kvmetal {

struct CascadeParams : HeadParams {
  // num_seqs is S; query, sinks and out (HeadParams) are [S, H, D] row-major.
  float sparse_v = 0.f;  // sparse V threshold tau (sparse_v.h; 0 = exact)

  int num_prefixes = 0;                    // P
  const int32_t* prefix_tables = nullptr;  // [P, prefix_width] row-major
  int64_t prefix_width = 0;
  const int32_t* prefix_lens = nullptr;  // [P]
  const int32_t* prefix_of = nullptr;    // [S]

  const int32_t* block_tables = nullptr;  // [S, width] row-major: the sequences' own blocks
  int64_t width = 0;
  const int32_t* seq_lens = nullptr;  // [S]: own tokens
};

void paged_attention_cascade(const CascadeParams& p, const KVView& k, const KVView& v);

}  // namespace kvmetal
