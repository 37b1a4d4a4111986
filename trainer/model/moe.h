// The Mixture-of-Experts MLP (Switch Transformer / GShard / Mixtral style), forward and backward,
// with expert parallelism over an EP group.
//
// Per MoE block, N rows h = norm2(x) (N, C), E experts, each token to K of them:
//   logits = h W_r^T                  (N, E) fp32 (16-bit inputs' products are exact in fp32;
//                                     fp32 accumulation)
//   p = softmax(logits)               (N, E) fp32; the top-K experts of each row and their
//                                     probabilities q (N, K); the gates g = s q / sum_k q
//                                     (router_pre_softmax false: renormalised) or s q (true),
//                                     s = router_topk_scaling_factor (1 when null)
//   plan (host): assignments (i, k) sorted by expert, token order within an expert; with a
//     capacity factor an expert keeps its first ceil(factor N K / E) assignments and drops the
//     rest (a dropped assignment contributes nothing: the token's residual passes through);
//     under context parallelism N and "first" are the whole sequence's (plan_routing)
//   x_perm = h[rows]                  (M, C) per-expert contiguous blocks, M kept assignments
//   expert e over its block:  u = x W1_e^T + b1_e (n_e, FC); a = gelu(u) | swiglu(u) (n_e, F);
//                             y = a W2_e^T + b2_e (n_e, C)       one GEMM pair per expert
//   out[i] = x_mid[i] + sum_k g[i,k] y[pos[i,k]]   (the residual add of the block)
//            + g_s[i] shared(h)[i]                 (model.moe.shared_expert_ffn_hidden_size: an MLP
//                                                   every token goes through, g_s its optional
//                                                   sigmoid gate; moe_shared.h)
// Losses added to the objective, per micro-batch (weighted like its mean cross-entropy):
//   aux = E / (N^2 K) sum_e routed_e sum_i p[i,e]   (Switch; routed_e counts assignments before
//                                                   drops; gradient through p only)
//   z   = mean_i lse_i^2                            (ST-MoE router z-loss)
// objective += aux_loss_coeff aux + z_loss_coeff z.
//
// Expert parallelism (ep ranks, carved out of DP; the exchanges are trainer/parallel/expert_dispatch.h):
// rank r holds experts [r E/ep, (r+1) E/ep).
// Each rank routes its own tokens (capacity counted on them, so drops do not depend on ep), then:
//   1. all_to_all_v of the per-expert counts (each rank learns how many rows it will receive),
//   2. all_to_all_v of x_perm's expert blocks to their owners (dispatch),
//   3. the received rows, source-major, regrouped expert-major so each local expert's rows are
//      one contiguous block; the expert GEMMs; the reverse regrouping,
//   4. all_to_all_v of the outputs back to their sources (combine), weighted there by the gates.
// Backward runs the same exchanges for the output and input gradients. Buffers are sized for the
// worst case (dropless: every token of every EP rank to this rank's experts), so the step
// allocates nothing.
//
// Tensor parallelism (tp ranks, the same tokens on each): every TP rank routes identically (the
// router is replicated) and computes its slice of each expert's hidden units, as in the dense
// MLP: its output is a partial sum, which the caller reduces over TP like a row-parallel layer's
// (all-reduce, or reduce-scatter with sequence parallelism; the expert proj bias and the residual
// are added on TP rank 0). Backward: the gates' gradient <dout, y> is a partial sum too and is
// all-reduced over TP (N K floats); the input gradient is partial (the router's share added on
// TP rank 0 only) and the caller reduces it like a column-parallel layer's.
//
// Folded experts (Megatron-Core's MoE parallel folding: parallel.etp < tp, rank_grid.h): each
// expert is split over the ETP group only, and the TP group's tp / etp shares (groups of ETP ranks)
// route different rows: share g the g-th ceil(N / shares) rows of the N the caller gives. Its
// routing, dispatch over EP (which then spans the shares and DP), experts and combine are those
// above on its rows, with the ETP group in the TP group's place; its output (and input gradient)
// is zero on the other rows, so the caller's reduction over TP still sums every row's whole
// value. The load-balancing loss's statistics are summed over the share group (ESHARE) like the
// CP group's, the router's gradient is the share's (on ETP rank 0; reduced over TP as a partial
// sum), and a capacity counts the assignments of the shares before this one (an all-reduce of
// (shares, E) I32 per forward). The shared expert stays split over the whole TP group.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "trainer/core/arena.h"
#include "trainer/config/config.h"
#include "trainer/params/grad_sink.h"
#include "trainer/params/param_layout.h"

