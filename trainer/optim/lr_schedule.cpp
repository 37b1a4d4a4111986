#include "trainer/optim/lr_schedule.h"

#include <algorithm>
#include <cmath>
#include <numbers>

namespace tetra {

double learning_rate(const OptimizerConfig& o, int64_t total_steps, int64_t s) {
  if (s < o.warmup_steps) return o.lr * static_cast<double>(s + 1) / static_cast<double>(o.warmup_steps);
  if (o.decay == LrDecay::CONSTANT) return o.lr;
  const int64_t decay = std::max<int64_t>(1, o.decay_steps > 0 ? o.decay_steps : total_steps - o.warmup_steps);
  const double p = std::min(1.0, static_cast<double>(s - o.warmup_steps) / static_cast<double>(decay));
  if (o.decay == LrDecay::LINEAR) return o.lr - (o.lr - o.min_lr) * p;
  return o.min_lr + 0.5 * (o.lr - o.min_lr) * (1.0 + std::cos(std::numbers::pi * p));
}

}  // namespace tetra
