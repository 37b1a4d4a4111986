#include "trainer/checkpoint/hf_import.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kernels/common/check.h"
#include "kernels/common/math.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/core/format.h"
#include "trainer/core/json_text.h"
#include "trainer/params/param_layout.h"

namespace tetra {

namespace fs = std::filesystem;
using json = nlohmann::json;

namespace {

// A JSON file of a Hugging Face model directory (config.json, the shard index): a regular file,
// strict JSON (json_text.h).
json read_hf_json(const std::string& path) {
  std::error_code ec;
  if (!fs::exists(path, ec))
    throw InputError(fmt::format("{}: cannot open (a Hugging Face model directory has config.json)", path));
  return read_json_file(path, "Hugging Face file", "give a Hugging Face model directory");
}

// Typed reads of config.json's keys, each error naming the file and the key.
struct HfConfig {
  std::string path;
  json j;

  bool has(const char* key) const { return j.contains(key) && !j[key].is_null(); }
  [[noreturn]] void bad(const std::string& key, const std::string& why) const {
    throw InputError(fmt::format("{}: {}: {}", path, key, why));
  }
  int64_t integer(const char* key, std::optional<int64_t> fallback = std::nullopt) const {
    if (!has(key)) {
      if (fallback) return *fallback;
      bad(key, "missing (a required integer)");
    }
    if (!j[key].is_number_integer() || j[key].get<int64_t>() < 0) bad(key, fmt::format("{} is not a size", j[key].dump()));
    return j[key].get<int64_t>();
  }
  double number(const json& obj, const std::string& where, const char* key, std::optional<double> fallback) const {
    if (!obj.contains(key) || obj[key].is_null()) {
      if (fallback) return *fallback;
      bad(where + key, "missing (a required number)");
    }
    if (!obj[key].is_number()) bad(where + key, fmt::format("{} is not a number", obj[key].dump()));
    return obj[key].get<double>();
  }
  double number(const char* key, std::optional<double> fallback = std::nullopt) const {
    return number(j, "", key, fallback);
  }
  bool boolean(const char* key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j[key].is_boolean()) bad(key, fmt::format("{} is not true or false", j[key].dump()));
    return j[key].get<bool>();
  }
  std::string string(const char* key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!j[key].is_string()) bad(key, fmt::format("{} is not a string", j[key].dump()));
    return j[key].get<std::string>();
  }
};

// One RoPE description, `rope_parameters` or `rope_scaling`, as the run config's model.rope_scaling
// (null: plain RoPE, "default"). A type that is not a string is refused, not read as "default".
json rope_scaling_of(const HfConfig& c, const char* key) {
  const json& r = c.j[key];
  if (!r.is_object()) c.bad(key, fmt::format("{} is not an object", r.dump()));
  const std::string where = std::string(key) + ".";
  const char* type_key = r.contains("rope_type") ? "rope_type" : "type";
  std::string type = "default";
  if (r.contains(type_key) && !r[type_key].is_null()) {
    if (!r[type_key].is_string())
      c.bad(where + type_key, fmt::format("{} is not a string (\"default\", \"linear\" or \"llama3\")",
                                          r[type_key].dump()));
    type = r[type_key].get<std::string>();
  }
  if (type == "default") return nullptr;
  if (type == "linear") return json{{"type", "linear"}, {"factor", c.number(r, where, "factor", std::nullopt)}};
  if (type == "llama3") {
    const double original = c.number(r, where, "original_max_position_embeddings", std::nullopt);
    if (!(original >= 1.0 && original <= 2147483647.0 && original == std::floor(original)))
      c.bad(where + "original_max_position_embeddings",
            fmt::format("{} is not a whole number of positions (1 to 2^31-1)", r["original_max_position_embeddings"].dump()));
    return json{{"type", "llama3"},
                {"factor", c.number(r, where, "factor", std::nullopt)},
                {"low_freq_factor", c.number(r, where, "low_freq_factor", std::nullopt)},
                {"high_freq_factor", c.number(r, where, "high_freq_factor", std::nullopt)},
                {"original_max_position_embeddings", static_cast<int64_t>(original)}};
  }
  c.bad(where + type_key, fmt::format("\"{}\" is not supported (Tetra implements \"default\", \"linear\" and "
                                      "\"llama3\")", type));
}

