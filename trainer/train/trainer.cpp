#include "trainer/train/trainer.h"

#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <array>
#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <optional>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "kernels/common/check.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/comm/process_groups.h"
#include "trainer/comm/watchdog.h"
#include "trainer/core/files.h"
#include "trainer/core/log.h"
#include "trainer/core/output_path.h"
#include "trainer/core/trace.h"
#include "trainer/data/data_loader.h"
#include "trainer/data/sample_source.h"
#include "trainer/data/tokenizer.h"
#include "trainer/model/sampler.h"
#include "trainer/train/compute_device.h"
#include "trainer/train/fault_injection.h"
#include "trainer/train/generate.h"
#include "trainer/train/memory_plan.h"
#include "trainer/train/pipeline_model.h"
#include "trainer/train/run_report.h"
#include "trainer/train/step_guard.h"
#include "trainer/train/stop_requests.h"
#include "trainer/train/traced_backend.h"

namespace tetra {

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

namespace {

// Every directory the run writes, checked before anything is: logging.dir (train.log,
// metrics.jsonl, the final weights), checkpoint.dir (one checkpoint's fp32 weights and moments),
// --dump-dir. Rank 0 writes them.
// Every rank writes its slices into checkpoint.dir, and under training.profile_steps its timeline
// into logging.dir/trace; only the writer the others.
void check_output_paths(const Config& cfg, const std::string& dump_dir, bool writer) {
  const uint64_t params = static_cast<uint64_t>(ParamLayout::build(cfg.model).total);
  if (writer && !cfg.logging.dir.empty()) {
    check_output_dir("logging.dir", cfg.logging.dir, params * 4);
    // The final weights replace a file there at the end; anything else in their place would only
    // be found then.
    const std::filesystem::path weights = std::filesystem::path(cfg.logging.dir) / "model.safetensors";
    struct stat st {};
    TETRA_INPUT_CHECK(::lstat(weights.c_str(), &st) != 0 || S_ISREG(st.st_mode),
                      "logging.dir: {} is {}, not a file: the run writes its final weights there; move it away or "
                      "choose another logging.dir", weights.string(), file_kind_name(st.st_mode));
    // The files the run appends to, and TensorBoard's directory: found now, before train.log is
    // written, rather than when each is opened.
    for (const char* name : {"train.log", "metrics.jsonl"}) {
      const std::filesystem::path file = std::filesystem::path(cfg.logging.dir) / name;
      TETRA_INPUT_CHECK(::stat(file.c_str(), &st) != 0 || S_ISREG(st.st_mode),
                        "logging.dir: {} is {}, not a regular file: the run appends to it; move it away or choose "
                        "another logging.dir", file.string(), file_kind_name(st.st_mode));
    }
    if (cfg.logging.tensorboard)
      check_output_dir("logging.dir (logging.tensorboard writes an event file in its tensorboard/)",
                       (std::filesystem::path(cfg.logging.dir) / "tensorboard").string());
  }
  if (!writer && !cfg.logging.dir.empty() && !cfg.training.profile_steps.empty())
    check_output_dir("logging.dir (each rank writes its timeline there under training.profile_steps)",
                     cfg.logging.dir);
  if (cfg.checkpoint.saves()) check_output_dir("checkpoint.dir", cfg.checkpoint.dir, params * 12);
  if (writer && !dump_dir.empty()) check_output_dir("--dump-dir", dump_dir, params * 8);
}

}  // namespace

Trainer::Trainer(const Config& cfg, const std::string& config_path, ProcessGroups& groups, std::string dump_dir,
                 const DeviceOptions& device_opts, const StepPlanner& planner)
    : cfg_(cfg),
      groups_(groups),
      writer_(groups.rank == 0),
      layout_(rank_layout(cfg, groups.coord.tp, groups.coord.pp, groups.coord.ep)),
      comm_(cfg, groups) {
  act_ = precision_dtype(cfg.training.precision);
  accum_ = cfg.grad_accum_steps();
  const int64_t B = cfg.training.micro_batch_size, T = cfg.model.seq_len;
  rows_ = B * T / cfg.parallel.cp;  // a CP rank's two chunks of each sequence (context_parallel.h)
  if (cfg.parallel.cp > 1) cp_positions_ = ContextParallel::positions_of(T, static_cast<int>(cfg.parallel.cp),
                                                                        groups.coord.cp);

  const RunReport report = describe_run(cfg, layout_, groups.coord.pp);
  check_host_memory(cfg, report.memory, groups.grid.world());
  // Data first: a missing or malformed dataset is reported before anything large is allocated.
  const int64_t total_train_samples = cfg.training.steps * cfg.training.global_batch_size;
  train_source_ = make_train_source(cfg, total_train_samples);
  if (cfg.training.eval_steps > 0)
    valid_source_ = make_valid_source(cfg, cfg.training.eval_steps * cfg.training.global_batch_size);
  if (samples_enabled(cfg)) tokenizer_ = load_sampling_tokenizer(cfg);
  train_loader_ = std::make_unique<DataLoader>(train_source_, T, B, groups.coord.dp, cfg.parallel.dp);
  // The device too (no GPU, or a build without CUDA, is an input error; nothing is written).
  ComputeDevice device = make_compute_device(cfg.training, act_, device_opts);
  // The checkpoint to resume from is found (or refused) and its manifest checked against this
  // model before any file is written; so is every path the run will write.
  const std::string resume =
      agree_checkpoint_to_resume(cfg.checkpoint, groups, cfg.checkpoint.saves() ? cfg.training.steps : -1);
  // Nothing to resume: checkpoint.init's weights start the run (found as checkpoint.resume's path).
  std::string init;
  if (resume.empty() && !cfg.checkpoint.init.empty()) {
    // A step_* directory, or a checkpoint directory: its newest complete checkpoint.
    CheckpointConfig from = cfg.checkpoint;
    const bool step_dir = std::filesystem::exists(std::filesystem::path(cfg.checkpoint.init) / "manifest.json");
    from.dir = step_dir ? cfg.checkpoint.dir : cfg.checkpoint.init;
    from.resume = step_dir ? ResumeSpec{ResumeKind::PATH, cfg.checkpoint.init} : ResumeSpec{ResumeKind::AUTO, ""};
    init = agree_checkpoint_to_resume(from, groups);
    TETRA_INPUT_CHECK(!init.empty(), "checkpoint.init: {} is neither a checkpoint (no manifest.json) nor a "
                      "checkpoint directory holding one", cfg.checkpoint.init);
    check_same_model(read_manifest(init), cfg);
  }
  if (!resume.empty()) {
    const Manifest manifest = read_manifest(resume);
    check_same_model(manifest, cfg);
    TETRA_INPUT_CHECK(manifest.step <= cfg.training.steps,
                      "{} is at step {}, beyond training.steps ({}): raise training.steps to train on", resume,
                      manifest.step, cfg.training.steps);
  }
  check_output_paths(cfg, dump_dir, writer_);
  spdlog::info("config {}: {}", config_path, config_to_json(cfg).dump());
  spdlog::info("data: train {}{}", train_source_->describe(),
               valid_source_ ? ", valid " + valid_source_->describe() : std::string());

  be_ = std::move(device.backend);
  groups.use_backend_memory(backend_comm_factory(*be_, device_opts));
  // Profiled steps record every op (the communicators above were made for the backend itself).
  if (!cfg.training.profile_steps.empty()) be_ = make_traced_backend(std::move(be_));
  const size_t n = static_cast<size_t>(layout_.total);
  // ZeRO-2 keeps no whole gradient: its shards live in the gradient buffers (grad_buffer.h).
  const bool shard_gradients = cfg.parallel.zero_stage >= 2 && cfg.parallel.dp_cp() > 1;
  if (!shard_gradients) {
    grads_buf_ = BackendBuffer(*be_, n * 4);
    grads_ = grads_buf_.as<float>();
    be_->memset_zero(grads_, n * 4);
  }
  // ZeRO-3 keeps no whole compute weights: its shard is made beside the gradient buffers.
  zero3_ = cfg.parallel.zero_stage == 3 && cfg.parallel.dp_cp() > 1;
  // Where the distributed optimizer owns the fp32 master weights (16-bit compute, or ZeRO-3) no
  // rank makes the whole of them: each generates its own shard (init_params_range, bit for bit the
  // whole buffer's values there) and the compute weights are that shard rounded, all-gathered over
  // DP unless ZeRO-3 keeps them sharded too. Otherwise the rank's whole fp32 weights are the master.
  const bool sharded_start = cfg.parallel.distributed_optimizer && cfg.parallel.dp_cp() > 1 &&
                             (act_ != DType::F32 || zero3_);
  if (!sharded_start) {
    master_buf_ = BackendBuffer(*be_, n * 4);
    master_ = master_buf_.as<float>();
    if (be_->host_memory()) {
      init_params(layout_, cfg.model, cfg.training.seed, master_);
    } else {
      std::vector<float> host(n);
      init_params(layout_, cfg.model, cfg.training.seed, host.data());
      be_->copy_from_host(master_, host.data(), n * 4);
    }
    if (act_ == DType::F32) {
      compute_ = master_;
    } else {
      compute_buf_ = BackendBuffer(*be_, n * dtype_size(act_));
      compute_ = compute_buf_.get();
      be_->cast(compute_, act_, master_, DType::F32, layout_.total);
    }
  }
  if (!dump_dir.empty())
    dump_ = std::make_unique<DebugDump>(cfg, std::move(dump_dir), writer_,
                                        [this](const std::string& file, const float* buffer, double scale) {
                                          dump_tensors(file, buffer, scale);
                                        });
  if (dump_ && master_) dump_->initial_weights(master_);
  // The optimizer first (with the distributed optimizer it copies its shard of the whole fp32
  // weights, which are then freed), the activations after: the whole weights and the activation
  // arenas are never held at once (memory_plan.h's peak).
  grad_buffer_ = std::make_unique<GradBuffers>(layout_, *be_, grads_, groups, cfg.parallel.distributed_optimizer,
                                               cfg.parallel.gradient_bucket_size(),
                                               cfg.parallel.grad_compression == GradCompression::BF16,
                                               shard_gradients, cfg.model.tie_embeddings);
  if (shard_gradients) grads_ = grad_buffer_->shard();
  const size_t es = dtype_size(act_);
  if (zero3_ && act_ != DType::F32) {  // the 16-bit compute shard: the owned ranges back to back
    compute_buf_ = BackendBuffer(*be_, static_cast<size_t>(grad_buffer_->owned_numel()) * es);
    compute_ = compute_buf_.get();
  } else if (sharded_start && !zero3_) {  // 16-bit compute weights, whole (gathered below)
    compute_buf_ = BackendBuffer(*be_, n * es);
    compute_ = compute_buf_.get();
  }
  updater_ = std::make_unique<Updater>(cfg, layout_, *be_, *grad_buffer_, groups, act_, master_, compute_, grads_);
  if (updater_->holds_master_weights()) {
    master_buf_.reset();
    master_ = nullptr;
  }
  if (sharded_start) {
    TETRA_CHECK(updater_->holds_master_weights(), "a sharded start-up without the optimizer's master shard");
    initial_shard_weights(cfg);
  }
  const size_t batch_bytes = static_cast<size_t>(accum_ * rows_) * 4;
  tokens_buf_ = BackendBuffer(*be_, batch_bytes);
  targets_buf_ = BackendBuffer(*be_, batch_bytes);
  losses_buf_ = BackendBuffer(*be_, batch_bytes);
  scalar_buf_ = BackendBuffer(*be_, 64);
  if (cfg.model.moe.router_enable_expert_bias)  // the step's tokens per expert, reduced (memory_plan.cpp)
    moe_counts_buf_ = BackendBuffer(*be_, moe_expert_bias_count_bytes(cfg.model));
  pipe_scratch_buf_ = BackendBuffer(*be_, static_cast<size_t>(2 * cfg.parallel.pp + 2) * 4);
  tokens_ = tokens_buf_.as<int32_t>();
  targets_ = targets_buf_.as<int32_t>();
  losses_ = losses_buf_.as<float>();
  scalar_ = scalar_buf_.as<float>();
  step_scalars_ = scalar_ + 4;
  pipe_scratch_ = pipe_scratch_buf_.as<float>();
  host_batch_.resize(static_cast<size_t>(B * (T + 1)));
  host_inputs_.resize(static_cast<size_t>(rows_));
  host_targets_.resize(static_cast<size_t>(rows_));

  model_ = std::make_unique<PipelineModel>(cfg, layout_, *be_, act_, groups, accum_, tokens_, targets_, losses_);
  if (shard_gradients) model_->set_grad_sink(grad_buffer_.get());
  if (zero3_) {  // the model reads its weights unit by unit, gathered from the compute shards
    const void* shard = act_ == DType::F32 ? static_cast<const void*>(updater_->master_shard()) : compute_;
    units_ = std::make_unique<WeightUnits>(layout_, *be_, groups.backend(GroupKind::DP),
                                           groups.backend(GroupKind::EDP), shard, act_,
                                           /*keep=*/!cfg.parallel.reshards_after_forward());
    units_->set_step_phases(zero3_step_phases(cfg, layout_));
    model_->set_weight_source(units_.get());
  }
  group_done_ = [this](int group, int micro_batches) { grad_buffer_->group_done(group, micro_batches); };
  if (!resume.empty()) {
    const auto l0 = std::chrono::steady_clock::now();
    const CheckpointState st = load_checkpoint(resume, cfg, groups, *be_, checkpoint_buffers());
    spdlog::info("checkpoint {} loaded in {:.2f} s", resume, seconds_since(l0));
    TETRA_INPUT_CHECK(st.step <= cfg.training.steps,
                      "{} is at step {}, beyond training.steps ({}): raise training.steps to train on", resume,
                      st.step, cfg.training.steps);
    start_step_ = st.step;
    train_loader_->set_consumed_samples(st.consumed_samples);
    updater_->resume(st, resume);
    model_->set_moe_expert_bias(st.moe_expert_bias);
  } else if (!init.empty()) {
    const auto l0 = std::chrono::steady_clock::now();
    const CheckpointState st = load_checkpoint(init, cfg, groups, *be_, checkpoint_buffers(), /*weights_only=*/true);
    model_->set_moe_expert_bias(st.moe_expert_bias);
    spdlog::info("checkpoint.init {} loaded in {:.2f} s", init, seconds_since(l0));
  }
  // This run's hold on checkpoint.dir, then the run directory, once everything they depend on has
  // been read and checked (train.log starts with the lines logged so far).
  if (writer_ && cfg.checkpoint.saves())
    checkpoint_lock_ = lock_checkpoint_dir(cfg.checkpoint.dir);
  if (writer_) {
    log_to_file(cfg.logging.dir);
    metrics_ = std::make_unique<MetricsWriter>(cfg.logging.dir, cfg.logging.tensorboard);
  } else {
    metrics_ = std::make_unique<MetricsWriter>("");
  }
  if (tokenizer_) {
    // Without sequence parallelism: for one row of T tokens it would save little, and it would
    // need T divisible by tp. The parameter offsets do not depend on it.
    sample_layout_ = layout_;
    sample_layout_.slicing.sequence_parallel = false;
    // With expert parallelism its MoE blocks exchange rows over the EP group like training's: every
    // rank samples, the ranks of an EP group in lockstep.
    Communicator* tp = &groups.backend(GroupKind::TP);
    Communicator* ep = &groups.backend(GroupKind::EP);
    sample_model_ = std::make_unique<Gpt>(cfg.model, sample_layout_, *be_, act_, 1, tp, /*chunk=*/0, /*slots=*/1, ep,
                                          Recomputation{}, 0, nullptr, nullptr, CpComm::P2P,
                                          &groups.backend(GroupKind::ETP), &groups.backend(GroupKind::ESHARE));
    sampler_ = std::make_unique<Sampler>(*sample_model_, *be_, tp, ep);
    if (zero3_ && samples_enabled(cfg))
      sample_weights_buf_ = BackendBuffer(*be_, static_cast<size_t>(layout_.total) * dtype_size(act_));
  }
  const std::string loss_scaling = updater_->describe_loss_scaling();
  if (!loss_scaling.empty()) spdlog::info("loss scaling: {}", loss_scaling);

  peak_flops_ = device.peak_flops * static_cast<double>(groups.grid.world());
  planned_bytes_ = report.memory.peak();
  train_flops_per_token_ = report.model.train_flops_per_token;
  RunEnvironment env;
  env.world = groups.grid.world();
  env.gradient_buckets = grad_buffer_->num_buckets();
  env.backend = device.description;
  env.rank_peak_flops = device.peak_flops;
  env.peak_source = device.peak_source;
  env.samples = sampler_ != nullptr;
  env.onebit_compresses = updater_->compresses(cfg.training.steps);
  log_run_report(report, env);
  if (planner) {
    // Every rank plans at once: on a CPU the planner measures this machine's rates, which its
    // ranks share; global rank 0's prediction is logged.
    groups.world->barrier();
    const std::optional<PlannedStep> p = planner(cfg, device, groups.grid.world());
    if (p && groups.rank == 0) {
      planned_step_s_ = p->step_s;
      spdlog::info("planned step: {}", p->description);
    }
  }

  profiler_ = std::make_unique<StepProfiler>(cfg, groups, start_step_ + 1);
  // NCCL's waits (a CUDA backend) leave the host running: no busy time to compare.
  straggler_ = std::make_unique<StragglerDetector>(cfg.logging, groups, cfg.training.device != Device::CUDA);
  if (profiler_->enabled() && !be_->host_memory() && writer_)
    spdlog::info("profiled steps synchronise the device after every op (their spans are the ops' times): they run "
                 "slower than the others");

  nlohmann::ordered_json start;
  start["event"] = "start";
  start["params"] = report.model.params;
  start["flops_per_token"] = report.model.train_flops_per_token;
  start["peak_flops"] = peak_flops_;
  start["world"] = groups.grid.world();
  start["memory_plan_bytes"] = report.memory.peak();
  if (planned_step_s_) start["planned_step_ms"] = *planned_step_s_ * 1e3;
  start["activation_plan_bytes"] = report.memory.activations;
  start["optimizer_state_bytes"] = updater_->state_bytes();
  metrics_->event(start.dump());
}

Trainer::~Trainer() {
  if (checkpoint_lock_ >= 0) ::close(checkpoint_lock_);
  sampler_.reset();
  sample_model_.reset();
  updater_.reset();
  grad_buffer_.reset();
  model_.reset();
  units_.reset();
  groups_.use_backend_memory({});  // the backend-memory communicators use be_
  // The BackendBuffer members free their memory next, before be_ goes.
}

CheckpointBuffers Trainer::checkpoint_buffers() {
  CheckpointBuffers b;
  b.layout = &layout_;
  b.owned = &grad_buffer_->owned();
  b.sharded = grad_buffer_->sharded();
  b.master_full = master_;
  b.compute = compute_;
  b.compute_type = act_;
  b.compute_compact = zero3_;
  if (!master_ && compute_ && !zero3_) b.gather_compute = [this] { grad_buffer_->gather_params(compute_, act_); };
  updater_->add_checkpoint_state(b);
  return b;
}

std::string Trainer::sample() {
  TETRA_CHECK(sampler_, "sample() without sample.prompt, data.tokenizer and training.eval_steps");
  if (cfg_.model.moe.router_enable_expert_bias) sample_model_->set_moe_expert_bias(model_->moe_expert_bias());
  if (!zero3_) return generate_text(*sampler_, compute_, *tokenizer_, cfg_.sample.prompt, cfg_.sample);
  // ZeRO-3: the sampling model reads whole weights: every shard gathered into their buffer
  // (memory_plan.h counts it with the sampling model). Not the step's traffic.
  const CommAccounting::Paused paused(comm_);
  void* whole = sample_weights_buf_.get();
  grad_buffer_->gather_compact(whole, act_ == DType::F32 ? static_cast<const void*>(updater_->master_shard()) : compute_,
                               act_);
  return generate_text(*sampler_, whole, *tokenizer_, cfg_.sample.prompt, cfg_.sample);
}

void Trainer::load_micro_batch(DataLoader& loader, int64_t j) {
  const int64_t T = cfg_.model.seq_len, B = cfg_.training.micro_batch_size;
  loader.next(host_batch_.data());
  // A sample is T+1 tokens: the model reads the first T and predicts the last T. A CP rank keeps
  // the tokens at its positions (its two chunks, context_parallel.h) and their targets.
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* row = host_batch_.data() + b * (T + 1);
    if (cp_positions_.empty()) {
      std::memcpy(host_inputs_.data() + b * T, row, static_cast<size_t>(T) * 4);
      std::memcpy(host_targets_.data() + b * T, row + 1, static_cast<size_t>(T) * 4);
      continue;
    }
    const int64_t Tl = static_cast<int64_t>(cp_positions_.size());
    for (int64_t t = 0; t < Tl; ++t) {
      const int32_t p = cp_positions_[static_cast<size_t>(t)];
      host_inputs_[static_cast<size_t>(b * Tl + t)] = row[p];
      host_targets_[static_cast<size_t>(b * Tl + t)] = row[p + 1];
    }
  }
  be_->copy_from_host(tokens_ + j * rows_, host_inputs_.data(), static_cast<size_t>(rows_) * 4);
  be_->copy_from_host(targets_ + j * rows_, host_targets_.data(), static_cast<size_t>(rows_) * 4);
}

