// JSON <-> Config: the list of keys, their types and defaults, the type checks, and the hunt for
// unknown keys.
//
// Every key is named exactly once, in the visit_* functions below. The same visit drives both
// directions: a SectionReader pulls each key out of the JSON (checking its type, leaving the
// default in place when the key is absent or wrong), a SectionWriter puts each field into the
// JSON. So config_to_json cannot forget a key that parsing knows, and the set of keys the reader
// asked for is exactly the set of known keys that unknown-key detection compares against.
//
// Types are strict: an integer field takes only a JSON integer (not 4.5, 4.0, "4" or true), a
// float field takes any finite JSON number, a bool only true/false, an enum one of its spellings
// (config.h). A value of the wrong type leaves the default in place and is reported.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
#include <map>

#include <fmt/format.h>

#include "trainer/config/config_detail.h"

namespace tetra::config_detail {
namespace {

// ---- the schema: every key of every section, in the order they are documented ---------------

template <class M, class V>
void visit_moe(M& m, V& v) {
  v.integer("num_experts", m.num_experts);
  v.integer("top_k", m.top_k);
  v.integer("every", m.every);
  v.integer("ffn_hidden_size", m.ffn_hidden_size);
  v.optional_number("capacity_factor", m.capacity_factor);
  v.optional_number("max_load_factor", m.max_load_factor);
  v.boolean("router_pre_softmax", m.router_pre_softmax);
  v.choice("router_score_function", m.router_score_function);
  v.boolean("router_enable_expert_bias", m.router_enable_expert_bias);
  v.number("router_bias_update_rate", m.router_bias_update_rate);
  v.optional_number("router_topk_scaling_factor", m.router_topk_scaling_factor);
  v.integer("first_k_dense_replace", m.first_k_dense_replace);
  v.integer("shared_expert_ffn_hidden_size", m.shared_expert_ffn_hidden_size);
  v.boolean("shared_expert_gate", m.shared_expert_gate);
  v.number("aux_loss_coeff", m.aux_loss_coeff);
  v.number("z_loss_coeff", m.z_loss_coeff);
}

template <class M, class V>
void visit_model(M& m, V& v) {
  v.integer("vocab_size", m.vocab_size);
  v.integer("make_vocab_size_divisible_by", m.make_vocab_size_divisible_by);
  v.integer("seq_len", m.seq_len);
  v.integer("num_layers", m.num_layers);
  v.integer("hidden_size", m.hidden_size);
  v.integer("num_heads", m.num_heads);
  v.integer("num_kv_heads", m.num_kv_heads);
  v.integer("head_dim", m.head_dim);
  v.integer("ffn_hidden_size", m.ffn_hidden_size);
  v.choice("norm", m.norm);
  v.number("norm_eps", m.norm_eps);
  v.choice("activation", m.activation);
  v.choice("position", m.position);
  v.number("rope_theta", m.rope_theta);
  v.object("rope_scaling", m.rope_scaling, [](auto& s, auto& sv) {
    sv.choice("type", s.type);
    sv.number("factor", s.factor);
    sv.number("low_freq_factor", s.low_freq_factor);
    sv.number("high_freq_factor", s.high_freq_factor);
    sv.integer("original_max_position_embeddings", s.original_max_position_embeddings);
  });
  v.boolean("tie_embeddings", m.tie_embeddings);
  v.boolean("bias", m.bias);
  v.boolean("qkv_bias", m.qkv_bias);
  v.boolean("qk_norm", m.qk_norm);
  v.number("init_std", m.init_std);
  v.object("moe", m.moe, [](auto& s, auto& sv) { visit_moe(s, sv); });
}

template <class P, class V>
void visit_parallel(P& p, V& v) {
  v.integer("dp", p.dp);
  v.integer("tp", p.tp);
  v.integer("pp", p.pp);
  v.integer("ep", p.ep);
  v.optional_integer("etp", p.etp);
  v.integer("ep_overlap_chunks", p.ep_overlap_chunks);
  v.integer("cp", p.cp);
  v.choice("cp_comm", p.cp_comm);
  v.choice("order", p.order);
  v.boolean("sequence_parallel", p.sequence_parallel);
  v.boolean("distributed_optimizer", p.distributed_optimizer, p.distributed_optimizer_given);
  v.integer("zero_stage", p.zero_stage);
  v.optional_boolean("reshard_after_forward", p.reshard_after_forward);
  v.integer("bucket_size", p.bucket_size);
  v.choice("schedule", p.schedule);
  v.integer("virtual_stages", p.virtual_stages);
  v.integers("stage_layers", p.stage_layers);
  v.choice("grad_compression", p.grad_compression);
  v.integer("onebit_warmup_steps", p.onebit_warmup_steps);
}

template <class T, class V>
void visit_training(T& t, V& v) {
  v.choice("device", t.device);
  v.choice("precision", t.precision);
  v.number("loss_scale", t.loss_scale);
  v.number("initial_loss_scale", t.initial_loss_scale);
  v.integer("loss_scale_window", t.loss_scale_window);
  v.number("min_loss_scale", t.min_loss_scale);
  v.integer("hysteresis", t.hysteresis);
  v.integer("micro_batch_size", t.micro_batch_size);
  v.integer("global_batch_size", t.global_batch_size);
  v.integer("steps", t.steps);
  v.integer("seed", t.seed);
  v.integer("eval_every", t.eval_every);
  v.integer("eval_steps", t.eval_steps);
  v.integer("log_every", t.log_every);
  v.integer("threads", t.threads);
  v.number("peak_gflops", t.peak_gflops);
  v.integer("exit_interval", t.exit_interval);
  v.number("exit_after_min", t.exit_after_min);
  v.number("collective_timeout_s", t.collective_timeout_s);
  v.integer("max_skipped_steps", t.max_skipped_steps);
  v.number("spike_zscore", t.spike_zscore);
  v.integer("spike_window", t.spike_window);
  v.integers("profile_steps", t.profile_steps);
  v.choice("recompute", t.recompute);
  v.choices("recompute_modules", t.recompute_modules);
  v.choice("recompute_method", t.recompute_method);
  v.integer("recompute_num_layers", t.recompute_num_layers);
  v.integer("loss_chunk_rows", t.loss_chunk_rows);
}

template <class O, class V>
void visit_optimizer(O& o, V& v) {
  v.number("lr", o.lr);
  v.number("min_lr", o.min_lr);
  v.integer("warmup_steps", o.warmup_steps);
  v.choice("decay", o.decay);
  v.integer("decay_steps", o.decay_steps);
  v.number("weight_decay", o.weight_decay);
  v.number("beta1", o.beta1);
  v.number("beta2", o.beta2);
  v.number("eps", o.eps);
  v.number("grad_clip", o.grad_clip);
}

template <class D, class V>
void visit_data(D& d, V& v) {
  v.boolean("synthetic", d.synthetic);
  v.sources("train", d.train);
  v.sources("valid", d.valid);
  v.text("split", d.split);
  v.tokenizer("tokenizer", d.tokenizer);
}

template <class S, class V>
void visit_sample(S& s, V& v) {
  v.text("prompt", s.prompt);
  v.integer("max_tokens", s.max_tokens);
  v.number("temperature", s.temperature);
  v.integer("top_k", s.top_k);
  v.integer("seed", s.seed);
}

template <class K, class V>
void visit_checkpoint(K& k, V& v) {
  v.text("dir", k.dir);
  v.integer("every", k.every);
  v.integer("keep", k.keep);
  v.resume("resume", k.resume);
  v.text("init", k.init);
  v.boolean("save_on_exit", k.save_on_exit);
}

template <class L, class V>
void visit_logging(L& l, V& v) {
  v.text("dir", l.dir);
  v.choice("level", l.level);
  v.boolean("tensorboard", l.tensorboard);
  v.number("straggler_factor", l.straggler_factor);
  v.integer("straggler_window", l.straggler_window);
}

// Calls f(section name, section struct, visit function) for each section, in section_names() order.
template <class C, class F>
void for_each_section(C& c, F&& f) {
  f("model", c.model, [](auto& s, auto& v) { visit_model(s, v); });
  f("parallel", c.parallel, [](auto& s, auto& v) { visit_parallel(s, v); });
  f("training", c.training, [](auto& s, auto& v) { visit_training(s, v); });
  f("optimizer", c.optimizer, [](auto& s, auto& v) { visit_optimizer(s, v); });
  f("data", c.data, [](auto& s, auto& v) { visit_data(s, v); });
  f("sample", c.sample, [](auto& s, auto& v) { visit_sample(s, v); });
  f("checkpoint", c.checkpoint, [](auto& s, auto& v) { visit_checkpoint(s, v); });
  f("logging", c.logging, [](auto& s, auto& v) { visit_logging(s, v); });
}

// ---- suggestions for unknown keys -------------------------------------------------------------

// Names that users of Megatron-LM, Hugging Face configs and llm.c reach for, mapped to ours.
// Only used to suggest; they are not accepted as keys.
const std::map<std::string, std::string>& foreign_names() {
  static const std::map<std::string, std::string> m = {
      {"num_attention_heads", "model.num_heads"},
      {"n_head", "model.num_heads"},
      {"num_query_groups", "model.num_kv_heads"},
      {"num_key_value_heads", "model.num_kv_heads"},
      {"n_kv_head", "model.num_kv_heads"},
      {"n_layer", "model.num_layers"},
      {"num_hidden_layers", "model.num_layers"},
      {"n_embd", "model.hidden_size"},
      {"d_model", "model.hidden_size"},
      {"intermediate_size", "model.ffn_hidden_size"},
      {"max_position_embeddings", "model.seq_len"},
      {"seq_length", "model.seq_len"},
      {"n_positions", "model.seq_len"},
      {"block_size", "model.seq_len"},
      {"max_seq_len", "model.seq_len"},
      {"padded_vocab_size", "model.vocab_size"},
      {"normalization", "model.norm"},
      {"layernorm_epsilon", "model.norm_eps"},
      {"norm_epsilon", "model.norm_eps"},
      {"rms_norm_eps", "model.norm_eps"},
      {"layer_norm_epsilon", "model.norm_eps"},
      {"position_embedding_type", "model.position"},
      {"rotary_base", "model.rope_theta"},
      {"init_method_std", "model.init_std"},
      {"initializer_range", "model.init_std"},
      {"tie_word_embeddings", "model.tie_embeddings"},
      {"add_bias_linear", "model.bias"},
      {"hidden_act", "model.activation"},
      {"swiglu", "model.activation"},
      {"tensor_model_parallel_size", "parallel.tp"},
      {"pipeline_model_parallel_size", "parallel.pp"},
      {"virtual_pipeline_model_parallel_size", "parallel.virtual_stages"},
      {"num_layers_per_virtual_pipeline_stage", "parallel.virtual_stages"},
      {"decoder_first_pipeline_num_layers", "parallel.stage_layers"},
      {"pipeline_model_parallel_layout", "parallel.stage_layers"},
      {"expert_model_parallel_size", "parallel.ep"},
      {"expert_tensor_parallel_size", "parallel.etp"},
      {"num_moe_experts", "model.moe.num_experts"},
      {"num_local_experts", "model.moe.num_experts"},
      {"moe_router_topk", "model.moe.top_k"},
      {"num_experts_per_tok", "model.moe.top_k"},
      {"moe_layer_freq", "model.moe.every"},
      {"moe_ffn_hidden_size", "model.moe.ffn_hidden_size"},
      {"moe_expert_capacity_factor", "model.moe.capacity_factor"},
      {"moe_aux_loss_coeff", "model.moe.aux_loss_coeff"},
      {"router_aux_loss_coef", "model.moe.aux_loss_coeff"},
      {"moe_z_loss_coeff", "model.moe.z_loss_coeff"},
      {"moe_router_pre_softmax", "model.moe.router_pre_softmax"},
      {"moe_router_score_function", "model.moe.router_score_function"},
      {"scoring_func", "model.moe.router_score_function"},
      {"moe_router_enable_expert_bias", "model.moe.router_enable_expert_bias"},
      {"moe_router_bias_update_rate", "model.moe.router_bias_update_rate"},
      {"moe_router_topk_scaling_factor", "model.moe.router_topk_scaling_factor"},
      {"routed_scaling_factor", "model.moe.router_topk_scaling_factor"},
      {"moe_shared_expert_intermediate_size", "model.moe.shared_expert_ffn_hidden_size"},
      {"shared_expert_intermediate_size", "model.moe.shared_expert_ffn_hidden_size"},
      {"moe_shared_expert_gate", "model.moe.shared_expert_gate"},
      {"data_parallel_size", "parallel.dp"},
      {"context_parallel_size", "parallel.cp"},
      {"cp_comm_type", "parallel.cp_comm"},
      {"sequence_parallel", "parallel.sequence_parallel"},
      {"use_distributed_optimizer", "parallel.distributed_optimizer"},
      {"ddp_bucket_size", "parallel.bucket_size"},
      {"save", "checkpoint.dir"},
      {"load", "checkpoint.resume"},
      {"save_interval", "checkpoint.every"},
      {"exit_interval", "training.exit_interval"},
      {"train_iters", "training.steps"},
      {"max_steps", "training.steps"},
      {"num_iterations", "training.steps"},
      {"log_interval", "training.log_every"},
      {"eval_interval", "training.eval_every"},
      {"eval_iters", "training.eval_steps"},
      {"bf16", "training.precision"},
      {"fp16", "training.precision"},
      {"batch_size", "training.micro_batch_size"},
      {"total_batch_size", "training.global_batch_size"},
      {"learning_rate", "optimizer.lr"},
      {"adam_beta1", "optimizer.beta1"},
      {"adam_beta2", "optimizer.beta2"},
      {"adam_eps", "optimizer.eps"},
      {"clip_grad", "optimizer.grad_clip"},
      {"max_grad_norm", "optimizer.grad_clip"},
      {"lr_warmup_iters", "optimizer.warmup_steps"},
      {"warmup_iters", "optimizer.warmup_steps"},
      {"lr_decay_style", "optimizer.decay"},
      {"lr_decay_iters", "optimizer.decay_steps"},
      {"data_path", "data.train"},
      {"train_data_path", "data.train"},
      {"valid_data_path", "data.valid"},
      {"mock_data", "data.synthetic"},
      {"log_level", "logging.level"},
      {"log_dir", "logging.dir"},
      {"tensorboard_dir", "logging.dir"},
  };
  return m;
}

std::string normalise(const std::string& s) {
  std::string out;
  for (char ch : s)
    out += ch == '-' ? '_' : static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  return out;
}

// Optimal string alignment distance: insertions, deletions, substitutions, adjacent swaps.
size_t edit_distance(const std::string& a, const std::string& b) {
  const size_t n = a.size(), m = b.size();
  std::vector<std::vector<size_t>> d(n + 1, std::vector<size_t>(m + 1));
  for (size_t i = 0; i <= n; ++i) d[i][0] = i;
  for (size_t j = 0; j <= m; ++j) d[0][j] = j;
  for (size_t i = 1; i <= n; ++i)
    for (size_t j = 1; j <= m; ++j) {
      const size_t cost = a[i - 1] == b[j - 1] ? 0 : 1;
      d[i][j] = std::min({d[i - 1][j] + 1, d[i][j - 1] + 1, d[i - 1][j - 1] + cost});
      if (i > 1 && j > 1 && a[i - 1] == b[j - 2] && a[i - 2] == b[j - 1])
        d[i][j] = std::min(d[i][j], d[i - 2][j - 2] + 1);
    }
  return d[n][m];
}

// Known keys, per section, as the reader asked for them.
using KnownKeys = std::map<std::string, std::vector<std::string>>;

// The suggestion for an unknown `key` found in `section` ("" at the top level), or "".
std::string suggest(const std::string& section, const std::string& key, const KnownKeys& known) {
  const std::string k = normalise(key);
  // The exact name of a key that lives in another section: it was put in the wrong place.
  for (const std::string& s : section_names())
    for (const std::string& name : known.at(s))
      if (name == k && s != section) return s + "." + name;
  if (section.empty()) {
    const std::string s = closest(key, section_names());
    if (!s.empty()) return s;
  } else {
    const std::string s = closest(key, known.at(section));
    if (!s.empty()) return section + "." + s;
  }
  const auto foreign = foreign_names().find(k);
  if (foreign != foreign_names().end()) return foreign->second;
  for (const std::string& s : section_names()) {
    if (s == section) continue;
    const std::string c = closest(key, known.at(s));
    if (!c.empty()) return s + "." + c;
  }
  return "";
}

std::string did_you_mean(const std::string& suggestion) {
  return suggestion.empty() ? "" : "; did you mean \"" + suggestion + "\"?";
}

// ---- reading ----------------------------------------------------------------------------------

class SectionReader {
 public:
  SectionReader(const json* section, std::string name, Problems& problems)
      : section_(section), name_(std::move(name)), problems_(problems) {}

