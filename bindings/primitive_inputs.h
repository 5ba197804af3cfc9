// How the CPU primitives read their inputs: shared by primitives.cpp (which
// defines these) and the primitives of other files (cascade.cpp).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "head_params.h"
#include "kv_view.h"
#include "mlx/array.h"
#include "primitives.h"
#include "tensor.h"

namespace kvmetal {

// Storage for row-major copies made inside a task; a deque-like list so
// earlier copies stay where they are.
using Storage = std::vector<std::vector<char>>;

std::vector<char>& new_slot(Storage& st);

// int32 row-major view of an index array (int64 saturates, so an id that does
// not fit stays out of range for the kernels' guards).
const int32_t* int32_data(const Tensor& t, Storage& st);

// The KVView of a cache given as 1 (float) or 3 (data, scales, biases) arrays.
KVView make_view(const std::vector<Tensor>& arrays, QuantSpec q, Storage& st);

// The HeadParams every attention primitive fills alike: the query (row-major,
// copied into st if it is not) and the output, head_dim (the query's last axis),
// kv heads, scale, softcap, the split floor, the sinks (null: none) and, for a
// paged cache [blocks, Hkv, block_size, D], its block shape. num_seqs and
// num_heads depend on the op's query layout: the caller sets them.
void fill_head_params(HeadParams& p, const Tensor& q, const std::vector<Tensor>& k, const std::vector<Tensor>& v,
                      const AttentionOptions& opts, const Tensor* sinks, bool paged, Storage& st, char* out);

// The checks every attention op makes of its caches against the query (head_dim
// the query's last axis, num_heads a multiple of the kv heads), and the inputs
// it starts with: the query, then K's and V's arrays.
std::vector<mx::array> attention_inputs(const char* op, const mx::array& query, int num_heads,
                                        const std::vector<mx::array>& k, QuantSpec kq,
                                        const std::vector<mx::array>& v, QuantSpec vq);

// The sinks (float32 [num_heads]) appended to inputs, if given.
void append_sinks(const char* op, const std::optional<mx::array>& sinks, int num_heads,
                  std::vector<mx::array>& inputs);

std::vector<Tensor> describe_all(const std::vector<mx::array>& inputs, size_t first, int count);

// What every attention primitive's inputs start with: the query, then K's and V's
// arrays (1 float or 3 quantized each); ``next`` is the index of what follows.
struct AttentionInputs {
  Tensor q;
  std::vector<Tensor> k, v;
  size_t next = 0;
};
AttentionInputs describe_attention_inputs(const std::vector<mx::array>& inputs, QuantSpec kq, QuantSpec vq);

// Memory-safety checks of shapes and dtypes (kvmetal.ops does the user-facing ones).
[[noreturn]] void fail(const char* op, const std::string& msg);
void check_float(const mx::array& a, const char* op, const char* name);
int check_cache(const std::vector<mx::array>& c, QuantSpec q, const char* op, const char* name);

mx::Stream cpu_stream();

}  // namespace kvmetal
