// The communication a training step needs, predicted from the config and layout alone.
//
// Every collective the trainer issues in a step is listed here with its payload (the sizes
// communicator.h defines), per group. The trainer measures what its communicators actually moved
// in each step; the two must agree exactly, which is how a redundant or missing collective is
// caught (tests/dist). Evaluation passes are not part of a training step.
//
// Per micro-batch (N = micro_batch_size * seq_len rows, C hidden, L layers, a = activation bytes):
//   tp > 1, no sequence parallelism: all-reduce of (N, C) after the embedding and each
//     row-parallel layer (1 + 2L), and of each column-parallel layer's input gradient
//     (2L + 1, the output layer included); the vocab-parallel loss all-reduces N row maxima and
//     2N sums (fp32).
//   sequence parallelism: each of those all-reduces becomes a reduce-scatter (forward: after the
//     embedding and row-parallel layers; backward: column-parallel input gradients) or an
//     all-gather (forward: the norms' outputs before column-parallel layers, 2L + 1; backward:
//     the residual gradient before row-parallel layers and the embedding, 2L + 1), each with the
//     (N, C) payload; plus, once per step, one all-reduce of the norm gradients per group.
// With pipeline parallelism the TP counts are those of this rank's chunks (the embedding's
// exchange on the first stage, the output layer's and the loss's on the last), and:
//   pp: per micro-batch and chunk, a send of the (Ns, C) activation to the next stage (not from
//     the last) and of its gradient to the previous one (not from the first), and the matching
//     receives; per step the loss and the gradient norm (one float each).
//   embedding (tied embeddings, first and last stage): one all-reduce of embedding.wte's gradient.
// Per step: the DP reduction of the gradient buffer (all-reduce of each bucket, or with the
// distributed optimizer reduce-scatter of each bucket then all-gather of the updated weights),
// the global gradient norm (one float over tp; over dp when sharded) and the loss (one float
// over dp).
// Context parallelism (cp > 1): N above is this CP rank's micro_batch_size * seq_len / cp rows, the
// DP group's reductions run over dp x cp, and the cp group passes K/V blocks (and their fp32
// gradients) around its ring (context_parallel.h; counted in predict_step_volume).
// Mixture of Experts: the DP reduction covers the dense parameters only; the expert parameters'
// buckets reduce the same way over the expert-DP group (edp), and their norm's partial sum is
// all-reduced over ep (over edp when sharded). Per micro-batch and MoE block the EP group runs 5
// all-to-alls: the per-expert counts, the tokens' dispatch and combine forward, and the same two
// for the gradients backward; the tokens' payload depends on the routing (only the calls are
// predicted). Folded experts (parallel.etp < tp, moe.h): the gates' gradient (a share's rows)
// and the experts' norm reduce over etp instead of tp, the norm's partial sum also over ep (and
// edp when sharded); the router's gradient is a TP partial sum; per training forward the share
// group (eshare) sums the routing statistics (2 all-reduces of E values per block), and with a
// capacity factor the (shares, E) assignment counts.
// Gradient compression (parallel.grad_compression): bf16 halves the dense bucket reductions'
// payload; onebit's compressed steps (after its warm-up), and every int8 step, replace the reductions of each part
// (dense over dp, experts over edp) by one all-to-all of every rank's 1-bit shards (compressed_exchange.h's
// ExchangePlan: group-size messages of `words` 2-byte words) and, without the distributed optimizer,
// one all-gather of the same size (with it: of the tied embedding's piece, when a pipeline holds
// one), plus one fp32 all-reduce of the TP-replicated parameters when there are any.
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "trainer/config/config.h"
#include "trainer/comm/communicator.h"
#include "trainer/params/param_layout.h"

namespace tetra {

struct GroupVolume {
  std::array<int64_t, kCommOps> calls{};
  std::array<int64_t, kCommOps> payload_bytes{};
  void add(CommOp op, int64_t calls, int64_t bytes_each);
  bool operator==(const GroupVolume&) const = default;
  int64_t total_payload() const;
  std::string describe() const;  // "all_reduce 12 x = 3.1 MB, ..." (non-zero ops only)
};

struct StepVolume {
  GroupVolume tp, dp, pp, embedding, edp, ep, cp, etp, eshare;
};

// `layout`: this rank's (its TP slice of its pipeline stage, with the run's group alignment).
// `onebit_compressed`: a
// step of onebit's compressed phase; `onebit_gather_variance`: one that first all-gathers the
// frozen variance (distributed optimizer, OnebitAdam::gathers_variance).
// ZeRO-3: the weight groups each phase of one training step reads, in the schedule's order on this
// rank (Gpt's phases: the embedding, each block's forward, recomputation and backward, the head;
// weight_units.h), the order WeightUnits prefetches in and the prediction replays.
std::vector<std::vector<int>> zero3_step_phases(const Config& cfg, const ParamLayout& layout);

StepVolume predict_step_volume(const Config& cfg, const ParamLayout& layout, bool onebit_compressed = false,
                               bool onebit_gather_variance = false);

// The measured counterpart from a communicator's stats (difference of two snapshots).
GroupVolume measured_volume(const CommStats& after, const CommStats& before);

}  // namespace tetra
