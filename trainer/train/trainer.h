// The training loop: micro-batches × gradient accumulation, gradient reduction over data
// parallelism, AdamW step (sharded with the distributed optimizer), LR schedule, clipping,
// periodic evaluation with a text sample, metrics and communication accounting; the final weights
// exported at the end.
//
// Everything is allocated in the constructor (parameters, gradients, optimizer state, the model's
// activation arena, batch buffers); run() allocates nothing per step. Each rank holds its
// tensor-parallel slice of the model and reads its data-parallel slice of every global batch;
// global rank 0 writes the log file and metrics.jsonl.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/config/config.h"
#include "trainer/model/gpt.h"
#include "trainer/optim/grad_buffers.h"
#include "trainer/optim/weight_units.h"
#include "trainer/parallel/pipeline_runner.h"
#include "trainer/params/param_layout.h"
#include "trainer/train/comm_accounting.h"
#include "trainer/train/compute_device.h"
#include "trainer/train/debug_dump.h"
#include "trainer/train/memory_plan.h"
#include "trainer/train/metrics.h"
#include "trainer/train/pipeline_model.h"
#include "trainer/train/step_trace.h"
#include "trainer/train/stop_requests.h"
#include "trainer/train/straggler.h"
#include "trainer/train/updater.h"

namespace tetra {

class SampleSource;
class Sampler;
class Tokenizer;
struct ProcessGroups;
class DataLoader;
class MetricsWriter;
class PipelineModel;

// The step time the planner predicts for a run on its device (trainer/plan/, reached through the
// command line: the loop does not know the planner), logged at start-up and beside every measured
// step. `world` is the run's rank count. Every rank calls it at the same time.
struct PlannedStep {
  double step_s = 0.0;
  std::string description;  // its parts and the cluster it was predicted for
};
using StepPlanner = std::function<std::optional<PlannedStep>(const Config&, const ComputeDevice&, int64_t world)>;

class Trainer {
 public:
  // `dump_dir` non-empty: write initial weights, step-0 gradients and the batches (debug_dump.h).
  // `device`: the GPU (local rank), attention path and test modes (compute_device.h).
  // `planner`: the step time to log beside the measured one (none: not logged).
  Trainer(const Config& cfg, const std::string& config_path, ProcessGroups& groups,
          std::string dump_dir = "", const DeviceOptions& device = {}, const StepPlanner& planner = {});
  ~Trainer();

  void run();
  // Mean loss over `eval_steps` global batches of the validation set, from its start (each DP
  // rank evaluates its slice of each). With `stops`, a stop request (a signal, the clock) is agreed
  // over the world after each validation batch and ends the evaluation early: nullopt, the agreed
  // cause in *stopped.
  std::optional<double> evaluate(const StopRequests* stops = nullptr, StopCause* stopped = nullptr);
  // The continuation of sample.prompt by the current weights (every rank calls it; each TP group
  // samples together). Requires samples_enabled().
  std::string sample();

  const ParamLayout& layout() const { return layout_; }

 private:
  CheckpointBuffers checkpoint_buffers();
  // Step s's (0-based) forwards and backwards over its micro-batches: the gradients accumulated
  // (and, but for compression, reduced), the loss summed over the step's tokens and ranks left in
  // step_scalars_[0] (on the device: it is read back with the gradient norm, Updater::step).
  void train_step(int64_t s);
  // The tokens of one step, over every rank.
  int64_t step_tokens() const { return rows_ * accum_ * cfg_.parallel.dp_cp(); }
  // Step s's metrics, after its update `u` took `step_s` seconds; with the evaluation when one is due.
  // An evaluation ended by a stop request sets *eval_stop.
  StepMetrics step_metrics(int64_t s, double loss, const StepUpdate& u, double step_s, double eta_s,
                           const StopRequests& stops, StopCause* eval_stop);
  // The step's log lines (and, after the run's first step, which kernels it ran).
  void log_step(int64_t s, const StepMetrics& m);
  // MoE: the step's blocks over the row bound summed over the world into m.moe (collective), and
  // a warning the first time there are any.
  void count_moe_over_bound(StepMetrics& m);
  // MoE auxiliary-loss-free balancing: the step's tokens per expert reduced over DP and CP
  // (collective), then every block's expert bias moved (MoeLayers::update_expert_bias).
  void update_moe_expert_bias(const StepMetrics& m);
  // Saves a checkpoint after step s when one is due: every checkpoint.every steps, and at the end
  // of the run or before a stop (checkpoint.save_on_exit).
  void save_checkpoint_if_due(int64_t s, bool last, bool stop);
  // Next micro-batch of `loader` into micro-batch slot `j` of tokens_ / targets_ (and host_batch_).
  void load_micro_batch(DataLoader& loader, int64_t j);
  // Writes `buffer` (this rank's fp32 parameter-sized buffer, whole on every DP rank) as global
  // tensors: the TP slices are gathered to the writing rank (TP rank 0 of DP rank 0). The values
  // are multiplied by `scale` (fp16 gradients: 1 / the loss scale).
  void dump_tensors(const std::string& file, const float* buffer, double scale = 1.0);
  // The model's global tensors into `file` (safetensors, written by global rank 0): `local(i)` the
  // rank's values of layout parameter i (numel fp32, host memory, valid until the next call).
  // `collective`: every rank calls, and `local` for every parameter in order (it may gather).
  void write_global_tensors(const std::string& file, const std::function<const float*(size_t)>& local,
                            bool collective);
  // The sharded start-up: the optimizer's master shard generated range by range (a bounded host
  // piece at a time), the compute weights from it (gathered over DP unless ZeRO-3), and the debug
  // dump's initial weights (gathered whole: a debugging aid only).
  void initial_shard_weights(const Config& cfg);
  // The final weights (fp32) as global tensors to final_weights_path() (every rank calls it).
  void save_final_weights();
  // Every rank's planned bytes beside the peak its backend measured (collective over the world):
  // rank 0 logs them and writes the "memory" event of metrics.jsonl.
  void report_memory(int64_t step);  // the last step done: where its TensorBoard scalars go
  // Sum over the pipeline (the last stage holds it) and data-parallel groups of `local`.
  double reduce_loss(float local);
  // The same sum of the float at `dev` (backend memory), in place on the device.
  void reduce_loss_on_device(float* dev);
  // After step s: every rank's busy seconds compared (collective over the world); rank 0 logs and
  // records the ranks that became, or stopped being, stragglers.
  void report_stragglers(int64_t s, double busy_s);
  // The last step's pipeline figures of every pipeline rank (collective over the pipeline group).
  PipelineMetrics pipeline_metrics();

