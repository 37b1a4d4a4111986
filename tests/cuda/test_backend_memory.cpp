// The CUDA backend's memory ops: round trips through device memory, device-to-device copies,
// zero fills, and the allocation accounting; uploads staged through pinned buffers (the host
// buffer reused at once, uploads larger than the staging area); the GPU's identity and peaks.
#include <algorithm>
#include <cstdio>

#include "kernels/cuda/cuda_backend.h"
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

// copy_from_host returns before the device copy has run; the host buffer is overwritten at once
// (each upload must have taken its bytes along), and 5 uploads of 21 MiB each go through the 4
// staging buffers several times over, behind a queue of device work.
TEST_CASE("cuda memory: uploads are staged, the host buffer reusable at once", "[cuda][memory]") {
  Backend& gpu = *backends().gpu;
  const size_t small = 1000, n_small = 64;
  float* dev = static_cast<float*>(gpu.alloc(small * n_small * 4));
  std::vector<float> host(small);
  for (size_t k = 0; k < n_small; ++k) {
    for (size_t i = 0; i < small; ++i) host[i] = static_cast<float>(k * small + i);
    gpu.copy_from_host(dev + k * small, host.data(), small * 4);
    std::fill(host.begin(), host.end(), -1.0f);  // must not reach the device
  }
  std::vector<float> back(small * n_small);
  gpu.copy_to_host(back.data(), dev, back.size() * 4);
  for (size_t i = 0; i < back.size(); ++i) REQUIRE(back[i] == static_cast<float>(i));
  gpu.free(dev);

  const size_t big = (size_t{21} << 20) / 4 + 5;  // not a multiple of the staging buffers
  float* a = static_cast<float*>(gpu.alloc(big * 4));
  float* b = static_cast<float*>(gpu.alloc(big * 4));
  std::vector<float> values;
  for (int round = 0; round < 5; ++round) {
    values = random_values(big, 40 + round);
    gpu.copy(b, a, big * 4);  // device work queued ahead of the upload
    gpu.copy_from_host(a, values.data(), big * 4);
  }
  std::vector<float> got(big);
  gpu.copy_to_host(got.data(), a, big * 4);
  REQUIRE(got == values);
  gpu.free(a);
  gpu.free(b);
}

// The peak MFU is measured against: the datasheet's dense bf16 figure for the SKUs it knows
// (989.4 TFLOP/s on an H100 / H200 SXM), printed with its source for the log.
TEST_CASE("cuda device info: peaks and where they come from", "[cuda][device]") {
  const CudaDeviceInfo info = cuda_device_info(0);
  std::printf("device: %s, sm_%d, %d SMs at %.2f GHz, %.1f GiB\n", info.name.c_str(),
              info.compute_capability, info.sm_count, info.clock_ghz,
              info.memory_bytes / 1073741824.0);
  std::printf("  peak bf16 %.1f TFLOP/s (%s)\n  peak fp32 %.1f TFLOP/s (%s)\n",
              info.peak_bf16_flops / 1e12, info.peak_bf16_source.c_str(),
              info.peak_fp32_flops / 1e12, info.peak_fp32_source.c_str());
  REQUIRE(info.peak_bf16_flops > 0.0);
  REQUIRE(info.peak_fp32_flops > 0.0);
  REQUIRE_FALSE(info.peak_bf16_source.empty());
  const bool sxm = (info.name.find("H100") != std::string::npos ||
                    info.name.find("H200") != std::string::npos) &&
                   info.name.find("NVL") == std::string::npos &&
                   info.name.find("PCIe") == std::string::npos;
  if (sxm) CHECK(info.peak_bf16_flops == 989.4e12);
}

}  // namespace tetra::cuda_testing
