// The rules a parsed config must satisfy, and the values derived from it.
//
// Three passes, each skipping values that an earlier pass (or the type checks) already rejected:
//   1. ranges of single values (sizes >= 1, 0 <= beta < 1, ...), and features this build cannot
//      run yet (pipeline and expert parallelism, the CUDA device);
//   2. resolution of the "0 = derive it" defaults:
//        model.num_kv_heads      0 -> model.num_heads (plain multi-head attention)
//        model.ffn_hidden_size   0 -> 4 * hidden_size for gelu; for swiglu the Llama rule
//                                     64 * ceil(floor(8 * hidden_size / 3) / 64): two thirds of
//                                     4 * hidden_size (the gate doubles the matrices, so this
//                                     keeps the parameter count of a 4x GELU MLP), rounded up to
//                                     a multiple of 64 (768 -> 2048, 4096 -> 10944)
//        training.global_batch_size   0 -> micro_batch_size * parallel.dp (no accumulation)
//      Resolved values are never 0 again, so resolving a resolved config changes nothing (the
//      round trip config_from_json(config_to_json(c)) == c depends on it).
//      optimizer.decay_steps keeps its 0 (= training.steps - warmup_steps, read so by the LR
//      schedule): resolving it here would freeze the decay horizon into checkpoints, and a resumed
//      run that extends training.steps would stop decaying early.
//   3. cross-field rules (divisibility, data sources, evaluation).
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <iterator>
#include <limits>

#include "trainer/config/config_detail.h"

namespace tetra::config_detail {
namespace {

constexpr int64_t kMaxSize = std::numeric_limits<int32_t>::max();  // token ids are int32
constexpr int64_t kMaxThreads = int64_t{1} << 16;
constexpr int64_t kMaxLayers = int64_t{1} << 16;  // 500 times the deepest published LLM's 126
constexpr double kMaxParameters = 1e15;
constexpr int64_t kMaxSampleTokens = int64_t{1} << 20;
constexpr int64_t kMaxScheduleSlots = int64_t{1} << 22;  // micro-batches x pp x virtual_stages per step

class Rules {
 public:
  explicit Rules(Problems& p) : p_(p) {}

  // Reports `rule` against `path` unless `holds` or `path` already has a problem.
  template <class T>
  void require(bool holds, const std::string& path, const T& value, const std::string& rule) {
    if (!holds && p_.ok(path)) p_.add(path, show(json(value)), rule);
  }

  // Every path is free of problems: the values can be combined in a cross-field rule.
  bool ok(std::initializer_list<std::string> paths) const {
    for (const std::string& path : paths)
      if (!p_.ok(path)) return false;
    return true;
  }

  // A size or count: min <= v <= 2^31 - 1 (so that products of sizes cannot overflow int64).
  void size(const std::string& path, int64_t v, int64_t min) {
    require(v >= min, path, v, fmt::format("must be >= {}", min));
    require(v <= kMaxSize, path, v, fmt::format("must be <= {}", kMaxSize));
  }
  // A parallel degree: 1 <= v <= 2^20.
  void degree(const std::string& path, int64_t v) {
    require(v >= 1, path, v, "must be >= 1");
    require(v <= kMaxRanks, path, v, fmt::format("must be <= {} (2^20)", kMaxRanks));
  }
  void at_least(const std::string& path, int64_t v, int64_t min) {
    require(v >= min, path, v, fmt::format("must be >= {}", min));
  }
  void positive(const std::string& path, double v) { require(v > 0.0, path, v, "must be > 0"); }
  void non_negative(const std::string& path, double v) {
    require(v >= 0.0, path, v, "must be >= 0");
  }

