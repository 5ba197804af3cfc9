"""kvmetal.sim beyond g++ on x86-64: the soft-half header, clang, and aarch64 (under qemu).

The aarch64 check builds the runtime and a translated kernel with a cross
compiler and runs them under qemu-user; it needs `g++-aarch64-linux-gnu` and
`qemu-user` (Debian packages) and is skipped without them.
"""
from __future__ import annotations

import shutil
import subprocess

import mlx.core as mx
import numpy as np
import pytest

import kvmetal.sim as sim
from kvmetal.sim import build, signature, translate

SRC = """
threadgroup float buf[64];
uint l = thread_index_in_threadgroup;
float x = inp[thread_position_in_grid.x];
float s = simd_sum(x);
buf[l] = s;
threadgroup_barrier(mem_flags::mem_threadgroup);
half h = half(buf[63 - l]) * 0.5h;
out[thread_position_in_grid.x] = float(h) + simd_prefix_exclusive_sum(1.0f);
"""


def _expected(x: np.ndarray) -> np.ndarray:
    sums = x.reshape(-1, 32).sum(1).astype(np.float32)          # one per simdgroup
    out = np.empty_like(x)
    for i in range(x.size):
        g, l = divmod(i, 64)
        sg = g * 2 + (63 - l) // 32
        out[i] = np.float32(np.float16(sums[sg]) * np.float16(0.5)) + (l % 32)
    return out


@pytest.mark.parametrize("cxx", ["g++ -DKMSL_SOFT_HALF", "clang++"])
def test_other_compilers_and_soft_half(cxx, monkeypatch, tmp_path):
    if shutil.which(cxx.split()[0]) is None:
        pytest.skip(f"{cxx} is not installed")
    monkeypatch.setenv("CXX", cxx)
    monkeypatch.setenv("KVMETAL_SIM_CACHE", str(tmp_path))
    build._loaded.clear()
    try:
        k = sim.metal_kernel(name="portable", input_names=["inp"], output_names=["out"], source=SRC)
        x = (np.arange(256) % 7).astype(np.float32)
        (o,) = k(inputs=[mx.array(x)], output_shapes=[(256,)], output_dtypes=[mx.float32], grid=(256, 1, 1),
                 threadgroup=(64, 1, 1), seed=5, strict=True)
        np.testing.assert_array_equal(np.array(o), _expected(x))
        # The runtime is loaded once per process; check it also builds with this compiler.
        rt = subprocess.run([*cxx.split(), *build.RUNTIME_FLAGS, str(build.RUNTIME_DIR / "rt.cpp"), "-o",
                             str(tmp_path / "rt.so")], capture_output=True, text=True)
        assert rt.returncode == 0, rt.stderr
    finally:
        build._loaded.clear()


HARNESS = r"""
#include "abi.h"
#include <cstdio>
extern "C" void kmsl_entry(const KmslAttrs* a, KmslCounter* c);
int main() {
  const int n = 256;
  static float in[n], out[n];
  static uint8_t t0[n * 4], t1[n * 4], w0[n * 4], w1[n * 4];
  for (int i = 0; i < n; i++) in[i] = float(i % 7);
  KmslBuf bufs[2] = {{(char*)in, n * 4, 0, "inp", t0, w0}, {(char*)out, n * 4, 0, "out", t1, w1}};
  uint64_t loads[2], stores[2], load_ops[2], store_ops[2];
  KmslLaunch L{};
  L.grid[0] = n; L.grid[1] = L.grid[2] = 1;
  L.threadgroup[0] = 64; L.threadgroup[1] = L.threadgroup[2] = 1;
  L.nbufs = 2; L.bufs = bufs; L.seed = 5; L.strict = 1; L.nworkers = 2; L.kernel_name = "portable";
  L.loads = loads; L.stores = stores; L.load_ops = load_ops; L.store_ops = store_ops;
  if (kmsl_rt_launch(&L, kmsl_entry)) { printf("error: %s\n", L.err_msg); return 1; }
  for (int i = 0; i < n; i++) printf("%.9g\n", out[i]);
  return 0;
}
"""


def test_aarch64_context_switch_under_qemu(tmp_path):
    cross, qemu = shutil.which("aarch64-linux-gnu-g++"), shutil.which("qemu-aarch64")
    if not cross or not qemu:
        pytest.skip("needs g++-aarch64-linux-gnu and qemu-user")
    k = sim.metal_kernel(name="portable", input_names=["inp"], output_names=["out"], source=SRC)
    specs = [signature.InputSpec("inp", mx.float32, 1, 256)]
    fname, msl = k.metal_source(specs, [mx.float32], [])
    (tmp_path / "kernel.cpp").write_text(
        translate.cpp_source(msl, fname, k._params(specs, [mx.float32]), [], k._attrs, file_name="k.metal"))
    (tmp_path / "main.cpp").write_text(HARNESS)
    exe = tmp_path / "arm_test"
    subprocess.run([cross, "-std=c++17", "-O2", "-static", "-pthread", "-w", f"-I{build.RUNTIME_DIR}",
                    *build.GCC_SITE_FLAGS, *build.RUNTIME_DEFINES, str(tmp_path / "main.cpp"), str(tmp_path / "kernel.cpp"),
                    str(build.RUNTIME_DIR / "rt.cpp"), "-o", str(exe)], check=True)
    run = subprocess.run([qemu, str(exe)], capture_output=True, text=True, check=True)
    got = np.array([float(v) for v in run.stdout.split()], np.float32)
    np.testing.assert_array_equal(got, _expected((np.arange(256) % 7).astype(np.float32)))
