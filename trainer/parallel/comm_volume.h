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
// Per step: the DP reduction of the gradient buffer (all-reduce of each bucket, or with the
// distributed optimizer reduce-scatter of each bucket then all-gather of the updated weights),
// the global gradient norm (one float over tp; over dp when sharded) and the loss (one float
// over dp).
// Gradient compression (parallel.grad_compression): bf16 halves the bucket reductions' payload;
// onebit's compressed steps (after its warm-up) replace them by one all-to-all of every rank's
// 1-bit shards (compression.h's ChunkPlan: dp messages of `words` 2-byte words) and, without the
// distributed optimizer, one all-gather of the same size, plus one fp32 all-reduce of the
// replicated parameters when there are any (onebit_exact_ranges, onebit_adam.h).
#pragma once

#include <array>
#include <cstdint>
#include <string>

#include "trainer/config/config.h"
#include "trainer/dist/communicator.h"
#include "trainer/model/param_layout.h"

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
  GroupVolume tp, dp;
};

// `layout`: this rank's (its TP slice, with the run's group alignment). `onebit_compressed`: a
// step of onebit's compressed phase; `onebit_gather_variance`: one that first all-gathers the
// frozen variance (distributed optimizer, OnebitAdam::gathers_variance).
StepVolume predict_step_volume(const Config& cfg, const ParamLayout& layout, bool onebit_compressed = false,
                               bool onebit_gather_variance = false);

// The measured counterpart from a communicator's stats (difference of two snapshots).
GroupVolume measured_volume(const CommStats& after, const CommStats& before);

}  // namespace tetra
