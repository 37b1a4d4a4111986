// The config reader: defaults, derived values, collecting several problems in one error, key
// suggestions, the JSON round trip, overrides and file errors (every class of rule and its message:
// test_config_rules.cpp).
//
// Messages are checked by their JSON path and the phrase that states the rule, so rewording the
// explanation after the phrase does not break a test, but reporting the wrong key does.
#include <catch2/catch.hpp>
#include <fmt/format.h>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "trainer/config/config.h"
#include "tests/unit/config_testing.h"

using namespace tetra;
using nlohmann::json;
using namespace tetra::config_testing;

namespace {

// Field-by-field equality, written out so that a field the JSON writer forgot shows up here.
void require_equal(const Config& a, const Config& b) {
  CHECK(a.model.vocab_size == b.model.vocab_size);
  CHECK(a.model.seq_len == b.model.seq_len);
  CHECK(a.model.num_layers == b.model.num_layers);
  CHECK(a.model.hidden_size == b.model.hidden_size);
  CHECK(a.model.num_heads == b.model.num_heads);
  CHECK(a.model.num_kv_heads == b.model.num_kv_heads);
  CHECK(a.model.head_dim == b.model.head_dim);
  CHECK(a.model.ffn_hidden_size == b.model.ffn_hidden_size);
  CHECK(a.model.norm == b.model.norm);
  CHECK(a.model.norm_eps == b.model.norm_eps);
  CHECK(a.model.activation == b.model.activation);
  CHECK(a.model.position == b.model.position);
  CHECK(a.model.rope_theta == b.model.rope_theta);
  CHECK(a.model.rope_scaling.type == b.model.rope_scaling.type);
  CHECK(a.model.rope_scaling.factor == b.model.rope_scaling.factor);
  CHECK(a.model.rope_scaling.low_freq_factor == b.model.rope_scaling.low_freq_factor);
  CHECK(a.model.rope_scaling.high_freq_factor == b.model.rope_scaling.high_freq_factor);
  CHECK(a.model.rope_scaling.original_max_position_embeddings ==
        b.model.rope_scaling.original_max_position_embeddings);
  CHECK(a.model.tie_embeddings == b.model.tie_embeddings);
  CHECK(a.model.bias == b.model.bias);
  CHECK(a.model.qkv_bias == b.model.qkv_bias);
  CHECK(a.model.qk_norm == b.model.qk_norm);
  CHECK(a.checkpoint.init == b.checkpoint.init);
  CHECK(a.model.init_std == b.model.init_std);
  CHECK(a.model.moe.num_experts == b.model.moe.num_experts);
  CHECK(a.model.moe.top_k == b.model.moe.top_k);
  CHECK(a.model.moe.every == b.model.moe.every);
  CHECK(a.model.moe.ffn_hidden_size == b.model.moe.ffn_hidden_size);
  CHECK(a.model.moe.capacity_factor == b.model.moe.capacity_factor);
  CHECK(a.model.moe.max_load_factor == b.model.moe.max_load_factor);
  CHECK(a.model.moe.router_pre_softmax == b.model.moe.router_pre_softmax);
  CHECK(a.model.moe.router_topk_scaling_factor == b.model.moe.router_topk_scaling_factor);
  CHECK(a.model.moe.first_k_dense_replace == b.model.moe.first_k_dense_replace);
  CHECK(a.model.moe.router_score_function == b.model.moe.router_score_function);
  CHECK(a.model.moe.router_enable_expert_bias == b.model.moe.router_enable_expert_bias);
  CHECK(a.model.moe.router_bias_update_rate == b.model.moe.router_bias_update_rate);
  CHECK(a.model.moe.shared_expert_ffn_hidden_size == b.model.moe.shared_expert_ffn_hidden_size);
  CHECK(a.model.moe.shared_expert_gate == b.model.moe.shared_expert_gate);
  CHECK(a.model.moe.aux_loss_coeff == b.model.moe.aux_loss_coeff);
  CHECK(a.model.moe.z_loss_coeff == b.model.moe.z_loss_coeff);
  CHECK(a.parallel.dp == b.parallel.dp);
  CHECK(a.parallel.tp == b.parallel.tp);
  CHECK(a.parallel.pp == b.parallel.pp);
  CHECK(a.parallel.ep == b.parallel.ep);
  CHECK(a.parallel.order == b.parallel.order);
  CHECK(a.parallel.sequence_parallel == b.parallel.sequence_parallel);
  CHECK(a.parallel.distributed_optimizer == b.parallel.distributed_optimizer);
  CHECK(a.parallel.zero_stage == b.parallel.zero_stage);
  CHECK(a.parallel.reshard_after_forward == b.parallel.reshard_after_forward);
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
  CHECK(a.training.profile_steps == b.training.profile_steps);
  CHECK(a.training.recompute == b.training.recompute);
  CHECK(a.training.recompute_modules == b.training.recompute_modules);
  CHECK(a.training.recompute_method == b.training.recompute_method);
  CHECK(a.training.recompute_num_layers == b.training.recompute_num_layers);
  CHECK(a.training.loss_chunk_rows == b.training.loss_chunk_rows);
  CHECK(a.checkpoint.dir == b.checkpoint.dir);
  CHECK(a.checkpoint.every == b.checkpoint.every);
  CHECK(a.checkpoint.keep == b.checkpoint.keep);
  CHECK(a.checkpoint.resume == b.checkpoint.resume);
  CHECK(a.checkpoint.save_on_exit == b.checkpoint.save_on_exit);
  CHECK(a.logging.dir == b.logging.dir);
  CHECK(a.logging.level == b.logging.level);
  CHECK(a.logging.tensorboard == b.logging.tensorboard);
  CHECK(a.logging.straggler_factor == b.logging.straggler_factor);
  CHECK(a.logging.straggler_window == b.logging.straggler_window);
}

// A config that sets every key to a value other than its default (and no 0 = derive markers),
// except data.split, which excludes data.valid, and training.recompute_modules, which belongs to
// "selective" recomputation (the recompute keys here are "full"'s).
json every_key() {
  return json::parse(R"({
    "model": {"vocab_size": 32000, "make_vocab_size_divisible_by": 64, "seq_len": 256, "num_layers": 4, "hidden_size": 512,
              "num_heads": 8, "num_kv_heads": 2, "head_dim": 96, "ffn_hidden_size": 1376, "norm": "rmsnorm",
              "norm_eps": 1e-6, "activation": "swiglu", "position": "rope",
              "rope_theta": 500000.0,
              "rope_scaling": {"type": "llama3", "factor": 8.0, "low_freq_factor": 2.0,
                               "high_freq_factor": 3.0, "original_max_position_embeddings": 128},
              "tie_embeddings": false, "bias": false, "qkv_bias": true, "qk_norm": true, "init_std": 0.01,
              "moe": {"num_experts": 0, "top_k": 1, "every": 2, "ffn_hidden_size": 512,
                      "capacity_factor": 1.25, "max_load_factor": null, "router_pre_softmax": false,
                      "router_topk_scaling_factor": 2.5, "first_k_dense_replace": 1,
                      "router_score_function": "softmax", "router_enable_expert_bias": false,
                      "router_bias_update_rate": 0.002,
                      "shared_expert_ffn_hidden_size": 256, "shared_expert_gate": true,
                      "aux_loss_coeff": 0.02, "z_loss_coeff": 0.001}},
    "parallel": {"dp": 2, "tp": 2, "pp": 1, "ep": 1, "etp": 2, "ep_overlap_chunks": 1, "cp": 1, "cp_comm": "all_gather", "order": "tp-pp-dp",
                 "sequence_parallel": true, "distributed_optimizer": true, "zero_stage": 3, "reshard_after_forward": false, "bucket_size": 1000,
                 "schedule": "gpipe", "virtual_stages": 1, "stage_layers": [4],
                 "grad_compression": "bf16", "onebit_warmup_steps": 7},
    "training": {"device": "cpu", "precision": "fp16", "loss_scale": 0.0, "initial_loss_scale": 1024.0,
                 "loss_scale_window": 500, "min_loss_scale": 0.5, "hysteresis": 3, "micro_batch_size": 2,
                 "global_batch_size": 8, "steps": 500, "seed": 18446744073709551615,
                 "eval_every": 50, "eval_steps": 5, "log_every": 10, "threads": 2,
                 "peak_gflops": 123.5, "exit_interval": 250, "exit_after_min": 90.5,
                 "collective_timeout_s": 120.0, "max_skipped_steps": 3, "spike_zscore": 6.0,
                 "spike_window": 20, "profile_steps": [3, 4], "recompute": "full", "recompute_modules": ["core_attn"],
                 "recompute_method": "block", "recompute_num_layers": 3, "loss_chunk_rows": 512},
    "optimizer": {"lr": 3e-4, "min_lr": 3e-5, "warmup_steps": 20, "decay": "linear",
                  "decay_steps": 400, "weight_decay": 0.05, "beta1": 0.8, "beta2": 0.99,
                  "eps": 1e-6, "grad_clip": 0.5},
    "data": {"synthetic": false,
             "train": [{"path": "data/a", "weight": 0.7}, {"path": "data/b", "weight": 0.3}],
             "valid": [{"path": "data/v", "weight": 1.0}],
             "split": "", "tokenizer": "sentencepiece:tok.model"},
    "sample": {"prompt": "The", "max_tokens": 16, "temperature": 1.5, "top_k": 7, "seed": 9},
    "checkpoint": {"dir": "ckpt/x", "every": 100, "keep": 3, "resume": "none", "init": "ckpt/base",
                   "save_on_exit": false},
    "logging": {"dir": "runs/x", "level": "debug", "tensorboard": false, "straggler_factor": 1.5,
                "straggler_window": 8}
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
  CHECK(c.model.norm == Norm::LAYERNORM);
  CHECK(c.model.norm_eps == 1e-5);
  CHECK(c.model.activation == Activation::GELU);
  CHECK(c.model.position == Position::LEARNED);
  CHECK(c.model.rope_theta == 10000.0);
  CHECK(c.model.tie_embeddings);
  CHECK(c.model.bias);
  CHECK(c.model.init_std == 0.02);
  CHECK((c.parallel.dp == 1 && c.parallel.tp == 1 && c.parallel.pp == 1 && c.parallel.ep == 1));
  CHECK(c.training.device == Device::CPU);
  CHECK(c.training.precision == Precision::FP32);
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
  CHECK(c.optimizer.decay == LrDecay::COSINE);
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
  CHECK(c.logging.level == LogLevel::INFO);
  CHECK(c.logging.tensorboard);
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
  SECTION("zero_stage and distributed_optimizer resolve together") {
    const Config none = config_from_json(base());
    CHECK((none.parallel.zero_stage == 0 && !none.parallel.distributed_optimizer));
    const Config one = config_from_json(with(base(), "parallel.distributed_optimizer", true));
    CHECK((one.parallel.zero_stage == 1 && one.parallel.distributed_optimizer));
    const Config two = config_from_json(with(base(), "parallel.zero_stage", 2));
    CHECK((two.parallel.zero_stage == 2 && two.parallel.distributed_optimizer));
    const Config again = config_from_json(config_to_json(two));
    CHECK((again.parallel.zero_stage == 2 && again.parallel.distributed_optimizer));
  }
  SECTION("zero_stage: out-of-range stages are refused; 2 and 3 refuse onebit and int8") {
    CHECK(problems_of(with(with(base(), "parallel.zero_stage", 3), "parallel.dp", 2)).empty());
    CHECK(problems_of(with(with(with(base(), "parallel.zero_stage", 3), "parallel.dp", 2), "model.moe.num_experts", 4))
              .empty());
    require_one(with(base(), "parallel.zero_stage", 4), "parallel.zero_stage: 4: ", "must be 0");
    require_one(with(base(), "parallel.zero_stage", -1), "parallel.zero_stage: -1: ", "must be 0");
    CHECK(problems_of(with(with(with(base(), "parallel.zero_stage", 2), "parallel.dp", 2), "parallel.grad_compression",
                           "bf16")).empty());
    for (const char* gc : {"int8", "onebit"})
      require_one(with(with(with(base(), "parallel.zero_stage", 2), "parallel.dp", 2), "parallel.grad_compression", gc),
                  fmt::format("parallel.grad_compression: \"{}\": ", gc), "cannot be combined with parallel.zero_stage 2");
  }
  SECTION("shared experts: the gate needs one; the width splits over tp") {
    const json moe = with(base(), "model.moe.num_experts", 4);
    CHECK(problems_of(with(with(moe, "model.moe.shared_expert_ffn_hidden_size", 96), "model.moe.shared_expert_gate",
                           true)).empty());
    require_one(with(moe, "model.moe.shared_expert_gate", true), "model.moe.shared_expert_gate: true: ",
                "model.moe.shared_expert_ffn_hidden_size is 0");
    require_one(with(with(with(moe, "model.moe.shared_expert_ffn_hidden_size", 97), "parallel.tp", 2),
                     "model.num_heads", 4),
                "model.moe.shared_expert_ffn_hidden_size: 97: ", "must be a multiple of parallel.tp (2)");
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
  CHECK(c.model.norm == Norm::RMSNORM);
  CHECK(c.training.seed == 7);
  CHECK(c.training.precision == Precision::BF16);
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
  CHECK(load_error(missing) == "cannot open config file " + missing + ": No such file or directory");
  CHECK(load_error(tmp_dir()) == "config file " + tmp_dir() + " is a directory, not a regular file; give a JSON file");
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

// Enumerated keys are enum classes; their JSON spellings live in config.h's tables only.
template <class E>
void check_spellings_round_trip() {
  for (const EnumName<E>& n : EnumNames<E>::values) {
    CHECK(to_string(n.value) == n.name);
    CHECK(enum_from_string<E>(n.name) == n.value);
    CHECK(nlohmann::json(n.value) == std::string(n.name));
    CHECK(nlohmann::ordered_json(n.value) == std::string(n.name));
    CHECK(nlohmann::ordered_json{{"key", n.value}}["key"] == std::string(n.name));
  }
}

TEST_CASE("config: enumerated keys are typed, and spelt in JSON as before", "[config]") {
  check_spellings_round_trip<Norm>();
  check_spellings_round_trip<Activation>();
  check_spellings_round_trip<Position>();
  check_spellings_round_trip<RankOrder>();
  check_spellings_round_trip<ScheduleKind>();
  check_spellings_round_trip<GradCompression>();
  check_spellings_round_trip<Device>();
  check_spellings_round_trip<Precision>();
  check_spellings_round_trip<LrDecay>();
  check_spellings_round_trip<LogLevel>();
  check_spellings_round_trip<TokenizerKind>();
  CHECK(enum_names<ScheduleKind>() == std::vector<std::string>{"1f1b", "interleaved", "gpipe"});
  CHECK(!enum_from_string<Precision>("FP16"));
  CHECK(!enum_from_string<Norm>(""));
  CHECK(precision_dtype(Precision::FP16) == DType::F16);

  const Config c = config_from_json(
      with(with(with(with(base(), "parallel.order", "dp-tp-pp"), "parallel.grad_compression", "int8"),
                "data.tokenizer", "sentencepiece:/t/a:b.model"),
           "checkpoint.resume", "none"));
  CHECK(c.parallel.order == RankOrder::DP_TP_PP);
  CHECK(c.parallel.grad_compression == GradCompression::INT8);
  CHECK(c.data.tokenizer == TokenizerSpec{TokenizerKind::SENTENCEPIECE, "/t/a:b.model"});
  CHECK(c.checkpoint.resume.kind == ResumeKind::NONE);
  const json j = config_to_json(c);
  CHECK(j["parallel"]["order"] == "dp-tp-pp");
  CHECK(j["parallel"]["grad_compression"] == "int8");
  CHECK(j["data"]["tokenizer"] == "sentencepiece:/t/a:b.model");
  CHECK(j["checkpoint"]["resume"] == "none");
  CHECK(config_to_json(config_from_json(base()))["data"]["tokenizer"] == "");
}

TEST_CASE("config: data.tokenizer and checkpoint.resume specs", "[config]") {
  CHECK(parse_tokenizer_spec("") == TokenizerSpec{});
  CHECK(parse_tokenizer_spec("gpt2:dir") == TokenizerSpec{TokenizerKind::GPT2, "dir"});
  CHECK(parse_tokenizer_spec("gpt2:") == TokenizerSpec{TokenizerKind::GPT2, ""});  // load_tokenizer refuses it
  CHECK(parse_tokenizer_spec("hf:/m/llama3") == TokenizerSpec{TokenizerKind::HF, "/m/llama3"});
  CHECK(!parse_tokenizer_spec("gpt2"));
  CHECK(!parse_tokenizer_spec("bpe:x"));
  CHECK(!parse_tokenizer_spec(":x"));
  for (const char* s : {"", "gpt2:dir", "sentencepiece:a.model", "hf:dir"}) CHECK(to_string(*parse_tokenizer_spec(s)) == s);

  CHECK(parse_resume_spec("auto").kind == ResumeKind::AUTO);
  CHECK(parse_resume_spec("none").kind == ResumeKind::NONE);
  CHECK(parse_resume_spec("runs/ck/step_00000004") == ResumeSpec{ResumeKind::PATH, "runs/ck/step_00000004"});
  for (const char* s : {"auto", "none", "runs/ck/step_00000004"}) CHECK(to_string(parse_resume_spec(s)) == s);
  // An empty path is a config error, named as before.
  require_one(with(base(), "checkpoint.resume", ""), "checkpoint.resume: \"\": ", "must be \"auto\", \"none\"");
}
