#include "trainer/train/step_trace.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <limits>

#include <fmt/format.h>
#include <spdlog/spdlog.h>

#include "kernels/common/check.h"
#include "trainer/comm/process_groups.h"
#include "trainer/core/log.h"
#include "trainer/core/trace.h"

namespace tetra {

namespace {

constexpr int kRoundTrips = 8;

// A double through an int32 pair (the host communicators' types).
void send_double(Communicator& c, double v, int peer) {
  int32_t w[2];
  std::memcpy(w, &v, sizeof(v));
  c.send(w, 2, DType::I32, peer);
}
double recv_double(Communicator& c, int peer) {
  int32_t w[2];
  c.recv(w, 2, DType::I32, peer);
  double v;
  std::memcpy(&v, w, sizeof(v));
  return v;
}

// This rank's trace clock minus rank 0's, and its uncertainty (half the least round trip), with
// rank 0's clock at the start (the trace's time 0). Collective over `world` (host memory).
struct Alignment {
  double offset_s = 0.0, uncertainty_s = 0.0, epoch_s = 0.0;
};
Alignment align_clocks(Communicator& world) {
  Alignment a;
  world.barrier();
  if (world.rank() == 0) {
    a.epoch_s = trace::now_s();
    for (int r = 1; r < world.size(); ++r) {
      double best_rtt = std::numeric_limits<double>::infinity(), offset = 0.0;
      for (int i = 0; i < kRoundTrips; ++i) {
        const double t0 = trace::now_s();
        send_double(world, t0, r);
        const double tr = recv_double(world, r);
        const double t1 = trace::now_s();
        if (t1 - t0 < best_rtt) best_rtt = t1 - t0, offset = tr - 0.5 * (t0 + t1);
      }
      send_double(world, offset, r);
      send_double(world, 0.5 * best_rtt, r);
      send_double(world, a.epoch_s, r);
    }
  } else {
    for (int i = 0; i < kRoundTrips; ++i) {
      recv_double(world, 0);
      send_double(world, trace::now_s(), 0);
    }
    a.offset_s = recv_double(world, 0);
    a.uncertainty_s = recv_double(world, 0);
    a.epoch_s = recv_double(world, 0);
  }
  return a;
}

}  // namespace

std::string StepProfiler::path(const std::string& logging_dir, int rank) {
  return (std::filesystem::path(logging_dir) / "trace" / fmt::format("rank_{}.json", rank)).string();
}

StepProfiler::StepProfiler(const Config& cfg, ProcessGroups& groups, int64_t first_step) : groups_(groups) {
  const std::vector<int64_t>& p = cfg.training.profile_steps;
  if (p.size() != 2) return;  // validated: [first, last] or empty
  rank_ = groups.rank;
  if (first_step > p[1]) {
    if (rank_ == 0)
      spdlog::info("training.profile_steps [{}, {}]: the run starts at step {}, past them: no timeline", p[0], p[1],
                   first_step);
    return;
  }
  first_ = std::max(p[0], first_step), last_ = p[1];
  const GridCoord& c = groups.coord;
  process_name_ = fmt::format("rank {} {}", rank_, rank_prefix({c.tp, c.pp, c.dp, c.ep, rank_}));
  coords_json_ = fmt::format("\"tp\":{},\"cp\":{},\"pp\":{},\"dp\":{},\"ep\":{},\"world\":{}", c.tp, c.cp, c.pp,
                             c.dp, c.ep, groups.grid.world());
  file_ = path(cfg.logging.dir, rank_);
  std::error_code ec;
  std::filesystem::create_directories(std::filesystem::path(file_).parent_path(), ec);
  TETRA_INPUT_CHECK(!ec, "logging.dir: rank {} cannot create {}: {}; training.profile_steps writes each rank's "
                    "timeline there: give a logging.dir every rank can write", rank_,
                    std::filesystem::path(file_).parent_path().string(), ec.message());
  if (rank_ == 0)
    spdlog::info("profiling steps {} to {}: each rank's timeline to {}{}", first_, last_,
                 (std::filesystem::path(cfg.logging.dir) / "trace" / "rank_R.json").string(),
                 groups.grid.world() > 1 ? " on rank 0's clock" : "");
}

StepProfiler::~StepProfiler() {
  if (recording_) trace::stop();
}

void StepProfiler::begin_step(int64_t step) {
  if (!enabled() || step != first_) return;
  // Aligned now rather than at start-up: clocks of different nodes drift apart.
  const Alignment a = align_clocks(*groups_.world);
  offset_s_ = a.offset_s, uncertainty_s_ = a.uncertainty_s, epoch_s_ = a.epoch_s;
  trace::set_common_clock(a.epoch_s, a.offset_s);
  if (rank_ != 0)
    spdlog::debug("trace clock offset to rank 0: {:.3f} ms (± {:.3f} ms)", offset_s_ * 1e3, uncertainty_s_ * 1e3);
  trace::start();
  recording_ = true;
}

std::string StepProfiler::end_step(int64_t step, double ms) {
  if (!recording_) return "";
  steps_.emplace_back(step, ms);
  if (step < last_) return "";
  return write();
}

std::string StepProfiler::finish() { return recording_ ? write() : ""; }

std::string StepProfiler::write() {
  trace::stop();
  recording_ = false;
  std::string steps = "[";
  for (const auto& [s, ms] : steps_) steps += fmt::format("{}{{\"step\":{},\"ms\":{:.3f}}}", steps.size() > 1 ? "," : "", s, ms);
  steps += "]";
  trace::ProcessInfo info;
  info.rank = rank_;
  info.name = process_name_;
  info.other_data = fmt::format("\"rank\":{},{},\"clock_offset_ms\":{:.6f},\"clock_uncertainty_ms\":{:.6f},"
                                "\"epoch_s\":{:.9f},\"profile_steps\":[{},{}],\"steps\":{}",
                                rank_, coords_json_, offset_s_ * 1e3, uncertainty_s_ * 1e3, epoch_s_, first_, last_,
                                steps);
  int64_t n = 0;
  try {
    n = trace::write(file_, info);
  } catch (const std::exception& e) {  // the timeline is lost, not the run
    spdlog::warn("timeline of steps {} to {} not written: {}", first_, last_, e.what());
    return "";
  }
  const std::string line = fmt::format("timeline of steps {} to {}: {} ({} events)", first_,
                                       steps_.empty() ? first_ : steps_.back().first, file_, n);
  if (rank_ == 0) spdlog::info("{}", line);
  else spdlog::debug("{}", line);
  return file_;
}

}  // namespace tetra
