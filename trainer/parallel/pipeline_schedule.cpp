#include "trainer/parallel/pipeline_schedule.h"

#include <algorithm>
#include <deque>
#include <map>
#include <mutex>
#include <set>
#include <tuple>

#include <fmt/format.h>

#include "kernels/common/check.h"

namespace tetra {

ScheduleKind schedule_kind(const std::string& name) {
  if (const std::optional<ScheduleKind> kind = enum_from_string<ScheduleKind>(name)) return *kind;
  throw Error(fmt::format("unknown pipeline schedule \"{}\": use gpipe, 1f1b or interleaved", name));
}

const char* schedule_name(ScheduleKind kind) { return to_string(kind).data(); }

namespace {

// The k-th forward (or backward) of a rank under the interleaved schedule: chunks are visited in
// groups of pp consecutive micro-batches (backward visits them last chunk first).
PipeAction interleaved_action(int k, int pp, int vp, bool forward) {
  const int in_group = k % (pp * vp);
  int chunk = in_group / pp;
  if (!forward) chunk = vp - 1 - chunk;
  return PipeAction{forward, (k / (pp * vp)) * pp + k % pp, chunk};
}

}  // namespace

const PipelineSchedule& PipelineSchedule::build(ScheduleKind kind, int pp, int vp, int m) {
  // A pure function of its arguments, asked for the same tables many times over (every pipeline
  // rank's memory plan and communication prediction, `tetra plan`'s every candidate): built once.
  static std::mutex mutex;
  static std::map<std::tuple<ScheduleKind, int, int, int>, PipelineSchedule> built;
  const auto key = std::make_tuple(kind, pp, vp, m);
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (auto it = built.find(key); it != built.end()) return it->second;
  }
  PipelineSchedule s = build_uncached(kind, pp, vp, m);
  std::lock_guard<std::mutex> lock(mutex);
  return built.emplace(key, std::move(s)).first->second;
}

PipelineSchedule PipelineSchedule::build_uncached(ScheduleKind kind, int pp, int vp, int m) {
  TETRA_CHECK(pp >= 1 && m >= 1 && vp >= 1, "pipeline schedule needs pp, vp, m >= 1 (got {}, {}, {})", pp, vp, m);
  TETRA_CHECK(kind == ScheduleKind::INTERLEAVED || vp == 1, "the {} schedule runs one model chunk per rank, not {}",
              schedule_name(kind), vp);
  TETRA_CHECK(kind != ScheduleKind::INTERLEAVED || (vp >= 2 && m % pp == 0),
              "the interleaved schedule needs >= 2 chunks per rank (got {}) and micro-batches ({}) divisible by pp ({})",
              vp, m, pp);
  PipelineSchedule s;
  s.kind = kind;
  s.pp = pp;
  s.vp = vp;
  s.m = m;
  s.ranks.resize(static_cast<size_t>(pp));
  for (int r = 0; r < pp; ++r) {
    std::vector<PipeAction>& out = s.ranks[static_cast<size_t>(r)];
    switch (kind) {
      case ScheduleKind::GPIPE:
        for (int i = 0; i < m; ++i) out.push_back({true, i, 0});
        for (int i = 0; i < m; ++i) out.push_back({false, i, 0});
        break;
      case ScheduleKind::ONE_F_ONE_B: {
        const int warmup = std::min(pp - r - 1, m);
        for (int i = 0; i < warmup; ++i) out.push_back({true, i, 0});
        for (int i = 0; i < m - warmup; ++i) {
          out.push_back({true, warmup + i, 0});
          out.push_back({false, i, 0});
        }
        for (int i = m - warmup; i < m; ++i) out.push_back({false, i, 0});
        break;
      }
      case ScheduleKind::INTERLEAVED: {
        const int total = m * vp;
        const int warmup = m == pp ? total : std::min((pp - r - 1) * 2 + (vp - 1) * pp, total);
        for (int k = 0; k < warmup; ++k) out.push_back(interleaved_action(k, pp, vp, true));
        for (int k = 0; k < total - warmup; ++k) {
          out.push_back(interleaved_action(warmup + k, pp, vp, true));
          out.push_back(interleaved_action(k, pp, vp, false));
        }
        for (int k = total - warmup; k < total; ++k) out.push_back(interleaved_action(k, pp, vp, false));
        break;
      }
    }
  }
  // The fewest gradient send buffers per chunk with which the runner cannot deadlock (each
  // micro-batch its own buffer always works: nothing is then reused within a step). More buffers
  // only relax the waits: doubling finds a count that works (the answer is small for every
  // schedule, a few checks), bisection the first one.
  int lo = 1, hi = 1;
  for (;;) {
    s.grad_buffers = hi;
    if (hi >= m || check_schedule(s).empty()) break;
    lo = hi + 1;
    hi = std::min(2 * hi, m);
  }
  while (lo < hi) {
    s.grad_buffers = lo + (hi - lo) / 2;
    if (check_schedule(s).empty()) hi = s.grad_buffers;
    else lo = s.grad_buffers + 1;
  }
  s.grad_buffers = lo;
  return s;
}

int PipelineSchedule::max_in_flight(int rank) const {
  int live = 0, peak = 0;
  for (const PipeAction& a : ranks.at(static_cast<size_t>(rank))) {
    live += a.forward ? 1 : -1;
    peak = std::max(peak, live);
  }
  return peak;
}

int PipelineSchedule::max_in_flight(int rank, int chunk) const {
  int live = 0, peak = 0;
  for (const PipeAction& a : ranks.at(static_cast<size_t>(rank))) {
    if (a.chunk != chunk) continue;
    live += a.forward ? 1 : -1;
    peak = std::max(peak, live);
  }
  return peak;
}

