// The config reader: defaults, derived values, every class of rule and its message, collecting
// several problems in one error, key suggestions, the JSON round trip, overrides and file errors.
//
// Messages are checked by their JSON path and the phrase that states the rule, so rewording the
// explanation after the phrase does not break a test, but reporting the wrong key does.
#include <catch2/catch.hpp>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "trainer/config/config.h"

using namespace tetra;
using nlohmann::json;

namespace {

// The smallest valid config: everything default, synthetic data.
json base() {
  return json{{"data", {{"synthetic", true}}}};
}

// `j` with the dotted `path` set to `value` (objects created on the way).
json with(json j, const std::string& path, const json& value) {
  json* node = &j;
  size_t start = 0;
  for (size_t dot; (dot = path.find('.', start)) != std::string::npos; start = dot + 1)
    node = &(*node)[path.substr(start, dot - start)];
  (*node)[path.substr(start)] = value;
  return j;
}

// The problems config_from_json reports; empty when it accepts the config.
std::vector<std::string> problems_of(const json& j) {
  try {
    config_from_json(j);
  } catch (const ConfigError& e) {
    return e.problems();
  }
  return {};
}

std::string joined(const std::vector<std::string>& lines) {
  std::string s;
  for (const std::string& l : lines) s += l + "\n";
  return s;
}

// Exactly one problem, starting with `prefix` ("path: value: ") and containing `phrase`.
void require_one(const json& j, const std::string& prefix, const std::string& phrase) {
  const std::vector<std::string> p = problems_of(j);
  INFO("config: " << j.dump() << "\nproblems:\n" << joined(p));
  REQUIRE(p.size() == 1);
  CHECK(p[0].rfind(prefix, 0) == 0);
  CHECK(p[0].find(phrase) != std::string::npos);
}

std::string tmp_dir() {
  const std::string dir = std::string(TETRA_TEST_TMPDIR) + "/config";
  std::filesystem::create_directories(dir);
  return dir;
}

std::string write_file(const std::string& name, const std::string& text) {
  const std::string path = tmp_dir() + "/" + name;
  std::ofstream(path, std::ios::binary) << text;
  return path;
}

// The message of the ConfigError that load_config throws ("" if it does not throw).
std::string load_error(const std::string& path, const std::vector<std::string>& overrides = {}) {
  try {
    load_config(path, overrides);
  } catch (const ConfigError& e) {
    return e.what();
  }
  return "";
}

// Field-by-field equality, written out so that a field the JSON writer forgot shows up here.
void require_equal(const Config& a, const Config& b) {
  CHECK(a.model.vocab_size == b.model.vocab_size);
  CHECK(a.model.seq_len == b.model.seq_len);
  CHECK(a.model.num_layers == b.model.num_layers);
  CHECK(a.model.hidden_size == b.model.hidden_size);
  CHECK(a.model.num_heads == b.model.num_heads);
  CHECK(a.model.num_kv_heads == b.model.num_kv_heads);
  CHECK(a.model.ffn_hidden_size == b.model.ffn_hidden_size);
  CHECK(a.model.norm == b.model.norm);
  CHECK(a.model.norm_eps == b.model.norm_eps);
  CHECK(a.model.activation == b.model.activation);
  CHECK(a.model.position == b.model.position);
  CHECK(a.model.rope_theta == b.model.rope_theta);
  CHECK(a.model.tie_embeddings == b.model.tie_embeddings);
  CHECK(a.model.bias == b.model.bias);
  CHECK(a.model.init_std == b.model.init_std);
  CHECK(a.model.moe.num_experts == b.model.moe.num_experts);
  CHECK(a.model.moe.top_k == b.model.moe.top_k);
  CHECK(a.model.moe.every == b.model.moe.every);
  CHECK(a.model.moe.ffn_hidden_size == b.model.moe.ffn_hidden_size);
  CHECK(a.model.moe.capacity_factor == b.model.moe.capacity_factor);
  CHECK(a.model.moe.aux_loss_coeff == b.model.moe.aux_loss_coeff);
  CHECK(a.model.moe.z_loss_coeff == b.model.moe.z_loss_coeff);
  CHECK(a.parallel.dp == b.parallel.dp);
  CHECK(a.parallel.tp == b.parallel.tp);
  CHECK(a.parallel.pp == b.parallel.pp);
  CHECK(a.parallel.ep == b.parallel.ep);
  CHECK(a.parallel.order == b.parallel.order);
  CHECK(a.parallel.sequence_parallel == b.parallel.sequence_parallel);
  CHECK(a.parallel.distributed_optimizer == b.parallel.distributed_optimizer);
  CHECK(a.parallel.bucket_size == b.parallel.bucket_size);
  CHECK(a.parallel.schedule == b.parallel.schedule);
  CHECK(a.parallel.virtual_stages == b.parallel.virtual_stages);
  CHECK(a.parallel.stage_layers == b.parallel.stage_layers);
  CHECK(a.parallel.grad_compression == b.parallel.grad_compression);
  CHECK(a.parallel.onebit_warmup_steps == b.parallel.onebit_warmup_steps);
  CHECK(a.training.device == b.training.device);
  CHECK(a.training.precision == b.training.precision);
  CHECK(a.training.loss_scale == b.training.loss_scale);
  CHECK(a.training.initial_loss_scale == b.training.initial_loss_scale);
  CHECK(a.training.loss_scale_window == b.training.loss_scale_window);
  CHECK(a.training.min_loss_scale == b.training.min_loss_scale);
  CHECK(a.training.hysteresis == b.training.hysteresis);
  CHECK(a.training.micro_batch_size == b.training.micro_batch_size);
  CHECK(a.training.global_batch_size == b.training.global_batch_size);
  CHECK(a.training.steps == b.training.steps);
  CHECK(a.training.seed == b.training.seed);
  CHECK(a.training.eval_every == b.training.eval_every);
  CHECK(a.training.eval_steps == b.training.eval_steps);
  CHECK(a.training.log_every == b.training.log_every);
  CHECK(a.training.threads == b.training.threads);
  CHECK(a.training.peak_gflops == b.training.peak_gflops);
  CHECK(a.optimizer.lr == b.optimizer.lr);
  CHECK(a.optimizer.min_lr == b.optimizer.min_lr);
  CHECK(a.optimizer.warmup_steps == b.optimizer.warmup_steps);
  CHECK(a.optimizer.decay == b.optimizer.decay);
  CHECK(a.optimizer.decay_steps == b.optimizer.decay_steps);
  CHECK(a.optimizer.weight_decay == b.optimizer.weight_decay);
  CHECK(a.optimizer.beta1 == b.optimizer.beta1);
  CHECK(a.optimizer.beta2 == b.optimizer.beta2);
  CHECK(a.optimizer.eps == b.optimizer.eps);
  CHECK(a.optimizer.grad_clip == b.optimizer.grad_clip);
  CHECK(a.data.synthetic == b.data.synthetic);
  for (auto [x, y] :
       {std::pair{&a.data.train, &b.data.train}, std::pair{&a.data.valid, &b.data.valid}}) {
    REQUIRE(x->size() == y->size());
    for (size_t i = 0; i < x->size(); ++i) {
      CHECK((*x)[i].path == (*y)[i].path);
      CHECK((*x)[i].weight == (*y)[i].weight);
    }
  }
  CHECK(a.data.split == b.data.split);
  CHECK(a.data.tokenizer == b.data.tokenizer);
  CHECK(a.sample.prompt == b.sample.prompt);
  CHECK(a.sample.max_tokens == b.sample.max_tokens);
  CHECK(a.sample.temperature == b.sample.temperature);
  CHECK(a.sample.top_k == b.sample.top_k);
  CHECK(a.sample.seed == b.sample.seed);
  CHECK(a.training.exit_interval == b.training.exit_interval);
  CHECK(a.training.exit_after_min == b.training.exit_after_min);
  CHECK(a.training.collective_timeout_s == b.training.collective_timeout_s);
  CHECK(a.training.max_skipped_steps == b.training.max_skipped_steps);
  CHECK(a.training.spike_zscore == b.training.spike_zscore);
  CHECK(a.training.spike_window == b.training.spike_window);
  CHECK(a.checkpoint.dir == b.checkpoint.dir);
  CHECK(a.checkpoint.every == b.checkpoint.every);
  CHECK(a.checkpoint.keep == b.checkpoint.keep);
  CHECK(a.checkpoint.resume == b.checkpoint.resume);
  CHECK(a.checkpoint.save_on_exit == b.checkpoint.save_on_exit);
  CHECK(a.logging.dir == b.logging.dir);
  CHECK(a.logging.level == b.logging.level);
}

// A config that sets every key to a value other than its default (and no 0 = derive markers),
// except data.split, which excludes data.valid.
json every_key() {
  return json::parse(R"({
    "model": {"vocab_size": 32000, "seq_len": 256, "num_layers": 4, "hidden_size": 512,
              "num_heads": 8, "num_kv_heads": 2, "ffn_hidden_size": 1376, "norm": "rmsnorm",
              "norm_eps": 1e-6, "activation": "swiglu", "position": "rope",
              "rope_theta": 500000.0, "tie_embeddings": false, "bias": false, "init_std": 0.01,
              "moe": {"num_experts": 0, "top_k": 1, "every": 2, "ffn_hidden_size": 512,
                      "capacity_factor": 1.25, "aux_loss_coeff": 0.02, "z_loss_coeff": 0.001}},
    "parallel": {"dp": 2, "tp": 2, "pp": 1, "ep": 1, "order": "tp-pp-dp",
                 "sequence_parallel": true, "distributed_optimizer": true, "bucket_size": 1000,
                 "schedule": "gpipe", "virtual_stages": 1, "stage_layers": [4],
                 "grad_compression": "bf16", "onebit_warmup_steps": 7},
    "training": {"device": "cpu", "precision": "fp16", "loss_scale": 0.0, "initial_loss_scale": 1024.0,
                 "loss_scale_window": 500, "min_loss_scale": 0.5, "hysteresis": 3, "micro_batch_size": 2,
                 "global_batch_size": 8, "steps": 500, "seed": 18446744073709551615,
                 "eval_every": 50, "eval_steps": 5, "log_every": 10, "threads": 2,
                 "peak_gflops": 123.5, "exit_interval": 250, "exit_after_min": 90.5,
                 "collective_timeout_s": 120.0, "max_skipped_steps": 3, "spike_zscore": 6.0,
                 "spike_window": 20},
    "optimizer": {"lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 20, "decay": "linear",
                  "decay_steps": 400, "weight_decay": 0.05, "beta1": 0.8, "beta2": 0.99,
                  "eps": 1e-6, "grad_clip": 0.5},
    "data": {"synthetic": false,
             "train": [{"path": "data/a", "weight": 0.7}, {"path": "data/b", "weight": 0.3}],
             "valid": [{"path": "data/v", "weight": 1.0}],
             "split": "", "tokenizer": "sentencepiece:tok.model"},
    "sample": {"prompt": "The", "max_tokens": 16, "temperature": 1.5, "top_k": 7, "seed": 9},
    "checkpoint": {"dir": "ckpt/x", "every": 100, "keep": 3, "resume": "none", "save_on_exit": false},
    "logging": {"dir": "runs/x", "level": "debug"}
  })");
}

}  // namespace

