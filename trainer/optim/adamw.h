// AdamW on fp32 master weights, with global-norm gradient clipping; shardable over data
// parallelism (the distributed optimizer, ZeRO-1).
//
// The optimizer updates the parameter ranges it owns (GradBuffer::owned(): everything, or this
// rank's shard of every bucket). Its moments live in two fp32 buffers holding only those ranges,
// back to back. The fp32 master weights are either the full parameter buffer the caller passes
// to step() (fp32 training, where they are also the weights the model reads), or, with
// `own_master`, a compact buffer of the owned ranges kept here (bf16 / fp16 training: the model
// reads the 16-bit copy that step() writes, and the master weights are sharded with the moments).
//
// Parameters are updated in runs of consecutive tensors that share a weight-decay setting (about
// eight runs per transformer block), not one kernel call per tensor. In bf16 / fp16 mode the
// update also writes the rounded 16-bit compute weights in the same pass.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "kernels/backend.h"
#include "trainer/config/config.h"
#include "trainer/params/param_layout.h"
#include "trainer/optim/grad_buffer.h"

namespace tetra {

class Communicator;

class AdamW {
 public:
  // `initial_master`: the full fp32 parameter buffer (backend memory) to copy the owned ranges
  // from when `own_master`.
  // `compact_grads` (ZeRO-2): the gradients step() reads are the owned ranges back to back (the
  // state's layout, GradBuffers::shard()), not the whole buffer at the layout's offsets.
  AdamW(const OptimizerConfig& cfg, const ParamLayout& layout, Backend& be,
        const std::vector<GradRange>& owned, bool own_master, const float* initial_master,
        bool compact_grads = false);
  ~AdamW();
  AdamW(const AdamW&) = delete;
  AdamW& operator=(const AdamW&) = delete;

  // One update with learning rate `lr` of the owned ranges; grads are multiplied by `grad_scale`
  // first (clipping, and in fp16 the loss scale's removal), and left zeroed (in the owned ranges) for the next step's accumulation.
  // `master`: the full fp32 parameter buffer (ignored with own_master). `compute` (may be null)
  // receives the updated weights as `compute_type`, at the layout's offsets.
  void step(float* master, float* grads, double lr, float grad_scale, void* compute,
            DType compute_type);

  // 1-bit Adam's compressed phase (onebit_adam.h): the variance stays what it was after step
  // `frozen_at` (beta2 = 1 and its bias correction frozen at 1 - beta2^frozen_at); with
  // `momentum_given`, `grads` holds the new momentum itself (beta1 = 0 in the update, so m = grads),
  // else the momentum is updated from grads as usual. No clipping (grad_scale 1).
  void step_frozen_variance(float* master, float* grads, double lr, int64_t frozen_at, bool momentum_given,
                            void* compute, DType compute_type);

  int64_t steps_taken() const { return t_; }
  size_t state_bytes() const;

  // The state of the owned ranges, back to back in owned-range order (checkpoints): Adam's
  // moments, and the fp32 master weights when the optimizer owns them (else null).
  float* exp_avg() { return m_; }
  float* exp_avg_sq() { return v_; }
  float* master_shard() { return master_; }
  int64_t state_numel() const { return state_numel_; }
  void set_steps_taken(int64_t t) { t_ = t; }
  // ZeRO-3: step() writes the compute weights as the owned ranges back to back (the state's
  // layout: the compute shard, weight_units.h), not at the layout's offsets.
  void set_compact_compute(bool compact) { compact_compute_ = compact; }

 private:
  void update(float* master, float* grads, const math::AdamParams& base, void* compute, DType compute_type);
  struct Run {
    int64_t offset, numel, state_offset;
    bool decay;
  };
  const OptimizerConfig& cfg_;
  Backend& be_;
  int64_t state_numel_ = 0;
  std::vector<Run> runs_;
  BackendBuffer m_buf_, v_buf_, master_buf_;  // own the three below
  float* m_ = nullptr;
  float* v_ = nullptr;
  float* master_ = nullptr;  // own_master: the owned ranges' fp32 weights
  int64_t t_ = 0;
  bool compact_grads_ = false;
  bool compact_compute_ = false;
};

// Global L2 norm of the model's gradient. Each rank sums the squares of the ranges it owns,
// counting a parameter replicated over TP on TP rank 0 only; the sums are added over `tp` and,
// when the gradient is sharded (distributed optimizer), over `dp` (either may be null).
class GradNorm {
 public:
  // Sums the squares over this rank's counted gradients, then over `tp`, `pp` (each stage holds
  // different parameters) and, when the optimizer shards them, `dp_if_sharded`. TP replicas count
  // on TP rank 0 only, a tied embedding's last-stage copy not at all.
  // `compact_base` >= 0 (ZeRO-2): compute() reads the owned ranges back to back, the first at
  // grads + compact_base; -1: at the layout's offsets.
  GradNorm(const ParamLayout& layout, const std::vector<GradRange>& owned, Backend& be,
           Communicator* tp, Communicator* pp, Communicator* dp_if_sharded, int64_t compact_base = -1);
  ~GradNorm();
  // The sum of squares, reduced over the groups, left in backend memory at `out` (one float):
  // nothing is read back (the caller reads it with the step's other scalars, once).
  void squares(const float* grads, float* out);

 private:
  Backend& be_;
  Communicator* tp_;
  Communicator* pp_;
  Communicator* dp_;
  std::vector<GradRange> ranges_;  // merged
  BackendBuffer scratch_buf_;
  float* scratch_ = nullptr;  // scratch_buf_'s: each range's part
};

// torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (norm + 1e-6)); 1 when clip <= 0.
float clip_factor(double norm, double max_norm);

}  // namespace tetra