  void integer(const char* key, int64_t& out) {
    const json* v = find(key);
    if (!v) return;
    if (v->is_number_unsigned() &&
        v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      problems_.add(path(key), show(*v), "out of range for a 64-bit integer");
    else if (v->is_number_integer())
      out = v->get<int64_t>();
    else
      problems_.add(path(key), show(*v), "expected an integer, got " + type_phrase(*v));
  }

  void integer(const char* key, uint64_t& out) {
    const json* v = find(key);
    if (!v) return;
    if (v->is_number_unsigned())
      out = v->get<uint64_t>();
    else if (v->is_number_integer())
      problems_.add(path(key), show(*v), "must be >= 0");
    else
      problems_.add(path(key), show(*v), "expected an integer, got " + type_phrase(*v));
  }

  void number(const char* key, double& out) {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_number())
      problems_.add(path(key), show(*v), "expected a number, got " + type_phrase(*v));
    else if (!std::isfinite(v->get<double>()))
      problems_.add(path(key), show(*v), "must be a finite number");
    else
      out = v->get<double>();
  }

  // A number, or null (the field's "off" state, std::nullopt).
  void optional_number(const char* key, std::optional<double>& out) {
    const json* v = find(key);
    if (!v) return;
    if (v->is_null()) {
      out.reset();
      return;
    }
    double d = 0.0;
    keys_.pop_back();  // number() records the key again
    number(key, d);
    if (v->is_number() && std::isfinite(v->get<double>())) out = d;
  }

