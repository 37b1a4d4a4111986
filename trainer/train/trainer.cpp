#include "trainer/train/trainer.h"

#include "trainer/train/pipeline_model.h"

#include <signal.h>
#include <sys/resource.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <optional>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "trainer/checkpoint/checkpoint.h"
#include "trainer/core/output_path.h"
#include "trainer/checkpoint/safetensors.h"
#include "kernels/common/check.h"
#include "trainer/core/log.h"
#include "trainer/data/data_loader.h"
#include "trainer/data/sample_source.h"
#include "trainer/data/tokenizer.h"
#include "trainer/comm/process_groups.h"
#include "trainer/comm/watchdog.h"
#include "trainer/model/flops.h"
#include "trainer/model/sampler.h"
#include "trainer/optim/lr_schedule.h"
#include "trainer/train/compute_device.h"
#include "trainer/train/fault_injection.h"
#include "trainer/train/generate.h"
#include "trainer/train/metrics.h"
#include "trainer/train/step_guard.h"

namespace tetra {

namespace {

constexpr int64_t kMaxDumpedSteps = 100;

DType activation_type(const Config& cfg) { return precision_dtype(cfg.training.precision); }

// Processes of this job on this machine (they share its memory).
int64_t local_ranks() {
  for (const char* var : {"OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE"}) {
    const char* v = std::getenv(var);
    if (v && std::atoll(v) > 0) return std::atoll(v);  // Slurm's "4(x2)" reads as 4
  }
  return 1;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

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
  slicing.sequence_parallel = cfg.parallel.sequence_parallel;
  // Buckets split into dp aligned shards: the distributed optimizer's, and onebit's and int8's chunks.
  const bool shards = cfg.parallel.distributed_optimizer || cfg.parallel.grad_compression == "onebit" ||
                      cfg.parallel.grad_compression == "int8";
  slicing.group_align = shards ? 16 * cfg.parallel.dp : 16;
  return ParamLayout::build(cfg.model, slicing, stage_slice(cfg, pp_rank));
}

MemoryPlan plan_memory(const Config& cfg, const ParamLayout& layout, int64_t pp_rank) {
  const DType act = activation_type(cfg);
  const int64_t B = cfg.training.micro_batch_size, T = cfg.model.seq_len;
  const size_t n = static_cast<size_t>(layout.total);
  // The distributed optimizer keeps Adam's moments (and, in bf16 / fp16, the fp32 master weights) for
  // this rank's 1/dp of the buffer only.
  const size_t shard = cfg.parallel.distributed_optimizer ? n / static_cast<size_t>(cfg.parallel.dp) : n;
  MemoryPlan m;
  m.master = act == DType::F32 ? n * 4 : shard * 4;
  m.compute = act == DType::F32 ? 0 : n * dtype_size(act);
  m.grads = n * 4;
  m.optimizer = shard * 8;
  // Gradient compression's buffers (grad_buffer.h, compressed_exchange.h): the bf16 copy of the buffer
  // (backend memory); onebit / int8 on the host: the worker error and the scaled input (n each), the
  // server error and average (n / dp each), the two messages (1 bit or 1 byte per element) and, for
  // sharded onebit, the whole frozen variance; on a GPU also the host staging of the gradient (and
  // for onebit of the variance, and for plain onebit of the momentum).
  const size_t dp = static_cast<size_t>(cfg.parallel.dp);
  m.on_device = cfg.training.device != "cpu";
  if (dp > 1 && cfg.parallel.grad_compression == "bf16") m.grads += n * 2;
  const bool onebit = cfg.parallel.grad_compression == "onebit", int8 = cfg.parallel.grad_compression == "int8";
  if (dp > 1 && (onebit || int8)) {
    m.compression = 2 * n * 4 + 2 * (n / dp) * 4 + (onebit ? n / 2 : 2 * n);
    if (onebit && cfg.parallel.distributed_optimizer) m.compression += n * 4;
    if (m.on_device) m.compression += n * 4 + (onebit ? n * 4 : 0) + (onebit && !cfg.parallel.distributed_optimizer ? n * 4 : 0);
  }
  m.activations = PipelineModel::activation_bytes_for(cfg, pp_rank);
  m.batch = static_cast<size_t>(cfg.grad_accum_steps() * B * T) * 12;  // tokens, targets, losses
  if (samples_enabled(cfg))  // the sampling model's arena and its (T) ids and two logit rows
    m.sampling = Gpt::activation_bytes_for(cfg.model, act, 1, cfg.parallel.tp) +
                 static_cast<size_t>(T) * 4 + static_cast<size_t>(cfg.model.vocab_size) * 8;
  return m;
}

namespace {

// Every directory the run writes, checked before anything is: logging.dir (train.log,
// metrics.jsonl, the final weights), checkpoint.dir (one checkpoint's fp32 weights and moments),
// --dump-dir. Rank 0 writes them.
// Every rank writes its slices into checkpoint.dir; only the writer the others.
void check_output_paths(const Config& cfg, const std::string& dump_dir, bool writer) {
  const uint64_t params = static_cast<uint64_t>(ParamLayout::build(cfg.model).total);
  if (writer && !cfg.logging.dir.empty()) check_output_dir("logging.dir", cfg.logging.dir, params * 4);
  const bool saves = cfg.checkpoint.every > 0 || cfg.checkpoint.save_on_exit;
  if (!cfg.checkpoint.dir.empty() && saves) check_output_dir("checkpoint.dir", cfg.checkpoint.dir, params * 12);
  if (writer && !dump_dir.empty()) check_output_dir("--dump-dir", dump_dir, params * 8);
}

}  // namespace

Trainer::Trainer(const Config& cfg, const std::string& config_path, ProcessGroups& groups, std::string dump_dir)
    : cfg_(cfg),
      groups_(groups),
      writer_(groups.rank == 0),
      dump_dir_(std::move(dump_dir)),
      layout_(rank_layout(cfg, groups.coord.tp, groups.coord.pp, groups.coord.ep)) {
  act_ = activation_type(cfg);
  accum_ = cfg.grad_accum_steps();
  const int64_t B = cfg.training.micro_batch_size, T = cfg.model.seq_len;
  rows_ = B * T;
  const bool shard_optimizer = cfg.parallel.distributed_optimizer && cfg.parallel.dp > 1;

  // Linux overcommits: an allocation larger than the machine succeeds and the process is killed
  // later. Refuse such a run now, with the numbers (all ranks of a node share its memory).
  const MemoryPlan plan = plan_memory(cfg, layout_, groups.coord.pp);
  const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  const double ranks_here = static_cast<double>(std::min<int64_t>(groups.grid.world(), local_ranks()));
  if (physical > 0 && static_cast<double>(plan.host_bytes()) * ranks_here > 0.95 * physical)
    throw InputError(fmt::format(
        "the run needs {:.1f} GiB of host memory per rank x {} ranks on this machine ({}) but it has "
        "{:.1f} GiB of memory: {}",
        plan.host_bytes() / 1073741824.0, ranks_here,
        plan.on_device ? "gradient compression's buffers"
                       : fmt::format("{:.1f} GiB of activations for training.micro_batch_size {}",
                                     plan.activations / 1073741824.0, B),
        physical / 1073741824.0,
        plan.on_device ? "use parallel.grad_compression bf16 or none, or more ranks per model (tp, pp)"
                       : "lower training.micro_batch_size (use global_batch_size for gradient accumulation), "
                         "model.seq_len or the model size, or use more tensor parallelism / the distributed "
                         "optimizer"));
  // Data first: a missing or malformed dataset is reported before anything large is allocated.
  const int64_t total_train_samples = cfg.training.steps * cfg.training.global_batch_size;
  train_source_ = make_train_source(cfg, total_train_samples);
  if (cfg.training.eval_steps > 0)
    valid_source_ = make_valid_source(cfg, cfg.training.eval_steps * cfg.training.global_batch_size);
  if (samples_enabled(cfg)) tokenizer_ = load_sampling_tokenizer(cfg);
  train_loader_ = std::make_unique<DataLoader>(train_source_, T, B, groups.coord.dp, cfg.parallel.dp);
  // The device too (no GPU, or a build without CUDA, is an input error; nothing is written).
  ComputeDevice device = make_compute_device(cfg.training, act_);
  // The checkpoint to resume from is found (or refused) and its manifest checked against this
  // model before any file is written; so is every path the run will write.
  const std::string resume = agree_checkpoint_to_resume(cfg.checkpoint, groups);
  if (!resume.empty()) {
    const Manifest manifest = read_manifest(resume);
    check_same_model(manifest, cfg);
    TETRA_INPUT_CHECK(manifest.step <= cfg.training.steps,
                      "{} is at step {}, beyond training.steps ({}): raise training.steps to train on", resume,
                      manifest.step, cfg.training.steps);
  }
  check_output_paths(cfg, dump_dir_, writer_);
  spdlog::info("config {}: {}", config_path, config_to_json(cfg).dump());
  spdlog::info("data: train {}{}", train_source_->describe(),
               valid_source_ ? ", valid " + valid_source_->describe() : std::string());

  be_ = std::move(device.backend);
  groups.use_backend_memory(backend_comm_factory(*be_));
  const size_t n = static_cast<size_t>(layout_.total);
  master_ = static_cast<float*>(be_->alloc(n * 4));
  grads_ = static_cast<float*>(be_->alloc(n * 4));
  be_->memset_zero(grads_, n * 4);
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
    compute_ = be_->alloc(n * dtype_size(act_));
    be_->cast(compute_, act_, master_, DType::F32, layout_.total);
  }
  if (!dump_dir_.empty()) {
    if (writer_) {
      std::error_code ec;
      std::filesystem::create_directories(dump_dir_, ec);
      TETRA_INPUT_CHECK(!ec, "--dump-dir: cannot create {}: {}", dump_dir_, ec.message());
    }
    dump_tensors(dump_dir_ + "/params_init.safetensors", master_);
  }
  tokens_ = static_cast<int32_t*>(be_->alloc(static_cast<size_t>(accum_ * rows_) * 4));
  targets_ = static_cast<int32_t*>(be_->alloc(static_cast<size_t>(accum_ * rows_) * 4));
  losses_ = static_cast<float*>(be_->alloc(static_cast<size_t>(accum_ * rows_) * 4));
  scalar_ = static_cast<float*>(be_->alloc(64));
  pipe_scratch_ = static_cast<float*>(be_->alloc(static_cast<size_t>(2 * cfg.parallel.pp + 2) * 4));
  host_batch_.resize(static_cast<size_t>(B * (T + 1)));
  host_inputs_.resize(static_cast<size_t>(rows_));
  host_targets_.resize(static_cast<size_t>(rows_));

