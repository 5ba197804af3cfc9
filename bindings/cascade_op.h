// The MLX op of shared-prefix decode attention on the CPU (bindings/cascade.h).
#pragma once

#include <optional>
#include <vector>

#include "primitives.h"

namespace kvmetal {

// Inputs as kvmetal.ops.paged_attention_cascade passes them: query [S, H, D];
// prefix_tables [P, Mp], prefix_lens [P], prefix_of [S]; block_tables [S, M] and
// seq_lens [S] (the sequences' own tokens). opts: scale, softcap, min_tokens_per_split, sparse_v.
mx::array paged_attention_cascade(const mx::array& query, const std::vector<mx::array>& k, QuantSpec kq,
                                  const std::vector<mx::array>& v, QuantSpec vq, const mx::array& prefix_tables,
                                  const mx::array& prefix_lens, const mx::array& prefix_of,
                                  const mx::array& block_tables, const mx::array& seq_lens, AttentionOptions opts,
                                  const std::optional<mx::array>& sinks);

}  // namespace kvmetal
