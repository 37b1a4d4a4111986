// The run configuration: one struct per JSON section, read once and validated before any rank
// allocates anything.
//
// Reading collects every problem it finds (unknown keys with the closest known key suggested,
// wrong types, out-of-range values, cross-field rules) and reports them all at once in a
// ConfigError whose message lists one line per problem: "<json.path>: <value>: <rule>".
#pragma once

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/common/check.h"
#include "kernels/common/dtype.h"

namespace tetra {

// ---- enumerated keys ----------------------------------------------------------------------------
// Each enumerated key is an enum class; its values' spellings in the JSON ("rmsnorm", "1f1b") live
// in one table per enum below (EnumNames), in the order error messages list them. Code compares
// values, never strings: to_string / enum_from_string (and JSON, through adl_serializer below)
// are the only crossings.

enum class Norm : uint8_t { LAYERNORM, RMSNORM };                  // model.norm
enum class Activation : uint8_t { GELU, SWIGLU };                  // model.activation
enum class Position : uint8_t { LEARNED, ROPE };                   // model.position
enum class RopeScaling : uint8_t { NONE, LINEAR, LLAMA3 };         // model.rope_scaling.type
enum class RouterScore : uint8_t { SOFTMAX, SIGMOID };             // model.moe.router_score_function
// parallel.order: the rank order, fastest-varying axis first (rank_grid.h).
// The 24 orders of the four axes; the six of three (no cp) are accepted while parallel.cp is 1.
enum class RankOrder : uint8_t {
  TP_CP_DP_PP, CP_DP_PP_TP, CP_DP_TP_PP, CP_PP_DP_TP, CP_PP_TP_DP, CP_TP_DP_PP, CP_TP_PP_DP, DP_CP_PP_TP, DP_CP_TP_PP, DP_PP_CP_TP, DP_PP_TP_CP, DP_TP_CP_PP, DP_TP_PP_CP, PP_CP_DP_TP, PP_CP_TP_DP, PP_DP_CP_TP, PP_DP_TP_CP, PP_TP_CP_DP, PP_TP_DP_CP, TP_CP_PP_DP, TP_DP_CP_PP, TP_DP_PP_CP, TP_PP_CP_DP, TP_PP_DP_CP, TP_DP_PP, TP_PP_DP, DP_TP_PP, DP_PP_TP, PP_TP_DP, PP_DP_TP
};
enum class ScheduleKind : uint8_t { GPIPE, ONE_F_ONE_B, INTERLEAVED };  // parallel.schedule
enum class GradCompression : uint8_t { NONE, BF16, ONEBIT, INT8 };  // parallel.grad_compression
// parallel.cp_comm: K/V passed around the CP ring while attention runs, or gathered first.
enum class CpComm : uint8_t { P2P, ALL_GATHER };
enum class Device : uint8_t { CPU, CUDA };                         // training.device
enum class Precision : uint8_t { FP32, BF16, FP16 };               // training.precision
enum class LrDecay : uint8_t { COSINE, LINEAR, CONSTANT };         // optimizer.decay
enum class LogLevel : uint8_t { TRACE, DEBUG, INFO, WARN, ERROR };  // logging.level
enum class TokenizerKind : uint8_t { NONE, GPT2, SENTENCEPIECE, HF };  // data.tokenizer's "<kind>:"
enum class ResumeKind : uint8_t { AUTO, NONE, PATH };              // checkpoint.resume
enum class Recompute : uint8_t { NONE, SELECTIVE, FULL };          // training.recompute
enum class RecomputeMethod : uint8_t { UNIFORM, BLOCK };           // training.recompute_method
enum class RecomputeModule : uint8_t { NORM, ACT, MOE_ACT, CORE_ATTN };  // training.recompute_modules

template <class E>
struct EnumName {
  E value;
  std::string_view name;
};
template <class E>
struct EnumNames;  // `values`: every value of E with its spelling
template <>
struct EnumNames<Norm> {
  static constexpr EnumName<Norm> values[] = {{Norm::LAYERNORM, "layernorm"}, {Norm::RMSNORM, "rmsnorm"}};
};
template <>
struct EnumNames<Activation> {
  static constexpr EnumName<Activation> values[] = {{Activation::GELU, "gelu"}, {Activation::SWIGLU, "swiglu"}};
};
template <>
struct EnumNames<RouterScore> {
  static constexpr EnumName<RouterScore> values[] = {{RouterScore::SOFTMAX, "softmax"}, {RouterScore::SIGMOID, "sigmoid"}};
};
template <>
struct EnumNames<Position> {
  static constexpr EnumName<Position> values[] = {{Position::LEARNED, "learned"}, {Position::ROPE, "rope"}};
};
template <>
struct EnumNames<RopeScaling> {
  static constexpr EnumName<RopeScaling> values[] = {
      {RopeScaling::NONE, "none"}, {RopeScaling::LINEAR, "linear"}, {RopeScaling::LLAMA3, "llama3"}};
};
template <>
struct EnumNames<RankOrder> {
  static constexpr EnumName<RankOrder> values[] = {
      {RankOrder::TP_CP_DP_PP, "tp-cp-dp-pp"},
      {RankOrder::CP_DP_PP_TP, "cp-dp-pp-tp"},
      {RankOrder::CP_DP_TP_PP, "cp-dp-tp-pp"},
      {RankOrder::CP_PP_DP_TP, "cp-pp-dp-tp"},
      {RankOrder::CP_PP_TP_DP, "cp-pp-tp-dp"},
      {RankOrder::CP_TP_DP_PP, "cp-tp-dp-pp"},
      {RankOrder::CP_TP_PP_DP, "cp-tp-pp-dp"},
      {RankOrder::DP_CP_PP_TP, "dp-cp-pp-tp"},
      {RankOrder::DP_CP_TP_PP, "dp-cp-tp-pp"},
      {RankOrder::DP_PP_CP_TP, "dp-pp-cp-tp"},
      {RankOrder::DP_PP_TP_CP, "dp-pp-tp-cp"},
      {RankOrder::DP_TP_CP_PP, "dp-tp-cp-pp"},
      {RankOrder::DP_TP_PP_CP, "dp-tp-pp-cp"},
      {RankOrder::PP_CP_DP_TP, "pp-cp-dp-tp"},
      {RankOrder::PP_CP_TP_DP, "pp-cp-tp-dp"},
      {RankOrder::PP_DP_CP_TP, "pp-dp-cp-tp"},
      {RankOrder::PP_DP_TP_CP, "pp-dp-tp-cp"},
      {RankOrder::PP_TP_CP_DP, "pp-tp-cp-dp"},
      {RankOrder::PP_TP_DP_CP, "pp-tp-dp-cp"},
      {RankOrder::TP_CP_PP_DP, "tp-cp-pp-dp"},
      {RankOrder::TP_DP_CP_PP, "tp-dp-cp-pp"},
      {RankOrder::TP_DP_PP_CP, "tp-dp-pp-cp"},
      {RankOrder::TP_PP_CP_DP, "tp-pp-cp-dp"},
      {RankOrder::TP_PP_DP_CP, "tp-pp-dp-cp"},
      {RankOrder::TP_DP_PP, "tp-dp-pp"},
      {RankOrder::TP_PP_DP, "tp-pp-dp"},
      {RankOrder::DP_TP_PP, "dp-tp-pp"},
      {RankOrder::DP_PP_TP, "dp-pp-tp"},
      {RankOrder::PP_TP_DP, "pp-tp-dp"},
      {RankOrder::PP_DP_TP, "pp-dp-tp"}};
};
template <>
struct EnumNames<ScheduleKind> {
  static constexpr EnumName<ScheduleKind> values[] = {
      {ScheduleKind::ONE_F_ONE_B, "1f1b"}, {ScheduleKind::INTERLEAVED, "interleaved"}, {ScheduleKind::GPIPE, "gpipe"}};
};
template <>
struct EnumNames<CpComm> {
  static constexpr EnumName<CpComm> values[] = {{CpComm::P2P, "p2p"}, {CpComm::ALL_GATHER, "all_gather"}};
};
template <>
struct EnumNames<GradCompression> {
  static constexpr EnumName<GradCompression> values[] = {{GradCompression::NONE, "none"},
                                                         {GradCompression::BF16, "bf16"},
                                                         {GradCompression::ONEBIT, "onebit"},
                                                         {GradCompression::INT8, "int8"}};
};
template <>
struct EnumNames<Device> {
  static constexpr EnumName<Device> values[] = {{Device::CPU, "cpu"}, {Device::CUDA, "cuda"}};
};
template <>
struct EnumNames<Precision> {
  static constexpr EnumName<Precision> values[] = {
      {Precision::FP32, "fp32"}, {Precision::BF16, "bf16"}, {Precision::FP16, "fp16"}};
};
template <>
struct EnumNames<LrDecay> {
  static constexpr EnumName<LrDecay> values[] = {
      {LrDecay::COSINE, "cosine"}, {LrDecay::LINEAR, "linear"}, {LrDecay::CONSTANT, "constant"}};
};
template <>
struct EnumNames<LogLevel> {
  static constexpr EnumName<LogLevel> values[] = {{LogLevel::TRACE, "trace"}, {LogLevel::DEBUG, "debug"},
                                                  {LogLevel::INFO, "info"},   {LogLevel::WARN, "warn"},
                                                  {LogLevel::ERROR, "error"}};
};
template <>
struct EnumNames<TokenizerKind> {
  static constexpr EnumName<TokenizerKind> values[] = {{TokenizerKind::GPT2, "gpt2"},
                                                       {TokenizerKind::SENTENCEPIECE, "sentencepiece"},
                                                       {TokenizerKind::HF, "hf"}};
};

template <>
struct EnumNames<Recompute> {
  static constexpr EnumName<Recompute> values[] = {
      {Recompute::NONE, "none"}, {Recompute::SELECTIVE, "selective"}, {Recompute::FULL, "full"}};
};
template <>
struct EnumNames<RecomputeMethod> {
  static constexpr EnumName<RecomputeMethod> values[] = {{RecomputeMethod::UNIFORM, "uniform"},
                                                         {RecomputeMethod::BLOCK, "block"}};
};
template <>
struct EnumNames<RecomputeModule> {
  static constexpr EnumName<RecomputeModule> values[] = {{RecomputeModule::NORM, "norm"},
                                                         {RecomputeModule::ACT, "act"},
                                                         {RecomputeModule::MOE_ACT, "moe_act"},
                                                         {RecomputeModule::CORE_ATTN, "core_attn"}};
};

template <class E>
concept ConfigEnum = std::is_enum_v<E> && requires { EnumNames<E>::values; };

// The spelling of `v` ("rmsnorm").
template <ConfigEnum E>
constexpr std::string_view to_string(E v) {
  for (const EnumName<E>& n : EnumNames<E>::values)
    if (n.value == v) return n.name;
  return "?";
}

// The value spelt `name`, or nullopt when no value is.
template <ConfigEnum E>
constexpr std::optional<E> enum_from_string(std::string_view name) {
  for (const EnumName<E>& n : EnumNames<E>::values)
    if (n.name == name) return n.value;
  return std::nullopt;
}

// Every value's spelling, in the table's order.
template <ConfigEnum E>
std::vector<std::string> enum_names() {
  std::vector<std::string> out;
  for (const EnumName<E>& n : EnumNames<E>::values) out.emplace_back(n.name);
  return out;
}

// data.tokenizer: "gpt2:<directory with encoder.json and vocab.bpe>", "sentencepiece:<model file>" or
// "hf:<directory with tokenizer.json>", the tokenizer the datasets were made with; "" (kind NONE)
// when there is none.
struct TokenizerSpec {
  TokenizerKind kind = TokenizerKind::NONE;
  std::string path;
  bool empty() const { return kind == TokenizerKind::NONE; }
  bool operator==(const TokenizerSpec&) const = default;
};
// "<kind>:<path>" ("" for none); parse_tokenizer_spec is its inverse: nullopt when `spec` starts
// with none of "gpt2:", "sentencepiece:", "hf:" (and is not empty).
std::string to_string(const TokenizerSpec& t);
std::optional<TokenizerSpec> parse_tokenizer_spec(std::string_view spec);

// checkpoint.resume: "auto" (from checkpoint.dir/latest if there is one), "none", or the path of
// a checkpoint directory (kind PATH; an empty path is a config error).
struct ResumeSpec {
  ResumeKind kind = ResumeKind::AUTO;
  std::string path;  // PATH only
  bool operator==(const ResumeSpec&) const = default;
};
// "auto", "none" or the path; parse_resume_spec is its inverse.
std::string to_string(const ResumeSpec& r);
ResumeSpec parse_resume_spec(std::string_view spec);

// The weights' and activations' type of a precision.
DType precision_dtype(Precision p);

}  // namespace tetra

