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
                         bool distributed_optimizer, int64_t bucket_size, bool bf16_wire, bool shard_gradients,
                         bool tied_embeddings)
    : dense_layout_(layout_part(layout, false)),
      expert_layout_(layout_part(layout, true)),
      dense_groups_(layout.dense_groups),
      be_(&be) {
  // Every collective here is on backend memory (the gradients, the norms' scratch scalars).
  Communicator* tp = &groups.backend(GroupKind::TP);
  Communicator* dp = &groups.backend(GroupKind::DP);
  Communicator* edp = &groups.backend(GroupKind::EDP);
  const bool has_experts = !expert_layout_.groups.empty();
  // ZeRO-2 needs a shard to hold: dp > 1 with the distributed optimizer (then expert-DP holds its
  // shards too, or, at edp 1, the whole expert gradient, which is then its "shard").
  const bool zero2 = shard_gradients && distributed_optimizer && dp->size() > 1;
  if (zero2) {
    // The owned ranges of both buffers decide the compact layout: build them first, then the shard.
    const auto owned_of = [&](const ParamLayout& part, Communicator* c) {  // GradBuffer::owned_numel()
      const int64_t span = part.groups.back().second - part.groups.front().first;
      return c->size() > 1 ? span / c->size() : span;
    };
    const int64_t n = owned_of(dense_layout_, dp) + (has_experts ? owned_of(expert_layout_, edp) : 0);
    shard_buf_ = BackendBuffer(be, static_cast<size_t>(std::max<int64_t>(n, 1)) * 4);
    shard_ = shard_buf_.as<float>();
    be.memset_zero(shard_, static_cast<size_t>(n) * 4);
  }
  dense_ = std::make_unique<GradBuffer>(dense_layout_, be, grads, dp, tp, distributed_optimizer, bucket_size,
                                        bf16_wire, shard_, tied_embeddings);
  owned_ = dense_->owned();
  const bool sharded = dense_->sharded();
  const int64_t dense_owned = dense_->owned_numel();
  // The pipeline stages' parts of the norm are summed once, over both kinds (norm()): a stage
  // without MoE blocks has no expert part, so each part cannot reduce over pp on its own.
  dense_norm_ = std::make_unique<GradNorm>(layout, dense_->owned(), be, tp, nullptr, sharded ? dp : nullptr,
                                           shard_ ? 0 : -1);
  if (groups.pp->size() > 1) pp_ = &groups.backend(GroupKind::PP);
  if (has_experts) {
    expert_begin_ = expert_layout_.groups.front().first;
    // At edp 1 the expert buffer is not sharded: its shard is then its whole gradient, in shard_.
    experts_ = std::make_unique<GradBuffer>(expert_layout_, be, grads, edp, tp, distributed_optimizer, bucket_size,
                                            false, shard_ ? shard_ + dense_owned : nullptr);
    owned_.insert(owned_.end(), experts_->owned().begin(), experts_->owned().end());
    // Each EP rank holds other experts, and with the distributed optimizer each expert-DP rank
    // other shards of them: the DP group (ep x edp ranks) then holds every expert shard once.
    // Folded experts (rank_grid.h): the ETP ranks hold an expert's slices, the EP ranks other
    // experts and the expert-DP ranks other shards: the sum goes over each of those groups.
    const GridSizes& grid = groups.grid.sizes();
    if (grid.expert_tp() < grid.tp)
      expert_norm_ = std::make_unique<GradNorm>(layout, experts_->owned(), be, &groups.backend(GroupKind::ETP),
                                                &groups.backend(GroupKind::EP), experts_->sharded() ? edp : nullptr,
                                                shard_ ? dense_owned : -1);
    else
      expert_norm_ = std::make_unique<GradNorm>(layout, experts_->owned(), be, tp, nullptr,
                                                experts_->sharded() ? dp : &groups.backend(GroupKind::EP),
                                                shard_ ? dense_owned : -1);
  }
}

GradBuffers::~GradBuffers() = default;

int64_t GradBuffers::owned_numel() const {
  return dense_->owned_numel() + (experts_ ? experts_->owned_numel() : 0);
}

float* GradBuffers::at(int64_t offset) {
  if (experts_ && offset >= expert_begin_) return experts_->at(offset);
  return dense_->at(offset);
}

size_t GradBuffers::staging_bytes() const {
  return dense_->staging_bytes() + (experts_ ? experts_->staging_bytes() : 0);
}

void GradBuffers::group_done(int group, int micro_batches) {
  if (group < dense_groups_)
    dense_->group_done(group, micro_batches);
  else
    experts_->group_done(group - dense_groups_, micro_batches);
}

void GradBuffers::finish() {
  dense_->finish();
  if (experts_) experts_->finish();
}

void GradBuffers::gather_params(void* params, DType type) {
  dense_->gather_params(params, type);
  if (experts_) experts_->gather_params(params, type);
}

size_t GradBuffers::buckets() const { return dense_->num_buckets() + (experts_ ? experts_->num_buckets() : 0); }

std::pair<int64_t, int64_t> GradBuffers::bucket_range(size_t i) const {
  if (i < dense_->num_buckets()) return dense_->bucket_range(i);
  return experts_->bucket_range(i - dense_->num_buckets());
}

void GradBuffers::gather_bucket(size_t i, const float* compact, float* out) {
  if (i < dense_->num_buckets()) return dense_->gather_bucket(i, compact, out);
  experts_->gather_bucket(i - dense_->num_buckets(), compact + dense_->owned_numel(), out);
}

void GradBuffers::gather_compact(void* whole, const void* compact, DType type) {
  const size_t es = dtype_size(type);
  int64_t at = 0;
  for (const GradRange& o : owned_) {
    be_->copy(static_cast<char*>(whole) + static_cast<size_t>(o.offset) * es,
              static_cast<const char*>(compact) + static_cast<size_t>(at) * es, static_cast<size_t>(o.numel) * es);
    at += o.numel;
  }
  gather_params(whole, type);
}

void GradBuffers::norm_squares(const float* grads, float* out) {
  dense_norm_->squares(grads, out);
  if (expert_norm_) expert_norm_->squares(grads, out + 1);
  else be_->memset_zero(out + 1, sizeof(float));
  // Each stage holds other parameters; a stage without MoE blocks adds 0 to the expert part.
  if (pp_) pp_->all_reduce(out, 2, DType::F32, ReduceOp::SUM);
}

double GradBuffers::norm_from_squares(const float squares[2], double dense_scale, double expert_scale) const {
  const double d = dense_scale * std::sqrt(static_cast<double>(squares[0]));
  const double e = expert_scale * std::sqrt(static_cast<double>(squares[1]));
  return std::sqrt(static_cast<double>(static_cast<float>(d * d + e * e)));
}


}  // namespace tetra
