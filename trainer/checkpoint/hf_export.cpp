#include "trainer/checkpoint/hf_export.h"

#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>

#include "kernels/common/check.h"
#include "trainer/params/param_layout.h"

namespace tetra {

namespace {

using json = nlohmann::ordered_json;

// Builds the records of one state dict, converting fp32 values to the output type.
struct RecordWriter {
  DType dtype;
  std::vector<TensorRecord> out;

  void add(std::string name, std::vector<int64_t> shape, const float* values) {
    TensorRecord r;
    r.name = std::move(name);
    r.dtype = dtype;
    r.shape = std::move(shape);
    const size_t n = static_cast<size_t>(r.numel());
    r.data.resize(n * dtype_size(dtype));
    if (dtype == DType::F32) {
      std::memcpy(r.data.data(), values, n * 4);
    } else if (dtype == DType::F16) {
      auto* dst = reinterpret_cast<uint16_t*>(r.data.data());
      for (size_t i = 0; i < n; ++i) dst[i] = math::f32_to_f16_bits(values[i]);
    } else {
      auto* dst = reinterpret_cast<uint16_t*>(r.data.data());
      for (size_t i = 0; i < n; ++i) dst[i] = math::f32_to_bf16_bits(values[i]);
    }
    out.push_back(std::move(r));
  }
  void add(std::string name, std::vector<int64_t> shape, const std::vector<float>& values) {
    add(std::move(name), std::move(shape), values.data());
  }
};

// (R, C) row-major -> (C, R) row-major.
std::vector<float> transposed(const std::vector<float>& w, int64_t R, int64_t C) {
  std::vector<float> t(w.size());
  for (int64_t r = 0; r < R; ++r)
    for (int64_t c = 0; c < C; ++c) t[static_cast<size_t>(c * R + r)] = w[static_cast<size_t>(r * C + c)];
  return t;
}

// A parameter's global tensor, checked against the size its layout gives.
std::vector<float> fetch(const HfWeightSource& weights, const ParamLayout& layout, const std::string& name) {
  const ParamSpec* p = layout.find(name);
  TETRA_CHECK(p != nullptr, "the model has no parameter {}", name);
  std::vector<float> w = weights(name);
  TETRA_CHECK(static_cast<int64_t>(w.size()) == p->held(), "{}: {} values, its global shape holds {}", name,
              w.size(), p->held());
  return w;
}

// A MoE block's router and experts under Mixtral's (block_sparse_moe, w1 w3 w2) or Qwen3-MoE's
// (mlp, gate_proj up_proj down_proj) names: Tetra's global (E, 2F, C) [gate | up] and (E, C, F)
// tensors cut per expert.
void moe_tensors(const ModelConfig& m, const ParamLayout& layout, const HfWeightSource& weights, bool mixtral,
                 const std::string& t, const std::string& h, RecordWriter& w) {
  const int64_t C = m.hidden_size, E = m.moe.num_experts, FE = m.moe.ffn_hidden_size;
  const std::string moe = h + (mixtral ? "block_sparse_moe." : "mlp.");
  w.add(moe + "gate.weight", {E, C}, fetch(weights, layout, t + "mlp.router.weight"));
  const std::vector<float> fc = fetch(weights, layout, t + "mlp.experts.fc.weight");
  const std::vector<float> proj = fetch(weights, layout, t + "mlp.experts.proj.weight");
  for (int64_t e = 0; e < E; ++e) {
    const std::string x = fmt::format("{}experts.{}.", moe, e);
    const float* f = fc.data() + e * 2 * FE * C;
    w.add(x + (mixtral ? "w1.weight" : "gate_proj.weight"), {FE, C}, f);
    w.add(x + (mixtral ? "w3.weight" : "up_proj.weight"), {FE, C}, f + FE * C);
    w.add(x + (mixtral ? "w2.weight" : "down_proj.weight"), {C, FE}, proj.data() + e * C * FE);
  }
  if (m.moe.has_shared_expert()) {  // Qwen2-MoE: [gate | up] rows of the shared expert, down, its gate
    const int64_t FS = m.moe.shared_expert_ffn_hidden_size;
    const std::vector<float> sfc = fetch(weights, layout, t + "mlp.shared_expert.fc.weight");
    w.add(moe + "shared_expert.gate_proj.weight", {FS, C}, sfc.data());
    w.add(moe + "shared_expert.up_proj.weight", {FS, C}, sfc.data() + FS * C);
    w.add(moe + "shared_expert.down_proj.weight", {C, FS}, fetch(weights, layout, t + "mlp.shared_expert.proj.weight"));
    w.add(moe + "shared_expert_gate.weight", {1, C}, fetch(weights, layout, t + "mlp.shared_expert_gate.weight"));
  }
}

void llama_tensors(const ModelConfig& m, const ParamLayout& layout, const HfWeightSource& weights, HfArch arch,
                   RecordWriter& w) {
  const int64_t C = m.hidden_size, HS = m.head_size(), NH = m.num_heads, NKV = m.num_kv_heads;
  const int64_t F = m.ffn_hidden_size, V = m.vocab_size;
  w.add("model.embed_tokens.weight", {V, C}, fetch(weights, layout, "embedding.wte"));
  for (int64_t l = 0; l < m.num_layers; ++l) {
    const std::string t = fmt::format("layers.{}.", l), h = fmt::format("model.layers.{}.", l);
    w.add(h + "input_layernorm.weight", {C}, fetch(weights, layout, t + "norm1.weight"));
    // qkv (NH + 2 NKV) HS rows of C: [q heads | k heads | v heads]
    const std::vector<float> qkv = fetch(weights, layout, t + "attn.qkv.weight");
    w.add(h + "self_attn.q_proj.weight", {NH * HS, C}, qkv.data());
    w.add(h + "self_attn.k_proj.weight", {NKV * HS, C}, qkv.data() + NH * HS * C);
    w.add(h + "self_attn.v_proj.weight", {NKV * HS, C}, qkv.data() + (NH + NKV) * HS * C);
    if (m.has_qkv_bias()) {  // Qwen2
      const std::vector<float> b = fetch(weights, layout, t + "attn.qkv.bias");
      w.add(h + "self_attn.q_proj.bias", {NH * HS}, b.data());
      w.add(h + "self_attn.k_proj.bias", {NKV * HS}, b.data() + NH * HS);
      w.add(h + "self_attn.v_proj.bias", {NKV * HS}, b.data() + (NH + NKV) * HS);
    }
    if (m.qk_norm) {  // Qwen3
      w.add(h + "self_attn.q_norm.weight", {HS}, fetch(weights, layout, t + "attn.q_norm.weight"));
      w.add(h + "self_attn.k_norm.weight", {HS}, fetch(weights, layout, t + "attn.k_norm.weight"));
    }
    w.add(h + "self_attn.o_proj.weight", {C, NH * HS}, fetch(weights, layout, t + "attn.proj.weight"));
    w.add(h + "post_attention_layernorm.weight", {C}, fetch(weights, layout, t + "norm2.weight"));
    if (m.moe.is_moe_layer(l)) {
      moe_tensors(m, layout, weights, arch == HfArch::MIXTRAL, t, h, w);
      continue;
    }
    // fc 2F rows of C: [gate | up]
    const std::vector<float> fc = fetch(weights, layout, t + "mlp.fc.weight");
    w.add(h + "mlp.gate_proj.weight", {F, C}, fc.data());
    w.add(h + "mlp.up_proj.weight", {F, C}, fc.data() + F * C);
    w.add(h + "mlp.down_proj.weight", {C, F}, fetch(weights, layout, t + "mlp.proj.weight"));
  }
  w.add("model.norm.weight", {C}, fetch(weights, layout, "final_norm.weight"));
  if (!m.tie_embeddings) w.add("lm_head.weight", {V, C}, fetch(weights, layout, "lm_head.weight"));
}

void gpt2_tensors(const ModelConfig& m, const ParamLayout& layout, const HfWeightSource& weights, RecordWriter& w) {
  const int64_t C = m.hidden_size, F = m.ffn_hidden_size, V = m.vocab_size, T = m.seq_len;
  const int64_t QKV = 3 * C;  // multi-head attention: (NH + 2 NH) HS
  w.add("transformer.wte.weight", {V, C}, fetch(weights, layout, "embedding.wte"));
  w.add("transformer.wpe.weight", {T, C}, fetch(weights, layout, "embedding.wpe"));
  for (int64_t l = 0; l < m.num_layers; ++l) {
    const std::string t = fmt::format("layers.{}.", l), h = fmt::format("transformer.h.{}.", l);
    w.add(h + "ln_1.weight", {C}, fetch(weights, layout, t + "norm1.weight"));
    w.add(h + "ln_1.bias", {C}, fetch(weights, layout, t + "norm1.bias"));
    // Conv1D weights are (in, out): the transposes of Tetra's (out, in).
    w.add(h + "attn.c_attn.weight", {C, QKV}, transposed(fetch(weights, layout, t + "attn.qkv.weight"), QKV, C));
    w.add(h + "attn.c_attn.bias", {QKV}, fetch(weights, layout, t + "attn.qkv.bias"));
    w.add(h + "attn.c_proj.weight", {C, C}, transposed(fetch(weights, layout, t + "attn.proj.weight"), C, C));
    w.add(h + "attn.c_proj.bias", {C}, fetch(weights, layout, t + "attn.proj.bias"));
    w.add(h + "ln_2.weight", {C}, fetch(weights, layout, t + "norm2.weight"));
    w.add(h + "ln_2.bias", {C}, fetch(weights, layout, t + "norm2.bias"));
    w.add(h + "mlp.c_fc.weight", {C, F}, transposed(fetch(weights, layout, t + "mlp.fc.weight"), F, C));
    w.add(h + "mlp.c_fc.bias", {F}, fetch(weights, layout, t + "mlp.fc.bias"));
    w.add(h + "mlp.c_proj.weight", {F, C}, transposed(fetch(weights, layout, t + "mlp.proj.weight"), C, F));
    w.add(h + "mlp.c_proj.bias", {C}, fetch(weights, layout, t + "mlp.proj.bias"));
  }
  w.add("transformer.ln_f.weight", {C}, fetch(weights, layout, "final_norm.weight"));
  w.add("transformer.ln_f.bias", {C}, fetch(weights, layout, "final_norm.bias"));
  if (!m.tie_embeddings) w.add("lm_head.weight", {V, C}, fetch(weights, layout, "lm_head.weight"));
}

json token_id(int64_t id) { return id < 0 ? json(nullptr) : json(id); }

}  // namespace

const char* hf_model_type(HfArch arch) {
  switch (arch) {
    case HfArch::LLAMA: return "llama";
    case HfArch::QWEN2: return "qwen2";
    case HfArch::QWEN3: return "qwen3";
    case HfArch::MIXTRAL: return "mixtral";
    case HfArch::QWEN3_MOE: return "qwen3_moe";
    case HfArch::QWEN2_MOE: return "qwen2_moe";
    case HfArch::GPT2: break;
  }
  return "gpt2";
}

HfArch hf_architecture(const ModelConfig& m) {
  std::vector<std::string> bad;
  const bool rope = m.position == Position::ROPE;
  if (rope) {
    if (m.norm != Norm::RMSNORM)
      bad.push_back(fmt::format("model.norm \"{}\" (Llama has rmsnorm only)", to_string(m.norm)));
    if (m.activation != Activation::SWIGLU)
      bad.push_back(fmt::format("model.activation \"{}\" (Llama's MLP is swiglu)", to_string(m.activation)));
    if (m.bias) bad.push_back("model.bias true (Llama has no biases)");
    if (m.qk_norm && m.qkv_bias)
      bad.push_back("model.qkv_bias true with model.qk_norm (Qwen3's attention_bias also biases o_proj)");

  } else {
    if (m.norm != Norm::LAYERNORM)
      bad.push_back(fmt::format("model.norm \"{}\" (GPT-2 has layernorm only)", to_string(m.norm)));
    if (m.activation != Activation::GELU)
      bad.push_back(fmt::format("model.activation \"{}\" (GPT-2's MLP is gelu)", to_string(m.activation)));
    if (!m.bias) bad.push_back("model.bias false (GPT-2 has biases in every layer)");
    if (m.num_kv_heads != m.num_heads)
      bad.push_back(fmt::format("model.num_kv_heads {} (GPT-2 has multi-head attention only: num_kv_heads "
                                "= num_heads = {})", m.num_kv_heads, m.num_heads));
  }
  const MoeConfig& moe = m.moe;
  if (moe.enabled()) {  // Mixtral (no q/k norms) or Qwen3-MoE (q/k norms): experts in every block
    if (!rope) bad.push_back(fmt::format("model.moe.num_experts {} with GPT-2's layout (Hugging Face's MoE "
                                         "families are Llama-style)", moe.num_experts));
    // Qwen2-MoE: q/k/v biases, a gated shared expert; Mixtral and Qwen3-MoE: neither.
    const bool qwen2 = m.qkv_bias;
    if (qwen2 && (!moe.has_shared_expert() || !moe.shared_expert_gate))
      bad.push_back("model.qkv_bias true with experts but no gated shared expert (Qwen2-MoE has one: "
                    "model.moe.shared_expert_ffn_hidden_size and shared_expert_gate)");
    if (!qwen2 && moe.has_shared_expert())
      bad.push_back(fmt::format("model.moe.shared_expert_ffn_hidden_size {} without model.qkv_bias (of the "
                                "Hugging Face MoE families only Qwen2-MoE has a shared expert, gated, with q/k/v "
                                "biases)", moe.shared_expert_ffn_hidden_size));
    if (moe.every != 1 || moe.first_k_dense_replace != 0)
      bad.push_back(fmt::format("model.moe.every {} / first_k_dense_replace {} (Mixtral and Qwen3-MoE have "
                                "experts in every block: 1 and 0)", moe.every, moe.first_k_dense_replace));
    if (moe.router_topk_scaling_factor.value_or(1.0) != 1.0)
      bad.push_back(fmt::format("model.moe.router_topk_scaling_factor {} (neither family scales its gates)",
                                *moe.router_topk_scaling_factor));
    if (moe.router_score_function != RouterScore::SOFTMAX || moe.router_enable_expert_bias)
      bad.push_back("model.moe.router_score_function \"sigmoid\" (these families' routers are softmax)");
    if (!m.qk_norm && !m.qkv_bias && moe.router_pre_softmax)
      bad.push_back("model.moe.router_pre_softmax true without model.qk_norm (Mixtral renormalises its gates "
                    "over the top-k: false; Qwen3-MoE, which may not, has q/k norms)");
  }
  if (!bad.empty()) {
    std::string list;
    for (const std::string& b : bad) list += (list.empty() ? "" : "; ") + b;
    throw InputError(fmt::format(
        "no Hugging Face architecture holds this model: with model.position \"{}\" it would be {}, but {}. "
        "Llama is norm rmsnorm, activation swiglu, position rope, bias false; GPT-2 is norm layernorm, "
        "activation gelu, position learned, bias true, num_kv_heads = num_heads",
        to_string(m.position), rope ? "Llama" : "GPT-2", list));
  }
  if (!rope) return HfArch::GPT2;
  if (moe.enabled()) return m.qk_norm ? HfArch::QWEN3_MOE : m.qkv_bias ? HfArch::QWEN2_MOE : HfArch::MIXTRAL;
  return m.qk_norm ? HfArch::QWEN3 : m.qkv_bias ? HfArch::QWEN2 : HfArch::LLAMA;
}

json hf_config(const ModelConfig& m, HfArch arch, DType dtype, int64_t eos_token_id) {
  TETRA_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16, "export dtype {}",
              dtype_name(dtype));
  const char* torch_dtype = dtype == DType::F32 ? "float32" : dtype == DType::F16 ? "float16" : "bfloat16";
  // RoPE's scaling as transformers reads it (rope_scaling; v5 reads it too).
  json rope_scaling = nullptr;
  if (m.rope_scaling.type == RopeScaling::LINEAR)
    rope_scaling = json{{"rope_type", "linear"}, {"factor", m.rope_scaling.factor}};
  else if (m.rope_scaling.type == RopeScaling::LLAMA3)
    rope_scaling = json{{"rope_type", "llama3"},
                        {"factor", m.rope_scaling.factor},
                        {"low_freq_factor", m.rope_scaling.low_freq_factor},
                        {"high_freq_factor", m.rope_scaling.high_freq_factor},
                        {"original_max_position_embeddings", m.rope_scaling.original_max_position_embeddings}};
  // Every family's last keys.
  const json common{{"initializer_range", m.init_std},
                    {"tie_word_embeddings", m.tie_embeddings},
                    {"bos_token_id", token_id(eos_token_id)},
                    {"eos_token_id", token_id(eos_token_id)},
                    {"use_cache", true},
                    {"torch_dtype", torch_dtype}};
  if (arch != HfArch::GPT2) {
    // The Llama family's keys; Qwen2 adds its sliding-window switch (off) and has q/k/v biases
    // (implied by its model type), Qwen3 is Qwen2 with attention_bias false and per-head q/k
    // norms (implied by its type), Llama names its biases and its pretraining_tp.
    const bool qwen = arch == HfArch::QWEN2 || arch == HfArch::QWEN3 || arch == HfArch::QWEN3_MOE ||
                      arch == HfArch::QWEN2_MOE;
    const char* architecture = arch == HfArch::QWEN3       ? "Qwen3ForCausalLM"
                               : arch == HfArch::QWEN2     ? "Qwen2ForCausalLM"
                               : arch == HfArch::MIXTRAL   ? "MixtralForCausalLM"
                               : arch == HfArch::QWEN3_MOE ? "Qwen3MoeForCausalLM"
                               : arch == HfArch::QWEN2_MOE ? "Qwen2MoeForCausalLM"
                                                           : "LlamaForCausalLM";
    json c{{"architectures", {architecture}},
           {"model_type", hf_model_type(arch)},
           {"vocab_size", m.vocab_size},
           {"hidden_size", m.hidden_size},
           // Mixtral's intermediate_size is its experts' (it has no dense MLP).
           {"intermediate_size", arch == HfArch::MIXTRAL ? m.moe.ffn_hidden_size : m.ffn_hidden_size},
           {"num_hidden_layers", m.num_layers},
           {"num_attention_heads", m.num_heads},
           {"num_key_value_heads", m.num_kv_heads},
           {"head_dim", m.head_size()},
           {"hidden_act", "silu"},
           {"max_position_embeddings", m.seq_len},
           {"rms_norm_eps", m.norm_eps},
           {"rope_theta", m.rope_theta},
           {"rope_scaling", rope_scaling},
           {"attention_dropout", 0.0}};
    c.update(common);
    if (qwen) {
      c["use_sliding_window"] = false;
      c["sliding_window"] = nullptr;
    }
    if (m.moe.enabled()) {
      // The load-balancing coefficient in Hugging Face's convention (E/N^2 sum_e routed_e P_e,
      // top_k times Tetra's).
      const double aux = m.moe.aux_loss_coeff / static_cast<double>(m.moe.top_k);
      if (arch == HfArch::MIXTRAL) {
        c["sliding_window"] = nullptr;
        c["num_local_experts"] = m.moe.num_experts;
        c["num_experts_per_tok"] = m.moe.top_k;
        c["router_jitter_noise"] = 0.0;
      } else {
        c["moe_intermediate_size"] = m.moe.ffn_hidden_size;
        c["num_experts"] = m.moe.num_experts;
        c["num_experts_per_tok"] = m.moe.top_k;
        c["norm_topk_prob"] = !m.moe.router_pre_softmax;
        c["decoder_sparse_step"] = 1;
        c["mlp_only_layers"] = json::array();
        if (arch == HfArch::QWEN2_MOE) c["shared_expert_intermediate_size"] = m.moe.shared_expert_ffn_hidden_size;
      }
      c["router_aux_loss_coef"] = aux;
      c["output_router_logits"] = false;
    }
    if (arch != HfArch::QWEN2 && arch != HfArch::QWEN2_MOE) c["attention_bias"] = false;
    if (arch == HfArch::LLAMA) {
      c["mlp_bias"] = false;
      c["pretraining_tp"] = 1;
    }
    return c;
  }
  json c{{"architectures", {"GPT2LMHeadModel"}},
          {"model_type", "gpt2"},
          {"vocab_size", m.vocab_size},
          {"n_positions", m.seq_len},
          {"n_ctx", m.seq_len},
          {"n_embd", m.hidden_size},
          {"n_layer", m.num_layers},
          {"n_head", m.num_heads},
          {"n_inner", m.ffn_hidden_size},
          {"activation_function", "gelu_new"},
          {"layer_norm_epsilon", m.norm_eps},
          {"resid_pdrop", 0.0},
          {"embd_pdrop", 0.0},
          {"attn_pdrop", 0.0},
          {"scale_attn_weights", true},
          {"scale_attn_by_inverse_layer_idx", false},
          {"reorder_and_upcast_attn", false}};
  c.update(common);
  return c;
}