void Trainer::train_step(int64_t s) {
  if (units_) units_->release_all(/*step=*/true);  // the last update changed every shard
  // grads_ is zero here: zeroed at start-up, then after each optimizer step.
  // The step's loss is the mean over its global batch; each micro-batch's gradient is scaled so
  // the accumulated gradient, summed over the DP ranks, is that mean's gradient.
  const int64_t tokens = step_tokens();
  // fp16: the loss gradient carries the loss scale (loss_scaler.h).
  const float dloss_scale = updater_->loss_gradient_scale(tokens);
  {
    const trace::Span span("phase", "data");
    for (int64_t j = 0; j < accum_; ++j) {
      load_micro_batch(*train_loader_, j);
      if (dump_) dump_->add_batch(s, host_batch_);
    }
  }
  inject_slowness(groups_.rank);  // test-only
  {
    // Forwards and backwards in the schedule's order; each chunk's last backward finalises its
    // gradients, and their reduction overlaps the backward of earlier layers.
    const trace::Span span("phase", "forward-backward");
    pipe_stats_ = model_->train(compute_, grads_, dloss_scale, group_done_);
  }
  {
    const trace::Span span("phase", "gradient reduction");
    grad_buffer_->finish();
    model_->finish_tied_embedding(grads_);
  }
  inject_grad_fault(groups_.rank, s + 1, *be_,  // test-only; ZeRO-2's grads_ is the compact shard
                    grads_ + (grad_buffer_->shards_gradients() ? 0 : grad_buffer_->owned().front().offset));
  // The loss summed on the device and reduced there (the pipeline's last stage holds it): read
  // back once, with the gradient norm (Updater::step).
  const trace::Span span("phase", "loss");
  if (model_->has_loss()) {
    inject_loss_fault(groups_.rank, s + 1, 0, *be_, losses_, rows_);  // test-only
    be_->sum(step_scalars_, losses_, accum_ * rows_);
  } else {
    be_->memset_zero(step_scalars_, sizeof(float));
  }
  reduce_loss_on_device(step_scalars_);
}

