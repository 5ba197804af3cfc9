// kvmetal.sim: simdgroup_matrix (<metal_simdgroup_matrix>): 8x8 matrices spread
// over the 32 lanes of a simdgroup, and the simdgroup-wide operations on them.
//
// Lane ownership follows the layout Apple GPUs use (the one MLX's steel
// BaseMMAFrag::get_coord relies on): lane l holds row fm and columns fn, fn+1,
//   qid = l / 4, fm = (qid & 4) + (l / 2) % 4, fn = (qid & 2) * 2 + (l % 2) * 2,
// so thread_elements()[0] is (fm, fn) and [1] is (fm, fn + 1). The four lanes
// of one row differ in lane bits 0 and 3 (a row reduction is shuffle_xor 1, 8).
//
// simdgroup_load / simdgroup_store / simdgroup_multiply(_accumulate) are
// simdgroup operations: each is a collective (call site numbered by
// translate.py, counted by name, strict mode requires every lane), and the
// multiply is resolved on the whole 8x8 matrices assembled from the lanes.
// Outside strict mode a missing lane contributes poison (NaN) to a multiply.
// Products are accumulated in float and rounded once to the result's type.
#pragma once
#include "msl_simd.h"

namespace kmsl {
// (row, first of the two columns) lane `l` holds.
inline void frag_coord(int l, int& row, int& col) {
  const int qid = l / 4;
  row = (qid & 4) + (l / 2) % 4;
  col = (qid & 2) * 2 + (l % 2) * 2;
}
inline int current_lane() { return int(kmsl_rt_thread_index() % 32u); }
}  // namespace kmsl

namespace metal {

template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "kvmetal.sim: only 8x8 simdgroup matrices");
  vec<T, 2> e;  // this lane's elements: (row fm, column fn) and (fm, fn + 1)
  simdgroup_matrix() = default;
  // MSL: a diagonal matrix, `d` on the diagonal and 0 elsewhere.
  explicit simdgroup_matrix(T d) {
    int row, col;
    kmsl::frag_coord(kmsl::current_lane(), row, col);
    e[0] = row == col ? d : T(0);
    e[1] = row == col + 1 ? d : T(0);
  }
  vec<T, 2>& thread_elements() { return e; }
  const vec<T, 2>& thread_elements() const { return e; }
};

typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <class T, int Cols, int Rows>
simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.e[0] = value;
  m.e[1] = value;
  return m;
}

}  // namespace metal

namespace kmsl {

template <class Td, class Ta, class Tb, class Tc>
struct mma_lane {
  metal::vec<Ta, 2> a;
  metal::vec<Tb, 2> b;
  metal::vec<Tc, 2> c;
};

// Assemble the 8x8 matrix of one operand from the lanes; missing lanes are NaN.
template <class T, class Get>
void gather_frag(const KmslGroup* g, float (&m)[8][8], Get get) {
  for (int l = 0; l < 32; l++) {
    int row, col;
    frag_coord(l, row, col);
    if (active(g, l)) {
      const metal::vec<T, 2>& v = get(l);
      m[row][col] = float(v[0]);
      m[row][col + 1] = float(v[1]);
    } else {
      m[row][col] = m[row][col + 1] = __builtin_nanf("");
    }
  }
}

template <class Td, class Ta, class Tb, class Tc, bool Acc>
int resolve_mma(KmslGroup* g) {
  typedef mma_lane<Td, Ta, Tb, Tc> L;
  float a[8][8], b[8][8], c[8][8];
  gather_frag<Ta>(g, a, [&](int l) -> const metal::vec<Ta, 2>& { return in_of<L>(g, l).a; });
  gather_frag<Tb>(g, b, [&](int l) -> const metal::vec<Tb, 2>& { return in_of<L>(g, l).b; });
  if (Acc) gather_frag<Tc>(g, c, [&](int l) -> const metal::vec<Tc, 2>& { return in_of<L>(g, l).c; });
  for (int l = 0; l < 32; l++) {
    if (!active(g, l)) continue;
    int row, col;
    frag_coord(l, row, col);
    metal::vec<Td, 2> out;
    for (int j = 0; j < 2; j++) {
      float s = Acc ? c[row][col + j] : 0.0f;
      for (int k = 0; k < 8; k++) s = __builtin_fmaf(a[row][k], b[k][col + j], s);
      out[j] = Td(s);
    }
    out_of<metal::vec<Td, 2>>(g, l) = out;
  }
  return 0;
}

// The element offset of (row, col) of the 8x8 block at `origin` (column, row)
// of a row-major source with `epr` elements per row; transposed: (col, row).
inline int64_t frag_offset(int row, int col, uint64_t epr, metal::ulong2 origin, bool transpose) {
  if (transpose) return int64_t((origin[1] + col) * epr + origin[0] + row);
  return int64_t((origin[1] + row) * epr + origin[0] + col);
}

}  // namespace kmsl

