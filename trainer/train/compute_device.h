// The backend a run computes on (training.device) and the arithmetic peak its MFU is measured
// against: the CPU backend with its measured FMA ceiling, or the CUDA backend on this process's
// GPU with the GPU's dense tensor-core (bf16) or CUDA-core (fp32) peak.
#pragma once

#include <memory>
#include <string>

#include "kernels/backend.h"
#include "trainer/config/config.h"

namespace tetra {

struct ComputeDevice {
  std::unique_ptr<Backend> backend;
  double peak_flops = 0.0;   // per rank
  std::string peak_source;   // "training.peak_gflops", "measured", or the GPU's datasheet figure
  std::string description;   // "cpu, 2 threads" or "cuda:0 NVIDIA H200 (132 SMs, 1.98 GHz)"
};

// Throws InputError when training.device is "cuda" and this build has no CUDA backend or the
// process sees no GPU (the message says which, and what to do). `want_peak` false skips the
// CPU peak measurement (generation needs no MFU).
ComputeDevice make_compute_device(const TrainingConfig& training, bool bf16, bool want_peak = true);

// True where this binary was built with the CUDA backend.
bool cuda_backend_built();

// The GPU this process uses among `count` visible ones: its local rank on the node (Open MPI's
// OMPI_COMM_WORLD_LOCAL_RANK, Slurm's SLURM_LOCALID, torchrun's LOCAL_RANK) modulo count.
int local_gpu_index(int count);

}  // namespace tetra
