#include "trainer/optim/onebit_adam.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "trainer/core/check.h"
#include "trainer/dist/communicator.h"

namespace tetra {

namespace {

// The elements of `layout` that are not compressed: its padding (no parameter) and the `exact`
// ranges (sorted buffer ranges).
std::vector<GradRange> excluded_ranges(const ParamLayout& layout, const std::vector<GradRange>& exact) {
  std::vector<GradRange> out;
  auto add = [&](int64_t b, int64_t e) {
    if (b >= e) return;
    if (!out.empty() && out.back().offset + out.back().numel == b)
      out.back().numel += e - b;
    else
      out.push_back(GradRange{b, e - b});
  };
  int64_t at = 0;
  size_t x = 0;
  for (const ParamSpec& p : layout.params) {
    add(at, p.offset);
    if (x < exact.size() && exact[x].offset == p.offset) add(p.offset, p.offset + exact[x++].numel);
    at = std::max(at, p.offset + p.numel);
  }
  add(at, layout.total);
  return out;
}

// `excluded` (buffer ranges) as ranges of the compact buffer that holds `ranges` back to back.
std::vector<GradRange> compact_within(const std::vector<GradRange>& excluded, const std::vector<GradRange>& ranges) {
  const std::vector<GradRange>& padding = excluded;
  std::vector<GradRange> out;
  int64_t compact = 0;
  for (const GradRange& r : ranges) {
    for (const GradRange& q : padding) {
      const int64_t b = std::max(r.offset, q.offset), e = std::min(r.offset + r.numel, q.offset + q.numel);
      if (b < e) out.push_back(GradRange{compact + b - r.offset, e - b});
    }
    compact += r.numel;
  }
  return out;
}

void zero_ranges(float* buf, const std::vector<GradRange>& ranges) {
  for (const GradRange& r : ranges) std::fill(buf + r.offset, buf + r.offset + r.numel, 0.0f);
}

}  // namespace

std::vector<GradRange> onebit_exact_ranges(const Config& cfg, const ParamLayout& layout) {
  const bool tied_across_stages = cfg.model.tie_embeddings && cfg.parallel.pp > 1;
  std::vector<GradRange> out;
  for (const ParamSpec& p : layout.params)
    if ((cfg.parallel.tp > 1 && !p.tp_split) || (tied_across_stages && p.name == "embedding.wte"))
      out.push_back(GradRange{p.offset, p.numel});
  return out;
}

OnebitAdam::OnebitAdam(const Config& cfg, const ParamLayout& layout, Backend& be, GradBuffer& grads, AdamW& adam,
                       Communicator* dp)
    : cfg_(cfg),
      be_(be),
      grad_buffer_(grads),
      adam_(adam),
      dp_(dp && dp->size() > 1 ? dp : nullptr),
      warmup_(cfg.parallel.onebit_warmup_steps),
      total_(layout.total),
      sharded_(grads.sharded()) {
  if (!dp_) return;
  TETRA_CHECK(be_.host_memory(), "1-bit compression runs on host memory; backend {} is not", be_.name());
  plan_ = plan_chunks(layout, cfg.parallel.bucket_size, dp_->size());
  mine_ = plan_.owned(dp_->rank());
  for (const GradRange& r : mine_) mine_numel_ += r.numel;
  if (sharded_) {
    TETRA_CHECK(grads.owned().size() == mine_.size(), "the optimizer owns {} ranges, the 1-bit plan {}",
                grads.owned().size(), mine_.size());
    for (size_t i = 0; i < mine_.size(); ++i)
      TETRA_CHECK(grads.owned()[i].offset == mine_[i].offset && grads.owned()[i].numel == mine_[i].numel,
                  "the optimizer's shard {} [{}, +{}) is not the 1-bit plan's [{}, +{})", i, grads.owned()[i].offset,
                  grads.owned()[i].numel, mine_[i].offset, mine_[i].numel);
  } else {
    // The optimizer's compact momentum must be the whole buffer in order: x is formed from it.
    int64_t at = 0;
    for (const GradRange& r : grads.owned()) {
      TETRA_CHECK(r.offset == at, "the optimizer's ranges are not the whole buffer in order (range at {}, expected {})",
                  r.offset, at);
      at += r.numel;
    }
    TETRA_CHECK(at == total_ && adam_.state_numel() == total_, "the optimizer holds {} of {} elements", at, total_);
  }
  // Replicated parameters (TP replicas, a tied embedding across stages): averaged exactly.
  replicated_ = onebit_exact_ranges(cfg, layout);
  for (const GradRange& r : replicated_) replicated_numel_ += r.numel;
  excluded_full_ = excluded_ranges(layout, replicated_);
  excluded_mine_ = compact_within(excluded_full_, mine_);
  if (replicated_numel_ > 0)
    replicated_sum_ = static_cast<float*>(be_.alloc(static_cast<size_t>(replicated_numel_) * 4));
  const size_t words = static_cast<size_t>(plan_.dp * plan_.words);
  worker_error_ = static_cast<float*>(be_.alloc(static_cast<size_t>(total_) * 4));
  be_.memset_zero(worker_error_, static_cast<size_t>(total_) * 4);
  if (!sharded_) {
    server_error_ = static_cast<float*>(be_.alloc(static_cast<size_t>(mine_numel_) * 4));
    be_.memset_zero(server_error_, static_cast<size_t>(mine_numel_) * 4);
  }
  avg_ = static_cast<float*>(be_.alloc(static_cast<size_t>(mine_numel_) * 4));
  if (sharded_) v_full_ = static_cast<float*>(be_.alloc(static_cast<size_t>(total_) * 4));
  send_ = static_cast<uint16_t*>(be_.alloc(words * 2));
  recv_ = static_cast<uint16_t*>(be_.alloc(words * 2));
}

OnebitAdam::~OnebitAdam() {
  for (void* p : {static_cast<void*>(worker_error_), static_cast<void*>(server_error_), static_cast<void*>(avg_),
                  static_cast<void*>(send_), static_cast<void*>(recv_), static_cast<void*>(replicated_sum_),
                  static_cast<void*>(v_full_)})
    if (p) be_.free(p);
}

void OnebitAdam::step(float* master, float* grads, double lr, void* compute, DType compute_type) {
  TETRA_CHECK(dp_, "OnebitAdam::step without a data-parallel group");
  const int64_t p = dp_->size();
  if (sharded_ && !v_full_ready_) {  // every rank needs every coordinate's denominator
    int64_t at = 0;
    for (const GradRange& r : mine_) {
      std::copy(adam_.exp_avg_sq() + at, adam_.exp_avg_sq() + at + r.numel, v_full_ + r.offset);
      at += r.numel;
    }
    grad_buffer_.gather_params(v_full_, DType::F32);
    v_full_ready_ = true;
  }
  // Adam's frozen denominator d = sqrt(v / (1 - beta2^W)) + eps, as math::adamw_update forms it.
  const float bc2 = static_cast<float>(1.0 - std::pow(cfg_.optimizer.beta2, static_cast<double>(warmup_)));
  const float eps = static_cast<float>(cfg_.optimizer.eps);
  const float* v = sharded_ ? v_full_ : adam_.exp_avg_sq();
  auto denom = [&](int64_t k) { return std::sqrt(v[k] / bc2) + eps; };
  // x_i: the momentum estimate (plain) or dp times the local gradient (sharded), padding zero.
  if (sharded_) {
    const float s = static_cast<float>(p);
    for (int64_t k = 0; k < total_; ++k) grads[k] *= s;
  } else {
    const float b1 = static_cast<float>(cfg_.optimizer.beta1);
    const float c = (1.0f - b1) * static_cast<float>(p);
    const float* m = adam_.exp_avg();
    for (int64_t k = 0; k < total_; ++k) grads[k] = b1 * m[k] + c * grads[k];
  }
  // Replicated parameters: the exact mean of x_i, all-reduced in fp32.
  int64_t at = 0;
  for (const GradRange& r : replicated_) {
    std::copy(grads + r.offset, grads + r.offset + r.numel, replicated_sum_ + at);
    at += r.numel;
  }
  if (replicated_numel_ > 0) dp_->all_reduce(replicated_sum_, replicated_numel_, DType::F32, ReduceOp::SUM);
  const float inv_p = 1.0f / static_cast<float>(p);
  auto put_replicated = [&] {
    int64_t k = 0;
    for (const GradRange& r : replicated_)
      for (int64_t i = 0; i < r.numel; ++i) grads[r.offset + i] = replicated_sum_[k++] * inv_p;
  };
  for (int64_t k = 0; k < total_; ++k) grads[k] /= denom(k);  // y_i = x_i / d
  zero_ranges(grads, excluded_full_);

  // Worker stage: compressed shards to their owners (a compressed reduce-scatter).
  onebit_worker_compress(plan_, grads, worker_error_, send_);
  zero_ranges(worker_error_, excluded_full_);
  std::vector<int64_t> counts(static_cast<size_t>(p), plan_.words), offsets(static_cast<size_t>(p));
  for (int64_t r = 0; r < p; ++r) offsets[static_cast<size_t>(r)] = r * plan_.words;
  dp_->all_to_all_v(send_, counts, offsets, recv_, counts, offsets, DType::BF16);
  onebit_server_average(plan_, recv_, avg_);
  zero_ranges(avg_, excluded_mine_);

  if (sharded_) {
    // The owner's gradient estimate, into its shards of the buffer; m and p updated there.
    at = 0;
    for (const GradRange& r : mine_) {  // back from y units: the gradient estimate
      for (int64_t i = 0; i < r.numel; ++i) grads[r.offset + i] = avg_[at + i] * denom(r.offset + i);
      at += r.numel;
    }
    put_replicated();
    adam_.step_frozen_variance(master, grads, lr, warmup_, /*momentum_given=*/false, compute, compute_type);
    return;
  }
  // Server stage: the averaged momentum, compressed again with the server error, to every rank.
  onebit_server_compress(plan_, avg_, server_error_, send_);
  zero_ranges(server_error_, excluded_mine_);
  dp_->all_gather(recv_, send_, plan_.words, DType::BF16);
  onebit_gather_decompress(plan_, recv_, grads);
  for (int64_t k = 0; k < total_; ++k) grads[k] *= denom(k);  // m = d * decompressed y
  zero_ranges(grads, excluded_full_);
  put_replicated();
  adam_.step_frozen_variance(master, grads, lr, warmup_, /*momentum_given=*/true, compute, compute_type);
}

std::vector<CheckpointExtra> OnebitAdam::checkpoint_state() {
  std::vector<CheckpointExtra> out;
  if (!dp_) return out;
  CheckpointExtra w;
  w.kind = fmt::format("optim/onebit_worker_error/dp{}of{}{}", dp_->rank(), dp_->size(), sharded_ ? "_sharded" : "");
  w.data = worker_error_;
  w.ranges = {GradRange{0, total_}};
  out.push_back(std::move(w));
  if (server_error_) {
    CheckpointExtra s;
    s.kind = "optim/onebit_server_error";
    s.data = server_error_;
    s.ranges = mine_;
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace tetra
