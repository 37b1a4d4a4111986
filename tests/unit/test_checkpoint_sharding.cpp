// Checkpoint slices (trainer/checkpoint/sharding.h): whatever layout writes a tensor (TP slices,
// DP shards of the distributed optimizer), every other layout reassembles exactly its own part.
// Each global element's value is its global index, so any misplaced element is caught. The
// vocabulary is padded differently on every tp: the padding is in no slice and loads as nothing.
// MoE models with a shared expert: the experts (over EP ranks too) and the shared expert's TP
// slices alike; with swiglu and biases each expert's fc bias is two column ranges a TP rank.
#include <catch2/catch.hpp>

#include <algorithm>
#include <vector>

#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/sharding.h"
#include "trainer/params/param_layout.h"

namespace {

using namespace tetra;

ModelConfig llama_like() {
  ModelConfig m;
  m.vocab_size = 61;  // padded to 64 rows on tp 1, 2 and 4: the last rank holds 3 padding rows
  m.make_vocab_size_divisible_by = 8;
  m.seq_len = 16;
  m.num_layers = 2;
  m.hidden_size = 32;
  m.num_heads = 8;
  m.num_kv_heads = 4;
  m.ffn_hidden_size = 48;
  m.norm = Norm::RMSNORM;
  m.activation = Activation::SWIGLU;
  m.position = Position::ROPE;
  m.tie_embeddings = false;
  m.bias = false;
  return m;
}

ModelConfig gpt2_like() {
  ModelConfig m = llama_like();
  m.num_kv_heads = 8;
  m.norm = Norm::LAYERNORM;
  m.activation = Activation::GELU;
  m.position = Position::LEARNED;
  m.tie_embeddings = true;
  m.bias = true;
  m.ffn_hidden_size = 128;
  return m;
}

// Mixture of Experts with a shared expert beside the routed ones (gated: Qwen2-MoE), every block.
ModelConfig with_shared_expert(ModelConfig m) {
  m.moe.num_experts = 4;
  m.moe.top_k = 2;
  m.moe.ffn_hidden_size = 16;
  m.moe.shared_expert_ffn_hidden_size = 24;
  m.moe.shared_expert_gate = true;
  return m;
}

struct Saved {
  SliceRegion region;
  std::vector<float> values;
};

// The slices one layout (tp, dp shards) writes of parameter `name`, as the checkpoint does: the
// DP shard of rank d is the d-th quarter... of each group, like GradBuffer's with one bucket per
// group.
std::vector<Saved> save(const ModelConfig& m, const std::string& name, int tp, int dp, int ep) {
  std::vector<Saved> out;
  for (int q = 0; q < ep; ++q)
  for (int t = 0; t < tp; ++t) {
    TensorSlicing sl;
    sl.tp = tp;
    sl.tp_rank = t;
    sl.ep = ep;
    sl.ep_rank = q;
    sl.group_align = 16 * dp;
    const ParamLayout layout = ParamLayout::build(m, sl);
    const ParamSpec& p = *layout.find(name);
    if ((!p.tp_split && t != 0) || (!p.ep_split && q != 0)) continue;  // replicas are written once
    const auto& g = layout.groups[static_cast<size_t>(p.group)];
    const int64_t shard = (g.second - g.first) / dp;
    for (int d = 0; d < dp; ++d) {
      const int64_t lo = std::max(g.first + d * shard, p.offset) - p.offset;
      const int64_t hi = std::min(g.first + (d + 1) * shard, p.offset + p.numel) - p.offset;
      if (lo >= hi) continue;
      int64_t local = lo;
      for (const SliceRegion& s : slices_of(p, lo, hi)) {
        Saved sv{s, {}};
        for (int64_t e = 0; e < s.numel(); ++e) sv.values.push_back(static_cast<float>(p.global_index(local + e)));
        out.push_back(std::move(sv));
        local += s.numel();
      }
    }
  }
  return out;
}

}  // namespace