TEST_CASE("config: defaults are the documented ones and resolve as documented", "[config]") {
  const Config c = config_from_json(base());
  CHECK(c.model.vocab_size == 50257);
  CHECK(c.model.seq_len == 1024);
  CHECK(c.model.num_layers == 12);
  CHECK(c.model.hidden_size == 768);
  CHECK(c.model.num_heads == 12);
  CHECK(c.model.num_kv_heads == 12);       // 0 -> num_heads
  CHECK(c.model.ffn_hidden_size == 3072);  // 0 -> 4 * 768 (gelu)
  CHECK(c.model.norm == "layernorm");
  CHECK(c.model.norm_eps == 1e-5);
  CHECK(c.model.activation == "gelu");
  CHECK(c.model.position == "learned");
  CHECK(c.model.rope_theta == 10000.0);
  CHECK(c.model.tie_embeddings);
  CHECK(c.model.bias);
  CHECK(c.model.init_std == 0.02);
  CHECK((c.parallel.dp == 1 && c.parallel.tp == 1 && c.parallel.pp == 1 && c.parallel.ep == 1));
  CHECK(c.training.device == "cpu");
  CHECK(c.training.precision == "fp32");
  CHECK(c.training.loss_scale == 0.0);  // dynamic
  CHECK(c.training.initial_loss_scale == 65536.0);
  CHECK(c.training.loss_scale_window == 1000);
  CHECK(c.training.min_loss_scale == 1.0);
  CHECK(c.training.hysteresis == 2);
  CHECK(c.training.micro_batch_size == 4);
  CHECK(c.training.global_batch_size == 4);  // 0 -> micro_batch_size * dp
  CHECK(c.grad_accum_steps() == 1);
  CHECK(c.training.steps == 100);
  CHECK(c.training.seed == 1234);
  CHECK(c.training.eval_every == 0);
  CHECK(c.training.eval_steps == 0);
  CHECK(c.training.log_every == 1);
  CHECK(c.training.threads == 0);
  CHECK(c.training.peak_gflops == 0.0);
  CHECK(c.optimizer.lr == 6e-4);
  CHECK(c.optimizer.min_lr == 0.0);
  CHECK(c.optimizer.warmup_steps == 0);
  CHECK(c.optimizer.decay == "cosine");
  CHECK(c.optimizer.decay_steps == 0);  // stays 0: the LR schedule derives it
  CHECK(c.optimizer.weight_decay == 0.1);
  CHECK(c.optimizer.beta1 == 0.9);
  CHECK(c.optimizer.beta2 == 0.95);
  CHECK(c.optimizer.eps == 1e-8);
  CHECK(c.optimizer.grad_clip == 1.0);
  CHECK(c.data.synthetic);
  CHECK(c.data.train.empty());
  CHECK(c.data.valid.empty());
  CHECK(c.logging.dir.empty());
  CHECK(c.logging.level == "info");
}

