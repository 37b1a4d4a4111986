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

// `dev`'s n floats (backend memory) for the host loops: `dev` itself where backend memory is host
// memory, else `staging` (sized at construction) after a copy.
float* host_view(Backend& be, const float* dev, std::vector<float>& staging, int64_t n) {
  if (be.host_memory()) return const_cast<float*>(dev);
  be.copy_to_host(staging.data(), dev, static_cast<size_t>(n) * 4);
  return staging.data();
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
  // The compression's own buffers are host memory, zeroed, carved from two allocations: the
  // replicated sums, the worker error, the server error (plain), the average; the 1-bit messages.
  const size_t words = static_cast<size_t>(plan_.dp * plan_.words);
  const int64_t server = sharded_ ? 0 : mine_numel_;
  host_f32_.assign(static_cast<size_t>(replicated_numel_ + total_ + server + mine_numel_), 0.0f);
  float* at = host_f32_.data();
  if (replicated_numel_ > 0) replicated_sum_ = at;
  at += replicated_numel_;
  worker_error_ = at;
  at += total_;
  if (!sharded_) server_error_ = at;
  avg_ = at + server;
  host_u16_.assign(2 * words, 0);
  send_ = host_u16_.data();
  recv_ = send_ + words;
  if (sharded_) v_full_ = static_cast<float*>(be_.alloc(static_cast<size_t>(total_) * 4));
  if (!be_.host_memory()) {  // staging for the host views of the gradient, m and v
    host_grads_.resize(static_cast<size_t>(total_));
    host_v_.resize(static_cast<size_t>(total_));
    if (!sharded_) host_m_.resize(static_cast<size_t>(total_));
  }
}

OnebitAdam::~OnebitAdam() {
  if (v_full_) be_.free(v_full_);
}

void OnebitAdam::step(float* master, float* grads_dev, double lr, void* compute, DType compute_type) {
  TETRA_CHECK(dp_, "OnebitAdam::step without a data-parallel group");
  const int64_t p = dp_->size();
  if (sharded_ && !v_full_ready_) {  // every rank needs every coordinate's denominator
    int64_t at = 0;
    for (const GradRange& r : mine_) {
      be_.copy(v_full_ + r.offset, adam_.exp_avg_sq() + at, static_cast<size_t>(r.numel) * 4);
      at += r.numel;
    }
    grad_buffer_.gather_params(v_full_, DType::F32);
    host_view(be_, v_full_, host_v_, total_);  // frozen from now on: one copy serves
    v_full_ready_ = true;
  }
  // The host loops below read and write host views of the backend buffers (host_view); the
  // gradient goes back before the optimizer reads it.
  float* grads = host_view(be_, grads_dev, host_grads_, total_);
  // Adam's frozen denominator d = sqrt(v / (1 - beta2^W)) + eps, as math::adamw_update forms it.
  const float bc2 = static_cast<float>(1.0 - std::pow(cfg_.optimizer.beta2, static_cast<double>(warmup_)));
  const float eps = static_cast<float>(cfg_.optimizer.eps);
  const float* v = sharded_ ? (be_.host_memory() ? v_full_ : host_v_.data())
                            : host_view(be_, adam_.exp_avg_sq(), host_v_, total_);
  auto denom = [&](int64_t k) { return std::sqrt(v[k] / bc2) + eps; };
  // x_i: the momentum estimate (plain) or dp times the local gradient (sharded), padding zero.
  if (sharded_) {
    const float s = static_cast<float>(p);
    for (int64_t k = 0; k < total_; ++k) grads[k] *= s;
  } else {
    const float b1 = static_cast<float>(cfg_.optimizer.beta1);
    const float c = (1.0f - b1) * static_cast<float>(p);
    const float* m = host_view(be_, adam_.exp_avg(), host_m_, total_);
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
    if (grads != grads_dev) be_.copy_from_host(grads_dev, grads, static_cast<size_t>(total_) * 4);
    adam_.step_frozen_variance(master, grads_dev, lr, warmup_, /*momentum_given=*/false, compute, compute_type);
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
  if (grads != grads_dev) be_.copy_from_host(grads_dev, grads, static_cast<size_t>(total_) * 4);
  adam_.step_frozen_variance(master, grads_dev, lr, warmup_, /*momentum_given=*/true, compute, compute_type);
}

std::vector<CheckpointExtra> OnebitAdam::checkpoint_state() {
  std::vector<CheckpointExtra> out;
  if (!dp_) return out;
  CheckpointExtra w;
  w.kind = fmt::format("optim/onebit_worker_error/dp{}of{}{}", dp_->rank(), dp_->size(), sharded_ ? "_sharded" : "");
  w.data = worker_error_;
  w.ranges = {GradRange{0, total_}};
  w.host = true;
  out.push_back(std::move(w));
  if (server_error_) {
    CheckpointExtra s;
    s.kind = "optim/onebit_server_error";
    s.data = server_error_;
    s.ranges = mine_;
    s.host = true;
    out.push_back(std::move(s));
  }
  return out;
}

}  // namespace tetra
