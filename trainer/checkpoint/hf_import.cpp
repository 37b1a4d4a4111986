#include "trainer/checkpoint/hf_import.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>

#include <fmt/format.h>

#include "kernels/common/check.h"
#include "kernels/common/math.h"
#include "trainer/checkpoint/safetensors.h"
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

// RoPE scaling from `rope_parameters` (transformers v5: it holds rope_theta too) or `rope_scaling`.
void read_rope(const HfConfig& c, json& model) {
  model["rope_theta"] = c.number("rope_theta", 10000.0);
  const char* key = c.has("rope_parameters") ? "rope_parameters" : c.has("rope_scaling") ? "rope_scaling" : nullptr;
  if (!key) return;
  const json& r = c.j[key];
  if (!r.is_object()) c.bad(key, fmt::format("{} is not an object", r.dump()));
  const std::string where = std::string(key) + ".";
  if (r.contains("rope_theta")) model["rope_theta"] = c.number(r, where, "rope_theta", std::nullopt);
  const char* type_key = r.contains("rope_type") ? "rope_type" : "type";
  const std::string type = r.contains(type_key) && r[type_key].is_string() ? r[type_key].get<std::string>() : "default";
  if (type == "default") return;
  if (type == "linear") {
    model["rope_scaling"] = json{{"type", "linear"}, {"factor", c.number(r, where, "factor", std::nullopt)}};
    return;
  }
  if (type == "llama3") {
    const double original = c.number(r, where, "original_max_position_embeddings", std::nullopt);
    if (!(original >= 1.0 && original <= 2147483647.0 && original == std::floor(original)))
      c.bad(where + "original_max_position_embeddings",
            fmt::format("{} is not a whole number of positions (1 to 2^31-1)", r["original_max_position_embeddings"].dump()));
    model["rope_scaling"] = json{
        {"type", "llama3"},
        {"factor", c.number(r, where, "factor", std::nullopt)},
        {"low_freq_factor", c.number(r, where, "low_freq_factor", std::nullopt)},
        {"high_freq_factor", c.number(r, where, "high_freq_factor", std::nullopt)},
        {"original_max_position_embeddings", static_cast<int64_t>(original)}};
    return;
  }
  c.bad(where + type_key, fmt::format("\"{}\" is not supported (Tetra implements \"default\", \"linear\" and "
                                      "\"llama3\")", type));
}

json llama_family(const HfConfig& c, const std::string& type, int64_t seq_len) {
  const std::string act = c.string("hidden_act", "silu");
  if (act != "silu") c.bad("hidden_act", fmt::format("\"{}\" (Tetra's gated MLP is SwiGLU: \"silu\")", act));
  if (c.boolean("attention_bias", false))
    c.bad("attention_bias", "true: biases on q, k, v and o_proj (Tetra has q/k/v biases only, as Qwen2)");
  if (c.boolean("mlp_bias", false)) c.bad("mlp_bias", "true: biases in the MLP are not supported for this family");
  if (type == "mistral" && c.has("sliding_window"))
    c.bad("sliding_window", fmt::format("{}: sliding-window attention is not supported (null: full attention)",
                                        c.j["sliding_window"].dump()));
  if ((type == "qwen2" || type == "qwen3") && c.boolean("use_sliding_window", false))
    c.bad("use_sliding_window", "true: sliding-window attention is not supported");
  for (const char* moe : {"num_experts", "num_local_experts", "n_routed_experts"})
    if (c.has(moe) && c.integer(moe) > 0) c.bad(moe, "a Mixture-of-Experts router this importer does not map");
  if (c.has("partial_rotary_factor") && c.number("partial_rotary_factor") != 1.0)
    c.bad("partial_rotary_factor", "RoPE on part of each head is not supported");
  const int64_t heads = c.integer("num_attention_heads"), hidden = c.integer("hidden_size");
  const int64_t max_pos = c.integer("max_position_embeddings", 2048);
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
            {"qkv_bias", type == "qwen2"},
            {"qk_norm", type == "qwen3"}};
  read_rope(c, m);
  return m;
}

