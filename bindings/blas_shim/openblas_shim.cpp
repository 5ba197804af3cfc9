// libkvmetal_openblas.so (Linux): MLX's cblas_sgemm, cblas_dgemm and cblas_cgemm served
// by the OpenBLAS of the scipy-openblas32 wheel (or scipy-openblas64).
//
// MLX's Linux CPU wheel links the reference (netlib) BLAS, whose float32 matmuls run at a
// few GFLOPS. The scipy-openblas wheels ship OpenBLAS with every symbol renamed
// ("scipy_cblas_sgemm"; the ILP64 build also adds "64_"), so that library alone cannot
// stand in for MLX's. kvmetal/models/blas.py loads it and then this library into the
// process's global scope before libmlx is loaded: the dynamic linker looks there before
// libmlx's own dependencies, so libmlx's cblas_* calls land here and go on to OpenBLAS.
// Not a part of the extension: no MLX, no Python, only libdl.
//
// Batch invariance: OpenBLAS computes a product of few rows (a decode step of one or a few
// sequences: M x N under a few thousand outputs, M = 1 above all, which goes to gemv) in
// other kernels than a product of many, and these round differently, so a row's result
// would depend on how many rows share its call. cblas_sgemm here pads such a call with
// zero rows up to kMinOutputs outputs (and 2 rows), and every call to whole blocks of
// kAlignRows rows: every row then takes the kernels of a large product in a whole
// micro-tile, whatever its batch (tests/test_blas.py checks rows against a larger call).
#include <dlfcn.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

// CBLAS enums are ints in both ABIs; the dimensions are int (LP64) or int64_t (ILP64).
template <typename I>
using Sgemm = void (*)(int, int, int, I, I, I, float, const float*, I, const float*, I, float, float*, I);
template <typename I>
using Dgemm = void (*)(int, int, int, I, I, I, double, const double*, I, const double*, I, double, double*, I);
template <typename I>
using Cgemm = void (*)(int, int, int, I, I, I, const void*, const void*, I, const void*, I, const void*, void*, I);

struct Table {
  bool ilp64 = false;
  void* sgemm = nullptr;
  void* dgemm = nullptr;
  void* cgemm = nullptr;
  bool complete() const { return sgemm && dgemm && cgemm; }
};

Table resolve() {
  Table t;
  t.sgemm = dlsym(RTLD_DEFAULT, "scipy_cblas_sgemm");
  t.dgemm = dlsym(RTLD_DEFAULT, "scipy_cblas_dgemm");
  t.cgemm = dlsym(RTLD_DEFAULT, "scipy_cblas_cgemm");
  if (t.complete()) return t;
  t = Table{};
  t.ilp64 = true;
  t.sgemm = dlsym(RTLD_DEFAULT, "scipy_cblas_sgemm64_");
  t.dgemm = dlsym(RTLD_DEFAULT, "scipy_cblas_dgemm64_");
  t.cgemm = dlsym(RTLD_DEFAULT, "scipy_cblas_cgemm64_");
  return t;
}

const Table& table() {
  static const Table t = resolve();
  if (!t.complete()) {
    std::fputs("kvmetal: libkvmetal_openblas.so was loaded without scipy-openblas32's library in the global "
               "scope (load it first, RTLD_GLOBAL); no BLAS to call\n", stderr);
    std::abort();
  }
  return t;
}

constexpr int kRowMajor = 101, kNoTrans = 111;
constexpr int64_t kMinOutputs = 2048;  // padded calls: M x N >= this, M >= 2 (measured: differing rows up to 1,152)
// Rows are computed in whole micro-tiles of the kernel's M unroll (12 on OpenBLAS's
// Haswell/Zen sgemm kernels, 16 elsewhere): a row in a call's tail of M % unroll rows
// takes another kernel and rounds differently (an AMD EPYC: a 1- to 257-row call and
// the same rows of a 300-row call differed unless M was a multiple of 12). So every
// row-major call is cut into whole kAlignRows blocks, computed in place, and a rest
// computed in a call padded to kAlignRows rows (a multiple of both unrolls).
constexpr int64_t kAlignRows = 48;

