#include "trainer/parallel/pipeline_runner.h"

#include <algorithm>
#include <chrono>
#include <utility>

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"
#include "trainer/core/trace.h"

namespace tetra {

namespace {

constexpr int kActivationTag = 0;
constexpr int kGradientTag = 1;

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

PipelineRunner::PipelineRunner(const PipelineSchedule& schedule, Communicator& pp, int64_t boundary_numel,
                               DType type, int64_t slots)
    : schedule_(schedule), pp_(pp), numel_(boundary_numel), type_(type), slots_(slots) {
  TETRA_CHECK(pp.size() == schedule.pp, "pipeline group of {} ranks for a schedule of {}", pp.size(), schedule.pp);
  TETRA_CHECK(slots >= slots_needed(schedule, pp.rank()),
              "pipeline rank {}: {} activation slot(s) for a schedule that keeps up to {} micro-batch(es) in flight "
              "on {} chunk(s)", pp.rank(), slots, schedule.max_in_flight(pp.rank()), schedule.vp);
}

int64_t PipelineRunner::slots_needed(const PipelineSchedule& schedule, int rank) {
  return std::max(schedule.max_in_flight(rank), schedule.vp);
}

PipelineStepStats PipelineRunner::run(const std::vector<PipelineChunk*>& chunks, bool forward_only) {
  using clock = std::chrono::steady_clock;
  const int r = pp_.rank(), pp = schedule_.pp, S = schedule_.stages();
  const int next = (r + 1) % pp, prev = (r - 1 + pp) % pp;
  TETRA_CHECK(static_cast<int>(chunks.size()) == schedule_.vp, "{} model chunks for a schedule of {} per rank",
              chunks.size(), schedule_.vp);
  const std::vector<PipeAction>& actions = schedule_.ranks[static_cast<size_t>(r)];

  struct ChunkState {
    std::vector<WorkHandle> grad_send; // per gradient buffer: the send of an input gradient
    std::vector<int> slot_of;          // per micro-batch: the slot holding it, -1 when none
    int last_backward = -1;            // micro-batch of the chunk's last backward this step
  };
  std::vector<ChunkState> state(chunks.size());
  for (ChunkState& cs : state) {
    cs.grad_send.resize(static_cast<size_t>(schedule_.grad_buffers));
    cs.slot_of.assign(static_cast<size_t>(schedule_.m), -1);
  }
  for (const PipeAction& a : actions)
    if (!a.forward) state[static_cast<size_t>(a.chunk)].last_backward = a.micro_batch;
  // The rank's slots, shared by its chunks: which (chunk, micro-batch) each holds, and the send of
  // the activation that last left it.
  std::vector<std::pair<int, int>> holds(static_cast<size_t>(slots_), {-1, -1});
  std::vector<WorkHandle> act_send(static_cast<size_t>(slots_));

  PipelineStepStats st;
  int live = 0;
  const auto t_start = clock::now();
  auto wait = [&](WorkHandle& w, CommOp op) {  // the time blocked is counted in pp_.stats()
    if (!w) return;
    pp_.wait(*w, op);
    w.reset();
  };
  // A slot's compute, timed (and a span of the timeline: "forward 3" of micro-batch 3, its chunk
  // and stage in the args).
  auto compute = [&](const PipeAction& a, int stage, auto&& body) {
    trace::Span span("pipeline", "{} {}", a.forward ? "forward" : "backward", a.micro_batch);
    span.arg("micro_batch", static_cast<int64_t>(a.micro_batch)).arg("chunk", static_cast<int64_t>(a.chunk));
    span.arg("stage", static_cast<int64_t>(stage));
    const auto t0 = clock::now();
    body();
    st.compute_s += seconds_between(t0, clock::now());
  };

  for (const PipeAction& a : actions) {
    if (forward_only && !a.forward) continue;
    const size_t c = static_cast<size_t>(a.chunk);
    ChunkState& cs = state[c];
    PipelineChunk& chunk = *chunks[c];
    const int stage = schedule_.stage_of(r, a.chunk);
    if (a.forward) {
      // Forward-only, chunk c uses slot c (nothing is kept); training, the lowest free slot. A slot
      // is free again after its micro-batch's backward, which needed the gradient of the activation
      // that left the slot, so that send has been received and waiting for it never blocks.
      size_t slot = static_cast<size_t>(a.chunk);
      if (!forward_only) {
        slot = 0;
        while (slot < holds.size() && holds[slot].first >= 0) ++slot;
        TETRA_CHECK(slot < holds.size(), "pipeline rank {} chunk {}: forward of micro-batch {} finds all {} "
                    "activation slots held: more in flight than the schedule's bound", r, a.chunk, a.micro_batch,
                    holds.size());
        holds[slot] = {a.chunk, a.micro_batch};
        cs.slot_of[static_cast<size_t>(a.micro_batch)] = static_cast<int>(slot);
      }
      wait(act_send[slot], CommOp::SEND);  // the slot's previous output was received
      if (stage > 0) {
        WorkHandle in = pp_.recv_async(chunk.input(static_cast<int64_t>(slot)), numel_, type_, prev, kActivationTag);
        wait(in, CommOp::RECV);
      }
      compute(a, stage, [&] { chunk.forward(static_cast<int64_t>(slot), a.micro_batch); });
      if (stage < S - 1)
        act_send[slot] = pp_.send_async(chunk.output(static_cast<int64_t>(slot)), numel_, type_, next, kActivationTag);
      if (!forward_only) st.peak_in_flight = std::max(st.peak_in_flight, ++live);
    } else {
      const int held = cs.slot_of[static_cast<size_t>(a.micro_batch)];
      TETRA_CHECK(held >= 0 && holds[static_cast<size_t>(held)] == std::make_pair(a.chunk, a.micro_batch),
                  "pipeline rank {} chunk {}: backward of micro-batch {} whose forward holds no slot", r, a.chunk,
                  a.micro_batch);
      const size_t slot = static_cast<size_t>(held);
      if (stage < S - 1) {
        WorkHandle in = pp_.recv_async(chunk.output_grad(), numel_, type_, next, kGradientTag);
        wait(in, CommOp::RECV);
      }
      const size_t gbuf = static_cast<size_t>(a.micro_batch % schedule_.grad_buffers);
      wait(cs.grad_send[gbuf], CommOp::SEND);  // the buffer's previous gradient was received
      compute(a, stage, [&] {
        chunk.backward(static_cast<int64_t>(slot), a.micro_batch, a.micro_batch == cs.last_backward,
                       static_cast<int64_t>(gbuf));
      });
      if (stage > 0)
        cs.grad_send[gbuf] = pp_.send_async(chunk.input_grad(static_cast<int64_t>(gbuf)), numel_, type_, prev,
                                            kGradientTag);
      holds[slot] = {-1, -1};
      cs.slot_of[static_cast<size_t>(a.micro_batch)] = -1;
      --live;
    }
  }
  for (WorkHandle& w : act_send) wait(w, CommOp::SEND);
  for (ChunkState& cs : state) {
    for (WorkHandle& w : cs.grad_send) wait(w, CommOp::SEND);
  }
  st.total_s = seconds_between(t_start, clock::now());
  return st;
}

}  // namespace tetra
