// The model as a pipeline rank runs it: its model chunks (one Gpt per chunk), the schedule table
// and its runner, and the glue that turns the runner's callbacks into forward / backward of
// micro-batch m.
//
// Activation memory: the chunks share one scratch (only one chunk computes at a time; the largest
// chunk's) and one set of activation slots, as many as the schedule keeps micro-batches in flight
// on the rank (over all chunks; each slot as large as the largest chunk's). Interleaved chunks do
// not peak together: Llama-3 70B on pp 8 vp 5 keeps at most 47 micro-batches in flight on pipeline
// rank 0, where its chunks' own most sum to 63.
//
// With one pipeline rank this is the plain loop (forward and backward of each micro-batch in
// turn), so every layout runs through the same code.
//
// Tied embeddings across stages: the first stage's embedding.wte and the last stage's copy get
// gradients from their own uses, and both must end up with the same sum. As in Megatron, each
// stage's gradient is first reduced over DP, then the two are summed over the embedding group
// (first + last stage; a sum of two is the same on both, bit for bit, so the copies never drift
// apart): finish_tied_embedding() after the DP reduction. With the distributed optimizer a DP
// rank holds only its shard of the reduced gradient, and the stages shard differently, so there
// the sum over the embedding group comes first, before the DP reduction of those two groups
// (their "done" reports are held back until then); the copies then agree to the rounding of the
// DP reduction (exactly for dp <= 2).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "trainer/config/config.h"
#include "trainer/model/gpt.h"
#include "trainer/params/param_layout.h"
#include "trainer/parallel/pipeline_runner.h"
#include "trainer/parallel/pipeline_schedule.h"

namespace tetra {

struct ProcessGroups;

// The layout of this rank's stage: its chunks' layers (Config::pipeline_stage_layers), the
// embedding on pipeline rank 0, the head on the last.
StageSlice stage_slice(const Config& cfg, int64_t pp_rank);

// The schedule a config asks for, with `micro_batches` per step.
const PipelineSchedule& make_schedule(const Config& cfg, int64_t micro_batches);

// What a pipeline rank's activation memory is made of (PipelineModel::activation_split).
struct ActivationSplit {
  size_t kept = 0;     // the slots: what micro-batches keep from forward to backward
  int64_t slots = 0;   // how many: the rank's most micro-batches in flight (at least one per chunk)
  size_t scratch = 0;  // the chunks' shared scratch: gradients, gathers, recomputation
};

class PipelineModel {
 public:
  // tokens / targets: (micro_batches, B*T) int32, losses (micro_batches, B*T) fp32, in backend
  // memory, owned by the caller (the trainer loads the step's micro-batches into them).
  PipelineModel(const Config& cfg, const ParamLayout& layout, Backend& be, DType act, ProcessGroups& groups,
                int64_t micro_batches, const int32_t* tokens, const int32_t* targets, float* losses);
  ~PipelineModel();

  // One training step's forwards and backwards; gradients accumulate into `grads`, and `done` is
  // told about each parameter group once its gradient is final (and summed over the embedding
  // group for tied embeddings). Losses land in losses() on the last stage.
  // `done(group, micro_batches)`: a report standing for that many micro-batches (more than 1 only for
  // a ZeRO-2 group deferred to the end of the step).
  using GroupReport = std::function<void(int group, int micro_batches)>;
  PipelineStepStats train(const void* weights, float* grads, float dloss_scale, const GroupReport& done);
  // After the DP reduction of the step's gradients (tied embeddings, no distributed optimizer):
  // the sum of the two copies' gradients over the embedding group.
  void finish_tied_embedding(float* grads);
  // ZeRO-2: every chunk writes its gradients where `sink` says (grad_sink.h), and `done` hears of
  // each group in every micro-batch (each micro-batch's gradient is reduced on its own).
  void set_grad_sink(GradSink* sink);
  // ZeRO-3: every chunk reads its weights from `source` (grad_sink.h); the weights arguments are unused.
  void set_weight_source(WeightSource* source);
  // Forwards only (evaluation): losses of every micro-batch on the last stage.
  PipelineStepStats forward(const void* weights);

  bool has_loss() const { return last_; }  // this rank holds the loss
  // MoE models: the statistics of this rank's MoE blocks since the last call (and reset).
  bool has_moe() const;
  MoeStepStats take_moe_stats();
  // Every chunk's MoE expert biases, their setting and update (Gpt's, over the chunks).
  std::map<int64_t, std::vector<float>> moe_expert_bias() const;
  void set_moe_expert_bias(const std::map<int64_t, std::vector<float>>& bias);
  void update_moe_expert_bias(const std::map<int64_t, std::vector<int64_t>>& tokens_per_expert);
  const PipelineSchedule& schedule() const { return schedule_; }
  size_t activation_bytes() const;
  // Activation memory of pipeline rank `pp_rank`'s chunks under `cfg`'s schedule.
  static size_t activation_bytes_for(const Config& cfg, int64_t pp_rank);
  // The same split into the slots the micro-batches in flight keep and the scratch beside:
  // activation_bytes_for = kept + scratch.
  static ActivationSplit activation_split(const Config& cfg, int64_t pp_rank);
  // Bytes of the buffers pipeline rank `pp_rank`'s chunks send their input gradients from.
  static size_t input_grad_bytes_for(const Config& cfg, int64_t pp_rank);

 private:
  class Chunk;
  PipelineStepStats run(bool forward_only);
  struct SharedActivations {
    size_t scratch = 0, stride = 0;  // bytes: the scratch, one slot
    int64_t slots = 0;
  };
  static SharedActivations shared_activations(const Config& cfg, const ParamLayout& layout,
                                              const PipelineSchedule& s, int pp_rank);

  const Config& cfg_;
  const ParamLayout& layout_;
  Backend& be_;
  ProcessGroups& groups_;
  PipelineSchedule schedule_;
  std::unique_ptr<PipelineRunner> runner_;
  BackendBuffer scratch_mem_, slot_mem_;  // the chunks' activations (declared before them: freed after)
  std::vector<std::unique_ptr<Chunk>> chunks_;
  bool last_;
  bool tied_across_stages_;  // tied embeddings with pp > 1
  bool sum_before_reduction_;  // ... with the distributed optimizer sharding over dp > 1
  int64_t wte_numel_ = 0;
  // This step's arguments, read by the chunks' callbacks.
  const void* weights_ = nullptr;
  float* grads_ = nullptr;
  GradSink* sink_ = nullptr;  // ZeRO-2
  float dloss_scale_ = 0.0f;
  GroupDoneHook hook_;
  std::vector<int> deferred_;  // groups whose report waits for the end of the step, with repeats
};

}  // namespace tetra
