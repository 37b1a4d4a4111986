// The Mixture-of-Experts layer (trainer/model/moe.h, its shared expert moe_shared.h) at ep = 1
// against a plain-loop reference of routing and expert math (double precision), its backward
// against central finite differences (expert weights, biases, router, shared expert and its gate,
// input), the load-balancing and z losses' values and gradients, dropped tokens under a capacity
// factor, a degenerate router, and a whole MoE model's gradients through Gpt.
#include <catch2/catch.hpp>

#include <cmath>
#include <random>

#include "kernels/backend.h"
#include "kernels/common/math.h"
#include "tests/unit/kernel_testing.h"
#include "trainer/model/gpt.h"
#include "trainer/model/moe.h"
#include "trainer/params/param_layout.h"

using namespace tetra;

namespace {

// The router's gates: as the probabilities are (Switch), or renormalised over the top-k
// (Mixtral), times a scaling factor (DeepSeek); and a shared expert of that width (0: none),
// plain (DeepSeek) or with its sigmoid gate (Qwen2-MoE).
struct Gates {
  bool pre_softmax = true;
  std::optional<double> scale;
  int64_t shared = 0;
  bool shared_gate = false;
  bool sigmoid = false;            // sigmoid scores (no z-loss)
  std::vector<float> select_bias;  // an expert bias set on the layer (sigmoid; empty: none)
};

ModelConfig moe_config(bool swiglu, int64_t K, std::optional<double> capacity, Gates gates = {}) {
  ModelConfig m;
  m.vocab_size = 29;
  m.seq_len = 6;
  m.num_layers = 1;
  m.hidden_size = 16;
  m.num_heads = 4;
  m.num_kv_heads = 4;
  m.ffn_hidden_size = 32;
  m.activation = swiglu ? Activation::SWIGLU : Activation::GELU;
  m.bias = !swiglu;
  m.init_std = 0.3;
  m.moe.num_experts = 4;
  m.moe.top_k = K;
  m.moe.ffn_hidden_size = 8;
  m.moe.capacity_factor = capacity;
  m.moe.aux_loss_coeff = 0.5;  // large: their gradients must be visible in the checks
  m.moe.z_loss_coeff = 0.25;
  m.moe.router_pre_softmax = gates.pre_softmax;
  m.moe.router_topk_scaling_factor = gates.scale;
  m.moe.shared_expert_ffn_hidden_size = gates.shared;
  m.moe.shared_expert_gate = gates.shared_gate;
  if (gates.sigmoid) {
    m.moe.router_score_function = RouterScore::SIGMOID;
    m.moe.z_loss_coeff = 0.0;
    m.moe.router_enable_expert_bias = !gates.select_bias.empty();
  }
  return m;
}

double gelu_ref(double u) { return 0.5 * u * (1.0 + std::tanh(0.7978845608028654 * (u + 0.044715 * u * u * u))); }
double silu_ref(double u) { return u / (1.0 + std::exp(-u)); }

// The layer's math in plain loops, double precision, from fp32 values.
struct Reference {
  std::vector<double> out;
  std::vector<int> dropped;  // per assignment (i, k)
  double aux = 0, z = 0;
};

Reference reference(const ModelConfig& m, const ParamLayout& L, const std::vector<float>& w,
                    const std::vector<float>& h, const std::vector<float>& res, int64_t N,
                    const std::vector<float>& select_bias = {}) {
  const BlockParams& p = L.blocks[0];
  const int64_t C = m.hidden_size, E = m.moe.num_experts, K = m.moe.top_k, F = m.moe.ffn_hidden_size;
  const bool swiglu = m.activation == Activation::SWIGLU;
  const int64_t FC = swiglu ? 2 * F : F;
  const int64_t cap = m.moe.capacity_factor ? static_cast<int64_t>(std::ceil(*m.moe.capacity_factor * N * K / E)) : -1;
  Reference r;
  r.out.assign(res.begin(), res.end());
  r.dropped.assign(N * K, 0);
  std::vector<int64_t> used(E, 0), routed(E, 0);
  std::vector<double> psum(E, 0.0);
  for (int64_t i = 0; i < N; ++i) {
    std::vector<double> logit(E), prob(E);
    double mx = -1e300, s = 0;
    for (int64_t e = 0; e < E; ++e) {
      double a = 0;
      for (int64_t c = 0; c < C; ++c) a += static_cast<double>(h[i * C + c]) * w[p.router_w + e * C + c];
      logit[e] = a;
      mx = std::max(mx, a);
    }
    const bool sigmoid = m.moe.router_score_function == RouterScore::SIGMOID;
    if (!sigmoid) {
      for (int64_t e = 0; e < E; ++e) s += std::exp(logit[e] - mx);
      const double lse = mx + std::log(s);
      r.z += lse * lse / N;
      for (int64_t e = 0; e < E; ++e) prob[e] = std::exp(logit[e] - lse), psum[e] += prob[e];
    } else {  // the scores are the sigmoids; the aux loss reads them normalised over the experts
      for (int64_t e = 0; e < E; ++e) prob[e] = 1.0 / (1.0 + std::exp(-logit[e])), s += prob[e];
      for (int64_t e = 0; e < E; ++e) psum[e] += prob[e] / s;
    }
    auto key = [&](int64_t e) { return prob[e] + (select_bias.empty() ? 0.0 : select_bias[e]); };
    std::vector<int> taken(E, 0);
    std::vector<int64_t> chosen;
    double chosen_sum = 0;
    for (int64_t k = 0; k < K; ++k) {
      int64_t best = -1;
      for (int64_t e = 0; e < E; ++e)
        if (!taken[e] && (best < 0 || key(e) > key(best))) best = e;
      taken[best] = 1;
      chosen.push_back(best);
      chosen_sum += prob[best];
    }
    for (int64_t k = 0; k < K; ++k) {
      const int64_t best = chosen[k];
      const double gate = (m.moe.normalizes_gates() ? prob[best] / chosen_sum : prob[best]) *
                          m.moe.router_topk_scaling_factor.value_or(1.0);
      ++routed[best];
      if (cap >= 0 && used[best] >= cap) {
        r.dropped[i * K + k] = 1;
        continue;
      }
      ++used[best];
      // The expert: u = W1 h + b1, a = act(u), y = W2 a + b2.
      std::vector<double> u(FC), a(F);
      for (int64_t f = 0; f < FC; ++f) {
        double acc = p.experts_fc_b >= 0 ? w[p.experts_fc_b + best * FC + f] : 0.0;
        for (int64_t c = 0; c < C; ++c)
          acc += static_cast<double>(w[p.experts_fc_w + (best * FC + f) * C + c]) * h[i * C + c];
        u[f] = acc;
      }
      for (int64_t f = 0; f < F; ++f) a[f] = swiglu ? silu_ref(u[f]) * u[F + f] : gelu_ref(u[f]);
      for (int64_t c = 0; c < C; ++c) {
        double y = p.experts_proj_b >= 0 ? w[p.experts_proj_b + best * C + c] : 0.0;
        for (int64_t f = 0; f < F; ++f) y += static_cast<double>(w[p.experts_proj_w + (best * C + c) * F + f]) * a[f];
        r.out[i * C + c] += gate * y;
      }
    }
  }
  for (int64_t e = 0; e < E; ++e) r.aux += static_cast<double>(E) / (N * N * K) * routed[e] * psum[e];
  // The shared expert, on every token: out += g s, s = W2 act(W1 h + b1) + b2, g = sigmoid(h . w_g)
  // with the gate, else 1.
  if (m.moe.has_shared_expert()) {
    const int64_t FS = m.moe.shared_expert_ffn_hidden_size, FSC = swiglu ? 2 * FS : FS;
    for (int64_t i = 0; i < N; ++i) {
      std::vector<double> u(FSC), a(FS);
      for (int64_t f = 0; f < FSC; ++f) {
        double acc = p.shared_fc_b >= 0 ? w[p.shared_fc_b + f] : 0.0;
        for (int64_t c = 0; c < C; ++c) acc += static_cast<double>(w[p.shared_fc_w + f * C + c]) * h[i * C + c];
        u[f] = acc;
      }
      for (int64_t f = 0; f < FS; ++f) a[f] = swiglu ? silu_ref(u[f]) * u[FS + f] : gelu_ref(u[f]);
      double g = 1.0;
      if (m.moe.shared_expert_gate) {
        double logit = 0;
        for (int64_t c = 0; c < C; ++c) logit += static_cast<double>(w[p.shared_gate_w + c]) * h[i * C + c];
        g = 1.0 / (1.0 + std::exp(-logit));
      }
      for (int64_t c = 0; c < C; ++c) {
        double s = p.shared_proj_b >= 0 ? w[p.shared_proj_b + c] : 0.0;
        for (int64_t f = 0; f < FS; ++f) s += static_cast<double>(w[p.shared_proj_w + c * FS + f]) * a[f];
        r.out[i * C + c] += g * s;
      }
    }
  }
  return r;
}

struct LayerHarness {
  ModelConfig cfg;
  ParamLayout layout;
  std::unique_ptr<Backend> be = make_cpu_backend(1);
  int64_t N = 12, C;
  std::unique_ptr<MoeLayers> moe;
  std::vector<float> w, h, res, out;