namespace tetra {

class Communicator;
class ExpertDispatcher;
class MoeSharedExpert;

// The routing of one micro-batch on one rank (host side), from the router's top-K choice.
struct MoeRoutingPlan {
  std::vector<int64_t> routed;   // (E) assignments per expert before drops
  std::vector<int64_t> kept;     // (E) after the capacity limit
  std::vector<int32_t> pos;      // (N K) row of x_perm holding assignment (i, k), -1 if dropped
  std::vector<int32_t> rows;     // (M) source token of each row of x_perm
  int64_t dropped = 0;
};
// capacity < 0: dropless. `before` (N / segment, E), when given: the tokens come in segments of
// `segment` tokens, and before[s][e] assignments to expert e precede segment s in the sequence
// (other CP ranks' chunks): the capacity is counted in the sequence's order, not this rank's.
MoeRoutingPlan plan_moe_routing(const int32_t* topk_idx, int64_t N, int64_t K, int64_t E, int64_t capacity,
                                const int64_t* before = nullptr, int64_t segment = 0);
// The rows of its local experts a rank keeps per MoE block and micro-batch (the plan's bound),
// given the worst case `worst` (every EP rank's rows to this rank's experts): the worst case with
// ep 1 (a rank's experts see its own N K rows) or a capacity factor; else
// ceil(max_load_factor N K), N K being the balanced load.
int64_t moe_row_bound(const MoeConfig& moe, int64_t N, int64_t ep, int64_t worst);
// Whether a block's rows can exceed that bound at all (dropless with ep > 1).
inline bool moe_rows_can_exceed_bound(const MoeConfig& moe, int64_t ep) { return ep > 1 && !moe.capacity_factor; }
// Test-only (TETRA_TEST_MOE_ROUTE, trainer/core/runtime_options.h; installed by the train
// command): the router's logits biased after the router GEMM, before the softmax, so that a test
// can force skewed or all-to-one routing. kOne: +30 on experts 0..top_k-1 (every token chooses
// them: all rows to EP rank 0 when it holds top_k experts); kSkew: +3 on expert 0.
enum class MoeRouteBias { kNone, kOne, kSkew };
void set_moe_route_bias(MoeRouteBias bias);
// Rows per expert under the capacity factor for N tokens (-1 when dropless).
int64_t moe_capacity(const MoeConfig& moe, int64_t N);

// What the MoE blocks did in a step (this rank's tokens), for the log and metrics.jsonl.
struct MoeLayerStats {
  int64_t layer = 0;
  std::vector<int64_t> tokens_per_expert;  // routed assignments, summed over micro-batches
  int64_t dropped = 0;
  int64_t max_rows = 0;     // the most rows this rank's experts received in one micro-batch
  int64_t bound_rows = 0;   // the rows planned for (moe_row_bound)
  int64_t over_bound = 0;   // micro-batches whose rows exceeded it (computed in passes, recomputed)
  double aux_loss = 0.0, z_loss = 0.0;     // mean over micro-batches
  int64_t micro_batches = 0;
};
struct MoeStepStats {
  std::vector<MoeLayerStats> layers;
  double expert_s = 0.0;            // expert GEMMs and activations, forward and backward
  double dispatch_s = 0.0, combine_s = 0.0;  // the all-to-alls (with the count exchange)
  int64_t dispatch_bytes = 0, combine_bytes = 0;  // payload this rank sent
  // Micro-batch blocks over the row bound in the step, summed over every rank (the trainer's
  // reduction; 0 until then).
  int64_t over_bound_world = 0;
  // Contribution to the step's objective: sum over layers of coeff * mean loss.
  double objective(const MoeConfig& moe) const;
  // Adds `other` (statistics of other micro-batches or other blocks): per block, counts summed and
  // mean losses weighted by micro-batches; times and bytes summed.
  void merge(const MoeStepStats& other);
};

class MoeLayers {
 public:
  // N rows per micro-batch; `ep` the expert-parallel group (null or size 1: every expert here);
  // `tp` the tensor-parallel group (null or size 1: whole experts).
  // The blocks [l0, l0 + layers) of the model (layers -1: to the last) are this chunk's; the MoE
  // blocks among them keep state, per activation slot (one per micro-batch in flight: `slots`).
  // `recompute_act`: the experts' activation is not kept but recomputed from fc in backward
  // (selective "moe_act"). `regions`: where the scratch and the slots live (sizes_for() bytes of
  // each at least; null: an arena of this object's own).
  // `cp`: the CP group whose ranks hold the other tokens of each sequence (null or size 1: none;
  // N is then this rank's B T / cp rows). The load-balancing loss uses the whole sequence's routing
  // statistics, summed over the group in each training forward (an all-reduce of the E routed
  // counts, I32, and of the E probability sums, F32), so that it, and its gradient, equal the
  // single-rank run's; with a capacity factor the capacity is the whole sequence's cp N tokens'
  // and the assignments each expert keeps are its first in the sequence's order, over the CP
  // ranks' chunks (an all-reduce of (B, 2 cp, E) I32 chunk counts in every forward), so that the
  // same assignments are dropped as on one rank.
  MoeLayers(const ModelConfig& cfg, const ParamLayout& layout, Backend& be, DType act, int64_t N,
            Communicator* ep, Communicator* tp = nullptr, int64_t l0 = 0, int64_t layers = -1,
            bool recompute_act = false, int64_t slots = 1, const ActivationRegions* regions = nullptr,
            Communicator* cp = nullptr, Communicator* etp = nullptr, Communicator* eshare = nullptr,
            int ep_chunks = 1, bool local_rows = false);
  // Whole folded experts (etp 1) under sequence parallelism, without a shared expert or a
  // capacity: each rank's share is its own sequence-parallel shard of the rows, so the block runs
  // on the shard itself (local_rows: N is the shard's rows, the output their whole value and the
  // input gradient whole too) and the TP group's gather before it and reduce-scatter after it,
  // forward and backward, are not needed (Megatron's folded dispatcher's saving): moe_local_rows()
  // (config.h) decides.
  // (`etp`, `eshare`: the ETP and ESHARE groups of folded experts; eshare null or of size 1: unfolded,
  // the experts split over `tp`. `ep_chunks`: the expert-parallel exchanges in that many chunks,
  // overlapped with the experts' compute: parallel.ep_overlap_chunks.)
  ~MoeLayers();
  MoeLayers(const MoeLayers&) = delete;
  MoeLayers& operator=(const MoeLayers&) = delete;

