// Which Hugging Face family a model exports as (trainer/checkpoint/hf_export.h): the dense and the
// Mixture-of-Experts families, and a refusal naming every key that no family holds.
#include <catch2/catch.hpp>

#include <string>

#include "kernels/common/check.h"
#include "trainer/checkpoint/hf_export.h"
#include "trainer/config/config.h"

using namespace tetra;

namespace {

ModelConfig llama() {
  ModelConfig m;
  m.norm = Norm::RMSNORM;
  m.activation = Activation::SWIGLU;
  m.position = Position::ROPE;
  m.bias = false;
  return m;
}

ModelConfig with_experts(ModelConfig m) {
  m.moe.num_experts = 8;
  m.moe.top_k = 2;
  m.moe.ffn_hidden_size = 64;
  m.moe.router_pre_softmax = false;
  return m;
}

std::string refusal(const ModelConfig& m) {
  try {
    hf_architecture(m);
  } catch (const InputError& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("hf export: a Llama-style model with experts is Mixtral, with q/k norms Qwen3-MoE", "[hf]") {
  CHECK(hf_architecture(llama()) == HfArch::LLAMA);
  CHECK(hf_architecture(with_experts(llama())) == HfArch::MIXTRAL);
  CHECK(std::string(hf_model_type(HfArch::MIXTRAL)) == "mixtral");
  ModelConfig q = with_experts(llama());
  q.qk_norm = true;
  CHECK(hf_architecture(q) == HfArch::QWEN3_MOE);
  q.moe.router_pre_softmax = true;  // Qwen3-MoE's norm_topk_prob false
  CHECK(hf_architecture(q) == HfArch::QWEN3_MOE);
  const nlohmann::ordered_json c = hf_config(q, HfArch::QWEN3_MOE, DType::BF16);
  CHECK(c["model_type"] == "qwen3_moe");
  CHECK(c["norm_topk_prob"] == false);
  CHECK(c["num_experts"] == 8);
  CHECK(c["moe_intermediate_size"] == 64);
  const nlohmann::ordered_json x = hf_config(with_experts(llama()), HfArch::MIXTRAL, DType::BF16);
  CHECK(x["architectures"][0] == "MixtralForCausalLM");
  CHECK(x["intermediate_size"] == 64);  // Mixtral's intermediate_size is its experts'
  CHECK(x["num_local_experts"] == 8);
}

TEST_CASE("hf export: MoE layouts no family holds are refused, naming each key", "[hf]") {
  ModelConfig m = with_experts(llama());
  m.moe.router_pre_softmax = true;  // Mixtral always renormalises
  CHECK(refusal(m).find("model.moe.router_pre_softmax true") != std::string::npos);
  m = with_experts(llama());
  m.moe.every = 2;
  CHECK(refusal(m).find("model.moe.every 2") != std::string::npos);
  m = with_experts(llama());
  m.moe.first_k_dense_replace = 1;
  CHECK(refusal(m).find("first_k_dense_replace 1") != std::string::npos);
  m = with_experts(llama());
  m.moe.router_topk_scaling_factor = 2.5;
  CHECK(refusal(m).find("router_topk_scaling_factor 2.5") != std::string::npos);
  m = with_experts(llama());
  m.qkv_bias = true;
  CHECK(refusal(m).find("model.qkv_bias true with experts but no gated shared expert") != std::string::npos);
  m.moe.shared_expert_ffn_hidden_size = 32;  // Qwen2-MoE: q/k/v biases and a gated shared expert
  m.moe.shared_expert_gate = true;
  CHECK(hf_architecture(m) == HfArch::QWEN2_MOE);
  CHECK(hf_config(m, HfArch::QWEN2_MOE, DType::F32)["shared_expert_intermediate_size"] == 32);
  m.qkv_bias = false;
  CHECK(refusal(m).find("shared_expert_ffn_hidden_size 32 without model.qkv_bias") != std::string::npos);
  m = with_experts(llama());
  m.moe.router_score_function = RouterScore::SIGMOID;
  CHECK(refusal(m).find("router_score_function \"sigmoid\"") != std::string::npos);
  ModelConfig g = with_experts(ModelConfig{});  // GPT-2's layout
  CHECK(refusal(g).find("with GPT-2's layout") != std::string::npos);
}