// RoPE from `rope_parameters` (transformers v5: it holds rope_theta too) and `rope_scaling` (the
// older key). Both may be present; then they must describe the same scaling.
void read_rope(const HfConfig& c, json& model) {
  model["rope_theta"] = c.number("rope_theta", 10000.0);
  json scaling = nullptr;
  const bool params = c.has("rope_parameters"), older = c.has("rope_scaling");
  for (const char* key : {"rope_scaling", "rope_parameters"}) {  // rope_parameters' rope_theta wins
    if (!c.has(key)) continue;
    const json s = rope_scaling_of(c, key);
    const json& r = c.j[key];
    if (r.contains("rope_theta")) model["rope_theta"] = c.number(r, std::string(key) + ".", "rope_theta", std::nullopt);
    if (params && older && std::string(key) == "rope_parameters" && s != scaling) {
      auto text = [](const json& x) { return x.is_null() ? std::string("plain RoPE (\"default\")") : x.dump(); };
      throw InputError(fmt::format("{}: rope_parameters and rope_scaling disagree: rope_parameters is {}, "
                                   "rope_scaling is {}; keep the one the model was trained with and remove the "
                                   "other", c.path, text(s), text(scaling)));
    }
    scaling = s;
  }
  if (!scaling.is_null()) model["rope_scaling"] = scaling;
}

// The experts of Mixtral (MixtralSparseMoeBlock), Qwen2-MoE (Qwen2MoeSparseMoeBlock) and Qwen3-MoE
// (Qwen3MoeSparseMoeBlock): a linear router without bias, the softmax over all experts, the top-k
// renormalised (Mixtral always, the Qwens with norm_topk_prob), SwiGLU experts without biases in
// every block, dropless; Qwen2-MoE adds a shared expert scaled by sigmoid(h . shared_expert_gate).
// Their load-balancing loss (load_balancing_loss_func) is E/N^2 sum_e routed_e P_e, top_k times
// Tetra's (Megatron's) E/(N^2 k) sum_e routed_e P_e: the coefficient is scaled to the same objective.
json moe_block(const HfConfig& c, const std::string& type, std::map<std::string, std::string>& sources) {
  const bool mixtral = type == "mixtral";
  const char* experts_key = mixtral ? "num_local_experts" : "num_experts";
  const char* ffn_key = mixtral ? "intermediate_size" : "moe_intermediate_size";
  const int64_t E = c.integer(experts_key), K = c.integer("num_experts_per_tok", 2);
  if (E < 1) c.bad(experts_key, fmt::format("{}: a \"{}\" model has experts", E, type));
  if (mixtral) {
    if (c.has("router_jitter_noise") && c.number("router_jitter_noise") != 0.0)
      c.bad("router_jitter_noise", "multiplicative jitter on the router's input is not supported (0: none)");
  } else {
    if (c.integer("decoder_sparse_step", 1) != 1)
      c.bad("decoder_sparse_step", fmt::format("{}: Tetra's MoE blocks are every model.moe.every-th from block 0; "
                                               "Qwen's step puts them at blocks step-1, 2 step-1, ... (1: every "
                                               "block)", c.integer("decoder_sparse_step", 1)));
    if (c.has("mlp_only_layers") && !(c.j["mlp_only_layers"].is_array() && c.j["mlp_only_layers"].empty()))
      c.bad("mlp_only_layers", fmt::format("{}: dense blocks among the MoE ones are not imported ([]: none)",
                                           c.j["mlp_only_layers"].dump()));
    if (type == "qwen3_moe" && c.has("shared_expert_intermediate_size") && c.integer("shared_expert_intermediate_size") > 0)
      c.bad("shared_expert_intermediate_size", "a \"qwen3_moe\" model has no shared expert (\"qwen2_moe\" has)");
  }
  json moe = {{"num_experts", E},
              {"top_k", K},
              {"every", 1},
              {"ffn_hidden_size", c.integer(ffn_key)},
              {"capacity_factor", nullptr},
              {"router_pre_softmax", mixtral ? false : !c.boolean("norm_topk_prob", false)},
              {"aux_loss_coeff", c.number("router_aux_loss_coef", 0.001) * static_cast<double>(K)},
              {"z_loss_coeff", 0.0}};
  if (type == "qwen2_moe") {
    const int64_t FS = c.integer("shared_expert_intermediate_size");
    if (FS < 1) c.bad("shared_expert_intermediate_size", fmt::format("{}: a \"qwen2_moe\" model has a shared expert", FS));
    moe["shared_expert_ffn_hidden_size"] = FS;
    moe["shared_expert_gate"] = true;
  }
  return moe;
}

