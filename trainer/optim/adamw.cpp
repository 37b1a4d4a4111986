#include "trainer/optim/adamw.h"

#include <algorithm>
#include <cmath>

namespace tetra {

AdamW::AdamW(const OptimizerConfig& cfg, const ParamLayout& layout, Backend& be)
    : cfg_(cfg), be_(be), total_(layout.total) {
  for (size_t i = 0; i < layout.params.size(); ++i) {
    const ParamSpec& p = layout.params[i];
    const int64_t end = i + 1 < layout.params.size() ? layout.params[i + 1].offset : layout.total;
    if (!runs_.empty() && runs_.back().decay == p.weight_decay)
      runs_.back().numel = end - runs_.back().offset;
    else
      runs_.push_back(Run{p.offset, end - p.offset, p.weight_decay});
  }
  const size_t bytes = static_cast<size_t>(total_) * sizeof(float);
  m_ = static_cast<float*>(be_.alloc(bytes));
  v_ = static_cast<float*>(be_.alloc(bytes));
  be_.memset_zero(m_, bytes);
  be_.memset_zero(v_, bytes);
}

AdamW::~AdamW() {
  be_.free(m_);
  be_.free(v_);
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
  for (const Run& r : runs_) {
    hp.weight_decay = r.decay ? static_cast<float>(cfg_.weight_decay) : 0.0f;
    void* out = compute ? static_cast<char*>(compute) + static_cast<size_t>(r.offset) * dtype_size(compute_type)
                        : nullptr;
    be_.adamw(master + r.offset, grads + r.offset, m_ + r.offset, v_ + r.offset, r.numel, hp, out,
              compute_type);
  }
}

double grad_global_norm(Backend& be, const float* grads, int64_t n, float* scratch) {
  be.sum_squares(scratch, grads, n);
  float host = 0.0f;
  be.copy_to_host(&host, scratch, sizeof(float));
  return std::sqrt(static_cast<double>(host));
}

float clip_factor(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0f;
  return static_cast<float>(std::min(1.0, max_norm / (norm + 1e-6)));
}

}  // namespace tetra