TEST_CASE("config: derived values", "[config]") {
  SECTION("num_kv_heads: 0 means num_heads, an explicit value is kept") {
    CHECK(config_from_json(with(base(), "model.num_heads", 8)).model.num_kv_heads == 8);
    CHECK(config_from_json(with(with(base(), "model.num_heads", 8), "model.num_kv_heads", 2))
              .model.num_kv_heads == 2);
  }
  SECTION("ffn_hidden_size: 4 * hidden_size for gelu, an explicit value is kept") {
    CHECK(config_from_json(with(base(), "model.hidden_size", 96)).model.ffn_hidden_size == 384);
    CHECK(config_from_json(with(base(), "model.ffn_hidden_size", 1000)).model.ffn_hidden_size ==
          1000);
  }
  SECTION("ffn_hidden_size for swiglu: the smallest multiple of 64 that is >= 8/3 * hidden_size") {
    // Known values: 768 -> exactly 2048; 4096 -> 10922.67 rounded up to 10944.
    json j = with(with(base(), "model.activation", "swiglu"), "model.num_heads", 1);
    CHECK(config_from_json(with(j, "model.hidden_size", 768)).model.ffn_hidden_size == 2048);
    CHECK(config_from_json(with(j, "model.hidden_size", 4096)).model.ffn_hidden_size == 10944);
    // Against a search by plain counting, in exact integer arithmetic (f >= 8h/3 <=> 3f >= 8h).
    for (int64_t h = 1; h <= 700; h += 7) {
      int64_t f = 64;
      while (3 * f < 8 * h) f += 64;
      INFO("hidden_size " << h);
      CHECK(config_from_json(with(j, "model.hidden_size", h)).model.ffn_hidden_size == f);
    }
  }
  SECTION("global_batch_size: 0 means micro_batch_size * dp (no accumulation)") {
    const Config c = config_from_json(with(base(), "training.micro_batch_size", 3));
    CHECK(c.training.global_batch_size == 3);
    const Config d = config_from_json(
        with(with(base(), "training.micro_batch_size", 3), "training.global_batch_size", 12));
    CHECK(d.training.global_batch_size == 12);
    CHECK(d.grad_accum_steps() == 4);
  }
  SECTION("data lists: a plain string has weight 1, objects keep their weight") {
    const Config c = config_from_json(json::parse(R"({"data": {
        "train": ["a", {"path": "b", "weight": 2.5}, {"path": "c"}], "valid": ["v"]}})"));
    REQUIRE(c.data.train.size() == 3);
    CHECK((c.data.train[0].path == "a" && c.data.train[0].weight == 1.0));
    CHECK((c.data.train[1].path == "b" && c.data.train[1].weight == 2.5));
    CHECK((c.data.train[2].path == "c" && c.data.train[2].weight == 1.0));
    REQUIRE(c.data.valid.size() == 1);
    CHECK(c.data.valid[0].path == "v");
  }
}

TEST_CASE("config: type checks", "[config]") {
  const std::string mbs = "training.micro_batch_size";
  CHECK(problems_of(with(base(), mbs, "4")) ==
        std::vector<std::string>{
            "training.micro_batch_size: \"4\": expected an integer, got a string"});
  require_one(with(base(), mbs, 4.5),
              mbs + ": 4.5: ", "expected an integer, got a floating-point number");
  require_one(with(base(), mbs, 4.0), mbs + ": 4.0: ", "expected an integer");
  require_one(with(base(), mbs, true), mbs + ": true: ", "expected an integer, got a boolean");
  require_one(with(base(), mbs, nullptr), mbs + ": null: ", "expected an integer, got null");
  require_one(with(base(), "model.hidden_size", json::parse("9223372036854775808")),
              "model.hidden_size: 9223372036854775808: ", "out of range for a 64-bit integer");
  require_one(with(base(), "training.seed", -1), "training.seed: -1: ", "must be >= 0");
  CHECK(config_from_json(with(base(), "training.seed", json::parse("18446744073709551615")))
            .training.seed == 18446744073709551615ull);
  // Floats accept integers.
  CHECK(config_from_json(with(base(), "optimizer.min_lr", 0)).optimizer.min_lr == 0.0);
  CHECK(config_from_json(with(base(), "model.rope_theta", 500000)).model.rope_theta == 500000.0);
  require_one(with(base(), "optimizer.lr", "0.1"),
              "optimizer.lr: \"0.1\": ", "expected a number, got a string");
  require_one(with(base(), "model.bias", 1),
              "model.bias: 1: ", "expected true or false, got an integer");
  require_one(with(base(), "logging.dir", 5),
              "logging.dir: 5: ", "expected a string, got an integer");
  require_one(with(base(), "model.norm", 5), "model.norm: 5: ", "expected a string");
  CHECK(problems_of(with(base(), "optimizer.decay", "cosin")) ==
        std::vector<std::string>{"optimizer.decay: \"cosin\": must be one of cosine, linear, "
                                 "constant; did you mean \"cosine\"?"});
  require_one(with(base(), "model.norm", "RMSNorm"), "model.norm: \"RMSNorm\": ",
              "must be one of layernorm, rmsnorm; did you mean \"rmsnorm\"?");
  require_one(with(base(), "training.precision", "fp8"),
              "training.precision: \"fp8\": ", "must be one of fp32, bf16, fp16");
  require_one(with(base(), "logging.level", "loud"),
              "logging.level: \"loud\": ", "must be one of trace, debug, info, warn, error");
  require_one(with(base(), "model.activation", "relu"),
              "model.activation: \"relu\": ", "must be one of gelu, swiglu");
  require_one(with(base(), "model.position", "alibi"),
              "model.position: \"alibi\": ", "must be one of learned, rope");
  // Sections and the root must be objects.
  require_one(with(base(), "model", 5), "model: 5: ", "expected an object, got an integer");
  require_one(json::array({1}), "config: [1]: ", "expected an object");
  require_one(with(base(), "data.train", "a"),
              "data.train: \"a\": ", "expected a list of datasets");
  require_one(with(with(base(), "data.synthetic", false), "data.train", json::array({5})),
              "data.train[0]: 5: ", "expected a path string or {\"path\": ..., \"weight\": ...}");
  require_one(
      with(with(base(), "data.synthetic", false), "data.train", json::parse(R"([{"weight": 1}])")),
      "data.train[0].path: ", "missing");
}