json llama_family(const HfConfig& c, const std::string& type, int64_t seq_len, const std::string& seq_len_from,
                  std::map<std::string, std::string>& sources) {
  const std::string act = c.string("hidden_act", "silu");
  if (act != "silu") c.bad("hidden_act", fmt::format("\"{}\" (Tetra's gated MLP is SwiGLU: \"silu\")", act));
  if (c.boolean("attention_bias", false))
    c.bad("attention_bias", "true: biases on q, k, v and o_proj (Tetra has q/k/v biases only, as Qwen2)");
  if (c.boolean("mlp_bias", false)) c.bad("mlp_bias", "true: biases in the MLP are not supported for this family");
  if ((type == "mistral" || type == "mixtral") && c.has("sliding_window"))
    c.bad("sliding_window", fmt::format("{}: sliding-window attention is not supported (null: full attention)",
                                        c.j["sliding_window"].dump()));
  if ((type == "qwen2" || type == "qwen3" || type == "qwen3_moe" || type == "qwen2_moe") &&
      c.boolean("use_sliding_window", false))
    c.bad("use_sliding_window", "true: sliding-window attention is not supported");
  const bool moe = type == "mixtral" || type == "qwen3_moe" || type == "qwen2_moe";
  if (!moe)
    for (const char* key : {"num_experts", "num_local_experts", "n_routed_experts"})
      if (c.has(key) && c.integer(key) > 0)
        c.bad(key, fmt::format("experts in a \"{}\" model: Tetra imports Mixture-of-Experts models as \"mixtral\", "
                               "\"qwen2_moe\" and \"qwen3_moe\"", type));
  if (c.has("partial_rotary_factor") && c.number("partial_rotary_factor") != 1.0)
    c.bad("partial_rotary_factor", "RoPE on part of each head is not supported");
  const int64_t heads = c.integer("num_attention_heads"), hidden = c.integer("hidden_size");
  const int64_t max_pos = c.integer("max_position_embeddings", 2048);
  if (seq_len == 0 && max_pos < 1)
    c.bad("max_position_embeddings", fmt::format("{}: must be at least 1 (the longest sequence the model takes; or "
                                                 "give {})", max_pos, seq_len_from));
  sources = {{"vocab_size", "vocab_size"},
             {"seq_len", seq_len > 0 ? seq_len_from : "max_position_embeddings"},
             {"num_layers", "num_hidden_layers"},
             {"hidden_size", "hidden_size"},
             {"num_heads", "num_attention_heads"},
             {"num_kv_heads", c.has("num_key_value_heads") ? "num_key_value_heads" : "num_attention_heads"},
             {"head_dim", c.has("head_dim") ? "head_dim" : "hidden_size / num_attention_heads"},
             {"ffn_hidden_size", "intermediate_size"},
             {"norm_eps", "rms_norm_eps"},
             {"rope_theta", c.has("rope_parameters") ? "rope_parameters.rope_theta or rope_theta" : "rope_theta"},
             {"rope_scaling", c.has("rope_parameters") ? "rope_parameters" : "rope_scaling"},
             {"tie_embeddings", "tie_word_embeddings"}};
  json m = {{"vocab_size", c.integer("vocab_size")},
            {"seq_len", seq_len > 0 ? seq_len : std::min<int64_t>(max_pos, 4096)},
            {"num_layers", c.integer("num_hidden_layers")},
            {"hidden_size", hidden},
            {"num_heads", heads},
            {"num_kv_heads", c.integer("num_key_value_heads", heads)},
            {"head_dim", c.integer("head_dim", heads > 0 ? hidden / heads : 0)},
            {"ffn_hidden_size", c.integer("intermediate_size")},
            {"norm", "rmsnorm"},
            {"norm_eps", c.number("rms_norm_eps", 1e-6)},
            {"activation", "swiglu"},
            {"position", "rope"},
            {"tie_embeddings", c.boolean("tie_word_embeddings", false)},
            {"bias", false},
            {"qkv_bias", type == "qwen2" || type == "qwen2_moe"},
            {"qk_norm", type == "qwen3" || type == "qwen3_moe"}};
  read_rope(c, m);
  if (moe) m["moe"] = moe_block(c, type, sources);
  return m;
}

