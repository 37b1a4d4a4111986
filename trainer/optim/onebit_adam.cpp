#include "trainer/optim/onebit_adam.h"

#include <algorithm>

#include <fmt/format.h>

#include "trainer/core/check.h"
#include "trainer/dist/communicator.h"
#include "trainer/dist/process_groups.h"
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
  dense_ = std::make_unique<CompressedExchange>(cfg, grads.dense_layout(), be, grads.dense(), groups.dp.get(),
                                                fmt::format("dp{}of{}", dp_rank, dp), 0);
  if (grads.experts())
    experts_ = std::make_unique<CompressedExchange>(
        cfg, grads.expert_layout(), be, *grads.experts(), groups.edp.get(),
        fmt::format("edp{}of{}_ep{}", groups.edp->rank(), groups.edp->size(), cfg.parallel.ep), 1);
  TETRA_CHECK(dense_->momentum() == !sharded_, "the exchange yields the {} but the optimizer state is {}",
              dense_->momentum() ? "momentum" : "gradient", sharded_ ? "sharded" : "whole");
  if (sharded_) v_full_ = static_cast<float*>(be_.alloc(static_cast<size_t>(total_) * 4));
}

OnebitAdam::~OnebitAdam() {
  if (v_full_) be_.free(v_full_);
}

void OnebitAdam::step(float* master, float* grads, double lr, void* compute, DType compute_type) {
  TETRA_CHECK(active_, "OnebitAdam::step without a data-parallel group");
  if (sharded_ && !v_full_ready_) {  // every rank needs every coordinate's denominator
    int64_t at = 0;
    for (const GradRange& r : grad_buffers_.owned()) {
      std::copy(adam_.exp_avg_sq() + at, adam_.exp_avg_sq() + at + r.numel, v_full_ + r.offset);
      at += r.numel;
    }
    grad_buffers_.gather_params(v_full_, DType::F32);
    v_full_ready_ = true;
  }
  const float* v = sharded_ ? v_full_ : adam_.exp_avg_sq();
  const float* m = sharded_ ? nullptr : adam_.exp_avg();
  dense_->exchange(grads, m, v, 0);
  if (experts_) experts_->exchange(grads, m, v, 0);
  adam_.step_frozen_variance(master, grads, lr, warmup_, /*momentum_given=*/!sharded_, compute, compute_type);
}

std::vector<CheckpointExtra> OnebitAdam::checkpoint_state() {
  std::vector<CheckpointExtra> out;
  if (dense_) dense_->checkpoint_state(out);
  if (experts_) experts_->checkpoint_state(out);
  return out;
}

}  // namespace tetra
