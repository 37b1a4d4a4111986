// One part of the gradient buffer exchanged in compressed form (compression.h): the dense
// parameters over the DP group, or a Mixture-of-Experts model's expert parameters over the
// expert-DP group (grad_buffers.h: [expert_begin, total) reduces over expert-DP). Each part has
// its own chunk plan, its own error feedback and its own collectives; the optimizer step that
// follows is one for the whole buffer. Two users:
//   parallel.grad_compression onebit (onebit_adam.h), after its warm-up: sign compression of
//     x_i / d, d Adam's frozen denominator, where x_i is the momentum estimate
//     beta1 m + (1 - beta1) p g_i (the optimizer state whole on every rank) or p g_i (the
//     distributed optimizer); it yields the new momentum or the gradient estimate;
//   parallel.grad_compression int8, every step: int8 compression of x_i = p g_i; it yields the
//     gradient estimate, and Adam (with clipping) runs as usual on it.
// (p: the group size; the gradients are pre-scaled so that sum_i g_i is the reduced gradient.)
// Plain: a two-stage compressed all-reduce (worker stage: every rank's shards to their owners by
// an all-to-all; server stage: each owner averages, recompresses and all-gathers), after which
// every rank holds the same result. Distributed optimizer: the worker stage only (a compressed
// reduce-scatter); each owner keeps its shards' average.
//
// The compressed vector y is laid out in pieces, each split into equal shards per destination
// (ChunkPlan); segments map buffer ranges to places in y:
//   plain (the optimizer state is whole on every rank): one piece per gradient bucket, holding the
//     bucket's elements except a tied embedding's, zero-padded to 16 x group size;
//   distributed optimizer: one piece per bucket, the bucket as it is (its shards are the ranges
//     the optimizer owns); a tied embedding's elements there are zeros;
//   then, when this rank holds a tied embedding across pipeline stages (embedding.wte on the first
//     stage, its copy on the last), a piece of its own: the embedding, zero-padded.
// The tied piece: the two copies must get the same update, bit for bit. Both stages build it
// alike and hold the same inputs (the same momentum and frozen variance, the gradient summed over
// the embedding group before the exchange, PipelineModel::finish_tied_embedding, and the same
// errors), so both compute the same result, and the embedding is compressed in the same blocks as
// at pp = 1 where its group is a bucket of its own. It is compressed, not averaged exactly, so that
// a pipeline runs the algorithm of pp = 1 and saves its bytes (the embedding is the largest tensor:
// averaging it in fp32 kept 62% of the demo's DP bytes at pp = 2, README Benchmarks); the exact
// momentum update with a frozen variance also lacks the compressor's per-block bound on rows whose
// gradient grew since the freeze (rare tokens'). Its int8 rounding draws the same
// random numbers on both stages (compression.h's Rounding). With the distributed optimizer the
// tied piece also takes the server stage (its own all-gather): the stages shard their optimizer
// state differently, so every rank decompresses the whole embedding's estimate and takes its own
// elements.
// Parameters replicated over TP (tp > 1: norms, biases of row-parallel layers, the router, the
// experts' proj.bias) are averaged exactly by one fp32 all-reduce: each TP rank lays them out at
// other offsets and cuts its blocks elsewhere, so compressing them would let the replicas drift
// apart. They, and the padding between parameters, are zeros in y and in the errors.
//
// Host memory: the compression loops run on the host, on host views of the gradient and Adam's
// moments (the callers' staging copies where backend memory is not host memory), over the groups'
// host-memory communicators. Work buffers (host memory, allocated at construction): y and the
// worker error (y's layout), the server error and average over this rank's shards of every piece,
// the exact sums, the two messages. Checkpoints see the errors per buffer range (CheckpointExtra,
// host memory), whatever y's layout.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/checkpoint/checkpoint.h"
#include "trainer/config/config.h"
#include "trainer/params/param_layout.h"
#include "trainer/optim/compression.h"
#include "trainer/optim/grad_buffer.h"

