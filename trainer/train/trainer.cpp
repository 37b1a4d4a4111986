#include "trainer/train/trainer.h"

#include <omp.h>
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

#include "kernels/cpu/peak.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/core/check.h"
#include "trainer/core/log.h"
#include "trainer/data/data_loader.h"
#include "trainer/data/sample_source.h"
#include "trainer/data/tokenizer.h"
#include "trainer/dist/process_groups.h"
#include "trainer/model/flops.h"
#include "trainer/model/sampler.h"
#include "trainer/optim/lr_schedule.h"
#include "trainer/train/generate.h"
#include "trainer/train/metrics.h"

namespace tetra {

namespace {

constexpr int64_t kMaxDumpedSteps = 100;

DType activation_type(const Config& cfg) { return cfg.training.precision == "bf16" ? DType::BF16 : DType::F32; }

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

ParamLayout rank_layout(const Config& cfg, int64_t tp_rank) {
  TensorSlicing slicing;
  slicing.tp = cfg.parallel.tp;
  slicing.tp_rank = tp_rank;
  slicing.sequence_parallel = cfg.parallel.sequence_parallel;
  // Buckets split into dp aligned shards: the distributed optimizer's, and onebit's chunks.
  const bool shards = cfg.parallel.distributed_optimizer || cfg.parallel.grad_compression == "onebit";
  slicing.group_align = shards ? 16 * cfg.parallel.dp : 16;
  return ParamLayout::build(cfg.model, slicing);
}

MemoryPlan plan_memory(const Config& cfg, const ParamLayout& layout) {
  const DType act = activation_type(cfg);
  const int64_t B = cfg.training.micro_batch_size, T = cfg.model.seq_len;
  const size_t n = static_cast<size_t>(layout.total);
  // The distributed optimizer keeps Adam's moments (and, in bf16, the fp32 master weights) for
  // this rank's 1/dp of the buffer only.
  const size_t shard = cfg.parallel.distributed_optimizer ? n / static_cast<size_t>(cfg.parallel.dp) : n;
  MemoryPlan m;
  m.master = act == DType::F32 ? n * 4 : shard * 4;
  m.compute = act == DType::F32 ? 0 : n * dtype_size(act);
  m.grads = n * 4;
  m.optimizer = shard * 8;
  // Gradient compression's buffers (grad_buffer.h, onebit_adam.h): the bf16 copy of the buffer;
  // the worker error (n), the server error and average (n / dp each), two 1-bit messages.
  const size_t dp = static_cast<size_t>(cfg.parallel.dp);
  if (dp > 1 && cfg.parallel.grad_compression == "bf16") m.grads += n * 2;
  if (dp > 1 && cfg.parallel.grad_compression == "onebit")  // + the whole frozen variance when sharded
    m.optimizer += n * 4 + 2 * (n / dp) * 4 + n / 2 + (cfg.parallel.distributed_optimizer ? n * 4 : 0);
  m.activations = Gpt::activation_bytes_for(cfg.model, act, B, cfg.parallel.tp, cfg.parallel.sequence_parallel);
  m.batch = static_cast<size_t>(B * T) * 8 + static_cast<size_t>(cfg.grad_accum_steps() * B * T) * 4;
  if (samples_enabled(cfg))  // the sampling model's arena and its (T) ids and two logit rows
    m.sampling = Gpt::activation_bytes_for(cfg.model, act, 1, cfg.parallel.tp) +
                 static_cast<size_t>(T) * 4 + static_cast<size_t>(cfg.model.vocab_size) * 8;
  return m;
}

Trainer::Trainer(const Config& cfg, const std::string& config_path, ProcessGroups& groups, std::string dump_dir)
    : cfg_(cfg),
      groups_(groups),
      writer_(groups.rank == 0),
      dump_dir_(std::move(dump_dir)),
      layout_(rank_layout(cfg, groups.coord.tp)) {
  act_ = activation_type(cfg);
  accum_ = cfg.grad_accum_steps();
  const int64_t B = cfg.training.micro_batch_size, T = cfg.model.seq_len;
  rows_ = B * T;
  const bool shard_optimizer = cfg.parallel.distributed_optimizer && cfg.parallel.dp > 1;

  // Linux overcommits: an allocation larger than the machine succeeds and the process is killed
  // later. Refuse such a run now, with the numbers (all ranks of a node share its memory).
  const MemoryPlan plan = plan_memory(cfg, layout_);
  const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  const double ranks_here = static_cast<double>(std::min<int64_t>(groups.grid.world(), local_ranks()));
  if (physical > 0 && static_cast<double>(plan.total()) * ranks_here > 0.95 * physical)
    throw InputError(fmt::format(
        "the run needs {:.1f} GiB per rank x {} ranks on this machine ({:.1f} GiB of activations for "
        "training.micro_batch_size {}) but it has {:.1f} GiB of memory: lower "
        "training.micro_batch_size (use global_batch_size for gradient accumulation), model.seq_len "
        "or the model size, or use more tensor parallelism / the distributed optimizer",
        plan.total() / 1073741824.0, ranks_here, plan.activations / 1073741824.0, B,
        physical / 1073741824.0));
  // Data first: a missing or malformed dataset is reported before anything large is allocated.
  const int64_t total_train_samples = cfg.training.steps * cfg.training.global_batch_size;
  train_source_ = make_train_source(cfg, total_train_samples);
  if (cfg.training.eval_steps > 0)
    valid_source_ = make_valid_source(cfg, cfg.training.eval_steps * cfg.training.global_batch_size);
  if (samples_enabled(cfg)) tokenizer_ = load_sampling_tokenizer(cfg);
  train_loader_ = std::make_unique<DataLoader>(train_source_, T, B, groups.coord.dp, cfg.parallel.dp);
  // The checkpoint to resume from is found (or refused) before any file is written.
  const std::string resume = checkpoint_to_resume(cfg.checkpoint);
  if (writer_) {
    log_to_file(cfg.logging.dir);
    metrics_ = std::make_unique<MetricsWriter>(cfg.logging.dir);
  } else {
    metrics_ = std::make_unique<MetricsWriter>("");
  }
  spdlog::info("config {}: {}", config_path, config_to_json(cfg).dump());
  spdlog::info("data: train {}{}", train_source_->describe(),
               valid_source_ ? ", valid " + valid_source_->describe() : std::string());

  be_ = make_cpu_backend(static_cast<int>(cfg.training.threads));
  const size_t n = static_cast<size_t>(layout_.total);
  master_ = static_cast<float*>(be_->alloc(n * 4));
  grads_ = static_cast<float*>(be_->alloc(n * 4));
  be_->memset_zero(grads_, n * 4);
  {
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
    if (writer_) std::filesystem::create_directories(dump_dir_);
    dump_tensors(dump_dir_ + "/params_init.safetensors", master_);
  }
  tokens_ = static_cast<int32_t*>(be_->alloc(static_cast<size_t>(rows_) * 4));
  targets_ = static_cast<int32_t*>(be_->alloc(static_cast<size_t>(rows_) * 4));
  losses_ = static_cast<float*>(be_->alloc(static_cast<size_t>(accum_ * rows_) * 4));
  scalar_ = static_cast<float*>(be_->alloc(64));
  host_batch_.resize(static_cast<size_t>(B * (T + 1)));
  host_inputs_.resize(static_cast<size_t>(rows_));
  host_targets_.resize(static_cast<size_t>(rows_));

  model_ = std::make_unique<Gpt>(cfg.model, layout_, *be_, act_, B, groups.tp.get());
  grad_buffer_ = std::make_unique<GradBuffer>(layout_, *be_, grads_, groups.dp.get(), groups.tp.get(),
                                              cfg.parallel.distributed_optimizer, cfg.parallel.bucket_size,
                                              cfg.parallel.grad_compression == "bf16");
  grad_norm_ = std::make_unique<GradNorm>(layout_, grad_buffer_->owned(), *be_, groups.tp.get(),
                                          shard_optimizer ? groups.dp.get() : nullptr);
  // bf16 with the distributed optimizer: the fp32 master weights live sharded in the optimizer.
  const bool optimizer_owns_master = shard_optimizer && act_ != DType::F32;
  optimizer_ = std::make_unique<AdamW>(cfg.optimizer, layout_, *be_, grad_buffer_->owned(),
                                       optimizer_owns_master, master_);
  if (cfg.parallel.grad_compression == "onebit")
    onebit_ = std::make_unique<OnebitAdam>(cfg, layout_, *be_, *grad_buffer_, *optimizer_, groups.dp.get());
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
    optimizer_->set_steps_taken(st.step);
  }
  if (tokenizer_) {
    // Without sequence parallelism: for one row of T tokens it would save little, and it would
    // need T divisible by tp. The parameter offsets do not depend on it.
    sample_layout_ = layout_;
    sample_layout_.slicing.sequence_parallel = false;
    sample_model_ = std::make_unique<Gpt>(cfg.model, sample_layout_, *be_, act_, 1, groups.tp.get());
    sampler_ = std::make_unique<Sampler>(*sample_model_, *be_, groups.tp.get());
  }
  predicted_ = predict_step_volume(cfg, layout_);