namespace metal {

// d = a * b + c (all 8x8; element types may differ, the sum is in float).
template <class Td, class Ta, class Tb, class Tc>
void simdgroup_multiply_accumulate(kmsl::site_t s, simdgroup_matrix<Td, 8, 8>& d, const simdgroup_matrix<Ta, 8, 8>& a,
                                   const simdgroup_matrix<Tb, 8, 8>& b, const simdgroup_matrix<Tc, 8, 8>& c) {
  const kmsl::mma_lane<Td, Ta, Tb, Tc> in{a.e, b.e, c.e};
  d.e = kmsl::collective<vec<Td, 2>>(s.p, "simdgroup_multiply_accumulate",
                                     &kmsl::resolve_mma<Td, Ta, Tb, Tc, true>, in, 0);
}
template <class Td, class Ta, class Tb, class Tc>
[[gnu::noinline]] void simdgroup_multiply_accumulate(simdgroup_matrix<Td, 8, 8>& d, const simdgroup_matrix<Ta, 8, 8>& a,
                                                     const simdgroup_matrix<Tb, 8, 8>& b,
                                                     const simdgroup_matrix<Tc, 8, 8>& c) {
  simdgroup_multiply_accumulate(KMSL_SITE, d, a, b, c);
}
// d = a * b
template <class Td, class Ta, class Tb>
void simdgroup_multiply(kmsl::site_t s, simdgroup_matrix<Td, 8, 8>& d, const simdgroup_matrix<Ta, 8, 8>& a,
                        const simdgroup_matrix<Tb, 8, 8>& b) {
  const kmsl::mma_lane<Td, Ta, Tb, Td> in{a.e, b.e, vec<Td, 2>(Td(0))};
  d.e = kmsl::collective<vec<Td, 2>>(s.p, "simdgroup_multiply", &kmsl::resolve_mma<Td, Ta, Tb, Td, false>, in, 0);
}
template <class Td, class Ta, class Tb>
[[gnu::noinline]] void simdgroup_multiply(simdgroup_matrix<Td, 8, 8>& d, const simdgroup_matrix<Ta, 8, 8>& a,
                                          const simdgroup_matrix<Tb, 8, 8>& b) {
  simdgroup_multiply(KMSL_SITE, d, a, b);
}

// Load / store: every lane of the simdgroup must take part (the collective),
// then each lane moves its own two elements through the (checked) pointer.
template <class T, class P>
void simdgroup_load(kmsl::site_t s, simdgroup_matrix<T, 8, 8>& d, P src, ulong elements_per_row = 8,
                    ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  kmsl::collective<int>(s.p, "simdgroup_load", &kmsl::resolve_nothing, 0, 0);
  int row, col;
  kmsl::frag_coord(kmsl::current_lane(), row, col);
  for (int j = 0; j < 2; j++)
    d.e[j] = T(src[kmsl::frag_offset(row, col + j, elements_per_row, matrix_origin, transpose_matrix)]);
}
template <class T, class P>
[[gnu::noinline]] void simdgroup_load(simdgroup_matrix<T, 8, 8>& d, P src, ulong elements_per_row = 8,
                                      ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  simdgroup_load(KMSL_SITE, d, src, elements_per_row, matrix_origin, transpose_matrix);
}
template <class T, class P>
void simdgroup_store(kmsl::site_t s, const simdgroup_matrix<T, 8, 8>& m, P dst, ulong elements_per_row = 8,
                     ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  kmsl::collective<int>(s.p, "simdgroup_store", &kmsl::resolve_nothing, 0, 0);
  int row, col;
  kmsl::frag_coord(kmsl::current_lane(), row, col);
  for (int j = 0; j < 2; j++)
    dst[kmsl::frag_offset(row, col + j, elements_per_row, matrix_origin, transpose_matrix)] = m.e[j];
}
template <class T, class P>
[[gnu::noinline]] void simdgroup_store(const simdgroup_matrix<T, 8, 8>& m, P dst, ulong elements_per_row = 8,
                                       ulong2 matrix_origin = ulong2(0), bool transpose_matrix = false) {
  simdgroup_store(KMSL_SITE, m, dst, elements_per_row, matrix_origin, transpose_matrix);
}

}  // namespace metal
