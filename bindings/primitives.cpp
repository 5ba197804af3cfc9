#include "primitives.h"
#include "primitive_inputs.h"

#include <algorithm>
#include <climits>
#include <numeric>
#include <stdexcept>
#include <string>

#include "attention.h"
#include "cache_ops.h"
#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "tensor.h"
#include "varlen.h"

namespace kvmetal {

// The input helpers below are shared with the primitives of other files
// (primitive_inputs.h declares them); the rest of this file's helpers are local.

std::vector<char>& new_slot(Storage& st) {
  st.emplace_back();
  return st.back();
}

// int32 row-major view (block tables, seq_lens): the array itself when it is one.
// Wider values saturate, so one that does not fit stays out of range (and the
// kernels' guards treat it as padding) instead of wrapping onto a valid index.
const int32_t* int32_data(const Tensor& t, Storage& st) {
  if (t.dtype == mx::int32) return reinterpret_cast<const int32_t*>(row_major(t, new_slot(st)).ptr);
  std::vector<int64_t> v = read_indices(t);
  auto& buf = new_slot(st);
  buf.resize(v.size() * sizeof(int32_t));
  int32_t* out = reinterpret_cast<int32_t*>(buf.data());
  for (size_t i = 0; i < v.size(); ++i)
    out[i] = static_cast<int32_t>(std::clamp<int64_t>(v[i], INT32_MIN, INT32_MAX));
  return out;
}

// The kernels need unit stride along the last axis; other strides are free.
Tensor unit_last_stride(const Tensor& t, Storage& st) {
  if (t.shape.back() == 1 || t.strides.back() == 1) return t;
  return row_major(t, new_slot(st));
}

// The KVView of a cache given as 1 (float) or 3 (data, scales, biases) arrays
// of rank 4: [outer, heads, rows, last].
KVView make_view(const std::vector<Tensor>& arrays, QuantSpec q, Storage& st) {
  KVView v;
  Tensor data = unit_last_stride(arrays[0], st);
  v.data = data.ptr;
  for (int i = 0; i < 3; ++i) v.stride[i] = data.strides[i];
  if (q.bits == 0) {
    v.kind = float_kind(data.dtype, "kvmetal");
    v.D = static_cast<int>(data.shape[3]);
    return v;
  }
  v.quantized = true;
  v.D = static_cast<int>(data.shape[3] * 32 / q.bits);
  Tensor scales = unit_last_stride(arrays[1], st);
  Tensor biases = unit_last_stride(arrays[2], st);
  v.fmt = QuantFormat{q.bits, q.group_size, float_kind(scales.dtype, "kvmetal")};
  v.scales = scales.ptr;
  v.biases = biases.ptr;
  for (int i = 0; i < 3; ++i) {
    v.scale_stride[i] = scales.strides[i];
    v.bias_stride[i] = biases.strides[i];
  }
  return v;
}

namespace {

// Row-major strides of a shape, in elements.
std::vector<int64_t> row_major_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s(shape.size());
  int64_t acc = 1;
  for (int d = static_cast<int>(shape.size()) - 1; d >= 0; --d) {
    s[d] = acc;
    acc *= shape[d];
  }
  return s;
}

// Output j of a cache update reuses input j's buffer when MLX lets us: the
// input is donatable (nothing else holds the array or its buffer; the caller
// replaced its reference by the op's result) and row-major over its whole
// buffer. Then only the touched rows are written: an in-place update. Else the
// output gets a new buffer and the task first copies the input into it.
// Returns whether the buffer was shared.
bool share_or_allocate(const mx::array& in, mx::array& out) {
  if (in.is_donatable() && in.flags().row_contiguous && in.data_size() == in.size()) {
    out.copy_shared_buffer(in);
    return true;
  }
  out.set_data(mx::allocator::malloc(out.nbytes()));
  return false;
}

Tensor as_row_major_output(mx::array& out) {
  Tensor t = describe(out);
  t.strides = row_major_strides(t.shape);
  t.row_contiguous = true;
  return t;
}

}  // namespace

mx::Stream cpu_stream() { return mx::default_stream(mx::Device::cpu); }

[[noreturn]] void fail(const char* op, const std::string& msg) {
  throw std::invalid_argument(std::string("[") + op + "] " + msg);
}

