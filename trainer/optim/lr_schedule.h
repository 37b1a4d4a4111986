// Learning-rate schedule: linear warm-up, then cosine, linear or constant decay to min_lr.
//   s < warmup:  lr * (s + 1) / warmup
//   otherwise:   p = min(1, (s - warmup) / D), D = decay_steps or (steps - warmup), at least 1
//                cosine: min_lr + (lr - min_lr) (1 + cos(pi p)) / 2;  linear: lr - (lr - min_lr) p
#pragma once

#include <cstdint>

#include "trainer/config/config.h"

namespace tetra {

// Learning rate for step s (0-based).
double learning_rate(const OptimizerConfig& o, int64_t total_steps, int64_t s);

}  // namespace tetra
