// Shared-prefix ("cascade") decode attention: one pass per shared prefix whose
// threadgroup rows are the query rows of every member sequence, one pass over
// each sequence's own tokens, and a reduce that merges both sets of partials.
//
// File layout as in attention.metal. This family is built on attention.metal's
// helper section (KernelSpec.uses: kv_attend, kv_split_range, the tile readers
// and the partial-state layout), which metal_specs.py pastes in before the helpers
// below; nothing of it is copied here.
//
// Design (docs/kernels.md, "Cascade decode"; after FlashInfer's cascade
// attention, which reads a shared prefix once per batch with a multi-query
// pass and merges per-request states):
// - cascade_partials is paged_attention_partials with one difference: every
//   query row sees every token of its table row (no causal staircase). Its
//   QL "query tokens" are the member sequences of one prefix (or QL = 1: one
//   sequence's own tokens), so a threadgroup serves G x QL rows, in register
//   or shared-tile mode as the layout picks, and each prefix K/V row leaves
//   device memory once per (prefix chunk, kv head). kv_attend places row l at
//   position len - QL + l; handing it len + QL - 1 puts every row at or past
//   the last token, while the split range is cut from the true length.
// - cascade_reduce folds, per output row (sequence, head), the prefix
//   partials of its member slot (if any) and its own partials, and the sink,
//   with kv_fold_splits: the same two-phase reduce attention_reduce runs.
// - Index guards (validate=False): lengths clamped to the table width, block
//   ids outside [0, N) are padding (KvPagedRows), a member slot outside the
//   prefix partials is "no prefix".

// cascade_reduce's parameters (kvmetal/backends/metal_cascade.py packs them
// from CASCADE_REDUCE_PARAMS, whose field list must match, in this order).
struct KvCascadeReduceParams {
  int num_heads;
  int prefix_splits;  // splits of the prefix partials
  int own_splits;     // splits of the sequences' own partials
  int prefix_slots;   // member slots in the prefix partials (rows / H)
  int num_seqs;
  int pad0;
  int pad1;
  int pad2;
};

//@kernel cascade_partials
// Inputs:  query [C, QL, H, D]: the QL member rows of each table row; key_*,
//          value_* as in paged_attention_partials; block_tables int32 [C, M];
//          seq_lens int32 [C] (tokens of each table row); params KvAttnParams
//          (window 0)
// Outputs: part_max, part_sum float32 [C * QL * H, splits]; part_acc TP [C * QL * H, splits, D]
// Grid:    threadgroups (splits, Hkv, C), NSG * 32 threads each.
const device KvAttnParams& p = kv_params<KvAttnParams>(params);
const int split = int(threadgroup_position_in_grid.x);
const int kvh = int(threadgroup_position_in_grid.y);
const int seq = int(threadgroup_position_in_grid.z);
const int len = clamp(seq_lens[seq], 0, p.max_blocks * BS);
// The split range of a one-row query over [0, len): every token of the row.
const KvSplitRange range = kv_split_range(len, 1, 0, split, p.num_splits, p.split_tokens, p.split_max, p.split_div, p.split_grow);
KV_ATTN_THREADGROUP_ARRAYS
KvPagedRows<BS, KW_, KNG_, VW_, VNG_, decltype(block_tables)> src;
src.init(block_tables, seq, kvh, p);
const KvSteps unit = kv_unit_steps();
// Rows sit at positions len - 1 .. len + QL - 2: each sees all of [0, len).
kv_attend<D, G, QL, NSG, RPS, LPK, TT, KBITS, KGS, KAW, VBITS, VGS, VAW, PF, SV, TKD, TVD, TK, TV, TQ>(
    src, kv_query_view(query + size_t(seq) * QL * p.num_heads * D, kvh * G, D, p.num_heads * D),
    kv_cache_arrays(key_data, key_scales, key_biases, value_data, value_scales, value_biases, unit, unit),
    len + QL - 1, range, kv_scoring<SV>(p, 0),
    kv_thread_ids(simdgroup_index_in_threadgroup, thread_index_in_simdgroup, thread_index_in_threadgroup), scratch,
    kv_partials_out(part_max, part_sum, part_acc, size_t(seq) * QL * p.num_heads + kvh * G, 1, p.num_heads,
                    p.num_splits, split));

//@kernel cascade_reduce
// Inputs:  prefix_max, prefix_sum float32 [slots * H, prefix_splits], prefix_acc
//          TP [slots * H, prefix_splits, D]: the prefix pass's partials;
//          own_max, own_sum, own_acc likewise [S * H, own_splits(, D)]: the
//          sequences' own tokens; slot_of int32 [S]: the member slot of each
//          sequence in the prefix partials (-1: no prefix); sinks float32 [H]
//          (ignored unless HAS_SINKS); params KvCascadeReduceParams
// Outputs: out [S * H, D] TQ; a row that saw no token is 0.
// Grid:    one threadgroup of 32 threads per row (s, h) = (row / H, row % H).
const device KvCascadeReduceParams& p = kv_params<KvCascadeReduceParams>(params);
const int row = int(threadgroup_position_in_grid.x);
const int lane = int(thread_index_in_threadgroup);
const int head = row % p.num_heads;
const int seq = row / p.num_heads;
const int slot = seq < p.num_seqs ? slot_of[seq] : -1;
const bool has_prefix = slot >= 0 && slot < p.prefix_slots;
// Prefix splits first, then the own splits: one fold over both (kv_reduce_row, the
// reduce attention_reduce runs over splits).
KvSplitParts<D, TP> sp;
sp.max0 = prefix_max;
sp.sum0 = prefix_sum;
sp.acc0 = prefix_acc;
sp.max1 = own_max;
sp.sum1 = own_sum;
sp.acc1 = own_acc;
sp.at0 = has_prefix ? (size_t(slot) * p.num_heads + head) * p.prefix_splits : 0;
sp.at1 = size_t(row) * p.own_splits;
sp.n0 = has_prefix ? p.prefix_splits : 0;
sp.n1 = p.own_splits;
kv_reduce_row<TQ, D>(sp, lane, HAS_SINKS, HAS_SINKS ? kv_sink_logit(sinks[head]) : KV_NEG_BIG,
                     out + size_t(row) * D);