  // An integer, or null (unset: the default's rule decides).
  void optional_integer(const char* key, std::optional<int64_t>& out) {
    const json* v = find(key);
    if (!v) return;
    if (v->is_null()) {
      out.reset();
      return;
    }
    int64_t i = 0;
    keys_.pop_back();  // integer() records the key again
    integer(key, i);
    if (v->is_number_integer() && !(v->is_number_unsigned() &&
                                    v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())))
      out = i;
  }

  // A nested object read by `visit` (its unknown keys reported with their full path).
  template <class S, class F>
  void object(const char* key, S& out, F&& visit) {
    const json* v = find(key);
    if (v && !v->is_object()) {
      problems_.add(path(key), show(*v), "expected an object, got " + type_phrase(*v));
      return;
    }
    SectionReader sub(v, path(key), problems_);
    visit(out, sub);
    sub.report_unknown_keys();
  }

  // true, false, or null (unset: the default's rule decides).
  void optional_boolean(const char* key, std::optional<bool>& out) {
    const json* v = find(key);
    if (!v) return;
    if (v->is_null())
      out.reset();
    else if (v->is_boolean())
      out = v->get<bool>();
    else
      problems_.add(path(key), show(*v), "expected true, false or null, got " + type_phrase(*v));
  }

  void boolean(const char* key, bool& out) {
    const json* v = find(key);
    if (!v) return;
    if (v->is_boolean())
      out = v->get<bool>();
    else
      problems_.add(path(key), show(*v), "expected true or false, got " + type_phrase(*v));
  }