double PipelineSchedule::ideal_bubble() const {
  return static_cast<double>(pp - 1) / static_cast<double>(m * vp + pp - 1);
}

std::string check_schedule(const PipelineSchedule& s, bool forward_only) {
  const int pp = s.pp, S = s.stages();
  if (static_cast<int>(s.ranks.size()) != pp) return fmt::format("{} rank lists for pp = {}", s.ranks.size(), pp);
  // Each rank does forward and backward of every (micro-batch, chunk) exactly once, backward last.
  for (int r = 0; r < pp && !forward_only; ++r) {
    std::map<std::pair<int, int>, int> state;  // (m, chunk) -> 1 after forward, 2 after backward
    for (const PipeAction& a : s.ranks[static_cast<size_t>(r)]) {
      if (a.micro_batch < 0 || a.micro_batch >= s.m || a.chunk < 0 || a.chunk >= s.vp)
        return fmt::format("rank {}: action on micro-batch {} chunk {} out of range", r, a.micro_batch, a.chunk);
      int& st = state[{a.micro_batch, a.chunk}];
      if (a.forward && st != 0) return fmt::format("rank {}: forward of micro-batch {} chunk {} twice", r, a.micro_batch, a.chunk);
      if (!a.forward && st != 1)
        return fmt::format("rank {}: backward of micro-batch {} chunk {} {}", r, a.micro_batch, a.chunk,
                           st == 0 ? "before its forward" : "twice");
      st = a.forward ? 1 : 2;
    }
    if (static_cast<int>(state.size()) != s.m * s.vp)
      return fmt::format("rank {} runs {} of the {} (micro-batch, chunk) pairs", r, state.size(), s.m * s.vp);
    for (const auto& [key, st] : state)
      if (st != 2) return fmt::format("rank {}: micro-batch {} chunk {} has no backward", r, key.first, key.second);
  }
  // Execution as the runner does it. channels[(from, to, kind)] hold (micro-batch, sending stage)
  // in send order. A send is posted at once, but completes only when its receiver has run the
  // action that receives it (the worst case: a large message, which MPI and NCCL deliver only
  // into a posted receive), and its buffer is reused later: micro-batch m's input gradient leaves
  // from buffer m % grad_buffers, so the backward of m + grad_buffers waits until m's message has
  // been received; forward-only, a chunk's activations leave from its one slot, so its forward of
  // m + 1 waits for m's. (Training, an activation slot is reused only after the backward of the
  // micro-batch it held, which needed that activation received: the runner's wait cannot block.)
  std::map<std::tuple<int, int, int>, std::deque<std::pair<int, int>>> channels;
  std::set<std::tuple<int, int, int, int>> received;  // (kind, stage, micro-batch) of received messages
  auto was_received = [&](int kind, int stage, int m) { return m < 0 || received.count({kind, stage, m, 0}) > 0; };
  std::vector<size_t> next(static_cast<size_t>(pp), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < pp; ++r) {
      const auto& list = s.ranks[static_cast<size_t>(r)];
      size_t& i = next[static_cast<size_t>(r)];
      while (i < list.size()) {
        const PipeAction& a = list[i];
        if (forward_only && !a.forward) {
          ++i;
          continue;
        }
        const int stage = s.stage_of(r, a.chunk);
        const bool sends = a.forward ? stage < S - 1 : stage > 0;
        if (sends && (forward_only || !a.forward)) {  // the buffer this action sends from must be free
          const int reuse = a.forward ? 1 : s.grad_buffers;
          if (!was_received(a.forward ? 0 : 1, stage, a.micro_batch - reuse)) break;
        }
        const bool needs_recv = a.forward ? stage > 0 : stage < S - 1;
        if (needs_recv) {
          const int from = a.forward ? (r - 1 + pp) % pp : (r + 1) % pp;
          auto& q = channels[{from, r, a.forward ? 0 : 1}];
          if (q.empty()) break;  // blocked until the peer sends
          const int want_stage = a.forward ? stage - 1 : stage + 1;
          if (q.front() != std::make_pair(a.micro_batch, want_stage))
            return fmt::format("rank {} {} of micro-batch {} (stage {}) would receive micro-batch {} of stage {}", r,
                               a.forward ? "forward" : "backward", a.micro_batch, stage, q.front().first,
                               q.front().second);
          received.insert({a.forward ? 0 : 1, want_stage, a.micro_batch, 0});
          q.pop_front();
        }
        if (sends) {
          const int to = a.forward ? (r + 1) % pp : (r - 1 + pp) % pp;
          channels[{r, to, a.forward ? 0 : 1}].push_back({a.micro_batch, stage});
        }
        ++i;
        progress = true;
      }
    }
  }
  for (int r = 0; r < pp; ++r) {
    const size_t i = next[static_cast<size_t>(r)];
    if (i < s.ranks[static_cast<size_t>(r)].size()) {
      const PipeAction& a = s.ranks[static_cast<size_t>(r)][i];
      return fmt::format("deadlock: rank {} waits forever in its action {} ({} of micro-batch {}, chunk {})", r, i,
                         a.forward ? "forward" : "backward", a.micro_batch, a.chunk);
    }
  }
  for (const auto& [key, q] : channels)
    if (!q.empty())
      return fmt::format("{} message(s) from rank {} to rank {} never received", q.size(), std::get<0>(key),
                         std::get<1>(key));
  return "";
}

}  // namespace tetra