void Trainer::reduce_loss_on_device(float* dev) {
  if (groups_.pp->size() > 1) groups_.backend(GroupKind::PP).all_reduce(dev, 1, DType::F32, ReduceOp::SUM);
  groups_.backend(GroupKind::DP).all_reduce(dev, 1, DType::F32, ReduceOp::SUM);
}

double Trainer::reduce_loss(float local) {
  be_->copy_from_host(scalar_, &local, sizeof(float));
  reduce_loss_on_device(scalar_);
  be_->copy_to_host(&local, scalar_, sizeof(float));
  return static_cast<double>(local);
}

std::optional<double> Trainer::evaluate(const StopRequests* stops, StopCause* stopped) {
  TETRA_CHECK(valid_source_ && cfg_.training.eval_steps > 0, "evaluate() needs validation data and "
              "training.eval_steps > 0");
  DataLoader loader(valid_source_, cfg_.model.seq_len, cfg_.training.micro_batch_size, groups_.coord.dp,
                    cfg_.parallel.dp);
  const int64_t micro_batches = cfg_.training.eval_steps * accum_;
  if (units_) units_->release_all(/*step=*/false);
  double total = 0.0;
  for (int64_t step = 0; step < cfg_.training.eval_steps; ++step) {  // a step's micro-batches at a time
    for (int64_t j = 0; j < accum_; ++j) load_micro_batch(loader, j);
    model_->forward(compute_);
    if (model_->has_loss()) {
      be_->sum(scalar_, losses_, accum_ * rows_);
      float sum = 0.0f;
      be_->copy_to_host(&sum, scalar_, sizeof(float));
      total += sum;
    }
    if (stops && step + 1 < cfg_.training.eval_steps) {
      // Every rank leaves after the same batch: the request's maximum over the world (not counted
      // as the step's traffic).
      const CommAccounting::Paused paused(comm_);
      const float mine = static_cast<float>(stops->request());
      be_->copy_from_host(scalar_, &mine, sizeof(float));
      groups_.backend(GroupKind::WORLD).all_reduce(scalar_, 1, DType::F32, ReduceOp::MAX);
      float agreed = 0.0f;
      be_->copy_to_host(&agreed, scalar_, sizeof(float));
      if (agreed != 0.0f) {
        spdlog::warn("evaluation stopped after {} of {} validation batches ({}): no validation loss for this step",
                     step + 1, cfg_.training.eval_steps, stop_cause_name(static_cast<StopCause>(agreed)));
        if (stopped) *stopped = static_cast<StopCause>(agreed);
        return std::nullopt;
      }
    }
  }
  return reduce_loss(static_cast<float>(total)) / static_cast<double>(rows_ * micro_batches * cfg_.parallel.dp_cp());
}

