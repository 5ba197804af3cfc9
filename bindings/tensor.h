// Plain descriptions of MLX arrays for the kernels.
//
// eval_cpu only schedules work: the data of its inputs is written by earlier
// tasks on the stream, so it records pointers, shapes and strides here (valid
// once the task runs) and the dispatched task reads them.
#pragma once

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "float_convert.h"
#include "mlx/array.h"

namespace kvmetal {

struct Tensor {
  char* ptr = nullptr;  // element (0, ..., 0), the array's offset applied
  mlx::core::Dtype dtype = mlx::core::float32;
  std::vector<int64_t> shape;
  std::vector<int64_t> strides;  // in elements
  int itemsize = 0;
  bool row_contiguous = false;

  int64_t size() const {
    int64_t n = 1;
    for (auto d : shape) n *= d;
    return n;
  }
};

inline Tensor describe(const mlx::core::array& a) {
  Tensor t;
  t.ptr = const_cast<char*>(a.data<char>());
  t.dtype = a.dtype();
  t.shape.assign(a.shape().begin(), a.shape().end());
  t.strides.assign(a.strides().begin(), a.strides().end());
  t.itemsize = static_cast<int>(a.itemsize());
  t.row_contiguous = a.flags().row_contiguous;
  return t;
}

inline FloatKind float_kind(mlx::core::Dtype dt, const char* op) {
  if (dt == mlx::core::float32) return FloatKind::f32;
  if (dt == mlx::core::float16) return FloatKind::f16;
  if (dt == mlx::core::bfloat16) return FloatKind::bf16;
  throw std::invalid_argument(std::string("[") + op + "] expected a float16, bfloat16 or float32 array");
}

// Copy a strided tensor into dst (row-major, same element type).
inline void copy_strided(const Tensor& t, char* dst) {
  const int nd = static_cast<int>(t.shape.size());
  if (t.row_contiguous || nd == 0) {
    std::memcpy(dst, t.ptr, static_cast<size_t>(t.size()) * t.itemsize);
    return;
  }
  const bool unit_inner = t.strides[nd - 1] == 1;
  const int64_t inner = t.shape[nd - 1];
  std::vector<int64_t> idx(nd, 0);
  const int64_t rows = t.size() / std::max<int64_t>(inner, 1);
  if (inner == 0) return;
  for (int64_t r = 0; r < rows; ++r) {
    int64_t off = 0;
    for (int d = 0; d < nd - 1; ++d) off += idx[d] * t.strides[d];
    const char* src = t.ptr + off * t.itemsize;
    if (unit_inner) {
      std::memcpy(dst, src, static_cast<size_t>(inner) * t.itemsize);
    } else {
      for (int64_t i = 0; i < inner; ++i)
        std::memcpy(dst + i * t.itemsize, src + i * t.strides[nd - 1] * t.itemsize, t.itemsize);
    }
    dst += inner * t.itemsize;
    for (int d = nd - 2; d >= 0; --d) {
      if (++idx[d] < t.shape[d]) break;
      idx[d] = 0;
    }
  }
}

// A row-major view of t: t itself when it already is one, else a copy held
// in `storage` (small index arrays, or the rare cache with a strided head_dim).
inline Tensor row_major(const Tensor& t, std::vector<char>& storage) {
  if (t.row_contiguous) return t;
  storage.resize(static_cast<size_t>(t.size()) * t.itemsize);
  copy_strided(t, storage.data());
  Tensor out = t;
  out.ptr = storage.data();
  out.row_contiguous = true;
  int64_t s = 1;
  for (int d = static_cast<int>(t.shape.size()) - 1; d >= 0; --d) {
    out.strides[d] = s;
    s *= t.shape[d];
  }
  return out;
}

// Integer index arrays (int32 or int64, any layout) as int64 values.
inline std::vector<int64_t> read_indices(const Tensor& t) {
  std::vector<char> storage;
  Tensor rm = row_major(t, storage);
  std::vector<int64_t> out(static_cast<size_t>(rm.size()));
  for (size_t i = 0; i < out.size(); ++i) {
    if (rm.dtype == mlx::core::int64) {
      out[i] = reinterpret_cast<const int64_t*>(rm.ptr)[i];
    } else if (rm.dtype == mlx::core::uint32) {
      out[i] = reinterpret_cast<const uint32_t*>(rm.ptr)[i];
    } else {
      out[i] = reinterpret_cast<const int32_t*>(rm.ptr)[i];
    }
  }
  return out;
}

}  // namespace kvmetal
