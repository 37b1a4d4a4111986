// 1-bit compression (trainer/optim/compression.h): the wire format against a plain-loop reference,
// the chunk plan, and error feedback: over many steps the sum of the decompressed (applied)
// updates stays within a fixed bound of the exact sum with error feedback, and drifts far outside
// it without (both asserted, so a broken error feedback fails). The two-stage exchange of 1-bit
// Adam (worker and server compression around an all-to-all and an all-gather) is simulated for
// 4 ranks in memory with the same functions the trainer calls between its collectives.
#include <catch2/catch.hpp>

#include <cmath>
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

// 1-bit Adam's two-stage exchange for p = 4 ranks, simulated: every rank compresses its vector per
// destination shard (worker error), the all-to-all is a transposition of the messages, each owner
// averages and recompresses (server error), the all-gather concatenates. Over T steps the sum of
// what every rank decompresses stays within the bound of the exact sum of the rank means (the
// telescoping argument above, with the mean worker error plus the server error as the last
// error: 3 max ||mean x|| covers both), and every rank decompresses the same vector. Without the
// errors, the check fails by far.
TEST_CASE("compression: two-stage compressed all-reduce with error feedback", "[compression]") {
  const int64_t p = 4, T = 300;
  const ChunkPlan plan = plan_chunks({{0, 16 * 64 * p}, {16 * 64 * p, 2 * kSignBlock * p}}, p);
  const int64_t n = 16 * 64 * p + 2 * kSignBlock * p;
  const int64_t shard_total = n / p;
  for (const bool feedback : {true, false}) {
    std::mt19937 rng(3);
    std::vector<std::vector<float>> worker_error(p, std::vector<float>(n, 0.0f));
    std::vector<std::vector<float>> server_error(p, std::vector<float>(shard_total, 0.0f));
    std::vector<double> exact(n, 0.0), applied(n, 0.0);
    double max_mean = 0.0;
    for (int64_t t = 0; t < T; ++t) {
      std::vector<std::vector<float>> x(p);
      std::vector<double> mean(n, 0.0);
      for (int64_t r = 0; r < p; ++r) {
        x[r] = biased_input(n, rng);
        for (int64_t k = 0; k < n; ++k) mean[k] += x[r][k] / static_cast<double>(p);
      }
      for (int64_t k = 0; k < n; ++k) exact[k] += mean[k];
      max_mean = std::max(max_mean, norm2(mean));
      std::vector<std::vector<uint16_t>> send(p, std::vector<uint16_t>(p * plan.words));
      for (int64_t r = 0; r < p; ++r)
        onebit_worker_compress(plan, x[r].data(), feedback ? worker_error[r].data() : nullptr, send[r].data());
      std::vector<uint16_t> gathered(p * plan.words);
      for (int64_t r = 0; r < p; ++r) {
        std::vector<uint16_t> recv(p * plan.words);  // source-major: what every source sent to r
        for (int64_t s = 0; s < p; ++s)
          std::copy(send[s].begin() + r * plan.words, send[s].begin() + (r + 1) * plan.words,
                    recv.begin() + s * plan.words);
        std::vector<float> avg(shard_total);
        onebit_server_average(plan, recv.data(), avg.data());
        onebit_server_compress(plan, avg.data(), feedback ? server_error[r].data() : nullptr,
                               gathered.data() + r * plan.words);
      }
      std::vector<float> out0(n), out(n);
      onebit_gather_decompress(plan, gathered.data(), out0.data());
      for (int64_t r = 1; r < p; ++r) {  // every rank decodes the same gathered bytes
        onebit_gather_decompress(plan, gathered.data(), out.data());
        REQUIRE(out == out0);
      }
      for (int64_t k = 0; k < n; ++k) applied[k] += out0[k];
    }
    std::vector<double> diff(n);
    for (int64_t k = 0; k < n; ++k) diff[k] = applied[k] - exact[k];
    const double distance = norm2(diff), bound = 3.0 * max_mean;
    INFO("error feedback " << feedback << ": ||applied - exact|| = " << distance << ", bound " << bound);
    if (feedback)
      CHECK(distance <= bound);
    else
      CHECK(distance > 10.0 * bound);
  }
}