TEST_CASE("checkpoint slices: every layout reassembles its part from every other layout's slices",
          "[checkpoint]") {
  ModelConfig biased_llama = llama_like();
  biased_llama.bias = true;
  for (const ModelConfig& m : {llama_like(), gpt2_like(), with_shared_expert(llama_like()), with_shared_expert(gpt2_like()),
                               with_shared_expert(biased_llama)}) {
    const ParamLayout whole = ParamLayout::build(m);
    const std::vector<int> eps = m.moe.enabled() ? std::vector<int>{1, 2} : std::vector<int>{1};
    for (const ParamSpec& spec : whole.params) {
      for (int save_tp : {1, 2, 4})
        for (int save_dp : {1, 2, 4})
        for (int save_ep : eps) {
          const std::vector<Saved> saved = save(m, spec.name, save_tp, save_dp, save_ep);
          // Each global element written exactly once.
          int64_t written = 0;
          for (const Saved& s : saved) written += s.region.numel();
          INFO(spec.name << " saved under tp " << save_tp << " dp " << save_dp << " ep " << save_ep);
          int64_t global = 1;
          for (int64_t d : spec.global_shape) global *= d;
          REQUIRE(written == global);
          for (int load_ep : eps)
          for (int q = 0; q < load_ep; ++q)
          for (int load_tp : {1, 2, 4})
            for (int t = 0; t < load_tp; ++t) {
              TensorSlicing sl;
              sl.tp = load_tp;
              sl.tp_rank = t;
              sl.ep = load_ep;
              sl.ep_rank = q;
              const ParamLayout layout = ParamLayout::build(m, sl);
              const ParamSpec& p = *layout.find(spec.name);
              std::vector<float> local(static_cast<size_t>(p.numel), -1.0f);
              std::vector<uint8_t> filled(static_cast<size_t>(p.numel), 0);
              int64_t overlaps = 0;
              for (const Saved& s : saved)
                if (may_intersect(p, s.region))
                  overlaps += scatter_slice(p, 0, p.numel, s.region, s.values.data(), local.data(), filled);
              CHECK(overlaps == 0);
              // A slice given twice overlaps itself: every element it holds is counted.
              for (const Saved& s : saved) {
                std::vector<uint8_t> once(static_cast<size_t>(p.numel), 0);
                std::vector<float> scratch(static_cast<size_t>(p.numel));
                CHECK(scatter_slice(p, 0, p.numel, s.region, s.values.data(), scratch.data(), once) == 0);
                const int64_t held = static_cast<int64_t>(std::count(once.begin(), once.end(), 1));
                CHECK(scatter_slice(p, 0, p.numel, s.region, s.values.data(), scratch.data(), once) == held);
              }
              int64_t wrong = 0, missing = 0, padding_filled = 0;
              for (int64_t i = 0; i < p.held(); ++i) {
                missing += !filled[static_cast<size_t>(i)];
                wrong += local[static_cast<size_t>(i)] != static_cast<float>(p.global_index(i));
              }
              for (int64_t i = p.held(); i < p.numel; ++i) padding_filled += filled[static_cast<size_t>(i)];
              CHECK(padding_filled == 0);
              INFO("loaded under tp " << load_tp << " rank " << t << ", ep " << load_ep << " rank " << q);
              CHECK(missing == 0);
              CHECK(wrong == 0);
              // local_index inverts global_index on what the rank holds.
              for (int64_t i = 0; i < p.held(); i += 7) CHECK(local_index(p, p.global_index(i)) == i);
            }
        }
    }
  }
}

TEST_CASE("checkpoint: crc32 is zlib's", "[checkpoint]") {
  CHECK(crc32("", 0) == 0u);
  CHECK(crc32("123456789", 9) == 0xCBF43926u);  // the standard check value of CRC-32/IEEE
  CHECK(crc32("The quick brown fox jumps over the lazy dog", 43) == 0x414FA339u);
  // Carried over pieces (a slice read in bounded pieces): every split point gives the whole's CRC,
  // including splits inside the 8-byte steps.
  const std::string text = "The quick brown fox jumps over the lazy dog";
  for (size_t cut = 0; cut <= text.size(); ++cut)
    CHECK(crc32_update(crc32(text.data(), cut), text.data() + cut, text.size() - cut) == 0x414FA339u);
  CHECK(crc32_update(crc32_update(crc32("1234", 4), "5", 1), "6789", 4) == 0xCBF43926u);
}
