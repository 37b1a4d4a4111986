#include "trainer/parallel/pipeline_runner.h"

#include <chrono>

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"

namespace tetra {

namespace {

constexpr int kActivationTag = 0;
constexpr int kGradientTag = 1;

double seconds_between(std::chrono::steady_clock::time_point a, std::chrono::steady_clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

}  // namespace

PipelineRunner::PipelineRunner(const PipelineSchedule& schedule, Communicator& pp, int64_t boundary_numel,
                               DType type)
    : schedule_(schedule), pp_(pp), numel_(boundary_numel), type_(type) {
  TETRA_CHECK(pp.size() == schedule.pp, "pipeline group of {} ranks for a schedule of {}", pp.size(), schedule.pp);
}

PipelineStepStats PipelineRunner::run(const std::vector<PipelineChunk*>& chunks, bool forward_only) {
  using clock = std::chrono::steady_clock;
  const int r = pp_.rank(), pp = schedule_.pp, S = schedule_.stages();
  const int next = (r + 1) % pp, prev = (r - 1 + pp) % pp;
  TETRA_CHECK(static_cast<int>(chunks.size()) == schedule_.vp, "{} model chunks for a schedule of {} per rank",
              chunks.size(), schedule_.vp);
  const std::vector<PipeAction>& actions = schedule_.ranks[static_cast<size_t>(r)];

  struct ChunkState {
    std::vector<int> holds;            // per slot: the micro-batch in it, -1 when free
    std::vector<WorkHandle> act_send;  // per slot: the send of its output activation
    std::vector<WorkHandle> grad_send; // per gradient buffer: the send of an input gradient
    int last_backward = -1;            // micro-batch of the chunk's last backward this step
  };
  std::vector<ChunkState> state(chunks.size());
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int64_t n = forward_only ? 1 : chunks[c]->slots();
    state[c].holds.assign(static_cast<size_t>(n), -1);
    state[c].act_send.resize(static_cast<size_t>(n));
    state[c].grad_send.resize(static_cast<size_t>(schedule_.grad_buffers));
  }
  for (const PipeAction& a : actions)
    if (!a.forward) state[static_cast<size_t>(a.chunk)].last_backward = a.micro_batch;

  PipelineStepStats st;
  int live = 0;
  const auto t_start = clock::now();
  auto wait = [&](WorkHandle& w, CommOp op) {  // the time blocked is counted in pp_.stats()
    if (!w) return;
    pp_.wait(*w, op);
    w.reset();
  };
  auto compute = [&](auto&& body) {
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
    const size_t slot = static_cast<size_t>(a.micro_batch) % cs.holds.size();
    if (a.forward) {
      if (!forward_only) {
        TETRA_CHECK(cs.holds[slot] < 0, "pipeline rank {} chunk {}: forward of micro-batch {} needs slot {} of {}, "
                    "still held by micro-batch {}: more in flight than the schedule's bound", r, a.chunk,
                    a.micro_batch, slot, cs.holds.size(), cs.holds[slot]);
        cs.holds[slot] = a.micro_batch;
      }
      wait(cs.act_send[slot], CommOp::SEND);  // the slot's previous output was received
      if (stage > 0) {
        WorkHandle in = pp_.recv_async(chunk.input(static_cast<int64_t>(slot)), numel_, type_, prev, kActivationTag);
        wait(in, CommOp::RECV);
      }
      compute([&] { chunk.forward(static_cast<int64_t>(slot), a.micro_batch); });
      if (stage < S - 1)
        cs.act_send[slot] = pp_.send_async(chunk.output(static_cast<int64_t>(slot)), numel_, type_, next, kActivationTag);
      if (!forward_only) st.peak_in_flight = std::max(st.peak_in_flight, ++live);
    } else {
      TETRA_CHECK(cs.holds[slot] == a.micro_batch, "pipeline rank {} chunk {}: backward of micro-batch {} but slot {} "
                  "holds micro-batch {}", r, a.chunk, a.micro_batch, slot, cs.holds[slot]);
      if (stage < S - 1) {
        WorkHandle in = pp_.recv_async(chunk.output_grad(), numel_, type_, next, kGradientTag);
        wait(in, CommOp::RECV);
      }
      const size_t gbuf = static_cast<size_t>(a.micro_batch % schedule_.grad_buffers);
      wait(cs.grad_send[gbuf], CommOp::SEND);  // the buffer's previous gradient was received
      compute([&] {
        chunk.backward(static_cast<int64_t>(slot), a.micro_batch, a.micro_batch == cs.last_backward,
                       static_cast<int64_t>(gbuf));
      });
      if (stage > 0)
        cs.grad_send[gbuf] = pp_.send_async(chunk.input_grad(static_cast<int64_t>(gbuf)), numel_, type_, prev,
                                            kGradientTag);
      cs.holds[slot] = -1;
      --live;
    }
  }
  for (ChunkState& cs : state) {
    for (WorkHandle& w : cs.act_send) wait(w, CommOp::SEND);
    for (WorkHandle& w : cs.grad_send) wait(w, CommOp::SEND);
  }
  st.total_s = seconds_between(t_start, clock::now());
  return st;
}

}  // namespace tetra