  LayerHarness(bool swiglu, int64_t K, std::optional<double> capacity, DType act = DType::F32, Gates gates = {})
      : cfg(moe_config(swiglu, K, capacity, gates)), layout(ParamLayout::build(cfg)) {
    C = cfg.hidden_size;
    moe = std::make_unique<MoeLayers>(cfg, layout, *be, act, N, nullptr);
    if (!gates.select_bias.empty()) moe->set_expert_bias({{0, gates.select_bias}});
    w.resize(layout.total);
    init_params(layout, cfg, 5, w.data());
    std::mt19937 rng(9);
    std::normal_distribution<float> nd(0.0f, 0.3f);
    for (const ParamSpec& p : layout.params)  // generic biases and router
      if (p.init == ParamInit::ZEROS || p.name.find("router") != std::string::npos)
        for (int64_t i = 0; i < p.numel; ++i) w[p.offset + i] = nd(rng);
    h = tetra_test::randn(N * C, 3, 1.0f);
    res = tetra_test::randn(N * C, 4, 1.0f);
    out.resize(N * C);
  }
  // J = <out, R> + lw (aux_coeff aux + z_coeff z), the objective backward differentiates.
  double objective(const std::vector<float>& R, float lw) {
    moe->forward(0, WeightView(w.data(), nullptr, sizeof(w[0])), h.data(), res.data(), out.data(), lw);
    double j = 0;
    for (int64_t i = 0; i < N * C; ++i) j += static_cast<double>(out[i]) * R[i];
    const MoeStepStats st = moe->take_stats();
    return j + lw * st.objective(cfg.moe);
  }
};

void check_forward(bool swiglu, int64_t K, std::optional<double> capacity, Gates gates = {}) {
  LayerHarness t(swiglu, K, capacity, DType::F32, gates);
  t.moe->forward(0, WeightView(t.w.data(), nullptr, sizeof(t.w[0])), t.h.data(), t.res.data(), t.out.data(), 1.0f);
  const Reference r = reference(t.cfg, t.layout, t.w, t.h, t.res, t.N, gates.select_bias);
  // fp32 GEMMs of length <= 16 against double: ~1e-6 relative; outputs are O(1).
  tetra_test::expect_close(t.out, r.out, {2e-5, 2e-5}, "MoE output");
  const MoeStepStats st = t.moe->take_stats();
  REQUIRE(st.layers.size() == 1);
  int64_t dropped = 0;
  for (int d : r.dropped) dropped += d;
  CHECK(st.layers[0].dropped == dropped);
  int64_t routed = 0;
  for (int64_t n : st.layers[0].tokens_per_expert) routed += n;
  CHECK(routed == t.N * K);
  CHECK(st.layers[0].aux_loss == Approx(r.aux).epsilon(1e-5));
  CHECK(st.layers[0].z_loss == Approx(r.z).epsilon(1e-5));
  if (capacity) CHECK(dropped > 0);  // the capacity case must really drop something
}

void check_backward(bool swiglu, int64_t K, std::optional<double> capacity, float r_scale, Gates gates = {}) {
  LayerHarness t(swiglu, K, capacity, DType::F32, gates);
  const std::vector<float> R = tetra_test::randn(t.N * t.C, 8, r_scale);
  const float lw = 1.0f;
  t.moe->forward(0, WeightView(t.w.data(), nullptr, sizeof(t.w[0])), t.h.data(), t.res.data(), t.out.data(), lw);
  std::vector<float> grads(t.layout.total, 0.0f), dh(t.N * t.C);
  t.moe->backward(0, WeightView(t.w.data(), nullptr, sizeof(t.w[0])), grads.data(), t.h.data(), R.data(), dh.data());
  t.moe->take_stats();  // objective() reads the statistics of its own forward only
  {  // dh in dout's buffer (as Gpt passes them with sequence parallelism): the same gradients
    t.moe->forward(0, WeightView(t.w.data(), nullptr, sizeof(t.w[0])), t.h.data(), t.res.data(), t.out.data(), lw);
    std::vector<float> grads2(t.layout.total, 0.0f), inout = R;
    t.moe->backward(0, WeightView(t.w.data(), nullptr, sizeof(t.w[0])), grads2.data(), t.h.data(), inout.data(),
                    inout.data());
    t.moe->take_stats();
    CHECK(inout == dh);
    CHECK(grads2 == grads);
  }
  // Central differences, step 1e-3 on values ~0.3-1 (small enough that no routing decision
  // flips): truncation ~1e-6, fp32 rounding of J (~10) ~ 1e-6 / 1e-3 = 1e-3 absolute; sampled
  // gradients are ~1e-2..1, so 2% of each tensor's sampled vector plus 2e-3 separates a correct
  // backward from a missing or wrong term (off by O(1) relative).
  const float step = 1e-3f;
  std::mt19937 rng(1);
  auto fd_check = [&](const std::string& name, std::vector<float>& x, int64_t offset, int64_t numel,
                      const float* analytic) {
    double err2 = 0, ref2 = 0;
    std::uniform_int_distribution<int64_t> pick(0, numel - 1);
    for (int k = 0; k < 8; ++k) {
      const int64_t i = offset + pick(rng);
      const float saved = x[i];
      x[i] = saved + step;
      const double up = t.objective(R, lw);
      x[i] = saved - step;
      const double down = t.objective(R, lw);
      x[i] = saved;
      const double fd = (up - down) / (2.0 * step);
      err2 += (fd - analytic[i - offset]) * (fd - analytic[i - offset]);
      ref2 += fd * fd;
    }
    INFO(name << ": |fd - backward| = " << std::sqrt(err2) << ", |fd| = " << std::sqrt(ref2));
    CHECK(std::sqrt(ref2) > 0);
    CHECK(std::sqrt(err2) <= 0.02 * std::sqrt(ref2) + 2e-3);
  };
  for (const ParamSpec& p : t.layout.params)
    if (p.name.find(r_scale == 0.0f ? "router" : "mlp.") != std::string::npos)
      fd_check(p.name, t.w, p.offset, p.numel, grads.data() + p.offset);
  fd_check("input h", t.h, 0, t.N * t.C, dh.data());
}

}  // namespace

