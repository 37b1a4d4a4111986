// What a step reports: one human-readable log line and one JSON object in metrics.jsonl.
//
// metrics.jsonl is appended to, never truncated: a run in a directory that already holds one adds
// an {"event": "start", ...} line and then its own step lines, so nothing earlier is lost.
// Consumers select lines with a "step" key.
//
// A write that fails (a full disk) is a warning naming the file and the reason, once; the run goes
// on and writes no more lines to that file (files.h's AppendFile). A file whose last line was cut
// by such a failure gets a newline before the next run's first line.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "trainer/core/files.h"
#include "trainer/model/moe.h"
#include "trainer/parallel/comm_volume.h"
#include "trainer/train/tensorboard.h"

namespace tetra {

// One group's communication in a step: measured by its communicator, and predicted.
struct CommRecord {
  std::string group;        // "tp", "dp", "edp", "ep"
  GroupVolume measured, predicted;
  double sent_bytes = 0.0;  // what this rank put on the wire (communicator.h's model)
  double blocked_ms = 0.0;  // time the step waited for this group (communication not hidden)
};

// Pipeline parallelism, per step: each pipeline rank's idle fraction of the schedule's time
// (1 - compute / total) beside the analytic bubble, and the most micro-batches it held between
// forward and backward.
struct PipelineMetrics {
  std::string schedule;
  double bubble = 0.0;        // mean over the pipeline ranks
  double ideal_bubble = 0.0;  // (pp - 1) / (m v + pp - 1)
  std::vector<double> bubble_per_rank;
  std::vector<int> peak_in_flight;  // per pipeline rank
};

struct StepMetrics {
  int64_t step = 0;            // 1-based, the step just completed
  int64_t total_steps = 0;
  double loss = 0.0;           // mean training loss of the step's global batch (before the update)
  double lr = 0.0;             // learning rate used by the update
  double grad_norm = 0.0;      // global norm before clipping
  double clip = 1.0;           // factor the gradients were multiplied by
  double ms = 0.0;             // wall time of the step
  std::optional<double> planned_ms;  // the planner's prediction of it (trainer.h's StepPlanner)
  double tokens_per_s = 0.0;
  double mfu = 0.0;            // achieved FLOP/s / peak FLOP/s
  double eta_s = 0.0;
  int64_t consumed_samples = 0;
  std::optional<double> val_loss;
  std::vector<CommRecord> comm;  // groups of size > 1 (global rank 0's view)
  std::optional<PipelineMetrics> pipeline;  // pp > 1
  std::optional<std::string> sample;  // text sampled at an evaluation
  std::optional<std::string> skipped;  // why the update was skipped (step_guard.h); unset: applied
  std::optional<double> loss_scale;   // fp16: the loss scale this step's gradients carried
  bool overflow = false;              // fp16: they overflowed and the update was skipped
  std::optional<MoeStepStats> moe;    // MoE models: routing per MoE block (global rank 0's tokens)
};

class MetricsWriter {
 public:
  // `dir` empty: console only. Opens (creates) dir/metrics.jsonl for appending, and with
  // `tensorboard` a TensorBoard event file in dir/tensorboard (tensorboard.h); InputError if it
  // cannot.
  explicit MetricsWriter(const std::string& dir, bool tensorboard = false);
  // Scalars outside a step's line (the memory at the end), to TensorBoard only.
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  // What a step's line puts in TensorBoard: every number of metrics.jsonl's step object but the
  // sample and the predicted traffic (tag, value).
  static std::vector<std::pair<std::string, double>> tensorboard_scalars(const StepMetrics& m);
  // A line that is not a step's: the run's {"event": "start", ...}, the end's {"event": "memory", ...}.
  void event(const std::string& event_json);
  void write(const StepMetrics& m);
  static std::string format_line(const StepMetrics& m);
  // Whether a write of metrics.jsonl or of the TensorBoard file has failed (and was warned of).
  bool write_failed() const { return jsonl_.failed() || (tensorboard_ && tensorboard_->failed()); }

 private:
  AppendFile jsonl_;
  std::unique_ptr<TensorBoardWriter> tensorboard_;
};

std::string format_duration(double seconds);

// Tokens per expert over the experts of one MoE block: min / mean / max.
struct MoeTokenSpread {
  int64_t min = 0, max = 0;
  double mean = 0.0;
};
MoeTokenSpread token_spread(const MoeLayerStats& l);

}  // namespace tetra