  // The same, and whether the key is there (a rule refuses some explicit values it would
  // otherwise resolve).
  void boolean(const char* key, bool& out, bool& given) {
    given = section_ != nullptr && section_->contains(key);
    boolean(key, out);
  }

  void text(const char* key, std::string& out) {
    const json* v = find(key);
    if (!v) return;
    if (v->is_string())
      out = v->get<std::string>();
    else
      problems_.add(path(key), show(*v), "expected a string, got " + type_phrase(*v));
  }

  // E's spellings, "a, b, c".
  template <ConfigEnum E>
  static std::string spellings() {
    std::string list;
    for (const std::string& c : enum_names<E>()) list += (list.empty() ? "" : ", ") + c;
    return list;
  }
  // The value `v` (at `at`) spells, or nullopt with the problem reported.
  template <ConfigEnum E>
  std::optional<E> spelling_of(const json& v, const std::string& at) {
    if (!v.is_string()) {
      problems_.add(at, show(v), "expected a string, got " + type_phrase(v));
      return std::nullopt;
    }
    const std::string s = v.get<std::string>();
    if (const std::optional<E> e = enum_from_string<E>(s)) return e;
    problems_.add(at, show(v), "must be one of " + spellings<E>() + did_you_mean(closest(s, enum_names<E>())));
    return std::nullopt;
  }

