// Stopping a run early, cleanly: after a step, with a checkpoint (checkpoint.save_on_exit), when
//   - a rank got SIGTERM or SIGUSR1 (a scheduler's warning before its time limit, or a user),
//   - training.exit_after_min minutes have passed since the process started (a scheduler's time
//     limit counts from there too),
//   - the step is a multiple of training.exit_interval (and not the last one).
// Every rank must stop after the same step: the signal and the clock are agreed on over the world
// (one MAX all-reduce of one integer after each step), so a signal that reached one rank only
// stops them all.
#pragma once

#include <cstdint>

#include "kernels/backend.h"
#include "trainer/comm/communicator.h"
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
  // `scratch`: 4 bytes of `be`'s memory for the agreement.
  StopRequests(const TrainingConfig& tc, Communicator& world, Backend& be, void* scratch);

  // SIGTERM and SIGUSR1 request a stop instead of ending the process (from then on).
  void install_signal_handlers();
  // Collective over the world, after step `step` (1-based; `last`: the run's last step): whether
  // to stop after it, and why. A signal or the clock on any rank stops every rank.
  StopCause check(int64_t step, bool last);

 private:
  const TrainingConfig& tc_;
  Communicator& world_;
  Backend& be_;
  void* scratch_;
};

}  // namespace tetra
