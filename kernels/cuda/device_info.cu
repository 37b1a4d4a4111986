// What the GPU can do: its name, and the dense arithmetic peak that MFU is measured against.
//
// The 16-bit tensor-core peak (dense, fp32 accumulation, no sparsity) is NVIDIA's datasheet figure
// for the SKU where the name identifies one: the tensor cores do not sustain the maximum boost
// clock the driver reports (an H100 SXM reports 1.98 GHz; its 989.4 TFLOP/s is 132 SMs x 4096
// FLOPs x 1.83 GHz), so SMs x reported clock x rate would put the peak ~8% high and MFU ~8% low.
//   H100 SXM, H200 (SXM), GH200   989.4 TFLOP/s     H100 NVL, H200 NVL   835.5 TFLOP/s
//   H100 PCIe                     756.5 TFLOP/s     A100 (SXM, PCIe)     312 TFLOP/s
// Other GPUs: SMs x reported clock x FLOPs per SM per clock (NVIDIA's architecture whitepapers):
// sm_80 1024 FMA = 2048 FLOPs, sm_90 2048 FMA = 4096 FLOPs, sm_86/89 (consumer Ampere/Ada) 512 FMA
// = 1024 FLOPs, and said so in the source line.
// The fp32 CUDA-core peak (the fp32 GEMM path computes exact fp32, no TF32) is SMs x clock x
// 64 FMA = 128 FLOPs on sm_80, 128 FMA = 256 FLOPs on sm_86 and later; at the maximum boost clock
// it matches the datasheets (an H100 SXM: 66.9 TFLOP/s).
#include <cstring>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tetra {

namespace {

struct SkuPeak {
  const char* name_part;  // a substring of cudaDeviceProp::name
  const char* sku;
  double bf16_tflops;
};
// The first entry whose name_part is in the device name wins (NVL and PCIe before the plain names).
constexpr SkuPeak kSkuPeaks[] = {
    {"H200 NVL", "H200 NVL", 835.5}, {"H100 NVL", "H100 NVL", 835.5},
    {"H100 PCIe", "H100 PCIe", 756.5}, {"GH200", "GH200", 989.4},
    {"H200", "H200 SXM", 989.4},     {"H100", "H100 SXM", 989.4},
    {"A100", "A100", 312.0},
};

}  // namespace

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
  info.peak_fp32_flops = fp32_per_clock * per_clock_scale;
  info.peak_fp32_source = fmt::format("{} SMs x {:.2f} GHz (max boost) x {:.0f} FLOPs/SM/clock",
                                      info.sm_count, info.clock_ghz, fp32_per_clock);
  for (const SkuPeak& p : kSkuPeaks) {
    if (std::strstr(prop.name, p.name_part) == nullptr) continue;
    info.peak_bf16_flops = p.bf16_tflops * 1e12;
    info.peak_bf16_source = fmt::format("NVIDIA datasheet, {}: {:.1f} TFLOP/s dense BF16", p.sku,
                                        p.bf16_tflops);
    return info;
  }
  info.peak_bf16_flops = bf16_per_clock * per_clock_scale;
  info.peak_bf16_source = fmt::format(
      "no datasheet entry for this GPU: {} SMs x {:.2f} GHz (max boost) x {:.0f} FLOPs/SM/clock",
      info.sm_count, info.clock_ghz, bf16_per_clock);
  return info;
}

}  // namespace tetra