PipelineMetrics Trainer::pipeline_metrics() {
  Communicator& pp = groups_.backend(GroupKind::PP);
  const int n = pp.size();
  float mine[2] = {static_cast<float>(pipe_stats_.bubble()), static_cast<float>(pipe_stats_.peak_in_flight)};
  float* dev = pipe_scratch_;
  be_->copy_from_host(dev, mine, sizeof(mine));
  pp.all_gather(dev + 2, dev, 2, DType::F32);
  std::vector<float> all(static_cast<size_t>(2 * n));
  be_->copy_to_host(all.data(), dev + 2, all.size() * 4);
  PipelineMetrics p;
  p.schedule = to_string(cfg_.parallel.schedule);
  p.ideal_bubble = model_->schedule().ideal_bubble();
  for (int r = 0; r < n; ++r) {
    p.bubble_per_rank.push_back(all[static_cast<size_t>(2 * r)]);
    p.peak_in_flight.push_back(static_cast<int>(all[static_cast<size_t>(2 * r + 1)]));
    p.bubble += all[static_cast<size_t>(2 * r)] / n;
  }
  return p;
}

StepMetrics Trainer::step_metrics(int64_t s, double loss, const StepUpdate& u, double step_s, double eta_s,
                                  const StopRequests& stops, StopCause* eval_stop) {
  const TrainingConfig& tc = cfg_.training;
  StepMetrics m;
  m.step = s + 1;
  m.total_steps = tc.steps;
  m.loss = loss;
  m.lr = u.lr;
  m.grad_norm = u.grad_norm;
  m.clip = u.clip;
  m.skipped = u.skipped;
  m.loss_scale = u.loss_scale;
  m.overflow = u.overflow;
  m.ms = step_s * 1e3;
  if (planned_step_s_) m.planned_ms = *planned_step_s_ * 1e3;
  m.tokens_per_s = static_cast<double>(tc.global_batch_size * cfg_.model.seq_len) / step_s;
  m.mfu = train_flops_per_token_ * m.tokens_per_s / peak_flops_;
  m.eta_s = eta_s;
  m.consumed_samples = train_loader_->consumed_samples();
  m.comm = comm_.records();
  if (groups_.pp->size() > 1) m.pipeline = pipeline_metrics();
  if (model_->has_moe()) m.moe = model_->take_moe_stats();
  // (a collective: only where a block can exceed its bound, the same on every rank)
  if (cfg_.model.moe.enabled() && moe_rows_can_exceed_bound(cfg_.model.moe, cfg_.parallel.ep)) count_moe_over_bound(m);
  if (cfg_.model.moe.router_enable_expert_bias && !u.skipped) update_moe_expert_bias(m);
  CommAccounting::warn_mismatches(s + 1, m.comm);
  const bool last = s + 1 == tc.steps;
  if (valid_source_ && ((tc.eval_every > 0 && (s + 1) % tc.eval_every == 0) || last)) {
    const trace::Span span("phase", "evaluation");
    m.val_loss = evaluate(&stops, eval_stop);
    if (sampler_ && m.val_loss) m.sample = sample();
  }
  return m;
}

