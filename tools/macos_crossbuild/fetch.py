"""Downloads into the cache (kept between runs): the MLX macOS arm64 wheels, retried when
PyPI fails transiently, and unpacked once."""
from __future__ import annotations

import fcntl
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from checks import Failed

PLATFORM = "macosx_14_0_arm64"


def pip_download(dest: Path, specs: list, *, platform: str | None = None, tries: int = 4):
    """pip download into dest; a failure is retried with back-off (network), then fatal."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "-d", str(dest)]
    if platform:
        cmd += ["--platform", platform, "--python-version", f"{sys.version_info.major}.{sys.version_info.minor}"]
    for attempt in range(1, tries + 1):
        r = subprocess.run(cmd + specs, capture_output=True, text=True)
        if r.returncode == 0:
            return
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        if attempt < tries:
            print(f"  pip download {' '.join(specs)} failed ({last}); retry {attempt}/{tries - 1}", flush=True)
            time.sleep(5 * attempt)
    raise Failed(f"pip download {' '.join(specs)}: {last}")


def mlx_wheels(cache: Path, version: str) -> Path:
    """The unpacked mlx + mlx-metal macOS arm64 wheels: <cache>/mlx-<version>/mlx/..."""
    root = cache / f"mlx-{version}-{PLATFORM}-py{sys.version_info.major}{sys.version_info.minor}"
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / ".fetch.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)      # concurrent runs share the cache
        if not (root / ".complete").exists():
            _download(cache, root, version)
    return root


def _download(cache: Path, root: Path, version: str):
    dl = cache / "downloads"
    dl.mkdir(parents=True, exist_ok=True)
    pip_download(dl, [f"mlx=={version}", f"mlx-metal=={version}"], platform=PLATFORM)
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheels = [w for w in dl.glob(f"mlx*-{version}-*{PLATFORM}.whl") if "mlx_metal" in w.name or tag in w.name]
    if len(wheels) != 2:
        raise Failed(f"expected the mlx and mlx-metal {version} wheels in {dl}, "
                         f"found {[w.name for w in wheels]}")
    root.mkdir(parents=True, exist_ok=True)
    for w in wheels:
        with zipfile.ZipFile(w) as z:
            z.extractall(root)
    (root / ".complete").touch()
