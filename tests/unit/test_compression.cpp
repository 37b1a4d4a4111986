// 1-bit compression (trainer/optim/compression.h): the wire format against a plain-loop reference,
// the chunk plan, and error feedback: over many steps the sum of the decompressed (applied)
// updates stays within a fixed bound of the exact sum with error feedback, and drifts far outside
// it without (both asserted, so a broken error feedback fails). The two-stage exchange of 1-bit
// Adam (worker and server compression around an all-to-all and an all-gather) is simulated for
// 4 ranks in memory with the same functions the trainer calls between its collectives. The int8
// compressor (parallel.grad_compression int8): the wire format and its rounding against a plain
// loop, unbiasedness, a non-finite block, and the same two-stage exchange with error feedback.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <random>
#include <vector>

#include "trainer/optim/compression.h"

namespace {

using namespace tetra;

double norm2(const std::vector<double>& v) {
  double s = 0.0;
  for (double x : v) s += x * x;
  return std::sqrt(s);
}

// Step t's input: a fixed mean with entries of two magnitudes (even 1.0, odd 0.01, so every
// block mixes them) plus N(0, 0.1) noise. For the scaled sign compressor this is a biased input:
// a block's scale (mean |x|, ~0.54) is far from either magnitude, so without error feedback every
// step applies ~0.46 too little to the large entries and ~0.03 too much to the small ones.
std::vector<float> biased_input(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> noise(0.0f, 0.1f);
  std::vector<float> x(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) x[static_cast<size_t>(k)] = (k % 2 == 0 ? 1.0f : 0.01f) + noise(rng);
  return x;
}

// The two-stage exchange for p ranks, simulated in memory with the functions the trainer calls
// between its collectives, over T steps of biased_input on every rank: every rank compresses its
// vector per destination shard (worker error), the all-to-all is a transposition of the messages,
// each owner averages and recompresses (server error), the all-gather concatenates, and every rank
// decodes the same vector (required). Each source rank rounds with its own key, each step and stage
// with its own stream (int8; the sign codec has no rounding to seed).
struct ExchangeRun {
  std::vector<double> diff;  // the sum of the decoded vectors minus the sum of the exact rank means
  double max_mean = 0.0;     // the largest ||rank mean|| of a step
  double worst_step = 0.0;   // the largest |decoded - rank mean| of an element in a step
};

ExchangeRun simulate_exchange(const ChunkPlan& plan, int64_t p, int64_t n, int64_t T, std::mt19937& rng, bool feedback) {
  const int64_t shard_total = n / p;
  std::vector<std::vector<float>> worker_error(p, std::vector<float>(n, 0.0f));
  std::vector<std::vector<float>> server_error(p, std::vector<float>(shard_total, 0.0f));
  std::vector<double> exact(n, 0.0), applied(n, 0.0);
  ExchangeRun run;
  for (int64_t t = 0; t < T; ++t) {
    std::vector<std::vector<float>> x(p);
    std::vector<double> mean(n, 0.0);
    for (int64_t r = 0; r < p; ++r) {
      x[r] = biased_input(n, rng);
      for (int64_t k = 0; k < n; ++k) mean[k] += x[r][k] / static_cast<double>(p);
    }
    for (int64_t k = 0; k < n; ++k) exact[k] += mean[k];
    run.max_mean = std::max(run.max_mean, norm2(mean));
    std::vector<std::vector<uint16_t>> send(p, std::vector<uint16_t>(p * plan.words));
    for (int64_t r = 0; r < p; ++r)
      exchange_worker_compress(plan, x[r].data(), feedback ? worker_error[r].data() : nullptr, send[r].data(),
                               Rounding{static_cast<uint64_t>(r), static_cast<uint64_t>(2 * t), 0});
    std::vector<uint16_t> gathered(p * plan.words);
    for (int64_t r = 0; r < p; ++r) {
      std::vector<uint16_t> recv(p * plan.words);  // source-major: what every source sent to r
      for (int64_t s = 0; s < p; ++s)
        std::copy(send[s].begin() + r * plan.words, send[s].begin() + (r + 1) * plan.words,
                  recv.begin() + s * plan.words);
      std::vector<float> avg(shard_total);
      exchange_server_average(plan, recv.data(), avg.data());
      exchange_server_compress(plan, avg.data(), feedback ? server_error[r].data() : nullptr,
                               gathered.data() + r * plan.words,
                               Rounding{static_cast<uint64_t>(r), static_cast<uint64_t>(2 * t + 1), 0});
    }
    std::vector<float> out0(n), out(n);
    exchange_gather_decompress(plan, gathered.data(), out0.data());
    for (int64_t r = 1; r < p; ++r) {  // every rank decodes the same gathered bytes
      exchange_gather_decompress(plan, gathered.data(), out.data());
      REQUIRE(out == out0);
    }
    for (int64_t k = 0; k < n; ++k) {
      applied[k] += out0[k];
      run.worst_step = std::max(run.worst_step, std::fabs(out0[k] - mean[k]));
    }
  }
  run.diff.resize(n);
  for (int64_t k = 0; k < n; ++k) run.diff[k] = applied[k] - exact[k];
  return run;
}

}  // namespace