 private:
  Problems& p_;
};

bool ends_with(const std::string& s, const std::string& suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// Pipeline layout: the stages must build exactly the model the config describes; uneven splits
// are given explicitly, never implied.
// Context parallelism: each sequence in 2 cp chunks, rank r keeping chunks r and 2 cp - 1 - r.
void check_context_parallel(const Config& c, Rules& r) {
  const ParallelConfig& p = c.parallel;
  if (!r.ok({"parallel.cp"}) || p.cp == 1) return;
  if (r.ok({"model.seq_len"}))
    r.require(c.model.seq_len % (2 * p.cp) == 0, "parallel.cp", p.cp,
              fmt::format("model.seq_len ({}) must be a multiple of 2 x parallel.cp ({}): each sequence is cut "
                          "into 2 cp equal chunks, CP rank r keeping chunks r and 2 cp - 1 - r so that every "
                          "rank does the same causal work",
                          c.model.seq_len, 2 * p.cp));
  const std::string order(to_string(p.order));
  if (r.ok({"parallel.order"}))
    r.require(order.find("cp") != std::string::npos, "parallel.order", order,
              fmt::format("names no cp axis, but parallel.cp is {}: name all four axes, e.g. \"tp-cp-dp-pp\" "
                          "(the default: CP between TP and DP, as in Megatron-LM)",
                          p.cp));
  // What would make a CP rank's result differ from the whole sequence's.
  if (r.ok({"parallel.grad_compression"}))
    r.require(p.grad_compression == GradCompression::NONE || p.grad_compression == GradCompression::BF16,
              "parallel.grad_compression", p.grad_compression,
              fmt::format("onebit and int8 are not available with context parallelism yet (parallel.cp {}): use "
                          "\"none\" or \"bf16\"",
                          p.cp));
}

void check_pipeline(const Config& c, Rules& r) {
  const ParallelConfig& p = c.parallel;
  if (!r.ok({"parallel.pp", "parallel.virtual_stages", "parallel.schedule", "parallel.stage_layers",
             "model.num_layers"}))
    return;
  const int64_t pp = p.pp, vp = p.virtual_stages, L = c.model.num_layers, stages = pp * vp;
  if (p.schedule == ScheduleKind::INTERLEAVED)
    r.require(pp >= 2, "parallel.schedule", p.schedule,
              fmt::format("the interleaved schedule splits each pipeline rank's layers into chunks and needs "
                          "parallel.pp >= 2 (it is {}); with pp 1 use \"1f1b\" (the default) and "
                          "parallel.virtual_stages 1", pp));
  if (p.schedule == ScheduleKind::INTERLEAVED)
    r.require(vp >= 2, "parallel.virtual_stages", vp,
              "the interleaved schedule needs parallel.virtual_stages >= 2 model chunks per pipeline rank "
              "(with 1 it is the 1f1b schedule)");
  else
    r.require(vp == 1, "parallel.virtual_stages", vp,
              fmt::format("virtual stages need parallel.schedule \"interleaved\" (it is \"{}\")",
                          to_string(p.schedule)));
  if (!r.ok({"parallel.virtual_stages"})) return;
  if (!p.stage_layers.empty()) {
    int64_t sum = 0;
    for (int64_t n : p.stage_layers) sum += n;
    if (static_cast<int64_t>(p.stage_layers.size()) != stages)
      r.require(false, "parallel.stage_layers", p.stage_layers,
                fmt::format("has {} entries, but parallel.pp ({}) x parallel.virtual_stages ({}) = {} stages "
                            "need one each", p.stage_layers.size(), pp, vp, stages));
    else
      r.require(sum == L, "parallel.stage_layers", p.stage_layers,
                fmt::format("adds up to {} layers, but model.num_layers is {}: the stages must hold every "
                            "layer exactly once", sum, L));
  } else if (stages > 1 && L % stages != 0) {
    // The nearest explicit split (the remainder on the first stages), written out while it is short.
    constexpr int64_t kHintStages = 64;
    std::string hint;
    if (stages <= kHintStages) {
      for (int64_t s = 0; s < stages; ++s)
        hint += fmt::format("{}{}", s ? ", " : "", L / stages + (s < L % stages ? 1 : 0));
      hint = fmt::format("e.g. parallel.stage_layers = [{}]", hint);
    } else {
      hint = fmt::format("parallel.stage_layers with {} entries adding up to {}", stages, L);
    }
    r.require(false, "model.num_layers", L,
              fmt::format("does not split evenly over parallel.pp ({}) x parallel.virtual_stages ({}) = {} "
                          "stages ({} / {} = {:.2f} layers each): give the split explicitly, {}",
                          pp, vp, stages, L, stages, static_cast<double>(L) / static_cast<double>(stages), hint));
  }
  if (p.schedule == ScheduleKind::INTERLEAVED && vp >= 2 &&
      r.ok({"training.global_batch_size", "training.micro_batch_size", "parallel.dp"})) {
    const int64_t m = c.grad_accum_steps();
    r.require(m % pp == 0, "training.global_batch_size", c.training.global_batch_size,
              fmt::format("gives {} micro-batches per step (global_batch_size / (micro_batch_size * dp) = "
                          "{} / ({} * {})); the interleaved schedule needs a multiple of parallel.pp ({})",
                          m, c.training.global_batch_size, c.training.micro_batch_size, p.dp, pp));
  }
  if (pp > 1 && r.ok({"sample.prompt"}))
    r.require(c.sample.prompt.empty(), "sample.prompt", c.sample.prompt,
              "text samples during training need the whole model on one rank: leave sample.prompt empty "
              "with parallel.pp > 1 (sample afterwards with `tetra generate` on the final weights)");
}

// fp16 loss scaling: its keys mean something only with precision fp16 (and the dynamic ones only
// with dynamic scaling), so a value other than the default elsewhere is reported rather than
// ignored; and the compressions whose error feedback spans steps are refused with fp16.
void check_loss_scaling(const Config& c, Rules& r) {
  const TrainingConfig& t = c.training;
  const TrainingConfig defaults;
  const bool fp16 = t.precision == Precision::FP16;
  const struct {
    const char* path;
    bool set;  // differs from its default
    json value;
    bool dynamic_only;
  } keys[] = {{"training.loss_scale", t.loss_scale != defaults.loss_scale, t.loss_scale, false},
              {"training.initial_loss_scale", t.initial_loss_scale != defaults.initial_loss_scale,
               t.initial_loss_scale, true},
              {"training.loss_scale_window", t.loss_scale_window != defaults.loss_scale_window,
               t.loss_scale_window, true},
              {"training.min_loss_scale", t.min_loss_scale != defaults.min_loss_scale, t.min_loss_scale, true},
              {"training.hysteresis", t.hysteresis != defaults.hysteresis, t.hysteresis, true}};
  if (!r.ok({"training.precision"})) return;
  for (const auto& k : keys) {
    if (!k.set || !r.ok({k.path})) continue;
    if (!fp16)
      r.require(false, k.path, k.value,
                fmt::format("loss scaling applies to training.precision \"fp16\" only (it is \"{}\", whose "
                            "exponent range is fp32's: nothing to scale); remove {} or set training.precision "
                            "to \"fp16\"", to_string(t.precision), k.path));
    else if (k.dynamic_only && t.loss_scale > 0.0 && r.ok({"training.loss_scale"}))
      r.require(false, k.path, k.value,
                fmt::format("applies to dynamic loss scaling only, but training.loss_scale is {} (a static "
                            "scale); remove {} or set training.loss_scale to 0 (dynamic)",
                            json(t.loss_scale).dump(), k.path));
  }
  if (fp16 && t.loss_scale == 0.0 && r.ok({"training.min_loss_scale", "training.initial_loss_scale"}))
    r.require(t.min_loss_scale <= t.initial_loss_scale, "training.min_loss_scale", t.min_loss_scale,
              fmt::format("must be <= training.initial_loss_scale ({})", json(t.initial_loss_scale).dump()));
  const GradCompression gc = c.parallel.grad_compression;
  if (fp16 && (gc == GradCompression::ONEBIT || gc == GradCompression::INT8) && r.ok({"parallel.grad_compression"}))
    r.require(false, "parallel.grad_compression", gc,
              fmt::format("cannot be combined with training.precision \"fp16\": {}'s error feedback carries "
                          "each step's compression error into later steps, where the loss scale may differ, "
                          "and a step skipped for an fp16 overflow would already have changed it; use "
                          "parallel.grad_compression \"none\" or \"bf16\", or training.precision \"bf16\" "
                          "(which needs no loss scaling)", to_string(gc)));
  if (c.parallel.zero_stage >= 2 && (gc == GradCompression::ONEBIT || gc == GradCompression::INT8) &&
      r.ok({"parallel.grad_compression", "parallel.zero_stage"}))
    r.require(false, "parallel.grad_compression", gc,
              fmt::format("cannot be combined with parallel.zero_stage 2 or 3: they reduce-scatter each "
                          "micro-batch's gradient as backward produces it and keep no whole gradient, while "
                          "{} exchanges the whole gradient of the step itself (with error feedback over all of "
                          "it); use parallel.zero_stage 1 with it, or grad_compression \"bf16\" or \"none\"",
                          to_string(gc)));
}

void check_ranges(const Config& c, Rules& r) {
  const ModelConfig& m = c.model;
  r.size("model.vocab_size", m.vocab_size, 1);
  r.size("model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by, 1);
  r.size("model.seq_len", m.seq_len, 1);
  r.size("model.num_layers", m.num_layers, 1);
  r.require(m.num_layers <= kMaxLayers, "model.num_layers", m.num_layers,
            fmt::format("must be <= {} (2^16; the per-layer tables of the plan and the pipeline grow with it)",
                        kMaxLayers));
  r.size("model.hidden_size", m.hidden_size, 1);
  r.size("model.num_heads", m.num_heads, 1);
  r.size("model.num_kv_heads", m.num_kv_heads, 0);
  r.size("model.ffn_hidden_size", m.ffn_hidden_size, 0);
  r.positive("model.norm_eps", m.norm_eps);
  r.size("model.head_dim", m.head_dim, 0);
  r.positive("model.rope_theta", m.rope_theta);
  r.positive("model.rope_scaling.factor", m.rope_scaling.factor);
  r.positive("model.rope_scaling.low_freq_factor", m.rope_scaling.low_freq_factor);
  r.positive("model.rope_scaling.high_freq_factor", m.rope_scaling.high_freq_factor);
  r.size("model.rope_scaling.original_max_position_embeddings", m.rope_scaling.original_max_position_embeddings, 1);
  r.positive("model.init_std", m.init_std);
  r.size("model.moe.num_experts", m.moe.num_experts, 0);
  r.size("model.moe.top_k", m.moe.top_k, 1);
  r.size("model.moe.every", m.moe.every, 1);
  r.size("model.moe.ffn_hidden_size", m.moe.ffn_hidden_size, 0);
  if (m.moe.capacity_factor)
    r.require(*m.moe.capacity_factor > 0.0, "model.moe.capacity_factor", *m.moe.capacity_factor,
              "must be > 0, or null for dropless routing");
  if (m.moe.max_load_factor) {
    r.require(*m.moe.max_load_factor >= 1.0, "model.moe.max_load_factor", *m.moe.max_load_factor,
              "must be >= 1 (a multiple of the balanced load, tokens x top_k rows per rank), or null for the "
              "default");
    r.require(!m.moe.capacity_factor, "model.moe.max_load_factor", *m.moe.max_load_factor,
              "applies to dropless routing only: with model.moe.capacity_factor the capacity bounds the rows; "
              "remove one of the two");
  }
  if (m.moe.router_topk_scaling_factor)
    r.require(*m.moe.router_topk_scaling_factor > 0.0, "model.moe.router_topk_scaling_factor",
              *m.moe.router_topk_scaling_factor, "must be > 0, or null for 1");
  r.size("model.moe.first_k_dense_replace", m.moe.first_k_dense_replace, 0);
  r.positive("model.moe.router_bias_update_rate", m.moe.router_bias_update_rate);
  if (m.moe.router_score_function == RouterScore::SIGMOID) {
    r.require(m.moe.z_loss_coeff == 0.0, "model.moe.z_loss_coeff", m.moe.z_loss_coeff,
              "the router z-loss is a softmax router's: set it to 0 with model.moe.router_score_function "
              "\"sigmoid\"");
    r.require(m.moe.router_pre_softmax, "model.moe.router_pre_softmax", m.moe.router_pre_softmax,
              "applies to softmax scores: with router_score_function \"sigmoid\" the gates are renormalised "
              "over the top-k whenever top_k > 1; remove the key");
  }
  if (m.moe.router_enable_expert_bias)
    r.require(m.moe.router_score_function == RouterScore::SIGMOID, "model.moe.router_enable_expert_bias", true,
              "needs model.moe.router_score_function \"sigmoid\" (the bias is added to sigmoid scores, as "
              "DeepSeek-V3's and Megatron's)");
  r.size("model.moe.shared_expert_ffn_hidden_size", m.moe.shared_expert_ffn_hidden_size, 0);
  if (m.moe.shared_expert_gate)
    r.require(m.moe.has_shared_expert(), "model.moe.shared_expert_gate", true,
              "gates the shared expert, but model.moe.shared_expert_ffn_hidden_size is 0 (no shared expert): set "
              "it to the shared expert's hidden width, or shared_expert_gate to false");
  r.non_negative("model.moe.aux_loss_coeff", m.moe.aux_loss_coeff);
  r.non_negative("model.moe.z_loss_coeff", m.moe.z_loss_coeff);

  const struct {
    const char* path;
    int64_t value;
    const char* what;
  } degrees[] = {{"parallel.dp", c.parallel.dp, "data"},
                 {"parallel.tp", c.parallel.tp, "tensor"},
                 {"parallel.pp", c.parallel.pp, "pipeline"},
                 {"parallel.ep", c.parallel.ep, "expert"},
                 {"parallel.cp", c.parallel.cp, "context"}};
  for (const auto& d : degrees) r.degree(d.path, d.value);
  r.degree("parallel.virtual_stages", c.parallel.virtual_stages);
  if (r.ok({"parallel.dp", "parallel.tp", "parallel.pp", "parallel.cp"}))
    // In double: four degrees of up to 2^20 each overflow int64.
    r.require(static_cast<double>(c.parallel.tp) * static_cast<double>(c.parallel.cp) *
                      static_cast<double>(c.parallel.pp) * static_cast<double>(c.parallel.dp) <=
                  static_cast<double>(kMaxRanks),
              "parallel.dp", c.parallel.dp,
              fmt::format("parallel.tp x parallel.cp x parallel.pp x parallel.dp = {} x {} x {} x {} ranks; a run "
                          "has at most {} (2^20)",
                          c.parallel.tp, c.parallel.cp, c.parallel.pp, c.parallel.dp, kMaxRanks));
  for (size_t i = 0; i < c.parallel.stage_layers.size(); ++i)
    r.at_least(fmt::format("parallel.stage_layers[{}]", i), c.parallel.stage_layers[i], 0);
  r.at_least("parallel.bucket_size", c.parallel.bucket_size, 1);
  if (r.ok({"parallel.zero_stage"})) {
    r.require(c.parallel.zero_stage >= 0 && c.parallel.zero_stage <= 3, "parallel.zero_stage", c.parallel.zero_stage,
              "must be 0 (no sharding), 1 (optimizer state), 2 (and gradients) or 3 (and weights)");
  }
  // At least one exact Adam step: the frozen variance is the one of the last warm-up step.
  r.at_least("parallel.onebit_warmup_steps", c.parallel.onebit_warmup_steps, 1);

  const TrainingConfig& t = c.training;
#if !defined(TETRA_HAVE_CUDA)
  r.require(t.device != Device::CUDA, "training.device", t.device,
            "this tetra was built without the CUDA backend (no nvcc found, or -DTETRA_CUDA=OFF): rebuild "
            "with -DTETRA_CUDA=ON where the CUDA Toolkit is installed, or set training.device to \"cpu\"");
#endif
  r.size("training.micro_batch_size", t.micro_batch_size, 1);
  r.size("training.global_batch_size", t.global_batch_size, 0);
  r.at_least("training.steps", t.steps, 1);
  r.at_least("training.eval_every", t.eval_every, 0);
  r.size("training.eval_steps", t.eval_steps, 0);
  r.at_least("training.log_every", t.log_every, 1);
  r.at_least("training.threads", t.threads, 0);
  r.require(t.threads <= kMaxThreads, "training.threads", t.threads,
            fmt::format("must be <= {} (CPU threads per rank; 0 uses every core)", kMaxThreads));
  r.non_negative("training.peak_gflops", t.peak_gflops);
  r.at_least("training.exit_interval", t.exit_interval, 0);
  r.non_negative("training.exit_after_min", t.exit_after_min);
  r.non_negative("training.collective_timeout_s", t.collective_timeout_s);
  r.at_least("training.max_skipped_steps", t.max_skipped_steps, 0);
  r.non_negative("training.loss_scale", t.loss_scale);
  r.positive("training.initial_loss_scale", t.initial_loss_scale);
  r.positive("training.min_loss_scale", t.min_loss_scale);
  for (const auto& [path, v] : {std::pair{"training.loss_scale", t.loss_scale},
                                {"training.initial_loss_scale", t.initial_loss_scale},
                                {"training.min_loss_scale", t.min_loss_scale}})
    r.require(v <= kMaxLossScale, path, v, "must be <= 2^64 (18446744073709551616)");
  r.at_least("training.loss_scale_window", t.loss_scale_window, 1);
  r.at_least("training.hysteresis", t.hysteresis, 1);
  r.non_negative("training.spike_zscore", t.spike_zscore);
  r.at_least("training.spike_window", t.spike_window, 2);
  if (!t.profile_steps.empty()) {
    const std::vector<int64_t>& p = t.profile_steps;
    r.require(p.size() == 2, "training.profile_steps", p, "must be [first, last], two 1-based steps");
    if (p.size() == 2) {
      r.require(p[0] >= 1 && p[0] <= p[1], "training.profile_steps", p, "must be [first, last] with 1 <= first <= last");
      r.require(p[1] <= t.steps, "training.profile_steps", p,
                fmt::format("its last step lies beyond training.steps ({})", t.steps));
    }
    r.require(!c.logging.dir.empty(), "training.profile_steps", p,
              "needs logging.dir: the timelines are written to logging.dir/trace/rank_R.json");
  }
  r.require(c.logging.straggler_factor == 0.0 || c.logging.straggler_factor > 1.0, "logging.straggler_factor",
            c.logging.straggler_factor, "must be > 1 (how many times the median a straggler's step takes), or 0: off");
  r.at_least("logging.straggler_window", c.logging.straggler_window, 0);
  r.require(c.logging.straggler_window <= 10000, "logging.straggler_window", c.logging.straggler_window,
            "must be <= 10000 (steps in a row)");

  const OptimizerConfig& o = c.optimizer;
  r.positive("optimizer.lr", o.lr);
  r.non_negative("optimizer.min_lr", o.min_lr);
  r.at_least("optimizer.warmup_steps", o.warmup_steps, 0);
  r.at_least("optimizer.decay_steps", o.decay_steps, 0);
  r.non_negative("optimizer.weight_decay", o.weight_decay);
  r.require(o.beta1 >= 0.0 && o.beta1 < 1.0, "optimizer.beta1", o.beta1, "must be in [0, 1)");
  r.require(o.beta2 >= 0.0 && o.beta2 < 1.0, "optimizer.beta2", o.beta2, "must be in [0, 1)");
  r.positive("optimizer.eps", o.eps);
  r.non_negative("optimizer.grad_clip", o.grad_clip);

  r.at_least("checkpoint.every", c.checkpoint.every, 0);
  r.at_least("checkpoint.keep", c.checkpoint.keep, 0);
  r.require(!(c.checkpoint.resume.kind == ResumeKind::PATH && c.checkpoint.resume.path.empty()), "checkpoint.resume",
            to_string(c.checkpoint.resume),
            "must be \"auto\", \"none\" or the path of a checkpoint directory");
  r.at_least("sample.max_tokens", c.sample.max_tokens, 1);
  r.require(c.sample.max_tokens <= kMaxSampleTokens, "sample.max_tokens", c.sample.max_tokens,
            fmt::format("must be <= {} (each token recomputes the whole context)", kMaxSampleTokens));
  r.non_negative("sample.temperature", c.sample.temperature);
  r.at_least("sample.top_k", c.sample.top_k, 0);
  if (!c.data.split.empty()) {
    const std::vector<double> parts = parse_data_split(c.data.split);
    r.require(!parts.empty(), "data.split", c.data.split,
              "must be 2 or 3 non-negative numbers separated by commas, with a positive train part "
              "and a positive sum, e.g. \"98,2\" (train, valid[, test])");
  }

  const std::pair<const char*, const std::vector<DataSource>*> lists[] = {
      {"data.train", &c.data.train}, {"data.valid", &c.data.valid}};
  for (const auto& [name, list] : lists)
    for (size_t i = 0; i < list->size(); ++i) {
      const DataSource& s = (*list)[i];
      const std::string at = fmt::format("{}[{}]", name, i);
      r.require(!s.path.empty(), at + ".path", s.path, "must not be empty");
      for (const char* ext : {".bin", ".idx"})
        r.require(!ends_with(s.path, ext), at + ".path", s.path,
                  fmt::format("give the dataset prefix without {} (\"{}\")", ext,
                              s.path.substr(0, s.path.size() - 4)));
      r.positive(at + ".weight", s.weight);
    }
}

void expand(const std::string& key, std::string& path, Rules& r) {
  std::string out, why;
  if (expand_path(path, out, why))
    path = out;
  else
    r.require(false, key, path, why);
}

void resolve(Config& c, Rules& r) {
  for (size_t i = 0; i < c.data.train.size(); ++i) expand(fmt::format("data.train[{}].path", i), c.data.train[i].path, r);
  for (size_t i = 0; i < c.data.valid.size(); ++i) expand(fmt::format("data.valid[{}].path", i), c.data.valid[i].path, r);
  // data.tokenizer is "kind:path": expand the path part.
  if (!c.data.tokenizer.empty()) expand("data.tokenizer", c.data.tokenizer.path, r);
  expand("logging.dir", c.logging.dir, r);
  expand("checkpoint.dir", c.checkpoint.dir, r);
  if (c.checkpoint.resume.kind == ResumeKind::PATH) expand("checkpoint.resume", c.checkpoint.resume.path, r);
  expand("checkpoint.init", c.checkpoint.init, r);
  ModelConfig& m = c.model;
  if (m.num_kv_heads == 0 && r.ok({"model.num_kv_heads", "model.num_heads"}))
    m.num_kv_heads = m.num_heads;
  if (m.head_dim == 0 && r.ok({"model.head_dim", "model.hidden_size", "model.num_heads"}) &&
      m.hidden_size % m.num_heads == 0)
    m.head_dim = m.hidden_size / m.num_heads;
  if (m.ffn_hidden_size == 0 && r.ok({"model.ffn_hidden_size", "model.hidden_size"})) {
    if (m.activation == Activation::SWIGLU)
      m.ffn_hidden_size = (8 * m.hidden_size / 3 + 63) / 64 * 64;
    else
      m.ffn_hidden_size = 4 * m.hidden_size;
  }
  if (m.moe.ffn_hidden_size == 0 && r.ok({"model.moe.ffn_hidden_size", "model.ffn_hidden_size"}))
    m.moe.ffn_hidden_size = m.ffn_hidden_size;
  ParallelConfig& par = c.parallel;
  if (r.ok({"parallel.zero_stage", "parallel.distributed_optimizer"})) {
    r.require(!(par.zero_stage >= 1 && par.distributed_optimizer_given && !par.distributed_optimizer),
              "parallel.distributed_optimizer", false,
              fmt::format("contradicts parallel.zero_stage {}: every ZeRO stage from 1 shards the optimizer "
                          "state over dp (the distributed optimizer); remove parallel.distributed_optimizer or "
                          "set parallel.zero_stage to 0", par.zero_stage));
    if (par.distributed_optimizer && par.zero_stage == 0) par.zero_stage = 1;
    if (par.zero_stage >= 1) par.distributed_optimizer = true;
  }
  TrainingConfig& t = c.training;
  if (t.global_batch_size == 0 &&
      r.ok({"training.global_batch_size", "training.micro_batch_size", "parallel.dp"}))
    t.global_batch_size = t.micro_batch_size * c.parallel.dp;
}

// Whether `path` is `dir` or lies inside it, as the filesystem resolves the two (".", "..", a
// trailing "/", symbolic links of the parts that exist).
bool inside_directory(const std::string& path, const std::string& dir) {
  namespace fs = std::filesystem;
  std::error_code ec_p, ec_d;
  const fs::path p = fs::weakly_canonical(fs::absolute(path), ec_p);
  const fs::path d = fs::weakly_canonical(fs::absolute(dir), ec_d);
  if (ec_p || ec_d) return false;
  auto pi = p.begin();
  for (auto di = d.begin(); di != d.end(); ++di, ++pi) {
    if (di->empty() && std::next(di) == d.end()) break;  // a trailing "/"
    if (pi == p.end() || *pi != *di) return false;
  }
  return true;
}

void check_cross_field(const Config& c, Rules& r) {
  const ModelConfig& m = c.model;

  if (r.ok({"model.hidden_size", "model.num_heads", "model.head_dim"})) {
    // model.head_dim given: any head size (Qwen3: 128 with hidden 1024 and 16 heads).
    const bool derived = m.head_dim == 0 || m.head_dim * m.num_heads == m.hidden_size;
    if (m.head_dim == 0)
      r.require(m.hidden_size % m.num_heads == 0, "model.hidden_size", m.hidden_size,
                fmt::format("must be divisible by model.num_heads ({}), or set model.head_dim", m.num_heads));
    if (m.position == Position::ROPE && (m.head_dim > 0 || m.hidden_size % m.num_heads == 0))
      r.require(m.head_size() % 2 == 0, derived ? "model.hidden_size" : "model.head_dim",
                derived ? m.hidden_size : m.head_dim,
                derived ? fmt::format("with model.position \"rope\" the head size hidden_size / num_heads "
                                      "({} / {} = {}) must be even",
                                      m.hidden_size, m.num_heads, m.head_size())
                        : std::string("must be even with model.position \"rope\""));
  }
  if (r.ok({"model.rope_scaling.type", "model.position"}) && m.rope_scaling.type != RopeScaling::NONE)
    r.require(m.position == Position::ROPE, "model.rope_scaling.type", m.rope_scaling.type,
              "scales RoPE's frequencies: it needs model.position \"rope\"");
  if (r.ok({"model.rope_scaling.type", "model.rope_scaling.low_freq_factor", "model.rope_scaling.high_freq_factor"}) &&
      m.rope_scaling.type == RopeScaling::LLAMA3)
    r.require(m.rope_scaling.high_freq_factor > m.rope_scaling.low_freq_factor, "model.rope_scaling.high_freq_factor",
              m.rope_scaling.high_freq_factor,
              fmt::format("must be above model.rope_scaling.low_freq_factor ({}) for \"llama3\"",
                          m.rope_scaling.low_freq_factor));
  if (r.ok({"model.qk_norm", "model.norm"}) && m.qk_norm)
    r.require(m.norm == Norm::RMSNORM, "model.qk_norm", m.qk_norm,
              "needs model.norm \"rmsnorm\" (Qwen3's q/k norm is an RMSNorm, as its other norms)");
  if (r.ok({"model.num_heads", "model.num_kv_heads"}) && m.num_kv_heads > 0)
    r.require(m.num_heads % m.num_kv_heads == 0, "model.num_kv_heads", m.num_kv_heads,
              fmt::format("must divide model.num_heads ({})", m.num_heads));

  // Tensor parallelism splits heads, kv heads, the MLP and the vocabulary over tp ranks.
  if (r.ok({"parallel.tp"}) && c.parallel.tp > 1) {
    const int64_t tp = c.parallel.tp;
    const struct {
      const char* path;
      int64_t value;
    } split[] = {{"model.num_heads", m.num_heads},
                 {"model.num_kv_heads", m.num_kv_heads},
                 {"model.ffn_hidden_size", m.ffn_hidden_size}};
    for (const auto& s : split)
      if (r.ok({s.path}))
        r.require(s.value % tp == 0, s.path, s.value,
                  fmt::format("{} ({}) must be a multiple of parallel.tp ({})", s.path, s.value, tp));
  }
  // The vocabulary is padded instead (ModelConfig::padded_vocab_size), so that every TP rank holds
  // the same number of rows; the last must still hold a real one.
  if (r.ok({"model.vocab_size", "model.make_vocab_size_divisible_by", "parallel.tp"}) && c.parallel.tp > 1 &&
      m.vocab_rows(c.parallel.tp, c.parallel.tp - 1) <= 0) {
    const int64_t tp = c.parallel.tp, padded = m.padded_vocab_size(tp);
    ModelConfig fit = m;  // the largest power of two below the setting that leaves the last rank a real row
    fit.make_vocab_size_divisible_by = 1;
    while (fit.make_vocab_size_divisible_by * 2 < m.make_vocab_size_divisible_by) fit.make_vocab_size_divisible_by *= 2;
    while (fit.make_vocab_size_divisible_by > 1 && fit.vocab_rows(tp, tp - 1) <= 0) fit.make_vocab_size_divisible_by /= 2;
    const std::string fix = fit.vocab_rows(tp, tp - 1) > 0
                                ? fmt::format("set model.make_vocab_size_divisible_by to at most {}",
                                              fit.make_vocab_size_divisible_by)
                                : fmt::format("model.vocab_size {} is too small for parallel.tp {}", m.vocab_size, tp);
    r.require(false, "model.make_vocab_size_divisible_by", m.make_vocab_size_divisible_by,
              fmt::format("pads model.vocab_size {} to {} rows for parallel.tp {}, {} per rank, which leaves tp rank "
                          "{} nothing but padding: {}", m.vocab_size, padded, tp, padded / tp, tp - 1, fix));
  }
  // Mixture of Experts, and expert parallelism (carved out of data parallelism).
  const MoeConfig& moe = m.moe;
  if (r.ok({"model.moe.num_experts", "model.moe.first_k_dense_replace", "model.num_layers"}) && moe.enabled())
    r.require(moe.first_k_dense_replace < m.num_layers, "model.moe.first_k_dense_replace", moe.first_k_dense_replace,
              fmt::format("leaves no MoE block among model.num_layers ({}): it must be below it, or set "
                          "model.moe.num_experts 0 for a dense model", m.num_layers));
  if (r.ok({"model.moe.num_experts", "model.moe.top_k"}) && moe.enabled())
    r.require(moe.top_k <= moe.num_experts, "model.moe.top_k", moe.top_k,
              fmt::format("model.moe.top_k ({}) must be <= model.moe.num_experts ({})", moe.top_k,
                          moe.num_experts));
  // The experts' tensor parallelism: a divisor of tp (its groups lie inside the attention's).
  if (c.parallel.etp) {
    const int64_t etp = *c.parallel.etp;
    r.degree("parallel.etp", etp);
    if (r.ok({"parallel.etp", "parallel.tp"}))
      r.require(c.parallel.tp % etp == 0, "parallel.etp", etp,
                fmt::format("parallel.etp ({}) must divide parallel.tp ({}): an expert's tensor-parallel ranks are "
                            "a part of the attention's tensor-parallel group (or set it to null: etp = tp)",
                            etp, c.parallel.tp));
    if (r.ok({"parallel.etp", "model.moe.num_experts"}) && !moe.enabled() && etp != c.parallel.tp)
      r.require(false, "parallel.etp", etp,
                "the experts' tensor parallelism needs a Mixture-of-Experts model: set model.moe.num_experts, or "
                "parallel.etp to null");
  }
  const int64_t etp = c.parallel.expert_tp();
  const bool etp_ok = r.ok({"parallel.etp", "parallel.tp"}) && etp >= 1 && c.parallel.tp % etp == 0;
  // Each expert is split over etp ranks like the dense MLP over tp.
  if (etp_ok && r.ok({"model.moe.num_experts", "model.moe.ffn_hidden_size"}) && moe.enabled() && etp > 1)
    r.require(moe.ffn_hidden_size % etp == 0, "model.moe.ffn_hidden_size", moe.ffn_hidden_size,
              c.parallel.etp ? fmt::format("model.moe.ffn_hidden_size ({}) must be a multiple of parallel.etp ({})",
                                           moe.ffn_hidden_size, etp)
                             : fmt::format("model.moe.ffn_hidden_size ({}) must be a multiple of parallel.tp ({}) "
                                           "(the experts' tensor parallelism, parallel.etp, is tp unless set)",
                                           moe.ffn_hidden_size, c.parallel.tp));
  if (etp_ok && moe.enabled() && etp < c.parallel.tp && moe.capacity_factor && c.parallel.cp > 1)
    r.require(false, "parallel.etp", etp,
              fmt::format("model.moe.capacity_factor with parallel.etp ({}) < parallel.tp ({}) and parallel.cp ({}) > 1 "
                          "is not supported (the capacity is counted over the whole sequence, split over both): make "
                          "the experts dropless (capacity_factor null), or set parallel.etp to tp",
                          etp, c.parallel.tp, c.parallel.cp));
  if (r.ok({"model.moe.num_experts", "model.moe.ffn_hidden_size", "parallel.tp"}) && moe.enabled() &&
      c.parallel.tp > 1) {
    if (r.ok({"model.moe.shared_expert_ffn_hidden_size"}))
      r.require(moe.shared_expert_ffn_hidden_size % c.parallel.tp == 0, "model.moe.shared_expert_ffn_hidden_size",
                moe.shared_expert_ffn_hidden_size,
                fmt::format("model.moe.shared_expert_ffn_hidden_size ({}) must be a multiple of parallel.tp ({}): the "
                            "shared expert is split over TP like the dense MLP",
                            moe.shared_expert_ffn_hidden_size, c.parallel.tp));
  }
  if (c.parallel.ep_overlap_chunks != 1) {
    r.at_least("parallel.ep_overlap_chunks", c.parallel.ep_overlap_chunks, 1);
    if (r.ok({"parallel.ep_overlap_chunks", "parallel.ep", "model.moe.num_experts"}) && c.parallel.ep_overlap_chunks > 1) {
      if (!moe.enabled() || c.parallel.ep <= 1)
        r.require(false, "parallel.ep_overlap_chunks", c.parallel.ep_overlap_chunks,
                  "overlaps the expert-parallel exchanges, but there are none (it needs a MoE model and "
                  "parallel.ep > 1): set it to 1");
      else if (moe.num_experts % c.parallel.ep == 0)
        r.require(c.parallel.ep_overlap_chunks <= moe.num_experts / c.parallel.ep, "parallel.ep_overlap_chunks",
                  c.parallel.ep_overlap_chunks,
                  fmt::format("splits each rank's {} local experts (model.moe.num_experts / parallel.ep) into chunks: "
                              "at most {}", moe.num_experts / c.parallel.ep, moe.num_experts / c.parallel.ep));
    }
  }
  if (r.ok({"parallel.ep", "parallel.dp", "model.moe.num_experts"}) && c.parallel.ep > 1) {
    const int64_t ep = c.parallel.ep;
    const int64_t shares = etp_ok ? c.parallel.tp / etp : 1;
    if (shares == 1)
      r.require(c.parallel.dp % ep == 0, "parallel.ep", ep,
                fmt::format("parallel.ep ({}) must divide parallel.dp ({}): expert parallelism is carved out of data "
                            "parallelism (and, with parallel.etp < parallel.tp, out of the tp / etp groups too)",
                            ep, c.parallel.dp));
    else
      r.require((shares * c.parallel.dp) % ep == 0, "parallel.ep", ep,
                fmt::format("parallel.ep ({}) must divide (parallel.tp / parallel.etp) x parallel.dp ({} / {} x {} = "
                            "{}): expert parallelism is carved out of the tp / etp groups and data parallelism",
                            ep, c.parallel.tp, etp, c.parallel.dp, shares * c.parallel.dp));
    if (!moe.enabled())
      r.require(false, "parallel.ep", ep,
                "expert parallelism needs a Mixture-of-Experts model: set model.moe.num_experts, or "
                "parallel.ep to 1");
    else
      r.require(moe.num_experts % ep == 0, "parallel.ep", ep,
                fmt::format("parallel.ep ({}) must divide model.moe.num_experts ({}): each expert-"
                            "parallel rank holds num_experts / ep experts", ep, moe.num_experts));
  }
  if (r.ok({"parallel.tp", "parallel.sequence_parallel"}) && c.parallel.sequence_parallel) {
    r.require(c.parallel.tp > 1, "parallel.sequence_parallel", true,
              "sequence parallelism shards the sequence over the tensor-parallel group: it needs "
              "parallel.tp > 1");
    const int64_t cp = c.parallel.cp >= 1 ? c.parallel.cp : 1;
    const int64_t rows = c.training.micro_batch_size * m.seq_len / cp;
    if (r.ok({"training.micro_batch_size", "model.seq_len", "parallel.cp"}) && c.parallel.tp > 1)
      r.require(rows % c.parallel.tp == 0, "parallel.sequence_parallel", true,
                cp > 1 ? fmt::format("a CP rank's tokens of a micro-batch, micro_batch_size * seq_len / cp "
                                     "({} * {} / {} = {}), must be a multiple of parallel.tp ({})",
                                     c.training.micro_batch_size, m.seq_len, cp, rows, c.parallel.tp)
                       : fmt::format("the tokens of a micro-batch, micro_batch_size * seq_len ({} * {} = {}), "
                                     "must be a multiple of parallel.tp ({})",
                                     c.training.micro_batch_size, m.seq_len, rows, c.parallel.tp));
  }
  check_context_parallel(c, r);

  const TrainingConfig& t = c.training;
  if (r.ok({"training.global_batch_size", "training.micro_batch_size", "parallel.dp"})) {
    const int64_t per_step = t.micro_batch_size * c.parallel.dp;
    r.require(t.global_batch_size % per_step == 0, "training.global_batch_size",
              t.global_batch_size,
              fmt::format("must be a multiple of training.micro_batch_size * parallel.dp "
                          "({} * {} = {})",
                          t.micro_batch_size, c.parallel.dp, per_step));
    // The schedule table holds every pipeline rank's forward and backward of every micro-batch
    // and model chunk (and the memory plan and communication prediction walk it).
    if (r.ok({"parallel.pp", "parallel.virtual_stages"}) && t.global_batch_size % per_step == 0) {
      const double slots = static_cast<double>(c.grad_accum_steps()) * static_cast<double>(c.parallel.pp) *
                           static_cast<double>(c.parallel.virtual_stages);
      r.require(slots <= static_cast<double>(kMaxScheduleSlots), "training.global_batch_size", t.global_batch_size,
                fmt::format("gives {} micro-batches per step, which with parallel.pp {} x parallel.virtual_stages "
                            "{} is {:.0f} pipeline slots; a step has at most {} (2^22): raise "
                            "training.micro_batch_size or lower the global batch",
                            c.grad_accum_steps(), c.parallel.pp, c.parallel.virtual_stages, slots,
                            kMaxScheduleSlots));
    }
  }
  check_pipeline(c, r);
  check_loss_scaling(c, r);

  const OptimizerConfig& o = c.optimizer;
  if (r.ok({"optimizer.lr", "optimizer.min_lr"}))
    r.require(o.min_lr <= o.lr, "optimizer.min_lr", o.min_lr,
              fmt::format("must be <= optimizer.lr ({})", json(o.lr).dump()));

  const DataConfig& d = c.data;
  if (r.ok({"data.synthetic", "data.train"})) {
    if (d.synthetic)
      r.require(d.train.empty(), "data.train", config_to_json(c)["data"]["train"],
                "must be empty when data.synthetic is true (synthetic data replaces the datasets)");
    else
      r.require(!d.train.empty(), "data.train", json::array(),
                "must list at least one dataset, or set data.synthetic to true");
  }
  if (r.ok({"data.synthetic", "data.valid"}) && d.synthetic)
    r.require(d.valid.empty(), "data.valid", config_to_json(c)["data"]["valid"],
              "must be empty when data.synthetic is true (synthetic data replaces the datasets)");

  if (r.ok({"data.split", "data.valid", "data.synthetic"}) && !d.split.empty()) {
    r.require(d.valid.empty(), "data.split", d.split,
              "data.split carves the validation set out of data.train: leave data.valid empty, or "
              "remove data.split");
    r.require(!d.synthetic, "data.split", d.split, "synthetic data has nothing to split: remove data.split");
  }
  if (r.ok({"checkpoint.every", "checkpoint.dir"}))
    r.require(c.checkpoint.every == 0 || !c.checkpoint.dir.empty(), "checkpoint.every", c.checkpoint.every,
              "saving checkpoints needs checkpoint.dir");
  if (r.ok({"checkpoint.init", "checkpoint.dir"}) && !c.checkpoint.init.empty() && !c.checkpoint.dir.empty())
    r.require(!inside_directory(c.checkpoint.init, c.checkpoint.dir), "checkpoint.init", c.checkpoint.init,
              fmt::format("is checkpoint.dir ({}) or inside it: the run would take it for a checkpoint of its own "
                          "to resume, and rotating its checkpoints (checkpoint.keep) would delete it; give "
                          "checkpoint.dir a directory of its own", c.checkpoint.dir));
  if (r.ok({"sample.prompt", "data.tokenizer"}))
    r.require(c.sample.prompt.empty() || !d.tokenizer.empty(), "sample.prompt", c.sample.prompt,
              "sampling text needs the tokenizer: set data.tokenizer");
  const bool have_valid = d.synthetic || !d.valid.empty() || !d.split.empty();
  if (r.ok({"training.eval_every", "training.eval_steps", "data.synthetic", "data.valid"})) {
    r.require(t.eval_every == 0 || t.eval_steps > 0, "training.eval_every", t.eval_every,
              "evaluating needs training.eval_steps > 0 (it is 0)");
    const bool every = t.eval_every > 0;
    r.require(!(every || t.eval_steps > 0) || have_valid,
              every ? "training.eval_every" : "training.eval_steps",
              every ? t.eval_every : t.eval_steps,
              "evaluating needs validation data: list datasets in data.valid (or set "
              "data.synthetic to true)");
  }
}

// training.recompute and its companions (trainer/params/recompute.h); parallel.reshard_after_forward.
// A key that applies to one mode only, given a value other than its default under another mode, is
// refused (as the loss-scaling keys are, check_loss_scaling), not ignored.
void check_recompute(const Config& c, Rules& r) {
  const TrainingConfig& t = c.training;
  const TrainingConfig defaults;
  r.size("training.recompute_num_layers", t.recompute_num_layers, 1);
  r.size("training.loss_chunk_rows", t.loss_chunk_rows, 0);
  if (r.ok({"training.recompute"})) {
    const auto only_under = [&](const char* key, const json& value, Recompute mode) {
      r.require(false, key, value,
                fmt::format("applies to training.recompute \"{}\" only (it is \"{}\"); remove {} or set "
                            "training.recompute to \"{}\"", to_string(mode), to_string(t.recompute), key,
                            to_string(mode)));
    };
    if (t.recompute != Recompute::SELECTIVE && t.recompute_modules != defaults.recompute_modules &&
        r.ok({"training.recompute_modules"}))
      only_under("training.recompute_modules", config_to_json(c)["training"]["recompute_modules"],
                 Recompute::SELECTIVE);
    if (t.recompute != Recompute::FULL && t.recompute_method != defaults.recompute_method &&
        r.ok({"training.recompute_method"}))
      only_under("training.recompute_method", std::string(to_string(t.recompute_method)), Recompute::FULL);
    if (t.recompute != Recompute::FULL && t.recompute_num_layers != defaults.recompute_num_layers &&
        r.ok({"training.recompute_num_layers"}))
      only_under("training.recompute_num_layers", t.recompute_num_layers, Recompute::FULL);
  }
  const ParallelConfig& par = c.parallel;
  if (par.reshard_after_forward && par.zero_stage != 3 &&
      r.ok({"parallel.reshard_after_forward", "parallel.zero_stage"}))
    r.require(false, "parallel.reshard_after_forward", *par.reshard_after_forward,
              fmt::format("applies to parallel.zero_stage 3 only (it is {}: no weights are gathered); remove "
                          "parallel.reshard_after_forward (or set it to null) or set parallel.zero_stage to 3",
                          par.zero_stage));
  if (t.recompute == Recompute::SELECTIVE) {
    r.require(!t.recompute_modules.empty(), "training.recompute_modules", json::array(),
              "\"selective\" recomputation needs at least one module: norm, act, moe_act or core_attn");
    const bool moe_act = std::find(t.recompute_modules.begin(), t.recompute_modules.end(), RecomputeModule::MOE_ACT) !=
                         t.recompute_modules.end();
    r.require(!moe_act || c.model.moe.enabled(), "training.recompute_modules", "moe_act",
              "\"moe_act\" recomputes the experts' activation: the model has no MoE blocks (model.moe)");
  }
}

}  // namespace

// The model's size, bounded before anything counts it in int64: parameters, FLOPs and bytes are
// products of sizes that each pass their own range (an MoE of 2^31 experts of width 2^31 would
// wrap). About 10^15 parameters is a thousand times the largest model trained.
void check_model_size(const Config& c, Rules& r) {
  const ModelConfig& m = c.model;
  if (!r.ok({"model.vocab_size", "model.hidden_size", "model.num_layers", "model.num_heads", "model.num_kv_heads",
             "model.head_dim", "model.ffn_hidden_size", "model.moe.num_experts", "model.moe.ffn_hidden_size",
             "model.moe.shared_expert_ffn_hidden_size"}))
    return;
  const double h = static_cast<double>(m.hidden_size), heads = static_cast<double>(m.num_heads);
  const double kv = m.num_kv_heads > 0 ? static_cast<double>(m.num_kv_heads) : heads;
  const double hd = m.head_dim > 0 ? static_cast<double>(m.head_dim) : h / heads;
  const double ffn = std::max(static_cast<double>(m.ffn_hidden_size), 4.0 * h);
  const double experts = std::max(1.0, static_cast<double>(m.moe.num_experts));
  const double expert_ffn = std::max(ffn, static_cast<double>(m.moe.ffn_hidden_size));
  const double shared_ffn = static_cast<double>(m.moe.shared_expert_ffn_hidden_size);
  const double per_layer = h * hd * (heads + 2.0 * kv) + heads * hd * h + 3.0 * h * (expert_ffn * experts + shared_ffn) +
                           experts * h;
  const double params = 2.0 * static_cast<double>(m.vocab_size) * h + static_cast<double>(m.num_layers) * per_layer;
  r.require(params <= kMaxParameters, "model.hidden_size", m.hidden_size,
            fmt::format("with these sizes the model has about {:.3g} parameters; at most {:.0e} can be counted "
                        "(model.vocab_size, num_layers, hidden_size, ffn_hidden_size and moe.num_experts multiply)",
                        params, kMaxParameters));
}

void resolve_and_validate(Config& c, Problems& problems) {
  Rules rules(problems);
  check_ranges(c, rules);
  check_model_size(c, rules);
  resolve(c, rules);
  check_cross_field(c, rules);
  check_recompute(c, rules);
}

}  // namespace tetra::config_detail
