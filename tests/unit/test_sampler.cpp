// Text sampling: the token choice (greedy, top-k, temperature) on fixed logits against plain-loop
// references, the inference forward pass against the loss it feeds, and the generation loop
// (context window, end-of-document stop, vocabulary limit) against a hand-written greedy loop.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "kernels/backend.h"
#include "trainer/model/gpt.h"
#include "trainer/params/param_layout.h"
#include "trainer/model/sampler.h"
#include "trainer/train/generate.h"

using namespace tetra;

namespace {

// softmax(logits / T) restricted to `allowed` (plain loop, double).
std::vector<double> reference_probs(const std::vector<float>& logits, double T, const std::vector<int>& allowed) {
  std::vector<double> p(logits.size(), 0.0);
  double mx = -1e300, sum = 0.0;
  for (int i : allowed) mx = std::max(mx, static_cast<double>(logits[i]));
  for (int i : allowed) sum += p[i] = std::exp((logits[i] - mx) / T);
  for (double& x : p) x /= sum;
  return p;
}

std::vector<double> frequencies(const std::vector<float>& logits, double T, int64_t top_k, int64_t draws,
                                uint64_t seed) {
  std::vector<double> f(logits.size(), 0.0);
  for (int64_t i = 0; i < draws; ++i)
    f[sample_token(logits, T, top_k, sampling_uniform(seed, static_cast<uint64_t>(i)))] += 1.0;
  for (double& x : f) x /= static_cast<double>(draws);
  return f;
}

}  // namespace

TEST_CASE("sampler: temperature 0 picks the argmax, the lowest index among equal maxima", "[sampler]") {
  const std::vector<float> logits{0.5f, 2.0f, -1.0f, 2.0f, 1.999f, -std::numeric_limits<float>::infinity()};
  for (double u : {1e-9, 0.25, 0.5, 0.999999})
    for (int64_t k : {0, 1, 3, 6}) CHECK(sample_token(logits, 0.0, k, u) == 1);
  const std::vector<float> negative{-5.0f, -3.0f, -4.0f};
  CHECK(sample_token(negative, 0.0, 0, 0.5) == 1);
  // top_k 1 is greedy at any temperature.
  for (int64_t i = 0; i < 100; ++i) CHECK(sample_token(logits, 3.0, 1, sampling_uniform(9, i)) == 1);
}

TEST_CASE("sampler: top-k never picks outside the k largest logits", "[sampler]") {
  const std::vector<float> logits{0.3f, -1.2f, 2.5f, 0.9f, 2.4f, -0.1f, 1.7f, 0.0f, 2.45f, -3.0f};
  std::vector<int> order(logits.size());
  std::iota(order.begin(), order.end(), 0);
  std::sort(order.begin(), order.end(), [&](int a, int b) { return logits[a] > logits[b]; });
  for (int64_t k : {2, 3, 5}) {
    std::vector<int64_t> count(logits.size(), 0);
    // A high temperature flattens the distribution: tokens outside the top k would be picked
    // often if the restriction leaked.
    for (int64_t i = 0; i < 20000; ++i) ++count[sample_token(logits, 5.0, k, sampling_uniform(4, i))];
    for (size_t r = 0; r < order.size(); ++r) {
      INFO("k " << k << ", rank " << r << " token " << order[r]);
      if (static_cast<int64_t>(r) < k)
        CHECK(count[order[r]] > 0);
      else
        CHECK(count[order[r]] == 0);
    }
  }
  // Ties at the boundary go to the lower indices: of the three logits 3, k = 2 keeps ids 1 and 2.
  const std::vector<float> tied{1.0f, 3.0f, 3.0f, 3.0f, 0.0f};
  std::vector<int64_t> count(tied.size(), 0);
  for (int64_t i = 0; i < 2000; ++i) ++count[sample_token(tied, 1.0, 2, sampling_uniform(5, i))];
  CHECK(count[1] > 0);
  CHECK(count[2] > 0);
  CHECK(count[0] + count[3] + count[4] == 0);
}