  model_ = std::make_unique<PipelineModel>(cfg, layout_, *be_, act_, groups, accum_, tokens_, targets_, losses_);
  grad_buffer_ = std::make_unique<GradBuffers>(layout_, *be_, grads_, groups, cfg.parallel.distributed_optimizer,
                                               cfg.parallel.bucket_size, cfg.parallel.grad_compression == "bf16");
  // bf16 / fp16 with the distributed optimizer: the fp32 master weights live sharded in the optimizer.
  const bool optimizer_owns_master = shard_optimizer && act_ != DType::F32;
  optimizer_ = std::make_unique<AdamW>(cfg.optimizer, layout_, *be_, grad_buffer_->owned(),
                                       optimizer_owns_master, master_);
  if (cfg.parallel.grad_compression == "onebit")
    onebit_ = std::make_unique<OnebitAdam>(cfg, layout_, *be_, *grad_buffer_, *optimizer_, groups);
  if (cfg.parallel.grad_compression == "int8")
    int8_ = std::make_unique<CompressedReduction>(cfg, *be_, *grad_buffer_, groups);
  if (act_ == DType::F16) scaler_ = std::make_unique<LossScaler>(cfg.training);
  if (optimizer_owns_master) {
    be_->free(master_);
    master_ = nullptr;
  }
  group_done_ = [this](int group) { grad_buffer_->group_done(group); };
  if (!resume.empty()) {
    const auto l0 = std::chrono::steady_clock::now();
    const CheckpointState st = load_checkpoint(resume, cfg, groups, *be_, checkpoint_buffers());
    spdlog::info("checkpoint {} loaded in {:.2f} s", resume, seconds_since(l0));
    TETRA_INPUT_CHECK(st.step <= cfg.training.steps,
                      "{} is at step {}, beyond training.steps ({}): raise training.steps to train on", resume,
                      st.step, cfg.training.steps);
    start_step_ = st.step;
    train_loader_->set_consumed_samples(st.consumed_samples);
    if (scaler_ && st.loss_scaler) scaler_->restore(*st.loss_scaler);
    if (scaler_ && !st.loss_scaler)
      spdlog::info("{} holds no loss scaler state (saved by a run not in fp16): loss scaling starts afresh at {}",
                   resume, scaler_->scale());
    // Steps skipped for an fp16 overflow made no update (loss_scaler.h).
    optimizer_->set_steps_taken(st.step - (scaler_ ? scaler_->skipped_steps() : 0));
  }
  // This run's hold on checkpoint.dir, then the run directory, once everything they depend on has
  // been read and checked (train.log starts with the lines logged so far).
  if (writer_ && !cfg.checkpoint.dir.empty() && (cfg.checkpoint.every > 0 || cfg.checkpoint.save_on_exit))
    checkpoint_lock_ = lock_checkpoint_dir(cfg.checkpoint.dir);
  if (writer_) {
    log_to_file(cfg.logging.dir);
    metrics_ = std::make_unique<MetricsWriter>(cfg.logging.dir);
  } else {
    metrics_ = std::make_unique<MetricsWriter>("");
  }
  if (tokenizer_) {
    // Without sequence parallelism: for one row of T tokens it would save little, and it would
    // need T divisible by tp. The parameter offsets do not depend on it.
    sample_layout_ = layout_;
    sample_layout_.slicing.sequence_parallel = false;
    Communicator* tp = &groups.backend(GroupKind::TP);
    sample_model_ = std::make_unique<Gpt>(cfg.model, sample_layout_, *be_, act_, 1, tp);
    sampler_ = std::make_unique<Sampler>(*sample_model_, *be_, tp);
  }
  predicted_ = predict_step_volume(cfg, layout_);
  if (scaler_)
    spdlog::info("loss scaling: {}", scaler_->dynamic()
                                         ? fmt::format("dynamic, scale {} (window {}, hysteresis {}, min {})",
                                                       scaler_->scale(), cfg.training.loss_scale_window,
                                                       cfg.training.hysteresis, cfg.training.min_loss_scale)
                                         : fmt::format("static, scale {}", scaler_->scale()));