TEST_CASE("compression: sign_compress matches a plain-loop reference", "[compression]") {
  const int64_t n = 2 * kSignBlock + 48;  // a partial last block
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.3f, 1.0f);
  std::vector<float> x(n), err(n), out(n, 0.0f), acc(n, 1.0f);
  for (auto& v : x) v = dist(rng);
  for (auto& v : err) v = 0.1f * dist(rng);
  const std::vector<float> err0 = err;
  REQUIRE(sign_packed_words(n) == 2 * 3 + n / 16);
  std::vector<uint16_t> packed(static_cast<size_t>(sign_packed_words(n)));
  sign_compress(x.data(), err.data(), n, packed.data());
  sign_decompress(packed.data(), n, out.data());
  sign_decompress_add(packed.data(), n, 0.5f, acc.data());
  for (int64_t b = 0; b < 3; ++b) {
    const int64_t lo = b * kSignBlock, hi = std::min(n, lo + kSignBlock);
    double abs_sum = 0.0;
    for (int64_t k = lo; k < hi; ++k) abs_sum += std::fabs(static_cast<double>(x[k] + err0[k]));
    const double s = abs_sum / static_cast<double>(hi - lo);
    for (int64_t k = lo; k < hi; ++k) {
      const float v = x[k] + err0[k];
      const double want = v >= 0.0f ? s : -s;
      // The scale is the double mean rounded once to fp32: relative 2^-24.
      REQUIRE(out[k] == Approx(want).epsilon(1e-6));
      REQUIRE(acc[k] == Approx(1.0 + 0.5 * want).epsilon(1e-6));
      // The error is exactly what the decompression dropped (computed in fp32 from the same values).
      REQUIRE(err[k] == v - out[k]);
      // The sign bit itself: element k is bit k % 16 of word k / 16 after the scales.
      REQUIRE(((packed[6 + k / 16] >> (k % 16)) & 1) == (v >= 0.0f ? 1 : 0));
    }
  }
  CHECK_THROWS(sign_packed_words(24));  // not a multiple of 16
}

TEST_CASE("compression: chunk plan shards every bucket over the ranks", "[compression]") {
  const std::vector<GradRange> buckets = {{0, 64 * 4}, {256, 4096 * 4 + 64}};
  const ChunkPlan plan = plan_chunks(buckets, 4);
  REQUIRE(plan.pieces.size() == 2);
  CHECK(plan.pieces[0].shard == 64);
  CHECK(plan.pieces[1].shard == 4096 + 16);
  CHECK(plan.pieces[1].offset == sign_packed_words(64));
  CHECK(plan.words == sign_packed_words(64) + sign_packed_words(4096 + 16));
  const std::vector<GradRange> mine = plan.owned(2);
  CHECK(mine[0].offset == 128);
  CHECK(mine[1].offset == 256 + 2 * (4096 + 16));
  CHECK_THROWS(plan_chunks({{0, 100}}, 4));  // 100 does not split into 4 shards of a multiple of 16
}

