#include "trainer/optim/onebit_adam.h"

#include <fmt/format.h>

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"
#include "trainer/comm/process_groups.h"
#include "trainer/optim/grad_buffers.h"

namespace tetra {

OnebitAdam::OnebitAdam(const Config& cfg, const ParamLayout& layout, Backend& be, GradBuffers& grads, AdamW& adam,
                       ProcessGroups& groups)
    : grad_buffers_(grads),
      adam_(adam),
      active_(groups.dp && groups.dp->size() > 1),
      warmup_(cfg.parallel.onebit_warmup_steps),
      total_(layout.total),
      sharded_(grads.sharded()),
      be_(be) {
  if (!active_) return;
  // Plain: the optimizer's compact state must be the whole buffer in order (x is formed from m).
  TETRA_CHECK(sharded_ || adam_.state_numel() == total_, "the optimizer holds {} of {} elements",
              adam_.state_numel(), total_);
  const int64_t dp = groups.dp->size(), dp_rank = groups.dp->rank();
  // The exchanges run on host memory: the host-memory communicators.
  Communicator& edp = groups.get(GroupKind::EDP);
  dense_ = std::make_unique<CompressedExchange>(cfg, grads.dense_layout(), grads.dense(), &groups.get(GroupKind::DP),
                                                fmt::format("dp{}of{}", dp_rank, dp), 0);
  if (grads.experts())
    experts_ = std::make_unique<CompressedExchange>(
        cfg, grads.expert_layout(), *grads.experts(), &edp,
        fmt::format("edp{}of{}_ep{}", edp.rank(), edp.size(), cfg.parallel.ep), 1);
  TETRA_CHECK(dense_->momentum() == !sharded_, "the exchange yields the {} but the optimizer state is {}",
              dense_->momentum() ? "momentum" : "gradient", sharded_ ? "sharded" : "whole");
  if (sharded_) {
    v_full_buf_ = BackendBuffer(be_, static_cast<size_t>(total_) * 4);
    v_full_ = v_full_buf_.as<float>();
  }
  if (!be_.host_memory()) {
    host_grads_.resize(static_cast<size_t>(total_));
    host_v_.resize(static_cast<size_t>(total_));
    if (!sharded_) host_m_.resize(static_cast<size_t>(total_));
  }
}

OnebitAdam::~OnebitAdam() = default;

float* OnebitAdam::host_view(const float* buf, std::vector<float>& staging) {
  if (be_.host_memory()) return const_cast<float*>(buf);
  be_.copy_to_host(staging.data(), buf, static_cast<size_t>(total_) * 4);
  return staging.data();
}

void OnebitAdam::step(float* master, float* grads, double lr, void* compute, DType compute_type) {
  TETRA_CHECK(active_, "OnebitAdam::step without a data-parallel group");
  if (!v_host_) {  // the frozen variance, once per process
    if (sharded_)  // every rank needs every coordinate's denominator
      grad_buffers_.gather_compact(v_full_, adam_.exp_avg_sq(), DType::F32);
    v_host_ = host_view(sharded_ ? v_full_ : adam_.exp_avg_sq(), host_v_);
  }
  // The exchanges read and write host views; the result goes back before the optimizer reads it.
  float* g = host_view(grads, host_grads_);
  const float* m = sharded_ ? nullptr : host_view(adam_.exp_avg(), host_m_);
  dense_->exchange(g, m, v_host_, 0);
  if (experts_) experts_->exchange(g, m, v_host_, 0);
  if (g != grads) be_.copy_from_host(grads, g, static_cast<size_t>(total_) * 4);
  adam_.step_frozen_variance(master, grads, lr, warmup_, /*momentum_given=*/!sharded_, compute, compute_type);
}

std::vector<CheckpointExtra> OnebitAdam::checkpoint_state() {
  std::vector<CheckpointExtra> out;
  if (dense_) dense_->checkpoint_state(out);
  if (experts_) experts_->checkpoint_state(out);
  return out;
}

}  // namespace tetra
