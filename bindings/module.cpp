// kvmetal._ext: the native CPU backend (MLX primitives with eval_cpu).
#include <nanobind/nanobind.h>

namespace nb = nanobind;

NB_MODULE(_ext, m) {
  m.doc() = "kvmetal native CPU backend";
  m.def("abi_check", []() { return 1; });
}
