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
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/config/config.h"
#include "trainer/model/gpt.h"
#include "trainer/params/param_layout.h"
#include "trainer/optim/adamw.h"
#include "trainer/optim/grad_buffer.h"
#include "trainer/parallel/pipeline_runner.h"
#include "trainer/optim/grad_buffers.h"
#include "trainer/optim/compressed_reduction.h"
#include "trainer/optim/loss_scaler.h"
#include "trainer/optim/onebit_adam.h"
#include "trainer/train/metrics.h"

namespace tetra {

class SampleSource;
class Sampler;
class Tokenizer;
struct ProcessGroups;
class DataLoader;
class MetricsWriter;
class PipelineModel;

struct MemoryPlan {
  size_t master = 0, compute = 0, grads = 0, optimizer = 0, activations = 0, batch = 0;
  size_t sampling = 0;  // the micro-batch-1 model of the text samples (when they are on)
  // onebit / int8 gradient compression: error feedback, messages and (on a GPU) the staging copies
  // of the gradient and moments. Always host memory: the compression runs on the host.
  size_t compression = 0;
  bool on_device = false;  // training.device is a GPU: everything but `compression` is GPU memory
  size_t total() const {
    return master + compute + grads + optimizer + activations + batch + sampling + compression;
  }
  size_t device_bytes() const { return on_device ? total() - compression : 0; }
  size_t host_bytes() const { return on_device ? compression : total(); }
};

// Text samples at evaluations: sample.prompt and data.tokenizer set, and training.eval_steps > 0.
bool samples_enabled(const Config& cfg);

// The layout of this rank's parameter buffer: its TP slice of its pipeline stage (and its EP
// rank's experts), groups aligned for the distributed optimizer's shards.
ParamLayout rank_layout(const Config& cfg, int64_t tp_rank, int64_t pp_rank = 0, int64_t ep_rank = 0);

// What one rank will take, computed from the config alone (for --dry-run and the start-up log).
// `layout`: rank_layout(cfg, ..., pp_rank).
MemoryPlan plan_memory(const Config& cfg, const ParamLayout& layout, int64_t pp_rank = 0);

class Trainer {
 public:
  // `dump_dir` non-empty: write initial weights, step-0 gradients and the batches (debugging and
  // the PyTorch reference tests).
  Trainer(const Config& cfg, const std::string& config_path, ProcessGroups& groups,
          std::string dump_dir = "");
  ~Trainer();

  void run();
  // Mean loss over `eval_steps` global batches of the validation set, from its start (each DP
  // rank evaluates its slice of each).
  double evaluate();
  // The continuation of sample.prompt by the current weights (every rank calls it; each TP group
  // samples together). Requires samples_enabled().
  std::string sample();

  const ParamLayout& layout() const { return layout_; }

 private:
  CheckpointBuffers checkpoint_buffers();
  void install_stop_signals();
  bool stop_requested();  // collective: true on every rank when any rank got SIGTERM / SIGUSR1
  double train_step(int64_t s);
  // Next micro-batch of `loader` into micro-batch slot `j` of tokens_ / targets_ (and host_batch_).
  void load_micro_batch(DataLoader& loader, int64_t j);
  // Writes `buffer` (this rank's fp32 parameter-sized buffer, whole on every DP rank) as global
  // tensors: the TP slices are gathered to the writing rank (TP rank 0 of DP rank 0). The values
  // are multiplied by `scale` (fp16 gradients: 1 / the loss scale).
  void dump_tensors(const std::string& file, const float* buffer, double scale = 1.0);
  // The final weights (fp32) as global tensors to final_weights_path() (every rank calls it).
  void save_final_weights();
  // Snapshots of every group's communication counters (tp, dp, pp, embedding, edp, ep).
  std::vector<CommStats> comm_snapshot() const;
  std::vector<CommRecord> comm_records(const std::vector<CommStats>& before) const;
  // Sum over the pipeline (the last stage holds it) and data-parallel groups of `local`.
  double reduce_loss(float local);
  // The last step's pipeline figures of every pipeline rank (collective over the pipeline group).
  PipelineMetrics pipeline_metrics();

  const Config& cfg_;
  ProcessGroups& groups_;
  bool writer_;  // global rank 0: log file, metrics, dumps
  std::string dump_dir_;
  int checkpoint_lock_ = -1;  // rank 0's lock on checkpoint.dir (commit.h), held for the run
  ParamLayout layout_;
  std::unique_ptr<Backend> be_;
  DType act_;
  int64_t accum_;
  int64_t rows_;  // B * T of a micro-batch

  float* master_ = nullptr;   // fp32 master weights (whole; null when the optimizer shards them)
  void* compute_ = nullptr;   // weights the model reads (== master_ in fp32)
  float* grads_ = nullptr;    // fp32 gradients
  int32_t* tokens_ = nullptr; // (accum, B*T) inputs of the step's micro-batches, backend memory
  int32_t* targets_ = nullptr;
  float* losses_ = nullptr;   // (accum, B*T) per-token losses of one step (last pipeline stage)
  PipelineStepStats pipe_stats_;  // of the last training step
  float* scalar_ = nullptr;   // one float of backend scratch
  float* pipe_scratch_ = nullptr;  // (2 pp + 2) floats: pipeline figures gathered over the group
  std::vector<int32_t> host_batch_;           // (B, T+1)
  std::vector<int32_t> host_inputs_, host_targets_;
  std::vector<int32_t> dumped_batches_;       // samples of the steps dumped so far

  std::unique_ptr<PipelineModel> model_;  // this rank's model chunks and pipeline schedule
  std::unique_ptr<GradBuffers> grad_buffer_;
  std::unique_ptr<AdamW> optimizer_;
  std::unique_ptr<OnebitAdam> onebit_;  // parallel.grad_compression onebit
  std::unique_ptr<CompressedReduction> int8_;  // parallel.grad_compression int8
  std::unique_ptr<LossScaler> scaler_;  // training.precision fp16
  GroupDoneHook group_done_;
  StepVolume predicted_;
  std::shared_ptr<SampleSource> train_source_, valid_source_;
  std::unique_ptr<DataLoader> train_loader_;
  std::unique_ptr<MetricsWriter> metrics_;
  // Text samples (null when off): a micro-batch-1 model reading the same weights.
  std::unique_ptr<Tokenizer> tokenizer_;
  ParamLayout sample_layout_;
  std::unique_ptr<Gpt> sample_model_;
  std::unique_ptr<Sampler> sampler_;
  double peak_flops_ = 0.0;
  int64_t start_step_ = 0;  // steps already done (resumed from a checkpoint)
};

}  // namespace tetra