void Trainer::update_moe_expert_bias(const StepMetrics& m) {
  // The step's tokens per expert of this rank's blocks, summed over every rank routing them: DP
  // (expert parallelism is inside it) and CP; TP ranks route the same tokens, but for folded
  // experts' shares (ESHARE) (not the step's traffic).
  std::vector<int32_t> counts;
  std::vector<int64_t> layers;
  if (m.moe)
    for (const MoeLayerStats& l : m.moe->layers) {
      layers.push_back(l.layer);
      for (int64_t n : l.tokens_per_expert) counts.push_back(static_cast<int32_t>(n));
    }
  if (!counts.empty()) {
    const CommAccounting::Paused paused(comm_);
    TETRA_CHECK(counts.size() * 4 <= moe_expert_bias_count_bytes(cfg_.model), "MoE token counts of {} blocks",
                layers.size());
    void* dev = moe_counts_buf_.get();
    be_->copy_from_host(dev, counts.data(), counts.size() * 4);
    groups_.backend(GroupKind::DP).all_reduce(dev, static_cast<int64_t>(counts.size()), DType::I32, ReduceOp::SUM);
    groups_.backend(GroupKind::CP).all_reduce(dev, static_cast<int64_t>(counts.size()), DType::I32, ReduceOp::SUM);
    // Folded experts: the TP group's shares route different rows (the ranks of a share, the same).
    groups_.backend(GroupKind::ESHARE).all_reduce(dev, static_cast<int64_t>(counts.size()), DType::I32, ReduceOp::SUM);
    be_->copy_to_host(counts.data(), dev, counts.size() * 4);
  }
  std::map<int64_t, std::vector<int64_t>> tokens;
  const int64_t E = cfg_.model.moe.num_experts;
  for (size_t i = 0; i < layers.size(); ++i)
    tokens[layers[i]].assign(counts.begin() + static_cast<int64_t>(i) * E, counts.begin() + static_cast<int64_t>(i + 1) * E);
  model_->update_moe_expert_bias(tokens);
}