TEST_CASE("config: pipeline layouts must build the configured model", "[config]") {
  // 12 layers (the default model) over pp stages.
  const json pp4 = with(base(), "parallel.pp", 4);
  CHECK(problems_of(pp4).empty());  // 3 layers per stage
  CHECK(problems_of(with(with(pp4, "parallel.schedule", "gpipe"), "parallel.stage_layers", json{4, 3, 3, 2})).empty());
  // 30 layers on pp=4: no silent 28-layer model; the message has the arithmetic and a split to use.
  require_one(with(pp4, "model.num_layers", 30), "model.num_layers: 30: ",
              "does not split evenly over parallel.pp (4) x parallel.virtual_stages (1) = 4 stages (30 / 4 = "
              "7.50 layers each): give the split explicitly, e.g. parallel.stage_layers = [8, 8, 7, 7]");
  require_one(with(pp4, "parallel.stage_layers", json{4, 4, 4}), "parallel.stage_layers: [4,4,4]: ",
              "has 3 entries, but parallel.pp (4) x parallel.virtual_stages (1) = 4 stages need one each");
  require_one(with(pp4, "parallel.stage_layers", json{4, 4, 4, 4}), "parallel.stage_layers: [4,4,4,4]: ",
              "adds up to 16 layers, but model.num_layers is 12");
  require_one(with(pp4, "parallel.stage_layers", json{4, -1, 5, 4}), "parallel.stage_layers[1]: -1: ",
              "must be >= 0");
  require_one(with(pp4, "parallel.stage_layers", json{4, "x", 5, 3}), "parallel.stage_layers[1]: ",
              "expected an integer");
  // Interleaved: virtual stages >= 2 dividing the layers, micro-batches a multiple of pp.
  const json inter = with(with(pp4, "parallel.schedule", "interleaved"), "parallel.virtual_stages", 3);
  CHECK(problems_of(with(with(inter, "training.micro_batch_size", 1), "training.global_batch_size", 8)).empty());
  require_one(with(with(inter, "training.micro_batch_size", 1), "training.global_batch_size", 6),
              "training.global_batch_size: 6: ", "gives 6 micro-batches per step (global_batch_size / "
              "(micro_batch_size * dp) = 6 / (1 * 1)); the interleaved schedule needs a multiple of parallel.pp (4)");
  require_one(with(with(with(inter, "parallel.virtual_stages", 2), "training.micro_batch_size", 1),
                   "training.global_batch_size", 8),
              "model.num_layers: 12: ", "does not split evenly over parallel.pp (4) x parallel.virtual_stages (2) = 8");
  require_one(with(pp4, "parallel.virtual_stages", 2), "parallel.virtual_stages: 2: ",
              "virtual stages need parallel.schedule \"interleaved\"");
  require_one(with(inter, "parallel.virtual_stages", 1), "parallel.virtual_stages: 1: ",
              "the interleaved schedule needs parallel.virtual_stages >= 2");
  require_one(with(pp4, "parallel.schedule", "zb"), "parallel.schedule: \"zb\": ", "must be one of");
  // Combined: MoE on a pipeline, gradient compression (1-bit Adam too) with pipelines and MoE.
  CHECK(problems_of(with(pp4, "model.moe", json{{"num_experts", 4}, {"top_k", 2}})).empty());
  CHECK(problems_of(with(with(pp4, "parallel.dp", 2), "parallel.grad_compression", "bf16")).empty());
  CHECK(problems_of(with(with(pp4, "parallel.dp", 2), "parallel.grad_compression", "onebit")).empty());
  CHECK(problems_of(with(with(with(pp4, "parallel.dp", 2), "parallel.grad_compression", "onebit"), "model.moe",
                         json{{"num_experts", 4}, {"top_k", 2}})).empty());
  CHECK(problems_of(with(with(pp4, "parallel.dp", 2), "parallel.grad_compression", "int8")).empty());
  // Samples during training need the whole model on a rank.
  require_one(with(with(pp4, "sample.prompt", "Hi"), "data.tokenizer", "gpt2:/x"), "sample.prompt: \"Hi\": ",
              "leave sample.prompt empty with parallel.pp > 1");
}

