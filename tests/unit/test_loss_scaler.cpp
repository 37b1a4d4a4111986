// LossScaler (trainer/optim/loss_scaler.h) against a step-by-step transcription of Megatron's
// DynamicGradScaler.update (written here independently, as a table of expected states), over
// sequences of overflows and good steps: hysteresis before the first halving, halving on every
// later overflow, the min_loss_scale floor, growth after a window of good steps (which refills the
// hysteresis), the 2^64 ceiling, the static scale, the divergence limit at the floor, and restore.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "kernels/common/check.h"
#include "trainer/optim/loss_scaler.h"

using namespace tetra;

namespace {

TrainingConfig fp16_config(double initial, int64_t window, double min_scale, int64_t hysteresis,
                           int64_t max_skipped = 5) {
  TrainingConfig t;
  t.precision = Precision::FP16;
  t.loss_scale = 0.0;
  t.initial_loss_scale = initial;
  t.loss_scale_window = window;
  t.min_loss_scale = min_scale;
  t.hysteresis = hysteresis;
  t.max_skipped_steps = max_skipped;
  return t;
}

// An independent model of Megatron's update: (scale, growth, hysteresis) after one step; Tetra caps
// the growth at 2^64 (kMaxLossScale), which Megatron does not.
struct Model {
  double scale, min_scale;
  int64_t growth = 0, hyst, window, hysteresis;
  void step(bool inf) {
    if (inf) {
      growth = 0;
      hyst -= 1;
      if (hyst <= 0) scale = std::max(scale / 2, min_scale);
    } else if (++growth == window) {
      growth = 0;
      hyst = hysteresis;
      scale = std::min(scale * 2, 0x1p64);
    }
  }
};

}  // namespace

TEST_CASE("loss scaler: hysteresis, halving, floor and growth follow Megatron's rules", "[loss_scaler]") {
  LossScaler s(fp16_config(1024.0, 3, 128.0, 2));
  CHECK(s.dynamic());
  CHECK(s.scale() == 1024.0);
  CHECK(s.state().hysteresis_tracker == 2);
  struct Step {
    bool overflow;
    double scale_after;
    int64_t growth_after, hysteresis_after;
  };
  // The hand-derived sequence (each row: what the step sees, and the state after it).
  const std::vector<Step> steps = {
      {true, 1024.0, 0, 1},   // first overflow: hysteresis absorbs it, scale kept
      {false, 1024.0, 1, 1},  // a good step does not refill the hysteresis (only growth does)
      {true, 512.0, 0, 0},    // second overflow: halved
      {true, 256.0, 0, -1},   // every later overflow halves
      {true, 128.0, 0, -2},
      {true, 128.0, 0, -3},   // floor: min_loss_scale
      {false, 128.0, 1, -3},
      {false, 128.0, 2, -3},
      {false, 256.0, 0, 2},   // window of 3 good steps: doubled, hysteresis refilled
      {true, 256.0, 0, 1},    // absorbed again
      {false, 256.0, 1, 1},
      {false, 256.0, 2, 1},
      {false, 512.0, 0, 2},
  };
  int64_t skipped = 0;
  for (size_t i = 0; i < steps.size(); ++i) {
    INFO("step " << i + 1);
    const double before = s.scale();
    const LossScaleUpdate u = s.update(static_cast<int64_t>(i) + 1, steps[i].overflow);
    CHECK(u.overflow == steps[i].overflow);
    CHECK(u.scale == before);
    CHECK(u.next_scale == steps[i].scale_after);
    CHECK(s.scale() == steps[i].scale_after);
    CHECK(s.state().growth_tracker == steps[i].growth_after);
    CHECK(s.state().hysteresis_tracker == steps[i].hysteresis_after);
    if (steps[i].overflow) ++skipped;
    CHECK(s.skipped_steps() == skipped);
    CHECK(u.describe().empty() == !steps[i].overflow);
  }
}

TEST_CASE("loss scaler: long random sequences agree with the model of Megatron's update", "[loss_scaler]") {
  for (int64_t hysteresis : {1, 2, 4})
    for (int64_t window : {1, 2, 7}) {
      LossScaler s(fp16_config(65536.0, window, 1.0, hysteresis, 1000000));
      Model m{65536.0, 1.0, 0, hysteresis, window, hysteresis};
      uint32_t r = 12345;
      for (int i = 0; i < 5000; ++i) {
        r = r * 1664525u + 1013904223u;
        const bool inf = (r >> 16) % 3 == 0;  // a third of the steps overflow
        s.update(i + 1, inf);
        m.step(inf);
        INFO("hysteresis " << hysteresis << " window " << window << " step " << i + 1);
        REQUIRE(s.scale() == m.scale);
        REQUIRE(s.state().growth_tracker == m.growth);
        REQUIRE(s.state().hysteresis_tracker == m.hyst);
      }
    }
}

