// training.profile_steps: each rank's timeline of the profiled steps as a Chrome trace,
// logging.dir/trace/rank_R.json (trainer/core/trace.h records it; `tetra trace merge` joins the
// ranks' files). Ranks share one time axis: when the window starts, global rank 0 measures every
// other rank's clock offset by round trips over the world (Cristian's algorithm, the round trip of
// least delay of several kept; its half is the offset's uncertainty, written in the file's
// otherData with rank 0's clock at time 0, which tells runs apart). A run resumed inside the window
// records from its first step; one resumed past it records nothing (and says so).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/config/config.h"

namespace tetra {

struct ProcessGroups;

class StepProfiler {
 public:
  // `first_step`: the run's first step (1-based; later than 1 when resumed).
  StepProfiler(const Config& cfg, ProcessGroups& groups, int64_t first_step);
  ~StepProfiler();  // recording stops (a step that threw inside the window)

  bool enabled() const { return first_ > 0; }
  // Step `step` (1-based) begins: at the window's first step run, the clocks are aligned (a
  // collective over the world: every rank calls it at the same step) and recording starts.
  void begin_step(int64_t step);
  // Step `step` has ended (its checkpoint saved) after `ms` of step time: at the window's last
  // step recording stops and this rank's file is written. Returns the file written, or "".
  std::string end_step(int64_t step, double ms);
  // The run ended (a stop request) inside the window: what was recorded is written.
  std::string finish();

  // logging.dir/trace/rank_R.json
  static std::string path(const std::string& logging_dir, int rank);

 private:
  std::string write();
  ProcessGroups& groups_;

  int64_t first_ = 0, last_ = 0;  // the window (0: off)
  bool recording_ = false;
  std::string file_;
  int rank_ = 0;
  std::string process_name_;
  double offset_s_ = 0.0, uncertainty_s_ = 0.0, epoch_s_ = 0.0;
  std::vector<std::pair<int64_t, double>> steps_;  // (step, ms) recorded
  std::string coords_json_;
};

}  // namespace tetra
