#!/usr/bin/env bash
# Set up a fresh Debian machine, build Tetra (CPU, and CUDA where nvcc is found), run every test.
#   scripts/test.sh [ctest args...]      e.g. scripts/test.sh -R unit:
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${TETRA_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${TETRA_CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "$(nproc)"
cd "$BUILD_DIR"
ctest --output-on-failure --timeout 900 "$@"
