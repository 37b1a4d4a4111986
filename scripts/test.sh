#!/usr/bin/env bash
# Set up a fresh Debian machine, build Tetra (CPU, and CUDA where nvcc is found), run every test.
#   scripts/test.sh [ctest args...]      e.g. scripts/test.sh -R unit:
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/data.sh >/dev/null   # the corpus and GPT-2's BPE files the tokenizer tests read
BUILD_DIR=${TETRA_BUILD_DIR:-build}
cmake -S . -B "$BUILD_DIR" -G Ninja -DCMAKE_BUILD_TYPE=Release ${TETRA_CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "$(nproc)"
cd "$BUILD_DIR"
# mpirun refuses to run as root without these (CI runs as root); the tests under MPI need them.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
ctest --output-on-failure --timeout 900 -j 2 "$@"
