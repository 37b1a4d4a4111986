#include "trainer/optim/adamw.h"

#include <algorithm>
#include <cmath>

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"

namespace tetra {

namespace {

// Appends [offset, offset + numel) to `ranges`, merging with the last range when adjacent.
void append_merged(std::vector<GradRange>& ranges, int64_t offset, int64_t numel) {
  if (numel <= 0) return;
  if (!ranges.empty() && ranges.back().offset + ranges.back().numel == offset)
    ranges.back().numel += numel;
  else
    ranges.push_back(GradRange{offset, numel});
}

}  // namespace

AdamW::AdamW(const OptimizerConfig& cfg, const ParamLayout& layout, Backend& be,
             const std::vector<GradRange>& owned, bool own_master, const float* initial_master,
             bool compact_grads)
    : cfg_(cfg), be_(be), compact_grads_(compact_grads) {
  // Weight-decay runs over the whole buffer (padding joins the run before it).
  struct Span {
    int64_t begin, end;
    bool decay;
  };
  std::vector<Span> spans;
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const ParamSpec& p = layout.params[i];
    const int64_t end = i + 1 < layout.params.size() ? layout.params[i + 1].offset : layout.total;
    if (!spans.empty() && spans.back().decay == p.weight_decay)
      spans.back().end = end;
    else
      spans.push_back(Span{p.offset, end, p.weight_decay});
  }
  if (!spans.empty()) spans.front().begin = 0;
  // Intersect with the owned ranges (both sorted).
  for (const GradRange& o : owned) {
    for (const Span& s : spans) {
      const int64_t b = std::max(s.begin, o.offset), e = std::min(s.end, o.offset + o.numel);
      if (b >= e) continue;
      runs_.push_back(Run{b, e - b, state_numel_ + (b - o.offset), s.decay});
    }
    state_numel_ += o.numel;
  }
  const size_t bytes = static_cast<size_t>(state_numel_) * sizeof(float);
  m_buf_ = BackendBuffer(be_, bytes);
  v_buf_ = BackendBuffer(be_, bytes);
  m_ = m_buf_.as<float>();
  v_ = v_buf_.as<float>();
  be_.memset_zero(m_, bytes);
  be_.memset_zero(v_, bytes);
  if (own_master) {
    master_buf_ = BackendBuffer(be_, bytes);
    master_ = master_buf_.as<float>();
    int64_t at = 0;
    for (const GradRange& o : owned) {  // (no initial weights: the caller fills the shard)
      if (initial_master) be_.copy(master_ + at, initial_master + o.offset, static_cast<size_t>(o.numel) * 4);
      at += o.numel;
    }
  }
}

AdamW::~AdamW() = default;

size_t AdamW::state_bytes() const {
  return (master_ ? 3 : 2) * static_cast<size_t>(state_numel_) * sizeof(float);
}

void AdamW::step(float* master, float* grads, double lr, float grad_scale, void* compute,
                 DType compute_type) {
  ++t_;
  math::AdamParams hp{};
  hp.lr = static_cast<float>(lr);
  hp.beta1 = static_cast<float>(cfg_.beta1);
  hp.beta2 = static_cast<float>(cfg_.beta2);
  hp.eps = static_cast<float>(cfg_.eps);
  hp.bias_correction1 = static_cast<float>(1.0 - std::pow(cfg_.beta1, static_cast<double>(t_)));
  hp.bias_correction2 = static_cast<float>(1.0 - std::pow(cfg_.beta2, static_cast<double>(t_)));
  hp.grad_scale = grad_scale;
  update(master, grads, hp, compute, compute_type);
}