// In JSON, ordered or not, an enumerated value is its spelling (and nothing reads one back from
// JSON but the config reader, which names the key of a bad value).
namespace nlohmann {
template <tetra::ConfigEnum E>
struct adl_serializer<E, void> {
  template <class BasicJson>
  static void to_json(BasicJson& j, E v) {
    j = std::string(tetra::to_string(v));
  }
};
}  // namespace nlohmann

namespace tetra {

// ---- the sections -------------------------------------------------------------------------------

// Mixture of Experts (model.moe): every `every`-th block (layers l with l % every == 0, Megatron's
// moe_layer_freq) replaces its MLP by num_experts expert MLPs and a router; 0 experts = dense.
struct MoeConfig {
  int64_t num_experts = 0;
  int64_t top_k = 2;
  int64_t every = 1;
  int64_t ffn_hidden_size = 0;            // of each expert; 0 = model.ffn_hidden_size
  std::optional<double> capacity_factor;  // null = dropless; else each expert takes at most
                                          // ceil(factor * tokens * top_k / num_experts) tokens
  // Dropless with expert parallelism: the rows a rank's experts keep per MoE block and micro-batch
  // in flight are planned for this multiple of the balanced load (tokens * top_k); a block that
  // receives more is computed in passes and recomputed in backward (moe.h). null = the default,
  // kDefaultMaxLoadFactor; not used with a capacity factor (the capacity bounds the rows).
  std::optional<double> max_load_factor;
  static constexpr double kDefaultMaxLoadFactor = 1.5;
  // The gates: true = the softmax over all E experts of the chosen ones (Switch; Megatron's
  // moe_router_pre_softmax); false = renormalised over the top-k (the softmax of the chosen
  // logits: Mixtral, Qwen3-MoE's norm_topk_prob, Megatron's default).
  bool router_pre_softmax = true;
  // The scores: softmax over the experts, or each expert's sigmoid (DeepSeek-V3; the chosen ones'
  // gates then renormalised over the top-k when top_k > 1, as Megatron's). Megatron's
  // moe_router_score_function.
  RouterScore router_score_function = RouterScore::SOFTMAX;
  // Auxiliary-loss-free balancing (DeepSeek-V3; Megatron's moe_router_enable_expert_bias): a bias
  // per expert added to the scores for the choice only, after each step moved by
  // router_bias_update_rate towards the experts that received fewer tokens than the mean
  // (sign(mean - tokens_e)); state the checkpoint keeps. Sigmoid scores only.
  bool router_enable_expert_bias = false;
  double router_bias_update_rate = 1e-3;
  std::optional<double> router_topk_scaling_factor;  // gates multiplied by it (DeepSeek's routed_scaling_factor); null = 1
  int64_t first_k_dense_replace = 0;  // blocks [0, k) keep the dense MLP (DeepSeek's first_k_dense_replace)
  // Shared experts (Qwen2-MoE, DeepSeek, Megatron's moe_shared_expert_*): an MLP of this hidden
  // width beside the routed experts of every MoE block, run on every token; 0 = none. With
  // shared_expert_gate its output is scaled per token by sigmoid(h w_gate) (Qwen2-MoE).
  int64_t shared_expert_ffn_hidden_size = 0;
  bool shared_expert_gate = false;
  bool has_shared_expert() const { return shared_expert_ffn_hidden_size > 0; }
  double aux_loss_coeff = 0.01;           // Switch / GShard load-balancing loss
  double z_loss_coeff = 0.0;              // router z-loss (ST-MoE)
  bool enabled() const { return num_experts > 0; }
  bool is_moe_layer(int64_t l) const { return enabled() && l >= first_k_dense_replace && l % every == 0; }
  // The gates are not the chosen probabilities as they are (renormalised or scaled).
  bool normalizes_gates() const {
    return router_score_function == RouterScore::SIGMOID ? top_k > 1 : !router_pre_softmax;
  }
  bool transforms_gates() const { return normalizes_gates() || router_topk_scaling_factor.value_or(1.0) != 1.0; }
};

// model.rope_scaling: how RoPE's frequencies are stretched for longer contexts (Hugging Face's
// rope types; math::RopeFreqs has the formulas). "none": theta^(-2i/HS) as they are.
struct RopeScalingConfig {
  RopeScaling type = RopeScaling::NONE;
  double factor = 1.0;                              // linear and llama3
  double low_freq_factor = 1.0;                     // llama3
  double high_freq_factor = 4.0;                    // llama3
  int64_t original_max_position_embeddings = 8192;  // llama3: the context the model was trained at
};

struct ModelConfig {
  int64_t vocab_size = 50257;
  // Megatron's --make-vocab-size-divisible-by: the embedding and output layer hold
  // padded_vocab_size(tp) rows, a multiple of this times tp, split evenly over the TP ranks. The
  // padding rows are never read or predicted (the logits and loss cover the vocab_size real
  // rows only) and never stored: checkpoints and exports hold the vocab_size rows, whatever tp.
  int64_t make_vocab_size_divisible_by = 128;
  int64_t seq_len = 1024;
  int64_t num_layers = 12;
  int64_t hidden_size = 768;
  int64_t num_heads = 12;
  int64_t num_kv_heads = 0;      // 0 = num_heads (multi-head attention)
  int64_t head_dim = 0;          // 0 = hidden_size / num_heads
  int64_t ffn_hidden_size = 0;   // 0 = 4 * hidden_size (gelu), or for swiglu
                                 // 8/3 * hidden_size rounded up to a multiple of 64
  Norm norm = Norm::LAYERNORM;
  double norm_eps = 1e-5;
  Activation activation = Activation::GELU;
  Position position = Position::LEARNED;
  double rope_theta = 10000.0;
  RopeScalingConfig rope_scaling;
  bool tie_embeddings = true;
  bool bias = true;       // every linear layer and norm has a bias (GPT-2)
  bool qkv_bias = false;  // q, k and v have biases, nothing else (Qwen2); implied by bias
  bool qk_norm = false;   // RMSNorm over each head's q and k before RoPE, with one weight of
                          // head_dim for the q heads and one for the k heads of a layer (Qwen3)
  double init_std = 0.02;
  MoeConfig moe;
  int64_t head_size() const { return head_dim > 0 ? head_dim : hidden_size / num_heads; }
  bool has_qkv_bias() const { return bias || qkv_bias; }
  // Rows of the embedding and output layer under tensor parallelism of `tp`: vocab_size rounded
  // up to a multiple of make_vocab_size_divisible_by * tp.
  int64_t padded_vocab_size(int64_t tp) const {
    const int64_t m = make_vocab_size_divisible_by * tp;
    return (vocab_size + m - 1) / m * m;
  }
  // The real rows TP rank r of tp holds (the last rank holds the padding; validation refuses a
  // layout where it would hold nothing else).
  int64_t vocab_rows(int64_t tp, int64_t r) const {
    const int64_t per = padded_vocab_size(tp) / tp;
    return std::max<int64_t>(0, std::min(per, vocab_size - r * per));
  }
};

struct ParallelConfig {
  int64_t dp = 1;
  int64_t tp = 1;
  int64_t pp = 1;
  int64_t ep = 1;
  // The experts' own tensor parallelism (Megatron-Core's expert_tensor_parallel_size, "MoE parallel
  // folding"): each expert's hidden units split over etp ranks, a divisor of tp; unset (null): tp.
  // With etp < tp expert parallelism spans the tp / etp groups of etp ranks as well as dp
  // (rank_grid.h): ep divides (tp / etp) x dp.
  std::optional<int64_t> etp;
  int64_t expert_tp() const { return etp.value_or(tp); }
  // The TP ranks that route different rows of a micro-batch to the experts (tp / etp; 1 unfolded).
  int64_t expert_shares() const { return expert_tp() >= 1 && tp % expert_tp() == 0 ? tp / expert_tp() : 1; }
  // Expert-parallel exchanges overlapped with expert compute: each rank's local experts in this
  // many chunks, chunk j + 1's rows travelling while chunk j's experts run (expert_dispatch.h);
  // 1: one exchange each way, not overlapped.
  int64_t ep_overlap_chunks = 1;
  int64_t cp = 1;  // context parallel: each sequence split over cp ranks (ring attention)
  CpComm cp_comm = CpComm::P2P;  // how K/V reach the other CP ranks
  RankOrder order = RankOrder::TP_CP_DP_PP;  // rank order, fastest-varying axis first
  bool sequence_parallel = false;      // norms and residual on sequence shards (needs tp > 1)
  bool distributed_optimizer = false;  // shard fp32 master weights and Adam moments over dp
  bool distributed_optimizer_given = false;  // the config gave distributed_optimizer (not written back)
  // ZeRO stage over dp: 0 none, 1 the optimizer state (= distributed_optimizer), 2 the gradients
  // too, 3 the compute weights too (gathered per parameter group). Resolved together: distributed_optimizer true means at least 1, a stage >= 1 sets it.
  int64_t zero_stage = 0;
  // ZeRO-3: whether a unit's gathered weights are freed after its forward (and gathered again for
  // its backward) or kept until the step's end. Unset (null): true, and false under pp > 1, where
  // several micro-batches are in flight between their forwards and backwards (torchtitan's rule).
  std::optional<bool> reshard_after_forward;
  bool reshards_after_forward() const { return reshard_after_forward.value_or(pp == 1); }
  // The gradient buckets' size: ZeRO-3 reduces (and gathers) each parameter group on its own.
  int64_t gradient_bucket_size() const { return zero_stage == 3 ? 1 : bucket_size; }
  // The replicas of a dense parameter: its gradient reduces, and the distributed optimizer and
  // ZeRO shard, over dp x cp (the CP ranks of a sequence see different tokens of it); an
  // expert's over expert-DP x cp.
  int64_t dp_cp() const { return dp * cp; }
  int64_t edp_cp() const { return expert_shares() * dp / ep * cp; }
  // Every rank of the layout: tp x cp x pp x dp.
  int64_t world() const { return tp * cp * pp * dp; }
  int64_t bucket_size = 40000000;      // parameters per gradient bucket (Megatron's
                                       // --ddp-bucket-size): reduced as soon as backward fills it
  ScheduleKind schedule = ScheduleKind::ONE_F_ONE_B;  // pipeline schedule
  int64_t virtual_stages = 1;          // model chunks per pipeline rank (interleaved: >= 2)
  std::vector<int64_t> stage_layers;   // layers of each of the pp * virtual_stages stages, in
                                       // stage order; empty = an even split
  GradCompression grad_compression = GradCompression::NONE;  // trainer/optim/compression.h
  int64_t onebit_warmup_steps = 100;      // onebit: steps of exact Adam before the variance freezes
};

// The largest loss scale (2^64): the scaler never grows past it, and no configured scale may
// exceed it. Beyond it a gradient norm of the scaled gradients overflows fp32's sum of squares.
inline constexpr double kMaxLossScale = 18446744073709551616.0;
// The most ranks a run has (and so the most of any parallel degree): 2^20, a million GPUs, keeps
// every product of degrees, and the per-rank tables built from them, far from overflow.
inline constexpr int64_t kMaxRanks = int64_t{1} << 20;

struct TrainingConfig {
  Device device = Device::CPU;
  Precision precision = Precision::FP32;
  // fp16 loss scaling (Megatron's meanings; trainer/optim/loss_scaler.h). Setting one with another
  // precision, or a dynamic-scaling one with a static loss_scale, is a config error.
  double loss_scale = 0.0;              // 0 = dynamic loss scaling; > 0 = this static scale
  double initial_loss_scale = 65536.0;  // dynamic: the scale of the first step
  int64_t loss_scale_window = 1000;     // dynamic: overflow-free steps after which the scale doubles
  double min_loss_scale = 1.0;          // dynamic: the scale never halves below this
  int64_t hysteresis = 2;               // dynamic: overflows tolerated before the scale first halves
  int64_t micro_batch_size = 4;
  int64_t global_batch_size = 0;    // 0 = micro_batch_size * dp (no accumulation)
  int64_t steps = 100;
  uint64_t seed = 1234;
  int64_t eval_every = 0;           // 0 = never (except at the end when eval_steps > 0)
  int64_t eval_steps = 0;
  int64_t log_every = 1;
  int64_t threads = 0;              // CPU threads; 0 = all cores
  double peak_gflops = 0.0;         // for MFU; 0 = measured at start-up
  int64_t exit_interval = 0;        // stop after a step that is a multiple of it, as if interrupted
                                    // (checkpoint saved; Megatron's --exit-interval); 0 = never
  double exit_after_min = 0.0;      // stop (with a checkpoint) after the first step that ends this
                                    // many minutes after start-up; 0 = never
  double collective_timeout_s = 300.0;  // watchdog: a step or a blocking collective wait longer
                                        // than this ends the job (exit 3); 0 = off
  int64_t max_skipped_steps = 5;    // consecutive skipped steps (non-finite or spiking loss or
                                    // grad norm) tolerated; one more fails the run
  double spike_zscore = 0.0;        // skip a step whose loss or grad norm lies more than this many
                                    // standard deviations above the recent mean; 0 = off
  int64_t spike_window = 50;        // steps in that mean (a full window is needed to judge)
  std::vector<int64_t> profile_steps;  // [first, last] (1-based, inclusive): each rank's timeline of
                                       // those steps in logging.dir/trace/rank_R.json; empty = none
  // Activation recomputation (Megatron's names and meanings; trainer/params/recompute.h): "none"
  // keeps what backward needs; "selective" recomputes the recompute_modules in backward instead of
  // keeping their outputs; "full" keeps only the input of each unit of layers and reruns its
  // forward in backward: "uniform" units of recompute_num_layers layers over the chunk, or "block":
  // the chunk's first recompute_num_layers layers one by one (the rest kept whole). The numbers do
  // not change: a recomputed forward runs the same kernels on the same values.
  Recompute recompute = Recompute::NONE;
  std::vector<RecomputeModule> recompute_modules = {RecomputeModule::CORE_ATTN};
  RecomputeMethod recompute_method = RecomputeMethod::UNIFORM;
  int64_t recompute_num_layers = 1;
  // The output layer and the loss in chunks of this many of a micro-batch's rows (B*T): the
  // last stage holds (chunk, V/tp) logits instead of (B*T, V/tp), and computes their gradient
  // during the forward (vocab_parallel.h). 0 = one chunk of every row, its logits kept to backward.
  int64_t loss_chunk_rows = 1024;
};

struct OptimizerConfig {
  double lr = 6e-4;
  double min_lr = 0.0;
  int64_t warmup_steps = 0;
  LrDecay decay = LrDecay::COSINE;
  int64_t decay_steps = 0;          // 0 = training.steps - warmup_steps
  double weight_decay = 0.1;
  double beta1 = 0.9;
  double beta2 = 0.95;
  double eps = 1e-8;
  double grad_clip = 1.0;           // global-norm clip; 0 = off
};

struct DataSource {
  std::string path;                 // prefix of a Megatron indexed dataset: path.bin + path.idx
  double weight = 1.0;
};

struct DataConfig {
  bool synthetic = false;
  std::vector<DataSource> train;
  std::vector<DataSource> valid;
  // "98,2" or "949,50,1": each dataset of `train` is split by documents into train / valid /
  // test parts in these proportions (Megatron's --split); the valid parts form the validation
  // set. Empty: no split (validation from `valid`).
  std::string split;
  // The tokenizer the datasets were made with (for samples and `tetra generate`). Empty: none.
  TokenizerSpec tokenizer;
};

// Text sampled from the model: at each evaluation during training (when `prompt` is set and
// data.tokenizer names the tokenizer), and the defaults of `tetra generate`.
struct SampleConfig {
  std::string prompt;
  int64_t max_tokens = 64;
  double temperature = 0.8;         // 0 = greedy
  int64_t top_k = 40;               // 0 = the whole vocabulary
  uint64_t seed = 1;
};

// Checkpoints (a directory per step under `dir`, see trainer/checkpoint/checkpoint.h).
struct CheckpointConfig {
  std::string dir;                  // empty = no checkpoints
  int64_t every = 0;                // save every N steps; 0 = only at the end / on a signal
  int64_t keep = 2;                 // complete checkpoints kept (older ones deleted); 0 = all
  ResumeSpec resume;                // auto: from dir/latest if present | none | a checkpoint path
  std::string init;                 // a checkpoint whose weights start a run that resumes nothing:
                                    // fresh optimizer, step 0, the data from its start ("" = none)
  bool save_on_exit = true;         // save when training ends or on SIGTERM / SIGUSR1