std::string shape_str(const mx::Shape& s) {
  std::string out = "(";
  for (size_t i = 0; i < s.size(); ++i) {
    if (i) out += ", ";
    out += std::to_string(s[i]);
  }
  return out + ")";
}

void check_float(const mx::array& a, const char* op, const char* name) {
  if (a.dtype() != mx::float32 && a.dtype() != mx::float16 && a.dtype() != mx::bfloat16)
    fail(op, std::string(name) + " must be float16, bfloat16 or float32");
}

// Memory-safety guards only: the shapes and dtypes the kernels index by, for
// callers that reach kvmetal._ext directly. kvmetal.ops is the one validation
// layer for users (errors naming the argument); index values are guarded in
// the kernels themselves.
int check_cache(const std::vector<mx::array>& c, QuantSpec q, const char* op, const char* name) {
  if (static_cast<int>(c.size()) != q.num_arrays())
    fail(op, std::string(name) + ": expected " + std::to_string(q.num_arrays()) + " array(s)");
  for (auto& a : c) {
    if (a.ndim() != 4) fail(op, std::string(name) + " arrays must have rank 4, got " + shape_str(a.shape()));
    for (int d = 0; d < 3; ++d)
      if (a.shape(d) != c[0].shape(d)) fail(op, std::string(name) + " arrays must share their first three dims");
  }
  if (q.bits == 0) {
    check_float(c[0], op, name);
    return c[0].shape(3);
  }
  if (c[0].dtype() != mx::uint32) fail(op, std::string(name) + " data must be uint32");
  check_float(c[1], op, name);
  if (c[2].dtype() != c[1].dtype()) fail(op, std::string(name) + " scales and biases must share a dtype");
  const int D = c[0].shape(3) * 32 / q.bits;
  if (D % q.group_size || c[1].shape(3) != D / q.group_size || c[2].shape(3) != D / q.group_size)
    fail(op, std::string(name) + " scales/biases do not match head_dim / group_size");
  return D;
}

void fill_head_params(HeadParams& p, const Tensor& q, const std::vector<Tensor>& k, const std::vector<Tensor>& v,
                      const AttentionOptions& opts, const Tensor* sinks, bool paged, Storage& st, char* out) {
  const Tensor qm = row_major(q, new_slot(st));
  p.query = qm.ptr;
  p.q_kind = float_kind(qm.dtype, "kvmetal");
  p.out = out;
  p.head_dim = static_cast<int>(q.shape.back());
  p.num_kv_heads = static_cast<int>(k[0].shape[1]);
  p.scale = opts.scale;
  p.has_softcap = opts.softcap.has_value();
  p.softcap = opts.softcap.value_or(0.f);
  p.min_tokens_per_split = opts.min_tokens_per_split;
  if (paged) {
    p.block_size = static_cast<int>(k[0].shape[2]);
    p.num_blocks = std::min(k[0].shape[0], v[0].shape[0]);  // ops checks they match
  }
  if (sinks) p.sinks = reinterpret_cast<const float*>(row_major(*sinks, new_slot(st)).ptr);
}

std::vector<mx::array> attention_inputs(const char* op, const mx::array& query, int num_heads,
                                        const std::vector<mx::array>& k, QuantSpec kq,
                                        const std::vector<mx::array>& v, QuantSpec vq) {
  const int D = query.shape(-1);
  if (check_cache(k, kq, op, "key_cache") != D || check_cache(v, vq, op, "value_cache") != D)
    fail(op, "key/value head_dim must equal the query's " + std::to_string(D));
  const int hkv = k[0].shape(1);
  if (v[0].shape(1) != hkv || hkv == 0 || num_heads % hkv) fail(op, "num_heads must be a multiple of num_kv_heads");
  std::vector<mx::array> inputs{query};
  inputs.insert(inputs.end(), k.begin(), k.end());
  inputs.insert(inputs.end(), v.begin(), v.end());
  return inputs;
}

void append_sinks(const char* op, const std::optional<mx::array>& sinks, int num_heads,
                  std::vector<mx::array>& inputs) {
  if (!sinks) return;
  if (sinks->dtype() != mx::float32 || sinks->size() != static_cast<size_t>(num_heads))
    fail(op, "sinks must be float32 [num_heads]");
  inputs.push_back(*sinks);
}

std::vector<Tensor> describe_all(const std::vector<mx::array>& inputs, size_t first, int count) {
  std::vector<Tensor> out;
  for (int i = 0; i < count; ++i) out.push_back(describe(inputs[first + i]));
  return out;
}

