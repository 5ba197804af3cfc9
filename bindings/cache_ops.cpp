#include "cache_ops.h"

#include <algorithm>
#include <cstring>

#include "thread_pool.h"

namespace kvmetal {

void gather_kv(const GatherParams& p, const KVView& cache) {
  const int D = p.head_dim;
  const int out_size = float_kind_size(p.out_kind);
  const TileKernels& tk = tile_kernels(D);
  ThreadPool::instance().parallel_for(static_cast<int64_t>(p.num_seqs) * p.num_kv_heads, [&](int64_t item) {
    const int s = static_cast<int>(item / p.num_kv_heads);
    const int h = static_cast<int>(item % p.num_kv_heads);
    const int len = std::min(p.seq_lens[s], p.max_len);
    char* out = p.out + item * p.max_len * D * out_size;
    std::vector<float> row(cache.quantized ? D : 0);
    for (int t = 0; t < len; ++t) {
      const int64_t block = p.block_tables[static_cast<int64_t>(s) * p.max_blocks + t / p.block_size];
      const int r = t % p.block_size;
      char* dst = out + static_cast<int64_t>(t) * D * out_size;
      if (cache.quantized) {
        int64_t stride;
        cache.tile(block, h, r, 1, row.data(), &stride, tk);
        for (int d = 0; d < D; ++d) store_from_f32(dst, d, row[d], p.out_kind);
      } else {
        // Same dtype in and out: a row copy.
        std::memcpy(dst, cache.data + cache.offset(cache.stride, block, h, r) * out_size, D * out_size);
      }
    }
    std::memset(out + static_cast<int64_t>(len) * D * out_size, 0,
                static_cast<size_t>(p.max_len - len) * D * out_size);
  });
}

void write_rows(const char* rows, FloatKind rows_kind, int num_tokens, int num_kv_heads,
                const std::vector<int64_t>& slots, int block_size, const KVView& cache) {
  const int D = cache.D;
  const int64_t heads = num_kv_heads;
  const int rows_size = float_kind_size(rows_kind);
  auto write_token = [&](int64_t i) {
    const int64_t slot = slots[i];
    if (slot < 0) return;  // padding
    const int64_t block = slot / block_size;
    const int64_t r = slot % block_size;
    std::vector<float> x(D);
    for (int64_t h = 0; h < heads; ++h) {
      const char* src = rows + (i * heads + h) * D * rows_size;
      if (cache.quantized) {
        for (int d = 0; d < D; ++d) x[d] = load_as_f32(src, d, rows_kind);
        const int sz = float_kind_size(cache.fmt.scale_kind);
        quantize_row(x.data(), cache.fmt, D,
                     const_cast<uint32_t*>(reinterpret_cast<const uint32_t*>(cache.data)) +
                         cache.offset(cache.stride, block, h, r),
                     const_cast<char*>(cache.scales) + sz * cache.offset(cache.scale_stride, block, h, r),
                     const_cast<char*>(cache.biases) + sz * cache.offset(cache.bias_stride, block, h, r));
        continue;
      }
      const int cache_size = float_kind_size(cache.kind);
      char* dst = const_cast<char*>(cache.data) + cache.offset(cache.stride, block, h, r) * cache_size;
      if (cache.kind == rows_kind) {
        std::memcpy(dst, src, static_cast<size_t>(D) * cache_size);
      } else {
        for (int d = 0; d < D; ++d) store_from_f32(dst, d, load_as_f32(src, d, rows_kind), cache.kind);
      }
    }
  };
  // Prefill writes many tokens; decode writes one (no point waking threads).
  if (num_tokens >= 64) {
    ThreadPool::instance().parallel_for(num_tokens, write_token);
  } else {
    for (int64_t i = 0; i < num_tokens; ++i) write_token(i);
  }
}

void copy_blocks(char* data, int64_t block_bytes, const std::vector<int64_t>& src, const std::vector<int64_t>& dst) {
  // Every copy reads the cache as it was before the call (a block that is both
  // a destination and a later source gives its old contents), so sources are
  // staged first.
  std::vector<char> staged(src.size() * static_cast<size_t>(block_bytes));
  for (size_t i = 0; i < src.size(); ++i)
    std::memcpy(staged.data() + i * block_bytes, data + src[i] * block_bytes, static_cast<size_t>(block_bytes));
  for (size_t i = 0; i < dst.size(); ++i)
    std::memcpy(data + dst[i] * block_bytes, staged.data() + i * block_bytes, static_cast<size_t>(block_bytes));
}

}  // namespace kvmetal