  const int threads = omp_get_max_threads();
  const double rank_peak = cfg.training.peak_gflops > 0
                               ? cfg.training.peak_gflops * 1e9
                               : measure_cpu_peak_gflops(threads, act_ == DType::BF16) * 1e9;
  peak_flops_ = rank_peak * static_cast<double>(groups.grid.world());

  const ParamLayout whole = ParamLayout::build(cfg.model);
  const ModelStats stats = model_stats(cfg.model, whole);
  spdlog::info("model: {} parameters ({} in matmuls), {} layers, hidden {}, heads {}/{} (q/kv), ffn {}, "
               "vocab {}, seq_len {}, {} + {} + {} positions",
               stats.params, stats.matmul_params, cfg.model.num_layers, cfg.model.hidden_size,
               cfg.model.num_heads, cfg.model.num_kv_heads, cfg.model.ffn_hidden_size,
               cfg.model.vocab_size, cfg.model.seq_len, cfg.model.norm, cfg.model.activation,
               cfg.model.position);
  spdlog::info("layout: {} ranks = tp {} x pp {} x dp {} (order {}){}{}; {} gradient bucket(s)",
               groups.grid.world(), cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.dp, cfg.parallel.order,
               cfg.parallel.sequence_parallel ? ", sequence parallel" : "",
               cfg.parallel.distributed_optimizer ? ", distributed optimizer" : "",
               grad_buffer_->num_buckets());
  spdlog::info("run: backend {} with {} threads per rank, precision {}, micro-batch {} x {} accumulation "
               "x dp {} = global batch {} ({} tokens/step), {} steps, {:.2f} GFLOP/token",
               be_->name(), threads, cfg.training.precision, B, accum_, cfg.parallel.dp,
               cfg.training.global_batch_size, cfg.training.global_batch_size * T, cfg.training.steps,
               stats.train_flops_per_token / 1e9);
  spdlog::info("memory per rank: {:.1f} MiB (weights {:.1f}, grads {:.1f}, optimizer {:.1f}, activations "
               "{:.1f}); peak {:.1f} GFLOP/s per rank ({})",
               plan.total() / 1048576.0, (plan.master + plan.compute) / 1048576.0, plan.grads / 1048576.0,
               plan.optimizer / 1048576.0, plan.activations / 1048576.0, rank_peak / 1e9,
               cfg.training.peak_gflops > 0 ? "training.peak_gflops" : "measured");
  if (sampler_)
    spdlog::info("samples: at each evaluation, up to {} tokens after \"{}\" (temperature {}, top-k {}, "
                 "seed {}, tokenizer {})",
                 cfg.sample.max_tokens, escape_text(cfg.sample.prompt), cfg.sample.temperature,
                 cfg.sample.top_k, cfg.sample.seed, cfg.data.tokenizer);
  else if (!cfg.sample.prompt.empty() && cfg.training.eval_steps == 0)
    spdlog::info("samples: none during training (sample.prompt is set but training.eval_steps is 0)");
  if (groups.grid.world() > 1)
    spdlog::info("communication per step (predicted): tp: {}; dp: {}", predicted_.tp.describe(),
                 predicted_.dp.describe());
  if (onebit_ && onebit_->compressed(cfg.training.steps))
    spdlog::info("communication per step after the {} warm-up steps of onebit (predicted): dp: {}",
                 cfg.parallel.onebit_warmup_steps, predict_step_volume(cfg, layout_, true).dp.describe());

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
  sampler_.reset();
  sample_model_.reset();
  onebit_.reset();
  optimizer_.reset();
  grad_norm_.reset();
  grad_buffer_.reset();
  model_.reset();
  if (be_) {
    for (void* p : {static_cast<void*>(master_), static_cast<void*>(grads_), static_cast<void*>(tokens_),
                    static_cast<void*>(targets_), static_cast<void*>(losses_), static_cast<void*>(scalar_)})
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
  return b;
}

namespace {
volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }
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
  if (groups_.world->size() > 1) {
    int32_t* dev = reinterpret_cast<int32_t*>(scalar_);
    be_->copy_from_host(dev, &flag, 4);
    groups_.world->all_reduce(dev, 1, DType::I32, ReduceOp::MAX);
    be_->copy_to_host(&flag, dev, 4);
  }
  return flag != 0;
}

void Trainer::dump_tensors(const std::string& file, const float* buffer) {
  std::vector<float> host(static_cast<size_t>(layout_.total));
  be_->copy_to_host(host.data(), buffer, host.size() * 4);
  Communicator& tp = *groups_.tp;
  const int p = tp.size();
  std::vector<ParamLayout> layouts;  // every TP rank's layout: where its slices sit
  for (int r = 0; r < p; ++r) layouts.push_back(r == tp.rank() ? layout_ : rank_layout(cfg_, r));
  std::vector<TensorRecord> records;
  for (size_t i = 0; i < layout_.params.size(); ++i) {
    const ParamSpec& spec = layout_.params[i];
    int64_t global = 1;
    for (int64_t d : spec.global_shape) global *= d;
    std::vector<float> slices(static_cast<size_t>(spec.numel) * (spec.tp_split ? p : 1));
    if (spec.tp_split && p > 1)
      tp.all_gather(slices.data(), host.data() + spec.offset, spec.numel, DType::F32);
    else
      std::memcpy(slices.data(), host.data() + spec.offset, static_cast<size_t>(spec.numel) * 4);
    if (!writer_) continue;
    TensorRecord r;
    r.name = spec.name;
    r.dtype = DType::F32;
    r.shape = spec.global_shape;
    r.data.resize(static_cast<size_t>(global) * 4);
    float* out = reinterpret_cast<float*>(r.data.data());
    for (int q = 0; q < (spec.tp_split ? p : 1); ++q) {
      const ParamSpec& qs = layouts[q].params[i];
      const float* src = slices.data() + static_cast<size_t>(q) * spec.numel;
      for (int64_t e = 0; e < qs.numel; ++e) out[qs.global_index(e)] = src[e];
    }
    records.push_back(std::move(r));
  }
  if (writer_) write_safetensors(file, records);
}

void Trainer::save_final_weights() {
  const std::string path = final_weights_path(cfg_);
  if (path.empty()) return;
  const auto t0 = std::chrono::steady_clock::now();
  const float* weights = master_;
  float* whole = nullptr;
  if (!master_) {
    // bf16 with the distributed optimizer: each DP rank's optimizer holds the fp32 master weights
    // of its shards, back to back; every DP rank takes part in gathering them.
    whole = static_cast<float*>(be_->alloc(static_cast<size_t>(layout_.total) * 4));
    const float* shard = optimizer_->master_shard();
    int64_t at = 0;
    for (const GradRange& o : grad_buffer_->owned()) {
      be_->copy(whole + o.offset, shard + at, static_cast<size_t>(o.numel) * 4);
      at += o.numel;
    }
    grad_buffer_->gather_params(whole, DType::F32);
    weights = whole;
  }
  // Global rank 0 writes, gathering the TP slices of its TP group; the other DP replicas hold the
  // same weights and need not gather theirs.
  if (groups_.coord.dp == 0) dump_tensors(path, weights);
  if (whole) be_->free(whole);
  spdlog::info("final weights: {} ({} tensors, fp32 master weights) in {:.1f} s", path, layout_.params.size(),
               seconds_since(t0));
}

std::string Trainer::sample() {
  TETRA_CHECK(sampler_, "sample() without sample.prompt, data.tokenizer and training.eval_steps");
  return generate_text(*sampler_, compute_, *tokenizer_, cfg_.sample.prompt, cfg_.sample);
}

void Trainer::load_micro_batch(DataLoader& loader) {
  const int64_t T = cfg_.model.seq_len, B = cfg_.training.micro_batch_size;
  loader.next(host_batch_.data());
  // A sample is T+1 tokens: the model reads the first T and predicts the last T.
  for (int64_t b = 0; b < B; ++b) {
    const int32_t* row = host_batch_.data() + b * (T + 1);
    std::memcpy(host_inputs_.data() + b * T, row, static_cast<size_t>(T) * 4);
    std::memcpy(host_targets_.data() + b * T, row + 1, static_cast<size_t>(T) * 4);
  }
  be_->copy_from_host(tokens_, host_inputs_.data(), static_cast<size_t>(rows_) * 4);
  be_->copy_from_host(targets_, host_targets_.data(), static_cast<size_t>(rows_) * 4);
}

double Trainer::train_step(int64_t s) {
  // grads_ is zero here: zeroed at start-up, then after each optimizer step.
  // The step's loss is the mean over its global batch; each micro-batch's gradient is scaled so
  // the accumulated gradient, summed over the DP ranks, is that mean's gradient.
  const int64_t tokens = rows_ * accum_ * cfg_.parallel.dp;
  const float dloss_scale = 1.0f / static_cast<float>(tokens);
  for (int64_t j = 0; j < accum_; ++j) {
    load_micro_batch(*train_loader_);
    if (!dump_dir_.empty() && s < kMaxDumpedSteps && cfg_.parallel.dp == 1)
      dumped_batches_.insert(dumped_batches_.end(), host_batch_.begin(), host_batch_.end());
    model_->forward(compute_, tokens_, targets_, losses_ + j * rows_, dloss_scale);
    // The last micro-batch finalises the gradients: their reduction overlaps its backward.
    model_->backward(compute_, grads_, tokens_, j + 1 == accum_ ? &group_done_ : nullptr);
  }
  grad_buffer_->finish();
  be_->sum(scalar_, losses_, accum_ * rows_);
  groups_.dp->all_reduce(scalar_, 1, DType::F32, ReduceOp::SUM);
  float loss_sum = 0.0f;
  be_->copy_to_host(&loss_sum, scalar_, sizeof(float));
  return static_cast<double>(loss_sum) / static_cast<double>(tokens);
}

double Trainer::evaluate() {
  TETRA_CHECK(valid_source_ && cfg_.training.eval_steps > 0, "evaluate() needs validation data and "
              "training.eval_steps > 0");
  DataLoader loader(valid_source_, cfg_.model.seq_len, cfg_.training.micro_batch_size, groups_.coord.dp,
                    cfg_.parallel.dp);
  const int64_t micro_batches = cfg_.training.eval_steps * accum_;
  double total = 0.0;
  for (int64_t j = 0; j < micro_batches; ++j) {
    load_micro_batch(loader);
    model_->forward(compute_, tokens_, targets_, losses_, /*dloss_scale=*/0.0f);
    be_->sum(scalar_, losses_, rows_);
    float sum = 0.0f;
    be_->copy_to_host(&sum, scalar_, sizeof(float));
    total += sum;
  }
  float local = static_cast<float>(total);
  be_->copy_from_host(scalar_, &local, sizeof(float));
  groups_.dp->all_reduce(scalar_, 1, DType::F32, ReduceOp::SUM);
  be_->copy_to_host(&local, scalar_, sizeof(float));
  return static_cast<double>(local) / static_cast<double>(rows_ * micro_batches * cfg_.parallel.dp);
}

std::vector<CommRecord> Trainer::comm_records(const CommStats& tp_before, const CommStats& dp_before) const {
  struct Group {
    const char* name;
    const Communicator* comm;
    const CommStats* before;
    const GroupVolume* predicted;
  };
  const Group groups[] = {{"tp", groups_.tp.get(), &tp_before, &predicted_.tp},
                          {"dp", groups_.dp.get(), &dp_before, &predicted_.dp}};
  std::vector<CommRecord> out;
  for (const Group& g : groups) {
    if (g.comm->size() <= 1) continue;
    CommRecord r;
    r.group = g.name;
    r.measured = measured_volume(g.comm->stats(), *g.before);
    r.predicted = *g.predicted;
    r.sent_bytes = g.comm->stats().total_sent() - g.before->total_sent();
    r.blocked_ms = 1e3 * (g.comm->stats().total_blocked_s() - g.before->total_blocked_s());
    out.push_back(std::move(r));
  }
  return out;
}

void Trainer::run() {
  const TrainingConfig& tc = cfg_.training;
  const ModelStats stats = model_stats(cfg_.model, ParamLayout::build(cfg_.model));
  const double tokens_per_step = static_cast<double>(tc.global_batch_size * cfg_.model.seq_len);
  const bool shard_optimizer = grad_buffer_->sharded();
  double avg_step_s = 0.0;  // mean over steps after the first (which pays one-off set-up costs)
  const auto run_t0 = std::chrono::steady_clock::now();

  install_stop_signals();
  for (int64_t s = start_step_; s < tc.steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    const CommStats tp_before = groups_.tp->stats(), dp_before = groups_.dp->stats();
    const bool compressed = onebit_ && onebit_->compressed(s);  // 1-bit Adam past its warm-up
    grad_buffer_->set_reduce(!compressed);
    predicted_ = predict_step_volume(cfg_, layout_, compressed, compressed && onebit_->gathers_variance());
    const double loss = train_step(s);
    if (!std::isfinite(loss))
      throw Error(fmt::format("step {}: the training loss is {}; lower optimizer.lr{}", s + 1, loss,
                              cfg_.optimizer.grad_clip > 0 ? "" : " or set optimizer.grad_clip"));
    // Compressed: the unreduced local gradient's norm, times dp, as an estimate (onebit_adam.h).
    const double norm = grad_norm_->compute(grads_) * (compressed ? static_cast<double>(cfg_.parallel.dp) : 1.0);
    if (!std::isfinite(norm))
      throw Error(fmt::format("step {}: the gradient norm is {} (the loss, {:.4f}, is finite): some "
                              "activation overflowed; lower optimizer.lr, or use precision fp32",
                              s + 1, norm, loss));
    if (!dump_dir_.empty() && s == 0) {
      // Debugging output, not part of the step: its communication is not accounted.
      const CommStats tp_saved = groups_.tp->stats(), dp_saved = groups_.dp->stats();
      if (shard_optimizer) {  // each DP rank holds its shards of the reduced gradient: gather them
        float* whole = static_cast<float*>(be_->alloc(static_cast<size_t>(layout_.total) * 4));
        be_->copy(whole, grads_, static_cast<size_t>(layout_.total) * 4);
        grad_buffer_->gather_params(whole, DType::F32);
        dump_tensors(dump_dir_ + "/grads_step0.safetensors", whole);
        be_->free(whole);
      } else {
        dump_tensors(dump_dir_ + "/grads_step0.safetensors", grads_);
      }
      groups_.tp->stats() = tp_saved;
      groups_.dp->stats() = dp_saved;
    }
    const double lr = learning_rate(cfg_.optimizer, tc.steps, s);
    const float clip = compressed ? 1.0f : clip_factor(norm, cfg_.optimizer.grad_clip);
    if (compressed)
      onebit_->step(master_, grads_, lr, act_ == DType::F32 ? nullptr : compute_, act_);
    else
      optimizer_->step(master_, grads_, lr, clip, act_ == DType::F32 ? nullptr : compute_, act_);
    if (shard_optimizer) {
      // The optimizer zeroed the shards it consumed; the rest of the buffer holds this rank's
      // unreduced gradients. Then every rank gets the updated weights of every shard.
      be_->memset_zero(grads_, static_cast<size_t>(layout_.total) * 4);
      grad_buffer_->gather_params(compute_, act_);
    }
    be_->synchronize();
    const double step_s = seconds_since(t0);
    if (s > start_step_) avg_step_s += (step_s - avg_step_s) / static_cast<double>(s - start_step_);

    StepMetrics m;
    m.step = s + 1;
    m.total_steps = tc.steps;
    m.loss = loss;
    m.lr = lr;
    m.grad_norm = norm;
    m.clip = clip;
    m.ms = step_s * 1e3;
    m.tokens_per_s = tokens_per_step / step_s;
    m.mfu = stats.train_flops_per_token * m.tokens_per_s / peak_flops_;
    m.eta_s = (s > start_step_ ? avg_step_s : step_s) * static_cast<double>(tc.steps - s - 1);
    m.consumed_samples = train_loader_->consumed_samples();
    m.comm = comm_records(tp_before, dp_before);
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
    if (m.sample)
      spdlog::info("sample: \"{}\" -> \"{}\"", escape_text(cfg_.sample.prompt), escape_text(*m.sample));

    // Checkpoints: every checkpoint.every steps, at the end, and when a signal asked to stop.
    const bool stop = stop_requested() ||
                      (tc.exit_interval > 0 && (s + 1) % tc.exit_interval == 0 && !last);
    const bool periodic = cfg_.checkpoint.every > 0 && (s + 1) % cfg_.checkpoint.every == 0;
    const bool at_exit = cfg_.checkpoint.save_on_exit && (last || stop);
    if (!cfg_.checkpoint.dir.empty() && (periodic || at_exit)) {
      const auto c0 = std::chrono::steady_clock::now();
      const std::string path = save_checkpoint(cfg_.checkpoint.dir, cfg_, groups_, *be_, checkpoint_buffers(),
                                               CheckpointState{s + 1, train_loader_->consumed_samples()});
      spdlog::info("checkpoint {} saved in {:.2f} s", path, seconds_since(c0));
    }
    if (stop) {
      spdlog::warn("stopping after step {} ({}){}", s + 1,
                   tc.exit_interval > 0 && (s + 1) % tc.exit_interval == 0 ? "training.exit_interval" : "a signal",
                   cfg_.checkpoint.save_on_exit && !cfg_.checkpoint.dir.empty() ? " (checkpoint saved)" : "");
      break;
    }
  }
  save_final_weights();
  if (!dump_dir_.empty() && writer_ && cfg_.parallel.dp == 1) {
    const int64_t dumped = std::min<int64_t>(tc.steps, kMaxDumpedSteps);
    std::vector<TensorRecord> records;
    const size_t per_step = static_cast<size_t>(tc.global_batch_size * (cfg_.model.seq_len + 1));
    for (int64_t s = 0; s < dumped; ++s) {
      TensorRecord r;
      r.name = fmt::format("step_{}", s);
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
               tc.steps, format_duration(seconds_since(run_t0)), static_cast<double>(usage.ru_maxrss) / 1024.0,
               static_cast<double>(optimizer_->state_bytes()) / 1048576.0);
}

}  // namespace tetra
