// Parameter layout and initialisation, learning-rate schedule, clipping, safetensors round trip.
#include <catch2/catch.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <numbers>

#include "trainer/checkpoint/safetensors.h"
#include "trainer/config/config.h"
#include "trainer/model/flops.h"
#include "trainer/params/param_layout.h"
#include "trainer/optim/adamw.h"
#include "trainer/optim/lr_schedule.h"

using namespace tetra;

namespace {

ModelConfig gpt2_124m() {
  ModelConfig m;
  m.vocab_size = 50257;
  m.seq_len = 1024;
  m.num_layers = 12;
  m.hidden_size = 768;
  m.num_heads = 12;
  m.num_kv_heads = 12;
  m.ffn_hidden_size = 3072;
  return m;
}

}  // namespace

TEST_CASE("GPT-2 124M has the published parameter count", "[model]") {
  // 124,439,808: the count of Hugging Face's gpt2 checkpoint (wte, wpe, 12 blocks, ln_f; tied head).
  const ParamLayout layout = ParamLayout::build(gpt2_124m());
  CHECK(layout.count() == 124439808);
  // Matmul parameters: 12 blocks x (qkv 768x2304 + proj 768x768 + fc 768x3072 + proj 3072x768)
  // plus the tied output projection (50257 x 768).
  CHECK(layout.matmul_count() == 12 * (768 * 2304 + 768 * 768 + 2 * 768 * 3072) + 50257 * 768);
  // Offsets are aligned and non-overlapping.
  int64_t end = 0;
  for (const ParamSpec& p : layout.params) {
    CHECK(p.offset % 16 == 0);
    CHECK(p.offset >= end);
    end = p.offset + p.numel;
  }
  CHECK(end <= layout.total);
}

TEST_CASE("Llama-style layout: GQA qkv rows, swiglu fc rows, untied head, no biases", "[model]") {
  ModelConfig m = gpt2_124m();
  m.vocab_size = 1000;
  m.num_layers = 2;
  m.hidden_size = 64;
  m.num_heads = 8;
  m.num_kv_heads = 2;
  m.ffn_hidden_size = 96;
  m.norm = Norm::RMSNORM;
  m.activation = Activation::SWIGLU;
  m.position = Position::ROPE;
  m.tie_embeddings = false;
  m.bias = false;
  const ParamLayout layout = ParamLayout::build(m);
  CHECK(layout.wpe == -1);
  CHECK(layout.lm_head >= 0);
  CHECK(layout.blocks[0].qkv_b == -1);
  CHECK(layout.blocks[0].norm1_b == -1);
  const int64_t HS = 8;
  int64_t expected = 1000 * 64 /*wte*/ + 64 /*final norm*/ + 1000 * 64 /*lm_head*/;
  expected += 2 * (64 + (8 + 2 * 2) * HS * 64 + 64 * 64 + 64 + 2 * 96 * 64 + 64 * 96);
  CHECK(layout.count() == expected);
  for (const ParamSpec& p : layout.params) {
    if (p.name == "layers.1.attn.qkv.weight") CHECK(p.shape == std::vector<int64_t>{96, 64});
    if (p.name == "layers.1.mlp.fc.weight") CHECK(p.shape == std::vector<int64_t>{192, 64});
    // Weight decay exactly on 2-D weights other than position embeddings.
    CHECK(p.weight_decay == (p.shape.size() == 2 && p.name != "embedding.wpe"));
  }
}

TEST_CASE("initialisation is deterministic, seed-dependent and has the configured statistics", "[model]") {
  ModelConfig m = gpt2_124m();
  m.vocab_size = 512;
  m.num_layers = 4;
  m.hidden_size = 128;
  m.num_heads = 4;
  m.ffn_hidden_size = 512;
  m.seq_len = 64;
  const ParamLayout layout = ParamLayout::build(m);
  std::vector<float> a(layout.total), b(layout.total), c(layout.total);
  init_params(layout, m, 7, a.data());
  init_params(layout, m, 7, b.data());
  init_params(layout, m, 8, c.data());
  CHECK(a == b);
  CHECK(a != c);
  for (const ParamSpec& p : layout.params) {
    double s = 0, s2 = 0;
    for (int64_t i = 0; i < p.numel; ++i) {
      s += a[p.offset + i];
      s2 += double(a[p.offset + i]) * a[p.offset + i];
    }
    const double mean = s / p.numel, sd = std::sqrt(s2 / p.numel - mean * mean);
    INFO(p.name);
    switch (p.init) {
      case ParamInit::ZEROS: CHECK(s2 == 0.0); break;
      case ParamInit::ONES: CHECK(mean == 1.0); break;
      case ParamInit::NORMAL:
        // >= 16K samples: the sample sd is within ~1% of the true one (4 sigma < 3%).
        CHECK(sd == Approx(0.02).epsilon(0.03));
        CHECK(std::abs(mean) < 0.02 * 4 / std::sqrt(double(p.numel)) + 1e-9);
        break;
      case ParamInit::NORMAL_SCALED:
        CHECK(sd == Approx(0.02 / std::sqrt(8.0)).epsilon(0.03));
        break;
    }
  }
  // Two parameters of the same shape get different values (streams keyed by name).
  const ParamSpec *q0 = nullptr, *q1 = nullptr;
  for (const ParamSpec& p : layout.params) {
    if (p.name == "layers.0.attn.qkv.weight") q0 = &p;
    if (p.name == "layers.1.attn.qkv.weight") q1 = &p;
  }
  REQUIRE(q0 != nullptr);
  REQUIRE(q1 != nullptr);
  CHECK(a[q0->offset] != a[q1->offset]);
}

