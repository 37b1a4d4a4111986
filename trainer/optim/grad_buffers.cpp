#include "trainer/optim/grad_buffers.h"

#include <cmath>

#include "trainer/comm/process_groups.h"

namespace tetra {

ParamLayout layout_part(const ParamLayout& layout, bool experts) {
  ParamLayout part = layout;
  const int first = experts ? layout.dense_groups : 0;
  const int end = experts ? static_cast<int>(layout.groups.size()) : layout.dense_groups;
  part.groups.assign(layout.groups.begin() + first, layout.groups.begin() + end);
  part.params.clear();
  for (const ParamSpec& p : layout.params)
    if (p.group >= first && p.group < end) {
      part.params.push_back(p);
      part.params.back().group -= first;
    }
  part.dense_groups = experts ? 0 : end;
  return part;
}

GradBuffers::GradBuffers(const ParamLayout& layout, Backend& be, float* grads, ProcessGroups& groups,
                         bool distributed_optimizer, int64_t bucket_size, bool bf16_wire)
    : dense_layout_(layout_part(layout, false)),
      expert_layout_(layout_part(layout, true)),
      dense_groups_(layout.dense_groups) {
  // Every collective here is on backend memory (the gradients, the norms' scratch scalars).
  Communicator* tp = &groups.backend(GroupKind::TP);
  Communicator* dp = &groups.backend(GroupKind::DP);
  dense_ = std::make_unique<GradBuffer>(dense_layout_, be, grads, dp, tp, distributed_optimizer, bucket_size,
                                        bf16_wire);
  owned_ = dense_->owned();
  const bool sharded = dense_->sharded();
  // The pipeline stages' parts of the norm are summed once, over both kinds (norm()): a stage
  // without MoE blocks has no expert part, so each part cannot reduce over pp on its own.
  dense_norm_ = std::make_unique<GradNorm>(layout, dense_->owned(), be, tp, nullptr, sharded ? dp : nullptr);
  if (groups.pp->size() > 1) {
    pp_ = &groups.backend(GroupKind::PP);
    be_ = &be;
    scratch_buf_ = BackendBuffer(be, 64);
    scratch_ = scratch_buf_.as<float>();
  }
  if (!expert_layout_.groups.empty()) {
    experts_ = std::make_unique<GradBuffer>(expert_layout_, be, grads, &groups.backend(GroupKind::EDP), tp,
                                            distributed_optimizer, bucket_size);
    owned_.insert(owned_.end(), experts_->owned().begin(), experts_->owned().end());
    // Each EP rank holds other experts, and with the distributed optimizer each expert-DP rank
    // other shards of them: the DP group (ep x edp ranks) then holds every expert shard once.
    expert_norm_ = std::make_unique<GradNorm>(layout, experts_->owned(), be, tp, nullptr,
                                              experts_->sharded() ? dp : &groups.backend(GroupKind::EP));
  }
}

GradBuffers::~GradBuffers() = default;

void GradBuffers::group_done(int group) {
  if (group < dense_groups_)
    dense_->group_done(group);
  else
    experts_->group_done(group - dense_groups_);
}

void GradBuffers::finish() {
  dense_->finish();
  if (experts_) experts_->finish();
}

void GradBuffers::gather_params(void* params, DType type) {
  dense_->gather_params(params, type);
  if (experts_) experts_->gather_params(params, type);
}

double GradBuffers::norm(const float* grads, double dense_scale, double expert_scale) {
  const double d = dense_scale * dense_norm_->compute(grads);
  const double e = expert_norm_ ? expert_scale * expert_norm_->compute(grads) : 0.0;
  float sq = static_cast<float>(d * d + e * e);
  if (pp_) {  // each pipeline stage holds other parameters
    be_->copy_from_host(scratch_, &sq, sizeof(float));
    pp_->all_reduce(scratch_, 1, DType::F32, ReduceOp::SUM);
    be_->copy_to_host(&sq, scratch_, sizeof(float));
  }
  return std::sqrt(static_cast<double>(sq));
}

}  // namespace tetra