  // Scratch (the backward's gradients and the exchange buffers, shared by the slots) and one
  // slot (each block's routing, dispatched rows and expert activations) of the blocks in
  // [l0, l0 + layers): zero when none is a MoE block.
  // `etp`: the experts' tensor parallelism (0: tp, unfolded).
  static ActivationSizes sizes_for(const ModelConfig& cfg, DType act, int64_t N, int64_t ep, int64_t tp = 1,
                                   int64_t l0 = 0, int64_t layers = -1, bool recompute_act = false, int64_t cp = 1,
                                   int64_t etp = 0);
  // Bytes of the arena this object allocated itself (0 when it was given regions).
  size_t activation_bytes() const { return bytes_; }

  // Block l (a MoE block) of the micro-batch in `slot`: out (N, C) = residual (N, C) + MoE(h)
  // (residual may be null: 0; with tp > 1 MoE(h) is this rank's partial sum). h (N, C) is kept
  // (the caller's activation) for backward. `loss_weight`: the weight of this micro-batch's mean
  // loss in the objective (0: not training; nothing is counted in the statistics).
  void forward(int64_t l, const WeightView& weights, const void* h, const void* residual, void* out,
               float loss_weight, int64_t slot = 0);
  // dh (N, C) is overwritten with the gradient of MoE(h) w.r.t. h given dout (N, C) (with tp > 1
  // this rank's partial sum; dh may be dout's buffer, as with sequence parallelism); parameter
  // gradients accumulate into `grads`. The slot's last forward of the block must be the one this
  // backward is for.
  void backward(int64_t l, const WeightView& weights, const GradTarget& grads, const void* h, const void* dout, void* dh,
                int64_t slot = 0);

