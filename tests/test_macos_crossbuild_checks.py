"""tools/macos_crossbuild/checks.py on small inputs: each check passes the good case and fails
the bad one with its one-line reason (CI runs the tool itself on the real cross-built wheel,
and its negative control on the symbol check)."""
from __future__ import annotations

import importlib.util
import zipfile
from pathlib import Path

import pytest
from macho_images import dylib

from kvmetal import _macho

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("macos_crossbuild_checks",
                                               ROOT / "tools" / "macos_crossbuild" / "checks.py")
checks = importlib.util.module_from_spec(_spec)   # by path: tools/ is not a package
_spec.loader.exec_module(checks)


def test_rpath():
    assert "@loader_path/../mlx/lib" in checks.rpath(_macho.parse(dylib()))
    with pytest.raises(checks.Failed, match=r"LC_RPATH is \['/build/mlx/lib'\]"):
        checks.rpath(_macho.parse(dylib(rpath="/build/mlx/lib")))


def test_minos_against_libmlx_and_the_wheel_tag():
    libmlx = _macho.parse(dylib(minos=(14, 0)))
    ok = _macho.parse(dylib(minos=(14, 0)))
    assert "minos 14.0" in checks.minos(ok, libmlx, "kvmetal-0.1.0-cp311-cp311-macosx_14_0_arm64.whl")
    with pytest.raises(checks.Failed, match="_ext minos is 11.0, libmlx.dylib's is 14.0"):
        checks.minos(_macho.parse(dylib(minos=(11, 0))), libmlx, "kvmetal-0.1.0-cp311-cp311-macosx_11_0_arm64.whl")
    with pytest.raises(checks.Failed, match="tagged macOS 11.0, its _ext needs 14.0"):
        checks.minos(ok, libmlx, "kvmetal-0.1.0-cp311-cp311-macosx_11_0_arm64.whl")


def test_symbols_bound_to_libmlx_must_be_in_it():
    ext = _macho.parse(dylib())            # _mlx_fn from libmlx, _PyFoo by flat lookup
    libmlx = _macho.MachO(cputype=0, filetype=6, flags=0x80,
                          symbols=[_macho.Symbol("_mlx_fn", True, True, 0, False)])
    assert "1 libmlx, 1 CPython" in checks.symbols(ext, libmlx, {"_PyFoo"})
    with pytest.raises(checks.Failed, match="not CPython's .*: _PyFoo"):
        checks.symbols(ext, libmlx, set())
    libmlx.symbols = []
    with pytest.raises(checks.Failed, match="bound to libmlx are not in the pinned libmlx.dylib: _mlx_fn"):
        checks.symbols(ext, libmlx, {"_PyFoo"})


def test_abi_tag():
    core = b"\0nanobind_system_libcpp_abi1_a1_v22\0"
    assert "system_libcpp_abi1_a1_v22" in checks.abi_tag(b"x\0system_libcpp_abi1_a1_v22\0", core)
    with pytest.raises(checks.Failed, match="!= mlx.core's system_libcpp_abi1_a1_v22"):
        checks.abi_tag(b"\0system_libstdcpp_gxx_abi_1xxx_use_cxx11_abi_1_a1_v22\0", core)


def test_wheel_contents(tmp_path):
    kernels = sorted(p.name for p in (ROOT / "kernels").iterdir() if p.suffix in (".metal", ".h"))

    def wheel(files: dict) -> Path:
        path = tmp_path / "kvmetal-0.1.0-cp311-cp311-macosx_14_0_arm64.whl"
        with zipfile.ZipFile(path, "w") as z:
            for name, text in files.items():
                z.writestr(name, text)
        return path

    good = {"kvmetal/_build_info.py": 'MLX_VERSION = "0.32.4"\n', "kvmetal/_ext.cpython-311-darwin.so": "",
            **{f"kvmetal/kernels/{k}": "" for k in kernels}}
    assert f"{len(kernels)} Metal sources" in checks.wheel_contents(wheel(good), ROOT, "0.32.4")
    with pytest.raises(checks.Failed, match="does not record MLX 0.32.5"):
        checks.wheel_contents(wheel(good), ROOT, "0.32.5")
    with pytest.raises(checks.Failed, match="Metal sources missing from the wheel"):
        checks.wheel_contents(wheel({k: v for k, v in good.items() if not k.endswith(".metal")}), ROOT, "0.32.4")
    with pytest.raises(checks.Failed, match="vendors libmlx"):
        checks.wheel_contents(wheel({**good, "kvmetal/.dylibs/libmlx.dylib": ""}), ROOT, "0.32.4")