TEST_CASE("config: single-value ranges", "[config]") {
  struct Case {
    std::string path;
    json value;
    std::string phrase;
  };
  const std::vector<Case> cases = {
      {"model.vocab_size", 0, "must be >= 1"},
      {"model.vocab_size", 2147483648LL, "must be <= 2147483647"},
      {"model.seq_len", 0, "must be >= 1"},
      {"model.num_layers", -1, "must be >= 1"},
      {"model.hidden_size", 0, "must be >= 1"},
      {"model.num_heads", 0, "must be >= 1"},
      {"model.num_kv_heads", -1, "must be >= 0"},
      {"model.ffn_hidden_size", -5, "must be >= 0"},
      {"model.norm_eps", 0.0, "must be > 0"},
      {"model.rope_theta", -1.0, "must be > 0"},
      {"model.init_std", 0.0, "must be > 0"},
      {"parallel.dp", 0, "must be >= 1"},
      {"parallel.tp", -1, "must be >= 1"},
      {"parallel.pp", 0, "must be >= 1"},
      {"parallel.virtual_stages", 0, "must be >= 1"},
      {"parallel.bucket_size", 0, "must be >= 1"},
      {"parallel.onebit_warmup_steps", 0, "must be >= 1"},
      {"training.micro_batch_size", 0, "must be >= 1"},
      {"training.global_batch_size", -4, "must be >= 0"},
      {"training.steps", 0, "must be >= 1"},
      {"training.eval_every", -1, "must be >= 0"},
      {"training.eval_steps", -1, "must be >= 0"},
      {"training.log_every", 0, "must be >= 1"},
      {"training.threads", -1, "must be >= 0"},
      {"training.peak_gflops", -1.0, "must be >= 0"},
      {"training.exit_after_min", -1.0, "must be >= 0"},
      {"training.collective_timeout_s", -5.0, "must be >= 0"},
      {"training.max_skipped_steps", -1, "must be >= 0"},
      {"training.spike_zscore", -0.5, "must be >= 0"},
      {"training.spike_window", 1, "must be >= 2"},
      {"training.loss_scale", -1.0, "must be >= 0"},
      {"training.loss_scale", 1e20, "must be <= 2^64"},
      {"training.initial_loss_scale", 0.0, "must be > 0"},
      {"training.initial_loss_scale", 3.7e19, "must be <= 2^64"},
      {"training.loss_scale_window", 0, "must be >= 1"},
      {"training.min_loss_scale", -2.0, "must be > 0"},
      {"training.hysteresis", 0, "must be >= 1"},
      {"optimizer.lr", 0.0, "must be > 0"},
      {"optimizer.lr", -1e-3, "must be > 0"},
      {"optimizer.min_lr", -1e-5, "must be >= 0"},
      {"optimizer.warmup_steps", -1, "must be >= 0"},
      {"optimizer.decay_steps", -1, "must be >= 0"},
      {"optimizer.weight_decay", -0.1, "must be >= 0"},
      {"optimizer.beta1", 1.0, "must be in [0, 1)"},
      {"optimizer.beta1", -0.1, "must be in [0, 1)"},
      {"optimizer.beta2", 1.5, "must be in [0, 1)"},
      {"optimizer.eps", 0.0, "must be > 0"},
      {"optimizer.grad_clip", -1.0, "must be >= 0"},
  };
  for (const Case& c : cases) {
    INFO(c.path << " = " << c.value.dump());
    require_one(with(base(), c.path, c.value), c.path + ": " + c.value.dump() + ": ", c.phrase);
  }
  // The edges of the ranges are accepted.
  json edges = base();
  for (const auto& [path, value] :
       std::vector<std::pair<std::string, json>>{{"optimizer.beta1", 0.0},
                                                 {"optimizer.beta2", 0.0},
                                                 {"optimizer.weight_decay", 0.0},
                                                 {"optimizer.grad_clip", 0.0},
                                                 {"optimizer.min_lr", 6e-4},
                                                 {"optimizer.warmup_steps", 0},
                                                 {"training.eval_every", 0},
                                                 {"training.threads", 0},
                                                 {"training.steps", 1},
                                                 {"model.vocab_size", 2147483647LL}})
    edges = with(edges, path, value);
  CHECK(problems_of(edges).empty());
}

TEST_CASE("config: cross-field rules", "[config]") {
  require_one(with(base(), "model.hidden_size", 770),
              "model.hidden_size: 770: ", "must be divisible by model.num_heads (12)");
  require_one(with(base(), "model.num_kv_heads", 5),
              "model.num_kv_heads: 5: ", "must divide model.num_heads (12)");
  // Head size 780 / 12 = 65: fine for a learned position table, not for RoPE (pairs of dims).
  CHECK(problems_of(with(base(), "model.hidden_size", 780)).empty());
  require_one(
      with(with(base(), "model.hidden_size", 780), "model.position", "rope"),
      "model.hidden_size: 780: ", "head size hidden_size / num_heads (780 / 12 = 65) must be even");
  CHECK(problems_of(with(base(), "model.position", "rope")).empty());
  require_one(with(base(), "training.global_batch_size", 10), "training.global_batch_size: 10: ",
              "must be a multiple of training.micro_batch_size * parallel.dp (4 * 1 = 4)");
  require_one(with(base(), "optimizer.min_lr", 1.0),
              "optimizer.min_lr: 1.0: ", "must be <= optimizer.lr (0.0006)");
}

TEST_CASE("config: parallel layout rules", "[config]") {
  // Tensor parallelism splits heads, kv heads, the MLP and the vocabulary: each is named with
  // both values.
  json j = with(with(with(base(), "parallel.tp", 8), "model.num_kv_heads", 4), "model.vocab_size", 1000);
  const std::string all = joined(problems_of(j));
  INFO(all);
  CHECK(all.find("model.num_heads (12) must be a multiple of parallel.tp (8)") != std::string::npos);
  CHECK(all.find("model.num_kv_heads (4) must be a multiple of parallel.tp (8)") != std::string::npos);
  CHECK(all.find("model.vocab_size (1000) must be a multiple of parallel.tp (8)") == std::string::npos);
  CHECK(all.find("ffn_hidden_size") == std::string::npos);  // 3072 = 8 * 384
  const json vb = with(base(), "model.vocab_size", 50304);  // GPT-2's vocabulary padded to 128s
  require_one(with(with(vb, "parallel.tp", 4), "model.ffn_hidden_size", 1000 + 2),
              "model.ffn_hidden_size: 1002: ", "model.ffn_hidden_size (1002) must be a multiple of parallel.tp (4)");
  CHECK(problems_of(with(vb, "parallel.tp", 4)).empty());
  require_one(with(base(), "parallel.tp", 4), "model.vocab_size: 50257: ",
              "model.vocab_size (50257) must be a multiple of parallel.tp (4)");
  require_one(with(base(), "parallel.sequence_parallel", true), "parallel.sequence_parallel: true: ",
              "needs parallel.tp > 1");
  require_one(with(with(with(with(vb, "parallel.tp", 4), "parallel.sequence_parallel", true),
                        "model.seq_len", 6), "training.micro_batch_size", 1),
              "parallel.sequence_parallel: true: ",
              "micro_batch_size * seq_len (1 * 6 = 6), must be a multiple of parallel.tp (4)");
  require_one(with(with(base(), "parallel.dp", 4), "parallel.ep", 3), "parallel.ep: 3: ",
              "parallel.ep (3) must divide parallel.dp (4)");
  require_one(with(with(base(), "parallel.dp", 4), "parallel.ep", 2), "parallel.ep: 2: ",
              "needs a Mixture-of-Experts model");
  // Mixture of Experts and expert parallelism.
  const json moe = with(with(vb, "model.moe.num_experts", 8), "parallel.dp", 4);
  CHECK(problems_of(with(moe, "parallel.ep", 4)).empty());
  CHECK(config_from_json(moe).model.moe.ffn_hidden_size == 4 * 768);  // defaults to the dense one
  CHECK(!config_from_json(moe).model.moe.capacity_factor);              // dropless by default
  CHECK(*config_from_json(with(moe, "model.moe.capacity_factor", 1.5)).model.moe.capacity_factor == 1.5);
  require_one(with(moe, "parallel.ep", 3), "parallel.ep: 3: ", "parallel.ep (3) must divide parallel.dp (4)");
  require_one(with(with(moe, "parallel.dp", 6), "parallel.ep", 3), "parallel.ep: 3: ",
              "parallel.ep (3) must divide model.moe.num_experts (8)");
  require_one(with(moe, "model.moe.top_k", 9), "model.moe.top_k: 9: ",
              "model.moe.top_k (9) must be <= model.moe.num_experts (8)");
  require_one(with(moe, "model.moe.capacity_factor", 0.0), "model.moe.capacity_factor: 0", "or null for dropless");
  CHECK(problems_of(with(moe, "parallel.tp", 2)).empty());
  require_one(with(with(moe, "parallel.tp", 2), "model.moe.ffn_hidden_size", 101), "model.moe.ffn_hidden_size: 101: ",
              "must be a multiple of parallel.tp (2)");
  require_one(with(with(moe, "parallel.tp", 2), "model.activation", "swiglu"), "model.bias: true: ",
              "swiglu fc biases cannot be split");
  CHECK(problems_of(with(with(moe, "parallel.ep", 2), "parallel.distributed_optimizer", true)).empty());
  require_one(with(with(with(moe, "parallel.ep", 2), "sample.prompt", "The"), "data.tokenizer", "gpt2:t"), "sample.prompt: ",
              "not available with expert parallelism");
  require_one(with(moe, "model.moe.topk", 2), "model.moe.topk: ", "did you mean \"model.moe.top_k\"");
  require_one(with(base(), "model.moe", 3), "model.moe: 3: ", "expected an object");
  require_one(with(base(), "parallel.order", "tp-ep-dp"), "parallel.order: ", "tp-dp-pp");
  require_one(with(base(), "parallel.grad_compression", "int4"), "parallel.grad_compression: ", "onebit");
  CHECK(problems_of(with(with(base(), "parallel.dp", 2), "parallel.order", "dp-tp-pp")).empty());
}

