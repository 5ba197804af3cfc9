// MLX primitives of the CPU backend, and the functions that build them.
//
// Each op is lazy: the functions below only add a node to the graph, and
// eval_cpu runs when MLX evaluates it (so they also trace under mx.compile).
// eval_cpu records pointers/shapes and dispatches the work to the CPU
// stream's task queue; the kernels then spread it over kvmetal's thread pool.
// There is no GPU implementation (the metal backend has its own kernels).
//
// A KV cache argument is a list of arrays plus `bits`: bits == 0 means one
// float array; otherwise the QuantizedKV arrays (data, scales, biases) with
// `bits` and `group_size`.
#pragma once

#include <optional>
#include <vector>

#include "mlx/array.h"
#include "mlx/primitives.h"

namespace kvmetal {

namespace mx = mlx::core;

struct QuantSpec {
  int bits = 0;  // 0: float cache
  int group_size = 0;
  bool operator==(const QuantSpec& o) const { return bits == o.bits && group_size == o.group_size; }
  int num_arrays() const { return bits ? 3 : 1; }
};

struct AttentionOptions {
  float scale = 1.f;
  std::optional<float> softcap;
  int sliding_window = 0;  // paged only; 0 = none
  int num_splits = 0;      // 0 = auto
  int min_tokens_per_split = 1;  // auto splits: none shorter (MIN_TOKENS_PER_SPLIT, kvmetal/backends)
  float sparse_v = 0.f;          // decode ops: sparse V threshold tau (0 = exact)
  bool operator==(const AttentionOptions& o) const {
    return scale == o.scale && softcap == o.softcap && sliding_window == o.sliding_window &&
           num_splits == o.num_splits && min_tokens_per_split == o.min_tokens_per_split &&
           sparse_v == o.sparse_v;
  }
};

// Decode attention over a paged cache (paged = true) or a contiguous one.
// Inputs: query, K arrays, V arrays, [block_tables, seq_lens if paged], [sinks].
class DecodeAttentionPrimitive : public mx::Primitive {
 public:
  DecodeAttentionPrimitive(mx::Stream stream, bool paged, QuantSpec k, QuantSpec v, AttentionOptions opts,
                           bool has_sinks)
      : mx::Primitive(stream), paged_(paged), k_(k), v_(v), opts_(opts), has_sinks_(has_sinks) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return paged_ ? "KvmetalPagedAttention" : "KvmetalDecodeAttention"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  bool paged_;
  QuantSpec k_, v_;
  AttentionOptions opts_;
  bool has_sinks_;
};

// Varlen attention over a paged cache (bindings/varlen.h). Inputs: query
// [T, H, D], K arrays, V arrays, block_tables, seq_lens, query_start_loc, [sinks].
class VarlenAttentionPrimitive : public mx::Primitive {
 public:
  VarlenAttentionPrimitive(mx::Stream stream, QuantSpec k, QuantSpec v, AttentionOptions opts, bool has_sinks)
      : mx::Primitive(stream), k_(k), v_(v), opts_(opts), has_sinks_(has_sinks) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "KvmetalPagedAttentionVarlen"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  QuantSpec k_, v_;
  AttentionOptions opts_;
  bool has_sinks_;
};

// Inputs: cache arrays, block_tables, seq_lens -> [S, Hkv, max_len, D].
class GatherKVPrimitive : public mx::Primitive {
 public:
  GatherKVPrimitive(mx::Stream stream, QuantSpec q, int max_len) : mx::Primitive(stream), q_(q), max_len_(max_len) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "KvmetalGatherKV"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override;

 private:
  QuantSpec q_;
  int max_len_;
};

// Inputs: rows [T, Hkv, D], one cache array, slot_mapping -> that array
// updated. A quantized cache takes three of these (part 0: data, 1: scales,
// 2: biases), each quantizing the new rows again (cheap: only new rows):
// MLX donates input buffers only to single-output primitives, and donation is
// what makes the update in place.
class CacheWritePrimitive : public mx::Primitive {
 public:
  CacheWritePrimitive(mx::Stream stream, QuantSpec q, int part) : mx::Primitive(stream), q_(q), part_(part) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "KvmetalReshapeAndCache"; }
  bool is_equivalent(const mx::Primitive& other) const override;
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[1].shape()}; }

 private:
  QuantSpec q_;
  int part_;
};

// Inputs: one array with blocks along axis 0, src, dst -> the array updated
// (one primitive per array, for the same donation reason).
class CopyBlocksPrimitive : public mx::Primitive {
 public:
  explicit CopyBlocksPrimitive(mx::Stream stream) : mx::Primitive(stream) {}
  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  const char* name() const override { return "KvmetalCopyBlocks"; }
  bool is_equivalent(const mx::Primitive&) const override { return true; }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }
};

// The op functions (what the Python bindings call).
mx::array paged_attention(const mx::array& query, const std::vector<mx::array>& k, QuantSpec kq,
                          const std::vector<mx::array>& v, QuantSpec vq, const mx::array& block_tables,
                          const mx::array& seq_lens, AttentionOptions opts, const std::optional<mx::array>& sinks);

mx::array paged_attention_varlen(const mx::array& query, const std::vector<mx::array>& k, QuantSpec kq,
                                 const std::vector<mx::array>& v, QuantSpec vq, const mx::array& block_tables,
                                 const mx::array& seq_lens, const mx::array& query_start_loc, AttentionOptions opts,
                                 const std::optional<mx::array>& sinks);

mx::array decode_attention(const mx::array& query, const std::vector<mx::array>& k, QuantSpec kq,
                           const std::vector<mx::array>& v, QuantSpec vq, AttentionOptions opts,
                           const std::optional<mx::array>& sinks);

mx::array gather_kv(const std::vector<mx::array>& cache, QuantSpec q, const mx::array& block_tables,
                    const mx::array& seq_lens, int max_len);

std::vector<mx::array> cache_write(const mx::array& rows, const std::vector<mx::array>& cache, QuantSpec q,
                                   const mx::array& slot_mapping);

std::vector<mx::array> copy_blocks(const std::vector<mx::array>& arrays, const mx::array& src, const mx::array& dst);

}  // namespace kvmetal
