"""What the cross-build takes from pyproject.toml, so no version is written twice: the macOS
MLX pin (build-system.requires), the nanobind requirement, and the macOS repair command
and environment of [tool.cibuildwheel.macos]."""
from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path


@dataclass
class Pins:
    mlx: str                 # "0.32.4"
    nanobind: str            # "nanobind>=3.0,<4"
    build_requires: list     # build-system.requires without MLX (installed for the build)
    repair_command: str      # [tool.cibuildwheel.macos] repair-wheel-command
    macos_env: dict          # [tool.cibuildwheel.macos] environment


def read(pyproject: Path) -> Pins:
    doc = tomllib.loads(pyproject.read_text())
    requires = doc["build-system"]["requires"]
    darwin = [r for r in requires if re.match(r"mlx\s*==", r) and "sys_platform == 'darwin'" in r]
    if len(darwin) != 1:
        raise SystemExit(f"pins: expected one \"mlx==X; sys_platform == 'darwin'\" in build-system.requires, "
                         f"found {darwin}")
    mlx = re.match(r"mlx\s*==\s*([\w.]+)", darwin[0]).group(1)
    nanobind = [r for r in requires if r.startswith("nanobind")]
    macos = doc.get("tool", {}).get("cibuildwheel", {}).get("macos", {})
    return Pins(mlx=mlx, nanobind=nanobind[0] if nanobind else "nanobind",
                build_requires=[r.split(";")[0].strip() for r in requires if not r.startswith("mlx")],
                repair_command=macos.get("repair-wheel-command", ""),
                macos_env=dict(macos.get("environment", {})))


if __name__ == "__main__":  # the build's Python requirements, for tools/macos_crossbuild.sh
    import sys

    print(" ".join(read(Path(sys.argv[1])).build_requires))