namespace tetra {

class Communicator;

// Buffer elements [buf, buf + numel) are y's [y, y + numel).
struct ExchangeSegment {
  int64_t buf = 0, y = 0, numel = 0;
};

// How a part of the buffer crosses a group of `size` ranks in a compressed step; comm_volume.cpp
// predicts the step's volume from it.
struct ExchangePlan {
  int64_t begin = 0, end = 0;          // the part: buffer elements [begin, end)
  Codec codec = Codec::SIGN;           // onebit: SIGN, int8: INT8
  bool sharded = false;                // the distributed optimizer shards the part's state
  ChunkPlan chunks;                    // the pieces of y (begin: y offsets), the tied piece last
  std::vector<ExchangeSegment> segments; // in y order, the tied embedding's last
  int64_t y_numel = 0;
  int64_t tied_offset = -1;            // the tied embedding's buffer offset (-1: none)
  int64_t tied_numel = 0;
  int64_t tied_words = 0;              // one destination's words of the tied piece
  std::vector<GradRange> exact;        // TP replicas (buffer offsets, in order)
  int64_t exact_numel = 0;
};
// `part`: layout_part() of this rank's layout (dense or experts); the codec from
// parallel.grad_compression.
ExchangePlan plan_exchange(const Config& cfg, const ParamLayout& part, int64_t size);

class CompressedExchange {
 public:
  // `buffer`: the part's GradBuffer (its owned ranges are the optimizer's); `group`: DP or
  // expert-DP, the host-memory communicator (null or size 1: nothing to exchange). onebit without
  // the distributed optimizer exchanges the momentum, otherwise the gradient. `key`: names this
  // rank's worker error in checkpoints ("dp1of4", "edp0of2_ep2"); `part_id`: 0 dense, 1 experts
  // (rounding streams).
  CompressedExchange(const Config& cfg, const ParamLayout& part, const GradBuffer& buffer, Communicator* group,
                     const std::string& key, int part_id);

  // `grads` (host memory): the whole buffer, this rank's unreduced gradient in the part.
  // Afterwards the part holds the new momentum (onebit, plain) or the gradient estimate
  // (everywhere plain, or on the ranges the optimizer owns). `m`: Adam's momentum (onebit, plain),
  // `v`: the frozen variance (onebit, the whole part), both host memory indexed by buffer offset,
  // else null. `step`: the 0-based step (int8 rounding).
  void exchange(float* grads, const float* m, const float* v, int64_t step);
  // The exchange yields the momentum (else the gradient estimate).
  bool momentum() const { return momentum_; }

  // The error-feedback buffers (checkpoints), appended to `out`: the worker error (kind
  // "optim/<codec>_worker_error/<key>", onebit with the distributed optimizer "..._sharded") and
  // the server error of this rank's shards ("optim/<codec>_server_error"; onebit with the
  // distributed optimizer has the tied piece's only, "optim/onebit_server_error_sharded": the
  // residual of a gradient estimate, not of a momentum). <codec>: onebit or int8.
  void checkpoint_state(std::vector<CheckpointExtra>& out);

 private:
  // Appends to `out` the buffer ranges of y's [y0, y0 + numel) (whose values are at `data`), one
  // extra each; a tied embedding's elements only from the tied piece.
  void add_extras(std::vector<CheckpointExtra>& out, const std::string& kind, float* data, int64_t y0,
                  int64_t numel) const;

  const Config& cfg_;
  Communicator* group_;
  bool momentum_;
  std::string key_;
  uint64_t rounding_key_ = 0;          // int8: this rank's and part's Philox key
  ExchangePlan plan_;
  std::vector<GradRange> mine_;        // this rank's shard of every piece (y offsets)
  int64_t mine_numel_ = 0;
  std::vector<GradRange> excluded_y_;     // zeros in y: padding, TP replicas (and a tied embedding
  std::vector<GradRange> excluded_mine_;  // in its bucket); the same within the compact shards
  ChunkPlan tied_only_;                // the tied piece alone (its server stage, distributed optimizer)
  int64_t tied_mine_at_ = 0;           // where the tied shard starts in the compact shards
  // Host memory, zeroed at construction:
  std::vector<float> y_;               // (y_numel)
  std::vector<float> worker_error_;    // (y_numel)
  std::vector<float> server_error_;    // (mine_numel)
  std::vector<float> avg_;             // (mine_numel)
  std::vector<float> exact_sum_;       // (exact_numel)
  std::vector<uint16_t> send_;         // (size * words), destination-major
  std::vector<uint16_t> recv_;         // (size * words), source-major
};

}  // namespace tetra