TEST_CASE("config: data split, tokenizer, samples and paths", "[config]") {
  const json ds = with(with(base(), "data.synthetic", false), "data.train", json::array({"a"}));
  CHECK(problems_of(with(ds, "data.split", "98,2")).empty());
  CHECK(problems_of(with(ds, "data.split", "949,50,1")).empty());
  for (const char* bad : {"98", "98,2,0,0", "-1,2", "0,5", "98,x", "98,,2", ""})
    if (std::string(bad).size() > 0)
      require_one(with(ds, "data.split", bad), std::string("data.split: \"") + bad + "\": ",
                  "2 or 3 non-negative numbers");
  require_one(with(with(ds, "data.split", "98,2"), "data.valid", json::array({"v"})),
              "data.split: \"98,2\": ", "leave data.valid empty");
  require_one(with(base(), "data.tokenizer", "bpe:x"), "data.tokenizer: \"bpe:x\": ",
              "sentencepiece:<model file>");
  require_one(with(base(), "sample.prompt", "Hello"), "sample.prompt: \"Hello\": ", "set data.tokenizer");
  CHECK(problems_of(with(with(base(), "sample.prompt", "Hello"), "data.tokenizer", "gpt2:dir")).empty());
  CHECK(parse_data_split("98,2") == std::vector<double>{98, 2, 0});
  CHECK(parse_data_split("1,0.5,0.25") == std::vector<double>{1, 0.5, 0.25});
  CHECK(parse_data_split("0,1").empty());
  // Paths: ~ and ${VAR} are expanded; an unset variable is an error naming it.
  setenv("TETRA_TEST_DATA_ROOT", "/srv/corpus", 1);
  unsetenv("TETRA_TEST_UNSET_VAR");
  const Config c = config_from_json(with(ds, "data.train", json::array({"${TETRA_TEST_DATA_ROOT}/sotu_train"})));
  CHECK(c.data.train[0].path == "/srv/corpus/sotu_train");
  const Config t = config_from_json(with(base(), "data.tokenizer", "sentencepiece:~/tok/a.model"));
  CHECK(t.data.tokenizer == "sentencepiece:" + std::string(std::getenv("HOME")) + "/tok/a.model");
  const Config h = config_from_json(with(base(), "logging.dir", "~/runs/a"));
  CHECK(h.logging.dir == std::string(std::getenv("HOME")) + "/runs/a");
  require_one(with(ds, "data.train", json::array({"${TETRA_TEST_UNSET_VAR}/x"})), "data.train[0].path: ",
              "the environment variable TETRA_TEST_UNSET_VAR is not set");
}

TEST_CASE("config: data and evaluation rules", "[config]") {
  const json real = json{{"data", {{"train", {"data/a"}}}}};
  CHECK(problems_of(real).empty());
  require_one(json::object(),
              "data.train: []: ", "must list at least one dataset, or set data.synthetic to true");
  require_one(with(real, "data.synthetic", true),
              "data.train: ", "must be empty when data.synthetic is true");
  require_one(with(base(), "data.valid", {"v"}),
              "data.valid: ", "must be empty when data.synthetic is true");
  require_one(with(real, "data.train", {""}), "data.train[0].path: \"\": ", "must not be empty");
  require_one(with(real, "data.train", {"a", "data/x.bin"}), "data.train[1].path: \"data/x.bin\": ",
              "give the dataset prefix without .bin (\"data/x\")");
  require_one(with(real, "data.valid", {"data/v.idx"}), "data.valid[0].path: ", "without .idx");
  require_one(with(real, "data.train", json::parse(R"([{"path": "a", "weight": 0}])")),
              "data.train[0].weight: 0.0: ", "must be > 0");
  require_one(with(real, "data.train", json::parse(R"([{"path": "a", "weight": "2"}])")),
              "data.train[0].weight: \"2\": ", "expected a number");
  // Evaluation needs eval_steps and validation data (a valid list, or synthetic data).
  require_one(with(base(), "training.eval_every", 10),
              "training.eval_every: 10: ", "evaluating needs training.eval_steps > 0");
  CHECK(
      problems_of(with(with(base(), "training.eval_every", 10), "training.eval_steps", 2)).empty());
  require_one(with(with(real, "training.eval_every", 10), "training.eval_steps", 2),
              "training.eval_every: 10: ", "evaluating needs validation data");
  require_one(with(real, "training.eval_steps", 2),
              "training.eval_steps: 2: ", "evaluating needs validation data");
  CHECK(problems_of(with(with(with(real, "training.eval_every", 10), "training.eval_steps", 2),
                         "data.valid", {"data/v"}))
            .empty());
}