  const double rank_peak = device.peak_flops;
  peak_flops_ = rank_peak * static_cast<double>(groups.grid.world());

  const ParamLayout whole = ParamLayout::build(cfg.model);
  const ModelStats stats = model_stats(cfg.model, whole);
  spdlog::info("model: {} parameters ({} in matmuls), {} layers, hidden {}, heads {}/{} (q/kv), ffn {}, "
               "vocab {}, seq_len {}, {} + {} + {} positions",
               stats.params, stats.matmul_params, cfg.model.num_layers, cfg.model.hidden_size,
               cfg.model.num_heads, cfg.model.num_kv_heads, cfg.model.ffn_hidden_size,
               cfg.model.vocab_size, cfg.model.seq_len, cfg.model.norm, cfg.model.activation,
               cfg.model.position);
  if (cfg.model.moe.enabled())
    spdlog::info("moe: {} experts (ffn {}), top-{}, every {} blocks, {}; {} active parameters per token; ep {}",
                 cfg.model.moe.num_experts, cfg.model.moe.ffn_hidden_size, cfg.model.moe.top_k, cfg.model.moe.every,
                 cfg.model.moe.capacity_factor ? fmt::format("capacity factor {}", *cfg.model.moe.capacity_factor)
                                               : std::string("dropless"),
                 stats.active_params, cfg.parallel.ep);
  spdlog::info("layout: {} ranks = tp {} x pp {} x dp {} (order {}){}{}; {} gradient bucket(s)",
               groups.grid.world(), cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.order,
               cfg.parallel.sequence_parallel ? ", sequence parallel" : "",
               cfg.parallel.distributed_optimizer ? ", distributed optimizer" : "",
               grad_buffer_->num_buckets());
  spdlog::info("run: backend {} per rank, precision {}, micro-batch {} x {} accumulation "
               "x dp {} = global batch {} ({} tokens/step), {} steps, {:.2f} GFLOP/token",
               device.description, cfg.training.precision, B, accum_, cfg.parallel.dp,
               cfg.training.global_batch_size, cfg.training.global_batch_size * T, cfg.training.steps,
               stats.train_flops_per_token / 1e9);
  spdlog::info("memory per rank: {:.1f} MiB (weights {:.1f}, grads {:.1f}, optimizer {:.1f}, activations "
               "{:.1f}{}); peak {:.1f} GFLOP/s per rank ({})",
               plan.total() / 1048576.0, (plan.master + plan.compute) / 1048576.0, plan.grads / 1048576.0,
               plan.optimizer / 1048576.0, plan.activations / 1048576.0,
               plan.compression ? fmt::format(", gradient compression {:.1f}{}", plan.compression / 1048576.0,
                                              plan.on_device ? " on the host" : "")
                                : std::string(),
               rank_peak / 1e9, device.peak_source);
  if (sampler_)
    spdlog::info("samples: at each evaluation, up to {} tokens after \"{}\" (temperature {}, top-k {}, "
                 "seed {}, tokenizer {})",
                 cfg.sample.max_tokens, escape_text(cfg.sample.prompt), cfg.sample.temperature,
                 cfg.sample.top_k, cfg.sample.seed, cfg.data.tokenizer);
  else if (!cfg.sample.prompt.empty() && cfg.training.eval_steps == 0)
    spdlog::info("samples: none during training (sample.prompt is set but training.eval_steps is 0)");
  if (groups.grid.world() > 1)
    spdlog::info("communication per step (predicted): tp: {}; dp: {}{}", predicted_.tp.describe(),
                 predicted_.dp.describe(),
                 cfg.model.moe.enabled() ? fmt::format("; edp: {}; ep: {} + the routed tokens", predicted_.edp.describe(),
                                                       predicted_.ep.describe())
                                         : std::string());
  if (onebit_ && onebit_->compressed(cfg.training.steps))
    spdlog::info("communication per step after the {} warm-up steps of onebit (predicted): dp: {}{}",
                 cfg.parallel.onebit_warmup_steps, predict_step_volume(cfg, layout_, true).dp.describe(),
                 cfg.model.moe.enabled() ? "; edp: " + predict_step_volume(cfg, layout_, true).edp.describe() : "");

