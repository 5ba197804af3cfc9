"""The build itself: the real pyproject.toml through scikit-build-core (pip wheel), with the
cross toolchain, the stand-in mlx on PYTHONPATH, and the wheel tagged for macOS arm64."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from checks import Failed


def wheel(repo: Path, work: Path, *, toolchain: Path, standin: Path, deployment_target: str, jobs: int,
          log_file: Path) -> Path:
    out = work / "wheel"
    out.mkdir(parents=True, exist_ok=True)
    for old in out.glob("*.whl"):
        old.unlink()
    py = f"{sys.version_info.major}{sys.version_info.minor}"
    env = dict(os.environ,
               PYTHONPATH=str(standin),
               MACOSX_DEPLOYMENT_TARGET=deployment_target,
               _PYTHON_HOST_PLATFORM=f"macosx-{deployment_target}-arm64",   # the wheel's platform tag
               SETUPTOOLS_EXT_SUFFIX=f".cpython-{py}-darwin.so",             # the extension's file name
               CMAKE_BUILD_PARALLEL_LEVEL=str(jobs))
    cmd = [sys.executable, "-m", "pip", "wheel", "-v", "--disable-pip-version-check", "--no-build-isolation",
           "--no-deps", "-w", str(out), str(repo),
           "-C", f"cmake.toolchain-file={toolchain}",
           "-C", f"build-dir={work / 'build'}"]
    with open(log_file, "w") as log:
        r = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    if r.returncode != 0:
        tail = [ln for ln in log_file.read_text().splitlines() if ln.strip()]
        err = next((ln for ln in reversed(tail) if "error" in ln.lower()), tail[-1] if tail else "?")
        raise Failed(f"pip wheel exited {r.returncode}: {err.strip()[:300]} (log: {log_file})")
    wheels = list(out.glob("*.whl"))
    if len(wheels) != 1:
        raise Failed(f"expected one wheel in {out}, found {[w.name for w in wheels]}")
    return wheels[0]