TEST_CASE("config: fp16 loss scaling keys and their rules", "[config]") {
  const json fp16 = with(base(), "training.precision", "fp16");
  // Every key accepted with fp16 (dynamic), and a static scale alone.
  CHECK(problems_of(with(with(with(with(with(fp16, "training.initial_loss_scale", 4096.0), "training.loss_scale_window", 10),
                                   "training.min_loss_scale", 0.25), "training.hysteresis", 1),
                         "parallel.grad_compression", "bf16")).empty());
  CHECK(problems_of(with(fp16, "training.loss_scale", 128.0)).empty());
  const Config c = config_from_json(with(fp16, "training.initial_loss_scale", 1099511627776.0));  // 2^40
  CHECK(c.training.precision == "fp16");
  CHECK(c.training.initial_loss_scale == 1099511627776.0);
  // With another precision each key set away from its default is reported, naming the precision.
  for (const char* precision : {"fp32", "bf16"}) {
    const json other = with(base(), "training.precision", precision);
    const std::vector<std::pair<std::string, json>> keys = {{"training.loss_scale", 8.0},
                                                            {"training.initial_loss_scale", 1024.0},
                                                            {"training.loss_scale_window", 10},
                                                            {"training.min_loss_scale", 2.0},
                                                            {"training.hysteresis", 3}};
    for (const auto& [path, value] : keys) {
      INFO(precision << " " << path);
      require_one(with(other, path, value), path + ": " + value.dump() + ": ",
                  std::string("loss scaling applies to training.precision \"fp16\" only (it is \"") + precision);
    }
    // Left at their defaults, they are no problem (a written-out config carries them all).
    CHECK(problems_of(with(with(other, "training.initial_loss_scale", 65536.0), "training.hysteresis", 2)).empty());
  }
  // The dynamic keys with a static scale.
  const json fixed = with(fp16, "training.loss_scale", 1024.0);
  require_one(with(fixed, "training.initial_loss_scale", 4096.0), "training.initial_loss_scale: 4096.0: ",
              "applies to dynamic loss scaling only, but training.loss_scale is 1024.0");
  require_one(with(fixed, "training.loss_scale_window", 50), "training.loss_scale_window: 50: ",
              "set training.loss_scale to 0 (dynamic)");
  require_one(with(fixed, "training.hysteresis", 1), "training.hysteresis: 1: ", "a static scale");
  require_one(with(fixed, "training.min_loss_scale", 4.0), "training.min_loss_scale: 4.0: ", "a static scale");
  // The floor must lie below the start.
  require_one(with(with(fp16, "training.initial_loss_scale", 16.0), "training.min_loss_scale", 32.0),
              "training.min_loss_scale: 32.0: ", "must be <= training.initial_loss_scale (16.0)");
  // Compressions with error feedback are refused with fp16, naming both keys.
  for (const char* gc : {"onebit", "int8"}) {
    INFO(gc);
    require_one(with(with(fp16, "parallel.dp", 2), "parallel.grad_compression", gc),
                std::string("parallel.grad_compression: \"") + gc + "\": ",
                "cannot be combined with training.precision \"fp16\"");
    CHECK(problems_of(with(with(with(base(), "training.precision", "bf16"), "parallel.dp", 2),
                           "parallel.grad_compression", gc)).empty());
  }
  CHECK(problems_of(with(with(fp16, "parallel.dp", 2), "parallel.grad_compression", "bf16")).empty());
}

TEST_CASE("config: every problem is collected into one error, grouped by section", "[config]") {
  const json j = json::parse(R"({
    "data": {"synthetic": false},
    "training": {"steps": 0, "micro_batch_size": "4"},
    "model": {"hidden_size": 770, "hiden_size": 1, "norm": "x"}
  })");
  std::vector<std::string> p;
  std::string what;
  try {
    config_from_json(j);
  } catch (const ConfigError& e) {
    p = e.problems();
    what = e.what();
  }
  INFO(joined(p));
  REQUIRE(p.size() == 6);
  CHECK(what + "\n" == joined(p));  // what(): one line per problem
  auto index_of = [&](const std::string& prefix) {
    for (size_t i = 0; i < p.size(); ++i)
      if (p[i].rfind(prefix, 0) == 0) return static_cast<int>(i);
    return -1;
  };
  const int norm = index_of("model.norm: \"x\": must be one of"),
            typo = index_of("model.hiden_size: unknown key"),
            divisible = index_of("model.hidden_size: 770: must be divisible"),
            steps = index_of("training.steps: 0: must be >= 1"),
            mbs = index_of("training.micro_batch_size: \"4\": expected an integer"),
            data = index_of("data.train: []: must list");
  for (int i : {norm, typo, divisible, steps, mbs, data}) CHECK(i >= 0);
  // Sections in their documented order: model, training, data.
  CHECK(std::max({norm, typo, divisible}) < std::min(steps, mbs));
  CHECK(std::max(steps, mbs) < data);
  // A ConfigError is an input error (exit code 2 at the top level).
  CHECK_THROWS_AS(config_from_json(j), InputError);
}

TEST_CASE("config: a rejected value does not cause follow-on messages", "[config]") {
  // Each of these would divide by zero or compare against a meaningless value if the rules ran on
  // them; exactly one message is expected.
  require_one(with(base(), "model.num_heads", 0), "model.num_heads: 0: ", "must be >= 1");
  require_one(with(base(), "model.hidden_size", "768"),
              "model.hidden_size: \"768\": ", "expected an integer");
  require_one(with(base(), "training.micro_batch_size", 0),
              "training.micro_batch_size: 0: ", "must be >= 1");
  require_one(with(base(), "parallel.dp", 0), "parallel.dp: 0: ", "must be >= 1");
  require_one(with(base(), "optimizer.lr", -1.0), "optimizer.lr: -1.0: ", "must be > 0");
  require_one(with(base(), "data.synthetic", "yes"),
              "data.synthetic: \"yes\": ", "expected true or false");
  // A section that is not an object hides the rules on its keys.
  require_one(json{{"data", 5}}, "data: 5: ", "expected an object");
}

TEST_CASE("config: unknown keys and sections, with suggestions", "[config]") {
  auto one = [](const json& j) {
    const std::vector<std::string> p = problems_of(j);
    INFO(joined(p));
    REQUIRE(p.size() == 1);
    return p[0];
  };
  CHECK(one(with(base(), "model.hiden_size", 768)) ==
        "model.hiden_size: unknown key; did you mean \"model.hidden_size\"?");
  CHECK(one(with(base(), "model.Hidden-Size", 768)) ==
        "model.Hidden-Size: unknown key; did you mean \"model.hidden_size\"?");
  CHECK(one(with(base(), "training.lr", 1e-3)) ==
        "training.lr: unknown key; did you mean \"optimizer.lr\"?");
  CHECK(one(with(base(), "model.num_attention_heads", 8)) ==
        "model.num_attention_heads: unknown key; did you mean \"model.num_heads\"?");
  CHECK(one(with(base(), "optimizer.adam_beta2", 0.99)) ==
        "optimizer.adam_beta2: unknown key; did you mean \"optimizer.beta2\"?");
  CHECK(one(with(base(), "model.qwertyuiop", 1)) == "model.qwertyuiop: unknown key");
  CHECK(one(with(base(), "modle", json::object())) ==
        "modle: unknown section; did you mean \"model\"?");
  CHECK(one(with(base(), "lr", 1e-3)) == "lr: unknown section; did you mean \"optimizer.lr\"?");
  CHECK(one(with(base(), "zzz_qqq", 1)) == "zzz_qqq: unknown section");
  CHECK(one(json{{"data", {{"synthetic", true}}}, {"model.num_layers", 2}}) ==
        "model.num_layers: unknown section; keys are nested in their section: "
        "{\"model\": {\"num_layers\": ...}}");
  CHECK(one(with(with(base(), "data.synthetic", false), "data.train",
                 json::parse(R"([{"path": "a", "wieght": 2}])"))) ==
        "data.train[0].wieght: unknown key; did you mean \"data.train[0].weight\"?");
}