std::vector<TensorRecord> hf_tensors(const ModelConfig& m, HfArch arch, DType dtype, const HfWeightSource& weights) {
  TETRA_CHECK(dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16, "export dtype {}",
              dtype_name(dtype));
  const ParamLayout layout = ParamLayout::build(m);
  RecordWriter w{dtype, {}};
  if (arch != HfArch::GPT2)
    llama_tensors(m, layout, weights, arch, w);
  else
    gpt2_tensors(m, layout, weights, w);
  return std::move(w.out);
}

std::map<std::string, std::string> hf_metadata() { return {{"format", "pt"}}; }

namespace {

const char* file_type_name(std::filesystem::file_type t) {
  using std::filesystem::file_type;
  switch (t) {
    case file_type::regular: return "a regular file";
    case file_type::directory: return "a directory";
    case file_type::symlink: return "a symbolic link";
    case file_type::block: return "a block device";
    case file_type::character: return "a character device";
    case file_type::fifo: return "a FIFO";
    case file_type::socket: return "a socket";
    default: return "not a regular file";
  }
}

// "" when the directory `dir` can take new entries, else why not.
std::string not_writable(const std::filesystem::path& dir) {
  if (::access(dir.c_str(), W_OK | X_OK) == 0) return {};
  return std::strerror(errno);
}

}  // namespace

