// The CUDA op tests (every CUDA op against the CPU op). Where no GPU is present the whole binary
// reports itself skipped (exit code 77, which ctest counts as skipped): never failed, never
// silently passed.
#define CATCH_CONFIG_CONSOLE_WIDTH 200  // as tests/unit/main.cpp: no wrapping of long names (Catch2 v2 can hang there)
#define CATCH_CONFIG_RUNNER
#include <cstdio>

#include <catch2/catch.hpp>

#include "kernels/backend.h"

int main(int argc, char** argv) {
  if (tetra::cuda_device_count() == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  return Catch::Session().run(argc, argv);
}
