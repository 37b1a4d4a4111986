// The update of one training step, from the accumulated gradients to the new weights: whichever
// of the run's update paths applies, behind one step().
//
//   exact (AdamW)      the gradient buffers reduce over DP while backward runs; global-norm
//                      clipping; AdamW on the fp32 master weights (sharded with the distributed
//                      optimizer, whose shards are then all-gathered into the compute weights)
//   int8               the reduction is a compressed exchange after backward (compressed_reduction.h),
//                      then as exact
//   onebit             AdamW during the warm-up; then 1-bit Adam's compressed step on the unreduced
//                      gradient, without clipping (onebit_adam.h)
//   fp16               the gradients carry the loss scale: it comes off in the update's one multiply;
//                      an overflow skips the update and the scaler halves the scale (loss_scaler.h)
//
// StepGuard's verdict (step_guard.h) may skip any of them: the gradients are then dropped. The
// learning rate follows the updates made (an fp16 overflow is none).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include "kernels/backend.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/comm/process_groups.h"
#include "trainer/config/config.h"
#include "trainer/optim/adamw.h"
#include "trainer/optim/compressed_reduction.h"
#include "trainer/optim/grad_buffers.h"
#include "trainer/optim/loss_scaler.h"
#include "trainer/optim/onebit_adam.h"
#include "trainer/parallel/comm_volume.h"
#include "trainer/params/param_layout.h"
#include "trainer/train/step_guard.h"

namespace tetra {

// What one step's update did.
struct StepUpdate {
  double loss = 0.0;       // the step's mean loss over its tokens
  int32_t stop_request = 0;  // the largest stop request of any rank (stop_requests.h)
  double lr = 0.0;         // the learning rate of the update
  double grad_norm = 0.0;  // global norm before clipping (without the loss scale)
  float clip = 1.0f;       // factor the gradients were multiplied by
  std::optional<std::string> skipped;  // why the update was skipped; unset: applied
  std::optional<double> loss_scale;    // fp16: the scale this step's gradients carried
  bool overflow = false;               // fp16: they overflowed
};

class Updater {
 public:
  // `master`: the fp32 master weights (whole, backend memory), read at construction; once the
  // optimizer holds its shards of them (holds_master_weights()) the caller may free them.
  // `compute`: the weights the model reads (== master in fp32); `grads`: the fp32 gradients,
  // reduced by `grad_buffers`.
  Updater(const Config& cfg, const ParamLayout& layout, Backend& be, GradBuffers& grad_buffers,
          ProcessGroups& groups, DType compute_type, float* master, void* compute, float* grads);
  ~Updater();
  Updater(const Updater&) = delete;
  Updater& operator=(const Updater&) = delete;

  // bf16 / fp16 with the distributed optimizer: the fp32 master weights live sharded in the optimizer.
  bool holds_master_weights() const { return !master_; }

  // Before step `s` (0-based) runs its backward: sets whether the gradient buffers reduce while
  // backward runs. Returns the step's predicted communication.
  StepVolume begin_step(int64_t s);
  // The factor of the loss gradient for a step over `tokens` tokens: 1 / tokens, times the loss
  // scale in fp16.
  float loss_gradient_scale(int64_t tokens) const;

  // Called with the reduced gradients before they are consumed (with the loss scale they carry).
  using GradientHook = std::function<void(double loss_scale)>;
  // Step `s`'s update after its backward: reduces what is left to reduce, takes the guard's
  // verdict (collective), updates the weights and zeroes the gradients for the next step.
  // `scalars`: 3 floats of backend memory, the first holding the step's loss summed over its
  // `tokens` tokens and every rank (the trainer leaves it there, reduced on the device); the
  // gradient's squared norms are reduced beside it and the three read back together: the step's
  // one read-back before the guard's agreement (the GPU is not drained for each). `stop_request`
  // rides the guard's all-reduce (StepUpdate::stop_request: every rank's maximum).
  StepUpdate step(int64_t s, float* scalars, double tokens, StepGuard& guard, int32_t stop_request = 0,
                  const GradientHook& reduced = {});

  // Checkpoints: the optimizer's state into `b`, the loss scaler's (fp16), and both back on resume
  // from checkpoint `from` at `st`.
  void add_checkpoint_state(CheckpointBuffers& b);
  std::optional<LossScalerState> loss_scaler_state() const;
  void resume(const CheckpointState& st, const std::string& from);

  // "dynamic, scale 65536 (window 1000, hysteresis 2, min 1)" / "static, scale 4096"; "" without
  // loss scaling.
  std::string describe_loss_scaling() const;
  // Whether onebit compresses step s (0-based).
  bool compresses(int64_t s) const { return onebit_ && onebit_->compressed(s); }
  float* master_shard() { return optimizer_->master_shard(); }
  size_t state_bytes() const { return optimizer_->state_bytes(); }

 private:
  const Config& cfg_;
  const ParamLayout& layout_;
  Backend& be_;
  GradBuffers& grad_buffers_;
  bool writer_;  // global rank 0: logs skipped updates
  DType act_;
  float* master_;  // null when the optimizer holds the master weights
  void* compute_;
  float* grads_;  // ZeRO-2: the compact shard (GradBuffers::shard())
  int64_t grads_numel_ = 0;
  bool zero3_ = false;  // parallel.zero_stage 3 over dp > 1
  bool compressed_ = false;  // the current step runs onebit's compressed phase
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<OnebitAdam> onebit_;         // parallel.grad_compression onebit
  std::unique_ptr<CompressedReduction> int8_;  // parallel.grad_compression int8
  std::unique_ptr<LossScaler> scaler_;         // training.precision fp16
};

}  // namespace tetra