TEST_CASE("config: config_to_json writes every key and reads back to the same config", "[config]") {
  SECTION("a config that sets every key: parsed exactly, written back exactly") {
    const json j = every_key();
    const Config c = config_from_json(j);
    CHECK(c.model.ffn_hidden_size == 1376);
    CHECK(c.training.seed == 18446744073709551615ull);
    REQUIRE(c.data.train.size() == 2);
    CHECK(c.data.train[1].weight == 0.3);
    CHECK(config_to_json(c) == j);  // every key, nothing else (the input lists every key once)
    require_equal(config_from_json(config_to_json(c)), c);
  }
  SECTION("defaults and derived values survive the round trip") {
    for (const json& j :
         {base(), with(with(base(), "model.activation", "swiglu"), "logging.dir", "runs/b"),
          json{{"data", {{"train", {"a", "b"}}, {"valid", {"c"}}}}}}) {
      INFO(j.dump());
      const Config c = config_from_json(j);
      const json written = config_to_json(c);
      for (const char* section : {"model", "parallel", "training", "optimizer", "data", "logging"})
        CHECK(written.contains(section));
      CHECK(written["model"]["num_kv_heads"] == c.model.num_heads);
      require_equal(config_from_json(written), c);
      CHECK(config_to_json(config_from_json(written)) == written);
    }
  }
}

TEST_CASE("config: load_config applies overrides", "[config]") {
  const std::string path = write_file("overrides.json", R"({
    // comments are allowed
    "model": {"hidden_size": 256, "num_heads": 4},
    "data": {"synthetic": true}
  })");
  const Config c =
      load_config(path, {"model.hidden_size=128", "optimizer.lr=1e-3", "model.bias=false",
                         "logging.dir=runs/x y", "model.norm=rmsnorm", "training.seed=7",
                         "training.precision=\"bf16\""});
  CHECK(c.model.hidden_size == 128);  // the override wins over the file
  CHECK(c.model.num_heads == 4);      // the rest of the file stays
  CHECK(c.optimizer.lr == 1e-3);
  CHECK(!c.model.bias);
  CHECK(c.logging.dir == "runs/x y");  // not JSON: taken as a string
  CHECK(c.model.norm == "rmsnorm");
  CHECK(c.training.seed == 7);
  CHECK(c.training.precision == "bf16");
  // A list, and the last override of a key wins.
  const Config d =
      load_config(path, {"data.synthetic=false", R"(data.train=["a", {"path": "b", "weight": 3}])",
                         "training.steps=5", "training.steps=6"});
  REQUIRE(d.data.train.size() == 2);
  CHECK(d.data.train[1].weight == 3.0);
  CHECK(d.training.steps == 6);
  // Override values go through the same checks; override errors and config errors come together.
  const std::string e =
      load_error(path, {"model.hiden_size=1", "training.steps", "model.hidden_size.x=1",
                        "model..norm=rmsnorm", "training.micro_batch_size=four"});
  INFO(e);
  CHECK(e.find("override \"training.steps\": expected section.key=value") != std::string::npos);
  CHECK(e.find("override \"model.hidden_size.x=1\": model.hidden_size is 256, not an object") !=
        std::string::npos);
  CHECK(e.find("override \"model..norm=rmsnorm\": expected section.key=value") !=
        std::string::npos);
  CHECK(e.find("model.hiden_size: unknown key; did you mean \"model.hidden_size\"?") !=
        std::string::npos);
  CHECK(e.find("training.micro_batch_size: \"four\": expected an integer, got a string") !=
        std::string::npos);
}

TEST_CASE("config: file errors name the file, syntax errors the line and column", "[config]") {
  const std::string missing = tmp_dir() + "/no_such_config.json";
  std::filesystem::remove(missing);
  CHECK(load_error(missing) ==
        missing + ": cannot read the config file: No such file or directory");
  CHECK(load_error(tmp_dir()) == tmp_dir() + ": cannot read the config file: it is a directory");
  CHECK_THROWS_AS(load_config(missing, {}), InputError);

  // A trailing comma: the parser stops at the '}' on line 4, column 3.
  const std::string trailing =
      write_file("trailing_comma.json", "{\n  \"model\": {\n    \"hidden_size\": 768,\n  }\n}\n");
  std::string e = load_error(trailing);
  INFO(e);
  CHECK(e.rfind(trailing + ":4:3: invalid JSON: ", 0) == 0);
  CHECK(e.find("[json.exception") == std::string::npos);  // the parser's prefix is dropped
  // Cut short: the error is at the end of the input, line 3, column 1 (after the last newline).
  const std::string truncated = write_file("truncated.json", "{\n  \"model\": {\n");
  e = load_error(truncated);
  CHECK(e.rfind(truncated + ":3:1: invalid JSON: ", 0) == 0);
  // A bad literal on the first line.
  const std::string literal = write_file("literal.json", "{\"data\": {\"synthetic\": yes}}");
  e = load_error(literal);
  CHECK(e.rfind(literal + ":1:", 0) == 0);
  CHECK(e.find("invalid literal") != std::string::npos);
  const std::string empty = write_file("empty.json", "");
  CHECK(load_error(empty).rfind(empty + ":1:1: invalid JSON: ", 0) == 0);

  // A key given twice in one object (the parser would keep the last one silently).
  const std::string dup =
      write_file("duplicate.json", R"({"model": {"num_layers": 2, "num_layers": 3},
    "data": {"train": ["a", {"path": "b", "path": "c"}]}})");
  e = load_error(dup);
  CHECK(e.find("model.num_layers: duplicate key") != std::string::npos);
  CHECK(e.find("data.train[1].path: duplicate key") != std::string::npos);
  // Keys of the same name in different objects are not duplicates.
  const std::string same = write_file(
      "same_names.json",
      R"({"data": {"train": [{"path": "a"}, {"path": "b"}], "valid": [{"path": "c"}]}})");
  CHECK(load_error(same).empty());
}
