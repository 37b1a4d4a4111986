// StepGuard (see step_guard.h): local judgement, one MAX all-reduce of six flags, the verdict.
#include "trainer/train/step_guard.h"

#include <cmath>

#include <fmt/format.h>

#include "kernels/common/check.h"

namespace tetra {

namespace {
enum Flag { NONFINITE_LOSS, NONFINITE_NORM, LOSS_SPIKE, NORM_SPIKE, OVERFLOW, REQUEST, FLAGS };
}  // namespace

double StepGuard::Window::zscore(double x, size_t size) const {
  if (values.size() < size) return 0.0;
  double mean = 0.0;
  for (double v : values) mean += v;
  mean /= static_cast<double>(values.size());
  double var = 0.0;
  for (double v : values) var += (v - mean) * (v - mean);
  const double sd = std::sqrt(var / static_cast<double>(values.size()));
  return sd > 0.0 ? (x - mean) / sd : 0.0;
}

void StepGuard::Window::push(double x, size_t size) {
  values.push_back(x);
  while (values.size() > size) values.pop_front();
}

StepGuard::StepGuard(const TrainingConfig& tc, Communicator& world, Backend& be)
    : spike_zscore_(tc.spike_zscore),
      window_size_(static_cast<size_t>(tc.spike_window)),
      max_skipped_(tc.max_skipped_steps),
      world_(world),
      be_(be) {
  flags_buf_ = BackendBuffer(be_, FLAGS * sizeof(int32_t));
  flags_ = flags_buf_.as<int32_t>();
}

StepGuard::~StepGuard() = default;

StepVerdict StepGuard::check(int64_t step, double loss, double grad_norm, bool overflow, int32_t request) {
  int32_t flags[FLAGS] = {};
  flags[REQUEST] = request;
  flags[OVERFLOW] = overflow ? 1 : 0;
  flags[NONFINITE_LOSS] = std::isfinite(loss) ? 0 : 1;
  flags[NONFINITE_NORM] = std::isfinite(grad_norm) ? 0 : 1;
  double z_loss = 0.0, z_norm = 0.0;
  if (spike_zscore_ > 0.0 && std::isfinite(loss) && std::isfinite(grad_norm)) {
    z_loss = losses_.zscore(loss, window_size_);
    z_norm = norms_.zscore(grad_norm, window_size_);
    flags[LOSS_SPIKE] = z_loss > spike_zscore_ ? 1 : 0;
    flags[NORM_SPIKE] = z_norm > spike_zscore_ ? 1 : 0;
  }
  if (world_.size() > 1) {
    be_.copy_from_host(flags_, flags, sizeof(flags));
    world_.all_reduce(flags_, FLAGS, DType::I32, ReduceOp::MAX);
    be_.copy_to_host(flags, flags_, sizeof(flags));
  }

  StepVerdict v;
  v.request = flags[REQUEST];
  if (flags[OVERFLOW]) {  // the loss scaler's case: nothing else is judged, nothing counted
    v.skip = v.overflow = true;
    v.reason = overflow ? "fp16 gradient overflow" : "fp16 gradient overflow (seen on another rank)";
    return v;
  }
  auto add = [&v](const std::string& why) { v.reason += (v.reason.empty() ? "" : ", ") + why; };
  if (flags[NONFINITE_LOSS]) add(std::isfinite(loss) ? "non-finite loss (on another rank)" : fmt::format("loss {}", loss));
  if (flags[NONFINITE_NORM])
    add(std::isfinite(grad_norm) ? "non-finite grad norm (on another rank)" : fmt::format("grad norm {}", grad_norm));
  if (flags[LOSS_SPIKE])
    add(fmt::format("loss spike ({:.4f}, z = {:.1f} > training.spike_zscore {})", loss, z_loss, spike_zscore_));
  if (flags[NORM_SPIKE])
    add(fmt::format("grad norm spike ({:.4f}, z = {:.1f} > training.spike_zscore {})", grad_norm, z_norm,
                    spike_zscore_));
  v.skip = !v.reason.empty();
  if (!v.skip) {
    consecutive_ = 0;
    losses_.push(loss, window_size_);
    norms_.push(grad_norm, window_size_);
    return v;
  }
  ++consecutive_;
  if (consecutive_ > max_skipped_)
    throw Error(fmt::format("step {}: {}; {} step(s) in a row skipped, more than training.max_skipped_steps ({}): "
                            "the run has diverged; resume from an earlier checkpoint with a lower optimizer.lr "
                            "(or set optimizer.grad_clip), or raise training.max_skipped_steps",
                            step, v.reason, consecutive_, max_skipped_));
  return v;
}

}  // namespace tetra