  // The run writes checkpoints: a dir, and periodic saves or one at exit.
  bool saves() const { return !dir.empty() && (every > 0 || save_on_exit); }
};

struct LoggingConfig {
  std::string dir;                  // empty = no files, console only
  LogLevel level = LogLevel::INFO;
  bool tensorboard = true;          // TensorBoard event files under dir/tensorboard (when dir is set)
  double straggler_factor = 1.25;   // a rank whose step, less its communication waits, takes this
                                    // many times its pipeline stage's median ...
  int64_t straggler_window = 5;     // ... in this many steps in a row is logged; 0 = off
};

// MoE blocks of whole folded experts (etp 1) under sequence parallelism, without a shared expert or
// a capacity, run on each rank's own sequence-parallel rows: no TP gather or reduce-scatter around
// them (trainer/model/moe.h; the traffic prediction counts them out).
inline bool moe_local_rows(const ModelConfig& m, int64_t tp, int64_t etp, bool sequence_parallel) {
  return m.moe.enabled() && tp > 1 && etp == 1 && sequence_parallel && !m.moe.has_shared_expert() &&
         !m.moe.capacity_factor;
}

struct Config {
  ModelConfig model;
  ParallelConfig parallel;
  TrainingConfig training;
  OptimizerConfig optimizer;
  DataConfig data;
  SampleConfig sample;
  CheckpointConfig checkpoint;
  LoggingConfig logging;

