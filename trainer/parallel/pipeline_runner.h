// Executes a pipeline schedule table (pipeline_schedule.h) on one pipeline rank: for each action,
// receive the input activation (or the output gradient) from the neighbouring stage, run the
// chunk's forward (or backward), and send the result on asynchronously. Sends never block the
// rank; a receive blocks only until its data has arrived.
//
// The model supplies the work through PipelineChunk; the runner owns nothing but the bookkeeping:
// which activation slot holds which micro-batch (the rank's chunks share one set of slots, as many
// as the schedule keeps micro-batches in flight on the rank over all its chunks, and a forward
// takes the lowest free one: with interleaving, chunks do not peak at the same time, so this is
// fewer than each chunk's own most, summed), which send is still reading a buffer (an activation
// leaves from its slot, an input gradient from gradient buffer m % schedule.grad_buffers: a buffer
// is written again only once its previous send has completed, which check_schedule proves cannot
// deadlock), and how long the rank computed versus waited.
//
// Messages: activations travel on tag 0 from rank r to (r + 1) mod pp, gradients on tag 1 from r
// to (r - 1) mod pp; check_schedule() proves each receive matches the send it is meant for.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/common/dtype.h"
#include "trainer/parallel/pipeline_schedule.h"

namespace tetra {

class Communicator;
class Work;

// One model chunk of this rank, as the runner drives it.
class PipelineChunk {
 public:
  virtual ~PipelineChunk() = default;
  // Forward of `micro_batch` into activation slot `slot` of the rank's slots (the input, on a
  // non-first stage, is already in input(slot)); backward of the micro-batch held in `slot` (the output gradient, on a
  // non-last stage, is already in output_grad()), leaving the input gradient (non-first stage) in
  // input_grad(grad_buffer). `last` marks the chunk's last backward of the step (its gradients
  // are final after it).
  virtual void forward(int64_t slot, int micro_batch) = 0;
  virtual void backward(int64_t slot, int micro_batch, bool last, int64_t grad_buffer) = 0;
  virtual void* input(int64_t slot) = 0;
  virtual const void* output(int64_t slot) = 0;
  virtual void* output_grad() = 0;
  virtual const void* input_grad(int64_t grad_buffer) = 0;
};

struct PipelineStepStats {
  double compute_s = 0.0;      // in forward / backward
  double total_s = 0.0;        // the whole schedule
  int peak_in_flight = 0;      // most micro-batches held between forward and backward, all chunks
  double bubble() const { return total_s > 0.0 ? 1.0 - compute_s / total_s : 0.0; }
};

class PipelineRunner {
 public:
  // `pp`: the pipeline group (its rank is this rank's pipeline rank); boundary activations are
  // `boundary_numel` elements of `type`; the chunks have `slots` activation slots, at least
  // slots_needed().
  PipelineRunner(const PipelineSchedule& schedule, Communicator& pp, int64_t boundary_numel, DType type,
                 int64_t slots);
  // Slots pipeline rank `rank` needs: its most micro-batches in flight, and one per chunk for the
  // forward-only run (chunk c's forward in slot c).
  static int64_t slots_needed(const PipelineSchedule& schedule, int rank);

  // Runs this rank's actions (training: forwards and backwards; forward_only: the forwards alone,
  // one slot per chunk, as in evaluation). `chunks` in chunk order.
  PipelineStepStats run(const std::vector<PipelineChunk*>& chunks, bool forward_only = false);

 private:
  const PipelineSchedule& schedule_;
  Communicator& pp_;
  int64_t numel_;
  DType type_;
  int64_t slots_;
};

}  // namespace tetra
