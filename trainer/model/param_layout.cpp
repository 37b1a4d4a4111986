#include "trainer/model/param_layout.h"

#include <cmath>

#include <fmt/format.h>

#include "kernels/common/math.h"

namespace tetra {

namespace {

constexpr int64_t kAlign = 16;

struct LayoutBuilder {
  ParamLayout& layout;
  int64_t add(std::string name, std::vector<int64_t> shape, ParamInit init, bool decay, bool matmul) {
    ParamSpec p;
    p.name = std::move(name);
    p.shape = std::move(shape);
    p.numel = 1;
    for (int64_t d : p.shape) p.numel *= d;
    p.offset = layout.total;
    p.init = init;
    p.weight_decay = decay;
    p.matmul = matmul;
    layout.total += (p.numel + kAlign - 1) / kAlign * kAlign;
    layout.params.push_back(std::move(p));
    return layout.params.back().offset;
  }
  int64_t weight(std::string name, std::vector<int64_t> shape, ParamInit init = ParamInit::NORMAL) {
    return add(std::move(name), std::move(shape), init, /*decay=*/true, /*matmul=*/true);
  }
  int64_t bias(std::string name, int64_t n) {
    return add(std::move(name), {n}, ParamInit::ZEROS, false, false);
  }
};

}  // namespace

ParamLayout ParamLayout::build(const ModelConfig& m) {
  ParamLayout layout;
  LayoutBuilder b{layout};
  const int64_t C = m.hidden_size, V = m.vocab_size, HS = m.head_size();
  const int64_t qkv_rows = (m.num_heads + 2 * m.num_kv_heads) * HS;
  const int64_t F = m.ffn_hidden_size;
  const int64_t fc_rows = m.activation == "swiglu" ? 2 * F : F;
  const bool layernorm = m.norm == "layernorm";
  const bool norm_bias = layernorm && m.bias;

  // The token embedding is a matmul parameter only when tied (it is then the output projection).
  layout.wte = b.add("embedding.wte", {V, C}, ParamInit::NORMAL, true, m.tie_embeddings);
  if (m.position == "learned")
    layout.wpe = b.add("embedding.wpe", {m.seq_len, C}, ParamInit::NORMAL, false, false);
  for (int64_t i = 0; i < m.num_layers; ++i) {
    BlockParams bp;
    const std::string p = fmt::format("layers.{}.", i);
    bp.norm1_w = b.add(p + "norm1.weight", {C}, ParamInit::ONES, false, false);
    if (norm_bias) bp.norm1_b = b.bias(p + "norm1.bias", C);
    bp.qkv_w = b.weight(p + "attn.qkv.weight", {qkv_rows, C});
    if (m.bias) bp.qkv_b = b.bias(p + "attn.qkv.bias", qkv_rows);
    bp.attn_proj_w = b.weight(p + "attn.proj.weight", {C, m.num_heads * HS}, ParamInit::NORMAL_SCALED);
    if (m.bias) bp.attn_proj_b = b.bias(p + "attn.proj.bias", C);
    bp.norm2_w = b.add(p + "norm2.weight", {C}, ParamInit::ONES, false, false);
    if (norm_bias) bp.norm2_b = b.bias(p + "norm2.bias", C);
    bp.fc_w = b.weight(p + "mlp.fc.weight", {fc_rows, C});
    if (m.bias) bp.fc_b = b.bias(p + "mlp.fc.bias", fc_rows);
    bp.mlp_proj_w = b.weight(p + "mlp.proj.weight", {C, F}, ParamInit::NORMAL_SCALED);
    if (m.bias) bp.mlp_proj_b = b.bias(p + "mlp.proj.bias", C);
    layout.blocks.push_back(bp);
  }
  layout.final_norm_w = b.add("final_norm.weight", {C}, ParamInit::ONES, false, false);
  if (norm_bias) layout.final_norm_b = b.bias("final_norm.bias", C);
  if (!m.tie_embeddings) layout.lm_head = b.weight("lm_head.weight", {V, C});
  return layout;
}

int64_t ParamLayout::count() const {
  int64_t n = 0;
  for (const ParamSpec& p : params) n += p.numel;
  return n;
}

int64_t ParamLayout::matmul_count() const {
  int64_t n = 0;
  for (const ParamSpec& p : params)
    if (p.matmul) n += p.numel;
  return n;
}

void init_params(const ParamLayout& layout, const ModelConfig& m, uint64_t seed, float* master) {
  const float std = static_cast<float>(m.init_std);
  // GPT-2 / Megatron: output projections of residual branches scaled by 1/sqrt(2 L).
  const float scaled_std = std / std::sqrt(2.0f * static_cast<float>(m.num_layers));
  for (int64_t i = 0; i < layout.total; ++i) master[i] = 0.0f;
  for (const ParamSpec& p : layout.params) {
    float* w = master + p.offset;
    const uint64_t stream = math::fnv1a64(p.name.c_str());
    switch (p.init) {
      case ParamInit::ZEROS: break;
      case ParamInit::ONES:
        for (int64_t n = 0; n < p.numel; ++n) w[n] = 1.0f;
        break;
      case ParamInit::NORMAL:
      case ParamInit::NORMAL_SCALED: {
        const float s = p.init == ParamInit::NORMAL ? std : scaled_std;
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < p.numel; ++n)
          w[n] = s * math::philox_normal(seed, stream, static_cast<uint64_t>(n));
        break;
      }
    }
  }
}

}  // namespace tetra
