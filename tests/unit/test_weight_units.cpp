// ZeRO-3's weight units: the two-buffer rule and its prefetch, counted by hand on short phase
// sequences, and a real WeightUnits over a single-rank communicator gathering what was required.
#include <catch2/catch.hpp>

#include <vector>

#include "kernels/backend.h"
#include "trainer/comm/self_communicator.h"
#include "trainer/optim/weight_units.h"

using namespace tetra;

TEST_CASE("weight units: the gathers of a step's phases, prefetch included", "[optim]") {
  // Groups 0 embedding, 1 and 2 blocks, 3 head; untied. One micro-batch: forward e b0 b1 h,
  // backward h b1 b0. By hand: e is gathered, b0 prefetched beside it; during b0, b1 replaces e;
  // during b1, h replaces b0; the head's forward and backward share h; b1 is still resident for
  // its backward, during which b0 replaces h: e 1, b0 2, b1 1, h 1.
  std::vector<std::vector<int>> step = {{0}, {1}, {2}, {3}, {3}, {2}, {1}};
  std::vector<int64_t> n(4, 0);
  WeightUnits::count_gathers(step, n);
  CHECK(n == std::vector<int64_t>{1, 2, 1, 1});
  // Tied: the head reads the embedding again (the blocks evicted it) beside itself, so both blocks
  // are out when the backward reaches them: e 2, b0 2, b1 2, h 1.
  std::vector<std::vector<int>> tied = {{0}, {1}, {2}, {3, 0}, {3, 0}, {2}, {1}};
  std::fill(n.begin(), n.end(), 0);
  WeightUnits::count_gathers(tied, n);
  CHECK(n == std::vector<int64_t>{2, 2, 2, 1});
  // Two micro-batches: the second forward starts where the first backward left (b0 resident).
  std::vector<std::vector<int>> two = step;
  two.insert(two.end(), step.begin(), step.end());
  std::fill(n.begin(), n.end(), 0);
  WeightUnits::count_gathers(two, n);
  CHECK(n == std::vector<int64_t>{2, 3, 2, 2});
  CHECK_THROWS_WITH(WeightUnits::count_gathers({{0, 1, 2}}, n), Catch::Contains("two are held at once"));
}

TEST_CASE("weight units: a required group reads its gathered weights, an unrequired one is refused", "[optim]") {
  ModelConfig m;
  m.vocab_size = 64;
  m.seq_len = 16;
  m.num_layers = 2;
  m.hidden_size = 32;
  m.num_heads = 4;
  m.num_kv_heads = 4;
  m.ffn_hidden_size = 64;
  const ParamLayout layout = ParamLayout::build(m);
  auto be = make_cpu_backend(1);
  std::unique_ptr<Communicator> dp = make_self_communicator("dp", 0);
  // dp 1: the shard is every group back to back, i.e. the buffer itself.
  std::vector<float> shard(static_cast<size_t>(layout.total));
  for (size_t i = 0; i < shard.size(); ++i) shard[i] = static_cast<float>(i);
  WeightUnits units(layout, *be, *dp, *dp, shard.data(), DType::F32);
  units.set_step_phases({{layout.embedding_group}, {layout.layer_group[0]}});
  units.release_all(/*step=*/true);
  units.require({layout.embedding_group});
  const int64_t wte = layout.wte;
  CHECK(*static_cast<const float*>(units.at(wte + 5)) == static_cast<float>(wte + 5));
  CHECK(units.gathers() == 2);  // the embedding's, and block 0's issued ahead of its phase
  // Block 0 was prefetched while the embedding "computed": resident once required.
  units.require({layout.layer_group[0]});
  const int64_t qkv = layout.blocks[0].qkv_w;
  CHECK(*static_cast<const float*>(units.at(qkv + 3)) == static_cast<float>(qkv + 3));
  CHECK(units.gathers() == 2);
  CHECK_THROWS_WITH(units.at(layout.blocks[1].qkv_w), Catch::Contains("without being required"));
  // Out of the planned order: refused (the model and the prediction must agree).
  units.release_all(/*step=*/true);
  CHECK_THROWS_WITH(units.require({layout.layer_group[1]}), Catch::Contains("not the planned one"));
}