AttentionInputs describe_attention_inputs(const std::vector<mx::array>& inputs, QuantSpec kq, QuantSpec vq) {
  AttentionInputs a;
  a.q = describe(inputs[0]);
  a.k = describe_all(inputs, 1, kq.num_arrays());
  a.v = describe_all(inputs, 1 + kq.num_arrays(), vq.num_arrays());
  a.next = 1 + kq.num_arrays() + vq.num_arrays();
  return a;
}

// ---------------------------------------------------------------- attention

void DecodeAttentionPrimitive::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const AttentionInputs in = describe_attention_inputs(inputs, k_, v_);
  size_t i = in.next;
  Tensor bt, sl, sinks;
  if (paged_) {
    bt = describe(inputs[i++]);
    sl = describe(inputs[i++]);
  }
  if (has_sinks_) sinks = describe(inputs[i++]);
  char* out_ptr = out.data<char>();

  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch([in, bt, sl, sinks, out_ptr, paged = paged_, kq = k_, vq = v_, opts = opts_,
                has_sinks = has_sinks_]() {
    const Tensor& q = in.q;
    const std::vector<Tensor>& kt = in.k;
    const std::vector<Tensor>& vt = in.v;
    Storage st;
    AttentionParams p;
    fill_head_params(p, q, kt, vt, opts, has_sinks ? &sinks : nullptr, paged, st, out_ptr);
    // Paged queries are [S, L, H, D] (or [S, H, D]: L = 1), contiguous ones [B, H, L, D].
    const bool rank4 = q.shape.size() == 4;
    p.num_seqs = static_cast<int>(q.shape[0]);
    p.query_len = paged ? (rank4 ? static_cast<int>(q.shape[1]) : 1) : static_cast<int>(q.shape[2]);
    p.num_heads = static_cast<int>(paged ? q.shape[q.shape.size() - 2] : q.shape[1]);
    p.sliding_window = opts.sliding_window;
    p.num_splits = opts.num_splits;
    p.sparse_v = opts.sparse_v;
    p.paged = paged;
    if (paged) {
      p.block_tables = int32_data(bt, st);
      p.max_blocks = bt.shape[1];
      p.seq_lens = int32_data(sl, st);
    } else {
      p.contiguous_len = static_cast<int>(kt[0].shape[2]);
    }
    KVView k = make_view(kt, kq, st);
    KVView v = make_view(vt, vq, st);
    decode_attention(p, k, v);
  });
}

void DecodeAttentionPrimitive::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error(std::string("[") + name() + "] has no GPU implementation; use the metal backend");
}

bool DecodeAttentionPrimitive::is_equivalent(const mx::Primitive& other) const {
  auto* o = dynamic_cast<const DecodeAttentionPrimitive*>(&other);
  return o && paged_ == o->paged_ && k_ == o->k_ && v_ == o->v_ && opts_ == o->opts_ && has_sinks_ == o->has_sinks_;
}

static mx::array attention_op(const char* op, bool paged, const mx::array& query, const std::vector<mx::array>& k,
                              QuantSpec kq, const std::vector<mx::array>& v, QuantSpec vq,
                              const mx::array* block_tables, const mx::array* seq_lens, AttentionOptions opts,
                              const std::optional<mx::array>& sinks) {
  check_float(query, op, "query");
  const int qrank = static_cast<int>(query.ndim());
  if (paged ? (qrank != 3 && qrank != 4) : qrank != 4)
    fail(op, std::string("query must have rank ") + (paged ? "3 or 4 ([S, H, D] or [S, L, H, D])" : "4 ([B, H, L, D])") +
                 ", got " + shape_str(query.shape()));
  const int num_heads = paged ? query.shape(-2) : query.shape(1);
  std::vector<mx::array> inputs = attention_inputs(op, query, num_heads, k, kq, v, vq);
  if (paged) {
    if (block_tables->ndim() != 2 || block_tables->shape(0) != query.shape(0)) fail(op, "block_tables must be [S, max_blocks]");
    if (seq_lens->ndim() != 1 || seq_lens->shape(0) != query.shape(0)) fail(op, "seq_lens must be [S]");
    if (k[0].shape(2) != v[0].shape(2)) fail(op, "key and value block sizes differ");
    inputs.push_back(*block_tables);
    inputs.push_back(*seq_lens);
  } else {
    if (k[0].shape(0) != query.shape(0) || v[0].shape(0) != query.shape(0) || k[0].shape(2) != v[0].shape(2))
      fail(op, "keys/values must be [B, Hkv, T, D] matching the query");
  }
  append_sinks(op, sinks, num_heads, inputs);
  auto prim = std::make_shared<DecodeAttentionPrimitive>(cpu_stream(), paged, kq, vq, opts, sinks.has_value());
  return mx::array(query.shape(), query.dtype(), prim, inputs);
}