  const Config& cfg_;
  ProcessGroups& groups_;
  bool writer_;  // global rank 0: log file, metrics, dumps
  int checkpoint_lock_ = -1;  // rank 0's lock on checkpoint.dir (commit.h), held for the run
  ParamLayout layout_;
  std::unique_ptr<Backend> be_;
  DType act_;
  int64_t accum_;
  int64_t rows_;  // B * T of a micro-batch (B * T / cp: this CP rank's tokens)
  std::vector<int32_t> cp_positions_;  // context parallelism: the sequence positions this rank keeps

  // The run's backend memory, owned here (declared after be_, so freed before it); the typed
  // pointers below are views of these.
  BackendBuffer moe_counts_buf_;  // the step's tokens per expert of the rank's MoE blocks (expert bias)
  BackendBuffer master_buf_, compute_buf_, grads_buf_, tokens_buf_, targets_buf_, losses_buf_, scalar_buf_,
      pipe_scratch_buf_;
  float* master_ = nullptr;   // fp32 master weights (whole; null when the optimizer shards them)
  void* compute_ = nullptr;   // weights the model reads (== master_ in fp32)
  float* grads_ = nullptr;    // fp32 gradients
  int32_t* tokens_ = nullptr; // (accum, B*T) inputs of the step's micro-batches, backend memory
  int32_t* targets_ = nullptr;
  float* losses_ = nullptr;   // (accum, B*T) per-token losses of one step (last pipeline stage)
  PipelineStepStats pipe_stats_;  // of the last training step
  float* scalar_ = nullptr;   // one float of backend scratch
  bool warned_moe_over_bound_ = false;
  float* step_scalars_ = nullptr;  // (3) in scalar_buf_ after it: the step's loss and norm sums
  float* pipe_scratch_ = nullptr;  // (2 pp + 2) floats: pipeline figures gathered over the group
  std::vector<int32_t> host_batch_;           // (B, T+1)
  std::vector<int32_t> host_inputs_, host_targets_;

  std::unique_ptr<PipelineModel> model_;
  bool zero3_ = false;                   // parallel.zero_stage 3 over dp > 1
  std::unique_ptr<WeightUnits> units_;   // ZeRO-3: the gathered weight units
  BackendBuffer sample_weights_buf_;     // ZeRO-3 with text samples: the whole weights they read  // this rank's model chunks and pipeline schedule
  std::unique_ptr<GradBuffers> grad_buffer_;
  std::unique_ptr<Updater> updater_;
  PipelineModel::GroupReport group_done_;
  CommAccounting comm_;
  std::unique_ptr<DebugDump> dump_;  // --dump-dir (null without)
  std::shared_ptr<SampleSource> train_source_, valid_source_;
  std::unique_ptr<DataLoader> train_loader_;
  std::unique_ptr<MetricsWriter> metrics_;
  std::unique_ptr<StepProfiler> profiler_;         // training.profile_steps (step_trace.h)
  std::unique_ptr<StragglerDetector> straggler_;   // logging.straggler_* (straggler.h)
  // Text samples (null when off): a micro-batch-1 model reading the same weights.
  std::unique_ptr<Tokenizer> tokenizer_;
  ParamLayout sample_layout_;
  std::unique_ptr<Gpt> sample_model_;
  std::unique_ptr<Sampler> sampler_;
  double peak_flops_ = 0.0;
  std::optional<double> planned_step_s_;  // global rank 0's prediction (StepPlanner)
  size_t planned_bytes_ = 0;  // this rank's memory plan (plan_memory().total())
  double train_flops_per_token_ = 0.0;
  int64_t start_step_ = 0;  // steps already done (resumed from a checkpoint)
};

}  // namespace tetra