TEST_CASE("MoE routing plan: expert-major rows, token order within an expert, capacity drops", "[moe]") {
  // 5 tokens, top-2 over 3 experts.
  const std::vector<int32_t> idx = {0, 1, 1, 0, 0, 2, 0, 1, 2, 1};
  const MoeRoutingPlan free = plan_moe_routing(idx.data(), 5, 2, 3, -1);
  CHECK(free.routed == std::vector<int64_t>{4, 4, 2});
  CHECK(free.kept == free.routed);
  CHECK(free.dropped == 0);
  CHECK(free.rows == std::vector<int32_t>{0, 1, 2, 3, 0, 1, 3, 4, 2, 4});
  CHECK(free.pos == std::vector<int32_t>{0, 4, 5, 1, 2, 8, 3, 6, 9, 7});
  const MoeRoutingPlan capped = plan_moe_routing(idx.data(), 5, 2, 3, 2);
  CHECK(capped.kept == std::vector<int64_t>{2, 2, 2});
  CHECK(capped.dropped == 4);
  // Expert 0 keeps tokens 0 and 1 (its first two), expert 1 tokens 0 and 1, expert 2 tokens 2, 4.
  CHECK(capped.rows == std::vector<int32_t>{0, 1, 0, 1, 2, 4});
  CHECK(capped.pos == std::vector<int32_t>{0, 2, 3, 1, -1, 4, -1, -1, 5, -1});
}

