#!/usr/bin/env bash
# Build kvmetal's macOS arm64 wheel on this Linux x86_64 host and check it: the real CMakeLists.txt
# and pyproject.toml through zig's clang and Mach-O linker, against the pinned MLX macOS wheels.
# What it checks, and what it cannot show, is in README.md ("Install") and
# tools/macos_crossbuild/main.py. One PASS/FAIL line per step; exit status 1 on the first failure.
#
# The MLX wheels, this tool's virtual environment and zig's cache are kept in
# $KVMETAL_CROSSBUILD_CACHE (default ~/.cache/kvmetal-crossbuild); the build itself is always fresh.
set -euo pipefail
cd "$(dirname "$0")/.."
export KVMETAL_CROSSBUILD_CACHE=${KVMETAL_CROSSBUILD_CACHE:-$HOME/.cache/kvmetal-crossbuild}
mkdir -p "$KVMETAL_CROSSBUILD_CACHE"
python3 -c 'import tomllib' 2>/dev/null || { echo "FAIL setup: needs Python 3.11+ (tomllib) as python3"; exit 1; }

# pyproject's build requirements (less MLX, whose macOS wheels are unpacked, not installed), CMake
# and Ninja (pip's isolated builds fetch them; this build is not isolated), and the cross tools at
# the versions this was proven with; the venv is rebuilt when that list changes.
REQS="$(python3 tools/macos_crossbuild/pins.py pyproject.toml) cmake>=3.24 ninja ziglang==0.17.1 delocate==0.13.0"
STAMP="$(python3 --version) $REQS"
VENV=$KVMETAL_CROSSBUILD_CACHE/venv
(
  flock 9   # one run at a time sets the venv up
  if [ "$(cat "$VENV/.stamp" 2>/dev/null)" != "$STAMP" ]; then
    rm -rf "$VENV"
    python3 -m venv "$VENV"
    for attempt in 1 2 3 4; do   # PyPI hiccups are retried, not reported as a failed check
      if "$VENV/bin/pip" install -q --disable-pip-version-check $REQS 2>"$VENV/pip.err"; then break; fi
      if [ "$attempt" = 4 ]; then
        echo "FAIL setup: pip install $REQS: $(grep -v '^WARNING' "$VENV/pip.err" | tail -1)"; exit 1
      fi
      echo "  pip install failed; retry $attempt/3"; sleep $((5 * attempt))
    done
    echo "$STAMP" > "$VENV/.stamp"
  fi
) 9>"$KVMETAL_CROSSBUILD_CACHE/.venv.lock"
export PATH="$VENV/bin:$PATH"   # its cmake, ninja and delocate-wheel
exec "$VENV/bin/python" tools/macos_crossbuild/main.py "$@"
