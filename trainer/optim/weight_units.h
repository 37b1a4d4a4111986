// ZeRO-3's weights: the compute weights sharded over data parallelism like the optimizer state,
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
// always hold it; the gathers per step follow from the phase order alone (gathers_for).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "trainer/params/grad_sink.h"
#include "trainer/params/param_layout.h"

namespace tetra {

class Communicator;

class WeightUnits final : public WeightSource {
 public:
  // `shard`: this rank's compute shard (the owned ranges of one bucket per group, back to back;
  // `type` elements), owned by the caller and rewritten by the optimizer between steps.
  WeightUnits(const ParamLayout& layout, Backend& be, Communicator& dp, const void* shard, DType type);

  void require(const std::vector<int>& groups) override;
  const void* at(int64_t offset) override;
  // Every buffer is stale: the optimizer changed the shards, or an evaluation begins. Called at
  // the start of every step's forwards and of every evaluation, so that each starts empty.
  void release_all();
  int64_t gathers() const { return gathers_; }  // since construction

  // Bytes of the two unit buffers for `layout` in `type`.
  static size_t buffer_bytes(const ParamLayout& layout, DType type);
  // The gathers of each group (added to `out`, one entry per group) of running `phases` in order
  // from empty buffers, exactly as require() would: the communication prediction's count.
  static void count_gathers(const std::vector<std::vector<int>>& phases, std::vector<int64_t>& out);

 private:
  int group_of(int64_t offset) const;

  const ParamLayout& layout_;
  Backend& be_;
  Communicator& dp_;
  const char* shard_;
  DType type_;
  size_t es_;
  BackendBuffer bufs_[2];
  int resident_[2] = {-1, -1};  // the group each buffer holds
  int64_t used_[2] = {0, 0};    // when each was last required
  int64_t clock_ = 0;
  int64_t gathers_ = 0;
};

}  // namespace tetra
