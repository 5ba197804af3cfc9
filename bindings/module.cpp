// kvmetal._ext: the native CPU backend (MLX primitives with eval_cpu).
//
// Thin bindings: kvmetal/backends/cpu.py unpacks QuantizedKV containers into
// arrays + (bits, group_size) and calls these. bits == 0 marks a float cache.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <cstdint>

#include "cascade_op.h"
#include "primitives.h"
#include "thread_pool.h"
#include "tile_math.h"

namespace nb = nanobind;
using namespace nb::literals;
namespace mx = mlx::core;

namespace {

kvmetal::QuantSpec spec(int bits, int group_size) { return kvmetal::QuantSpec{bits, bits ? group_size : 0}; }

kvmetal::AttentionOptions options(float scale, std::optional<float> softcap, int sliding_window, int num_splits,
                                  int min_tokens_per_split, float sparse_v = 0.f) {
  kvmetal::AttentionOptions o;
  o.sparse_v = sparse_v;
  o.scale = scale;
  o.softcap = softcap;
  o.sliding_window = sliding_window;
  o.num_splits = num_splits;
  o.min_tokens_per_split = min_tokens_per_split;
  return o;
}

}  // namespace

NB_MODULE(_ext, m) {
  m.doc() = "kvmetal native CPU backend";
  // The MLX version this extension was compiled against (kvmetal/_build_info.py holds the
  // same string, readable before this module loads).
  m.attr("mlx_version") = KVMETAL_MLX_VERSION;

  m.def(
      "paged_attention",
      [](const mx::array& query, const std::vector<mx::array>& k, int k_bits, int k_group,
         const std::vector<mx::array>& v, int v_bits, int v_group, const mx::array& block_tables,
         const mx::array& seq_lens, float scale, std::optional<float> softcap, int sliding_window,
         std::optional<mx::array> sinks, int num_splits, int min_tokens_per_split, float sparse_v) {
        return kvmetal::paged_attention(
            query, k, spec(k_bits, k_group), v, spec(v_bits, v_group), block_tables, seq_lens,
            options(scale, softcap, sliding_window, num_splits, min_tokens_per_split, sparse_v), sinks);
      },
      "query"_a, "k"_a, "k_bits"_a, "k_group"_a, "v"_a, "v_bits"_a, "v_group"_a, "block_tables"_a, "seq_lens"_a,
      nb::kw_only(), "scale"_a, "softcap"_a = nb::none(), "sliding_window"_a = 0, "sinks"_a = nb::none(),
      "num_splits"_a = 0, "min_tokens_per_split"_a, "sparse_v"_a = 0.f,
      "Split-KV decode attention over a paged cache. query [S, L, H, D] (or [S, H, D]) -> the query's shape.");

  m.def(
      "paged_attention_varlen",
      [](const mx::array& query, const std::vector<mx::array>& k, int k_bits, int k_group,
         const std::vector<mx::array>& v, int v_bits, int v_group, const mx::array& block_tables,
         const mx::array& seq_lens, const mx::array& query_start_loc, float scale, std::optional<float> softcap,
         int sliding_window, std::optional<mx::array> sinks, int min_tokens_per_split) {
        return kvmetal::paged_attention_varlen(query, k, spec(k_bits, k_group), v, spec(v_bits, v_group),
                                               block_tables, seq_lens, query_start_loc,
                                               options(scale, softcap, sliding_window, 0, min_tokens_per_split),
                                               sinks);
      },
      "query"_a, "k"_a, "k_bits"_a, "k_group"_a, "v"_a, "v_bits"_a, "v_group"_a, "block_tables"_a, "seq_lens"_a,
      "query_start_loc"_a, nb::kw_only(), "scale"_a, "softcap"_a = nb::none(), "sliding_window"_a = 0,
      "sinks"_a = nb::none(), "min_tokens_per_split"_a,
      "Paged varlen attention: query [T, H, D], sequence s owns rows [qsl[s], qsl[s + 1]) -> [T, H, D].");

  m.def(
      "paged_attention_cascade",
      [](const mx::array& query, const std::vector<mx::array>& k, int k_bits, int k_group,
         const std::vector<mx::array>& v, int v_bits, int v_group, const mx::array& prefix_tables,
         const mx::array& prefix_lens, const mx::array& prefix_of, const mx::array& block_tables,
         const mx::array& seq_lens, float scale, std::optional<float> softcap, std::optional<mx::array> sinks,
         int min_tokens_per_split, float sparse_v) {
        return kvmetal::paged_attention_cascade(query, k, spec(k_bits, k_group), v, spec(v_bits, v_group),
                                                prefix_tables, prefix_lens, prefix_of, block_tables, seq_lens,
                                                options(scale, softcap, 0, 0, min_tokens_per_split, sparse_v), sinks);
      },
      "query"_a, "k"_a, "k_bits"_a, "k_group"_a, "v"_a, "v_bits"_a, "v_group"_a, "prefix_tables"_a,
      "prefix_lens"_a, "prefix_of"_a, "block_tables"_a, "seq_lens"_a, nb::kw_only(), "scale"_a,
      "softcap"_a = nb::none(), "sinks"_a = nb::none(), "min_tokens_per_split"_a, "sparse_v"_a = 0.f,
      "Shared-prefix decode attention: query [S, H, D]; sequence s attends to prefix prefix_of[s] "
      "(-1: none), then its own tokens -> [S, H, D].");

  m.def(
      "decode_attention",
      [](const mx::array& query, const std::vector<mx::array>& k, int k_bits, int k_group,
         const std::vector<mx::array>& v, int v_bits, int v_group, float scale, std::optional<float> softcap,
         std::optional<mx::array> sinks, int num_splits, int min_tokens_per_split, float sparse_v) {
        return kvmetal::decode_attention(query, k, spec(k_bits, k_group), v, spec(v_bits, v_group),
                                         options(scale, softcap, 0, num_splits, min_tokens_per_split, sparse_v),
                                         sinks);
      },
      "query"_a, "k"_a, "k_bits"_a, "k_group"_a, "v"_a, "v_bits"_a, "v_group"_a, nb::kw_only(), "scale"_a,
      "softcap"_a = nb::none(), "sinks"_a = nb::none(), "num_splits"_a = 0, "min_tokens_per_split"_a,
      "sparse_v"_a = 0.f,
      "Split-KV decode attention over contiguous (possibly strided) [B, Hkv, T, D] keys/values.");

  m.def(
      "gather_kv",
      [](const std::vector<mx::array>& cache, int bits, int group, const mx::array& block_tables,
         const mx::array& seq_lens, int max_len) {
        return kvmetal::gather_kv(cache, spec(bits, group), block_tables, seq_lens, max_len);
      },
      "cache"_a, "bits"_a, "group_size"_a, "block_tables"_a, "seq_lens"_a, nb::kw_only(), "max_len"_a,
      "One cache gathered to [S, Hkv, max_len, D] (dequantized), zero past seq_len.");

  m.def(
      "cache_write",
      [](const mx::array& rows, const std::vector<mx::array>& cache, int bits, int group,
         const mx::array& slot_mapping) { return kvmetal::cache_write(rows, cache, spec(bits, group), slot_mapping); },
      "rows"_a, "cache"_a, "bits"_a, "group_size"_a, "slot_mapping"_a,
      "Write rows [T, Hkv, D] into one cache's slots; returns the cache arrays (in place when donatable).");

  m.def("copy_blocks", &kvmetal::copy_blocks, "arrays"_a, "src"_a, "dst"_a,
        "Copy block src[i] (as it was before the call) to dst[i] in every array; in place when donatable.");

  // Debug / test helpers.
  m.def(
      "data_pointer",
      [](const mx::array& a) {
        if (a.status() == mx::array::Status::unscheduled)
          throw std::invalid_argument("[data_pointer] evaluate the array first (mx.eval)");
        return reinterpret_cast<std::uintptr_t>(a.data<char>());
      },
      "a"_a, "Address of an evaluated array's first element (to test in-place updates).");
  m.def(
      "set_num_threads", [](int n) { kvmetal::ThreadPool::instance().set_num_threads(n); }, "n"_a,
      "Resize the kernel thread pool (the caller counts as one thread).");
  m.def("num_threads", []() { return kvmetal::ThreadPool::instance().num_threads(); });
  m.def("simd_level", []() { return std::string(kvmetal::best_tile_kernels().name); },
        "The widest tile kernels in use: 'avx512', 'avx2' or 'portable'.");
  m.def(
      "cap_simd_level",
      [](const std::string& name) {
        if (!kvmetal::cap_tile_level(name))
          throw std::invalid_argument("[cap_simd_level] name must be 'portable', 'avx2' or 'avx512'");
      },
      "name"_a, "Use no kernels wider than `name` (tests run every implementation the CPU has).");
  m.def("set_int8_k_scores", [](bool on) { kvmetal::set_int8_k_scores(on); }, "on"_a,
        "Score 8-bit K against int8 queries where the CPU has the kernel (off by default; docs/cpu.md).");
  m.def("int8_k_scores", []() { return kvmetal::int8_k_scores(); });
}