void hf_check_output_dir(const std::string& out, bool force, bool can_force) {
  namespace fs = std::filesystem;
  if (out.empty())
    throw InputError("OUT is empty: name a new or empty directory to write model.safetensors and config.json in");
  std::error_code ec;
  const fs::file_status st = fs::status(out, ec);
  if (st.type() == fs::file_type::not_found && fs::is_symlink(fs::symlink_status(out, ec)))
    throw InputError(fmt::format("{}: is a symbolic link to nothing ({}): choose a new or empty directory for OUT",
                                 out, fs::read_symlink(out, ec).string()));
  if (st.type() == fs::file_type::not_found) {
    // Created later with its missing parents: the nearest existing ancestor must take them.
    fs::path at = fs::absolute(out, ec);
    if (ec) throw InputError(fmt::format("{}: cannot resolve the output directory: {}", out, ec.message()));
    fs::file_status a;
    do {
      at = at.parent_path();
      a = fs::status(at, ec);
    } while (a.type() == fs::file_type::not_found && at != at.root_path() && !at.empty());
    if (a.type() != fs::file_type::directory)
      throw InputError(fmt::format("{}: cannot create the output directory: {} is {}, not a directory; choose "
                                   "another OUT",
                                   out, at.string(),
                                   a.type() == fs::file_type::not_found || a.type() == fs::file_type::none
                                       ? "unreachable (" + ec.message() + ")"
                                       : file_type_name(a.type())));
    const std::string why = not_writable(at);
    if (!why.empty())
      throw InputError(fmt::format("{}: cannot create the output directory: {} is not writable ({}); choose "
                                   "another OUT",
                                   out, at.string(), why));
    return;
  }
  if (st.type() == fs::file_type::none || st.type() == fs::file_type::unknown)
    throw InputError(fmt::format("{}: cannot check the output directory: {}", out, ec.message()));
  if (st.type() != fs::file_type::directory)
    throw InputError(fmt::format("{}: exists and is {}, not a directory: choose a new or empty directory for "
                                 "OUT (--force replaces files in a directory only)",
                                 out, file_type_name(st.type())));
  const std::string why = not_writable(out);
  if (!why.empty())
    throw InputError(fmt::format("{}: the output directory is not writable ({}); choose another OUT", out, why));
  std::vector<std::string> held;
  for (fs::directory_iterator it(out, ec), end; !ec && it != end; it.increment(ec))
    held.push_back(it->path().filename().string());
  if (ec) throw InputError(fmt::format("{}: cannot list the output directory: {}", out, ec.message()));
  if (!held.empty() && !force) {
    std::sort(held.begin(), held.end());
    std::string list;
    for (size_t i = 0; i < held.size() && i < 3; ++i) list += (i ? ", " : "") + held[i];
    if (held.size() > 3) list += fmt::format(" and {} more", held.size() - 3);
    throw InputError(can_force ? fmt::format("{}: the output directory is not empty (it holds {}): pass --force to "
                                             "replace model.safetensors and config.json in it, or choose an empty or "
                                             "new directory", out, list)
                               : fmt::format("{}: the output directory is not empty (it holds {}): choose an empty or "
                                             "new directory", out, list));
  }
  for (const char* name : {"model.safetensors", "config.json"}) {
    const fs::path p = fs::path(out) / name;
    const fs::file_status f = fs::status(p, ec);
    if (f.type() != fs::file_type::not_found && f.type() != fs::file_type::regular)
      throw InputError(fmt::format("{}: exists and is {}: --force replaces regular files only; remove it or "
                                   "choose another OUT",
                                   p.string(), file_type_name(f.type())));
  }
}

}  // namespace tetra
