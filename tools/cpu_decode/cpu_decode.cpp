// Standalone driver of kvmetal's CPU decode without Python or MLX (its half-type
// header only), for profiling (cachegrind, perf) and A/B timing: the bench workload
// (1 sequence, T tokens, H 32 / Hkv 8, D 128, block 16, shuffled blocks).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>
#include <ctime>
#include "attention.h"
#include "float_convert.h"
#include "quant_rows.h"
#include "thread_pool.h"
using namespace kvmetal;
static double cpu_s() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static double wall_s() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
int main(int argc, char** argv) {
  std::string kind = argv[1]; int T = atoi(argv[2]); int threads = atoi(argv[3]); int reps = atoi(argv[4]);
  const char* level = argc > 5 ? argv[5] : "avx512";
  cap_tile_level(level);
  if (getenv("INT8")) set_int8_k_scores(true);
  ThreadPool::instance().set_num_threads(threads);
  const int H = 32, Hkv = 8, D = 128, bs = 16, N = (T + bs - 1) / bs;
  const int64_t elems = (int64_t)N * Hkv * bs * D;
  std::mt19937 rng(0); std::normal_distribution<float> nd;
  std::vector<float> kf(elems), vf(elems), q(H * D);
  for (auto& x : kf) x = nd(rng);
  for (auto& x : vf) x = nd(rng);
  for (auto& x : q) x = nd(rng);
  std::vector<int32_t> table(N); std::iota(table.begin(), table.end(), 0); std::shuffle(table.begin(), table.end(), rng);
  int32_t len = T;
  AttentionParams p; p.num_seqs = 1; p.num_heads = H; p.num_kv_heads = Hkv; p.head_dim = D; p.scale = 1.f / std::sqrt((float)D);
  p.paged = true; p.block_size = bs; p.num_blocks = N; p.block_tables = table.data(); p.max_blocks = N; p.seq_lens = &len;
  std::vector<float> out(H * D);
  p.query = reinterpret_cast<const char*>(q.data()); p.q_kind = FloatKind::f32; p.out = reinterpret_cast<char*>(out.data());
  KVView kv, vv; std::vector<uint16_t> kh, vh; std::vector<uint32_t> kw, vw; std::vector<uint16_t> ks, kb, vs, vb;
  int64_t bytes = 0;
  auto fview = [&](KVView& v, const void* data, FloatKind k) {
    v.D = D; v.kind = k; v.data = (const char*)data; v.stride[0] = (int64_t)Hkv * bs * D; v.stride[1] = bs * D; v.stride[2] = D; };
  if (kind == "f32") { fview(kv, kf.data(), FloatKind::f32); fview(vv, vf.data(), FloatKind::f32); bytes = elems * 8; }
  else if (kind == "f16") {
    kh.resize(elems); vh.resize(elems);
    for (int64_t i = 0; i < elems; ++i) { kh[i] = f32_to_f16(kf[i]); vh[i] = f32_to_f16(vf[i]); }
    fview(kv, kh.data(), FloatKind::f16); fview(vv, vh.data(), FloatKind::f16); bytes = elems * 4;
  } else {  // k8v4, group 64, f16 scales
    auto quant = [&](KVView& v, const std::vector<float>& src, int bits, std::vector<uint32_t>& w, std::vector<uint16_t>& s, std::vector<uint16_t>& b) {
      const int gs = 64, rows = elems / D, wpr = D * bits / 32, gpr = D / gs;
      w.resize((int64_t)rows * wpr); s.resize((int64_t)rows * gpr); b.resize((int64_t)rows * gpr);
      QuantFormat f{bits, gs, FloatKind::f16};
      for (int r = 0; r < rows; ++r) quantize_row(src.data() + (int64_t)r * D, f, D, w.data() + (int64_t)r * wpr, s.data() + (int64_t)r * gpr, b.data() + (int64_t)r * gpr);
      v.D = D; v.quantized = true; v.data = (const char*)w.data(); v.fmt = f;
      v.stride[0] = (int64_t)Hkv * bs * wpr; v.stride[1] = bs * wpr; v.stride[2] = wpr;
      v.scales = (const char*)s.data(); v.biases = (const char*)b.data();
      v.scale_stride[0] = v.bias_stride[0] = (int64_t)Hkv * bs * gpr; v.scale_stride[1] = v.bias_stride[1] = bs * gpr; v.scale_stride[2] = v.bias_stride[2] = gpr;
      bytes += (int64_t)rows * (wpr * 4 + gpr * 4);
    };
    quant(kv, kf, 8, kw, ks, kb); quant(vv, vf, 4, vw, vs, vb);
  }
  fprintf(stderr, "kernels: %s\n", tile_kernels(D).name);
  decode_attention(p, kv, vv);  // warm
  std::vector<double> c, w;
  for (int i = 0; i < reps; ++i) { double c0 = cpu_s(), w0 = wall_s(); decode_attention(p, kv, vv); c.push_back(cpu_s() - c0); w.push_back(wall_s() - w0); }
  std::sort(c.begin(), c.end()); std::sort(w.begin(), w.end());
  double sum = 0; for (float x : out) sum += x;
  printf("%s T=%d thr=%d %s: cpu med %.2f ms min %.2f (%.2f GB/cpu-s) wall med %.2f min %.2f ms (%.2f GB/s)  checksum %.6f\n", kind.c_str(), T, threads, level,
         c[reps / 2] * 1e3, c[0] * 1e3, bytes / c[0] / 1e9, w[reps / 2] * 1e3, w[0] * 1e3, bytes / w[0] / 1e9, sum);
  if (getenv("DUMP")) { FILE* f = fopen(getenv("DUMP"), "wb"); fwrite(out.data(), 4, out.size(), f); fclose(f); }
}
