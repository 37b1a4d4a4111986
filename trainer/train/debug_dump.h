// --dump-dir: what a run starts from and its first gradients, as files, for debugging and the
// PyTorch reference tests (tests/reference):
//   params_init.safetensors  the initial weights, as the model's global tensors
//   grads_step0.safetensors  the reduced gradients of step 0 (the loss scale taken off), likewise
//   batches.safetensors      with dp 1: the samples of each step run, "step_<n>" (global batch,
//                            seq_len + 1) for the first 100 steps of the run
// Global rank 0 writes; every rank takes part in gathering the tensors.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "trainer/config/config.h"
#include "trainer/optim/grad_buffers.h"

namespace tetra {

class DebugDump {
 public:
  // Writes `buffer` (a rank's fp32 parameter-sized buffer, whole on every DP rank) to `file` as
  // global tensors, the values multiplied by `scale` (collective).
  using WriteTensors = std::function<void(const std::string& file, const float* buffer, double scale)>;

  // Creates `dir` (the writer). InputError when it cannot.
  DebugDump(const Config& cfg, std::string dir, bool writer, WriteTensors write);

  void initial_weights(const float* master);
  // Step `s`'s (0-based) micro-batch `batch` (B, T + 1) of this rank, for batches.safetensors.
  void add_batch(int64_t s, const std::vector<int32_t>& batch);
  // The reduced gradients `grads` (gathered first when `grad_buffers` shards them) that carry
  // `loss_scale`. Collective.
  void gradients(Backend& be, GradBuffers& grad_buffers, const float* grads, int64_t total, double loss_scale);
  // batches.safetensors, of the steps from `start_step` on.
  void batches(int64_t start_step);

 private:
  const Config& cfg_;
  std::string dir_;
  bool writer_;
  WriteTensors write_;
  std::vector<int32_t> batches_;  // samples of the steps dumped so far
};

}  // namespace tetra
