// Standalone driver of kvmetal's CPU decode without Python or MLX (its half-type
// header only), for profiling (cachegrind, perf) and A/B timing: the bench workload
// (1 sequence, T tokens, H 32 / Hkv 8, D 128, block 16, shuffled blocks).
// HOT=n alternates, call by call in one process, three things over the same bytes:
// the decode on the shuffled pool (cold), the decode with every block id taken mod
// n (hot: n blocks, 64 KiB each in float16, stay in L2), and a streaming read of a
// buffer that size on the same threads. Cold minus hot is what memory costs the
// decode; hot alone is its arithmetic. Alternating cancels the drift of a shared host.
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
#include <immintrin.h>
#include "attention.h"
#include "float_convert.h"
#include "quant_rows.h"
#include "thread_pool.h"
using namespace kvmetal;
static double cpu_s() { timespec t; clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
static double wall_s() { timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + t.tv_nsec * 1e-9; }
// One pass over buf split across the pool's threads: 4 independent 32-byte loads per step.
static float stream_read(const std::vector<float>& buf) {
  const int64_t parts = ThreadPool::instance().num_threads(), n = static_cast<int64_t>(buf.size());
  std::vector<float> sums(parts);
  ThreadPool::instance().parallel_for(parts, [&](int64_t t) {
    const float* a = buf.data() + n * t / parts;
    const float* e = buf.data() + n * (t + 1) / parts - 31;
    __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0;
    for (; a < e; a += 32) {
      s0 = _mm256_add_ps(s0, _mm256_loadu_ps(a)); s1 = _mm256_add_ps(s1, _mm256_loadu_ps(a + 8));
      s2 = _mm256_add_ps(s2, _mm256_loadu_ps(a + 16)); s3 = _mm256_add_ps(s3, _mm256_loadu_ps(a + 24));
    }
    alignas(32) float o[8];
    _mm256_store_ps(o, _mm256_add_ps(_mm256_add_ps(s0, s1), _mm256_add_ps(s2, s3)));
    sums[t] = o[0];
  });
  return std::accumulate(sums.begin(), sums.end(), 0.f);
}
static double median(std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; }
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
  if (const char* hot_env = getenv("HOT")) {
    std::vector<int32_t> hot(table);
    for (auto& b : hot) b %= std::max(1, atoi(hot_env));
    std::vector<float> buf(bytes / 4, 1.f);
    std::vector<double> cold_s, hot_s, read_s;
    volatile float sink = 0;
    for (int i = 0; i <= reps; ++i) {  // the first round warms up and is not counted
      double t0 = wall_s();
      p.block_tables = table.data(); decode_attention(p, kv, vv);
      double t1 = wall_s();
      p.block_tables = hot.data(); decode_attention(p, kv, vv);
      double t2 = wall_s();
      sink = sink + stream_read(buf);
      double t3 = wall_s();
      if (i) { cold_s.push_back(t1 - t0); hot_s.push_back(t2 - t1); read_s.push_back(t3 - t2); }
    }
    const double c = median(cold_s), h = median(hot_s), r = median(read_s);
    printf("%s T=%d thr=%d %s, medians of %d alternating rounds: cold %.2f ms (%.2f GB/s), hot %.2f ms, "
           "read of the same bytes %.2f ms (%.2f GB/s)\n  the decode reads at %.2f of the read bandwidth; the hot run "
           "(arithmetic alone) takes %.2f of the cold one; memory adds %.2f ms\n",
           kind.c_str(), T, threads, level, reps, c * 1e3, bytes / c / 1e9, h * 1e3, r * 1e3, bytes / r / 1e9, r / c,
           h / c, (c - h) * 1e3);
    return 0;
  }
  decode_attention(p, kv, vv);  // warm
  std::vector<double> c, w;
  for (int i = 0; i < reps; ++i) { double c0 = cpu_s(), w0 = wall_s(); decode_attention(p, kv, vv); c.push_back(cpu_s() - c0); w.push_back(wall_s() - w0); }
  std::sort(c.begin(), c.end()); std::sort(w.begin(), w.end());
  double sum = 0; for (float x : out) sum += x;
  printf("%s T=%d thr=%d %s: cpu med %.2f ms min %.2f (%.2f GB/cpu-s) wall med %.2f min %.2f ms (%.2f GB/s)  checksum %.6f\n", kind.c_str(), T, threads, level,
         c[reps / 2] * 1e3, c[0] * 1e3, bytes / c[0] / 1e9, w[reps / 2] * 1e3, w[0] * 1e3, bytes / w[0] / 1e9, sum);
  if (getenv("DUMP")) { FILE* f = fopen(getenv("DUMP"), "wb"); fwrite(out.data(), 4, out.size(), f); fclose(f); }
}
