// LossScaler (see loss_scaler.h): Megatron's dynamic grad scaler state machine, the static scale,
// and the divergence limit at the lowest scale.
#include "trainer/optim/loss_scaler.h"

#include <algorithm>

#include <fmt/format.h>

#include "kernels/common/check.h"

namespace tetra {

std::string LossScaleUpdate::describe() const {
  if (!overflow) return "";
  const std::string what = fmt::format("fp16 gradient overflow at loss scale {}", scale);
  if (next_scale < scale) return what + fmt::format("; scale halved to {}", next_scale);
  if (!dynamic) return what + " (static)";
  if (overflows_left > 0) return what + fmt::format("; scale kept ({} more before it halves)", overflows_left);
  return what + "; scale kept (training.min_loss_scale)";
}

LossScaler::LossScaler(const TrainingConfig& tc)
    : dynamic_(tc.loss_scale == 0.0),
      min_scale_(tc.min_loss_scale),
      window_(tc.loss_scale_window),
      hysteresis_(tc.hysteresis),
      max_floor_overflows_(tc.max_skipped_steps) {
  TETRA_CHECK(tc.precision == Precision::FP16, "loss scaling is for training.precision fp16, not {}",
              to_string(tc.precision));
  TETRA_CHECK(window_ >= 1 && hysteresis_ >= 1 && min_scale_ > 0.0,
              "loss scaler: loss_scale_window {}, hysteresis {}, min_loss_scale {}", window_, hysteresis_,
              min_scale_);
  state_.scale = dynamic_ ? tc.initial_loss_scale : tc.loss_scale;
  state_.hysteresis_tracker = hysteresis_;
}

LossScaleUpdate LossScaler::update(int64_t step, bool overflow) {
  LossScaleUpdate u;
  u.overflow = overflow;
  u.dynamic = dynamic_;
  u.scale = state_.scale;
  if (overflow) {
    ++state_.skipped_steps;
    // At the lowest scale already (static, or dynamic at min_loss_scale): lowering cannot help.
    const bool floor = !dynamic_ || state_.scale <= min_scale_;
    state_.floor_overflows = floor ? state_.floor_overflows + 1 : 0;
    if (dynamic_) {
      state_.growth_tracker = 0;
      state_.hysteresis_tracker -= 1;
      if (state_.hysteresis_tracker <= 0) state_.scale = std::max(state_.scale * 0.5, min_scale_);
      u.overflows_left = std::max<int64_t>(state_.hysteresis_tracker, 0);
    }
    u.next_scale = state_.scale;
    if (state_.floor_overflows > max_floor_overflows_)
      throw Error(fmt::format(
          "step {}: {}; {} overflowing step(s) in a row at the lowest loss scale ({}), more than "
          "training.max_skipped_steps ({}): the fp16 gradients overflow even so, the run has diverged; resume "
          "from an earlier checkpoint with a lower optimizer.lr, lower training.min_loss_scale, or train in "
          "training.precision \"bf16\"",
          step, u.describe(), state_.floor_overflows, state_.scale, max_floor_overflows_));
    return u;
  }
  state_.floor_overflows = 0;
  if (dynamic_) {
    state_.growth_tracker += 1;
    if (state_.growth_tracker == window_) {
      state_.growth_tracker = 0;
      state_.hysteresis_tracker = hysteresis_;
      state_.scale = std::min(state_.scale * 2.0, kMaxLossScale);
    }
  }
  u.next_scale = state_.scale;
  return u;
}

void LossScaler::restore(const LossScalerState& s) {
  const double configured = state_.scale;
  state_ = s;
  if (!dynamic_) state_.scale = configured;
}

}  // namespace tetra