  int64_t grad_accum_steps() const {
    return training.global_batch_size / (training.micro_batch_size * parallel.dp);
  }
  // Layers of each pipeline stage (pp * virtual_stages entries, stage s = chunk * pp + rank):
  // parallel.stage_layers, or the even split. Valid after validation.
  std::vector<int64_t> pipeline_stage_layers() const;
};

// Bad configuration: every problem found, one per line. main() turns it into exit code 2.
class ConfigError : public InputError {
 public:
  explicit ConfigError(std::vector<std::string> problems);
  const std::vector<std::string>& problems() const { return problems_; }

 private:
  std::vector<std::string> problems_;
};

// Parse, apply defaults and derived values (num_kv_heads = 0 -> num_heads, ...), validate.
// Throws ConfigError listing every problem.
Config config_from_json(const nlohmann::json& j);

// Read a JSON file (ConfigError naming the file on I/O or syntax errors, with line/column),
// apply `overrides` ("section.key=value"; value parsed as JSON, else taken as a string), then
// config_from_json.
Config load_config(const std::string& path, const std::vector<std::string>& overrides);

// data.split's parts as {train, valid, test} (test 0 when given two); empty if malformed.
std::vector<double> parse_data_split(const std::string& split);

// A path as users write it in configs: a leading "~/" is $HOME, and "${NAME}" is the environment
// variable NAME. Returns false (and leaves `out` alone) naming the undefined variable in `why`.
bool expand_path(const std::string& path, std::string& out, std::string& why);

// The fully resolved config (every key, defaults filled in), as written to logs and checkpoints.
nlohmann::json config_to_json(const Config& c);

}  // namespace tetra