json gpt2(const HfConfig& c, int64_t seq_len, const std::string& seq_len_from,
          std::map<std::string, std::string>& sources) {
  const std::string act = c.string("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    c.bad("activation_function", fmt::format("\"{}\" (Tetra's GELU is the tanh approximation: \"gelu_new\")", act));
  if (c.boolean("scale_attn_by_inverse_layer_idx", false))
    c.bad("scale_attn_by_inverse_layer_idx", "true: per-layer attention scaling is not supported");
  if (!c.boolean("scale_attn_weights", true)) c.bad("scale_attn_weights", "false: unscaled attention is not supported");
  const int64_t n_pos = c.integer("n_positions", 1024), C = c.integer("n_embd");
  if (seq_len > 0 && seq_len != n_pos)
    throw InputError(fmt::format("{} {}: GPT-2's learned position table has n_positions = {} rows ({}); {}",
                                 seq_len_from, seq_len, n_pos, c.path,
                                 seq_len_from.rfind("--", 0) == 0
                                     ? fmt::format("import it at that length (leave {} out)", seq_len_from)
                                     : fmt::format("set {} to {}", seq_len_from, n_pos)));
  sources = {{"vocab_size", "vocab_size"},     {"seq_len", "n_positions"},
             {"num_layers", "n_layer"},        {"hidden_size", "n_embd"},
             {"num_heads", "n_head"},          {"num_kv_heads", "n_head"},
             {"ffn_hidden_size", c.has("n_inner") ? "n_inner" : "4 x n_embd"},
             {"norm_eps", "layer_norm_epsilon"}, {"tie_embeddings", "tie_word_embeddings"}};
  return json{{"vocab_size", c.integer("vocab_size")},
              {"seq_len", n_pos},
              {"num_layers", c.integer("n_layer")},
              {"hidden_size", C},
              {"num_heads", c.integer("n_head")},
              {"num_kv_heads", c.integer("n_head")},
              {"ffn_hidden_size", c.integer("n_inner", 4 * C)},
              {"norm", "layernorm"},
              {"norm_eps", c.number("layer_norm_epsilon", 1e-5)},
              {"activation", "gelu"},
              {"position", "learned"},
              {"tie_embeddings", c.boolean("tie_word_embeddings", true)},
              {"bias", true}};
}

}  // namespace

