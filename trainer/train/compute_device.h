// The backend a run computes on (training.device) and the arithmetic peak its MFU is measured
// against: the CPU backend with its measured FMA ceiling, or the CUDA backend on this process's
// GPU with the GPU's dense tensor-core (bf16 / fp16) or CUDA-core (fp32) peak.
//
// Test mode: with DeviceOptions::guarded_memory (the user's TETRA_TEST_GUARDED_MEMORY=1) the CPU
// backend sits behind the guarded-memory decorator (kernels/cpu/guarded_backend.h), whose memory the host cannot touch,
// as a GPU's. Test-only, like the fault-injection hooks (fault_injection.h): it proves on a
// CPU-only machine that the trainer reaches backend memory only through the backend
// (tests/parity/test_guarded_memory.py runs the same configs with and without it and requires
// bitwise-identical results). Slow; logged as a warning on every rank that uses it.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "kernels/backend.h"
#include "trainer/config/config.h"
#include "trainer/comm/process_groups.h"
#include "trainer/core/runtime_options.h"

namespace tetra {

// How this process computes, beyond the config: from the runtime options (read once in main) and
// the bootstrap's node-local rank.
struct DeviceOptions {
  int local_rank = 0;  // among this node's processes (ProcessInfo::local_rank); GPU local_rank % count
  AttentionPath attention = AttentionPath::AUTO;    // TETRA_ATTENTION
  bool nccl_blocking_wait = false;                  // TETRA_NCCL_BLOCKING_WAIT
  bool guarded_memory = false;                      // TETRA_TEST_GUARDED_MEMORY
  std::optional<std::string> cuda_visible_devices;  // CUDA_VISIBLE_DEVICES, quoted when no GPU is visible
};
DeviceOptions device_options(const RuntimeOptions& runtime, int local_rank);

struct ComputeDevice {
  std::unique_ptr<Backend> backend;
  double peak_flops = 0.0;   // per rank
  std::string peak_source;   // "training.peak_gflops", "measured", or the GPU's datasheet figure
  std::string description;   // "cpu, 2 threads" or "cuda:0 NVIDIA H200 (132 SMs, 1.98 GHz)"
  std::string gpu_name;      // the GPU's name ("NVIDIA H200"); empty on the CPU
  int threads = 1;           // CPU threads of this rank (1 on a GPU)
};

// Throws InputError when training.device is "cuda" and this build has no CUDA backend or the
// process sees no GPU (the message says which, and what to do). `want_peak` false skips the
// CPU peak measurement (generation needs no MFU). `act` is the run's compute type (its GEMMs' peak:
// on the CPU, fp16 GEMMs run in fp32, oneDNN having no fp16 kernels there).
ComputeDevice make_compute_device(const TrainingConfig& training, DType act, const DeviceOptions& device,
                                  bool want_peak = true);

// The backend-memory communicators `be` needs (ProcessGroups::use_backend_memory): none when its
// memory is host memory (the MPI communicators serve both roles), NCCL for the CUDA backend, the
// staged communicator (trainer/comm/staged_communicator.h) around each host one otherwise (the
// guarded test backend). `be` must outlive them.
BackendCommFactory backend_comm_factory(Backend& be, const DeviceOptions& device);

// True where this binary was built with the CUDA backend.
bool cuda_backend_built();

}  // namespace tetra