  nlohmann::ordered_json start;
  start["event"] = "start";
  start["params"] = stats.params;
  start["flops_per_token"] = stats.train_flops_per_token;
  start["peak_flops"] = peak_flops_;
  start["world"] = groups.grid.world();
  start["memory_plan_bytes"] = plan.total();
  start["optimizer_state_bytes"] = optimizer_->state_bytes();
  metrics_->start(start.dump());
}

Trainer::~Trainer() {
  if (checkpoint_lock_ >= 0) ::close(checkpoint_lock_);
  sampler_.reset();
  sample_model_.reset();
  onebit_.reset();
  int8_.reset();
  optimizer_.reset();
  grad_buffer_.reset();
  model_.reset();
  groups_.use_backend_memory({});  // the backend-memory communicators use be_
  if (be_) {
    for (void* p : {static_cast<void*>(master_), static_cast<void*>(grads_), static_cast<void*>(tokens_),
                    static_cast<void*>(targets_), static_cast<void*>(losses_), static_cast<void*>(scalar_),
                    static_cast<void*>(pipe_scratch_)})
      if (p) be_->free(p);
    if (compute_ && compute_ != master_) be_->free(compute_);
  }
}

CheckpointBuffers Trainer::checkpoint_buffers() {
  CheckpointBuffers b;
  b.layout = &layout_;
  b.owned = &grad_buffer_->owned();
  b.sharded = grad_buffer_->sharded();
  b.master_full = master_;
  b.master_shard = optimizer_->master_shard();
  b.exp_avg = optimizer_->exp_avg();
  b.exp_avg_sq = optimizer_->exp_avg_sq();
  b.compute = compute_;
  b.compute_type = act_;
  if (onebit_) b.extra = onebit_->checkpoint_state();
  if (int8_) b.extra = int8_->checkpoint_state();
  return b;
}

namespace {
volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }
// training.exit_after_min counts from the process's start (as a scheduler's time limit does).
const auto g_process_start = std::chrono::steady_clock::now();
int32_t g_stop_cause = 0;  // what stop_requested() agreed on: 1 a signal, 2 training.exit_after_min
}  // namespace

