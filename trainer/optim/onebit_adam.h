// 1-bit Adam (Tang et al. 2021, "1-bit Adam: Communication Efficient Large-Scale Training with
// Adam's Convergence Speed"; DeepSpeed's OnebitAdam): parallel.grad_compression = onebit.
//
// Warm-up: the first parallel.onebit_warmup_steps steps are exact AdamW (GradBuffer reduces the
// fp32 gradient as usual). Adam's variance then barely changes; 1-bit Adam freezes it, and from
// then on Adam is a momentum SGD with a fixed per-coordinate step size, whose momentum can be
// exchanged in 1-bit form with error feedback (compression.h) without losing convergence.
//
// Compressed phase, plain data parallelism (every rank keeps the whole momentum m, identical on
// all ranks; DeepSpeed's two-stage compressed all-reduce):
//   x_i = beta1 m + (1 - beta1) dp g_i       g_i: rank i's unreduced gradient (sum_i g_i = g)
//   worker: x_i / d (below) + worker error e_i is sign-compressed per destination shard (one
//     fp32 scale per kSignBlock elements), e_i keeps what the compression dropped; an all-to-all
//     sends shard r to rank r.
//   server: rank r averages its dp received shards, adds its server error, compresses again
//     (server error keeps the residual) and all-gathers the result: every rank decompresses the
//     same new m = mean_i x_i + compression error, carried into the next step by the two errors.
//   update: p -= lr (m / (1 - beta1^t) / d + wd p), d = sqrt(v / (1 - beta2^W)) + eps with v
//     frozen at step W = the warm-up.
// What is compressed is x_i / d, not x_i (and m = d * the decompressed result): the compressor
// C_d(x) = d * C(x / d), with the errors kept in units of x / d. d is frozen and the same on every
// rank, so averaging commutes with it and error feedback works unchanged; but the compression
// error now lands on the update itself, whose entries are all of Adam's unit scale, instead of on
// the momentum, whose entries span orders of magnitude within one block. Compressing x_i itself
// gives a coordinate with a tiny frozen variance (an embedding row of a rare token) a momentum of
// the block's scale, divided by its tiny d: the demo model (configs/demo.json) diverged that way.
// Compressed phase with the distributed optimizer (each rank keeps m and v of its shards only, so
// no rank can form x_i for the others' shards; the compressed quantity is the gradient):
//   worker: dp g_i / d + e_i is compressed per destination shard (d from the frozen variance,
//     all-gathered once, at the process's first compressed step) and sent by the same all-to-all
//     (a compressed reduce-scatter); the owner averages its shards into the gradient estimate,
//     updates m = beta1 m + (1 - beta1) d avg and its parameters with the frozen v, and the updated
//     weights are all-gathered as usual (GradBuffer::gather_params). The server stage is not needed
//     (but for a tied embedding across pipeline stages, compressed_exchange.h).
// The step's bytes on the DP wire fall from 2 (dp-1)/dp * 4 bytes per parameter (fp32 all-reduce)
// to 2 (dp-1)/dp * (1/8 + 4/kSignBlock) (plain), or the reduce-scatter's (dp-1)/dp * 4 to
// (dp-1)/dp * (1/8 + 4/kSignBlock) (distributed optimizer; the weight all-gather is unchanged).
//
// Layouts (compressed_exchange.h): the dense parameters cross the DP group, a MoE model's expert
// parameters the expert-DP group, each part with its own plan and error feedback (with
// expert-DP 1 the expert gradient is already whole: the part only forms its momentum). Parameters
// replicated over TP are averaged exactly; a tied embedding held by two pipeline stages is
// compressed in a piece of its own that both stages build and compute identically, so the two
// copies get the same update bit for bit. Pipeline stages each exchange their own parameters over
// their own DP group; the embedding group's sum of the tied gradients comes first (on the
// gradients, PipelineModel::finish_tied_embedding), the exchange of the momentum after it.
//
// Gradient clipping is not applied in the compressed phase (the reduced gradient's norm is never
// formed: that is the point); the logged grad_norm is then an estimate, the group size times the
// norm of the rank's local gradient (dp for dense parameters, expert-DP for experts; with the
// distributed optimizer: of the local shards, summed over DP).
//
// State: the worker error (the whole part, per rank) and, plain, the server error (the rank's
// shards), saved in checkpoints as CheckpointExtra tensors. The server error of an element is the
// residual of its average, whoever owns it, so it reshards over any dp ("optim/onebit_server_error";
// the tied piece's "optim/onebit_server_error_tied"). The worker error is one rank's own residual;
// its key names the rank, the group size and the mode ("optim/onebit_worker_error/dp1of4",
// ".../dp1of4_sharded", experts ".../edp0of2_ep2"), so it resumes exactly under the same
// data-parallel layout (any tp or pp) and starts from zero, with a warning, under another. The
// frozen variance is exp_avg_sq, and the warm-up progress the step count, both saved already.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/config/config.h"
#include "trainer/params/param_layout.h"
#include "trainer/optim/adamw.h"
#include "trainer/optim/compressed_exchange.h"