mx::array paged_attention(const mx::array& query, const std::vector<mx::array>& k, QuantSpec kq,
                          const std::vector<mx::array>& v, QuantSpec vq, const mx::array& block_tables,
                          const mx::array& seq_lens, AttentionOptions opts, const std::optional<mx::array>& sinks) {
  return attention_op("paged_attention", true, query, k, kq, v, vq, &block_tables, &seq_lens, opts, sinks);
}

mx::array decode_attention(const mx::array& query, const std::vector<mx::array>& k, QuantSpec kq,
                           const std::vector<mx::array>& v, QuantSpec vq, AttentionOptions opts,
                           const std::optional<mx::array>& sinks) {
  opts.sliding_window = 0;
  return attention_op("decode_attention", false, query, k, kq, v, vq, nullptr, nullptr, opts, sinks);
}

// ---------------------------------------------------------------- varlen attention

void VarlenAttentionPrimitive::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const AttentionInputs in = describe_attention_inputs(inputs, k_, v_);
  size_t i = in.next;
  Tensor bt = describe(inputs[i++]);
  Tensor sl = describe(inputs[i++]);
  Tensor qsl = describe(inputs[i++]);
  Tensor sinks;
  if (has_sinks_) sinks = describe(inputs[i++]);
  char* out_ptr = out.data<char>();

  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch([in, bt, sl, qsl, sinks, out_ptr, kq = k_, vq = v_, opts = opts_, has_sinks = has_sinks_]() {
    const Tensor& q = in.q;
    const std::vector<Tensor>& kt = in.k;
    const std::vector<Tensor>& vt = in.v;
    Storage st;
    VarlenParams p;
    fill_head_params(p, q, kt, vt, opts, has_sinks ? &sinks : nullptr, true, st, out_ptr);
    p.num_tokens = static_cast<int>(q.shape[0]);
    p.num_heads = static_cast<int>(q.shape[1]);
    p.num_seqs = static_cast<int>(bt.shape[0]);
    p.sliding_window = opts.sliding_window;
    p.block_tables = int32_data(bt, st);
    p.max_blocks = bt.shape[1];
    p.seq_lens = int32_data(sl, st);
    p.query_start_loc = int32_data(qsl, st);
    KVView k = make_view(kt, kq, st);
    KVView v = make_view(vt, vq, st);
    paged_attention_varlen(p, k, v);
  });
}

void VarlenAttentionPrimitive::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[KvmetalPagedAttentionVarlen] has no GPU implementation; use the metal backend");
}

bool VarlenAttentionPrimitive::is_equivalent(const mx::Primitive& other) const {
  auto* o = dynamic_cast<const VarlenAttentionPrimitive*>(&other);
  return o && k_ == o->k_ && v_ == o->v_ && opts_ == o->opts_ && has_sinks_ == o->has_sinks_;
}

mx::array paged_attention_varlen(const mx::array& query, const std::vector<mx::array>& k, QuantSpec kq,
                                 const std::vector<mx::array>& v, QuantSpec vq, const mx::array& block_tables,
                                 const mx::array& seq_lens, const mx::array& query_start_loc, AttentionOptions opts,
                                 const std::optional<mx::array>& sinks) {
  const char* op = "paged_attention_varlen";
  check_float(query, op, "query");
  if (query.ndim() != 3) fail(op, "query must have rank 3 ([T, H, D]), got " + shape_str(query.shape()));
  std::vector<mx::array> inputs = attention_inputs(op, query, query.shape(1), k, kq, v, vq);
  if (k[0].shape(2) != v[0].shape(2)) fail(op, "key and value block sizes differ");
  if (block_tables.ndim() != 2) fail(op, "block_tables must be [S, max_blocks]");
  const int S = block_tables.shape(0);
  if (seq_lens.ndim() != 1 || seq_lens.shape(0) != S) fail(op, "seq_lens must be [S]");
  if (query_start_loc.ndim() != 1 || query_start_loc.shape(0) != S + 1) fail(op, "query_start_loc must be [S + 1]");
  for (const mx::array* a : {&block_tables, &seq_lens, &query_start_loc})
    if (a->dtype() != mx::int32 && a->dtype() != mx::int64) fail(op, "index arrays must be int32 or int64");
  inputs.push_back(block_tables);
  inputs.push_back(seq_lens);
  inputs.push_back(query_start_loc);
  append_sinks(op, sinks, query.shape(1), inputs);
  auto prim = std::make_shared<VarlenAttentionPrimitive>(cpu_stream(), kq, vq, opts, sinks.has_value());
  return mx::array(query.shape(), query.dtype(), prim, inputs);
}

