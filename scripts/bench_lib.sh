# Shared by the bench_*.sh scripts (sourced): bench_prepare REPO sets TETRA_BIN — as given, or a
# Release build of this tree in TETRA_BUILD_DIR (default REPO/build-release) after
# scripts/setup.sh — and lets mpirun start ranks as root.
bench_prepare() {
  local repo="$1"
  if [[ -z "${TETRA_BIN:-}" ]]; then
    local build=${TETRA_BUILD_DIR:-$repo/build-release}
    "$repo/scripts/setup.sh" >/dev/null
    cmake -S "$repo" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DTETRA_TESTS=OFF >/dev/null
    cmake --build "$build" --target tetra >/dev/null
    TETRA_BIN="$build/tetra"
  fi
  export TETRA_BIN OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
}