namespace tetra {

class Communicator;
class GradBuffers;
struct ProcessGroups;

class OnebitAdam {
 public:
  // `grads`: the dense and expert gradient buffers (their owned ranges are `adam`'s); the groups:
  // DP for the dense part, expert-DP for the experts. A DP group of 1: every step is exact.
  OnebitAdam(const Config& cfg, const ParamLayout& layout, Backend& be, GradBuffers& grads, AdamW& adam,
             ProcessGroups& groups);
  ~OnebitAdam();
  OnebitAdam(const OnebitAdam&) = delete;
  OnebitAdam& operator=(const OnebitAdam&) = delete;

  // Whether step s (0-based) runs compressed: after the warm-up, with a DP group.
  bool compressed(int64_t s) const { return active_ && s >= warmup_; }
  // Distributed optimizer: whether the next compressed step first all-gathers the frozen variance
  // (once per process: its first compressed step, also after a resume).
  bool gathers_variance() const { return sharded_ && !v_host_; }

  // The compressed step: `grads` holds this rank's unreduced gradient (GradBuffers::set_reduce(false));
  // exchanges it as described above and updates the owned parameters (AdamW::step's arguments).
  // The compression runs on the host, on host views of the gradient and moments (the buffers
  // themselves when backend memory is host memory, else copies into staging allocated here at
  // construction; the gradient is copied back before the update). The exchanges use the
  // host-memory DP and expert-DP communicators; the frozen variance is gathered through the
  // gradient buffers' (backend memory), and viewed on the host once.
  void step(float* master, float* grads, double lr, void* compute, DType compute_type);

  // The error-feedback buffers, for checkpoints (empty without a DP group).
  std::vector<CheckpointExtra> checkpoint_state();

 private:
  // `buf` (total floats, backend memory) for the host: `buf` itself where backend memory is host
  // memory, else `staging` after a copy.
  float* host_view(const float* buf, std::vector<float>& staging);

  GradBuffers& grad_buffers_;
  AdamW& adam_;
  bool active_;
  int64_t warmup_;
  int64_t total_;
  bool sharded_;
  std::unique_ptr<CompressedExchange> dense_, experts_;
  Backend& be_;
  BackendBuffer v_full_buf_;       // owns v_full_
  float* v_full_ = nullptr;        // sharded: the whole frozen variance (total, backend memory), gathered once
  // Host views (compressed_exchange.h runs on host memory): the frozen variance (total; set at
  // the process's first compressed step and kept: AdamW::step_frozen_variance leaves v as it is), and,
  // where backend memory is not host memory, staging for the gradient, the variance and (plain)
  // the momentum, each (total), sized at construction.
  const float* v_host_ = nullptr;
  std::vector<float> host_grads_, host_v_, host_m_;
};

}  // namespace tetra