// The bound: with error feedback the sum of applied updates telescopes, sum_t C(x_t + e_t) =
// sum_t x_t - e_T (e_0 = 0), so its distance to the exact sum is the last error, which stays
// O(max_t |x_t|) for ever: the compressor keeps a fixed fraction of its input's energy (for these
// inputs ||v - C(v)|| <= q ||v|| with q ~ 0.65), so ||e|| <= q / (1 - q) max ||x|| < 2 max ||x||.
// We assert ||applied - exact|| <= 2 max_t ||x_t|| after T = 400 steps. Without error feedback the
// bias adds up linearly (~0.46 T per large entry): the same check must fail, by far.
TEST_CASE("compression: error feedback keeps the applied sum near the exact sum", "[compression]") {
  const int64_t n = 4096, T = 400;
  for (const bool feedback : {true, false}) {
    std::mt19937 rng(42);
    std::vector<double> exact(n, 0.0), applied(n, 0.0);
    std::vector<float> err(n, 0.0f), out(n);
    std::vector<uint16_t> packed(static_cast<size_t>(sign_packed_words(n)));
    double max_x = 0.0;
    for (int64_t t = 0; t < T; ++t) {
      const std::vector<float> x = biased_input(n, rng);
      double xx = 0.0;
      for (int64_t k = 0; k < n; ++k) {
        exact[k] += x[k];
        xx += static_cast<double>(x[k]) * x[k];
      }
      max_x = std::max(max_x, std::sqrt(xx));
      sign_compress(x.data(), feedback ? err.data() : nullptr, n, packed.data());
      sign_decompress(packed.data(), n, out.data());
      for (int64_t k = 0; k < n; ++k) applied[k] += out[k];
    }
    std::vector<double> diff(n);
    for (int64_t k = 0; k < n; ++k) diff[k] = applied[k] - exact[k];
    const double distance = norm2(diff), bound = 2.0 * max_x;
    INFO("error feedback " << feedback << ": ||applied - exact|| = " << distance << ", bound " << bound);
    if (feedback) {
      CHECK(distance <= bound);
      // And the telescoping identity itself: applied - exact = -e_T, up to fp32 rounding of the
      // 400 per-step error updates (each ~1e-7 relative of values ~1: 1e-3 in all is generous).
      double worst = 0.0;
      for (int64_t k = 0; k < n; ++k) worst = std::max(worst, std::fabs(diff[k] + err[k]));
      CHECK(worst < 1e-3);
    } else {
      CHECK(distance > 10.0 * bound);
    }
  }
}

// 1-bit Adam's two-stage exchange for p = 4 ranks, simulated (simulate_exchange). Over T steps the
// sum of what every rank decompresses stays within the bound of the exact sum of the rank means
// (the telescoping argument above, with the mean worker error plus the server error as the last
// error: 3 max ||mean x|| covers both), and every rank decompresses the same vector. Without the
// errors, the check fails by far.
TEST_CASE("compression: two-stage compressed all-reduce with error feedback", "[compression]") {
  const int64_t p = 4, T = 300;
  const ChunkPlan plan = plan_chunks({{0, 16 * 64 * p}, {16 * 64 * p, 2 * kSignBlock * p}}, p);
  const int64_t n = 16 * 64 * p + 2 * kSignBlock * p;
  for (const bool feedback : {true, false}) {
    std::mt19937 rng(3);
    const ExchangeRun run = simulate_exchange(plan, p, n, T, rng, feedback);
    const double distance = norm2(run.diff), bound = 3.0 * run.max_mean;
    INFO("error feedback " << feedback << ": ||applied - exact|| = " << distance << ", bound " << bound);
    if (feedback)
      CHECK(distance <= bound);
    else
      CHECK(distance > 10.0 * bound);
  }
}