void Trainer::count_moe_over_bound(StepMetrics& m) {
  // The blocks over the row bound on any rank (every rank takes part; not the step's traffic).
  float mine = 0.0f;
  if (m.moe)
    for (const MoeLayerStats& l : m.moe->layers) mine += static_cast<float>(l.over_bound);
  {
    const CommAccounting::Paused paused(comm_);
    be_->copy_from_host(scalar_, &mine, sizeof(float));
    groups_.backend(GroupKind::WORLD).all_reduce(scalar_, 1, DType::F32, ReduceOp::SUM);
    be_->copy_to_host(&mine, scalar_, sizeof(float));
  }
  if (!m.moe) m.moe = MoeStepStats{};
  m.moe->over_bound_world = static_cast<int64_t>(mine);
  if (m.moe->over_bound_world > 0 && !warned_moe_over_bound_) {
    warned_moe_over_bound_ = true;
    int64_t rows = 0, bound = 0;
    for (const MoeLayerStats& l : m.moe->layers) rows = std::max(rows, l.max_rows), bound = std::max(bound, l.bound_rows);
    spdlog::warn("step {}: {} MoE block(s) of a micro-batch received more rows than the {} planned per rank "
                 "(model.moe.max_load_factor {}{}): they ran in passes and recompute their experts' hidden "
                 "rows in backward (more time; the weight gradients are summed in pieces). Raise model.moe.max_load_factor if this persists; "
                 "metrics.jsonl counts it under moe.over_bound",
                 m.step, m.moe->over_bound_world, bound,
                 cfg_.model.moe.max_load_factor.value_or(MoeConfig::kDefaultMaxLoadFactor),
                 rows > 0 ? fmt::format(", this rank's most {}", rows) : "");
  }
}