TEST_CASE("MoE routing plan: capacity in the sequence's order over context-parallel chunks", "[moe]") {
  // One sequence of 8 tokens, top-2 over 3 experts, in 4 chunks of 2 (cp 2): rank 0 holds chunks
  // 0 and 3, rank 1 chunks 1 and 2. Each rank's plan, given the assignments before each of its
  // chunks, keeps exactly the assignments the whole sequence's plan keeps.
  const std::vector<int32_t> idx = {0, 1, 1, 0, 0, 2, 0, 1, 2, 1, 1, 0, 0, 2, 1, 2};
  const int64_t K = 2, E = 3, cap = 3, c = 2;
  const MoeRoutingPlan whole = plan_moe_routing(idx.data(), 8, K, E, cap);
  CHECK(whole.dropped == 16 - 9);
  int64_t dropped = 0;
  for (int64_t r = 0; r < 2; ++r) {
    const int64_t chunks[2] = {r, 3 - r};
    std::vector<int32_t> local;
    std::vector<int64_t> before;
    for (int64_t q : chunks) {
      std::vector<int64_t> n(E, 0);
      for (int64_t a = 0; a < q * c * K; ++a) ++n[static_cast<size_t>(idx[static_cast<size_t>(a)])];
      before.insert(before.end(), n.begin(), n.end());
      local.insert(local.end(), idx.begin() + q * c * K, idx.begin() + (q + 1) * c * K);
    }
    const MoeRoutingPlan mine = plan_moe_routing(local.data(), 2 * c, K, E, cap, before.data(), c);
    dropped += mine.dropped;
    for (int64_t h = 0; h < 2; ++h)
      for (int64_t a = 0; a < c * K; ++a)
        CHECK((mine.pos[static_cast<size_t>(h * c * K + a)] >= 0) ==
              (whole.pos[static_cast<size_t>(chunks[h] * c * K + a)] >= 0));
  }
  CHECK(dropped == whole.dropped);
}

