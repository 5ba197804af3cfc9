"""tools/macos_crossbuild.sh: build kvmetal's macOS arm64 wheel on Linux x86_64 through the real
CMakeLists.txt and pyproject.toml, check it, repair it as cibuildwheel would, and prove with a
negative control that the symbol check can fail. One PASS/FAIL line per step, with its time;
the first failure ends the run with a one-line reason naming the check (exit status 1)."""
from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
sys.path.insert(0, str(HERE))

import build  # noqa: E402
import checks  # noqa: E402
import cross_env  # noqa: E402
import fetch  # noqa: E402
import pins as pins_mod  # noqa: E402

CIBW_ARM64_DEFAULT = "11.0"   # cibuildwheel's MACOSX_DEPLOYMENT_TARGET for arm64 when unset
NEGATIVE_SYMBOL = "kvmetal_negative_control_missing"


def load_macho():
    """kvmetal/_macho.py by path: importing the kvmetal package would import Linux MLX."""
    spec = importlib.util.spec_from_file_location("kvmetal_macho", REPO / "kvmetal" / "_macho.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["kvmetal_macho"] = mod
    spec.loader.exec_module(mod)
    return mod


class Run:
    def __init__(self):
        self.start = time.perf_counter()
        self.passed = 0

    def step(self, name: str, fn, *args):
        t = time.perf_counter()
        try:
            detail = fn(*args)
        except Exception as e:  # noqa: BLE001 - any failure is one line naming the step
            reason = str(e) if isinstance(e, checks.Failed) else f"{type(e).__name__}: {e}"
            print(f"FAIL {name}: {reason.splitlines()[0] if reason else '?'} [{time.perf_counter() - t:.1f} s]",
                  flush=True)
            raise SystemExit(1)
        print(f"PASS {name}: {detail} [{time.perf_counter() - t:.1f} s]", flush=True)
        self.passed += 1
        return detail


def _ext_bytes(wheel: Path) -> bytes:
    with zipfile.ZipFile(wheel) as z:
        name = next(n for n in z.namelist() if n.startswith("kvmetal/_ext.") and n.endswith(".so"))
        return z.read(name)


def negative_control(work: Path, macho, libmlx, cpython) -> str:
    """Relink the real _ext (the build's own link command) with one more object that calls a
    function libmlx does not have: the symbols check must reject it."""
    bdir = work / "build"
    cmds = subprocess.run(["ninja", "-C", str(bdir), "-t", "commands"], capture_output=True, text=True,
                          check=True).stdout.splitlines()
    link = next((c for c in reversed(cmds) if " -o _ext." in c), None)
    if link is None:
        raise checks.Failed("no _ext link command in the build's ninja file")
    src = work / "negative.cpp"
    src.write_text(f"namespace mlx::core {{ void {NEGATIVE_SYMBOL}(); }}\n"
                   f"extern \"C\" __attribute__((visibility(\"default\"))) void kvmetal_negative_control() "
                   f"{{ mlx::core::{NEGATIVE_SYMBOL}(); }}\n")
    cxx = work / "bin" / "zig-c++"
    subprocess.run([str(cxx), "-O3", "-std=gnu++20", "-c", str(src), "-o", str(work / "negative.o")], check=True)
    out = work / "negative_ext.so"
    ext_name = link.split(" -o ", 1)[1].split()[0]
    cmd = link.replace(f" -o {ext_name}", f" -o {out} {work / 'negative.o'}", 1)
    r = subprocess.run(cmd, shell=True, cwd=bdir, capture_output=True, text=True)
    if r.returncode != 0:
        raise checks.Failed(f"relinking _ext with the bad reference failed: {r.stderr.strip()[-300:]}")
    try:
        checks.symbols(macho.read(out), libmlx, cpython)
    except checks.Failed as e:
        if NEGATIVE_SYMBOL not in str(e):
            raise checks.Failed(f"the symbols check failed, but not on the bad reference: {e}")
        return f"_ext relinked with a call to mlx::core::{NEGATIVE_SYMBOL}() -> \"FAIL symbols: {e}\""
    raise checks.Failed(f"the symbols check passed an _ext that calls mlx::core::{NEGATIVE_SYMBOL}(), "
                        f"which libmlx.dylib lacks")


def repair(wheel: Path, work: Path, command: str, macho, libmlx, tools: Path) -> str:
    """[tool.cibuildwheel.macos] repair-wheel-command, as cibuildwheel fills it in."""
    if not command:
        raise checks.Failed("pyproject.toml has no [tool.cibuildwheel.macos] repair-wheel-command")
    dest = work / "repaired"
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir()
    cmd = command.format(delocate_archs="arm64", dest_dir=str(dest), wheel=str(wheel))
    env = dict(os.environ, PATH=f"{tools}:{Path(sys.executable).parent}:{os.environ['PATH']}")
    r = subprocess.run(shlex.split(cmd), capture_output=True, text=True, env=env)
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["?"])[-1]
        raise checks.Failed(f"`{command.split()[0]}` exited {r.returncode}: {last[:300]}")
    out = list(dest.glob("*.whl"))
    if len(out) != 1:
        raise checks.Failed(f"the repair command left {[w.name for w in out]} in {dest}")
    data = _ext_bytes(out[0])
    ext = macho.parse(data)
    checks.rpath(ext)
    checks.minos(ext, libmlx, out[0].name)
    checks.signature(data, ext)
    with zipfile.ZipFile(out[0]) as z:
        if any("libmlx" in n for n in z.namelist()):
            raise checks.Failed("the repaired wheel vendors libmlx")
    return f"`{cmd.replace(str(work) + '/', '')}` -> {out[0].name}; its _ext: minos {ext.minos}, rpath {ext.rpaths[0]}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tools/macos_crossbuild.sh", description=__doc__)
    p.add_argument("--cache", type=Path, default=Path(os.environ.get(
        "KVMETAL_CROSSBUILD_CACHE", Path.home() / ".cache" / "kvmetal-crossbuild")),
        help="downloads and zig's cache, kept between runs (default ~/.cache/kvmetal-crossbuild)")
    p.add_argument("--work", type=Path, default=None,
                   help="build directory, emptied first (default: a new /tmp/kvmetal-crossbuild-*)")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--reuse-build", action="store_true",
                   help="check the wheel a previous run left in --work instead of building (development)")
    args = p.parse_args(argv)
    macho = load_macho()
    run = Run()
    pins = pins_mod.read(REPO / "pyproject.toml")
    dt = pins.macos_env.get("MACOSX_DEPLOYMENT_TARGET", CIBW_ARM64_DEFAULT)
    print(f"macos-crossbuild: MLX {pins.mlx} (pyproject.toml), MACOSX_DEPLOYMENT_TARGET {dt} "
          f"([tool.cibuildwheel.macos]{'' if 'MACOSX_DEPLOYMENT_TARGET' in pins.macos_env else ', unset: cibuildwheel default'})",
          flush=True)
    int_ = shutil.which("llvm-install-name-tool") or shutil.which("llvm-install-name-tool-14")
    if not int_:
        print("FAIL setup: llvm-install-name-tool not found (apt-get install llvm)")
        return 1
    temporary = args.work is None
    if temporary:
        args.work = Path(tempfile.mkdtemp(prefix="kvmetal-crossbuild-"))
    elif not args.reuse_build:
        shutil.rmtree(args.work, ignore_errors=True)
        args.work.mkdir(parents=True)
    rewrites = args.work / "rewrites.txt"

    def log(kind, why):
        with open(rewrites, "a") as f:
            f.write(f"{kind}: {why}\n")

    def do_fetch():
        do_fetch.root = fetch.mlx_wheels(args.cache, pins.mlx)
        return f"mlx and mlx-metal {pins.mlx} {fetch.PLATFORM} in {do_fetch.root}"

    run.step("fetch", do_fetch)
    mlx_root = do_fetch.root
    lib_path = mlx_root / "mlx" / "lib" / "libmlx.dylib"
    core_path = next((mlx_root / "mlx").glob("core.cpython-*-darwin.so"), None)
    if core_path is None or not lib_path.is_file():
        print(f"FAIL fetch: no mlx/core.cpython-*-darwin.so or mlx/lib/libmlx.dylib in {mlx_root}")
        return 1
    libmlx, core = macho.read(lib_path), macho.read(core_path)
    standin = cross_env.standin_mlx(args.work, mlx_root, log)
    log("CPython headers: this Linux Python's", "macOS's Python headers are not on PyPI; both are LP64, "
                                                 "little-endian CPython of the same version")
    stubs_dir, mlx_libcxx = cross_env.stubs(args.work, [libmlx, core], log)
    import ziglang
    tc = cross_env.toolchain(args.work, zig=Path(ziglang.__file__).parent / "zig", stubs_dir=stubs_dir,
                             deployment_target=dt, rewrites=rewrites, install_name_tool=int_,
                             zig_cache=args.cache / "zig", log=log)
    tools = cross_env.apple_tools(args.work, log)

    def do_build():
        if args.reuse_build:
            do_build.wheel = next((args.work / "wheel").glob("*.whl"))
            return f"{do_build.wheel.name} reused"
        whl = build.wheel(REPO, args.work, toolchain=tc, standin=standin, deployment_target=dt, jobs=args.jobs,
                          log_file=args.work / "build.log")
        do_build.wheel = whl
        return f"{whl.name}, {whl.stat().st_size / 1e6:.2f} MB (log: {args.work / 'build.log'})"

    run.step("build", do_build)
    whl = do_build.wheel
    for line in dict.fromkeys(rewrites.read_text().splitlines()):
        print(f"  rewrite {line}")
    # MLX's CMake config names the frameworks by paths inside the Xcode that built it.
    xcode = [ln.strip() for ln in (args.work / "build.log").read_text().splitlines()
             if "warning" in ln and "/Applications/Xcode" in ln]
    if xcode:
        print(f"  note: MLX's CMake config adds -F/Applications/Xcode_*.app/... (the Xcode that built MLX) to "
              f"compile and link lines; {len(xcode)} warnings here like \"{xcode[0][:120]}\", and the build goes on")
    data = _ext_bytes(whl)
    ext = macho.parse(data)
    cpython = checks.cpython_list(Path(__import__("nanobind").__file__).parent)
    run.step("symbols", checks.symbols, ext, libmlx, cpython)
    run.step("libcxx", checks.libcxx, ext, mlx_libcxx)
    run.step("rpath", checks.rpath, ext)
    run.step("minos", checks.minos, ext, libmlx, whl.name)
    run.step("abi", checks.abi_tag, data, core_path.read_bytes())
    run.step("signature", checks.signature, data, ext)
    run.step("wheel", checks.wheel_contents, whl, REPO, pins.mlx)
    run.step("repair", repair, whl, args.work, pins.repair_command, macho, libmlx, tools)
    run.step("negative-control", negative_control, args.work, macho, libmlx, cpython)
    print(f"macos-crossbuild: PASS, {run.passed} steps in {time.perf_counter() - run.start:.0f} s"
          + (f"; {args.work} removed (--work DIR keeps the build)" if temporary else f"; wheel {whl}"))
    if temporary:
        shutil.rmtree(args.work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
