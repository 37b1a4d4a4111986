// A training step's time on a cluster, predicted from the config alone (`tetra plan`).
//
// Compute, per op of a pipeline rank's layers, at the cluster's rates (cluster.h):
//   GEMMs     max(2 M N K / (peak * gemm_efficiency * wave), bytes / (HBM * hbm_efficiency)) plus the
//             kernel overhead; `wave` is the fraction of the last wave of output tiles that is
//             busy (ceil(M / tile_m) ceil(N / tile_n) tiles over the SMs; a GEMM of fewer tiles than
//             SMs splits K, as cuBLAS does). Backward: the input-gradient and weight-gradient GEMMs.
//   attention the causal pairs a rank computes (context parallel: its share), 4 HS per pair and
//             head forward, 2.5 times that backward (flash attention recomputes the scores), at
//             the cluster's fused-attention fractions of peak.
//   the rest  norms, RoPE, activations, residual adds, the embedding, the loss over the
//             vocabulary and the optimizer: the bytes each reads and writes at streaming rate.
//   recomputation adds the forward of what it recomputes to the backward.
// Communication, per group, from the exact per-step prediction (comm_volume.h: what every
// collective moves) with an alpha-beta ring model on the link the group spans (all its ranks
// in one node: intra_node, else inter_node): all-reduce 2 (g-1)/g bytes / bandwidth + 2 (g-1)
// latency per call, reduce-scatter, all-gather and all-to-all (g-1)/g and (g-1), a send its
// bytes and one latency. Mixture of Experts: the all-to-alls' payload of balanced routing.
// What overlaps, as the trainer runs it:
//   tp, ep     on the critical path, inside each forward and backward (PlanOptions::tp_overlap
//              hides TP behind the layer's GEMMs instead, for implementations that do);
//   cp         p2p: the ring's hops behind the attention blocks (what exceeds them is exposed);
//              all_gather: exposed;
//   pp         asynchronous: a message delays the action that receives it, not the sender;
//   dp         the gradient buckets behind the backward of the step's last micro-batch (ZeRO-2/3:
//              of every micro-batch), the last bucket exposed; the distributed optimizer's
//              all-gather of the updated weights after the step (PlanOptions::param_gather_overlap
//              hides it behind the next forward); ZeRO-3's gathers behind the compute they precede.
// The pipeline: the schedule's own table (pipeline_schedule.h) simulated with these action
// times, a rank starting an action when it is free and its input has arrived; the bubble is what
// the slowest rank spends waiting.
#pragma once

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "trainer/config/config.h"
#include "trainer/plan/cluster.h"

namespace tetra {

// Features of the implementation whose step is predicted: Tetra's by default. The validation
// against published runs sets what those runs used.
struct PlanOptions {
  bool tp_overlap = false;            // TP collectives hidden behind the layer's GEMMs
  bool param_gather_overlap = false;  // the distributed optimizer's weight all-gather behind the next forward
};

// The groups whose communication is timed, in report order.
enum class PlanGroup : uint8_t { TP, CP, EP, PP, DP, EDP, EMBEDDING };
constexpr int kPlanGroups = 7;
const char* plan_group_name(PlanGroup g);

struct GroupTime {
  int64_t size = 1;
  bool inter_node = false;  // spans nodes
  double total_s = 0.0;     // its collectives' time per step
  double exposed_s = 0.0;   // the part compute did not hide
};

struct StepPrediction {
  double step_s = 0.0;
  double compute_s = 0.0;    // the critical pipeline rank's forward + backward compute (recomputation included)
  double recompute_s = 0.0;  // of which recomputation
  double bubble_s = 0.0;     // pipeline wait of that rank
  double optimizer_s = 0.0;  // the update, gradient norm and zeroing
  std::array<GroupTime, kPlanGroups> groups{};
  int64_t critical_pp_rank = 0;
  double tokens_per_s_per_gpu = 0.0;
  double mfu = 0.0;  // model FLOPs (flops.h) per second per GPU over the dense peak of the precision
  // One micro-batch of one layer on the critical rank, op by op (forward and backward seconds).
  std::vector<std::pair<std::string, std::pair<double, double>>> ops;
  double exposed_comm_s() const;
};

// One GEMM, C (M, N) = A (M, K) B (K, N), on `g` at `peak` FLOP/s: operands of `es` bytes per
// element, C of `out_es` (the compute model's unit, exposed so that it can be held against
// published single-kernel measurements).
double gemm_seconds(const GpuSpec& g, double peak, double M, double N, double K, double es, double out_es);

// The step of `cfg` (a validated config: model, batch and layout) on `cluster`.
StepPrediction predict_step(const Config& cfg, const ClusterSpec& cluster, const PlanOptions& opt = {});

// The pipeline's span: the action table of `kind` simulated with per-(rank, chunk) forward and
// backward times and a message time between stages. Returns each rank's finish time; `busy`
// receives each rank's compute time.
std::vector<double> simulate_pipeline(ScheduleKind kind, int pp, int vp, int m,
                                      const std::vector<std::vector<double>>& forward,
                                      const std::vector<std::vector<double>>& backward, double message_s,
                                      std::vector<double>* busy = nullptr);

}  // namespace tetra