// int8 (QSGD with 127 levels per sign): against a plain-loop reference. Each element lands on one
// of the two levels around 127 |v| / s (stochastic rounding), the error is exactly what the
// decompression dropped (to fp32 rounding), the bytes are two's complement in element order, and the same rounding
// stream gives the same bytes while another stream gives other ones.
TEST_CASE("compression: int8_compress matches a plain-loop reference", "[compression]") {
  const int64_t n = 2 * kSignBlock + 48;  // a partial last block
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.2f, 1.0f);
  std::vector<float> x(n), err(n), out(n), acc(n, 1.0f);
  for (auto& v : x) v = dist(rng);
  for (auto& v : err) v = 0.05f * dist(rng);
  const std::vector<float> err0 = err;
  REQUIRE(int8_packed_words(n) == 2 * 3 + n / 2);
  REQUIRE(packed_words(Codec::INT8, n) == int8_packed_words(n));
  std::vector<uint16_t> packed(static_cast<size_t>(int8_packed_words(n)));
  const Rounding rounding{123, 7, 40};
  int8_compress(x.data(), err.data(), n, packed.data(), rounding);
  int8_decompress(packed.data(), n, out.data());
  int8_decompress_add(packed.data(), n, 0.5f, acc.data());
  const int8_t* bytes = reinterpret_cast<const int8_t*>(packed.data() + 6);
  int64_t rounded_up = 0;
  for (int64_t b = 0; b < 3; ++b) {
    const int64_t lo = b * kSignBlock, hi = std::min(n, lo + kSignBlock);
    float s = 0.0f;
    for (int64_t k = lo; k < hi; ++k) s = std::max(s, std::fabs(x[k] + err0[k]));
    for (int64_t k = lo; k < hi; ++k) {
      const float v = x[k] + err0[k];
      const float level = std::fabs(v) * (127.0f / s);
      const int q = std::abs(static_cast<int>(bytes[k]));
      REQUIRE((q == static_cast<int>(std::floor(level)) || q == static_cast<int>(std::floor(level)) + 1));
      REQUIRE(q <= 127);
      rounded_up += q > static_cast<int>(std::floor(level)) ? 1 : 0;
      if (q > 0) REQUIRE((bytes[k] < 0) == (v < 0.0f));
      REQUIRE(out[k] == static_cast<float>(bytes[k]) * (s / 127.0f));
      REQUIRE(acc[k] == Approx(1.0 + 0.5 * out[k]).epsilon(1e-6));
      // The error is what the decompression dropped, up to the rounding of q * s / 127 (which the
      // compiler may fuse into the subtraction): 2^-24 of the scale.
      REQUIRE(err[k] == Approx(v - out[k]).margin(1e-7 * s));
    }
  }
  // Stochastic: some round up, some down (560 elements, each up with its fractional part's odds).
  CHECK(rounded_up > 100);
  CHECK(rounded_up < n - 100);
  std::vector<uint16_t> again(packed.size()), other(packed.size());
  std::vector<float> e1 = err0, e2 = err0;
  int8_compress(x.data(), e1.data(), n, again.data(), rounding);
  int8_compress(x.data(), e2.data(), n, other.data(), Rounding{123, 8, 40});
  CHECK(again == packed);
  CHECK(other != packed);
  CHECK_THROWS(int8_packed_words(24));
}