json gpt2(const HfConfig& c, int64_t seq_len) {
  const std::string act = c.string("activation_function", "gelu_new");
  if (act != "gelu_new" && act != "gelu_pytorch_tanh")
    c.bad("activation_function", fmt::format("\"{}\" (Tetra's GELU is the tanh approximation: \"gelu_new\")", act));
  if (c.boolean("scale_attn_by_inverse_layer_idx", false))
    c.bad("scale_attn_by_inverse_layer_idx", "true: per-layer attention scaling is not supported");
  if (!c.boolean("scale_attn_weights", true)) c.bad("scale_attn_weights", "false: unscaled attention is not supported");
  const int64_t n_pos = c.integer("n_positions", 1024), C = c.integer("n_embd");
  if (seq_len > 0 && seq_len != n_pos)
    throw InputError(fmt::format("--seq-len {}: GPT-2's learned position table has n_positions = {} rows ({}); "
                                 "import it at that length", seq_len, n_pos, c.path));
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

HfModel read_hf_model(const std::string& dir, int64_t seq_len) {
  if (!fs::is_directory(dir))
    throw InputError(fmt::format("{}: not a directory (a Hugging Face model directory: config.json and "
                                 "model.safetensors)", dir));
  HfConfig c{(fs::path(dir) / "config.json").string(), {}};
  c.j = read_hf_json(c.path);
  if (!c.j.is_object()) throw InputError(fmt::format("{}: not a JSON object", c.path));
  HfModel hf;
  hf.dir = dir;
  hf.model_type = c.string("model_type", "");
  if (hf.model_type == "llama" || hf.model_type == "mistral" || hf.model_type == "qwen2" || hf.model_type == "qwen3")
    hf.model = llama_family(c, hf.model_type, seq_len);
  else if (hf.model_type == "gpt2")
    hf.model = gpt2(c, seq_len);
  else
    c.bad("model_type", fmt::format("\"{}\" is not imported (Tetra imports \"llama\", \"mistral\", \"qwen2\", "
                                    "\"qwen3\" and \"gpt2\")", hf.model_type));
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
      if (f.find('/') != std::string::npos || f == "." || f == "..")
        throw InputError(fmt::format("{}: weight_map.{}: \"{}\" is not a file of this directory", index.string(),
                                     name, f));
      if (seen.insert(f).second) hf.weight_files.push_back((fs::path(dir) / f).string());
    }
  } else if (fs::exists(fs::path(dir) / "model.safetensors")) {
    hf.weight_files.push_back((fs::path(dir) / "model.safetensors").string());
  } else {
    throw InputError(fmt::format("{}: no model.safetensors and no model.safetensors.index.json (PyTorch .bin "
                                 "files are not read: convert them to safetensors)", dir));
  }
  return hf;
}

