// Pipeline schedules as tables: for each pipeline rank, the ordered list of what it does in a
// step (forward or backward of micro-batch m on one of its model chunks). The runner
// (pipeline_runner.h) executes a table; everything about the schedule itself — order, memory
// bound, bubble — is a property of the table and is unit-tested without running a model.
//
// Stages: with pp ranks and v virtual stages (model chunks) per rank there are S = pp v stages;
// stage s = c pp + r is chunk c of rank r (Megatron's interleaving: rank r holds layer blocks
// r, r + pp, r + 2 pp, ...). Activations flow from stage s to s + 1, i.e. from rank r to rank
// (r + 1) mod pp; their gradients flow back.
//
//   gpipe        every forward, then every backward (m micro-batches in flight).
//   1f1b         PipeDream-Flush / Megatron's default: rank r runs min(pp - r - 1, m) warm-up
//                forwards, then alternates one forward and one backward, then drains; at most
//                pp - r micro-batches in flight on rank r.
//   interleaved  Megatron's interleaved 1F1B over v chunks: forwards visit chunks in groups of
//                pp micro-batches (micro-batch order within a chunk is preserved), warm-up
//                (pp - r - 1) * 2 + (v - 1) pp forwards; needs m divisible by pp. Its bubble is
//                (pp - 1) / (m v + pp - 1) of the step instead of (pp - 1) / (m + pp - 1).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/config/config.h"

namespace tetra {

// ScheduleKind (parallel.schedule) is config.h's.
// "gpipe" | "1f1b" | "interleaved"; throws on anything else.
ScheduleKind schedule_kind(const std::string& name);
const char* schedule_name(ScheduleKind kind);

struct PipeAction {
  bool forward = true;
  int32_t micro_batch = 0;
  int32_t chunk = 0;  // model chunk of this rank (0 .. v-1); stage = chunk * pp + rank
  bool operator==(const PipeAction&) const = default;
};

struct PipelineSchedule {
  ScheduleKind kind = ScheduleKind::ONE_F_ONE_B;
  int pp = 1, vp = 1, m = 1;
  std::vector<std::vector<PipeAction>> ranks;  // [rank] -> actions in execution order
  // Buffers per chunk that input gradients are sent from (micro-batch m uses m % grad_buffers):
  // the fewest with which the execution cannot deadlock when a send completes only once received.
  int grad_buffers = 1;

  // Requires: pp >= 1, m >= 1; vp == 1 unless interleaved; interleaved: vp >= 2 and m % pp == 0.
  // The table, built once per (kind, pp, vp, m) and kept for the process (a reference to it).
  static const PipelineSchedule& build(ScheduleKind kind, int pp, int vp, int m);
  static PipelineSchedule build_uncached(ScheduleKind kind, int pp, int vp, int m);  // build() caches these

  int stages() const { return pp * vp; }
  int stage_of(int rank, int chunk) const { return chunk * pp + rank; }
  // Most micro-batches whose forward ran and backward has not, on `rank` (over all its chunks,
  // and for one chunk): what its activation memory must hold.
  int max_in_flight(int rank) const;
  int max_in_flight(int rank, int chunk) const;
  // The analytic bubble: idle fraction of a step with equal forward/backward times per stage.
  double ideal_bubble() const;
};

// Simulates the table the way the runner executes it: each rank runs its actions in order;
// sends are posted without blocking, but a send buffer is reused only after its message was
// received (gradients leave from buffer m % grad_buffers; forward-only, a chunk's activations
// from its one slot); a forward on stage s > 0 waits for stage s - 1's activation and a backward
// on stage s < S - 1 for stage s + 1's gradient, each taken from a FIFO channel per (sender,
// receiver, kind) — the matching MPI and NCCL give one tag. Returns an empty string when every
// action runs and every message is received by the action it was sent for, else what went wrong
// (a deadlock, a message matched to the wrong micro-batch, an action missing or repeated, a
// backward before its forward).
// forward_only: the forward actions alone, in table order (evaluation).
std::string check_schedule(const PipelineSchedule& schedule, bool forward_only = false);

}  // namespace tetra
