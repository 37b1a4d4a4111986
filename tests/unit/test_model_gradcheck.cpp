// The whole model's backward pass against central finite differences of its loss, for a GPT-2
// style and a Llama style configuration, in fp32. Independent of the PyTorch reference test: this
// one needs no second implementation, only the forward pass.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>

#include "kernels/backend.h"
#include "trainer/model/gpt.h"
#include "trainer/params/param_layout.h"

using namespace tetra;

namespace {

ModelConfig tiny(bool llama) {
  ModelConfig m;
  m.vocab_size = 37;
  m.seq_len = 6;
  m.num_layers = 2;
  m.hidden_size = 16;
  m.num_heads = 4;
  m.num_kv_heads = llama ? 2 : 4;
  m.ffn_hidden_size = llama ? 24 : 64;
  m.norm = llama ? Norm::RMSNORM : Norm::LAYERNORM;
  m.activation = llama ? Activation::SWIGLU : Activation::GELU;
  m.position = llama ? Position::ROPE : Position::LEARNED;
  m.tie_embeddings = !llama;
  m.bias = !llama;
  m.init_std = 0.3;  // large weights: every path carries a gradient well above rounding noise
  return m;
}

struct Harness {
  ModelConfig cfg;
  ParamLayout layout;
  std::unique_ptr<Backend> be = make_cpu_backend(1);
  std::unique_ptr<Gpt> model;
  int64_t B = 2, N;
  std::vector<float> params;
  std::vector<int32_t> tokens, targets;
  std::vector<float> losses;

  explicit Harness(const ModelConfig& m) : cfg(m), layout(ParamLayout::build(cfg)) {
    model = std::make_unique<Gpt>(cfg, layout, *be, DType::F32, B);
    N = B * cfg.seq_len;
    params.resize(layout.total);
    init_params(layout, cfg, 42, params.data());
    // Norm weights and biases start at 1 and 0: perturb them so their gradients are generic.
    std::mt19937 rng(3);
    std::uniform_real_distribution<float> u(-0.5f, 0.5f);
    for (const ParamSpec& p : layout.params)
      if (p.init == ParamInit::ONES || p.init == ParamInit::ZEROS)
        for (int64_t i = 0; i < p.held(); ++i) params[p.offset + i] += u(rng);
    tokens.resize(N);
    targets.resize(N);
    for (int64_t i = 0; i < N; ++i) {
      tokens[i] = static_cast<int32_t>((i * 7 + 3) % cfg.vocab_size);
      targets[i] = static_cast<int32_t>((i * 11 + 5) % cfg.vocab_size);
    }
    losses.resize(N);
  }

  double loss(float dloss_scale) {
    model->forward(params.data(), tokens.data(), targets.data(), losses.data(), dloss_scale);
    double s = 0;
    for (float l : losses) s += l;
    return s / static_cast<double>(N);
  }
};

void check_gradients(const ModelConfig& m) {
  Harness h(m);
  std::vector<float> grads(h.layout.total, 0.0f);
  h.loss(1.0f / static_cast<float>(h.N));
  h.model->backward(h.params.data(), grads.data(), h.tokens.data());

  std::mt19937 rng(11);
  // Central differences with step 1e-2 on fp32 weights of size ~0.3: truncation error
  // O(step^2 * f''') ~ 1e-5, rounding error ~ 1e-7 * loss / step ~ 3e-5 per entry; gradients of
  // sampled entries are ~1e-3..1e-1, so 2% relative on each tensor's sampled vector (plus 1e-4
  // absolute) separates a correct backward from any wrong term, which is off by O(1).
  const float step = 1e-2f;
  for (const ParamSpec& p : h.layout.params) {
    double err2 = 0, ref2 = 0;
    const int samples = static_cast<int>(std::min<int64_t>(p.held(), 6));  // not the vocabulary's padding
    std::uniform_int_distribution<int64_t> pick(0, p.held() - 1);
    for (int k = 0; k < samples; ++k) {
      const int64_t i = p.offset + (samples == p.held() ? k : pick(rng));
      const float saved = h.params[i];
      h.params[i] = saved + step;
      const double up = h.loss(0.0f);
      h.params[i] = saved - step;
      const double down = h.loss(0.0f);
      h.params[i] = saved;
      const double fd = (up - down) / (2.0 * step);
      err2 += (fd - grads[i]) * (fd - grads[i]);
      ref2 += fd * fd;
    }
    INFO(p.name << ": |fd - backward| = " << std::sqrt(err2) << ", |fd| = " << std::sqrt(ref2));
    CHECK(std::sqrt(err2) <= 0.02 * std::sqrt(ref2) + 1e-4);
  }
}

}  // namespace

TEST_CASE("GPT-2 style model: backward matches finite differences", "[model][gradcheck]") {
  check_gradients(tiny(false));
}

TEST_CASE("Llama style model (RMSNorm, SwiGLU, RoPE, GQA, untied): backward matches finite differences",
          "[model][gradcheck]") {
  check_gradients(tiny(true));
}

TEST_CASE("Qwen3 style model (per-head q/k RMSNorm, head_dim 8 != hidden / heads): backward matches finite "
          "differences", "[model][gradcheck]") {
  ModelConfig m = tiny(true);
  m.qk_norm = true;
  m.head_dim = 8;
  check_gradients(m);
}
