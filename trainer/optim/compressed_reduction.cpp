#include "trainer/optim/compressed_reduction.h"

#include <fmt/format.h>

#include "trainer/comm/communicator.h"
#include "trainer/comm/process_groups.h"
#include "trainer/optim/grad_buffers.h"

namespace tetra {

CompressedReduction::CompressedReduction(const Config& cfg, Backend& be, GradBuffers& grads, ProcessGroups& groups)
    : be_(be), total_(grads.dense_layout().total) {
  // The exchanges run on host memory: the host-memory communicators.
  Communicator& dp = groups.get(GroupKind::DP);
  Communicator& edp = groups.get(GroupKind::EDP);
  dense_ = std::make_unique<CompressedExchange>(cfg, grads.dense_layout(), grads.dense(), &dp,
                                                fmt::format("dp{}of{}", dp.rank(), dp.size()), 0);
  if (grads.experts())
    experts_ = std::make_unique<CompressedExchange>(cfg, grads.expert_layout(), *grads.experts(), &edp,
                                                    fmt::format("edp{}of{}_ep{}", edp.rank(), edp.size(),
                                                                cfg.parallel.ep),
                                                    1);
  if (!be_.host_memory()) host_grads_.resize(static_cast<size_t>(total_));
}

void CompressedReduction::reduce(float* grads, int64_t step) {
  float* g = grads;
  if (!be_.host_memory()) {
    be_.copy_to_host(host_grads_.data(), grads, static_cast<size_t>(total_) * 4);
    g = host_grads_.data();
  }
  dense_->exchange(g, nullptr, nullptr, step);
  if (experts_) experts_->exchange(g, nullptr, nullptr, step);
  if (g != grads) be_.copy_from_host(grads, g, static_cast<size_t>(total_) * 4);
}

std::vector<CheckpointExtra> CompressedReduction::checkpoint_state() {
  std::vector<CheckpointExtra> out;
  dense_->checkpoint_state(out);
  if (experts_) experts_->checkpoint_state(out);
  return out;
}

}  // namespace tetra
