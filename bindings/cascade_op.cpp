#include "cascade_op.h"

#include <algorithm>
#include <memory>
#include <stdexcept>
#include <string>

#include "cascade.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "primitive_inputs.h"
#include "tensor.h"

namespace kvmetal {
namespace {

// Inputs: query, K arrays, V arrays, prefix_tables, prefix_lens, prefix_of,
// block_tables, seq_lens, [sinks].
class CascadeAttentionPrimitive : public mx::Primitive {
 public:
  CascadeAttentionPrimitive(mx::Stream stream, QuantSpec k, QuantSpec v, AttentionOptions opts, bool has_sinks)
      : mx::Primitive(stream), k_(k), v_(v), opts_(opts), has_sinks_(has_sinks) {}

  void eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) override;
  void eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) override {
    throw std::runtime_error(std::string("[") + name() + "] has no GPU implementation; use the metal backend");
  }
  const char* name() const override { return "KvmetalPagedAttentionCascade"; }
  bool is_equivalent(const mx::Primitive& other) const override {
    auto* o = dynamic_cast<const CascadeAttentionPrimitive*>(&other);
    return o && k_ == o->k_ && v_ == o->v_ && opts_ == o->opts_ && has_sinks_ == o->has_sinks_;
  }
  std::vector<mx::Shape> output_shapes(const std::vector<mx::array>& inputs) override { return {inputs[0].shape()}; }

 private:
  QuantSpec k_, v_;
  AttentionOptions opts_;
  bool has_sinks_;
};

void CascadeAttentionPrimitive::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const AttentionInputs in = describe_attention_inputs(inputs, k_, v_);
  size_t i = in.next;
  Tensor pt = describe(inputs[i++]);
  Tensor pl = describe(inputs[i++]);
  Tensor po = describe(inputs[i++]);
  Tensor bt = describe(inputs[i++]);
  Tensor sl = describe(inputs[i++]);
  Tensor sinks;
  if (has_sinks_) sinks = describe(inputs[i++]);
  char* out_ptr = out.data<char>();

  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch([in, pt, pl, po, bt, sl, sinks, out_ptr, kq = k_, vq = v_, opts = opts_,
                has_sinks = has_sinks_]() {
    const Tensor& q = in.q;
    const std::vector<Tensor>& kt = in.k;
    const std::vector<Tensor>& vt = in.v;
    Storage st;
    CascadeParams p;
    fill_head_params(p, q, kt, vt, opts, has_sinks ? &sinks : nullptr, true, st, out_ptr);
    p.num_seqs = static_cast<int>(q.shape[0]);
    p.num_heads = static_cast<int>(q.shape[1]);
    p.sparse_v = opts.sparse_v;
    p.num_prefixes = static_cast<int>(pt.shape[0]);
    p.prefix_tables = int32_data(pt, st);
    p.prefix_width = pt.shape[1];
    p.prefix_lens = int32_data(pl, st);
    p.prefix_of = int32_data(po, st);
    p.block_tables = int32_data(bt, st);
    p.width = bt.shape[1];
    p.seq_lens = int32_data(sl, st);
    KVView k = make_view(kt, kq, st);
    KVView v = make_view(vt, vq, st);
    paged_attention_cascade(p, k, v);
  });
}

}  // namespace

mx::array paged_attention_cascade(const mx::array& query, const std::vector<mx::array>& k, QuantSpec kq,
                                  const std::vector<mx::array>& v, QuantSpec vq, const mx::array& prefix_tables,
                                  const mx::array& prefix_lens, const mx::array& prefix_of,
                                  const mx::array& block_tables, const mx::array& seq_lens, AttentionOptions opts,
                                  const std::optional<mx::array>& sinks) {
  const char* op = "paged_attention_cascade";
  check_float(query, op, "query");
  if (query.ndim() != 3) fail(op, "query must have rank 3 [S, H, D]");
  std::vector<mx::array> inputs = attention_inputs(op, query, query.shape(1), k, kq, v, vq);
  if (k[0].shape(2) != v[0].shape(2)) fail(op, "key and value block sizes differ");
  const int S = query.shape(0);
  if (prefix_tables.ndim() != 2 || prefix_lens.ndim() != 1 || prefix_lens.shape(0) != prefix_tables.shape(0))
    fail(op, "prefix_tables must be [P, Mp] and prefix_lens [P]");
  if (prefix_of.ndim() != 1 || prefix_of.shape(0) != S) fail(op, "prefix_of must be [S]");
  if (block_tables.ndim() != 2 || block_tables.shape(0) != S) fail(op, "block_tables must be [S, M]");
  if (seq_lens.ndim() != 1 || seq_lens.shape(0) != S) fail(op, "seq_lens must be [S]");
  for (const mx::array* a : {&prefix_tables, &prefix_lens, &prefix_of, &block_tables, &seq_lens}) {
    if (a->dtype() != mx::int32 && a->dtype() != mx::int64) fail(op, "index arrays must be int32 or int64");
    inputs.push_back(*a);
  }
  append_sinks(op, sinks, query.shape(1), inputs);
  auto prim = std::make_shared<CascadeAttentionPrimitive>(cpu_stream(), kq, vq, opts, sinks.has_value());
  return mx::array(query.shape(), query.dtype(), prim, inputs);
}

}  // namespace kvmetal
