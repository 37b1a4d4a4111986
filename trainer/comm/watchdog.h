// The watchdog: no silent hangs. A thread per process watches two records, "which step is this
// rank in, since when" and "which collective is each thread blocked in, since when", and ends the
// whole job when either has lasted longer than training.collective_timeout_s.
//
// Why a thread, and why a per-process record: a rank blocked in a collective whose peer is dead
// or stuck never returns to any code of ours, so nothing on the blocked path can notice. The
// record is written where the code blocks (Communicator::wait, barrier, group_end) and by the
// training loop at each step's start and end; the watchdog thread reads it a few times per
// timeout. Reading and writing it costs a mutex per blocking wait, nothing per element.
//
// What a timeout prints (stderr, every rank that times out, then MPI_Abort with kWatchdogExitCode):
//   watchdog: rank 1 [tp1 pp0 dp0 ep0 | r1] has been in step 3 for 5.0 s (training.collective_
//   timeout_s = 5): waiting 4.9 s in all_reduce on group 'tp' (global ranks [0, 1]) for a member
//   that has not joined it (hung or dead); ending the job
// and, on a rank that is not blocked in any collective (the rank that hangs in its own work):
//   ... has been in step 3 for 5.0 s ...: not waiting in any collective: this rank is stuck in its
//   own work (a kernel, I/O, a deadlock), and the ranks waiting for it time out too
// Every stuck rank reports before the job ends (the abort waits a short grace period), so the
// odd one out in the log is the rank that hung.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/core/runtime_options.h"

namespace tetra {

// Exit code of a job ended by the watchdog (0 success, 1 runtime failure, 2 bad input).
constexpr int kWatchdogExitCode = 3;

// Starts the process's watchdog thread: `timeout_s` > 0 (0 = off: start nothing); `rank` and
// `where` (the rank's coordinates, log.h's rank_prefix) name this rank in its reports. `hang` is
// the test hook of watchdog_step_begin (kept with the timeout off too). Stopped by watchdog_stop()
// or at the end of the process. One per process.
void watchdog_start(double timeout_s, int rank, const std::string& where, const HangHook& hang = {});
void watchdog_stop();

// A blocking wait in progress: registered for the watchdog while the object lives. Cheap when the
// watchdog is off. `group` and `members` must outlive the object (the communicator's own).
class WatchedWait {
 public:
  WatchedWait(const std::string& group, const std::vector<int>& members, const char* op);
  ~WatchedWait();
  WatchedWait(const WatchedWait&) = delete;
  WatchedWait& operator=(const WatchedWait&) = delete;

 private:
  int64_t id_ = -1;  // -1: not registered
};

// The training loop's record: step `step` (1-based) starts / has finished.
// Test-only fault injection (tests/cli/test_watchdog.sh): watchdog_start's `hang` (the user's
// TETRA_TEST_HANG_RANK=<global rank>, TETRA_TEST_HANG_STEP=<step>) makes that rank sleep (for
// TETRA_TEST_HANG_SECONDS, default one hour) at the start of that step, before the step's first
// collective, as a rank stuck in its own work would. Not for production use.
void watchdog_step_begin(int64_t step);
void watchdog_step_end();

}  // namespace tetra