// Unbiased: over many rounding streams the mean of the decompressed values is v, within the
// sampling error (each value is v's lower or upper level, so its standard deviation is at most
// half a level, s / 254; the mean of N = 4000 is within 5 of its standard deviations,
// 5 s / (254 sqrt(N)) = 0.079 s / 254, of v). Rounding down instead would be off by half a level
// on average, and the check fails by far.
TEST_CASE("compression: int8 stochastic rounding is unbiased", "[compression]") {
  const int64_t n = kSignBlock, N = 4000;
  std::mt19937 rng(9);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n), out(n);
  for (auto& v : x) v = dist(rng);
  float s = 0.0f;
  for (float v : x) s = std::max(s, std::fabs(v));
  std::vector<double> mean(n, 0.0);
  std::vector<uint16_t> packed(static_cast<size_t>(int8_packed_words(n)));
  for (int64_t t = 0; t < N; ++t) {
    int8_compress(x.data(), nullptr, n, packed.data(), Rounding{99, static_cast<uint64_t>(t), 0});
    int8_decompress(packed.data(), n, out.data());
    for (int64_t k = 0; k < n; ++k) mean[k] += out[k] / static_cast<double>(N);
  }
  const double half_level = s / 254.0;
  double worst = 0.0;
  for (int64_t k = 0; k < n; ++k) worst = std::max(worst, std::fabs(mean[k] - x[k]) / half_level);
  INFO("worst |mean - x| = " << worst << " half levels");
  CHECK(worst <= 5.0 / std::sqrt(static_cast<double>(N)));
}

// A block holding a non-finite value decompresses to NaN (so the step's gradient norm is NaN and
// the step guard skips it) and keeps its errors; the other blocks are compressed as usual.
TEST_CASE("compression: int8 passes a non-finite block on as NaN", "[compression]") {
  const int64_t n = 2 * kSignBlock;
  std::vector<float> x(n, 0.5f), err(n, 0.25f), out(n);
  x[kSignBlock + 3] = std::numeric_limits<float>::infinity();
  std::vector<uint16_t> packed(static_cast<size_t>(int8_packed_words(n)));
  int8_compress(x.data(), err.data(), n, packed.data(), Rounding{1, 2, 0});
  int8_decompress(packed.data(), n, out.data());
  for (int64_t k = 0; k < kSignBlock; ++k) {
    REQUIRE(out[k] == Approx(0.75f).epsilon(1e-6));  // the block's maximum: level 127
    REQUIRE(std::fabs(err[k]) < 1e-6f);
  }
  for (int64_t k = kSignBlock; k < n; ++k) {
    REQUIRE(std::isnan(out[k]));
    REQUIRE(err[k] == 0.25f);
  }
}

// Error feedback with int8, over the two-stage exchange for p = 4 ranks (as the 1-bit test above):
// the sum of what every rank decompresses stays within the telescoping bound of the exact sum of
// the rank means, every rank decodes the same, and each step's result is within a few levels of
// the exact mean (127 levels per sign: far closer than the 1-bit exchange).
TEST_CASE("compression: two-stage int8 exchange with error feedback", "[compression]") {
  const int64_t p = 4, T = 200;
  const ChunkPlan plan = plan_chunks({{0, 16 * 64 * p}, {16 * 64 * p, 2 * kSignBlock * p}}, p, Codec::INT8);
  REQUIRE(plan.words == int8_packed_words(16 * 64) + int8_packed_words(2 * kSignBlock));
  const int64_t n = 16 * 64 * p + 2 * kSignBlock * p;
  std::mt19937 rng(4);
  const ExchangeRun run = simulate_exchange(plan, p, n, T, rng, /*feedback=*/true);
  // Inputs reach |x| ~ 1.4, so a level is ~0.011. The distance is the last errors (the mean worker
  // error plus the server error, each under a level per element): <= 2 levels x sqrt(n) = 1.7,
  // against 0.05 max ||mean|| = 2.8. One step's result differs from the exact mean by the change
  // of those errors, a few levels: < 0.1.
  INFO("||applied - exact|| = " << norm2(run.diff) << ", bound " << 0.05 * run.max_mean << "; worst step error "
                                 << run.worst_step);
  CHECK(norm2(run.diff) <= 0.05 * run.max_mean);
  CHECK(run.worst_step < 0.1);
}
