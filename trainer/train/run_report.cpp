#include "trainer/train/run_report.h"

#include <iterator>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "trainer/parallel/pipeline_schedule.h"
#include "trainer/train/generate.h"
#include "trainer/train/pipeline_model.h"

namespace tetra {

namespace {

std::string human_count(double n) {
  if (n >= 1e12) return fmt::format("{:.2f}T", n / 1e12);
  if (n >= 1e9) return fmt::format("{:.2f}B", n / 1e9);
  if (n >= 1e6) return fmt::format("{:.2f}M", n / 1e6);
  if (n >= 1e3) return fmt::format("{:.2f}K", n / 1e3);
  return fmt::format("{:.0f}", n);
}

std::string mib(size_t bytes) { return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / 1048576.0); }

}  // namespace

RunReport describe_run(const Config& cfg, const ParamLayout& layout, int64_t pp_rank) {
  RunReport r;
  r.cfg = &cfg;
  r.model = model_stats(cfg.model, ParamLayout::build(cfg.model));
  r.pp_rank = pp_rank;
  r.layout = layout;
  r.memory = plan_memory(cfg, layout, pp_rank);
  r.predicted = predict_step_volume(cfg, layout);
  return r;
}

void log_run_report(const RunReport& report, const RunEnvironment& env) {
  const Config& cfg = *report.cfg;
  const ModelStats& stats = report.model;
  const MemoryPlan& plan = report.memory;
  const StepVolume& predicted = report.predicted;
  const int64_t B = cfg.training.micro_batch_size, T = cfg.model.seq_len;
  spdlog::info("model: {} parameters ({} in matmuls), {} layers, hidden {}, heads {}/{} (q/kv), ffn {}, "
               "vocab {}{}, seq_len {}, {} + {} + {} positions",
               stats.params, stats.matmul_params, cfg.model.num_layers, cfg.model.hidden_size,
               cfg.model.num_heads, cfg.model.num_kv_heads, cfg.model.ffn_hidden_size, cfg.model.vocab_size,
               cfg.model.padded_vocab_size(cfg.parallel.tp) == cfg.model.vocab_size
                   ? std::string()
                   : fmt::format(" (padded to {} rows, {} per tp rank: make_vocab_size_divisible_by {} x tp {}; "
                                 "the padding is never predicted)",
                                 cfg.model.padded_vocab_size(cfg.parallel.tp),
                                 cfg.model.padded_vocab_size(cfg.parallel.tp) / cfg.parallel.tp,
                                 cfg.model.make_vocab_size_divisible_by, cfg.parallel.tp),
               cfg.model.seq_len, to_string(cfg.model.norm), to_string(cfg.model.activation),
               to_string(cfg.model.position));
  if (cfg.model.moe.enabled())
    spdlog::info("moe: {} experts (ffn {}), top-{}, every {} blocks{}, {}; {} active parameters per token; ep {}",
                 cfg.model.moe.num_experts, cfg.model.moe.ffn_hidden_size, cfg.model.moe.top_k, cfg.model.moe.every,
                 cfg.model.moe.has_shared_expert()
                     ? fmt::format(", a shared expert (ffn {}{})", cfg.model.moe.shared_expert_ffn_hidden_size,
                                   cfg.model.moe.shared_expert_gate ? ", gated" : "")
                     : std::string(),
                 cfg.model.moe.capacity_factor ? fmt::format("capacity factor {}", *cfg.model.moe.capacity_factor)
                                               : std::string("dropless"),
                 stats.active_params, cfg.parallel.ep);
  spdlog::info("layout: {} ranks = tp {} x {}pp {} x dp {} (order {}){}{}; {} gradient bucket(s)",
               env.world, cfg.parallel.tp,
               cfg.parallel.cp > 1 ? fmt::format("cp {} ({}) x ", cfg.parallel.cp, to_string(cfg.parallel.cp_comm)) : "",
               cfg.parallel.pp, cfg.parallel.dp, to_string(cfg.parallel.order),
               cfg.parallel.sequence_parallel ? ", sequence parallel" : "",
               cfg.parallel.distributed_optimizer ? ", distributed optimizer" : "", env.gradient_buckets);
  spdlog::info("run: backend {} per rank, precision {}, micro-batch {} x {} accumulation "
               "x dp {} = global batch {} ({} tokens/step), {} steps, {:.2f} GFLOP/token",
               env.backend, to_string(cfg.training.precision), B, cfg.grad_accum_steps(), cfg.parallel.dp,
               cfg.training.global_batch_size, cfg.training.global_batch_size * T, cfg.training.steps,
               stats.train_flops_per_token / 1e9);
  spdlog::info("memory per rank: {:.1f} MiB (weights {:.1f}, grads {:.1f}, optimizer {:.1f}, activations "
               "{:.1f}{}); peak {:.1f} GFLOP/s per rank ({})",
               plan.total() / 1048576.0, (plan.master + plan.compute) / 1048576.0, plan.grads / 1048576.0,
               plan.optimizer / 1048576.0, plan.activations / 1048576.0,
               plan.compression ? fmt::format(", gradient compression {:.1f}{}", plan.compression / 1048576.0,
                                              plan.on_device ? " on the host" : "")
                                : std::string(),
               env.rank_peak_flops / 1e9, env.peak_source);
  if (env.samples)
    spdlog::info("samples: at each evaluation, up to {} tokens after \"{}\" (temperature {}, top-k {}, "
                 "seed {}, tokenizer {})",
                 cfg.sample.max_tokens, escape_text(cfg.sample.prompt), cfg.sample.temperature,
                 cfg.sample.top_k, cfg.sample.seed, to_string(cfg.data.tokenizer));
  else if (!cfg.sample.prompt.empty() && cfg.training.eval_steps == 0)
    spdlog::info("samples: none during training (sample.prompt is set but training.eval_steps is 0)");
  if (env.world > 1)
    spdlog::info("communication per step (predicted): tp: {}; dp: {}{}{}", predicted.tp.describe(),
                 predicted.dp.describe(),
                 cfg.parallel.cp > 1 ? "; cp: " + predicted.cp.describe() : std::string(),
                 cfg.model.moe.enabled()
                     ? fmt::format("; edp: {}; ep: {} + the routed tokens{}", predicted.edp.describe(),
                                   predicted.ep.describe(),
                                   cfg.parallel.expert_shares() > 1
                                       ? fmt::format("; etp: {}; eshare: {}", predicted.etp.describe(),
                                                     predicted.eshare.describe())
                                       : std::string())
                     : std::string());
  if (env.onebit_compresses) {
    const StepVolume compressed = predict_step_volume(cfg, report.layout, true);
    spdlog::info("communication per step after the {} warm-up steps of onebit (predicted): dp: {}{}",
                 cfg.parallel.onebit_warmup_steps, compressed.dp.describe(),
                 cfg.model.moe.enabled() ? "; edp: " + compressed.edp.describe() : "");
  }
}

