// Loss scaling for fp16 training (training.precision "fp16"), as Megatron-LM and apex do it.
//
// Why: fp16 has 5 exponent bits. The activation gradients of a step are tiny (the loss is a mean
// over hundreds of thousands of tokens) and many fall below fp16's smallest subnormal (2^-24) and
// flush to zero. Multiplying the loss gradient by a scale S lifts them into range; the fp32
// parameter gradients are divided by S again once, after their reduction (folded into the factor
// AdamW multiplies the gradients by, with the clipping factor). Too large an S overflows fp16
// instead: some gradient becomes inf or NaN.
//
// The overflow check is the global gradient norm the trainer computes anyway, in fp32 / double,
// all-reduced over every rank that holds a part of the model: any inf or NaN in any gradient makes
// it inf or NaN on every rank (backend sum_squares propagates non-finite values), so no extra pass
// or collective is needed, and every rank takes the same decision (StepGuard's agreement
// all-reduce carries the overflow flag as well). A finite sum of squares beyond fp32's range is
// reported as an overflow too: the scale is too large either way.
//
// Dynamic scaling (training.loss_scale 0), Megatron's DynamicGradScaler step for step:
//   overflow: the update is skipped (parameters, Adam moments and step count untouched, gradients
//             zeroed); the good-step counter restarts; the hysteresis counter drops by one and,
//             when it reaches 0, the scale halves (never below training.min_loss_scale).
//   no overflow: the good-step counter grows; after training.loss_scale_window of them in a row the
//             scale doubles (never above kMaxLossScale), the counter restarts and the hysteresis
//             counter is refilled to training.hysteresis.
// So with hysteresis h the first h - 1 overflows after a growth (or after the start) only skip,
// and every later one halves: the counter is refilled by growth alone, as in Megatron (not by a
// good step). Static scaling (training.loss_scale > 0) keeps its scale; an overflow still skips.
//
// A skipped step still consumes its data and counts as an iteration, but, as in Megatron, not as an
// update: the LR schedule and Adam's bias correction advance with applied updates only
// (updates_applied = iteration - skipped_steps). More than training.max_skipped_steps overflows in
// a row while the scale cannot go lower (at min_loss_scale, or static) fail the run: the gradients
// overflow even unscaled, the run has diverged.
//
// The state (scale, counters, skipped steps) is replicated on every rank; checkpoints save it in
// their manifest and a resume restores it, so a resumed run continues bit for bit.
#pragma once

#include <cstdint>
#include <string>

#include "trainer/checkpoint/manifest.h"  // LossScalerState: the state a checkpoint records
#include "trainer/config/config.h"

namespace tetra {

// One step's outcome.
struct LossScaleUpdate {
  bool overflow = false;
  bool dynamic = true;
  double scale = 1.0;          // the scale this step's gradients carried
  double next_scale = 1.0;     // the scale of the next step
  int64_t overflows_left = 0;  // dynamic, after an overflow: overflows before the scale halves
  // "" without overflow, else e.g. "fp16 gradient overflow at loss scale 65536; scale halved to 32768"
  std::string describe() const;
};

class LossScaler {
 public:
  // Fresh state from the config (precision fp16): the static loss_scale, or initial_loss_scale with
  // the hysteresis counter full.
  explicit LossScaler(const TrainingConfig& tc);

  double scale() const { return state_.scale; }
  bool dynamic() const { return dynamic_; }
  int64_t skipped_steps() const { return state_.skipped_steps; }

  // Records a step whose (agreed) overflow verdict is `overflow`; returns what happened. Throws
  // tetra::Error after more than training.max_skipped_steps overflows in a row at the lowest scale.
  LossScaleUpdate update(int64_t step, bool overflow);

  const LossScalerState& state() const { return state_; }
  // A checkpoint's state. With static scaling the configured scale stays (a static run has no
  // scale to restore); the counters are taken as saved.
  void restore(const LossScalerState& s);

 private:
  bool dynamic_;
  double min_scale_;
  int64_t window_;
  int64_t hysteresis_;
  int64_t max_floor_overflows_;
  LossScalerState state_;
};

}  // namespace tetra
