// ZeRO-3's weights: the compute weights sharded over data parallelism like the optimizer state
// (a MoE model's experts over expert-DP),
// and each unit (a parameter group: the embedding, a block, the final norm and output layer)
// all-gathered before the model reads it.
//
// Under parallel.zero_stage 3 every group is its own gradient bucket (grad_buffer.h), so DP rank
// r owns the r-th of dp equal shards of each group, and the owned ranges back to back (the
// optimizer's state layout) are this rank's compute shard, which AdamW writes after each update
// (fp32: the optimizer's master shard itself). The model names the groups of its next phase
// (WeightSource::require); a group not resident is all-gathered from every rank's shard into one
// of two unit buffers, replacing the least recently used one the phase does not read. A phase
// reads at most two groups (the final norm and a tied output layer's embedding), so two buffers
// always hold it. In a training step the phases come in an order known beforehand
// (set_step_phases: the schedule's, comm_volume.h), and while a phase computes the next phase's
// group is gathered into the other buffer (prefetch: its gather overlaps the phase). The gathers
// per step follow from the phase order alone (count_gathers, the prediction's).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "trainer/params/grad_sink.h"
#include "trainer/params/param_layout.h"

namespace tetra {

class Communicator;
class Work;

class WeightUnits final : public WeightSource {
 public:
  // `shard`: this rank's compute shard (the owned ranges of one bucket per group, back to back,
  // the dense groups' over `dp` first, then a MoE model's expert groups' over expert-DP `edp`;
  // `type` elements), owned by the caller and rewritten by the optimizer between steps.
  // `keep` (parallel.reshard_after_forward false): a group stays gathered from its first use until
  // the step's end (a buffer per group: the stage's whole compute weights), not two at a time.
  WeightUnits(const ParamLayout& layout, Backend& be, Communicator& dp, Communicator& edp, const void* shard,
              DType type, bool keep = false);
  ~WeightUnits() override;
  WeightUnits(const WeightUnits&) = delete;
  WeightUnits& operator=(const WeightUnits&) = delete;

  void require(const std::vector<int>& groups) override;
  const void* at(int64_t offset) override;
  // The phases (the groups each reads) of one training step, in order: require() checks them
  // and prefetches the next one's group.
  void set_step_phases(std::vector<std::vector<int>> phases);
  // Every buffer is stale: the optimizer changed the shards, or an evaluation begins. Called at
  // the start of every step's forwards (`step`: its phases follow, with prefetch) and of every
  // evaluation (without), so that each starts empty.
  void release_all(bool step);
  int64_t gathers() const { return gathers_; }  // since construction

  // Bytes of the unit buffers for `layout` in `type` (two of the largest group, or with `keep`
  // one per group).
  static size_t buffer_bytes(const ParamLayout& layout, DType type, bool keep = false);
  // The gathers of each group (added to `out`, one entry per group) of running a step's `phases`
  // from empty buffers, prefetch included, exactly as require() does: the prediction's count.
  static void count_gathers(const std::vector<std::vector<int>>& phases, std::vector<int64_t>& out,
                            bool keep = false);

 private:
  struct Placer {  // which group each buffer holds, and when each was last needed
    int resident[2] = {-1, -1};
    int64_t used[2] = {0, 0};
    int64_t clock = 0;
    std::vector<char> kept;  // keep mode: per group, gathered this step (buffer = group)
    template <class Load>
    void need(const std::vector<int>& groups, Load load);  // make them resident (load the missing)
    template <class Load>
    void ahead(const std::vector<int>& current, const std::vector<int>& next, Load load);  // prefetch
  };
  void gather(int slot, int group, bool async);
  void wait_slot(int slot);
  int slot_of(int group) const;  // the buffer holding `group`, or -1

  const ParamLayout& layout_;
  Backend& be_;
  Communicator& dp_;
  Communicator& edp_;
  int64_t expert_compact_ = 0;  // where the expert groups' shards start in the compact shard
  const char* shard_;
  DType type_;
  size_t es_;
  bool keep_;
  std::vector<BackendBuffer> bufs_;          // two, or with keep_ one per group
  std::vector<std::unique_ptr<Work>> pending_;  // a prefetch's gather into the buffer, not yet waited for
  std::vector<Communicator*> pending_comm_;     // ... and its group
  Placer placer_;
  std::vector<std::vector<int>> phases_;
  int64_t cursor_ = -1;  // the next phase of the step; -1: outside one (no prefetch)
  int64_t gathers_ = 0;
};

}  // namespace tetra