TEST_CASE("learning-rate schedule: warm-up then cosine / linear / constant", "[optim]") {
  OptimizerConfig o;
  o.lr = 1.0;
  o.min_lr = 0.1;
  o.warmup_steps = 4;
  o.decay = LrDecay::COSINE;
  CHECK(learning_rate(o, 14, 0) == Approx(0.25));
  CHECK(learning_rate(o, 14, 3) == Approx(1.0));
  CHECK(learning_rate(o, 14, 4) == Approx(1.0));                        // decay starts at 1
  CHECK(learning_rate(o, 14, 9) == Approx(0.1 + 0.45 * (1 + std::cos(std::numbers::pi * 0.5))));
  CHECK(learning_rate(o, 14, 14) == Approx(0.1));                       // reaches min_lr
  CHECK(learning_rate(o, 14, 100) == Approx(0.1));                      // and stays there
  o.decay = LrDecay::LINEAR;
  CHECK(learning_rate(o, 14, 9) == Approx(1.0 - 0.9 * 0.5));
  o.decay = LrDecay::CONSTANT;
  CHECK(learning_rate(o, 14, 9) == Approx(1.0));
  o.decay = LrDecay::COSINE;
  o.decay_steps = 2;
  CHECK(learning_rate(o, 14, 5) == Approx(0.1 + 0.45 * (1 + std::cos(std::numbers::pi * 0.5))));
  CHECK(learning_rate(o, 14, 7) == Approx(0.1));
}

TEST_CASE("clip factor follows torch.nn.utils.clip_grad_norm_", "[optim]") {
  CHECK(clip_factor(0.5, 1.0) == 1.0f);
  CHECK(clip_factor(4.0, 1.0) == Approx(1.0 / (4.0 + 1e-6)));
  CHECK(clip_factor(4.0, 0.0) == 1.0f);  // clipping off
}

TEST_CASE("safetensors: write then read returns the same tensors, bad files are input errors", "[checkpoint]") {
  const std::string dir = (std::filesystem::path(TETRA_TEST_TMPDIR) / "safetensors").string();
  std::filesystem::create_directories(dir);
  std::vector<TensorRecord> in(2);
  in[0].name = "layer.weight";
  in[0].shape = {2, 3};
  in[0].data.resize(24);
  for (size_t i = 0; i < 24; ++i) in[0].data[i] = static_cast<uint8_t>(i * 7);
  in[1].name = "tokens";
  in[1].dtype = DType::I32;
  in[1].shape = {5};
  in[1].data.resize(20, 3);
  write_safetensors(dir + "/x.safetensors", in, {{"format", "pt"}});
  CHECK_FALSE(std::filesystem::exists(dir + "/x.safetensors.tmp"));
  const auto out = read_safetensors(dir + "/x.safetensors");
  REQUIRE(out.size() == 2);
  for (size_t i = 0; i < 2; ++i) {
    CHECK(out[i].name == in[i].name);
    CHECK(out[i].dtype == in[i].dtype);
    CHECK(out[i].shape == in[i].shape);
    CHECK(out[i].data == in[i].data);
  }
  // The header length is 8-byte aligned as the format recommends.
  CHECK((std::filesystem::file_size(dir + "/x.safetensors") - 24 - 20) % 8 == 0);
  { std::ofstream(dir + "/bad.safetensors") << "not a safetensors file"; }
  CHECK_THROWS_AS(read_safetensors(dir + "/bad.safetensors"), InputError);
  CHECK_THROWS_AS(read_safetensors(dir + "/missing.safetensors"), InputError);
}