void Trainer::log_step(int64_t s, const StepMetrics& m) {
  const bool last = s + 1 == cfg_.training.steps;
  if ((s + 1) % cfg_.training.log_every == 0 || last || m.val_loss) spdlog::info("{}", MetricsWriter::format_line(m));
  if (s == start_step_ && writer_) {  // which implementations the first step ran, where there is a choice
    const std::string kernels = be_->kernel_report();
    if (!kernels.empty()) spdlog::info("kernels: {}", kernels);
    const std::string memory = be_->memory_report();
    if (!memory.empty()) spdlog::info("{}", memory);
  }
  if (m.sample) spdlog::info("sample: \"{}\" -> \"{}\"", escape_text(cfg_.sample.prompt), escape_text(*m.sample));
}

void Trainer::save_checkpoint_if_due(int64_t s, bool last, bool stop) {
  const bool periodic = cfg_.checkpoint.every > 0 && (s + 1) % cfg_.checkpoint.every == 0;
  const bool at_exit = cfg_.checkpoint.save_on_exit && (last || stop);
  if (cfg_.checkpoint.dir.empty() || !(periodic || at_exit)) return;
  const trace::Span span("checkpoint", "checkpoint save");
  const auto c0 = std::chrono::steady_clock::now();
  CheckpointState state{s + 1, train_loader_->consumed_samples(), updater_->loss_scaler_state(), {}};
  state.moe_expert_bias = model_->moe_expert_bias();
  const std::string path = save_checkpoint(cfg_.checkpoint.dir, cfg_, groups_, *be_, checkpoint_buffers(), state);
  spdlog::info("checkpoint {} saved in {:.2f} s", path, seconds_since(c0));
}

void Trainer::report_memory(int64_t step) {
  const MemoryStats st = be_->memory_stats();
  if (!st.tracked) return;  // the same backend on every rank: all return here, or none
  // (planned, peak) as 30-bit halves in int32: exact for any size the plan can name.
  auto halves = [](size_t v) { return std::array<int32_t, 2>{static_cast<int32_t>(v >> 30), static_cast<int32_t>(v & ((1u << 30) - 1))}; };
  const auto p = halves(planned_bytes_), m = halves(st.peak);
  const std::array<int32_t, 4> mine{p[0], p[1], m[0], m[1]};
  const int world = groups_.grid.world();
  std::vector<int32_t> all(static_cast<size_t>(4 * world));
  {
    const CommAccounting::Paused paused(comm_);  // not the step's traffic
    groups_.get(GroupKind::WORLD).all_gather(all.data(), mine.data(), 4, DType::I32);
  }
  if (!writer_) return;
  auto whole = [&](size_t i) { return (static_cast<size_t>(all[i]) << 30) | static_cast<size_t>(all[i + 1]); };
  nlohmann::ordered_json ranks = nlohmann::ordered_json::array();
  double worst = 1.0;
  for (int r = 0; r < world; ++r) {
    const size_t planned = whole(4 * static_cast<size_t>(r)), peak = whole(4 * static_cast<size_t>(r) + 2);
    nlohmann::ordered_json j;
    j["rank"] = r;
    j["pp_rank"] = groups_.grid.coord(r).pp;
    j["planned_bytes"] = planned;
    j["measured_peak_bytes"] = peak;
    ranks.push_back(j);
    const double ratio = planned > 0 ? static_cast<double>(peak) / static_cast<double>(planned) : 0.0;
    if (std::abs(ratio - 1.0) > std::abs(worst - 1.0)) worst = ratio;
  }
  nlohmann::ordered_json event;
  event["event"] = "memory";
  event["ranks"] = ranks;
  metrics_->event(event.dump());
  metrics_->scalars(step, {{"memory/planned_bytes", static_cast<double>(planned_bytes_)},
                                          {"memory/measured_peak_bytes", static_cast<double>(st.peak)}});
  spdlog::info("backend memory: rank 0 peaked at {:.1f} MiB of a planned {:.1f} MiB (measured / planned {:.3f}; "
               "the farthest rank {:.3f})",
               static_cast<double>(st.peak) / 1048576.0, static_cast<double>(planned_bytes_) / 1048576.0,
               planned_bytes_ > 0 ? static_cast<double>(st.peak) / static_cast<double>(planned_bytes_) : 0.0, worst);
}

