// The run configuration: one struct per JSON section, read once and validated before any rank
// allocates anything.
//
// Reading collects every problem it finds (unknown keys with the closest known key suggested,
// wrong types, out-of-range values, cross-field rules) and reports them all at once in a
// ConfigError whose message lists one line per problem: "<json.path>: <value>: <rule>".
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kernels/common/check.h"

namespace tetra {

// Mixture of Experts (model.moe): every `every`-th block (layers l with l % every == 0, Megatron's
// moe_layer_freq) replaces its MLP by num_experts expert MLPs and a router; 0 experts = dense.
struct MoeConfig {
  int64_t num_experts = 0;
  int64_t top_k = 2;
  int64_t every = 1;
  int64_t ffn_hidden_size = 0;            // of each expert; 0 = model.ffn_hidden_size
  std::optional<double> capacity_factor;  // null = dropless; else each expert takes at most
                                          // ceil(factor * tokens * top_k / num_experts) tokens
  double aux_loss_coeff = 0.01;           // Switch / GShard load-balancing loss
  double z_loss_coeff = 0.0;              // router z-loss (ST-MoE)
  bool enabled() const { return num_experts > 0; }
  bool is_moe_layer(int64_t l) const { return enabled() && l % every == 0; }
};

struct ModelConfig {
  int64_t vocab_size = 50257;
  int64_t seq_len = 1024;
  int64_t num_layers = 12;
  int64_t hidden_size = 768;
  int64_t num_heads = 12;
  int64_t num_kv_heads = 0;      // 0 = num_heads (multi-head attention)
  int64_t ffn_hidden_size = 0;   // 0 = 4 * hidden_size (gelu), or for swiglu
                                 // 8/3 * hidden_size rounded up to a multiple of 64
  std::string norm = "layernorm";  // layernorm | rmsnorm
  double norm_eps = 1e-5;
  std::string activation = "gelu";  // gelu | swiglu
  std::string position = "learned";  // learned | rope
  double rope_theta = 10000.0;
  bool tie_embeddings = true;
  bool bias = true;
  double init_std = 0.02;
  MoeConfig moe;
  // Derived by resolve(): never 0 after validation.
  int64_t head_size() const { return hidden_size / num_heads; }
};

struct ParallelConfig {
  int64_t dp = 1;
  int64_t tp = 1;
  int64_t pp = 1;
  int64_t ep = 1;
  std::string order = "tp-dp-pp";      // rank order, fastest-varying axis first
  bool sequence_parallel = false;      // norms and residual on sequence shards (needs tp > 1)
  bool distributed_optimizer = false;  // shard fp32 master weights and Adam moments over dp
  int64_t bucket_size = 40000000;      // parameters per gradient bucket (Megatron's
                                       // --ddp-bucket-size): reduced as soon as backward fills it
  std::string schedule = "1f1b";       // pipeline schedule: 1f1b | interleaved | gpipe
  int64_t virtual_stages = 1;          // model chunks per pipeline rank (interleaved: >= 2)
  std::vector<int64_t> stage_layers;   // layers of each of the pp * virtual_stages stages, in
                                       // stage order; empty = an even split
  std::string grad_compression = "none";  // none | bf16 | onebit | int8 (trainer/optim/compression.h)
  int64_t onebit_warmup_steps = 100;      // onebit: steps of exact Adam before the variance freezes
};

// The largest loss scale (2^64): the scaler never grows past it, and no configured scale may
// exceed it. Beyond it a gradient norm of the scaled gradients overflows fp32's sum of squares.
inline constexpr double kMaxLossScale = 18446744073709551616.0;

struct TrainingConfig {
  std::string device = "cpu";       // cpu | cuda
  std::string precision = "fp32";   // fp32 | bf16 | fp16
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
};

struct OptimizerConfig {
  double lr = 6e-4;
  double min_lr = 0.0;
  int64_t warmup_steps = 0;
  std::string decay = "cosine";     // cosine | linear | constant
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
  // "gpt2:<dir with encoder.json, vocab.bpe>" or "sentencepiece:<file.model>": the tokenizer the
  // datasets were made with (for samples and `tetra generate`). Empty: none.
  std::string tokenizer;
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
  std::string resume = "auto";      // auto: from dir/latest if present | none | a checkpoint path
  bool save_on_exit = true;         // save when training ends or on SIGTERM / SIGUSR1
};

struct LoggingConfig {
  std::string dir;                  // empty = no files, console only
  std::string level = "info";       // trace | debug | info | warn | error
};

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
