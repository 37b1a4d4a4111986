#include "trainer/train/trainer.h"

#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstring>
#include <filesystem>

#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "kernels/cpu/peak.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/core/check.h"
#include "trainer/core/log.h"
#include "trainer/data/data_loader.h"
#include "trainer/data/sample_source.h"
#include "trainer/model/flops.h"
#include "trainer/optim/lr_schedule.h"
#include "trainer/train/metrics.h"

namespace tetra {

namespace {

constexpr int64_t kMaxDumpedSteps = 100;

DType activation_type(const Config& cfg) { return cfg.training.precision == "bf16" ? DType::BF16 : DType::F32; }

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

MemoryPlan plan_memory(const Config& cfg, const ParamLayout& layout) {
  const DType act = activation_type(cfg);
  const int64_t B = cfg.training.micro_batch_size, T = cfg.model.seq_len;
  MemoryPlan m;
  m.master = static_cast<size_t>(layout.total) * 4;
  m.compute = act == DType::F32 ? 0 : static_cast<size_t>(layout.total) * dtype_size(act);
  m.grads = static_cast<size_t>(layout.total) * 4;
  m.optimizer = static_cast<size_t>(layout.total) * 8;
  m.activations = Gpt::activation_bytes_for(cfg.model, act, B);
  m.batch = static_cast<size_t>(B * T) * 8 + static_cast<size_t>(cfg.grad_accum_steps() * B * T) * 4;
  return m;
}

Trainer::Trainer(const Config& cfg, const std::string& config_path, std::string dump_dir)
    : cfg_(cfg), dump_dir_(std::move(dump_dir)), layout_(ParamLayout::build(cfg.model)) {
  act_ = activation_type(cfg);
  accum_ = cfg.grad_accum_steps();
  const int64_t B = cfg.training.micro_batch_size, T = cfg.model.seq_len;
  rows_ = B * T;

  // Linux overcommits: an allocation larger than the machine succeeds and the process is killed
  // later. Refuse such a run now, with the numbers.
  const MemoryPlan plan = plan_memory(cfg, layout_);
  const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  if (physical > 0 && static_cast<double>(plan.total()) > 0.95 * physical)
    throw InputError(fmt::format(
        "the run needs {:.1f} GiB ({:.1f} GiB of activations for training.micro_batch_size {}) but this "
        "machine has {:.1f} GiB of memory: lower training.micro_batch_size (use global_batch_size for "
        "gradient accumulation), model.seq_len or the model size",
        plan.total() / 1073741824.0, plan.activations / 1073741824.0, B, physical / 1073741824.0));
  // Data first: a missing or malformed dataset is reported before anything large is allocated.
  const int64_t total_train_samples = cfg.training.steps * cfg.training.global_batch_size;
  train_source_ = make_train_source(cfg, total_train_samples);
  if (cfg.training.eval_steps > 0)
    valid_source_ = make_valid_source(cfg, cfg.training.eval_steps * B);
  train_loader_ = std::make_unique<DataLoader>(train_source_, T, B, /*dp_rank=*/0, cfg.parallel.dp);
  log_to_file(cfg.logging.dir);
  metrics_ = std::make_unique<MetricsWriter>(cfg.logging.dir);
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
  tokens_ = static_cast<int32_t*>(be_->alloc(static_cast<size_t>(rows_) * 4));
  targets_ = static_cast<int32_t*>(be_->alloc(static_cast<size_t>(rows_) * 4));
  losses_ = static_cast<float*>(be_->alloc(static_cast<size_t>(accum_ * rows_) * 4));
  scalar_ = static_cast<float*>(be_->alloc(64));
  host_batch_.resize(static_cast<size_t>(B * (T + 1)));
  host_inputs_.resize(static_cast<size_t>(rows_));
  host_targets_.resize(static_cast<size_t>(rows_));

  model_ = std::make_unique<Gpt>(cfg.model, layout_, *be_, act_, B);
  optimizer_ = std::make_unique<AdamW>(cfg.optimizer, layout_, *be_);

  const int threads = omp_get_max_threads();
  peak_flops_ = cfg.training.peak_gflops > 0
                    ? cfg.training.peak_gflops * 1e9
                    : measure_cpu_peak_gflops(threads, act_ == DType::BF16) * 1e9;

  const ModelStats stats = model_stats(cfg.model, layout_);
  spdlog::info("model: {} parameters ({} in matmuls), {} layers, hidden {}, heads {}/{} (q/kv), ffn {}, "
               "vocab {}, seq_len {}, {} + {} + {} positions",
               stats.params, stats.matmul_params, cfg.model.num_layers, cfg.model.hidden_size,
               cfg.model.num_heads, cfg.model.num_kv_heads, cfg.model.ffn_hidden_size,
               cfg.model.vocab_size, cfg.model.seq_len, cfg.model.norm, cfg.model.activation,
               cfg.model.position);
  spdlog::info("run: backend {} with {} threads, precision {}, micro-batch {} x {} accumulation = "
               "global batch {} ({} tokens/step), {} steps, {:.2f} GFLOP/token",
               be_->name(), threads, cfg.training.precision, B, accum_, cfg.training.global_batch_size,
               cfg.training.global_batch_size * T, cfg.training.steps, stats.train_flops_per_token / 1e9);
  spdlog::info("memory: {:.1f} MiB (weights {:.1f}, grads {:.1f}, optimizer {:.1f}, activations {:.1f}); "
               "peak {:.1f} GFLOP/s ({})",
               plan.total() / 1048576.0, (plan.master + plan.compute) / 1048576.0, plan.grads / 1048576.0,
               plan.optimizer / 1048576.0, plan.activations / 1048576.0, peak_flops_ / 1e9,
               cfg.training.peak_gflops > 0 ? "training.peak_gflops" : "measured");

  nlohmann::ordered_json start;
  start["event"] = "start";
  start["params"] = stats.params;
  start["flops_per_token"] = stats.train_flops_per_token;
  start["peak_flops"] = peak_flops_;
  metrics_->start(start.dump());

  if (!dump_dir_.empty()) {
    std::filesystem::create_directories(dump_dir_);
    dump_tensors(dump_dir_ + "/params_init.safetensors", master_);
  }
}

Trainer::~Trainer() {
  optimizer_.reset();
  model_.reset();
  if (be_) {
    for (void* p : {static_cast<void*>(master_), static_cast<void*>(grads_), static_cast<void*>(tokens_),
                    static_cast<void*>(targets_), static_cast<void*>(losses_), static_cast<void*>(scalar_)})
      if (p) be_->free(p);
    if (compute_ && compute_ != master_) be_->free(compute_);
  }
}

void Trainer::dump_tensors(const std::string& file, const float* buffer) const {
  std::vector<float> host(static_cast<size_t>(layout_.total));
  be_->copy_to_host(host.data(), buffer, host.size() * 4);
  std::vector<TensorRecord> records;
  for (const ParamSpec& p : layout_.params) {
    TensorRecord r;
    r.name = p.name;
    r.dtype = DType::F32;
    r.shape = p.shape;
    r.data.resize(static_cast<size_t>(p.numel) * 4);
    std::memcpy(r.data.data(), host.data() + p.offset, r.data.size());
    records.push_back(std::move(r));
  }
  write_safetensors(file, records);
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
  // grads_ is zero here: zeroed at start-up, then by each optimizer step as it consumes them.
  // The step's loss is the mean over its global batch; each micro-batch's gradient is scaled so
  // the accumulated gradient is that mean's gradient.
  const float dloss_scale = 1.0f / static_cast<float>(rows_ * accum_);
  for (int64_t j = 0; j < accum_; ++j) {
    load_micro_batch(*train_loader_);
    if (!dump_dir_.empty() && s < kMaxDumpedSteps)
      dumped_batches_.insert(dumped_batches_.end(), host_batch_.begin(), host_batch_.end());
    model_->forward(compute_, tokens_, targets_, losses_ + j * rows_, dloss_scale);
    model_->backward(compute_, grads_, tokens_);
  }
  be_->sum(scalar_, losses_, accum_ * rows_);
  float loss_sum = 0.0f;
  be_->copy_to_host(&loss_sum, scalar_, sizeof(float));
  return static_cast<double>(loss_sum) / static_cast<double>(rows_ * accum_);
}

double Trainer::evaluate() {
  TETRA_CHECK(valid_source_ && cfg_.training.eval_steps > 0, "evaluate() needs validation data and "
              "training.eval_steps > 0");
  DataLoader loader(valid_source_, cfg_.model.seq_len, cfg_.training.micro_batch_size, /*dp_rank=*/0,
                    cfg_.parallel.dp);
  double total = 0.0;
  for (int64_t j = 0; j < cfg_.training.eval_steps; ++j) {
    load_micro_batch(loader);
    model_->forward(compute_, tokens_, targets_, losses_, /*dloss_scale=*/0.0f);
    be_->sum(scalar_, losses_, rows_);
    float sum = 0.0f;
    be_->copy_to_host(&sum, scalar_, sizeof(float));
    total += sum;
  }
  return total / static_cast<double>(rows_ * cfg_.training.eval_steps);
}

void Trainer::run() {
  const TrainingConfig& tc = cfg_.training;
  const ModelStats stats = model_stats(cfg_.model, layout_);
  const double tokens_per_step = static_cast<double>(tc.global_batch_size * cfg_.model.seq_len);
  double avg_step_s = 0.0;  // mean over steps after the first (which pays one-off set-up costs)
  const auto run_t0 = std::chrono::steady_clock::now();

  for (int64_t s = 0; s < tc.steps; ++s) {
    const auto t0 = std::chrono::steady_clock::now();
    const double loss = train_step(s);
    if (!std::isfinite(loss))
      throw Error(fmt::format("step {}: the training loss is {}; lower optimizer.lr{}", s + 1, loss,
                              cfg_.optimizer.grad_clip > 0 ? "" : " or set optimizer.grad_clip"));
    const double norm = grad_global_norm(*be_, grads_, layout_.total, scalar_);
    if (!std::isfinite(norm))
      throw Error(fmt::format("step {}: the gradient norm is {} (the loss, {:.4f}, is finite): some "
                              "activation overflowed; lower optimizer.lr, or use precision fp32",
                              s + 1, norm, loss));
    if (!dump_dir_.empty() && s == 0) dump_tensors(dump_dir_ + "/grads_step0.safetensors", grads_);
    const double lr = learning_rate(cfg_.optimizer, tc.steps, s);
    const float clip = clip_factor(norm, cfg_.optimizer.grad_clip);
    optimizer_->step(master_, grads_, lr, clip, act_ == DType::F32 ? nullptr : compute_, act_);
    be_->synchronize();
    const double step_s = seconds_since(t0);
    if (s > 0) avg_step_s += (step_s - avg_step_s) / static_cast<double>(s);

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
    m.eta_s = (s > 0 ? avg_step_s : step_s) * static_cast<double>(tc.steps - s - 1);
    m.consumed_samples = train_loader_->consumed_samples();
    const bool last = s + 1 == tc.steps;
    if (valid_source_ && ((tc.eval_every > 0 && (s + 1) % tc.eval_every == 0) || last))
      m.val_loss = evaluate();
    metrics_->write(m);
    if ((s + 1) % tc.log_every == 0 || last || m.val_loss) spdlog::info("{}", MetricsWriter::format_line(m));
  }
  if (!dump_dir_.empty()) {
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
  spdlog::info("done: {} steps in {}", tc.steps, format_duration(seconds_since(run_t0)));
}

}  // namespace tetra
