#include "trainer/optim/compressed_reduction.h"

#include <fmt/format.h>

#include "trainer/dist/communicator.h"
#include "trainer/dist/process_groups.h"
#include "trainer/optim/grad_buffers.h"

namespace tetra {

CompressedReduction::CompressedReduction(const Config& cfg, Backend& be, GradBuffers& grads, ProcessGroups& groups) {
  dense_ = std::make_unique<CompressedExchange>(cfg, grads.dense_layout(), be, grads.dense(), groups.dp.get(),
                                                fmt::format("dp{}of{}", groups.dp->rank(), groups.dp->size()), 0);
  if (grads.experts())
    experts_ = std::make_unique<CompressedExchange>(
        cfg, grads.expert_layout(), be, *grads.experts(), groups.edp.get(),
        fmt::format("edp{}of{}_ep{}", groups.edp->rank(), groups.edp->size(), cfg.parallel.ep), 1);
}

void CompressedReduction::reduce(float* grads, int64_t step) {
  dense_->exchange(grads, nullptr, nullptr, step);
  if (experts_) experts_->exchange(grads, nullptr, nullptr, step);
}

std::vector<CheckpointExtra> CompressedReduction::checkpoint_state() {
  std::vector<CheckpointExtra> out;
  dense_->checkpoint_state(out);
  if (experts_) experts_->checkpoint_state(out);
  return out;
}

}  // namespace tetra
