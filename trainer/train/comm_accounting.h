// Communication accounting: what each group moved in a step (measured by its communicators) beside
// what the layout predicts (parallel/comm_volume.h), for metrics.jsonl's "comm" records and a
// warning whenever the two differ.
//
// The groups accounted are tp, dp, pp, embedding and, in MoE models, edp and ep (a dense model's
// expert groups never communicate). A group of one rank moves nothing and is left out of the
// records.
#pragma once

#include <vector>

#include "trainer/comm/process_groups.h"
#include "trainer/config/config.h"
#include "trainer/parallel/comm_volume.h"
#include "trainer/train/metrics.h"

namespace tetra {

class CommAccounting {
 public:
  CommAccounting(const Config& cfg, ProcessGroups& groups);

  // The start of a step whose predicted traffic is `predicted`: snapshots every group's counters.
  void begin_step(const StepVolume& predicted);
  // Each group's traffic since begin_step(), with its prediction (the expert-parallel all-to-all's
  // payload depends on the routing: it is taken as measured; its number of calls is predicted).
  std::vector<CommRecord> records() const;
  // "step N: group G moved X but the layout predicts Y" for each record that differs.
  static void warn_mismatches(int64_t step, const std::vector<CommRecord>& records);

  // Traffic in its scope is not accounted (debugging output between begin_step() and records()):
  // the counters are put back as they were when it ends.
  class Paused {
   public:
    explicit Paused(CommAccounting& accounting);
    ~Paused();
    Paused(const Paused&) = delete;
    Paused& operator=(const Paused&) = delete;

   private:
    CommAccounting& accounting_;
    std::vector<CommStats> saved_;
  };

 private:
  struct Group {
    const char* name;
    GroupKind kind;
    bool active;  // false: the group does not communicate in this model
    GroupVolume StepVolume::*predicted;
  };
  std::vector<CommStats> snapshot() const;

  ProcessGroups& groups_;
  std::vector<Group> accounted_;
  StepVolume predicted_;
  std::vector<CommStats> before_;
};

}  // namespace tetra