TEST_CASE("loss scaler: from 2^40 the overflows halve down to a scale that holds", "[loss_scaler]") {
  // The scenario of the fp16 parity test: gradients overflow above 2^17 here; hysteresis 2 costs
  // one extra skip at the start, then each overflow halves: 1 + (40 - 17) skipped steps.
  LossScaler s(fp16_config(std::ldexp(1.0, 40), 1000, 1.0, 2));
  int64_t step = 0;
  while (s.scale() > std::ldexp(1.0, 17)) s.update(++step, true);
  CHECK(step == 1 + 23);
  CHECK(s.skipped_steps() == 24);
  CHECK(s.scale() == std::ldexp(1.0, 17));
  const LossScaleUpdate u = s.update(++step, false);
  CHECK_FALSE(u.overflow);
  CHECK(u.scale == std::ldexp(1.0, 17));
  CHECK(s.skipped_steps() == 24);
}

TEST_CASE("loss scaler: the scale never grows past 2^64", "[loss_scaler]") {
  LossScaler s(fp16_config(std::ldexp(1.0, 63), 1, 1.0, 2));
  s.update(1, false);
  CHECK(s.scale() == std::ldexp(1.0, 64));
  s.update(2, false);
  CHECK(s.scale() == kMaxLossScale);
  CHECK(std::isfinite(static_cast<float>(s.scale())));
}

TEST_CASE("loss scaler: a static scale never moves, overflows still skip", "[loss_scaler]") {
  TrainingConfig t = fp16_config(65536.0, 2, 1.0, 2, 3);
  t.loss_scale = 1000.0;  // not a power of two: allowed
  LossScaler s(t);
  CHECK_FALSE(s.dynamic());
  CHECK(s.scale() == 1000.0);
  for (int i = 1; i <= 5; ++i) s.update(i, false);
  CHECK(s.scale() == 1000.0);
  const LossScaleUpdate u = s.update(6, true);
  CHECK(u.overflow);
  CHECK(u.next_scale == 1000.0);
  CHECK(u.describe().find("(static)") != std::string::npos);
  CHECK(s.skipped_steps() == 1);
  CHECK(s.scale() == 1000.0);
}

TEST_CASE("loss scaler: overflows in a row at the lowest scale fail the run after max_skipped_steps",
          "[loss_scaler]") {
  SECTION("dynamic, at min_loss_scale") {
    LossScaler s(fp16_config(4.0, 1000, 2.0, 1, 2));
    s.update(1, true);  // 4 -> 2: not at the floor yet
    CHECK(s.scale() == 2.0);
    CHECK(s.state().floor_overflows == 0);
    s.update(2, true);  // at the floor: 1
    s.update(3, true);  // 2
    CHECK(s.state().floor_overflows == 2);
    s.update(4, false);  // a good step ends the run of overflows
    CHECK(s.state().floor_overflows == 0);
    s.update(5, true);
    s.update(6, true);
    try {
      s.update(7, true);  // the third in a row at the floor: more than 2
      FAIL("no error");
    } catch (const Error& e) {
      const std::string what = e.what();
      CHECK(what.find("step 7") != std::string::npos);
      CHECK(what.find("training.max_skipped_steps (2)") != std::string::npos);
    }
  }
  SECTION("static") {
    TrainingConfig t = fp16_config(65536.0, 1000, 1.0, 2, 0);
    t.loss_scale = 8.0;
    LossScaler s(t);
    CHECK_THROWS_AS(s.update(1, true), Error);  // max_skipped_steps 0: the first one
  }
}

TEST_CASE("loss scaler: restore takes a checkpoint's state (a static scale stays configured)", "[loss_scaler]") {
  LossScaler a(fp16_config(65536.0, 4, 1.0, 2));
  for (int i = 1; i <= 7; ++i) a.update(i, i % 3 == 0);
  LossScaler b(fp16_config(65536.0, 4, 1.0, 2));
  b.restore(a.state());
  CHECK(b.state() == a.state());
  for (int i = 8; i <= 30; ++i) {
    const bool inf = i % 5 == 0;
    a.update(i, inf);
    b.update(i, inf);
    REQUIRE(b.state() == a.state());
  }
  TrainingConfig t = fp16_config(65536.0, 4, 1.0, 2);
  t.loss_scale = 32.0;
  LossScaler c(t);
  c.restore(a.state());
  CHECK(c.scale() == 32.0);
  CHECK(c.skipped_steps() == a.skipped_steps());
}

TEST_CASE("loss scaler: only for fp16", "[loss_scaler]") {
  TrainingConfig t = fp16_config(65536.0, 4, 1.0, 2);
  t.precision = Precision::BF16;
  CHECK_THROWS_AS(LossScaler(t), Error);
}
