// The scalar math in kernels/common/math.h evaluated on the GPU against the same functions on the
// host: the guarantee that CPU and CUDA kernels compute the same element-wise math. Exits 77
// (ctest: skipped) where no GPU is present.
#include <cmath>
#include <cstdio>
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
  return failures == 0 ? 0 : 1;
}
