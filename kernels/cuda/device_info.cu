// What the GPU can do: its name, and the dense arithmetic peak that MFU is measured against.
//
// Peak = SMs x clock x FLOPs per SM per clock of the unit the run's GEMMs use. Per SM per clock
// (dense, no sparsity; NVIDIA's architecture whitepapers):
//   bf16 tensor cores: sm_80 (A100) 1024 FMA = 2048 FLOPs, sm_90 (H100/H200) 2048 FMA = 4096 FLOPs,
//                      sm_86/89 (consumer Ampere/Ada) 512 FMA = 1024 FLOPs (fp32 accumulate);
//   fp32 CUDA cores:   64 FMA = 128 FLOPs on sm_80, 128 FMA = 256 FLOPs on sm_86 and later.
// The clock is the boost clock the driver reports (an H100 SXM at 1.83 GHz with 132 SMs gives
// NVIDIA's 989 TFLOP/s bf16 figure; an H200 has the same SMs and clock).
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tetra {

CudaDeviceInfo cuda_device_info(int device) {
  CudaDeviceInfo info;
  cudaDeviceProp prop{};
  TETRA_CUDA_CHECK(cudaGetDeviceProperties(&prop, device));
  int clock_khz = 0;
  TETRA_CUDA_CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, device));
  info.name = prop.name;
  info.sm_count = prop.multiProcessorCount;
  info.compute_capability = prop.major * 10 + prop.minor;
  info.memory_bytes = prop.totalGlobalMem;
  info.clock_ghz = clock_khz / 1e6;
  double bf16_per_clock = 0.0, fp32_per_clock = 256.0;
  switch (info.compute_capability) {
    case 80: bf16_per_clock = 2048.0; fp32_per_clock = 128.0; break;
    case 90: bf16_per_clock = 4096.0; break;
    default: bf16_per_clock = prop.major >= 9 ? 4096.0 : 1024.0; break;
  }
  const double per_clock_scale = info.sm_count * info.clock_ghz * 1e9;
  info.peak_bf16_flops = bf16_per_clock * per_clock_scale;
  info.peak_fp32_flops = fp32_per_clock * per_clock_scale;
  return info;
}

}  // namespace tetra