  // One of an enumerated key's spellings (config.h's EnumNames).
  template <ConfigEnum E>
  void choice(const char* key, E& out) {
    const json* v = find(key);
    if (!v) return;
    if (const std::optional<E> e = spelling_of<E>(*v, path(key))) out = *e;
  }

  // A list of an enum's spellings, e.g. ["norm", "act"] (each once).
  template <ConfigEnum E>
  void choices(const char* key, std::vector<E>& out) {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_array()) {
      problems_.add(path(key), show(*v),
                    "expected a list of strings from " + spellings<E>() + ", got " + type_phrase(*v));
      return;
    }
    std::vector<E> got;
    for (size_t i = 0; i < v->size(); ++i) {
      const std::string at = path(key) + "[" + std::to_string(i) + "]";
      const std::optional<E> value = spelling_of<E>((*v)[i], at);
      if (!value) return;
      if (std::find(got.begin(), got.end(), *value) != got.end()) {
        problems_.add(at, show((*v)[i]), "is listed twice: name each once");
        return;
      }
      got.push_back(*value);
    }
    out = std::move(got);
  }

  // "gpt2:<dir>", "sentencepiece:<file>", "hf:<dir>" or "" (none).
  void tokenizer(const char* key, TokenizerSpec& out) {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_string()) {
      problems_.add(path(key), show(*v), "expected a string, got " + type_phrase(*v));
      return;
    }
    if (const std::optional<TokenizerSpec> t = parse_tokenizer_spec(v->get<std::string>()))
      out = *t;
    else
      problems_.add(path(key), show(*v),
                    "must be \"gpt2:<directory with encoder.json and vocab.bpe>\", \"sentencepiece:<model file>\" "
                    "or \"hf:<directory with tokenizer.json>\"");
  }

  // "auto", "none" or a checkpoint's path (an empty one is rejected by the rules).
  void resume(const char* key, ResumeSpec& out) {
    const json* v = find(key);
    if (!v) return;
    if (v->is_string())
      out = parse_resume_spec(v->get<std::string>());
    else
      problems_.add(path(key), show(*v), "expected a string, got " + type_phrase(*v));
  }

  // A list of integers, e.g. [5, 4, 4, 3].
  void integers(const char* key, std::vector<int64_t>& out) {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_array()) {
      problems_.add(path(key), show(*v), "expected a list of integers, e.g. [5, 4, 4, 3], got " + type_phrase(*v));
      return;
    }
    std::vector<int64_t> got;
    for (size_t i = 0; i < v->size(); ++i) {
      const json& e = (*v)[i];
      if (!e.is_number_integer()) {
        problems_.add(path(key) + "[" + std::to_string(i) + "]", show(e), "expected an integer, got " + type_phrase(e));
        return;
      }
      got.push_back(e.get<int64_t>());
    }
    out = std::move(got);
  }

  // A list of datasets: each entry "prefix" (weight 1) or {"path": "prefix", "weight": w}.
  void sources(const char* key, std::vector<DataSource>& out) {
    const json* v = find(key);
    if (!v) return;
    if (!v->is_array()) {
      problems_.add(
          path(key), show(*v),
          "expected a list of datasets, e.g. [\"data/train_text\"], got " + type_phrase(*v));
      return;
    }
    out.clear();
    for (size_t i = 0; i < v->size(); ++i) {
      const json& e = (*v)[i];
      const std::string at = path(key) + "[" + std::to_string(i) + "]";
      DataSource src;
      if (e.is_string()) {
        src.path = e.get<std::string>();
      } else if (e.is_object()) {
        SectionReader entry(&e, at, problems_);
        if (!e.contains("path"))
          problems_.add_plain(at + ".path", "missing; every dataset needs a path");
        entry.text("path", src.path);
        entry.number("weight", src.weight);
        entry.report_unknown_keys();
      } else {
        problems_.add(
            at, show(e),
            "expected a path string or {\"path\": ..., \"weight\": ...}, got " + type_phrase(e));
      }
      out.push_back(src);
    }
  }

  const std::vector<std::string>& keys() const { return keys_; }

  // Keys of this object that no field asked for, with a suggestion among this object's keys.
  void report_unknown_keys() {
    if (!section_) return;
    for (const auto& [key, value] : section_->items())
      if (std::find(keys_.begin(), keys_.end(), key) == keys_.end())
        problems_.add_plain(path(key), "unknown key" + did_you_mean(suggest_local(key)));
  }

 private:
  const json* find(const char* key) {
    keys_.push_back(key);
    if (!section_) return nullptr;
    const auto it = section_->find(key);
    return it == section_->end() ? nullptr : &*it;
  }
  std::string path(const std::string& key) const { return name_ + "." + key; }
  std::string suggest_local(const std::string& key) const {
    const std::string s = closest(key, keys_);
    return s.empty() ? "" : path(s);
  }

  const json* section_;  // null: the section is absent, every key keeps its default
  std::string name_;
  Problems& problems_;
  std::vector<std::string> keys_;
};

