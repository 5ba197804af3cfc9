// kvmetal.sim: everything a kernel translation unit includes. The kernel's
// MSL (after kvmetal/sim/translate.py's pre-pass) is compiled as C++17 against
// this header, then called once per Metal thread by the runtime (rt.cpp).
#pragma once
#include "abi.h"
#include "msl_types.h"
#include "msl_math.h"
#include "msl_device.h"
#include "msl_simd.h"
#include "msl_simdgroup_matrix.h"

#define METAL_FUNC inline
#define MLX_MTL_CONST static constexpr const
#define MLX_MTL_PRAGMA_UNROLL

// Names of MLX's kernel prelude (mlx/backend/metal/kernels/utils.h) that
// custom kernels commonly use, written from their documented behaviour.
namespace metal {
template <typename U> struct Limits {
  static constexpr U max = numeric_limits<U>::max();
  static constexpr U min = numeric_limits<U>::lowest();
  static constexpr U finite_max = numeric_limits<U>::max();
  static constexpr U finite_min = numeric_limits<U>::lowest();
};
#define KMSL_FLOAT_LIMITS(U)                                                \
  template <> struct Limits<U> {                                            \
    static constexpr U max = numeric_limits<U>::infinity();                 \
    static constexpr U min = -numeric_limits<U>::infinity();                \
    static constexpr U finite_max = numeric_limits<U>::max();               \
    static constexpr U finite_min = numeric_limits<U>::lowest();            \
  };
KMSL_FLOAT_LIMITS(float)
KMSL_FLOAT_LIMITS(half)
#undef KMSL_FLOAT_LIMITS
template <> struct Limits<bfloat> {
  static inline const bfloat max = bfloat(__builtin_inff());
  static inline const bfloat min = bfloat(-__builtin_inff());
  static inline const bfloat finite_max = numeric_limits<bfloat>::max();
  static inline const bfloat finite_min = numeric_limits<bfloat>::lowest();
};

template <typename IdxT = int64_t, class S, class St, kmsl::enable_if_t<!kmsl::is_vec<IdxT>::value, int> = 0>
IdxT elem_to_loc(IdxT elem, S shape, St strides, int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += IdxT(elem % IdxT(shape[i])) * IdxT(strides[i]);
    elem /= IdxT(shape[i]);
  }
  return loc;
}
template <typename IdxT = int64_t, class S, class St>
IdxT elem_to_loc(uint3 elem, S shape, St strides, int ndim) {
  IdxT loc = IdxT(elem.x) * IdxT(strides[ndim - 1]) + IdxT(elem.y) * IdxT(strides[ndim - 2]);
  for (int d = ndim - 3; d >= 0; --d) {
    loc += IdxT(elem.z % uint(shape[d])) * IdxT(strides[d]);
    elem.z /= uint(shape[d]);
  }
  return loc;
}
template <typename IdxT = int64_t, class St> IdxT elem_to_loc_1(uint elem, St stride) { return IdxT(elem) * IdxT(stride); }
template <typename IdxT = int64_t, class St> IdxT elem_to_loc_2(uint2 elem, St strides) {
  return IdxT(elem.x) * IdxT(strides[1]) + IdxT(elem.y) * IdxT(strides[0]);
}
template <typename IdxT = int64_t, class St> IdxT elem_to_loc_3(uint3 elem, St strides) {
  return IdxT(elem.x) * IdxT(strides[2]) + IdxT(elem.y) * IdxT(strides[1]) + IdxT(elem.z) * IdxT(strides[0]);
}
template <typename T, typename U> constexpr T ceildiv(T n, U m) { return (n + m - 1) / m; }
}  // namespace metal