  // Statistics since the last take (and reset).
  MoeStepStats take_stats();
  // Auxiliary-loss-free balancing (model.moe.router_enable_expert_bias): each MoE block's bias
  // (E, fp32, host state, the same on every rank), by block; empty without it.
  std::map<int64_t, std::vector<float>> expert_bias() const;
  // Sets the blocks' biases (a checkpoint's); blocks of other chunks are ignored.
  void set_expert_bias(const std::map<int64_t, std::vector<float>>& bias);
  // After a step's update: bias_e += rate sign(mean - tokens_e) per block, from the step's tokens
  // per expert summed over every rank that routes the block's tokens (DP and CP; the caller's
  // reduction), blocks of other chunks ignored.
  void update_expert_bias(const std::map<int64_t, std::vector<int64_t>>& tokens_per_expert);

  struct Layer;  // per-block saved state (moe.cpp)

 private:
  // The routing plan of the router's choice `idx` (host, N K): capacity over this rank's tokens, or
  // under context parallelism over the whole sequence's (the CP group's chunk counts exchanged).
  MoeRoutingPlan plan_routing(const int32_t* idx);
  // The local experts over rows [r0, r1) of the block's expert-major rows: fc and act (rows from
  // r0) and y (the whole block's rows). Backward: dy, dx the whole block's; fc and act from r0,
  // computed again from x first when `refc` (a block over the bound), act from fc when `react`.
  // Block l's index among the chunk's MoE blocks, -1 when it is none of them.
  int64_t block_index(int64_t l) const;
  // Where block s's kept rows go, once its received row count is known (s.over when above B).
  void place_rows(Layer& s);
  void experts_forward(const Layer& s, const BlockParams& p, const WeightView& weights, int64_t r0, int64_t r1,
                       void* fc, void* act, void* y);
  void experts_backward(const Layer& s, const BlockParams& p, const WeightView& weights, const GradTarget& grads,
                        int64_t r0, int64_t r1, void* fc, void* act, bool refc, bool react);

  const ModelConfig& cfg_;
  const ParamLayout& layout_;
  Backend& be_;
  DType act_;
  Communicator* ep_;  // null without expert parallelism
  Communicator* tp_;  // null without tensor parallelism
  Communicator* cp_ = nullptr;  // null without context parallelism
  Communicator* etp_ = nullptr;    // the experts' partial sums (tp_ unfolded); null for whole experts
  Communicator* share_ = nullptr;  // folded experts: the TP ranks routing the other rows; else null
  int64_t Nfull_ = 0, r0_ = 0;  // the caller's rows; this share's first row
  int64_t seq_rows_ = 0;  // the rows of this CP rank's sequences over the TP group (the losses' N)
  std::unique_ptr<ExpertDispatcher> dispatcher_;  // the EP exchanges (parallel/expert_dispatch.h)
  std::unique_ptr<MoeSharedExpert> shared_;       // the shared expert (moe_shared.h), or null
  int64_t N_, C_, E_, K_, El_, e0_, F_, FC_, cap_, M_max_, R_max_, B_;
  bool swiglu_;
  bool recompute_act_ = false;
  std::vector<int> index_of_layer_;  // block -> its index among the chunk's MoE blocks, -1 for dense blocks
  int64_t blocks_ = 0;               // MoE blocks in the chunk
  std::vector<std::unique_ptr<Layer>> layers_;  // [slot * blocks_ + index]
  Layer& layer(int64_t slot, int64_t l);
  size_t bytes_ = 0;
  BackendBuffer arena_;
  struct Scratch;
  std::unique_ptr<Scratch> sc_;
  MoeStepStats stats_;
  std::vector<std::vector<float>> expert_bias_;  // [index among the chunk's MoE blocks] (E)
  MoeScore score() const {
    return cfg_.moe.router_score_function == RouterScore::SIGMOID ? MoeScore::SIGMOID : MoeScore::SOFTMAX;
  }
};

}  // namespace tetra