TEST_CASE("MoE layer forward matches a plain-loop reference (top-1, top-2, gelu, swiglu, capacity)", "[moe]") {
  check_forward(false, 1, std::nullopt);
  check_forward(false, 2, std::nullopt);
  check_forward(true, 2, std::nullopt);
  check_forward(false, 2, 0.5);
  check_forward(true, 1, 0.75);
  check_forward(false, 2, std::nullopt, Gates{false, std::nullopt});  // renormalised (Mixtral)
  check_forward(true, 3, std::nullopt, Gates{false, 2.5});            // renormalised and scaled
  check_forward(false, 2, 0.5, Gates{true, 0.5});                     // scaled, with drops
  // Sigmoid scores (DeepSeek-V3): gates renormalised over the top-k, scaled; a selection bias
  // large enough to change the choice (experts 2 and 3 favoured) without entering the gates.
  Gates sig{true, 2.5};
  sig.sigmoid = true;
  check_forward(true, 2, std::nullopt, sig);
  check_forward(false, 1, std::nullopt, sig);
  sig.select_bias = {-0.5f, 0.0f, 0.4f, 0.3f};
  check_forward(true, 2, std::nullopt, sig);
  check_forward(false, 3, 0.75, sig);
}

TEST_CASE("MoE layer backward matches finite differences (experts, router, input, aux and z losses)", "[moe][gradcheck]") {
  check_backward(false, 2, std::nullopt, 1.0f);
  check_backward(true, 1, std::nullopt, 1.0f);
  check_backward(false, 2, 0.5, 1.0f);  // dropped assignments carry no gradient
  // Without the output term only the aux and z losses remain: the router's gradient is theirs.
  check_backward(false, 2, std::nullopt, 0.0f);
  // Renormalised gates: the gradient through g = q / sum q (and the scale).
  check_backward(false, 2, std::nullopt, 1.0f, Gates{false, std::nullopt});
  check_backward(true, 3, std::nullopt, 1.0f, Gates{false, 2.5});
  check_backward(false, 2, 0.5, 1.0f, Gates{true, 0.5});
  // Sigmoid scores: the gates through the sigmoid, the aux loss through the normalised scores;
  // with a selection bias (which has no gradient).
  Gates sig{true, 2.5};
  sig.sigmoid = true;
  check_backward(true, 2, std::nullopt, 1.0f, sig);
  check_backward(false, 2, std::nullopt, 0.0f, sig);  // the aux loss's gradient alone
  sig.select_bias = {-0.5f, 0.0f, 0.4f, 0.3f};
  check_backward(false, 3, std::nullopt, 1.0f, sig);
}