HfModel read_hf_model(const std::string& dir, int64_t seq_len, const std::string& seq_len_from) {
  if (!fs::is_directory(dir))
    throw InputError(fmt::format("{}: not a directory (a Hugging Face model directory: config.json and "
                                 "model.safetensors)", dir));
  HfConfig c{(fs::path(dir) / "config.json").string(), {}};
  c.j = read_hf_json(c.path);
  if (!c.j.is_object()) throw InputError(fmt::format("{}: not a JSON object", c.path));
  HfModel hf;
  hf.dir = dir;
  hf.model_type = c.string("model_type", "");
  if (hf.model_type == "llama" || hf.model_type == "mistral" || hf.model_type == "qwen2" || hf.model_type == "qwen3" ||
      hf.model_type == "mixtral" || hf.model_type == "qwen3_moe" || hf.model_type == "qwen2_moe")
    hf.model = llama_family(c, hf.model_type, seq_len, seq_len_from, hf.sources);
  else if (hf.model_type.rfind("deepseek", 0) == 0)
    c.bad("model_type", fmt::format("\"{}\": DeepSeek's multi-head latent attention (kv_lora_rank, q_lora_rank) "
                                    "is not implemented", hf.model_type));
  else if (hf.model_type == "gpt2")
    hf.model = gpt2(c, seq_len, seq_len_from, hf.sources);
  else
    c.bad("model_type", fmt::format("\"{}\" is not imported (Tetra imports \"llama\", \"mistral\", \"qwen2\", "
                                    "\"qwen3\", \"gpt2\", and the Mixture-of-Experts \"mixtral\", \"qwen2_moe\" "
                                    "and \"qwen3_moe\")", hf.model_type));
  // The weights: one file, or the shards an index names.
  const fs::path index = fs::path(dir) / "model.safetensors.index.json";
  if (fs::exists(index)) {
    const json j = read_hf_json(index.string());
    if (!j.contains("weight_map") || !j["weight_map"].is_object())
      throw InputError(fmt::format("{}: weight_map: missing or not an object", index.string()));
    std::set<std::string> seen;
    for (const auto& [name, file] : j["weight_map"].items()) {
      if (!file.is_string())
        throw InputError(fmt::format("{}: weight_map.{}: {} is not a file name", index.string(), name, file.dump()));
      const std::string f = file.get<std::string>();
      if (f.empty() || f.find('/') != std::string::npos || f == "." || f == "..")
        throw InputError(fmt::format("{}: weight_map.{}: \"{}\" is not a file of this directory (a shard's file "
                                     "name, such as model-00001-of-00002.safetensors)", index.string(), name, f));
      if (!seen.insert(f).second) continue;
      const fs::path shard = fs::path(dir) / f;
      std::error_code ec;
      const fs::file_status st = fs::status(shard, ec);
      if (st.type() == fs::file_type::not_found)
        throw InputError(fmt::format("{}: weight_map.{}: \"{}\": no such file in {}", index.string(), name, f, dir));
      if (st.type() != fs::file_type::regular)
        throw InputError(fmt::format("{}: weight_map.{}: {} is not a regular file{}", index.string(), name,
                                     shard.string(), ec ? " (" + ec.message() + ")" : std::string()));
      hf.weight_files.push_back(shard.string());
    }
  } else if (fs::exists(fs::path(dir) / "model.safetensors")) {
    hf.weight_files.push_back((fs::path(dir) / "model.safetensors").string());
  } else {
    throw InputError(fmt::format("{}: no model.safetensors and no model.safetensors.index.json (PyTorch .bin "
                                 "files are not read: convert them to safetensors)", dir));
  }
  return hf;
}

