// The CUDA backend's memory ops: round trips through device memory, device-to-device copies,
// zero fills, and the allocation accounting.
#include "tests/cuda/cuda_testing.h"

namespace tetra::cuda_testing {

TEST_CASE("cuda memory: upload, device copy, zero fill and download round-trip", "[cuda][memory]") {
  Backend& gpu = *backends().gpu;
  const size_t n = 1000003;  // odd: no alignment luck
  const std::vector<float> values = random_values(n, 1);
  float* a = static_cast<float*>(gpu.alloc(n * 4));
  float* b = static_cast<float*>(gpu.alloc(n * 4));
  gpu.copy_from_host(a, values.data(), n * 4);
  gpu.copy(b, a, n * 4);
  std::vector<float> back(n, -1.0f);
  gpu.copy_to_host(back.data(), b, n * 4);
  REQUIRE(back == values);
  gpu.memset_zero(b + 7, (n - 14) * 4);
  gpu.copy_to_host(back.data(), b, n * 4);
  for (size_t i = 0; i < n; ++i) REQUIRE(back[i] == ((i < 7 || i >= n - 7) ? values[i] : 0.0f));
  gpu.free(a);
  gpu.free(b);
}

}  // namespace tetra::cuda_testing