void Trainer::install_stop_signals() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
}

bool Trainer::stop_requested() {
  // Every rank must stop after the same step: agree on whether any rank got a signal.
  int32_t flag = g_stop_signal != 0 ? 1 : 0;
  if (cfg_.training.exit_after_min > 0 && seconds_since(g_process_start) >= 60.0 * cfg_.training.exit_after_min)
    flag = 2;
  if (groups_.world->size() > 1) {
    int32_t* dev = reinterpret_cast<int32_t*>(scalar_);
    be_->copy_from_host(dev, &flag, 4);
    groups_.backend(GroupKind::WORLD).all_reduce(dev, 1, DType::I32, ReduceOp::MAX);
    be_->copy_to_host(&flag, dev, 4);
  }
  g_stop_cause = flag;
  return flag != 0;
}

std::string Trainer::sample() {
  TETRA_CHECK(sampler_, "sample() without sample.prompt, data.tokenizer and training.eval_steps");
  return generate_text(*sampler_, compute_, *tokenizer_, cfg_.sample.prompt, cfg_.sample);
}

void Trainer::load_micro_batch(DataLoader& loader, int64_t j) {
  const int64_t T = cfg_.model.seq_len, B = cfg_.training.micro_batch_size;
  loader.next(host_batch_.data());
  // A sample is T+1 tokens: the model reads the first T and predicts the last T.
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* row = host_batch_.data() + b * (T + 1);
    std::memcpy(host_inputs_.data() + b * T, row, static_cast<size_t>(T) * 4);
    std::memcpy(host_targets_.data() + b * T, row + 1, static_cast<size_t>(T) * 4);
  }
  be_->copy_from_host(tokens_ + j * rows_, host_inputs_.data(), static_cast<size_t>(rows_) * 4);
  be_->copy_from_host(targets_ + j * rows_, host_targets_.data(), static_cast<size_t>(rows_) * 4);
}

double Trainer::train_step(int64_t s) {
  // grads_ is zero here: zeroed at start-up, then after each optimizer step.
  // The step's loss is the mean over its global batch; each micro-batch's gradient is scaled so
  // the accumulated gradient, summed over the DP ranks, is that mean's gradient.
  const int64_t tokens = rows_ * accum_ * cfg_.parallel.dp;
  // fp16: the loss gradient carries the loss scale (loss_scaler.h).
  const float dloss_scale = scaler_ ? static_cast<float>(scaler_->scale() / static_cast<double>(tokens))
                                    : 1.0f / static_cast<float>(tokens);
  for (int64_t j = 0; j < accum_; ++j) {
    load_micro_batch(*train_loader_, j);
    if (!dump_dir_.empty() && s < kMaxDumpedSteps && cfg_.parallel.dp == 1)
      dumped_batches_.insert(dumped_batches_.end(), host_batch_.begin(), host_batch_.end());
  }
  // Forwards and backwards in the schedule's order; each chunk's last backward finalises its
  // gradients, and their reduction overlaps the backward of earlier layers.
  pipe_stats_ = model_->train(compute_, grads_, dloss_scale, group_done_);
  grad_buffer_->finish();
  model_->finish_tied_embedding(grads_);
  inject_grad_fault(groups_.rank, s + 1, *be_, grads_ + grad_buffer_->owned().front().offset);  // test-only
  float local = 0.0f;
  if (model_->has_loss()) {
    inject_loss_fault(groups_.rank, s + 1, 0, *be_, losses_, rows_);  // test-only
    be_->sum(scalar_, losses_, accum_ * rows_);
    be_->copy_to_host(&local, scalar_, sizeof(float));
  }
  return reduce_loss(local) / static_cast<double>(tokens);
}