template <typename I>
void sgemm_call(const Table& t, int order, int ta, int tb, int m, int n, int k, float alpha, const float* a, int lda,
                const float* b, int ldb, float beta, float* c, int ldc) {
  reinterpret_cast<Sgemm<I>>(t.sgemm)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

void sgemm_any(const Table& t, int order, int ta, int tb, int m, int n, int k, float alpha, const float* a, int lda,
               const float* b, int ldb, float beta, float* c, int ldc) {
  if (t.ilp64) sgemm_call<int64_t>(t, order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else sgemm_call<int>(t, order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

// Row-major C[M, N] = alpha op(A)[M, K] op(B)[K, N] + beta C with M padded by zero rows.
void sgemm_padded(const Table& t, int ta, int tb, int m, int mp, int n, int k, float alpha, const float* a, int lda,
                  const float* b, int ldb, float beta, float* c, int ldc) {
  thread_local std::vector<float> pa, pc;
  pa.assign(static_cast<size_t>(mp) * k, 0.f);
  pc.assign(static_cast<size_t>(mp) * n, 0.f);
  // op(A) rows go to pa as a row-major [mp, K] (NoTrans) or its transpose [K, mp] (Trans).
  const bool trans_a = ta != kNoTrans;
  for (int i = 0; i < m; ++i)
    for (int j = 0; j < k; ++j)
      pa[trans_a ? static_cast<size_t>(j) * mp + i : static_cast<size_t>(i) * k + j] =
          trans_a ? a[static_cast<int64_t>(j) * lda + i] : a[static_cast<int64_t>(i) * lda + j];
  if (beta != 0.f)
    for (int i = 0; i < m; ++i)
      std::copy_n(c + static_cast<int64_t>(i) * ldc, n, pc.data() + static_cast<size_t>(i) * n);
  sgemm_any(t, kRowMajor, ta, tb, mp, n, k, alpha, pa.data(), trans_a ? mp : k, b, ldb, beta, pc.data(), n);
  for (int i = 0; i < m; ++i) std::copy_n(pc.data() + static_cast<size_t>(i) * n, n, c + static_cast<int64_t>(i) * ldc);
}

}  // namespace

extern "C" {

// 1 when scipy-openblas32's three functions are in the global scope, 2 for scipy-openblas64's
// (ILP64), 0 for neither: kvmetal checks this before it makes the library global.
__attribute__((visibility("default"))) int kvmetal_openblas_ready() {
  const Table t = resolve();
  return t.complete() ? (t.ilp64 ? 2 : 1) : 0;
}

__attribute__((visibility("default"))) void cblas_sgemm(int order, int ta, int tb, int m, int n, int k, float alpha,
                                                        const float* a, int lda, const float* b, int ldb, float beta,
                                                        float* c, int ldc) {
  const Table& t = table();
  if (order == kRowMajor && m > 0 && n > 0 && k > 0) {
    const int64_t small = std::max<int64_t>(2, (kMinOutputs + n - 1) / n);  // fewer rows: padded as a whole
    int64_t done = m / kAlignRows * kAlignRows;  // whole blocks, in place
    if (done < small) done = 0;                   // too few: the whole call is padded
    if (done) sgemm_any(t, order, ta, tb, static_cast<int>(done), n, k, alpha, a, lda, b, ldb, beta, c, ldc);
    const int64_t rest = m - done;
    if (rest > 0) {
      const int64_t mp = (std::max(rest, small) + kAlignRows - 1) / kAlignRows * kAlignRows;
      const float* a_rest = ta != kNoTrans ? a + done : a + done * lda;  // op(A) rows done..m
      sgemm_padded(t, ta, tb, static_cast<int>(rest), static_cast<int>(mp), n, k, alpha, a_rest, lda, b, ldb, beta,
                   c + done * ldc, ldc);
    }
    return;
  }
  sgemm_any(t, order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

__attribute__((visibility("default"))) void cblas_dgemm(int order, int ta, int tb, int m, int n, int k, double alpha,
                                                        const double* a, int lda, const double* b, int ldb,
                                                        double beta, double* c, int ldc) {
  const Table& t = table();
  if (t.ilp64)
    reinterpret_cast<Dgemm<int64_t>>(t.dgemm)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else
    reinterpret_cast<Dgemm<int>>(t.dgemm)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

__attribute__((visibility("default"))) void cblas_cgemm(int order, int ta, int tb, int m, int n, int k,
                                                        const void* alpha, const void* a, int lda, const void* b,
                                                        int ldb, const void* beta, void* c, int ldc) {
  const Table& t = table();
  if (t.ilp64)
    reinterpret_cast<Cgemm<int64_t>>(t.cgemm)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  else
    reinterpret_cast<Cgemm<int>>(t.cgemm)(order, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

}  // extern "C"
