// The element type of float rows, scales and biases. A header of its own so the
// per-ISA tile kernels (tile_math_avx*.cpp) can name it without pulling in any
// inline function that they would then compile with their wider -m flags.
#pragma once

namespace kvmetal {

enum class FloatKind { f32, f16, bf16 };

}  // namespace kvmetal