// ---------------------------------------------------------------- gather

void GatherKVPrimitive::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  out.set_data(mx::allocator::malloc(out.nbytes()));
  const int n = q_.num_arrays();
  std::vector<Tensor> ct = describe_all(inputs, 0, n);
  Tensor bt = describe(inputs[n]);
  Tensor sl = describe(inputs[n + 1]);
  Tensor ot = describe(out);
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch([ct, bt, sl, ot, q = q_, max_len = max_len_]() {
    Storage st;
    GatherParams p;
    KVView cache = make_view(ct, q, st);
    p.num_seqs = static_cast<int>(bt.shape[0]);
    p.num_kv_heads = static_cast<int>(ct[0].shape[1]);
    p.head_dim = cache.D;
    p.max_len = max_len;
    p.block_size = static_cast<int>(ct[0].shape[2]);
    p.num_blocks = ct[0].shape[0];
    p.block_tables = int32_data(bt, st);
    p.max_blocks = bt.shape[1];
    p.seq_lens = int32_data(sl, st);
    p.out = ot.ptr;
    p.out_kind = float_kind(ot.dtype, "gather_kv_cache");
    gather_kv(p, cache);
  });
}

void GatherKVPrimitive::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[KvmetalGatherKV] has no GPU implementation; use the metal backend");
}

bool GatherKVPrimitive::is_equivalent(const mx::Primitive& other) const {
  auto* o = dynamic_cast<const GatherKVPrimitive*>(&other);
  return o && q_ == o->q_ && max_len_ == o->max_len_;
}

std::vector<mx::Shape> GatherKVPrimitive::output_shapes(const std::vector<mx::array>& inputs) {
  const int n = q_.num_arrays();
  const int D = q_.bits ? inputs[0].shape(3) * 32 / q_.bits : inputs[0].shape(3);
  return {mx::Shape{inputs[n].shape(0), inputs[0].shape(1), max_len_, D}};
}

mx::array gather_kv(const std::vector<mx::array>& cache, QuantSpec q, const mx::array& block_tables,
                    const mx::array& seq_lens, int max_len) {
  const char* op = "gather_kv_cache";
  const int D = check_cache(cache, q, op, "cache");
  if (block_tables.ndim() != 2 || seq_lens.ndim() != 1 || seq_lens.shape(0) != block_tables.shape(0))
    fail(op, "block_tables must be [S, max_blocks] and seq_lens [S]");
  if (max_len < 0) fail(op, "max_len must be >= 0");
  const mx::Dtype dt = q.bits ? cache[1].dtype() : cache[0].dtype();
  std::vector<mx::array> inputs(cache);
  inputs.push_back(block_tables);
  inputs.push_back(seq_lens);
  mx::Shape shape{block_tables.shape(0), cache[0].shape(1), max_len, D};
  return mx::array(shape, dt, std::make_shared<GatherKVPrimitive>(cpu_stream(), q, max_len), inputs);
}

// ---------------------------------------------------------------- cache write