double Trainer::reduce_loss(float local) {
  be_->copy_from_host(scalar_, &local, sizeof(float));
  if (groups_.pp->size() > 1) groups_.backend(GroupKind::PP).all_reduce(scalar_, 1, DType::F32, ReduceOp::SUM);
  groups_.backend(GroupKind::DP).all_reduce(scalar_, 1, DType::F32, ReduceOp::SUM);
  be_->copy_to_host(&local, scalar_, sizeof(float));
  return static_cast<double>(local);
}

double Trainer::evaluate() {
  TETRA_CHECK(valid_source_ && cfg_.training.eval_steps > 0, "evaluate() needs validation data and "
              "training.eval_steps > 0");
  DataLoader loader(valid_source_, cfg_.model.seq_len, cfg_.training.micro_batch_size, groups_.coord.dp,
                    cfg_.parallel.dp);
  const int64_t micro_batches = cfg_.training.eval_steps * accum_;
  double total = 0.0;
  for (int64_t step = 0; step < cfg_.training.eval_steps; ++step) {  // a step's micro-batches at a time
    for (int64_t j = 0; j < accum_; ++j) load_micro_batch(loader, j);
    model_->forward(compute_);
    if (!model_->has_loss()) continue;
    be_->sum(scalar_, losses_, accum_ * rows_);
    float sum = 0.0f;
    be_->copy_to_host(&sum, scalar_, sizeof(float));
    total += sum;
  }
  return reduce_loss(static_cast<float>(total)) / static_cast<double>(rows_ * micro_batches * cfg_.parallel.dp);
}

namespace {

// A group's traffic is what both its communicators moved (ProcessGroups::stats).
struct AccountedGroup {
  const char* name;
  GroupKind kind;
  bool active;  // false: the group does not communicate in this model
  const GroupVolume* predicted;
};

// The expert groups communicate only in MoE models (edp: expert gradients; ep: the tokens).
std::vector<AccountedGroup> accounted_groups(const Config& cfg, const StepVolume& predicted) {
  const bool moe = cfg.model.moe.enabled();
  return {{"tp", GroupKind::TP, true, &predicted.tp},
          {"dp", GroupKind::DP, true, &predicted.dp},
          {"pp", GroupKind::PP, true, &predicted.pp},
          {"embedding", GroupKind::EMBEDDING, true, &predicted.embedding},
          {"edp", GroupKind::EDP, moe, &predicted.edp},
          {"ep", GroupKind::EP, moe, &predicted.ep}};
}

}  // namespace

std::vector<CommStats> Trainer::comm_snapshot() const {
  std::vector<CommStats> out;
  for (const AccountedGroup& g : accounted_groups(cfg_, predicted_))
    out.push_back(g.active ? groups_.stats(g.kind) : CommStats{});
  return out;
}

std::vector<CommRecord> Trainer::comm_records(const std::vector<CommStats>& before) const {
  std::vector<CommRecord> out;
  const std::vector<AccountedGroup> groups = accounted_groups(cfg_, predicted_);
  for (size_t i = 0; i < groups.size(); ++i) {
    const AccountedGroup& g = groups[i];
    if (!g.active || groups_.get(g.kind).size() <= 1) continue;
    const CommStats now = groups_.stats(g.kind);
    CommRecord r;
    r.group = g.name;
    r.measured = measured_volume(now, before[i]);
    r.predicted = *g.predicted;
    // The tokens an expert-parallel rank sends depend on the routing: its all-to-all payload is
    // measured, not predicted (the number of calls is).
    if (std::string(g.name) == "ep") {
      const int a2a = static_cast<int>(CommOp::ALL_TO_ALL);
      r.predicted.payload_bytes[a2a] = r.measured.payload_bytes[a2a];
    }
    r.sent_bytes = now.total_sent() - before[i].total_sent();
    r.blocked_ms = 1e3 * (now.total_blocked_s() - before[i].total_blocked_s());
    out.push_back(std::move(r));
  }
  return out;
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
  p.schedule = cfg_.parallel.schedule;
  p.ideal_bubble = model_->schedule().ideal_bubble();
  for (int r = 0; r < n; ++r) {
    p.bubble_per_rank.push_back(all[static_cast<size_t>(2 * r)]);
    p.peak_in_flight.push_back(static_cast<int>(all[static_cast<size_t>(2 * r + 1)]));
    p.bubble += all[static_cast<size_t>(2 * r)] / n;
  }
  return p;
}

