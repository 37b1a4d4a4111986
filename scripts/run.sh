#!/usr/bin/env bash
# Set up a fresh Debian machine, build Tetra, and train the demo model on the CPU.
#   scripts/run.sh [tetra args...]       e.g. scripts/run.sh --set training.steps=50
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
BUILD_DIR=${TETRA_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${TETRA_CMAKE_ARGS:-} >/dev/null
cmake --build "$BUILD_DIR" -j "$(nproc)" --target tetra
exec "$BUILD_DIR/tetra" --config configs/demo.json "$@"