namespace {

// One Hugging Face tensor of a Tetra parameter: its name and shape in the files, and whether it is
// a GPT-2 Conv1D weight, stored (in, out), the transpose of Tetra's (out, in).
struct HfPart {
  std::string name;
  std::vector<int64_t> shape;
  bool conv1d = false;
};
// A parameter of the single-rank layout and the tensors it is made of, back to back.
struct HfParam {
  std::string param;
  std::vector<HfPart> parts;
};

// The mapping of the whole model, in the layout's order: the one list both the check of the files
// (names, shapes, types: before anything is allocated) and the read go through.
std::vector<HfParam> hf_params(const ModelConfig& m, bool gpt2, const std::string& model_type) {
  const int64_t C = m.hidden_size, V = m.vocab_size, F = m.ffn_hidden_size, L = m.num_layers;
  const int64_t HS = m.head_size(), NH = m.num_heads, NKV = m.num_kv_heads;
  std::vector<HfParam> out;
  auto add = [&](std::string param, std::vector<HfPart> parts) { out.push_back({std::move(param), std::move(parts)}); };
  if (!gpt2) {
    add("embedding.wte", {{"model.embed_tokens.weight", {V, C}}});
    for (int64_t l = 0; l < L; ++l) {
      const std::string t = fmt::format("layers.{}.", l), h = fmt::format("model.layers.{}.", l);
      add(t + "norm1.weight", {{h + "input_layernorm.weight", {C}}});
      add(t + "attn.qkv.weight", {{h + "self_attn.q_proj.weight", {NH * HS, C}},
                                  {h + "self_attn.k_proj.weight", {NKV * HS, C}},
                                  {h + "self_attn.v_proj.weight", {NKV * HS, C}}});
      if (m.has_qkv_bias())
        add(t + "attn.qkv.bias", {{h + "self_attn.q_proj.bias", {NH * HS}}, {h + "self_attn.k_proj.bias", {NKV * HS}},
                                  {h + "self_attn.v_proj.bias", {NKV * HS}}});
      if (m.qk_norm) {  // Qwen3: one RMSNorm weight over head_dim for the q heads, one for the k heads
        add(t + "attn.q_norm.weight", {{h + "self_attn.q_norm.weight", {HS}}});
        add(t + "attn.k_norm.weight", {{h + "self_attn.k_norm.weight", {HS}}});
      }
      add(t + "attn.proj.weight", {{h + "self_attn.o_proj.weight", {C, NH * HS}}});
      add(t + "norm2.weight", {{h + "post_attention_layernorm.weight", {C}}});
      if (m.moe.is_moe_layer(l)) {
        // Tetra's experts are global (E, 2F, C) [gate | up] and (E, C, F) tensors: each expert's
        // tensors back to back. Mixtral names them w1 (gate), w3 (up), w2 (down).
        const bool mixtral = model_type == "mixtral";
        const std::string moe = h + (mixtral ? "block_sparse_moe." : "mlp.");
        const int64_t E = m.moe.num_experts, FE = m.moe.ffn_hidden_size;
        add(t + "mlp.router.weight", {{moe + "gate.weight", {E, C}}});
        std::vector<HfPart> fc, proj;
        for (int64_t e = 0; e < E; ++e) {
          const std::string x = fmt::format("{}experts.{}.", moe, e);
          fc.push_back({x + (mixtral ? "w1.weight" : "gate_proj.weight"), {FE, C}});
          fc.push_back({x + (mixtral ? "w3.weight" : "up_proj.weight"), {FE, C}});
          proj.push_back({x + (mixtral ? "w2.weight" : "down_proj.weight"), {C, FE}});
        }
        add(t + "mlp.experts.fc.weight", std::move(fc));
        add(t + "mlp.experts.proj.weight", std::move(proj));
        if (m.moe.has_shared_expert()) {  // Qwen2-MoE: [gate | up] rows, down, and the gate vector
          const int64_t FS = m.moe.shared_expert_ffn_hidden_size;
          add(t + "mlp.shared_expert.fc.weight",
              {{moe + "shared_expert.gate_proj.weight", {FS, C}}, {moe + "shared_expert.up_proj.weight", {FS, C}}});
          add(t + "mlp.shared_expert.proj.weight", {{moe + "shared_expert.down_proj.weight", {C, FS}}});
          if (m.moe.shared_expert_gate) add(t + "mlp.shared_expert_gate.weight", {{moe + "shared_expert_gate.weight", {1, C}}});
        }
        continue;
      }
      add(t + "mlp.fc.weight", {{h + "mlp.gate_proj.weight", {F, C}}, {h + "mlp.up_proj.weight", {F, C}}});
      add(t + "mlp.proj.weight", {{h + "mlp.down_proj.weight", {C, F}}});
    }
    add("final_norm.weight", {{"model.norm.weight", {C}}});
  } else {
    const int64_t T = m.seq_len, QKV = 3 * C;
    add("embedding.wte", {{"transformer.wte.weight", {V, C}}});
    add("embedding.wpe", {{"transformer.wpe.weight", {T, C}}});
    for (int64_t l = 0; l < L; ++l) {
      const std::string t = fmt::format("layers.{}.", l), h = fmt::format("transformer.h.{}.", l);
      add(t + "norm1.weight", {{h + "ln_1.weight", {C}}});
      add(t + "norm1.bias", {{h + "ln_1.bias", {C}}});
      add(t + "attn.qkv.weight", {{h + "attn.c_attn.weight", {C, QKV}, true}});
      add(t + "attn.qkv.bias", {{h + "attn.c_attn.bias", {QKV}}});
      add(t + "attn.proj.weight", {{h + "attn.c_proj.weight", {C, C}, true}});
      add(t + "attn.proj.bias", {{h + "attn.c_proj.bias", {C}}});
      add(t + "norm2.weight", {{h + "ln_2.weight", {C}}});
      add(t + "norm2.bias", {{h + "ln_2.bias", {C}}});
      add(t + "mlp.fc.weight", {{h + "mlp.c_fc.weight", {C, F}, true}});
      add(t + "mlp.fc.bias", {{h + "mlp.c_fc.bias", {F}}});
      add(t + "mlp.proj.weight", {{h + "mlp.c_proj.weight", {F, C}, true}});
      add(t + "mlp.proj.bias", {{h + "mlp.c_proj.bias", {C}}});
    }
    add("final_norm.weight", {{"transformer.ln_f.weight", {C}}});
    add("final_norm.bias", {{"transformer.ln_f.bias", {C}}});
  }
  if (!m.tie_embeddings) add("lm_head.weight", {{"lm_head.weight", {V, C}}});
  return out;
}

int64_t numel_of(const std::vector<int64_t>& shape) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

}  // namespace

