// Stopping a run early, cleanly: after a step, with a checkpoint (checkpoint.save_on_exit), when
//   - a rank got SIGTERM or SIGUSR1 (a scheduler's warning before its time limit, or a user),
//   - training.exit_after_min minutes have passed since the process started (a scheduler's time
//     limit counts from there too),
//   - the step is a multiple of training.exit_interval (and not the last one).
// Every rank must stop after the same step: the signal and the clock are agreed on over the world
// (their MAX, carried by the step guard's all-reduce, step_guard.h), so a signal that reached one
// rank only stops them all.
#pragma once

#include <cstdint>

#include "trainer/config/config.h"

namespace tetra {

enum class StopCause : int32_t {
  NONE = 0,
  SIGNAL = 1,
  TIME_LIMIT = 2,     // training.exit_after_min
  EXIT_INTERVAL = 3,  // training.exit_interval
};

// What the log line says: "a signal", "training.exit_after_min", "training.exit_interval".
const char* stop_cause_name(StopCause cause);

class StopRequests {
 public:
  explicit StopRequests(const TrainingConfig& tc);

  // SIGTERM and SIGUSR1 request a stop instead of ending the process (from then on).
  void install_signal_handlers();
  // This rank's request before step `step`'s update: 0, or a StopCause (a signal, the clock), for
  // the guard's agreement.
  int32_t request() const;
  // After step `step` (1-based; `last`: the run's last step), with the agreed request (the maximum
  // of every rank's request()): whether to stop after it, and why.
  StopCause check(int64_t step, bool last, int32_t agreed) const;

 private:
  const TrainingConfig& tc_;
};

}  // namespace tetra