void AdamW::step_frozen_variance(float* master, float* grads, double lr, int64_t frozen_at, bool momentum_given,
                                 void* compute, DType compute_type) {
  TETRA_CHECK(frozen_at >= 1 && frozen_at <= t_, "variance frozen at step {} but {} steps were taken", frozen_at,
              t_);
  ++t_;
  math::AdamParams hp{};
  hp.lr = static_cast<float>(lr);
  // m = beta1 m + (1 - beta1) g: with beta1 = 0 it is g exactly; v = 1 * v + 0 * g^2 is v exactly.
  hp.beta1 = momentum_given ? 0.0f : static_cast<float>(cfg_.beta1);
  hp.beta2 = 1.0f;
  hp.eps = static_cast<float>(cfg_.eps);
  hp.bias_correction1 = static_cast<float>(1.0 - std::pow(cfg_.beta1, static_cast<double>(t_)));
  hp.bias_correction2 = static_cast<float>(1.0 - std::pow(cfg_.beta2, static_cast<double>(frozen_at)));
  hp.grad_scale = 1.0f;
  update(master, grads, hp, compute, compute_type);
}

void AdamW::update(float* master, float* grads, const math::AdamParams& base, void* compute, DType compute_type) {
  math::AdamParams hp = base;
  for (const Run& r : runs_) {
    hp.weight_decay = r.decay ? static_cast<float>(cfg_.weight_decay) : 0.0f;
    void* out = compute ? static_cast<char*>(compute) +
                              static_cast<size_t>(compact_compute_ ? r.state_offset : r.offset) * dtype_size(compute_type)
                        : nullptr;
    float* params = master_ ? master_ + r.state_offset : master + r.offset;
    be_.adamw(params, grads + (compact_grads_ ? r.state_offset : r.offset), m_ + r.state_offset, v_ + r.state_offset, r.numel, hp, out,
              compute_type);
  }
}

GradNorm::GradNorm(const ParamLayout& layout, const std::vector<GradRange>& owned, Backend& be,
                   Communicator* tp, Communicator* pp, Communicator* dp_if_sharded, int64_t compact_base)
    : be_(be),
      tp_(tp && tp->size() > 1 ? tp : nullptr),
      pp_(pp && pp->size() > 1 ? pp : nullptr),
      dp_(dp_if_sharded && dp_if_sharded->size() > 1 ? dp_if_sharded : nullptr) {
  const bool tp_rank0 = !tp_ || tp_->rank() == 0;
  // The counted parameter spans (padding after a parameter joins it: it is zero).
  std::vector<GradRange> counted;
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const ParamSpec& p = layout.params[i];
    if ((!p.tp_split && !tp_rank0) || p.stage_copy) continue;
    const int64_t end = i + 1 < layout.params.size() ? layout.params[i + 1].offset : layout.total;
    append_merged(counted, p.offset, end - p.offset);
  }
  int64_t at = compact_base;  // the owned range's first element in the compact layout
  for (const GradRange& o : owned) {
    for (const GradRange& c : counted) {
      const int64_t b = std::max(c.offset, o.offset), e = std::min(c.offset + c.numel, o.offset + o.numel);
      if (b < e) append_merged(ranges_, compact_base >= 0 ? at + (b - o.offset) : b, e - b);
    }
    at += o.numel;
  }
  scratch_buf_ = BackendBuffer(be_, std::max<size_t>(64, ranges_.size() * sizeof(float)));
  scratch_ = scratch_buf_.as<float>();
}

GradNorm::~GradNorm() = default;

void GradNorm::squares(const float* grads, float* out) {
  // Each range's part in fp32 (sum_squares accumulates in double), the parts summed in double and
  // rounded once: the same value a host loop over the parts gives, without reading them back.
  const size_t n = ranges_.size();
  if (n == 0) {
    be_.memset_zero(out, sizeof(float));
  } else if (n == 1) {
    be_.sum_squares(out, grads + ranges_[0].offset, ranges_[0].numel);
  } else {
    for (size_t i = 0; i < n; ++i) be_.sum_squares(scratch_ + i, grads + ranges_[i].offset, ranges_[i].numel);
    be_.sum(out, scratch_, static_cast<int64_t>(n));
  }
  if (tp_) tp_->all_reduce(out, 1, DType::F32, ReduceOp::SUM);
  if (pp_) pp_->all_reduce(out, 1, DType::F32, ReduceOp::SUM);
  if (dp_) dp_->all_reduce(out, 1, DType::F32, ReduceOp::SUM);
}

float clip_factor(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0f;
  return static_cast<float>(std::min(1.0, max_norm / (norm + 1e-6)));
}

}  // namespace tetra
