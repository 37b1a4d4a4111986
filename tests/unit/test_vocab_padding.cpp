// Vocabulary padding (model.make_vocab_size_divisible_by): the layout of the padded embedding and
// output layer over tp ranks, the config rule that refuses a rank holding padding alone, and the
// model's promise that padding rows never reach a logit, a loss, a gradient or a sample, checked
// by filling them with values that would dominate every row if they did.
#include <catch2/catch.hpp>

#include <algorithm>
#include <vector>

#include "kernels/backend.h"
#include "tests/unit/config_testing.h"
#include "trainer/checkpoint/sharding.h"
#include "trainer/model/gpt.h"
#include "trainer/model/sampler.h"
#include "trainer/params/param_layout.h"

using namespace tetra;

namespace {

ModelConfig tiny(int64_t vocab, int64_t divisible_by) {
  ModelConfig m;
  m.vocab_size = vocab;
  m.make_vocab_size_divisible_by = divisible_by;
  m.seq_len = 6;
  m.num_layers = 2;
  m.hidden_size = 16;
  m.num_heads = 4;
  m.num_kv_heads = 4;
  m.ffn_hidden_size = 64;
  m.init_std = 0.5;
  return m;
}

}  // namespace

TEST_CASE("vocab padding: padded sizes are Megatron's, the last rank holds the padding", "[vocab]") {
  ModelConfig m = tiny(50257, 128);
  CHECK(m.padded_vocab_size(1) == 50304);
  CHECK(m.padded_vocab_size(2) == 50432);
  CHECK(m.padded_vocab_size(8) == 51200);
  m.vocab_size = 128256;  // Llama 3: a multiple of 128 and of 256, not of 1024
  CHECK(m.padded_vocab_size(1) == 128256);
  CHECK(m.padded_vocab_size(2) == 128256);
  CHECK(m.padded_vocab_size(8) == 129024);
  // Rows per rank: full ones, then the rest on the last rank.
  m = tiny(29, 8);  // padded to 32 on tp 2 (16 per rank) and on tp 4 (8 per rank)
  CHECK(m.vocab_rows(2, 0) == 16);
  CHECK(m.vocab_rows(2, 1) == 13);
  CHECK(m.vocab_rows(4, 2) == 8);
  CHECK(m.vocab_rows(4, 3) == 5);
}

TEST_CASE("vocab padding: the layout holds padding rows outside the global tensor, zero from init", "[vocab]") {
  const ModelConfig m = tiny(29, 8);
  for (int64_t tp : {1, 2, 4}) {
    int64_t real_rows = 0;
    for (int64_t r = 0; r < tp; ++r) {
      INFO("tp " << tp << " rank " << r);
      TensorSlicing s;
      s.tp = tp;
      s.tp_rank = r;
      const ParamLayout layout = ParamLayout::build(m, s);
      const ParamSpec& wte = *layout.find("embedding.wte");
      const int64_t Vl = m.padded_vocab_size(tp) / tp, Vr = m.vocab_rows(tp, r);
      CHECK(wte.global_shape == std::vector<int64_t>{29, 16});
      CHECK(wte.shape == std::vector<int64_t>{Vl, 16});
      CHECK(wte.pad_rows == Vl - Vr);
      CHECK(wte.held() == Vr * 16);
      CHECK(wte.global_index(0) == r * Vl * 16);
      CHECK(wte.global_index(wte.held() - 1) == (r * Vl + Vr) * 16 - 1);
      // The checkpoint's slices cover the real rows alone, whatever range is asked for.
      int64_t sliced = 0;
      for (const SliceRegion& sl : slices_of(wte, 0, wte.numel)) sliced += sl.numel();
      CHECK(sliced == wte.held());
      // Initialised like the unpadded tensor's rows; the padding zero.
      std::vector<float> w(static_cast<size_t>(layout.total), -1.0f);
      init_params(layout, m, 3, w.data());
      int64_t nonzero_padding = 0;
      for (int64_t i = wte.held(); i < wte.numel; ++i) nonzero_padding += w[static_cast<size_t>(wte.offset + i)] != 0.0f;
      CHECK(nonzero_padding == 0);
      const ParamLayout whole = ParamLayout::build(tiny(29, 1));
      std::vector<float> ref(static_cast<size_t>(whole.total));
      init_params(whole, tiny(29, 1), 3, ref.data());
      const ParamSpec& ref_wte = *whole.find("embedding.wte");
      int64_t differ = 0;
      for (int64_t i = 0; i < wte.held(); ++i)
        differ += w[static_cast<size_t>(wte.offset + i)] != ref[static_cast<size_t>(ref_wte.offset + wte.global_index(i))];
      CHECK(differ == 0);
      // Parameter counts are of the real model.
      if (tp == 1) CHECK(layout.count() == whole.count());
      real_rows += Vr;
    }
    CHECK(real_rows == 29);
  }
  // A rank with nothing but padding is refused by the layout (the config rule reports it first).
  TensorSlicing s;
  s.tp = 2;
  s.tp_rank = 1;
  CHECK_THROWS_WITH(ParamLayout::build(tiny(64, 128), s), Catch::Contains("only vocabulary padding"));
}