std::vector<float> read_hf_weights(const HfModel& hf, const ModelConfig& m) {
  const ParamLayout layout = ParamLayout::build(m);
  std::vector<std::unique_ptr<SafetensorsReader>> readers;
  std::map<std::string, std::pair<const SafetensorsReader*, const SafetensorsReader::Entry*>> tensors;
  const bool gpt2 = hf.model_type == "gpt2";
  for (const std::string& f : hf.weight_files) {
    readers.push_back(std::make_unique<SafetensorsReader>(f));
    for (const auto& [name, e] : readers.back()->entries()) {
      // GPT-2 files saved by transformers prefix "transformer."; the original release does not.
      const std::string key = gpt2 && name.rfind("transformer.", 0) != 0 && name.rfind("lm_head.", 0) != 0
                                  ? "transformer." + name : name;
      if (!tensors.emplace(key, std::make_pair(readers.back().get(), &e)).second)
        throw InputError(fmt::format("{}: tensor {} is also in another file of {}", f, name, hf.dir));
    }
  }
  std::set<std::string> used;
  // Tensor `name` as fp32, its shape checked against `shape` (Tetra's view of it).
  auto take = [&](const std::string& name, const std::vector<int64_t>& shape) {
    const auto it = tensors.find(name);
    if (it == tensors.end())
      throw InputError(fmt::format("{}: tensor {} is missing (the model config.json describes needs it)", hf.dir, name));
    const auto& [reader, e] = it->second;
    if (e->shape != shape)
      throw InputError(fmt::format("{}: tensor {} has shape [{}], config.json implies [{}]", reader->path(), name,
                                   fmt::join(e->shape, ", "), fmt::join(shape, ", ")));
    int64_t n = 1;
    for (int64_t d : shape) n *= d;
    std::vector<float> out(static_cast<size_t>(n));
    if (e->dtype == DType::F32) {
      reader->read(*e, out.data());
    } else if (e->dtype == DType::BF16 || e->dtype == DType::F16) {
      std::vector<uint16_t> raw(static_cast<size_t>(n));
      reader->read(*e, raw.data());
      for (size_t i = 0; i < raw.size(); ++i)
        out[i] = e->dtype == DType::BF16 ? math::bf16_bits_to_f32(raw[i]) : math::f16_bits_to_f32(raw[i]);
    } else {
      throw InputError(fmt::format("{}: tensor {} is {}: weights must be F32, BF16 or F16", reader->path(), name,
                                   dtype_name(e->dtype)));
    }
    used.insert(name);
    return out;
  };
  std::vector<float> master(static_cast<size_t>(layout.total), 0.0f);
  auto put = [&](const std::string& param, const std::vector<std::vector<float>>& parts) {
    const ParamSpec* p = layout.find(param);
    TETRA_CHECK(p != nullptr, "import: the model has no parameter {}", param);
    int64_t at = 0;
    for (const std::vector<float>& part : parts) {
      TETRA_CHECK(at + static_cast<int64_t>(part.size()) <= p->held(), "import: {} overfilled", param);
      std::memcpy(master.data() + p->offset + at, part.data(), part.size() * 4);
      at += static_cast<int64_t>(part.size());
    }
    TETRA_CHECK(at == p->held(), "import: {} has {} values of {}", param, at, p->held());
  };
  // (R, C) row-major -> (C, R) row-major.
  auto transposed = [](const std::vector<float>& w, int64_t R, int64_t C) {
    std::vector<float> t(w.size());
    for (int64_t r = 0; r < R; ++r)
      for (int64_t c = 0; c < C; ++c) t[static_cast<size_t>(c * R + r)] = w[static_cast<size_t>(r * C + c)];
    return t;
  };
  const int64_t C = m.hidden_size, V = m.vocab_size, F = m.ffn_hidden_size, L = m.num_layers;
  const int64_t HS = m.head_size(), NH = m.num_heads, NKV = m.num_kv_heads;
  std::string embed, head;
  if (!gpt2) {
    embed = "model.embed_tokens.weight";
    put("embedding.wte", {take(embed, {V, C})});
    for (int64_t l = 0; l < L; ++l) {
      const std::string t = fmt::format("layers.{}.", l), h = fmt::format("model.layers.{}.", l);
      put(t + "norm1.weight", {take(h + "input_layernorm.weight", {C})});
      put(t + "attn.qkv.weight", {take(h + "self_attn.q_proj.weight", {NH * HS, C}),
                                  take(h + "self_attn.k_proj.weight", {NKV * HS, C}),
                                  take(h + "self_attn.v_proj.weight", {NKV * HS, C})});
      if (m.has_qkv_bias())
        put(t + "attn.qkv.bias", {take(h + "self_attn.q_proj.bias", {NH * HS}), take(h + "self_attn.k_proj.bias", {NKV * HS}),
                                  take(h + "self_attn.v_proj.bias", {NKV * HS})});
      if (m.qk_norm) {  // Qwen3: one RMSNorm weight over head_dim for the q heads, one for the k heads
        put(t + "attn.q_norm.weight", {take(h + "self_attn.q_norm.weight", {HS})});
        put(t + "attn.k_norm.weight", {take(h + "self_attn.k_norm.weight", {HS})});
      }
      put(t + "attn.proj.weight", {take(h + "self_attn.o_proj.weight", {C, NH * HS})});
      put(t + "norm2.weight", {take(h + "post_attention_layernorm.weight", {C})});
      put(t + "mlp.fc.weight", {take(h + "mlp.gate_proj.weight", {F, C}), take(h + "mlp.up_proj.weight", {F, C})});
      put(t + "mlp.proj.weight", {take(h + "mlp.down_proj.weight", {C, F})});
    }
    put("final_norm.weight", {take("model.norm.weight", {C})});
  } else {
    embed = "transformer.wte.weight";
    const int64_t T = m.seq_len, QKV = 3 * C;
    put("embedding.wte", {take(embed, {V, C})});
    put("embedding.wpe", {take("transformer.wpe.weight", {T, C})});
    for (int64_t l = 0; l < L; ++l) {
      const std::string t = fmt::format("layers.{}.", l), h = fmt::format("transformer.h.{}.", l);
      put(t + "norm1.weight", {take(h + "ln_1.weight", {C})});
      put(t + "norm1.bias", {take(h + "ln_1.bias", {C})});
      // Conv1D weights are (in, out): the transposes of Tetra's (out, in).
      put(t + "attn.qkv.weight", {transposed(take(h + "attn.c_attn.weight", {C, QKV}), C, QKV)});
      put(t + "attn.qkv.bias", {take(h + "attn.c_attn.bias", {QKV})});
      put(t + "attn.proj.weight", {transposed(take(h + "attn.c_proj.weight", {C, C}), C, C)});
      put(t + "attn.proj.bias", {take(h + "attn.c_proj.bias", {C})});
      put(t + "norm2.weight", {take(h + "ln_2.weight", {C})});
      put(t + "norm2.bias", {take(h + "ln_2.bias", {C})});
      put(t + "mlp.fc.weight", {transposed(take(h + "mlp.c_fc.weight", {C, F}), C, F)});
      put(t + "mlp.fc.bias", {take(h + "mlp.c_fc.bias", {F})});
      put(t + "mlp.proj.weight", {transposed(take(h + "mlp.c_proj.weight", {F, C}), F, C)});
      put(t + "mlp.proj.bias", {take(h + "mlp.c_proj.bias", {C})});
    }
    put("final_norm.weight", {take("transformer.ln_f.weight", {C})});
    put("final_norm.bias", {take("transformer.ln_f.bias", {C})});
  }
  head = "lm_head.weight";
  if (!m.tie_embeddings) {
    put("lm_head.weight", {take(head, {V, C})});
  } else if (tensors.count(head)) {  // a tied model saved with its (equal) copy of the embedding
    if (take(head, {V, C}) != take(embed, {V, C}))
      throw InputError(fmt::format("{}: lm_head.weight differs from {} but config.json ties them "
                                   "(tie_word_embeddings)", hf.dir, embed));
  }
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
  return master;
}

}  // namespace tetra