void check_host_memory_for(const std::string& what, uint64_t bytes) {
  const double physical = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
  double room = physical > 0 ? 0.95 * physical : 0.0;
  std::string limit = physical > 0 ? fmt::format("this machine has {:.2f} GiB of memory", physical / 1073741824.0) : "";
  // An address-space limit (ulimit -v) below the memory: what is left of it under the limit.
  rlimit as {};
  if (::getrlimit(RLIMIT_AS, &as) == 0 && as.rlim_cur != RLIM_INFINITY) {
    double used = 0;
    if (FILE* f = std::fopen("/proc/self/statm", "r")) {
      unsigned long pages = 0;
      if (std::fscanf(f, "%lu", &pages) == 1)
        used = static_cast<double>(pages) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
      std::fclose(f);
    }
    const double left = std::max(0.0, static_cast<double>(as.rlim_cur) - used);
    if (room == 0.0 || left < room) {
      room = left;
      limit = fmt::format("the process's address-space limit (ulimit -v: {:.2f} GiB) leaves {:.2f} GiB",
                          static_cast<double>(as.rlim_cur) / 1073741824.0, left / 1073741824.0);
    }
  }
  if (room > 0 && static_cast<double>(bytes) > room)
    throw InputError(fmt::format("{} needs {:.2f} GiB of host memory but {}: use a machine with more memory", what,
                                 static_cast<double>(bytes) / 1073741824.0, limit));
}