TEST_CASE("MoE expert bias: the choice follows score + bias, the update moves it towards the mean load", "[moe]") {
  Gates sig;
  sig.sigmoid = true;
  sig.select_bias = {0.0f, 0.0f, 0.0f, 0.0f};
  LayerHarness t(false, 1, std::nullopt, DType::F32, sig);
  // A bias of 10 on expert 2: every token chooses it, whatever its scores (all in (0, 1)).
  t.moe->set_expert_bias({{0, {0.0f, 0.0f, 10.0f, 0.0f}}});
  t.moe->forward(0, WeightView(t.w.data(), nullptr, sizeof(t.w[0])), t.h.data(), t.res.data(), t.out.data(), 1.0f);
  const MoeStepStats st = t.moe->take_stats();
  REQUIRE(st.layers.size() == 1);
  CHECK(st.layers[0].tokens_per_expert == std::vector<int64_t>{0, 0, t.N, 0});
  // The gate is the chosen sigmoid score (top-1: not renormalised), never the bias.
  const Reference r = reference(t.cfg, t.layout, t.w, t.h, t.res, t.N, {0.0f, 0.0f, 10.0f, 0.0f});
  tetra_test::expect_close(t.out, r.out, {2e-5, 2e-5}, "MoE output with a dominating bias");
  // Update: mean 3; experts below it rise by the rate, above it fall, at the mean stay.
  t.moe->update_expert_bias({{0, {1, 3, 8, 0}}, {5, {1, 1, 1, 1}}});  // block 5: not this layer's
  const std::map<int64_t, std::vector<float>> b = t.moe->expert_bias();
  const float rate = static_cast<float>(t.cfg.moe.router_bias_update_rate);
  REQUIRE(b.size() == 1);
  CHECK(b.at(0) == std::vector<float>{0.0f + rate, 0.0f, 10.0f - rate, 0.0f + rate});
}

TEST_CASE("MoE shared expert: forward matches the reference (gelu, swiglu, plain, gated)", "[moe]") {
  for (bool swiglu : {false, true})
    for (bool gate : {false, true}) {
      INFO("swiglu " << swiglu << " gate " << gate);
      check_forward(swiglu, 2, std::nullopt, Gates{true, std::nullopt, 24, gate});
      check_forward(swiglu, 1, 0.5, Gates{false, std::nullopt, 8, gate});  // with drops: the shared expert still runs
    }
}

