// Pipeline schedule tables: every schedule for many (pp, v, m) runs to completion under the
// runner's rules (no deadlock, messages matched to the right micro-batch, each action once,
// backward after forward), and its activation memory follows the schedule's bound.
#include <catch2/catch.hpp>

#include <algorithm>

#include "kernels/common/check.h"
#include "trainer/parallel/pipeline_schedule.h"

using namespace tetra;

TEST_CASE("gpipe and 1f1b tables are valid and keep their in-flight bounds", "[pipeline]") {
  for (int pp = 1; pp <= 8; ++pp)
    for (int m = 1; m <= 16; ++m)
      for (ScheduleKind kind : {ScheduleKind::GPIPE, ScheduleKind::ONE_F_ONE_B}) {
        const PipelineSchedule s = PipelineSchedule::build(kind, pp, 1, m);
        INFO(schedule_name(kind) << " pp=" << pp << " m=" << m);
        REQUIRE(check_schedule(s).empty());
        REQUIRE(check_schedule(s, /*forward_only=*/true).empty());
        for (int r = 0; r < pp; ++r) {
          REQUIRE(s.ranks[r].size() == static_cast<size_t>(2 * m));
          // gpipe keeps every micro-batch; 1f1b at most pp - r on rank r.
          const int bound = kind == ScheduleKind::GPIPE ? m : std::min(pp - r, m);
          REQUIRE(s.max_in_flight(r) == bound);
          REQUIRE(s.max_in_flight(r, 0) == bound);
        }
        REQUIRE(s.ideal_bubble() == Approx(double(pp - 1) / double(m + pp - 1)));
      }
}

TEST_CASE("interleaved tables are valid for many (pp, v, m)", "[pipeline]") {
  for (int pp = 1; pp <= 8; ++pp)
    for (int vp = 2; vp <= 4; ++vp)
      for (int m = pp; m <= 4 * pp; m += pp) {
        const PipelineSchedule s = PipelineSchedule::build(ScheduleKind::INTERLEAVED, pp, vp, m);
        INFO("pp=" << pp << " v=" << vp << " m=" << m);
        REQUIRE(check_schedule(s).empty());
        REQUIRE(check_schedule(s, /*forward_only=*/true).empty());
        for (int r = 0; r < pp; ++r) {
          REQUIRE(s.ranks[r].size() == static_cast<size_t>(2 * m * vp));
          // Megatron's warm-up: (pp - r - 1) * 2 + (v - 1) pp forwards (all when m == pp), then one
          // more forward before the first backward.
          const int total = m * vp;
          const int warmup = m == pp ? total : std::min((pp - r - 1) * 2 + (vp - 1) * pp, total);
          REQUIRE(s.max_in_flight(r) == std::min(warmup + 1, total));
          // Within a chunk, micro-batches run forward in order (the data each stage reads).
          for (int c = 0; c < vp; ++c) {
            int expect = 0;
            for (const PipeAction& a : s.ranks[r])
              if (a.forward && a.chunk == c) REQUIRE(a.micro_batch == expect++);
          }
        }
        REQUIRE(s.ideal_bubble() == Approx(double(pp - 1) / double(m * vp + pp - 1)));
      }
}

TEST_CASE("gradient send buffers: one per chunk cannot deadlock", "[pipeline]") {
  // A send completes only once received, and a chunk's input gradients leave from
  // grad_buffers buffers in turn. build() picks the fewest the simulation proves deadlock-free;
  // for these schedules one is enough (the backward of m + 1 on a stage cannot come before the
  // previous stage's backward of m has received m's gradient without a cycle): memory for them
  // does not grow with the number of micro-batches.
  for (ScheduleKind kind : {ScheduleKind::GPIPE, ScheduleKind::ONE_F_ONE_B, ScheduleKind::INTERLEAVED})
    for (int pp = 2; pp <= 8; ++pp)
      for (int m = pp; m <= 4 * pp; m += pp) {
        const int vp = kind == ScheduleKind::INTERLEAVED ? 2 : 1;
        const PipelineSchedule s = PipelineSchedule::build(kind, pp, vp, m);
        INFO(schedule_name(kind) << " pp=" << pp << " m=" << m);
        REQUIRE(s.grad_buffers == 1);
        REQUIRE(check_schedule(s).empty());
      }
}

TEST_CASE("the schedule checker finds broken tables", "[pipeline]") {
  // Swapping the steady-state pair of the last rank makes it wait for a gradient of a micro-batch
  // whose forward it has not run: each mutation must be reported.
  PipelineSchedule s = PipelineSchedule::build(ScheduleKind::ONE_F_ONE_B, 4, 1, 8);
  {
    PipelineSchedule bad = s;
    auto& first = bad.ranks[3];
    std::swap(first[0], first[1]);  // backward of micro-batch 0 before its forward
    REQUIRE_FALSE(check_schedule(bad).empty());
  }
  {
    PipelineSchedule bad = s;
    // Rank 0 runs backward of micro-batch 0 right after its forward: it waits for rank 1's
    // gradient, while rank 1 (still warming up) waits for rank 0's activation of micro-batch 1.
    auto& r0 = bad.ranks[0];
    const auto b0 = std::find(r0.begin(), r0.end(), PipeAction{false, 0, 0});
    std::rotate(r0.begin() + 1, b0, b0 + 1);
    REQUIRE(check_schedule(bad).find("deadlock") != std::string::npos);
  }
  {
    PipelineSchedule bad = s;
    // Rank 1 swaps two forwards: its first receive would match micro-batch 0's activation to
    // micro-batch 1.
    auto& r1 = bad.ranks[1];
    std::swap(r1[0], r1[1]);
    REQUIRE(check_schedule(bad).find("would receive") != std::string::npos);
  }
  {
    PipelineSchedule bad = s;
    bad.ranks[2].pop_back();  // a backward missing
    REQUIRE_FALSE(check_schedule(bad).empty());
  }
}

TEST_CASE("schedule arguments are checked", "[pipeline]") {
  REQUIRE_THROWS_AS(PipelineSchedule::build(ScheduleKind::INTERLEAVED, 4, 2, 6), Error);   // m % pp
  REQUIRE_THROWS_AS(PipelineSchedule::build(ScheduleKind::INTERLEAVED, 4, 1, 8), Error);   // v < 2
  REQUIRE_THROWS_AS(PipelineSchedule::build(ScheduleKind::ONE_F_ONE_B, 4, 2, 8), Error);   // v > 1
  REQUIRE_THROWS_AS(schedule_kind("zero-bubble"), Error);
  REQUIRE(schedule_kind("1f1b") == ScheduleKind::ONE_F_ONE_B);
}
