#!/bin/bash
# Build the standalone CPU decode driver from a bindings/ directory (at or after the
# commit that added it; default: this
# checkout's), with the extension's Release flags but no LTO:
#   tools/cpu_decode/build.sh [BINDINGS_DIR] [OUT]
# Usage of the binary: OUT {f32|f16|k8v4} TOKENS THREADS REPEATS [portable|avx2|avx512]
#   (INT8=1 in the environment switches on int8 K scores; DUMP=file writes the output).
# It prints the median and min CPU seconds per call (process CPU time: what one core
# spends, much less disturbed by other processes on a shared host than wall time) and wall time.
set -e
here=$(cd "$(dirname "$0")" && pwd)
src=${1:-$here/../../bindings}; out=${2:-/tmp/cpu_decode}
inc=$(python -c "import mlx.core as m, os; print(os.path.dirname(m.__file__) + '/include')")
o=$(mktemp -d)
F="-O3 -DNDEBUG -std=c++20 -I$src -I$inc"
g++ $F -mavx2 -mfma -mf16c -c $src/tile_math_avx2.cpp -o $o/x2.o
g++ $F -mavx512f -mavx2 -mfma -mf16c -c $src/tile_math_avx512.cpp -o $o/x5.o
for f in attention tile_math_portable quant_rows thread_pool query_q8; do
  [ -f $src/$f.cpp ] && g++ $F -c $src/$f.cpp -o $o/$f.o
done
g++ $F -mavx2 -c $here/cpu_decode.cpp -o $o/main.o  # its streaming read uses AVX2 loads
g++ -O3 $o/*.o -o $out -lpthread
echo "built $out"