TEST_CASE("MoE shared expert: backward matches finite differences (its MLP, its gate, the input)", "[moe][gradcheck]") {
  for (bool swiglu : {false, true})
    for (bool gate : {false, true}) {
      INFO("swiglu " << swiglu << " gate " << gate);
      check_backward(swiglu, 2, std::nullopt, 1.0f, Gates{true, std::nullopt, 24, gate});
      check_backward(swiglu, 2, std::nullopt, 1.0f, Gates{false, 2.5, 8, gate});
    }
}

TEST_CASE("MoE degenerate router: every token to one expert, the capacity keeps exactly the first tokens", "[moe]") {
  for (int64_t K : {1, 2}) {
    LayerHarness t(false, K, 1.0);
    const BlockParams& p = t.layout.blocks[0];
    for (int64_t i = 0; i < t.cfg.moe.num_experts * t.C; ++i) t.w[p.router_w + i] = 0.0f;  // equal logits
    t.moe->forward(0, WeightView(t.w.data(), nullptr, sizeof(t.w[0])), t.h.data(), t.res.data(), t.out.data(), 1.0f);
    const Reference r = reference(t.cfg, t.layout, t.w, t.h, t.res, t.N);
    tetra_test::expect_close(t.out, r.out, {2e-5, 2e-5}, "degenerate router output");
    // Ties go to the lowest experts: top-1 sends all 12 tokens to expert 0, top-2 to 0 and 1.
    // Capacity ceil(1.0 * 12 K / 4) = 3K: tokens 0..3K-1 kept by each chosen expert.
    const int64_t cap = 3 * K;
    const MoeStepStats st = t.moe->take_stats();
    CHECK(st.layers[0].tokens_per_expert[0] == t.N);
    CHECK(st.layers[0].dropped == K * (t.N - cap));
    for (int64_t i = 0; i < t.N; ++i) {
      bool same = true;  // a dropped token's output is its residual, bit for bit
      for (int64_t c = 0; c < t.C; ++c) same = same && t.out[i * t.C + c] == t.res[i * t.C + c];
      INFO("token " << i);
      CHECK(same == (i >= cap));
    }
    // Uniform probabilities: aux = E / (N^2 K) * sum_e routed_e * N / E = 1 exactly.
    CHECK(st.layers[0].aux_loss == Approx(1.0).epsilon(1e-6));
  }
}

TEST_CASE("MoE layer in bf16 follows the fp32 reference within bf16 rounding", "[moe]") {
  for (const Gates gates : {Gates{}, Gates{true, std::nullopt, 24, true}}) {
    INFO("shared expert " << gates.shared);
    LayerHarness t(true, 2, 1.0, DType::BF16, gates);
    // Round inputs and weights to bf16 so both see the same values.
    auto round = [](std::vector<float>& v) {
      for (float& x : v) x = static_cast<float>(bf16(x));
    };
    round(t.w), round(t.h), round(t.res);
    std::vector<bf16> w(t.w.size()), h(t.h.size()), res(t.res.size()), out(t.out.size());
    for (size_t i = 0; i < w.size(); ++i) w[i] = bf16(t.w[i]);
    for (size_t i = 0; i < h.size(); ++i) h[i] = bf16(t.h[i]), res[i] = bf16(t.res[i]);
    t.moe->forward(0, WeightView(w.data(), nullptr, sizeof(w[0])), h.data(), res.data(), out.data(), 1.0f);
    const Reference r = reference(t.cfg, t.layout, t.w, t.h, t.res, t.N);
    std::vector<float> got(out.size());
    for (size_t i = 0; i < out.size(); ++i) got[i] = static_cast<float>(out[i]);
    // bf16 rounding (2^-9 relative) of u, a, y and the output, on values O(1): ~1e-2 absolute.
    tetra_test::expect_close(got, r.out, {3e-2, 2e-2}, "bf16 MoE output");
    // Backward runs and gives finite values of the fp32 gradients' magnitude.
    std::vector<bf16> dout(out.size(), bf16(0.1f)), dh(out.size());
    std::vector<float> grads(t.layout.total, 0.0f);
    t.moe->backward(0, WeightView(w.data(), nullptr, sizeof(w[0])), grads.data(), h.data(), dout.data(), dh.data());
    double n2 = 0;
    for (float g : grads) n2 += static_cast<double>(g) * g;
    CHECK(std::isfinite(n2));
    CHECK(n2 > 0);
  }
}

