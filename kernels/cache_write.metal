// Cache writes: new K/V rows converted (or quantized) to the cache's format.
//
// metal_kernel outputs are fresh arrays, so these kernels only produce the rows;
// kvmetal/backends/metal.py scatters them into the cache with an MLX scatter,
// which MLX performs in place when the cache holds the only reference.
// File layout: see attention.metal (helper section, then `//@kernel` bodies).

// Quantize one group of GS values the way mx.quantize does (MLX affine: the
// edge of larger magnitude lands exactly on a code), packing BITS per value
// little-endian into GS * BITS / 32 words.
template <int BITS, int GS, typename TS, typename PI, typename PW, typename PS>
inline void kv_quantize_group(PI src, PW words, PS scale_out, PS bias_out) {
  constexpr float n_bins = float((1 << BITS) - 1);
  float w_min = static_cast<float>(src[0]);
  float w_max = w_min;
  for (int i = 1; i < GS; i++) {
    const float w = static_cast<float>(src[i]);
    w_min = min(w_min, w);
    w_max = max(w_max, w);
  }
  const bool low_edge = fabs(w_min) > fabs(w_max);
  float scale = max((w_max - w_min) / n_bins, 1e-7f);
  scale = low_edge ? scale : -scale;
  const float edge = low_edge ? w_min : w_max;
  const float q0 = rint(edge / scale);
  float bias = 0.0f;
  if (q0 != 0.0f) {
    scale = edge / q0;
    bias = edge;
  }
  uint64_t window = 0;
  int have = 0;
  int next = 0;
  for (int i = 0; i < GS; i++) {
    const float q = clamp(rint((static_cast<float>(src[i]) - bias) / scale), 0.0f, n_bins);
    window |= uint64_t(q) << have;
    have += BITS;
    if (have >= 32) {
      words[next] = uint(window & 0xffffffffu);
      next++;
      window >>= 32;
      have -= 32;
    }
  }
  scale_out[0] = static_cast<TS>(scale);
  bias_out[0] = static_cast<TS>(bias);
}

//@kernel cache_rows_convert
// Inputs:  new_rows [T, Hkv, D] (any float dtype); output row t is input row t
// Outputs: rows_out [T, Hkv, D] TC
// Grid:    threads (D / 4, Hkv, T); threadgroup (D / 4, 1, 1).
const int chunk = int(thread_position_in_grid.x);
const int kvh = int(thread_position_in_grid.y);
const int tok = int(thread_position_in_grid.z);
const int num_kv_heads = int(threads_per_grid.y);
const size_t row = (size_t(tok) * num_kv_heads + kvh) * D + chunk * 4;
kv_store4<TC>(rows_out + row, kv_load4(new_rows + row));

//@kernel cache_rows_quantize
// Inputs:  new_rows [T, Hkv, D] (any float dtype); output row t is input row t
// Outputs: words_out uint32 [T, Hkv, D * BITS / 32]; scales_out, biases_out
//          [T, Hkv, D / GS] TC. Each row's scales come from that row alone.
// Grid:    threads (D / GS, Hkv, T), one group each; threadgroup (D / GS, 1, 1).
const int group = int(thread_position_in_grid.x);
const int kvh = int(thread_position_in_grid.y);
const int tok = int(thread_position_in_grid.z);
const int num_kv_heads = int(threads_per_grid.y);
const size_t row = size_t(tok) * num_kv_heads + kvh;
kv_quantize_group<BITS, GS, TC>(new_rows + row * D + group * GS,
                            words_out + row * (D * BITS / 32) + group * (GS * BITS / 32),
                            scales_out + row * (D / GS) + group,
                            biases_out + row * (D / GS) + group);
