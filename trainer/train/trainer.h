// The training loop: micro-batches × gradient accumulation, AdamW step, LR schedule, clipping,
// periodic evaluation, metrics.
//
// Everything is allocated in the constructor (parameters, gradients, optimizer state, the model's
// activation arena, batch buffers); run() allocates nothing per step.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "trainer/config/config.h"
#include "trainer/model/gpt.h"
#include "trainer/model/param_layout.h"
#include "trainer/optim/adamw.h"

namespace tetra {

class SampleSource;
class DataLoader;
class MetricsWriter;

struct MemoryPlan {
  size_t master = 0, compute = 0, grads = 0, optimizer = 0, activations = 0, batch = 0;
  size_t total() const { return master + compute + grads + optimizer + activations + batch; }
};

// What the run will take, computed from the config alone (for --dry-run and the start-up log).
MemoryPlan plan_memory(const Config& cfg, const ParamLayout& layout);

class Trainer {
 public:
  // `dump_dir` non-empty: write initial weights, step-0 gradients and the batches (debugging and
  // the PyTorch reference tests).
  Trainer(const Config& cfg, const std::string& config_path, std::string dump_dir = "");
  ~Trainer();

  void run();
  // Mean loss over `eval_steps` micro-batches of the validation set, from its start.
  double evaluate();

  const ParamLayout& layout() const { return layout_; }

 private:
  double train_step(int64_t s);
  // Next micro-batch of `loader` into tokens_ / targets_ (and host_batch_).
  void load_micro_batch(DataLoader& loader);
  void dump_tensors(const std::string& file, const float* buffer) const;

  const Config& cfg_;
  std::string dump_dir_;
  ParamLayout layout_;
  std::unique_ptr<Backend> be_;
  DType act_;
  int64_t accum_;
  int64_t rows_;  // B * T of a micro-batch

  float* master_ = nullptr;   // fp32 master weights
  void* compute_ = nullptr;   // weights the model reads (== master_ in fp32)
  float* grads_ = nullptr;    // fp32 gradients
  int32_t* tokens_ = nullptr; // (B, T) inputs, backend memory
  int32_t* targets_ = nullptr;
  float* losses_ = nullptr;   // (accum, B*T) per-token losses of one step
  float* scalar_ = nullptr;   // one float of backend scratch
  std::vector<int32_t> host_batch_;           // (B, T+1)
  std::vector<int32_t> host_inputs_, host_targets_;
  std::vector<int32_t> dumped_batches_;       // samples of the steps dumped so far

  std::unique_ptr<Gpt> model_;
  std::unique_ptr<AdamW> optimizer_;
  std::shared_ptr<SampleSource> train_source_, valid_source_;
  std::unique_ptr<DataLoader> train_loader_;
  std::unique_ptr<MetricsWriter> metrics_;
  double peak_flops_ = 0.0;
};

}  // namespace tetra