TEST_CASE("MoE model (every other block): Gpt backward matches finite differences of loss + aux + z", "[moe][gradcheck]") {
  ModelConfig m = moe_config(false, 2, std::nullopt);
  m.num_layers = 2;
  m.moe.every = 2;  // block 0 MoE, block 1 dense
  m.moe.shared_expert_ffn_hidden_size = 8;  // with a gated shared expert (Qwen2-MoE)
  m.moe.shared_expert_gate = true;
  const ParamLayout L = ParamLayout::build(m);
  REQUIRE(L.blocks[0].moe);
  REQUIRE(!L.blocks[1].moe);
  REQUIRE(L.find("layers.0.mlp.experts.fc.weight")->shape == std::vector<int64_t>{4, 8, 16});
  REQUIRE(L.find("layers.0.mlp.shared_expert.fc.weight")->shape == std::vector<int64_t>{8, 16});
  REQUIRE(L.find("layers.0.mlp.shared_expert.proj.weight")->shape == std::vector<int64_t>{16, 8});
  REQUIRE(L.find("layers.0.mlp.shared_expert_gate.weight")->shape == std::vector<int64_t>{1, 16});
  REQUIRE(!L.find("layers.1.mlp.shared_expert.fc.weight"));
  REQUIRE(L.find("layers.1.mlp.fc.weight"));
  auto be = make_cpu_backend(1);
  const int64_t B = 2, N = B * m.seq_len;
  Gpt model(m, L, *be, DType::F32, B);
  std::vector<float> w(L.total);
  init_params(L, m, 42, w.data());
  std::vector<int32_t> tok(N), tgt(N);
  for (int64_t i = 0; i < N; ++i) tok[i] = (i * 7 + 3) % m.vocab_size, tgt[i] = (i * 11 + 5) % m.vocab_size;
  std::vector<float> losses(N);
  const float scale = 1.0f / static_cast<float>(N);
  auto loss = [&]() {
    model.forward(w.data(), tok.data(), tgt.data(), losses.data(), scale);
    double s = 0;
    for (float l : losses) s += l;
    return s / N + model.take_moe_stats().objective(m.moe);
  };
  loss();
  std::vector<float> g(L.total, 0.0f);
  model.backward(w.data(), g.data(), tok.data());
  model.take_moe_stats();
  std::mt19937 rng(2);
  const float step = 1e-3f;
  // As the layer test: fp32 loss ~3.4, rounding ~1e-7 * 3.4 / 1e-3 ~ 4e-4 per difference.
  for (const ParamSpec& p : L.params) {
    if (p.name.find("layers.0.") != 0) continue;
    double err2 = 0, ref2 = 0;
    std::uniform_int_distribution<int64_t> pick(0, p.numel - 1);
    for (int k = 0; k < 6; ++k) {
      const int64_t i = p.offset + pick(rng);
      const float saved = w[i];
      w[i] = saved + step;
      const double up = loss();
      w[i] = saved - step;
      const double down = loss();
      w[i] = saved;
      const double fd = (up - down) / (2.0 * step);
      err2 += (fd - g[i]) * (fd - g[i]);
      ref2 += fd * fd;
    }
    INFO(p.name << ": |fd - backward| = " << std::sqrt(err2) << ", |fd| = " << std::sqrt(ref2));
    CHECK(std::sqrt(err2) <= 0.03 * std::sqrt(ref2) + 1e-3);
  }
}
