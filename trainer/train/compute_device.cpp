// Chooses and creates the compute backend; see compute_device.h.
#include "trainer/train/compute_device.h"

#include <omp.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include <fmt/format.h>

#include "kernels/cpu/guarded_backend.h"
#include "kernels/cpu/peak.h"
#include "kernels/common/check.h"
#include "trainer/comm/staged_communicator.h"
#if defined(TETRA_HAVE_CUDA)
#include "kernels/cuda/cuda_backend.h"
#include "trainer/comm/nccl_communicator.h"
#endif

namespace tetra {

bool cuda_backend_built() {
#if defined(TETRA_HAVE_CUDA)
  return true;
#else
  return false;
#endif
}

DeviceOptions device_options(const RuntimeOptions& runtime, int local_rank) {
  DeviceOptions d;
  d.local_rank = local_rank;
  d.attention = runtime.attention == "fused"   ? AttentionPath::FUSED
                : runtime.attention == "cudnn" ? AttentionPath::CUDNN
                                               : AttentionPath::AUTO;
  d.nccl_blocking_wait = runtime.nccl_blocking_wait;
  d.guarded_memory = runtime.guarded_memory;
  d.cuda_visible_devices = runtime.cuda_visible_devices;
  return d;
}

ComputeDevice make_compute_device(const TrainingConfig& training, DType act, const DeviceOptions& device,
                                  bool want_peak) {
  ComputeDevice d;
  const bool peak_given = training.peak_gflops > 0;
  if (training.device == Device::CUDA) {
#if defined(TETRA_HAVE_CUDA)
    const int count = cuda_device_count();
    if (count == 0) {
      throw InputError(fmt::format(
          "training.device: \"cuda\": no CUDA device is visible to this process (CUDA_VISIBLE_DEVICES={}); "
          "run on a machine with an NVIDIA GPU and driver, or set training.device to \"cpu\"",
          device.cuda_visible_devices.value_or("unset")));
    }
    const int index = device.local_rank >= 0 ? device.local_rank % count : 0;
    const CudaDeviceInfo info = cuda_device_info(index);
    d.backend = make_cuda_backend(index, device.attention);
    // fp16 and bf16 tensor cores have the same dense rate on sm_80 and sm_90.
    const bool half = is_half_type(act);
    d.peak_flops = peak_given ? training.peak_gflops * 1e9 : (half ? info.peak_bf16_flops : info.peak_fp32_flops);
    // The dense peak of the SKU's datasheet where the backend knows it, else SMs x clock (its source
    // says which).
    d.peak_source = peak_given ? "training.peak_gflops"
                               : fmt::format("{} dense {} peak: {}", info.name, half ? "16-bit tensor-core" : "fp32",
                                             half ? info.peak_bf16_source : info.peak_fp32_source);
    d.gpu_name = info.name;
    d.description = fmt::format("cuda:{} {} (sm_{}, {} SMs, {:.1f} GiB)", index, info.name, info.compute_capability,
                                info.sm_count, info.memory_bytes / 1073741824.0);
    return d;
#else
    throw InputError(
        "training.device: \"cuda\": this tetra was built without the CUDA backend (no nvcc found, or "
        "-DTETRA_CUDA=OFF); rebuild with -DTETRA_CUDA=ON where the CUDA Toolkit is installed, or set "
        "training.device to \"cpu\"");
#endif
  }
  TETRA_CHECK(training.device == Device::CPU, "unknown training.device {}", to_string(training.device));
  d.backend = make_cpu_backend(static_cast<int>(training.threads));
  if (device.guarded_memory) {
    // On stderr, from every rank (and not on stdout, which `tetra generate` keeps for its text).
    std::fprintf(stderr, "warning: TETRA_TEST_GUARDED_MEMORY=1: backend memory is guarded (backend 'cpu-guarded': "
                 "the host may touch it only through the backend; collectives on it are staged through host "
                 "buffers). A test mode, slow: not for production runs\n");
    d.backend = make_guarded_backend(std::move(d.backend));
  }
  const int threads = training.threads > 0 ? static_cast<int>(training.threads) : omp_get_max_threads();
  if (want_peak) {
    d.peak_flops = peak_given ? training.peak_gflops * 1e9
                              : measure_cpu_peak_gflops(threads, act == DType::BF16) * 1e9;
    d.peak_source = peak_given ? "training.peak_gflops" : "measured";
  }
  d.threads = threads;
  d.description = fmt::format("cpu, {} threads", threads);
  return d;
}

BackendCommFactory backend_comm_factory(Backend& be, [[maybe_unused]] const DeviceOptions& device) {
  if (be.host_memory()) return {};
#if defined(TETRA_HAVE_CUDA)
  // GPU memory: NCCL, ordered after the backend's compute stream (one per group, groups of one
  // rank included: the host communicator of a one-rank group copies with memmove, which device
  // pointers do not allow).
  if (auto* cuda = dynamic_cast<CudaBackend*>(&be)) {
    return [cuda, blocking = device.nccl_blocking_wait](const std::string&, const std::vector<int>&,
                                                         Communicator& host) {
      return make_nccl_communicator(host, cuda->stream(), blocking);
    };
  }
#endif
  return [&be](const std::string&, const std::vector<int>&, Communicator& host) {
    return make_staged_communicator(host, be);
  };
}

}  // namespace tetra