void Trainer::report_stragglers(int64_t s, double busy_s) {
  for (const StragglerReport& r : straggler_->observe(s + 1, busy_s)) {
    if (!writer_) continue;
    if (r.slow) spdlog::warn("{}", r.line);
    else spdlog::info("{}", r.line);
    nlohmann::ordered_json e;
    e["event"] = "straggler";
    e["at_step"] = s + 1;  // not "step": the key of step records
    e["rank"] = r.rank;
    e["slow"] = r.slow;
    e["busy_ms"] = r.busy_ms;
    e["median_ms"] = r.median_ms;
    metrics_->event(e.dump());
  }
}

void Trainer::run() {
  const TrainingConfig& tc = cfg_.training;
  if (model_->has_moe()) model_->take_moe_stats();  // start the step statistics afresh
  double avg_step_s = 0.0;  // mean over steps after the first (which pays one-off set-up costs)
  const auto run_t0 = std::chrono::steady_clock::now();

  StopRequests stops(tc);
  stops.install_signal_handlers();
  StepGuard guard(tc, groups_.backend(GroupKind::WORLD), *be_);
  // Step 0's reduced gradients, for --dump-dir; debugging output, not part of the step's traffic.
  const Updater::GradientHook dump_gradients = [this](double loss_scale) {
    const CommAccounting::Paused paused(comm_);
    dump_->gradients(*be_, *grad_buffer_, grads_, layout_.total, loss_scale);
  };
  int64_t reached = start_step_;  // the last step done (a stop may come before tc.steps)
  for (int64_t s = start_step_; s < tc.steps; ++s) {
    watchdog_step_begin(s + 1);
    profiler_->begin_step(s + 1);
    const double blocked0 = straggler_->enabled() ? straggler_->blocked_s() : 0.0;
    const auto t0 = std::chrono::steady_clock::now();
    {
      const trace::Span span("phase", "step start");
      comm_.begin_step(updater_->begin_step(s));
    }
    train_step(s);
    const StepUpdate update = [&] {
      const trace::Span span("optimizer", "optimizer");
      return updater_->step(s, step_scalars_, static_cast<double>(step_tokens()), guard, stops.request(),
                            dump_ && s == 0 ? dump_gradients : Updater::GradientHook{});
    }();
    const double loss = update.loss;
    {
      const trace::Span span("phase", "synchronize");
      be_->synchronize();
    }
    watchdog_step_end();
    reached = s + 1;
    const auto t1 = std::chrono::steady_clock::now();
    const double step_s = std::chrono::duration<double>(t1 - t0).count();
    trace::complete("step", fmt::format("step {}", s + 1), t0, t1, fmt::format("\"step\":{}", s + 1));
    if (straggler_->enabled()) report_stragglers(s, step_s - (straggler_->blocked_s() - blocked0));
    if (s > start_step_) avg_step_s += (step_s - avg_step_s) / static_cast<double>(s - start_step_);
    const double eta_s = (s > start_step_ ? avg_step_s : step_s) * static_cast<double>(tc.steps - s - 1);

    StopCause eval_stop = StopCause::NONE;
    const StepMetrics m = step_metrics(s, loss, update, step_s, eta_s, stops, &eval_stop);
    metrics_->write(m);
    log_step(s, m);

    const bool last = s + 1 == tc.steps;
    const StopCause stop = eval_stop != StopCause::NONE ? eval_stop : stops.check(s + 1, last, update.stop_request);
    save_checkpoint_if_due(s, last, stop != StopCause::NONE);
    profiler_->end_step(s + 1, step_s * 1e3);
    if (stop != StopCause::NONE) {
      spdlog::warn("stopping after step {} ({}){}", s + 1, stop_cause_name(stop),
                   cfg_.checkpoint.save_on_exit && !cfg_.checkpoint.dir.empty() ? " (checkpoint saved)" : "");
      break;
    }
  }
  profiler_->finish();  // a stop inside the profiled steps: what was recorded
  // The activations are done with: without a whole fp32 buffer, their memory makes room for the
  // gathered final weights (memory_plan.h's peak).
  if (!master_) {
    model_.reset();
    units_.reset();
  }
  save_final_weights();
  if (dump_) dump_->batches(start_step_);
  report_memory(reached);
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  spdlog::info("done: {} steps in {}; peak memory of this rank {:.1f} MiB (optimizer state {:.1f} MiB)",
               reached, format_duration(seconds_since(run_t0)), static_cast<double>(usage.ru_maxrss) / 1024.0,
               static_cast<double>(updater_->state_bytes()) / 1048576.0);
}

}  // namespace tetra