TEST_CASE("sampler: draws follow softmax(logits / T), over the top k when restricted", "[sampler]") {
  const std::vector<float> logits{1.0f, -0.5f, 0.25f, 2.0f, -2.0f, 0.9f};
  const int64_t draws = 200000;
  struct Case {
    double T;
    int64_t k;
    std::vector<int> allowed;
  };
  const std::vector<Case> cases{{1.0, 0, {0, 1, 2, 3, 4, 5}},
                                {0.5, 0, {0, 1, 2, 3, 4, 5}},
                                {2.0, 0, {0, 1, 2, 3, 4, 5}},
                                {1.5, 3, {0, 3, 5}}};
  for (const Case& c : cases) {
    const std::vector<double> p = reference_probs(logits, c.T, c.allowed);
    const std::vector<double> f = frequencies(logits, c.T, c.k, draws, 17);
    for (size_t i = 0; i < logits.size(); ++i) {
      // Each count is binomial(draws, p): its frequency's standard deviation is
      // sqrt(p (1 - p) / draws) <= 0.0011. Five of them: a correct sampler fails a bin with
      // probability < 6e-7 (and the draws are a fixed sequence, so the outcome is reproducible),
      // while a wrong temperature or an unnormalised top-k moves some bin by > 0.02, >= 18 sigma.
      const double sigma = std::sqrt(p[i] * (1.0 - p[i]) / static_cast<double>(draws));
      INFO("T " << c.T << ", top_k " << c.k << ", token " << i << ": frequency " << f[i] << ", softmax "
                << p[i]);
      CHECK(std::abs(f[i] - p[i]) <= 5.0 * sigma);
    }
  }
}

TEST_CASE("sampler: the draws are uniform on (0, 1) and depend on the seed", "[sampler]") {
  double sum = 0.0, lo = 1.0, hi = 0.0;
  const int64_t n = 100000;
  int64_t same = 0;
  for (int64_t i = 0; i < n; ++i) {
    const double u = sampling_uniform(1, static_cast<uint64_t>(i));
    sum += u;
    lo = std::min(lo, u);
    hi = std::max(hi, u);
    same += u == sampling_uniform(2, static_cast<uint64_t>(i));
  }
  CHECK(lo > 0.0);
  CHECK(hi < 1.0);
  // The mean of n uniforms has standard deviation sqrt(1/12 / n) = 0.0009: 5 of them.
  CHECK(std::abs(sum / n - 0.5) < 0.0046);
  CHECK(same == 0);
  CHECK(sampling_uniform(1, 7) == sampling_uniform(1, 7));
}

TEST_CASE("sampler: NaN logits are an error", "[sampler]") {
  const std::vector<float> logits{0.0f, std::numeric_limits<float>::quiet_NaN(), 1.0f};
  CHECK_THROWS_WITH(sample_token(logits, 1.0, 0, 0.5), Catch::Contains("logit 1 of 3 is NaN"));
  CHECK_THROWS_WITH(sample_token(logits, 0.0, 0, 0.5), Catch::Contains("NaN"));
}

TEST_CASE("sampler: escape_text makes one log line", "[sampler]") {
  CHECK(escape_text("a \"b\"\n\\c\td\r\x01 é") == "a \\\"b\\\"\\n\\\\c\\td\\r\\x01 é");
}

namespace {

ModelConfig tiny_model() {
  ModelConfig m;
  m.vocab_size = 29;
  m.seq_len = 6;
  m.num_layers = 2;
  m.hidden_size = 16;
  m.num_heads = 4;
  m.num_kv_heads = 4;
  m.ffn_hidden_size = 64;
  m.init_std = 0.5;  // large weights: logits far apart, no near-ties for greedy to stumble on
  return m;
}

// Row `row` of the (T, V) logits of a (1, T) forward over `window` padded with `filler`.
std::vector<float> logits_row(Gpt& model, const std::vector<float>& params, const std::vector<int32_t>& window,
                              int32_t filler) {
  const ModelDims& d = model.dims();
  std::vector<int32_t> tokens(static_cast<size_t>(d.T), filler);
  std::copy(window.begin(), window.end(), tokens.begin());
  model.forward_logits(params.data(), tokens.data());
  const float* l = static_cast<const float*>(model.logits()) + (window.size() - 1) * static_cast<size_t>(d.V);
  return std::vector<float>(l, l + d.V);
}

}  // namespace

