// One description of a run: its model, its layout over the ranks, what a step does, what a rank
// holds in memory and what it sends per step. It is computed from the config alone (and the rank
// it describes), so `--dry-run` shows before a job is launched what the start-up log of that job
// shows: both are renderings of the same RunReport.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "trainer/config/config.h"
#include "trainer/model/flops.h"
#include "trainer/parallel/comm_volume.h"
#include "trainer/params/param_layout.h"
#include "trainer/train/memory_plan.h"

namespace tetra {

struct RunReport {
  const Config* cfg = nullptr;
  ModelStats model;      // of the whole model
  int64_t pp_rank = 0;   // of the rank described
  ParamLayout layout;    // the rank's parameter buffer (rank_layout)
  MemoryPlan memory;     // what the rank allocates (plan_memory)
  StepVolume predicted;  // the rank's traffic per step (exact steps: before onebit compresses)
};

// The rank whose buffer is `layout` (rank_layout(cfg, ..., pp_rank)).
RunReport describe_run(const Config& cfg, const ParamLayout& layout, int64_t pp_rank);

// What only the running job knows, beside the report, for its start-up log.
struct RunEnvironment {
  int64_t world = 1;
  size_t gradient_buckets = 0;
  std::string backend;      // the compute device, in words
  double rank_peak_flops = 0.0;
  std::string peak_source;  // where rank_peak_flops comes from
  bool samples = false;     // text samples at evaluations
  bool onebit_compresses = false;  // onebit reaches its compressed phase within training.steps
};

// The start-up log's description of the run: the model, moe, layout, run, memory, samples and
// communication lines (spdlog info).
void log_run_report(const RunReport& report, const RunEnvironment& env);

// `--dry-run`: the run as planned for rank 0 (and each pipeline rank's memory), as printed.
std::string dry_run_report(const Config& cfg);

}  // namespace tetra
