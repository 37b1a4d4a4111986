// AdamW on fp32 master weights, with global-norm gradient clipping.
//
// The moments live in two parameter-sized fp32 buffers (same offsets as the parameter buffer).
// Parameters are updated in runs of consecutive tensors that share a weight-decay setting (about
// eight runs per transformer block), not one kernel call per tensor. In bf16 mode the update also
// writes the rounded bf16 compute weights in the same pass.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "trainer/config/config.h"
#include "trainer/model/param_layout.h"

namespace tetra {

class AdamW {
 public:
  AdamW(const OptimizerConfig& cfg, const ParamLayout& layout, Backend& be);
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // One update with learning rate `lr`; grads are multiplied by `grad_scale` first (clipping), and
  // left zeroed for the next step's accumulation. `compute` (may be null) receives the updated
  // weights as `compute_type`.
  void step(float* master, float* grads, double lr, float grad_scale, void* compute,
            DType compute_type);

  int64_t steps_taken() const { return t_; }
  size_t state_bytes() const { return 2 * static_cast<size_t>(total_) * sizeof(float); }

 private:
  struct Run {
    int64_t offset, numel;
    bool decay;
  };
  const OptimizerConfig& cfg_;
  Backend& be_;
  int64_t total_;
  std::vector<Run> runs_;
  float* m_ = nullptr;
  float* v_ = nullptr;
  int64_t t_ = 0;
};

// Global L2 norm of the gradient buffer (padding is zero and does not contribute).
double grad_global_norm(Backend& be, const float* grads, int64_t n, float* scratch);

// torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6)); 1 when clip <= 0.
float clip_factor(double norm, double max_norm);

}  // namespace tetra