TEST_CASE("vocab padding: the config refuses a layout that leaves a tp rank only padding", "[vocab][config]") {
  using namespace tetra::config_testing;
  json j = with(with(base(), "model.vocab_size", 64), "parallel.tp", 2);
  j = with(j, "model.num_heads", 4);
  j = with(j, "model.hidden_size", 64);
  // 64 padded to 256 for tp 2 (128 per rank): rank 1 would hold none of the 64 real rows.
  require_one(j, "model.make_vocab_size_divisible_by: 128: ", "leaves tp rank 1 nothing but padding");
  require_one(j, "model.make_vocab_size_divisible_by: 128: ", "at most 32");
  CHECK(problems_of(with(j, "model.make_vocab_size_divisible_by", 32)).empty());
  CHECK(problems_of(with(j, "model.make_vocab_size_divisible_by", 1)).empty());
  require_one(with(j, "model.make_vocab_size_divisible_by", 0), "model.make_vocab_size_divisible_by: 0: ",
              "must be >= 1");
  // A vocabulary no padding can spread over tp: 3 ids on tp 4.
  json small = with(with(j, "model.vocab_size", 3), "parallel.tp", 4);
  require_one(small, "model.make_vocab_size_divisible_by: 128: ", "model.vocab_size 3 is too small for parallel.tp 4");
  // A vocabulary that tp does not divide is padded, not refused.
  CHECK(problems_of(with(j, "model.vocab_size", 50257)).empty());
}

TEST_CASE("vocab padding: padding rows reach no logit, loss, gradient or sample", "[vocab][sampler]") {
  const ModelConfig cfg = tiny(29, 128);  // 29 real rows of 128 (tied embedding: wte is the output layer)
  const ParamLayout layout = ParamLayout::build(cfg);
  const ParamSpec& wte = *layout.find("embedding.wte");
  REQUIRE(wte.pad_rows == 99);
  std::unique_ptr<Backend> be = make_cpu_backend(1);
  const int64_t B = 2, T = cfg.seq_len, V = cfg.vocab_size, N = B * T;
  std::vector<float> clean(static_cast<size_t>(layout.total));
  init_params(layout, cfg, 5, clean.data());
  // Padding that would win every softmax, every argmax and every draw if it were read.
  std::vector<float> dirty = clean;
  for (int64_t i = wte.held(); i < wte.numel; ++i) dirty[static_cast<size_t>(wte.offset + i)] = 50.0f;
  std::vector<int32_t> tokens(N), targets(N);
  for (int64_t i = 0; i < N; ++i) {
    tokens[i] = static_cast<int32_t>((i * 7 + 3) % V);
    targets[i] = static_cast<int32_t>((i * 11 + 1) % V);
  }
  for (int64_t loss_chunk : {int64_t{0}, int64_t{5}}) {
    INFO("loss_chunk " << loss_chunk);
    auto run = [&](const std::vector<float>& w, std::vector<float>& losses, std::vector<float>& grads) {
      Gpt model(cfg, layout, *be, DType::F32, B, nullptr, 0, 1, nullptr, {}, loss_chunk);
      losses.assign(N, 0.0f);
      grads.assign(static_cast<size_t>(layout.total), 0.0f);
      model.forward(w.data(), 0, tokens.data(), targets.data(), losses.data(), 1.0f / N, grads.data());
      model.backward(w.data(), grads.data(), tokens.data());
    };
    std::vector<float> l0, g0, l1, g1;
    run(clean, l0, g0);
    run(dirty, l1, g1);
    CHECK(l0 == l1);  // bitwise: the padding is not in the softmax
    CHECK(g0 == g1);  // and receives no gradient (its rows stay zero)
    int64_t padding_grads = 0;
    for (int64_t i = wte.held(); i < wte.numel; ++i) padding_grads += g1[static_cast<size_t>(wte.offset + i)] != 0.0f;
    CHECK(padding_grads == 0);
  }
  // Inference: the logits are the V real columns; sampling over the whole vocabulary at a high
  // temperature never draws a padded id.
  Gpt model(cfg, layout, *be, DType::F32, 1);
  CHECK(model.dims().V == V);
  CHECK(model.dims().Vl == 128);
  Sampler sampler(model, *be, nullptr);
  SampleConfig s;
  s.max_tokens = 200;
  s.temperature = 2.0;
  s.top_k = 0;
  s.seed = 9;
  const std::vector<int32_t> context{4, 2};
  const std::vector<int32_t> ids = sampler.generate(dirty.data(), context, s, -1, V);
  REQUIRE(ids.size() == 200);
  CHECK(*std::max_element(ids.begin(), ids.end()) < V);
  CHECK(ids == sampler.generate(clean.data(), context, s, -1, V));
}