std::string dry_run_report(const Config& cfg) {
  const RunReport report = describe_run(cfg, rank_layout(cfg, 0), 0);
  const ModelStats& stats = report.model;
  const MemoryPlan& mem = report.memory;
  const StepVolume& v = report.predicted;
  const ParallelConfig& par = cfg.parallel;
  const MoeConfig& moe = cfg.model.moe;
  const double tokens = static_cast<double>(cfg.training.global_batch_size * cfg.model.seq_len);
  std::string text;
  auto out = std::back_inserter(text);
  fmt::format_to(out, "parameters:        {} ({}; {} in matmuls)\n", stats.params, human_count(stats.params),
                 human_count(stats.matmul_params));
  if (moe.enabled())
    fmt::format_to(out, "active parameters: {} per token ({} in matmuls; {} experts, top-{}, every {} blocks{})\n",
                   human_count(stats.active_params), human_count(stats.active_matmul_params), moe.num_experts,
                   moe.top_k, moe.every, moe.has_shared_expert() ? ", a shared expert always active" : "");
  fmt::format_to(out, "FLOPs per token:   {} (training step: 6 x {}matmul params + 12 L C T)\n",
                 human_count(stats.train_flops_per_token), moe.enabled() ? "active " : "");
  fmt::format_to(out, "FLOPs per step:    {} ({} tokens, {} micro-batches of {} on each of {} DP ranks)\n",
                 human_count(stats.train_flops_per_token * tokens), tokens, cfg.grad_accum_steps(),
                 cfg.training.micro_batch_size, par.dp);
  fmt::format_to(out, "layout:            {} ranks = tp {} x {}pp {} x dp {}{}, order {}{}{}\n",
                 par.world(), par.tp,
                 par.cp > 1 ? fmt::format("cp {} ({}, seq_len {} in chunks of {}) x ", par.cp, to_string(par.cp_comm),
                                          cfg.model.seq_len, cfg.model.seq_len / (2 * par.cp))
                            : "",
                 par.pp, par.dp,
                 cfg.model.moe.enabled() && (par.ep > 1 || par.expert_shares() > 1)
                     ? fmt::format(" (experts: {}ep {} x edp {})",
                                   par.expert_shares() > 1 ? fmt::format("etp {} x ", par.expert_tp()) : "", par.ep,
                                   par.edp_cp() / par.cp)
                     : "",
                 to_string(par.order),
                 par.sequence_parallel ? ", sequence parallel" : "",
                 par.distributed_optimizer ? ", distributed optimizer" : "");
  if (par.pp > 1) {
    const PipelineSchedule schedule = make_schedule(cfg, cfg.grad_accum_steps());
    fmt::format_to(out, "pipeline:          schedule {}, {} stages ({} x {} chunk(s)), {} micro-batches per step, "
                   "ideal bubble {:.1f}%\n",
                   to_string(par.schedule), par.pp * par.virtual_stages, par.pp, par.virtual_stages,
                   cfg.grad_accum_steps(), 100.0 * schedule.ideal_bubble());
    for (int64_t r = 0; r < par.pp; ++r) {
      const StageSlice st = stage_slice(cfg, r);
      std::string layers;
      for (const auto& [b, e] : st.chunks)
        layers += (layers.empty() ? "" : ", ") + (e > b ? fmt::format("{}-{}", b, e - 1) : std::string("none"));
      fmt::format_to(out, "  rank {:<3}         layers {}{}{}; {} micro-batch(es) in flight; {}\n", r, layers,
                     st.first ? " + embedding" : "", st.last ? " + output layer and loss" : "",
                     schedule.max_in_flight(static_cast<int>(r)),
                     mib(plan_memory(cfg, rank_layout(cfg, 0, r), r).peak()));
    }
  }
  std::string largest;  // the pipeline rank that needs the most, when it is not rank 0
  if (par.pp > 1) {
    int64_t worst = 0;
    size_t most = mem.peak();
    for (int64_t r = 1; r < par.pp; ++r) {
      const size_t p = plan_memory(cfg, rank_layout(cfg, 0, r), r).peak();
      if (p > most) most = p, worst = r;
    }
    largest = worst == 0 ? " (pipeline rank 0, the largest)"
                         : fmt::format(" (pipeline rank 0; the largest is rank {}'s, {})", worst, mib(most));
  }
  fmt::format_to(out, "memory per rank:   {} at the peak{}{}\n", mib(mem.peak()), largest,
                 mem.on_device && mem.compression
                     ? fmt::format(": {} on the GPU, {} on the host", mib(mem.device_bytes()), mib(mem.host_bytes()))
                     : std::string());
  fmt::format_to(out, "  master weights   {} (fp32{})\n", mib(mem.master),
                 par.distributed_optimizer && (cfg.training.precision != Precision::FP32 || mem.units) ? ", 1/dp shard"
                                                                                                       : "");
  if (mem.compute)
    fmt::format_to(out, "  compute weights  {} ({}{})\n", mib(mem.compute), to_string(cfg.training.precision),
                   mem.units ? ", 1/dp shard" : "");
  if (mem.units)
    fmt::format_to(out, "  weight units     {} (ZeRO-3: {})\n", mib(mem.units),
                   par.reshards_after_forward() ? "two parameter groups gathered at a time"
                                                : "every parameter group kept from its first gather to the step's end "
                                                  "(reshard_after_forward false)");
  if (par.zero_stage >= 2 && par.dp_cp() > 1) {
    Config stage1 = cfg;
    stage1.parallel.zero_stage = 1;
    const MemoryPlan one = plan_memory(stage1, rank_layout(stage1, 0));
    fmt::format_to(out, "  gradients        {} (fp32, ZeRO-{}: 1/(dp x cp) shard and the buckets' staging; {} whole)\n",
                   mib(mem.grads), par.zero_stage, mib(one.grads));
  } else {
    fmt::format_to(out, "  gradients        {} (fp32)\n", mib(mem.grads));
  }
  fmt::format_to(out, "  optimizer        {} (AdamW moments, fp32{})\n", mib(mem.optimizer),
                 par.distributed_optimizer ? ", 1/dp shard" : "");
  if (par.distributed_optimizer && par.dp_cp() > 1) {
    Config plain = cfg;
    plain.parallel.distributed_optimizer = false;
    plain.parallel.zero_stage = 0;
    const MemoryPlan without = plan_memory(plain, rank_layout(plain, 0));
    fmt::format_to(out, "    the distributed optimizer {} {} per rank ({} without it)\n",
                   par.zero_stage >= 2 ? fmt::format("and ZeRO-{} save", par.zero_stage) : std::string("saves"),
                   mib(without.peak() - mem.peak()), mib(without.peak()));
  }
  if (par.dp_cp() > 1) {  // the same layout's peak under each ZeRO stage, to choose one before a job starts
    std::string stages;
    for (int64_t z = 0; z <= 3; ++z) {
      Config c = cfg;
      c.parallel.zero_stage = z;
      c.parallel.distributed_optimizer = z >= 1;
      std::string refused;
      if (z >= 2 && (par.grad_compression == GradCompression::ONEBIT || par.grad_compression == GradCompression::INT8))
        refused = "not with grad_compression " + std::string(to_string(par.grad_compression));
      stages += fmt::format("{}{}: {}{}", z == 0 ? "" : ", ", z,
                            refused.empty() ? mib(plan_memory(c, rank_layout(c, 0)).peak()) : refused,
                            z == par.zero_stage ? " (this run)" : "");
    }
    fmt::format_to(out, "  ZeRO stages      {} at the peak per rank\n", stages);
  }
  {
    // Kept per micro-batch in flight (the rank's slots, shared by its chunks), and the chunks'
    // shared scratch.
    const ActivationSplit split = PipelineModel::activation_split(cfg, 0);
    const TrainingConfig& t = cfg.training;
    std::string rc(to_string(t.recompute));
    if (t.recompute == Recompute::SELECTIVE) {
      std::string mods;
      for (RecomputeModule m : t.recompute_modules) mods += (mods.empty() ? "" : ", ") + std::string(to_string(m));
      rc += " (" + mods + ")";
    } else if (t.recompute == Recompute::FULL) {
      rc += fmt::format(" ({}, {} layer(s))", to_string(t.recompute_method), t.recompute_num_layers);
    }
    fmt::format_to(out, "  activations      {} (micro-batch {}; recompute {}): {} kept in {} slot(s) of micro-batches "
                   "in flight (shared by the rank's chunks) + {} scratch\n",
                   mib(mem.activations), t.micro_batch_size, rc, mib(split.kept), split.slots,
                   mib(split.scratch));
  }
  if (mem.compression)
    fmt::format_to(out, "  compression      {} ({}: error feedback and messages{}, host memory)\n",
                   mib(mem.compression), to_string(par.grad_compression),
                   mem.on_device ? ", staging of the gradient and moments" : "");
  fmt::format_to(out, "  batch buffers    {}\n", mib(mem.batch));
  if (mem.buffers)
    fmt::format_to(out, "  comm buffers     {} (pipeline input gradients, sequence-parallel norm gradients)\n",
                   mib(mem.buffers));
  if (mem.staging)
    fmt::format_to(out, "  staging          {} ({}, when the activations are not allocated: {} held then{})\n",
                   mib(mem.staging),
                   cfg.parallel.dp_cp() > 1 ? "the final weights a bucket at a time: the largest bucket's fp32"
                                            : "the whole fp32 weights, at start-up and for the final weights",
                   mib(mem.staging_held + mem.staging),
                   mem.staging_held + mem.staging > mem.total() ? ", the peak" : "");
  if (mem.sampling)
    fmt::format_to(out, "  sampling         {} (micro-batch 1 model for the text samples)\n", mib(mem.sampling));
  fmt::format_to(out, "communication per step and rank (payload; sent under ring algorithms ~ 2(p-1)/p of an "
                 "all-reduce's, (p-1)/p of the others'):\n");
  fmt::format_to(out, "  tp ({} ranks)      {}\n", par.tp, v.tp.describe());
  fmt::format_to(out, "  dp ({} ranks)      {}{}\n", par.dp_cp(), v.dp.describe(),
                 par.cp > 1 ? " (the DP group spans dp x cp)" : "");
  if (par.cp > 1) fmt::format_to(out, "  cp ({} ranks)      {}\n", par.cp, v.cp.describe());
  if (par.pp > 1) {
    fmt::format_to(out, "  pp ({} ranks)      {}\n", par.pp, v.pp.describe());
    fmt::format_to(out, "  embedding         {}\n", v.embedding.describe());
  }
  if (moe.enabled()) {
    fmt::format_to(out, "  edp ({} ranks)     {}\n", par.edp_cp(), v.edp.describe());
    fmt::format_to(out, "  ep ({} ranks)      {} (plus the routed tokens: all-to-all payload depends on the routing)\n",
                   par.ep, v.ep.describe());
    if (par.expert_shares() > 1) {
      fmt::format_to(out, "  etp ({} ranks)     {}\n", par.expert_tp(), v.etp.describe());
      fmt::format_to(out, "  eshare ({} ranks)  {}\n", par.expert_shares(), v.eshare.describe());
    }
  }
  return text;
}

}  // namespace tetra
