// StepGuard: decides whether a step's update may reach the weights. A step is skipped (no optimizer
// update; the gradients are dropped) when its loss or gradient norm is not finite, or, with
// training.spike_zscore > 0, when either spikes: lies more than spike_zscore standard deviations
// above the mean of the last spike_window applied steps. More than training.max_skipped_steps
// skipped steps in a row fail the run: at that point skipping hides a diverged run instead of
// stepping over one bad batch.
//
// The verdict is collective over the world: each rank judges the values it holds and one small
// MAX all-reduce makes every rank take the same decision, so the replicas never diverge (a
// non-finite loss on one tensor-parallel rank only, say, still skips the step everywhere).
//
// Why skip instead of stop: one batch with a bad document, or one overflow, should cost a step,
// not a run (Megatron and OPT skip such updates); the consecutive limit keeps a real divergence
// from being skipped forever. A skipped step still counts as a step (the LR schedule, the data
// and the optimizer's step counter move on), so a resumed run sees the same schedule.
//
// fp16 loss scaling (trainer/optim/loss_scaler.h) reports a gradient overflow through the same
// agreement: an overflow on any rank skips the step on every rank, as an overflow (verdict.overflow)
// that the loss scaler handles, not judged here nor counted as a skip in a row (an overflow is the
// scale's fault, not the batch's).
#pragma once

#include <cstdint>
#include <deque>
#include <string>

#include "kernels/backend.h"
#include "trainer/config/config.h"
#include "trainer/comm/communicator.h"

namespace tetra {

struct StepVerdict {
  bool skip = false;
  bool overflow = false;  // skipped for an fp16 gradient overflow (the loss scaler's case)
  std::string reason;  // why it is skipped: "non-finite loss", "loss spike (z = 9.3)", ...
  int32_t request = 0;  // the largest `request` of any rank (check()'s)
};

class StepGuard {
 public:
  StepGuard(const TrainingConfig& tc, Communicator& world, Backend& be);
  ~StepGuard();
  StepGuard(const StepGuard&) = delete;
  StepGuard& operator=(const StepGuard&) = delete;

  // Collective over `world`. `step` is 1-based. `overflow`: this rank saw an fp16 gradient overflow
  // (a non-finite norm of the loss-scaled gradients). `request`: a number every rank must agree on
  // by its maximum, carried by the same all-reduce (the trainer's stop request, stop_requests.h),
  // returned in the verdict. Throws tetra::Error when this skip is one more than
  // training.max_skipped_steps in a row.
  StepVerdict check(int64_t step, double loss, double grad_norm, bool overflow = false, int32_t request = 0);

 private:
  struct Window {
    std::deque<double> values;
    // z-score of x against the window; 0 until the window is full or when it has no spread.
    double zscore(double x, size_t size) const;
    void push(double x, size_t size);
  };

  double spike_zscore_;
  size_t window_size_;
  int64_t max_skipped_;
  Communicator& world_;
  Backend& be_;
  BackendBuffer flags_buf_;   // owns flags_
  int32_t* flags_ = nullptr;  // (4) backend scratch for the agreement
  Window losses_, norms_;
  int64_t consecutive_ = 0;
};

}  // namespace tetra
