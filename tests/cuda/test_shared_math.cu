// The scalar math in kernels/common/math.h evaluated on the GPU against the same functions on the
// host: the guarantee that CPU and CUDA kernels compute the same element-wise math. Exits 77
// (ctest: skipped) where no GPU is present.
//
// The fp16 conversions are different code on the two sides (CUDA's __float2half_rn / __half2float
// on the device, integer code on the host), so they are compared bit for bit: every fp16 pattern
// widened, and fp32 -> fp16 at every fp16 value, at every midpoint between neighbours and next to
// both, and over a strided sweep of all fp32 patterns (NaNs compare as NaN: the device's is the
// canonical 0x7fff, the host keeps the payload).
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <vector>

#include <cuda_runtime.h>

#include "kernels/common/math.h"

namespace m = tetra::math;

constexpr int kFunctions = 8;

__host__ __device__ void evaluate(int i, float x, float* out) {
  out[0] = m::gelu(x);
  out[1] = m::gelu_grad(x);
  out[2] = m::silu(x);
  out[3] = m::silu_grad(x);
  out[4] = m::round_bf16(x * 1.2345f);
  float a = x, b = 0.5f - x;
  m::rope_rotate(a, b, cosf(0.3f * i), sinf(0.3f * i));
  out[5] = a + 2.0f * b;
  float p = x, mom = 0.1f, var = 0.01f;
  m::AdamParams hp{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0.1f, 0.05f, 1.0f};
  out[6] = m::adamw_update(p, mom, var, 0.3f * x, hp);
  out[7] = m::philox_normal(1234, 99, static_cast<uint64_t>(i));
}

__global__ void evaluate_kernel(const float* xs, float* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) evaluate(i, xs[i], out + i * kFunctions);
}

__global__ void narrow_kernel(const float* xs, uint16_t* out, int n) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) out[i] = m::f32_to_f16_bits(xs[i]);
}

__global__ void widen_kernel(float* out) {
  int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < 65536) out[i] = m::f16_bits_to_f32(static_cast<uint16_t>(i));
}

bool f16_is_nan(uint16_t h) { return (h & 0x7c00) == 0x7c00 && (h & 0x3ff) != 0; }

// The fp16 conversions on the device against the host's; returns the number of mismatches.
int check_f16_conversions() {
  int failures = 0;
  // Widening: all 65536 patterns.
  std::vector<float> wide(65536);
  float* d_wide = nullptr;
  cudaMalloc(&d_wide, 65536 * sizeof(float));
  widen_kernel<<<256, 256>>>(d_wide);
  cudaMemcpy(wide.data(), d_wide, 65536 * sizeof(float), cudaMemcpyDeviceToHost);
  cudaFree(d_wide);
  for (uint32_t h = 0; h < 65536; ++h) {
    const float host = m::f16_bits_to_f32(static_cast<uint16_t>(h)), dev = wide[h];
    const bool ok = std::isnan(host) ? std::isnan(dev) : std::memcmp(&host, &dev, 4) == 0;
    if (!ok && failures++ < 10) std::printf("f16 0x%04x widens to %.9g on the host, %.9g on the device\n", h, host, dev);
  }
  // Narrowing: around every fp16 value and midpoint, both signs; then a strided sweep.
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> xs;
  for (uint32_t h = 0; h < 0x7c00; ++h) {
    const float v = m::f16_bits_to_f32(static_cast<uint16_t>(h));
    const float next = h + 1 < 0x7c00 ? m::f16_bits_to_f32(static_cast<uint16_t>(h + 1)) : 65536.0f;
    const float mid = 0.5f * (v + next);  // exact: 12 significant bits
    for (float x : {v, std::nextafter(v, -inf), std::nextafter(v, inf), mid, std::nextafter(mid, -inf),
                    std::nextafter(mid, inf)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  for (uint64_t u = 0; u < (uint64_t{1} << 32); u += 65537) {
    const uint32_t bits = static_cast<uint32_t>(u);
    float x;
    std::memcpy(&x, &bits, 4);
    xs.push_back(x);
  }
  const int n = static_cast<int>(xs.size());
  std::vector<uint16_t> narrow(xs.size());
  float* d_x = nullptr;
  uint16_t* d_h = nullptr;
  cudaMalloc(&d_x, xs.size() * sizeof(float));
  cudaMalloc(&d_h, xs.size() * sizeof(uint16_t));
  cudaMemcpy(d_x, xs.data(), xs.size() * sizeof(float), cudaMemcpyHostToDevice);
  narrow_kernel<<<(n + 255) / 256, 256>>>(d_x, d_h, n);
  const cudaError_t err = cudaMemcpy(narrow.data(), d_h, xs.size() * sizeof(uint16_t), cudaMemcpyDeviceToHost);
  cudaFree(d_x);
  cudaFree(d_h);
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    return failures + 1;
  }
  for (int i = 0; i < n; ++i) {
    const uint16_t host = m::f32_to_f16_bits(xs[i]), dev = narrow[i];
    const bool ok = std::isnan(xs[i]) ? f16_is_nan(host) && f16_is_nan(dev) : host == dev;
    if (!ok && failures++ < 20) std::printf("%.9g narrows to 0x%04x on the host, 0x%04x on the device\n", xs[i], host, dev);
  }
  std::printf("fp16 conversions: %d mismatches over 65536 widenings and %d narrowings\n", failures, n);
  return failures;
}

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices == 0) {
    std::printf("no CUDA device: skipped\n");
    return 77;
  }
  const int n = 4096;
  std::vector<float> xs(n), host(n * kFunctions), dev(n * kFunctions);
  for (int i = 0; i < n; ++i) xs[i] = -8.0f + 16.0f * static_cast<float>(i) / n;
  for (int i = 0; i < n; ++i) evaluate(i, xs[i], host.data() + i * kFunctions);
  float *d_x = nullptr, *d_out = nullptr;
  cudaMalloc(&d_x, n * sizeof(float));
  cudaMalloc(&d_out, n * kFunctions * sizeof(float));
  cudaMemcpy(d_x, xs.data(), n * sizeof(float), cudaMemcpyHostToDevice);
  evaluate_kernel<<<(n + 255) / 256, 256>>>(d_x, d_out, n);
  cudaError_t err = cudaMemcpy(dev.data(), d_out, n * kFunctions * sizeof(float), cudaMemcpyDeviceToHost);
  if (err != cudaSuccess) {
    std::printf("CUDA error: %s\n", cudaGetErrorString(err));
    return 1;
  }
  // tanhf/expf/logf/cosf differ between CUDA's and glibc's implementations by a few ulp; anything
  // beyond 1e-5 relative would be a real divergence of the shared math.
  int failures = 0;
  for (int i = 0; i < n * kFunctions; ++i) {
    const float a = host[i], b = dev[i];
    if (std::fabs(a - b) > 1e-5f * std::fmax(1.0f, std::fabs(a))) {
      if (failures++ < 10) std::printf("function %d at x=%g: host %.9g device %.9g\n", i % kFunctions, xs[i / kFunctions], a, b);
    }
  }
  std::printf("%d of %d values differ\n", failures, n * kFunctions);
  failures += check_f16_conversions();
  return failures == 0 ? 0 : 1;
}