std::vector<float> read_hf_weights(const HfModel& hf, const ModelConfig& m, uint64_t also_needed_bytes) {
  const ParamLayout layout = ParamLayout::build(m);
  std::vector<std::unique_ptr<SafetensorsReader>> readers;
  struct Found {
    const SafetensorsReader* reader;
    const SafetensorsReader::Entry* entry;
  };
  std::map<std::string, Found> tensors;
  const bool gpt2 = hf.model_type == "gpt2";
  for (const std::string& f : hf.weight_files) {
    readers.push_back(std::make_unique<SafetensorsReader>(f));  // every header checked, nothing read yet
    for (const auto& [name, e] : readers.back()->entries()) {
      // GPT-2 files saved by transformers prefix "transformer."; the original release does not.
      const std::string key = gpt2 && name.rfind("transformer.", 0) != 0 && name.rfind("lm_head.", 0) != 0
                                  ? "transformer." + name : name;
      if (!tensors.emplace(key, Found{readers.back().get(), &e}).second)
        throw InputError(fmt::format("{}: tensor {} is also in another file of {}", f, name, hf.dir));
    }
  }
  // Every tensor the model needs, its shape and its type, from the headers alone.
  std::set<std::string> used;
  int64_t largest = 0;  // elements of the largest tensor read
  auto check = [&](const HfPart& part) -> const Found& {
    const auto it = tensors.find(part.name);
    if (it == tensors.end())
      throw InputError(fmt::format("{}: tensor {} is missing (the model config.json describes needs it)", hf.dir,
                                   part.name));
    const auto& [reader, e] = it->second;
    if (e->shape != part.shape)
      throw InputError(fmt::format("{}: tensor {} has shape [{}], config.json implies [{}]", reader->path(), part.name,
                                   fmt::join(e->shape, ", "), fmt::join(part.shape, ", ")));
    if (!is_weight_dtype(e->dtype))
      throw InputError(fmt::format("{}: tensor {} is {}: weights must be F32, BF16 or F16", reader->path(), part.name,
                                   dtype_name(e->dtype)));
    used.insert(part.name);
    largest = std::max(largest, numel_of(part.shape));
    return it->second;
  };
  const std::vector<HfParam> params = hf_params(m, gpt2, hf.model_type);
  for (const HfParam& p : params)
    for (const HfPart& part : p.parts) check(part);
  const std::string embed = gpt2 ? "transformer.wte.weight" : "model.embed_tokens.weight";
  const HfPart head{"lm_head.weight", {m.vocab_size, m.hidden_size}};
  const bool tied_copy = m.tie_embeddings && tensors.count(head.name);  // a tied model saved with its copy
  if (tied_copy) check(head);
  // What the model does not read: buffers that are no parameters are ignored, anything else is
  // an error (a parameter this import would silently drop).
  std::vector<std::string> left;
  for (const auto& [name, where] : tensors) {
    if (used.count(name)) continue;
    const bool buffer = name.find("rotary_emb.inv_freq") != std::string::npos ||
                        (gpt2 && (name.size() > 10 && (name.compare(name.size() - 10, 10, ".attn.bias") == 0 ||
                                                       name.find(".attn.masked_bias") != std::string::npos)));
    if (!buffer) left.push_back(name);
  }
  if (!left.empty()) {
    std::string list;
    for (size_t i = 0; i < left.size() && i < 5; ++i) list += (i ? ", " : "") + left[i];
    throw InputError(fmt::format("{}: {} tensor(s) the {} model does not have: {}{} (a feature Tetra does not "
                                 "implement: importing without them would change the model)", hf.dir, left.size(),
                                 hf.model_type, list, left.size() > 5 ? ", ..." : ""));
  }
  // The fp32 weights, one tensor read at a time (its values, its 16-bit bits, its transpose), and
  // what the caller holds beside them.
  const uint64_t need =
      static_cast<uint64_t>(layout.total) * 4 + static_cast<uint64_t>(largest) * 10 + also_needed_bytes;
  check_host_memory_for(fmt::format("{}: reading the weights of {} parameters", hf.dir, grouped(layout.total)), need);

  std::vector<float> master(static_cast<size_t>(layout.total), 0.0f);
  std::vector<float> values;
  for (const HfParam& p : params) {
    const ParamSpec* spec = layout.find(p.param);
    TETRA_CHECK(spec != nullptr, "import: the model has no parameter {}", p.param);
    int64_t at = 0;
    for (const HfPart& part : p.parts) {
      const Found& f = tensors.at(part.name);
      const int64_t n = numel_of(part.shape);
      TETRA_CHECK(at + n <= spec->held(), "import: {} overfilled", p.param);
      float* dst = master.data() + spec->offset + at;
      if (!part.conv1d) {
        read_weights_f32(*f.reader, part.name, *f.entry, dst);
      } else {  // (R, C) row-major -> (C, R) row-major
        values.resize(static_cast<size_t>(n));
        read_weights_f32(*f.reader, part.name, *f.entry, values.data());
        const int64_t R = part.shape[0], Cc = part.shape[1];
        for (int64_t r = 0; r < R; ++r)
          for (int64_t c = 0; c < Cc; ++c) dst[c * R + r] = values[static_cast<size_t>(r * Cc + c)];
      }
      at += n;
    }
    TETRA_CHECK(at == spec->held(), "import: {} has {} values of {}", p.param, at, spec->held());
  }
  if (tied_copy) {  // the copy must be the embedding, bit for bit
    const Found& f = tensors.at(head.name);
    values.resize(static_cast<size_t>(numel_of(head.shape)));
    read_weights_f32(*f.reader, head.name, *f.entry, values.data());
    const ParamSpec* wte = layout.find("embedding.wte");
    TETRA_CHECK(wte != nullptr && wte->held() == static_cast<int64_t>(values.size()), "import: embedding.wte");
    if (std::memcmp(values.data(), master.data() + wte->offset, values.size() * 4) != 0)
      throw InputError(fmt::format("{}: lm_head.weight differs from {} but config.json ties them "
                                   "(tie_word_embeddings)", hf.dir, embed));
  }
  return master;
}

std::string hf_config_problems(const HfModel& hf, const std::vector<std::string>& problems) {
  std::string list;
  for (const std::string& p : problems) {
    std::string line = "\n  " + p;
    if (p.rfind("model.", 0) == 0) {
      const std::string key = p.substr(6, p.find_first_of(".:", 6) - 6);
      const auto it = hf.sources.find(key);
      if (it != hf.sources.end())
        line += it->second.rfind("--", 0) == 0 || it->second.rfind("model.", 0) == 0
                    ? fmt::format(" (from {})", it->second)
                    : fmt::format(" (from config.json's {})", it->second);
    }
    list += line;
  }
  return list;
}

}  // namespace tetra