// ---- writing ----------------------------------------------------------------------------------

class SectionWriter {
 public:
  explicit SectionWriter(json& out) : out_(out) {}
  void integer(const char* key, const int64_t& v) { out_[key] = v; }
  void integer(const char* key, const uint64_t& v) { out_[key] = v; }
  void number(const char* key, const double& v) { out_[key] = v; }
  void boolean(const char* key, const bool& v) { out_[key] = v; }
  void boolean(const char* key, const bool& v, const bool&) { out_[key] = v; }
  void optional_boolean(const char* key, const std::optional<bool>& v) { out_[key] = v ? json(*v) : json(nullptr); }
  void optional_number(const char* key, const std::optional<double>& v) {
    out_[key] = v ? json(*v) : json(nullptr);
  }
  void optional_integer(const char* key, const std::optional<int64_t>& v) {
    out_[key] = v ? json(*v) : json(nullptr);
  }
  template <class S, class F>
  void object(const char* key, const S& v, F&& visit) {
    json sub = json::object();
    SectionWriter w(sub);
    visit(v, w);
    out_[key] = sub;
  }
  void text(const char* key, const std::string& v) { out_[key] = v; }
  void integers(const char* key, const std::vector<int64_t>& v) { out_[key] = v; }
  template <ConfigEnum E>
  void choice(const char* key, const E& v) { out_[key] = std::string(to_string(v)); }
  template <ConfigEnum E>
  void choices(const char* key, const std::vector<E>& v) {
    json list = json::array();
    for (E e : v) list.push_back(std::string(to_string(e)));
    out_[key] = list;
  }
  void tokenizer(const char* key, const TokenizerSpec& v) { out_[key] = to_string(v); }
  void resume(const char* key, const ResumeSpec& v) { out_[key] = to_string(v); }
  void sources(const char* key, const std::vector<DataSource>& v) {
    json list = json::array();
    for (const DataSource& s : v) list.push_back({{"path", s.path}, {"weight", s.weight}});
    out_[key] = list;
  }