TEST_CASE("Gpt::forward_logits: the logits the loss is computed from", "[sampler]") {
  const ModelConfig cfg = tiny_model();
  const ParamLayout layout = ParamLayout::build(cfg);
  std::unique_ptr<Backend> be = make_cpu_backend(1);
  const int64_t B = 2, T = cfg.seq_len, V = cfg.vocab_size, N = B * T;
  Gpt model(cfg, layout, *be, DType::F32, B);
  std::vector<float> params(static_cast<size_t>(layout.total));
  init_params(layout, cfg, 7, params.data());
  std::vector<int32_t> tokens(N), targets(N);
  for (int64_t i = 0; i < N; ++i) {
    tokens[i] = static_cast<int32_t>((i * 5 + 1) % V);
    targets[i] = static_cast<int32_t>((i * 13 + 2) % V);
  }
  std::vector<float> losses(N);
  model.forward(params.data(), tokens.data(), targets.data(), losses.data(), 0.0f);
  model.forward_logits(params.data(), tokens.data());
  const float* logits = static_cast<const float*>(model.logits());
  for (int64_t r = 0; r < N; ++r) {
    double mx = -1e300, sum = 0.0;
    for (int64_t v = 0; v < V; ++v) mx = std::max(mx, static_cast<double>(logits[r * V + v]));
    for (int64_t v = 0; v < V; ++v) sum += std::exp(logits[r * V + v] - mx);
    const double want = mx + std::log(sum) - logits[r * V + targets[r]];
    // fp32 cross-entropy of V = 29 logits of size ~1 against the same logits in double: a few
    // ulps of the loss (~1e-7); 1e-5 leaves room and still catches a wrong row or column.
    INFO("row " << r);
    CHECK(std::abs(losses[r] - want) < 1e-5);
  }
}

TEST_CASE("Sampler: greedy generation slides a T-token window and stops at the end-of-document id",
          "[sampler]") {
  const ModelConfig cfg = tiny_model();
  const ParamLayout layout = ParamLayout::build(cfg);
  std::unique_ptr<Backend> be = make_cpu_backend(1);
  Gpt model(cfg, layout, *be, DType::F32, 1);
  Sampler sampler(model, *be, nullptr);
  std::vector<float> params(static_cast<size_t>(layout.total));
  init_params(layout, cfg, 11, params.data());

  // The reference: every step's argmax from an explicit window of the last T ids, padded with a
  // filler other than the sampler's (causal attention makes it irrelevant).
  const std::vector<int32_t> context{3, 17};
  const int64_t steps = 10;  // > T: the window slides
  auto reference = [&](int64_t vocab_limit) {
    std::vector<int32_t> ids = context, out;
    for (int64_t i = 0; i < steps; ++i) {
      const size_t n = std::min<size_t>(ids.size(), static_cast<size_t>(cfg.seq_len));
      const std::vector<int32_t> window(ids.end() - static_cast<std::ptrdiff_t>(n), ids.end());
      const std::vector<float> row = logits_row(model, params, window, static_cast<int32_t>(cfg.vocab_size - 1));
      const auto best = static_cast<int32_t>(std::max_element(row.begin(), row.begin() + vocab_limit) - row.begin());
      out.push_back(best);
      ids.push_back(best);
    }
    return out;
  };
  SampleConfig s;
  s.max_tokens = steps;
  s.temperature = 0.0;
  const int32_t no_eod = -1;
  const std::vector<int32_t> want = reference(cfg.vocab_size);
  CHECK(sampler.generate(params.data(), context, s, no_eod, cfg.vocab_size) == want);

  // Stop before the end-of-document id: at the third token, and at the first.
  const std::vector<int32_t> stopped = sampler.generate(params.data(), context, s, want[2], cfg.vocab_size);
  const auto first = std::find(want.begin(), want.end(), want[2]);
  CHECK(stopped == std::vector<int32_t>(want.begin(), first));
  CHECK(sampler.generate(params.data(), context, s, want[0], cfg.vocab_size).empty());

  // A vocabulary limit below the argmax of some step: never exceeded, and the greedy choice among
  // the allowed ids.
  const int32_t limit = *std::max_element(want.begin(), want.end());
  REQUIRE(limit > 0);
  const std::vector<int32_t> limited = sampler.generate(params.data(), context, s, no_eod, limit);
  CHECK(limited == reference(limit));
  for (int32_t t : limited) CHECK(t < limit);

  // Sampling with a seed: the same ids for the same seed.
  s.temperature = 1.0;
  s.top_k = 5;
  s.seed = 3;
  CHECK(sampler.generate(params.data(), context, s, no_eod, cfg.vocab_size) ==
        sampler.generate(params.data(), context, s, no_eod, cfg.vocab_size));
}
