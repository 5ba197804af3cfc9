// Cache reads and block copies: gather a paged cache into contiguous rows
// (dequantizing a quantized cache) and gather whole blocks for copy_blocks.
// File layout: see attention.metal (helper section, then `//@kernel` bodies).

//@kernel gather_kv_rows
// Inputs:  cache_data [N, Hkv, BS, W] (TE, or uint32 packed); cache_scales,
//          cache_biases [N, Hkv, BS, D/GS] TE (8-element placeholders for a float
//          cache); block_tables int32 [S, M]; seq_lens int32 [S];
//          params int32 KvGatherParams
// Outputs: rows_out [S, Hkv, max_len, D] TE; rows past seq_len are zero.
// Index guards (validate=False misuse): a length beyond the block table is cut
// to it, and a row of a block id outside [0, N) is zero, never read.
// Grid:    threads (TASKS, max_len, S * Hkv): one vec4 (float) or one group
//          (quantized) per thread; threadgroup (TASKS, 1, 1).
const int task = int(thread_position_in_grid.x);
const int tok = int(thread_position_in_grid.y);
const int seq_head = int(thread_position_in_grid.z);
const device KvGatherParams& p = kv_params<KvGatherParams>(params);
const int num_kv_heads = p.num_kv_heads;
const int max_blocks = p.max_blocks;
const int max_len = p.max_len;
const int num_blocks = p.num_blocks;
const int seq = seq_head / num_kv_heads;
const int kvh = seq_head % num_kv_heads;

typedef typename RowsSelect<BITS, GS, D, decltype(cache_data), decltype(cache_scales)>::type RowsT;
typedef PagedRowIndex<BS, RowShape<BITS, GS, D>::WIDTH, RowShape<BITS, GS, D>::GROUPS,
                      decltype(block_tables)> IndexT;
const RowsT rows = {cache_data, cache_scales, cache_biases};
const IndexT index = {block_tables + seq * max_blocks, num_kv_heads, kvh};
device TE* dst = rows_out + (size_t(seq_head) * max_len + tok) * D;
const int len = min(seq_lens[seq], max_blocks * BS);
if (tok < len && uint(block_tables[seq * max_blocks + tok / BS]) < uint(num_blocks)) {
  rows.template read<TE>(index(tok), task, dst);
} else {
  for (int i = 0; i < RowsT::TASK_ELEMS; i++) {
    dst[task * RowsT::TASK_ELEMS + i] = static_cast<TE>(0.0f);
  }
}

//@kernel copy_blocks_gather
// Inputs:  blocks [N, E] (one cache array, any dtype, a block per row); src int32 [n]
// Outputs: blocks_out [n, E] T: blocks_out[i] = blocks[src[i]]
// Grid:    threads (E, n); threadgroup (the largest power of two <= 256 dividing E, 1, 1)
//          (threadgroups never straddle a block row).
const size_t elem = thread_position_in_grid.x;
const size_t i = thread_position_in_grid.y;
const size_t width = threads_per_grid.x;
blocks_out[i * width + elem] = blocks[size_t(src[i]) * width + elem];
