// parallel.grad_compression int8: every step's gradient reduction as a compressed exchange
// (compressed_exchange.h) instead of GradBuffer's fp32 all-reduce or reduce-scatter.
//
// After backward, each rank's unreduced gradient x_i = p g_i is quantised to int8 per block of
// kSignBlock elements (one fp32 scale each, stochastic rounding from a counter-based RNG: unbiased,
// and deterministic given training.seed and the step) with error feedback, and exchanged in two
// stages (all-to-all to the shards' owners, who average, requantise with their own error feedback
// and all-gather), or, with the distributed optimizer, the first stage only. The optimizer then
// runs as usual on the estimate: AdamW with its live variance, global-norm clipping of the
// estimate's norm, the step guard. Dense parameters cross the DP group, a MoE model's experts the
// expert-DP group; a tied embedding across pipeline stages and TP replicas as compressed_exchange.h
// describes. The bytes on the wire: 8.125 bits per element instead of 32 (74.6% less).
//
// Unlike 1-bit Adam there is no warm-up and no frozen variance: 127 levels per sign keep enough of
// the gradient that Adam's own statistics stay meaningful; the price is 8x the bytes of onebit's
// compressed phase. It exchanges after backward, not overlapped with it as the buckets are.
//
// State: the error-feedback buffers, checkpointed like onebit's ("optim/int8_worker_error/dp1of4",
// "optim/int8_server_error").
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/config/config.h"
#include "trainer/params/param_layout.h"
#include "trainer/optim/compressed_exchange.h"

namespace tetra {

class GradBuffers;
struct ProcessGroups;

class CompressedReduction {
 public:
  CompressedReduction(const Config& cfg, Backend& be, GradBuffers& grads, ProcessGroups& groups);

  // `grads` (backend memory): this rank's unreduced gradient (GradBuffers::set_reduce(false));
  // afterwards the reduced gradient's estimate wherever the optimizer reads it. `step`: 0-based.
  // The exchanges run on the host over the host-memory DP and expert-DP communicators, on the
  // gradient itself where backend memory is host memory, else on a staging copy (allocated at
  // construction) that goes back into `grads` afterwards.
  void reduce(float* grads, int64_t step);

  // The error-feedback buffers, for checkpoints.
  std::vector<CheckpointExtra> checkpoint_state();

 private:
  Backend& be_;
  int64_t total_;
  std::unique_ptr<CompressedExchange> dense_, experts_;
  std::vector<float> host_grads_;  // (total), where backend memory is not host memory
};

}  // namespace tetra