void Trainer::run() {
  const TrainingConfig& tc = cfg_.training;
  const ModelStats stats = model_stats(cfg_.model, ParamLayout::build(cfg_.model));
  if (model_->has_moe()) model_->take_moe_stats();  // start the step statistics afresh
  const double tokens_per_step = static_cast<double>(tc.global_batch_size * cfg_.model.seq_len);
  const bool shard_optimizer = grad_buffer_->sharded();
  double avg_step_s = 0.0;  // mean over steps after the first (which pays one-off set-up costs)
  const auto run_t0 = std::chrono::steady_clock::now();

  install_stop_signals();
  StepGuard guard(tc, groups_.backend(GroupKind::WORLD), *be_);
  int64_t reached = start_step_;  // the last step done (a stop may come before tc.steps)
  for (int64_t s = start_step_; s < tc.steps; ++s) {
    watchdog_step_begin(s + 1);
    const auto t0 = std::chrono::steady_clock::now();
    const std::vector<CommStats> comm_before = comm_snapshot();
    const bool compressed = onebit_ && onebit_->compressed(s);  // 1-bit Adam past its warm-up
    grad_buffer_->set_reduce(!compressed && !int8_);
    predicted_ = predict_step_volume(cfg_, layout_, compressed, compressed && onebit_->gathers_variance());
    const double loss = train_step(s);
    if (int8_) int8_->reduce(grads_, s);  // the step's gradient reduction, compressed
    // Compressed: the unreduced local gradient's norm, times the group size, as an estimate (onebit_adam.h).
    const double dp = static_cast<double>(cfg_.parallel.dp);
    const double raw_norm = compressed ? grad_buffer_->norm(grads_, dp, dp / static_cast<double>(cfg_.parallel.ep))
                                       : grad_buffer_->norm(grads_);
    // fp16: the gradients carry the loss scale; a non-finite norm is an overflow (loss_scaler.h).
    const double step_scale = scaler_ ? scaler_->scale() : 1.0;
    const double norm = raw_norm / step_scale;
    // A non-finite or spiking loss or norm, or an fp16 overflow: the update is skipped, the
    // gradients dropped.
    const bool overflow_here = scaler_ && !std::isfinite(raw_norm);
    const StepVerdict verdict = guard.check(s + 1, loss, norm, overflow_here);
    // A step skipped for an overflow is no update: the LR schedule advances with updates (loss_scaler.h).
    const int64_t updates_before = s - (scaler_ ? scaler_->skipped_steps() : 0);
    const LossScaleUpdate scaling = scaler_ ? scaler_->update(s + 1, verdict.overflow) : LossScaleUpdate{};
    const std::string skip_reason = !verdict.overflow ? verdict.reason
                                    : scaling.describe() + (overflow_here ? "" : " (seen on another rank)");
    if (!dump_dir_.empty() && s == 0) {
      // Debugging output, not part of the step: its communication is not accounted.
      const std::vector<CommStats> saved = comm_snapshot();
      if (shard_optimizer) {  // each DP rank holds its shards of the reduced gradient: gather them
        float* whole = static_cast<float*>(be_->alloc(static_cast<size_t>(layout_.total) * 4));
        be_->copy(whole, grads_, static_cast<size_t>(layout_.total) * 4);
        grad_buffer_->gather_params(whole, DType::F32);
        dump_tensors(dump_dir_ + "/grads_step0.safetensors", whole, 1.0 / step_scale);
        be_->free(whole);
      } else {
        dump_tensors(dump_dir_ + "/grads_step0.safetensors", grads_, 1.0 / step_scale);
      }
      const std::vector<AccountedGroup> accounted = accounted_groups(cfg_, predicted_);
      for (size_t i = 0; i < accounted.size(); ++i)
        if (accounted[i].active) groups_.set_stats(accounted[i].kind, saved[i]);
    }
    const double lr = learning_rate(cfg_.optimizer, tc.steps, updates_before);
    const float clip = verdict.skip || compressed ? 1.0f : clip_factor(norm, cfg_.optimizer.grad_clip);
    if (verdict.skip) {
      be_->memset_zero(grads_, static_cast<size_t>(layout_.total) * 4);
      // A guard's skip counts as a step (step_guard.h); an overflow's does not (loss_scaler.h).
      if (!verdict.overflow) optimizer_->set_steps_taken(optimizer_->steps_taken() + 1);
      if (writer_)
        spdlog::warn("step {}: update skipped: {}", s + 1, skip_reason);
    } else if (compressed) {
      onebit_->step(master_, grads_, lr, act_ == DType::F32 ? nullptr : compute_, act_);
    } else {
      // The loss scale comes off with the clipping factor, in AdamW's one multiply.
      const float grad_scale = scaler_ ? static_cast<float>(clip / step_scale) : clip;
      optimizer_->step(master_, grads_, lr, grad_scale, act_ == DType::F32 ? nullptr : compute_, act_);
    }
    if (shard_optimizer && !verdict.skip) {
      // The optimizer zeroed the shards it consumed; the rest of the buffer holds this rank's
      // unreduced gradients. Then every rank gets the updated weights of every shard.
      be_->memset_zero(grads_, static_cast<size_t>(layout_.total) * 4);
      grad_buffer_->gather_params(compute_, act_);
    }
    be_->synchronize();
    watchdog_step_end();
    reached = s + 1;
    const double step_s = seconds_since(t0);
    if (s > start_step_) avg_step_s += (step_s - avg_step_s) / static_cast<double>(s - start_step_);

    StepMetrics m;
    m.step = s + 1;
    m.total_steps = tc.steps;
    m.loss = loss;
    m.lr = lr;
    m.grad_norm = norm;
    m.clip = clip;
    if (verdict.skip) m.skipped = skip_reason;
    if (scaler_) {
      m.loss_scale = step_scale;
      m.overflow = verdict.overflow;
    }
    m.ms = step_s * 1e3;
    m.tokens_per_s = tokens_per_step / step_s;
    m.mfu = stats.train_flops_per_token * m.tokens_per_s / peak_flops_;
    m.eta_s = (s > start_step_ ? avg_step_s : step_s) * static_cast<double>(tc.steps - s - 1);
    m.consumed_samples = train_loader_->consumed_samples();
    m.comm = comm_records(comm_before);
    if (groups_.pp->size() > 1) m.pipeline = pipeline_metrics();
    if (model_->has_moe()) m.moe = model_->take_moe_stats();
    for (const CommRecord& c : m.comm)
      if (!(c.measured == c.predicted))
        spdlog::warn("step {}: group {} moved {} but the layout predicts {}", s + 1, c.group,
                     c.measured.describe(), c.predicted.describe());
    const bool last = s + 1 == tc.steps;
    if (valid_source_ && ((tc.eval_every > 0 && (s + 1) % tc.eval_every == 0) || last)) {
      m.val_loss = evaluate();
      if (sampler_) m.sample = sample();
    }
    metrics_->write(m);
    if ((s + 1) % tc.log_every == 0 || last || m.val_loss) spdlog::info("{}", MetricsWriter::format_line(m));
    if (s == start_step_ && writer_) {  // which implementations the first step ran, where there is a choice
      const std::string kernels = be_->kernel_report();
      if (!kernels.empty()) spdlog::info("kernels: {}", kernels);
      const std::string memory = be_->memory_report();
      if (!memory.empty()) spdlog::info("{}", memory);
    }
    if (m.sample)
      spdlog::info("sample: \"{}\" -> \"{}\"", escape_text(cfg_.sample.prompt), escape_text(*m.sample));

    // Checkpoints: every checkpoint.every steps, at the end, and when a signal asked to stop.
    const bool stop = stop_requested() ||
                      (tc.exit_interval > 0 && (s + 1) % tc.exit_interval == 0 && !last);
    const bool periodic = cfg_.checkpoint.every > 0 && (s + 1) % cfg_.checkpoint.every == 0;
    const bool at_exit = cfg_.checkpoint.save_on_exit && (last || stop);
    if (!cfg_.checkpoint.dir.empty() && (periodic || at_exit)) {
      const auto c0 = std::chrono::steady_clock::now();
      CheckpointState state{s + 1, train_loader_->consumed_samples(), std::nullopt};
      if (scaler_) state.loss_scaler = scaler_->state();
      const std::string path = save_checkpoint(cfg_.checkpoint.dir, cfg_, groups_, *be_, checkpoint_buffers(), state);
      spdlog::info("checkpoint {} saved in {:.2f} s", path, seconds_since(c0));
    }
    if (stop) {
      spdlog::warn("stopping after step {} ({}){}", s + 1,
                   g_stop_cause == 2   ? "training.exit_after_min"
                   : g_stop_cause == 1 ? "a signal"
                                       : "training.exit_interval",
                   cfg_.checkpoint.save_on_exit && !cfg_.checkpoint.dir.empty() ? " (checkpoint saved)" : "");
      break;
    }
  }
  save_final_weights();
  if (!dump_dir_.empty() && writer_ && cfg_.parallel.dp == 1) {
    // The steps run here (from start_step_; a stop may end the run before tc.steps).
    std::vector<TensorRecord> records;
    const size_t per_step = static_cast<size_t>(tc.global_batch_size * (cfg_.model.seq_len + 1));
    const int64_t dumped = static_cast<int64_t>(dumped_batches_.size() / per_step);
    for (int64_t s = 0; s < dumped; ++s) {
      TensorRecord r;
      r.name = fmt::format("step_{}", start_step_ + s);
      r.dtype = DType::I32;
      r.shape = {tc.global_batch_size, cfg_.model.seq_len + 1};
      r.data.resize(per_step * 4);
      std::memcpy(r.data.data(), dumped_batches_.data() + s * per_step, per_step * 4);
      records.push_back(std::move(r));
    }
    write_safetensors(dump_dir_ + "/batches.safetensors", records);
  }
  struct rusage usage {};
  getrusage(RUSAGE_SELF, &usage);
  spdlog::info("done: {} steps in {}; peak memory of this rank {:.1f} MiB (optimizer state {:.1f} MiB)",
               reached, format_duration(seconds_since(run_t0)), static_cast<double>(usage.ru_maxrss) / 1024.0,
               static_cast<double>(optimizer_->state_bytes()) / 1048576.0);
}

}  // namespace tetra
