// StepGuard: which steps are skipped (non-finite values; spikes judged by a z-score against a full
// window of applied steps, computed here by hand), the consecutive-skip limit, and the watchdog's
// record being silent when off. One process: the agreement all-reduce is a no-op on a group of one.
#include <catch2/catch.hpp>

#include <cmath>
#include <limits>

#include "kernels/backend.h"
#include "trainer/config/config.h"
#include "kernels/common/check.h"
#include "trainer/comm/self_communicator.h"
#include "trainer/train/step_guard.h"

namespace {

using namespace tetra;

struct Fixture {
  std::unique_ptr<Backend> be = make_cpu_backend(1);
  std::unique_ptr<Communicator> world = make_self_communicator("world", 0);
};

TrainingConfig guard_config(double zscore, int64_t window, int64_t max_skipped) {
  TrainingConfig tc;
  tc.spike_zscore = zscore;
  tc.spike_window = window;
  tc.max_skipped_steps = max_skipped;
  return tc;
}

}  // namespace

TEST_CASE("step guard skips non-finite losses and norms") {
  Fixture f;
  StepGuard guard(guard_config(0.0, 50, 5), *f.world, *f.be);
  const double nan = std::numeric_limits<double>::quiet_NaN(), inf = std::numeric_limits<double>::infinity();
  CHECK_FALSE(guard.check(1, 2.0, 1.0).skip);
  StepVerdict v = guard.check(2, nan, 1.0);
  CHECK(v.skip);
  CHECK(v.reason == "loss nan");
  v = guard.check(3, 2.0, inf);
  CHECK(v.skip);
  CHECK(v.reason == "grad norm inf");
  // Off: a 1000x loss is applied.
  CHECK_FALSE(guard.check(4, 2000.0, 1.0).skip);
}

TEST_CASE("step guard spike detector: z-score over a full window of applied steps") {
  Fixture f;
  // window 4, threshold 3: losses 1.0, 1.2, 0.8, 1.0 have mean 1.0 and population sd sqrt(0.02).
  StepGuard guard(guard_config(3.0, 4, 5), *f.world, *f.be);
  const double sd = std::sqrt(0.02);
  // Not judged before the window is full: a jump at step 2 is applied (and joins the window).
  CHECK_FALSE(guard.check(1, 1.0, 1.0).skip);
  StepGuard fresh(guard_config(3.0, 4, 5), *f.world, *f.be);
  CHECK_FALSE(fresh.check(1, 1.0, 1.0).skip);
  CHECK_FALSE(fresh.check(2, 50.0, 1.0).skip);
  for (double x : {1.2, 0.8, 1.0}) CHECK_FALSE(guard.check(2, x, 1.0).skip);
  // z just below and above 3 (the norms stay constant: sd 0, never judged).
  CHECK_FALSE(guard.check(5, 1.0 + 2.99 * sd, 1.0).skip);
  // That step entered the window (1.2, 0.8, 1.0, 1.0 + 2.99 sd): recompute mean and sd by hand.
  const double w[4] = {1.2, 0.8, 1.0, 1.0 + 2.99 * sd};
  double mean = 0.0, var = 0.0;
  for (double x : w) mean += x / 4.0;
  for (double x : w) var += (x - mean) * (x - mean) / 4.0;
  const double above = mean + 3.01 * std::sqrt(var), below = mean + 2.99 * std::sqrt(var);
  StepVerdict v = guard.check(6, above, 1.0);
  CHECK(v.skip);
  CHECK(v.reason.find("loss spike") == 0);
  // A skipped step does not enter the window: the same threshold holds for the next step.
  CHECK_FALSE(guard.check(7, below, 1.0).skip);
  // Downward moves are never spikes.
  StepGuard down(guard_config(3.0, 4, 5), *f.world, *f.be);
  for (double x : {1.0, 1.2, 0.8, 1.0}) down.check(1, x, 1.0);
  CHECK_FALSE(down.check(5, -100.0, 1.0).skip);
}

TEST_CASE("step guard fails after more than max_skipped_steps in a row") {
  Fixture f;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  StepGuard guard(guard_config(0.0, 50, 2), *f.world, *f.be);
  CHECK(guard.check(1, nan, 1.0).skip);
  CHECK(guard.check(2, nan, 1.0).skip);
  CHECK_FALSE(guard.check(3, 1.0, 1.0).skip);  // an applied step resets the count
  CHECK(guard.check(4, nan, 1.0).skip);
  CHECK(guard.check(5, nan, 1.0).skip);
  CHECK_THROWS_WITH(guard.check(6, nan, 1.0),
                    Catch::Contains("step 6: loss nan; 3 step(s) in a row skipped, more than "
                                    "training.max_skipped_steps (2)"));
  StepGuard strict(guard_config(0.0, 50, 0), *f.world, *f.be);
  CHECK_THROWS_WITH(strict.check(1, 1.0, nan), Catch::Contains("training.max_skipped_steps (0)"));
}
