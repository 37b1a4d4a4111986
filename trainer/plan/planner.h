// `tetra plan`: every layout the trainer accepts for a model, sequence length and global batch on a
// cluster, those that fit its memory ranked by predicted tokens/s per GPU.
//
// A layout is (tp, cp, pp, schedule, virtual stages, dp, ep, ZeRO stage, recomputation,
// micro-batch size) over all the cluster's GPUs, tp within a node (a power of two up to gpus_per_node),
// cp a power of two, pp any divisor, micro-batches 1 to 16 (powers of two), in the default rank order (tp fastest, so TP
// groups share a node), sequence parallelism on wherever tp > 1 (the same traffic as without it,
// less memory). Each candidate is the run's config with those keys set and passes the trainer's
// own validation (config_from_json) or is not a layout; its memory is the trainer's plan
// (plan_memory, the largest pipeline rank's peak) against the GPU's memory less its reserve, and
// its time predict_step's.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "trainer/config/config.h"
#include "trainer/plan/cluster.h"
#include "trainer/plan/step_time.h"
#include "trainer/train/memory_plan.h"

namespace tetra {

struct PlannedLayout {
  Config cfg;
  MemoryPlan memory;        // of the pipeline rank with the largest peak
  int64_t memory_pp_rank = 0;
  double memory_bytes = 0;  // what that rank's device holds at the peak
  bool fits = false;
  std::string binds;        // when it does not fit: the largest part and by how much it is over
  StepPrediction time;
  std::string describe() const;  // "tp 4 cp 1 pp 8 (interleaved x5) dp 2 zero 1 mbs 1 recompute none"
};

// The bytes a layout's rank may use: the GPU's memory less its reserve.
double usable_bytes(const ClusterSpec& cluster);

// Memory and time of `cfg`'s own layout (validated) on `cluster` (`always_time` false: the time only
// when it fits).
PlannedLayout evaluate_layout(const Config& cfg, const ClusterSpec& cluster, const PlanOptions& opt = {},
                              bool always_time = true);

struct PlanSearch {
  std::vector<PlannedLayout> fitting;  // ranked, fastest first
  int64_t candidates = 0;              // layouts tried
  int64_t refused = 0;                 // refused by the trainer's validation
  std::map<std::string, int64_t> refusal_keys;  // the first key each refusal names, counted
  int64_t too_big = 0;                 // valid, but over the memory
  int64_t dominated = 0;               // a heavier recomputation of a layout that fits without it: not timed
  std::vector<PlannedLayout> closest_too_big;  // the least over, a few (to say what binds)
};

// Every layout of `base`'s model, seq_len, global batch, precision and optimizer on the cluster's
// gpus() GPUs. InputError when base has no global_batch_size.
PlanSearch search_layouts(const Config& base, const ClusterSpec& cluster, const PlanOptions& opt = {});

}  // namespace tetra