void CacheWritePrimitive::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  const bool shared = share_or_allocate(inputs[1], out);
  Tensor in = describe(inputs[1]);
  Tensor target = as_row_major_output(out);
  Tensor rows = describe(inputs[0]);
  Tensor slots = describe(inputs[2]);
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch([rows, slots, in, target, shared, q = q_, part = part_]() {
    if (!shared) copy_strided(in, target.ptr);
    Storage st;
    Tensor r = row_major(rows, new_slot(st));
    RowTarget t;
    t.ptr = target.ptr;
    for (int i = 0; i < 3; ++i) t.stride[i] = target.strides[i];
    if (q.bits == 0) {
      t.part = CachePart::float_rows;
      t.kind = float_kind(target.dtype, "reshape_and_cache");
    } else {
      t.part = part == 0 ? CachePart::quant_data : part == 1 ? CachePart::quant_scales : CachePart::quant_biases;
      if (part != 0) t.kind = float_kind(target.dtype, "reshape_and_cache");
      t.fmt = QuantFormat{q.bits, q.group_size, t.kind};
    }
    t.num_blocks = target.shape[0];
    write_rows(r.ptr, float_kind(r.dtype, "reshape_and_cache"), static_cast<int>(r.shape[0]),
               static_cast<int>(r.shape[1]), static_cast<int>(r.shape[2]), read_indices(slots),
               static_cast<int>(target.shape[2]), t);
  });
}

void CacheWritePrimitive::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[KvmetalReshapeAndCache] has no GPU implementation; use the metal backend");
}

bool CacheWritePrimitive::is_equivalent(const mx::Primitive& other) const {
  auto* o = dynamic_cast<const CacheWritePrimitive*>(&other);
  return o && q_ == o->q_ && part_ == o->part_;
}

std::vector<mx::array> cache_write(const mx::array& rows, const std::vector<mx::array>& cache, QuantSpec q,
                                   const mx::array& slot_mapping) {
  const char* op = "reshape_and_cache";
  const int D = check_cache(cache, q, op, "cache");
  check_float(rows, op, "key/value");
  if (rows.ndim() != 3 || rows.shape(1) != cache[0].shape(1) || rows.shape(2) != D)
    fail(op, "key/value must be [num_tokens, num_kv_heads, head_dim] matching the cache, got " + shape_str(rows.shape()));
  if (slot_mapping.ndim() != 1 || slot_mapping.shape(0) != rows.shape(0))
    fail(op, "slot_mapping must be [num_tokens]");
  if (slot_mapping.dtype() != mx::int32 && slot_mapping.dtype() != mx::int64)
    fail(op, "slot_mapping must be int32 or int64");
  std::vector<mx::array> out;
  for (size_t part = 0; part < cache.size(); ++part) {
    auto prim = std::make_shared<CacheWritePrimitive>(cpu_stream(), q, static_cast<int>(part));
    out.emplace_back(cache[part].shape(), cache[part].dtype(), prim,
                     std::vector<mx::array>{rows, cache[part], slot_mapping});
  }
  return out;
}

// ---------------------------------------------------------------- copy blocks

void CopyBlocksPrimitive::eval_cpu(const std::vector<mx::array>& inputs, std::vector<mx::array>& outputs) {
  auto& out = outputs[0];
  const bool shared = share_or_allocate(inputs[0], out);
  Tensor in = describe(inputs[0]);
  Tensor target = as_row_major_output(out);
  Tensor src = describe(inputs[1]);
  Tensor dst = describe(inputs[2]);
  auto& enc = mx::cpu::get_command_encoder(stream());
  for (auto& a : inputs) enc.set_input_array(a);
  enc.set_output_array(out);
  enc.dispatch([src, dst, in, target, shared]() {
    if (!shared) copy_strided(in, target.ptr);
    copy_blocks(target.ptr, target.shape[0], target.strides[0] * target.itemsize, read_indices(src),
                read_indices(dst));
  });
}

void CopyBlocksPrimitive::eval_gpu(const std::vector<mx::array>&, std::vector<mx::array>&) {
  throw std::runtime_error("[KvmetalCopyBlocks] has no GPU implementation; use the metal backend");
}

std::vector<mx::array> copy_blocks(const std::vector<mx::array>& arrays, const mx::array& src, const mx::array& dst) {
  const char* op = "copy_blocks";
  if (arrays.empty()) fail(op, "no cache arrays given");
  if (src.ndim() != 1 || dst.ndim() != 1 || src.shape(0) != dst.shape(0)) fail(op, "src and dst must be [n]");
  std::vector<mx::array> out;
  for (auto& a : arrays) {
    if (a.ndim() < 1 || a.shape(0) != arrays[0].shape(0)) fail(op, "cache arrays must share num_blocks");
    out.emplace_back(a.shape(), a.dtype(), std::make_shared<CopyBlocksPrimitive>(cpu_stream()),
                     std::vector<mx::array>{a, src, dst});
  }
  return out;
}

}  // namespace kvmetal
