// What one rank of a run takes, from the config alone: the layout of its parameter buffer and the
// bytes of every buffer the trainer allocates (weights, gradients, optimizer state, activations,
// batches, the sampling model, gradient compression's buffers). The Trainer allocates exactly these
// buffers; --dry-run shows them for any layout before a job is launched.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>

#include "trainer/config/config.h"
#include "trainer/params/param_layout.h"

namespace tetra {

// The buffer of the step's tokens per expert that MoE auxiliary-loss-free balancing reduces: one
// int32 per expert of every block.
inline size_t moe_expert_bias_count_bytes(const ModelConfig& m) {
  return static_cast<size_t>(m.num_layers * m.moe.num_experts) * 4;
}

struct MemoryPlan {
  size_t master = 0, compute = 0, grads = 0, optimizer = 0, activations = 0, batch = 0;
  size_t sampling = 0;  // the micro-batch-1 model of the text samples (when they are on)
  // onebit / int8 gradient compression: error feedback, messages and (on a GPU) the staging copies
  // of the gradient and moments. Always host memory: the compression runs on the host.
  size_t compression = 0;
  // Communication and packing buffers: the pipeline's input-gradient buffers and the
  // sequence-parallel norm-gradient scratch.
  size_t buffers = 0;
  // ZeRO-3: the two buffers gathered weight units are read from (weight_units.h), made with the
  // model after the whole fp32 weights are freed, and freed with it before the final weights.
  size_t units = 0;
  // The distributed optimizer with 16-bit compute (or ZeRO-3) keeps only its shard of the fp32
  // weights: the final weights are gathered a bucket at a time after the activations are freed
  // (the largest bucket's fp32; none at start-up, where each rank generates its own shard). On one
  // DP rank (dp x cp 1) the whole fp32 weights at start-up and for the final weights. Checkpoints
  // are saved and loaded from the shards. `staging_held`: what is held beside it then.
  size_t staging = 0, staging_held = 0;
  bool on_device = false;  // training.device is a GPU: everything but `compression` is GPU memory
  // What is held through the steps.
  size_t total() const {
    return master + compute + grads + optimizer + activations + batch + sampling + compression + buffers + units;
  }
  // The most held at once (what the backend's measured peak is checked against).
  size_t peak() const { return std::max(total(), staging ? staging_held + staging : 0); }
  size_t device_bytes() const { return on_device ? peak() - compression : 0; }
  size_t host_bytes() const { return on_device ? compression : peak(); }
};

// Text samples at evaluations: sample.prompt and data.tokenizer set, and training.eval_steps > 0.
bool samples_enabled(const Config& cfg);

// The layout of this rank's parameter buffer: its TP slice of its pipeline stage (and its EP
// rank's experts), groups aligned for the distributed optimizer's shards.
ParamLayout rank_layout(const Config& cfg, int64_t tp_rank, int64_t pp_rank = 0, int64_t ep_rank = 0);

// What one rank will take, computed from the config alone (for --dry-run and the start-up log).
// `layout`: rank_layout(cfg, ..., pp_rank).
MemoryPlan plan_memory(const Config& cfg, const ParamLayout& layout, int64_t pp_rank = 0);

// Linux overcommits: an allocation larger than the machine succeeds and the process is killed
// later. InputError, with the numbers, when `plan`'s host memory times the ranks of this job on
// this machine (at most `world`; they share its memory) exceeds 95% of it.
void check_host_memory(const Config& cfg, const MemoryPlan& plan, int64_t world);

}  // namespace tetra
