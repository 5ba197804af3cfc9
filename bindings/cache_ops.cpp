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
    const int64_t capacity = std::min<int64_t>(p.max_len, p.max_blocks * p.block_size);
    const int len = static_cast<int>(std::clamp<int64_t>(p.seq_lens[s], 0, capacity));
    char* out = p.out + item * p.max_len * D * out_size;
    std::vector<float> row(cache.quantized ? D : 0);
    for (int t = 0; t < len; ++t) {
      const int64_t block = p.block_tables[static_cast<int64_t>(s) * p.max_blocks + t / p.block_size];
      const int r = t % p.block_size;
      char* dst = out + static_cast<int64_t>(t) * D * out_size;
      if (block < 0 || block >= p.num_blocks) {  // padding
        std::memset(dst, 0, static_cast<size_t>(D) * out_size);
      } else if (cache.quantized) {
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

void write_rows(const char* rows, FloatKind rows_kind, int num_tokens, int num_kv_heads, int head_dim,
                const std::vector<int64_t>& slots, int block_size, const RowTarget& target) {
  const int D = head_dim;
  const int rows_size = float_kind_size(rows_kind);
  const int groups = target.part == CachePart::float_rows ? 0 : D / target.fmt.group_size;
  auto write_token = [&](int64_t i) {
    const int64_t slot = slots[i];
    if (slot < 0 || slot / block_size >= target.num_blocks) return;  // padding, or past the cache
    const int64_t block = slot / block_size;
    const int64_t r = slot % block_size;
    std::vector<float> x(D), scales(groups), biases(groups);
    std::vector<uint32_t> words(target.part == CachePart::float_rows ? 0 : D * target.fmt.bits / 32);
    for (int64_t h = 0; h < num_kv_heads; ++h) {
      const char* src = rows + (i * num_kv_heads + h) * D * rows_size;
      const int64_t off = block * target.stride[0] + h * target.stride[1] + r * target.stride[2];
      if (target.part == CachePart::float_rows) {
        const int size = float_kind_size(target.kind);
        if (target.kind == rows_kind) {
          std::memcpy(target.ptr + off * size, src, static_cast<size_t>(D) * size);
        } else {
          for (int d = 0; d < D; ++d) store_from_f32(target.ptr + off * size, d, load_as_f32(src, d, rows_kind), target.kind);
        }
        continue;
      }
      for (int d = 0; d < D; ++d) x[d] = load_as_f32(src, d, rows_kind);
      QuantFormat f32_fmt = target.fmt;
      f32_fmt.scale_kind = FloatKind::f32;  // the words do not depend on the scale dtype
      quantize_row(x.data(), f32_fmt, D, words.data(), scales.data(), biases.data());
      switch (target.part) {
        case CachePart::quant_data:
          std::memcpy(target.ptr + off * 4, words.data(), words.size() * 4);
          break;
        case CachePart::quant_scales:
          for (int g = 0; g < groups; ++g) store_from_f32(target.ptr + off * float_kind_size(target.kind), g, scales[g], target.kind);
          break;
        default:
          for (int g = 0; g < groups; ++g) store_from_f32(target.ptr + off * float_kind_size(target.kind), g, biases[g], target.kind);
          break;
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

void copy_blocks(char* data, int64_t num_blocks, int64_t block_bytes, const std::vector<int64_t>& src,
                 const std::vector<int64_t>& dst) {
  auto in_range = [&](size_t i) { return src[i] >= 0 && src[i] < num_blocks && dst[i] >= 0 && dst[i] < num_blocks; };
  // Every copy reads the cache as it was before the call (a block that is both
  // a destination and a later source gives its old contents), so sources are
  // staged first.
  std::vector<char> staged(src.size() * static_cast<size_t>(block_bytes));
  for (size_t i = 0; i < src.size(); ++i)
    if (in_range(i))
      std::memcpy(staged.data() + i * block_bytes, data + src[i] * block_bytes, static_cast<size_t>(block_bytes));
  for (size_t i = 0; i < dst.size(); ++i)
    if (in_range(i))
      std::memcpy(data + dst[i] * block_bytes, staged.data() + i * block_bytes, static_cast<size_t>(block_bytes));
}

}  // namespace kvmetal
