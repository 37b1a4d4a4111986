// The straggler line: a rank whose steps are consistently slower than its peers'. In synchronous
// training every rank's step takes the same wall time (the others wait for the slowest in their
// collectives), so what is compared is each rank's busy time: its step less the time it spent
// blocked in communication waits (CommStats::blocked_s over every group). A rank whose busy time
// is at least logging.straggler_factor times the median of the other ranks of its pipeline stage
// (which do the same work) in logging.straggler_window steps in a row is named, once, with its
// coordinates; a line says when it is no longer slow. Megatron's straggler detector has the same aim
// (it times GEMMs on every rank); this needs no extra kernels.
//
// Only where communication waits block the host (MPI: the CPU backend). NCCL's waits return at once
// (the device waits), so on GPUs every rank's busy time would be its whole step: the check is off
// there, and says so.
#pragma once

#include <cstdint>
#include <deque>
#include <optional>
#include <string>
#include <vector>

#include "trainer/config/config.h"

namespace tetra {

struct ProcessGroups;

struct StragglerReport {
  int rank = 0;
  double busy_ms = 0.0, median_ms = 0.0;
  bool slow = true;  // false: it was slow and no longer is
  std::string line;
};

class StragglerDetector {
 public:
  // `waits_block_host`: communication waits block the calling thread (false: the check is off).
  StragglerDetector(const LoggingConfig& cfg, ProcessGroups& groups, bool waits_block_host);

  bool enabled() const { return enabled_; }
  // Every rank's seconds blocked in communication so far (all groups, both roles).
  double blocked_s() const;
  // After step `step`: this rank's busy seconds. Collective over the world (host memory). The
  // ranks that became (or stopped being) stragglers at this step, the same on every rank.
  std::vector<StragglerReport> observe(int64_t step, double busy_s);

  // The rule, for tests: given each rank's busy times over the last steps (busy[step][rank]) and
  // each rank's pipeline stage, the ranks at least `factor` times the median of their stage's other
  // ranks in each of the last `window` steps.
  static std::vector<int> slow_ranks(const std::deque<std::vector<double>>& busy, const std::vector<int>& stage,
                                     double factor, int64_t window);

 private:
  ProcessGroups& groups_;
  bool enabled_ = false;
  double factor_;
  int64_t window_;
  std::vector<int> stage_;                  // per global rank: its pipeline stage
  std::deque<std::vector<double>> busy_;    // the last `window` steps' busy seconds, per rank
  std::vector<bool> flagged_;               // per rank: named as a straggler and not yet cleared
};

}  // namespace tetra
