#include "trainer/train/memory_plan.h"

#include <numeric>

#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include <fmt/format.h>

#include "kernels/common/check.h"
#include "kernels/common/dtype.h"
#include "trainer/comm/launcher.h"
#include "trainer/model/gpt.h"
#include "trainer/optim/grad_buffer.h"
#include "trainer/optim/grad_buffers.h"
#include "trainer/optim/weight_units.h"
#include "trainer/train/generate.h"
#include "trainer/train/pipeline_model.h"

namespace tetra {

namespace {

// Processes of this job on this machine (they share its memory), as the launcher says.
int64_t local_ranks() { return launcher_local_size(); }

}  // namespace

bool samples_enabled(const Config& cfg) {
  return !cfg.sample.prompt.empty() && !cfg.data.tokenizer.empty() && cfg.training.eval_steps > 0;
}

ParamLayout rank_layout(const Config& cfg, int64_t tp_rank, int64_t pp_rank, int64_t ep_rank) {
  TensorSlicing slicing;
  slicing.tp = cfg.parallel.tp;
  slicing.tp_rank = tp_rank;
  slicing.ep = cfg.parallel.ep;
  slicing.ep_rank = ep_rank;
  slicing.etp = cfg.parallel.expert_tp();
  slicing.etp_rank = tp_rank % slicing.etp;
  slicing.sequence_parallel = cfg.parallel.sequence_parallel;
  // Buckets split into dp aligned shards: the distributed optimizer's, and onebit's and int8's chunks.
  const GradCompression gc = cfg.parallel.grad_compression;
  const bool shards =
      cfg.parallel.distributed_optimizer || gc == GradCompression::ONEBIT || gc == GradCompression::INT8;
  // (A group's experts shard over expert-DP x cp: with folded experts not always a divisor of dp x cp.)
  slicing.group_align = shards ? 16 * std::lcm(cfg.parallel.dp_cp(), cfg.model.moe.enabled() ? cfg.parallel.edp_cp() : 1) : 16;
  return ParamLayout::build(cfg.model, slicing, stage_slice(cfg, pp_rank));
}

MemoryPlan plan_memory(const Config& cfg, const ParamLayout& layout, int64_t pp_rank) {
  const DType act = precision_dtype(cfg.training.precision);
  const int64_t B = cfg.training.micro_batch_size, T = cfg.model.seq_len;
  const size_t n = static_cast<size_t>(layout.total);
  // The distributed optimizer keeps Adam's moments (and, in bf16 / fp16, the fp32 master weights) for
  // this rank's shard only: 1/dp of the dense part, and of a MoE model's expert part 1/(dp/ep), the
  // expert-data-parallel group that shares each expert (grad_buffers.h).
  auto numel = [](const ParamLayout& part) {
    return part.groups.empty() ? size_t{0} : static_cast<size_t>(part.groups.back().second - part.groups.front().first);
  };
  const size_t dense_n = numel(layout_part(layout, false)), expert_n = numel(layout_part(layout, true));
  const size_t shard = cfg.parallel.distributed_optimizer
                           ? dense_n / static_cast<size_t>(cfg.parallel.dp_cp()) +
                                 expert_n / static_cast<size_t>(cfg.parallel.edp_cp())
                           : n;
  MemoryPlan m;
  // ZeRO-3 (weight_units.h): the optimizer holds the fp32 master shard in every precision, the
  // 16-bit compute weights are a shard too (fp32: the master shard itself), and the units gathered.
  const bool zero3 = cfg.parallel.zero_stage == 3 && cfg.parallel.dp_cp() > 1;
  m.master = act == DType::F32 && !zero3 ? n * 4 : shard * 4;
  m.compute = act == DType::F32 ? 0 : (zero3 ? shard : n) * dtype_size(act);
  if (zero3) m.units = WeightUnits::buffer_bytes(layout, act, /*keep=*/!cfg.parallel.reshards_after_forward());
  m.grads = n * 4;
  const bool zero2 = cfg.parallel.zero_stage >= 2 && cfg.parallel.dp_cp() > 1;
  if (zero2) {
    // ZeRO-2 (grad_buffer.h): this rank's fp32 shard, and the staging buffers of the buckets being
    // written and reduced (GradBuffer::StagingPlan; the expert part's only where expert-DP > 1).
    const auto pool = [&](const ParamLayout& part, bool tied) -> size_t {
      if (part.groups.empty()) return 0;
      return static_cast<size_t>(GradBuffer::staging_plan(part, cfg.parallel.gradient_bucket_size(), tied).bytes());
    };
    m.grads = std::max<size_t>(shard, 1) * 4 + pool(layout_part(layout, false), cfg.model.tie_embeddings) +
              (cfg.parallel.edp_cp() > 1 ? pool(layout_part(layout, true), false) : 0);
  }
  m.optimizer = shard * 8;
  // Gradient compression's buffers (grad_buffer.h, compressed_exchange.h): the bf16 copy of the buffer
  // (backend memory); onebit / int8 on the host: the worker error and the scaled input (n each), the
  // server error and average (n / dp each), the two messages (1 bit or 1 byte per element) and, for
  // sharded onebit, the whole frozen variance; on a GPU also the host staging of the gradient (and
  // for onebit of the variance, and for plain onebit of the momentum).
  const size_t dp = static_cast<size_t>(cfg.parallel.dp_cp());
  m.on_device = cfg.training.device != Device::CPU;
  const GradCompression gc = cfg.parallel.grad_compression;
  if (dp > 1 && gc == GradCompression::BF16)  // ZeRO-2: one bucket's bf16 copy (grad_buffer.h)
    m.grads += zero2 ? static_cast<size_t>(std::max<int64_t>(1, GradBuffer::staging_plan(
                           layout_part(layout, false), cfg.parallel.gradient_bucket_size(), cfg.model.tie_embeddings).largest())) * 2
                     : n * 2;
  const bool onebit = gc == GradCompression::ONEBIT, int8 = gc == GradCompression::INT8;
  if (dp > 1 && (onebit || int8)) {
    m.compression = 2 * n * 4 + 2 * (n / dp) * 4 + (onebit ? n / 2 : 2 * n);
    if (onebit && cfg.parallel.distributed_optimizer) m.compression += n * 4;
    if (m.on_device) m.compression += n * 4 + (onebit ? n * 4 : 0) + (onebit && !cfg.parallel.distributed_optimizer ? n * 4 : 0);
  }
  m.activations = PipelineModel::activation_bytes_for(cfg, pp_rank);
  const size_t input_grads = PipelineModel::input_grad_bytes_for(cfg, pp_rank);
  m.buffers = input_grads;
  if (cfg.parallel.tp > 1) m.buffers += GradBuffer::sp_scratch_bytes(layout);
  m.batch = static_cast<size_t>(cfg.grad_accum_steps() * B * T) * 12 +  // tokens, targets, losses
            (cfg.model.moe.router_enable_expert_bias ? moe_expert_bias_count_bytes(cfg.model) : 0);
  const int64_t vl = cfg.model.padded_vocab_size(cfg.parallel.tp) / cfg.parallel.tp;  // vocabulary rows per rank
  if (samples_enabled(cfg))  // the sampling model's arena and its (T) ids, two logit rows and chosen id
    m.sampling = Gpt::activation_bytes_for(cfg.model, act, 1, cfg.parallel.tp, false, {}, cfg.parallel.ep, {}, 0, 1,
                                           CpComm::P2P, cfg.parallel.expert_tp()) +
                 static_cast<size_t>(T) * 4 + (cfg.parallel.ep > 1 ? 4 : 0) +
                 static_cast<size_t>(vl) * 4 +                              // its logit row
                 (cfg.parallel.tp > 1 ? static_cast<size_t>(vl * cfg.parallel.tp) * 4 : 0) +  // gathered
                 (zero3 ? n * dtype_size(act) : 0);  // ZeRO-3: the whole weights it reads, gathered
  if ((act != DType::F32 || zero3) && cfg.parallel.distributed_optimizer) {
    const size_t without_activations = m.total() - m.activations - input_grads - m.units;
    if (cfg.parallel.dp_cp() > 1) {
      // The optimizer owns the master shard: no rank makes the whole fp32 weights at start-up (each
      // generates its shard, trainer_weights.cpp); the final weights are written bucket by bucket,
      // the largest bucket's fp32 gathered at a time, beside everything but the activations.
      int64_t largest = 0;
      for (const bool experts : {false, true}) {
        const ParamLayout part = layout_part(layout, experts);
        if (part.groups.empty()) continue;
        for (const BucketPlan& b : plan_buckets(part, cfg.parallel.gradient_bucket_size()))
          largest = std::max(largest, b.end - b.begin);
      }
      m.staging = final_weights_path(cfg).empty() ? 0 : static_cast<size_t>(largest) * 4;
      m.staging_held = m.staging ? without_activations : 0;
    } else {
      // The whole fp32 weights (trainer.cpp): at start-up beside everything but the activations,
      // the batch buffers and the sampling model (allocated after); at the end, when the final
      // weights are written, beside everything but the activations (freed before).
      m.staging = n * 4;
      m.staging_held = final_weights_path(cfg).empty() ? without_activations - m.batch - m.sampling : without_activations;
    }
  }
  return m;
}

void check_host_memory(const Config& cfg, const MemoryPlan& plan, int64_t world) {
  const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  const double ranks_here = static_cast<double>(std::min<int64_t>(world, local_ranks()));
  if (physical > 0 && static_cast<double>(plan.host_bytes()) * ranks_here > 0.95 * physical)
    throw InputError(fmt::format(
        "the run needs {:.1f} GiB of host memory per rank x {} ranks on this machine ({}) but it has "
        "{:.1f} GiB of memory: {}",
        plan.host_bytes() / 1073741824.0, ranks_here,
        plan.on_device ? "gradient compression's buffers"
                       : fmt::format("{:.1f} GiB of activations for training.micro_batch_size {}",
                                     plan.activations / 1073741824.0, cfg.training.micro_batch_size),
        physical / 1073741824.0,
        plan.on_device ? "use parallel.grad_compression bf16 or none, or more ranks per model (tp, pp)"
                       : "lower training.micro_batch_size (use global_batch_size for gradient accumulation), "
                         "model.seq_len or the model size, or use more tensor parallelism / the distributed "
                         "optimizer"));
}

}  // namespace tetra