 private:
  json& out_;
};

}  // namespace

// ---- shared helpers ---------------------------------------------------------------------------

std::string show(const json& v) {
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

std::string type_phrase(const json& v) {
  switch (v.type()) {
    case json::value_t::null:
      return "null";
    case json::value_t::boolean:
      return "a boolean";
    case json::value_t::string:
      return "a string";
    case json::value_t::array:
      return "a list";
    case json::value_t::object:
      return "an object";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned:
      return "an integer";
    case json::value_t::number_float:
      return "a floating-point number";
    default:
      return "an unsupported value";
  }
}

std::string closest(const std::string& word, const std::vector<std::string>& candidates) {
  const std::string w = normalise(word);
  std::string best;
  size_t best_d = std::numeric_limits<size_t>::max();
  for (const std::string& c : candidates) {
    const size_t d = edit_distance(w, normalise(c));
    if (d < best_d) best_d = d, best = c;
  }
  if (best.empty()) return "";
  // Plausible typos only: one edit for very short names, up to three for long ones.
  const size_t len = std::max(w.size(), best.size());
  const size_t allowed = len <= 3 ? 1 : len <= 6 ? 2 : 3;
  return best_d <= allowed && best_d < len ? best : "";
}

Config parse_config(const json& j, Problems& problems) {
  Config c;
  if (!j.is_object()) {
    problems.add("config", show(j),
                 "expected an object with the sections model, parallel, training, optimizer, data, "
                 "logging; got " +
                     type_phrase(j));
    return c;
  }
  KnownKeys known;
  for_each_section(c, [&](const std::string& name, auto& section, auto visit) {
    const auto it = j.find(name);
    const json* obj = nullptr;
    if (it != j.end()) {
      if (it->is_object())
        obj = &*it;
      else
        problems.add(name, show(*it), "expected an object, got " + type_phrase(*it));
    }
    SectionReader reader(obj, name, problems);
    visit(section, reader);
    known[name] = reader.keys();
  });
  // Unknown keys are reported once every known key is known, so a key put in the wrong section
  // can be pointed to where it belongs.
  for (size_t s = 0; s < section_names().size(); ++s) {
    const std::string& name = section_names()[s];
    const auto it = j.find(name);
    if (it == j.end() || !it->is_object()) continue;
    for (const auto& [key, value] : it->items())
      if (std::find(known[name].begin(), known[name].end(), key) == known[name].end())
        problems.add_plain(name + "." + key,
                           "unknown key" + did_you_mean(suggest(name, key, known)));
  }
  for (const auto& [key, value] : j.items()) {
    if (std::find(section_names().begin(), section_names().end(), key) != section_names().end())
      continue;
    // "model.hidden_size" written as a top-level key: the file wants nesting, not a dotted name.
    const size_t dot = key.find('.');
    const auto section = dot == std::string::npos ? known.end() : known.find(key.substr(0, dot));
    if (section != known.end()) {
      const std::string rest = key.substr(dot + 1);
      problems.add_plain(key, fmt::format("unknown section; keys are nested in their section: "
                                          "{{\"{}\": {{\"{}\": ...}}}}",
                                          section->first, rest));
      continue;
    }
    problems.add_plain(key, "unknown section" + did_you_mean(suggest("", key, known)));
  }
  return c;
}

}  // namespace tetra::config_detail

namespace tetra {

nlohmann::json config_to_json(const Config& c) {
  nlohmann::json j = nlohmann::json::object();
  config_detail::for_each_section(c, [&](const std::string& name, const auto& section, auto visit) {
    nlohmann::json s = nlohmann::json::object();
    config_detail::SectionWriter writer(s);
    visit(section, writer);
    j[name] = s;
  });
  return j;
}

}  // namespace tetra
