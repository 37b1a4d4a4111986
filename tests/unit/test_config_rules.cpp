// The config rules, each with its message: types, single-value ranges, cross-field and parallel
// layout rules, pipeline layouts, data / evaluation / tokenizer rules, fp16 loss scaling, keys of
// one mode given under another.
//
// Messages are checked by their JSON path and the phrase that states the rule, so rewording the
// explanation after the phrase does not break a test, but reporting the wrong key does.
#include <catch2/catch.hpp>
#include <fmt/format.h>

#include <filesystem>
#include <string>
#include <vector>

#include "tests/unit/config_testing.h"
#include "trainer/config/config.h"

using namespace tetra;
using namespace tetra::config_testing;
using nlohmann::json;

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
  // model.head_dim: any head size, the hidden size need not divide; RoPE still needs it even.
  {
    const json j = with(with(with(base(), "model.hidden_size", 770), "model.head_dim", 96), "model.position", "rope");
    CHECK(problems_of(j).empty());
    CHECK(config_from_json(j).model.head_size() == 96);
    CHECK(config_from_json(base()).model.head_dim == 64);  // resolved: 768 / 12
    require_one(with(j, "model.head_dim", 95), "model.head_dim: 95: ", "must be even with model.position \"rope\"");
  }
  require_one(with(base(), "model.hidden_size", 770), "model.hidden_size: 770: ", "or set model.head_dim");
  // rope_scaling scales RoPE, and llama3's band edges must be ordered.
  require_one(with(base(), "model.rope_scaling.type", "linear"), "model.rope_scaling.type: \"linear\": ",
              "needs model.position \"rope\"");
  {
    const json rope = with(with(base(), "model.position", "rope"), "model.rope_scaling.type", "llama3");
    CHECK(problems_of(rope).empty());
    require_one(with(rope, "model.rope_scaling.high_freq_factor", 1.0), "model.rope_scaling.high_freq_factor: 1.0: ",
                "must be above model.rope_scaling.low_freq_factor (1)");
    require_one(with(rope, "model.rope_scaling.factor", 0.0), "model.rope_scaling.factor: 0.0: ", "> 0");
    require_one(with(rope, "model.rope_scaling.type", "yarn"), "model.rope_scaling.type: \"yarn\": ", "llama3");
  }
  require_one(with(base(), "training.global_batch_size", 10), "training.global_batch_size: 10: ",
              "must be a multiple of training.micro_batch_size * parallel.dp (4 * 1 = 4)");
  require_one(with(base(), "optimizer.min_lr", 1.0),
              "optimizer.min_lr: 1.0: ", "must be <= optimizer.lr (0.0006)");
}

TEST_CASE("config: parallel layout rules", "[config]") {
  // Tensor parallelism splits heads, kv heads and the MLP: each is named with both values. The
  // vocabulary is padded instead (test_vocab_padding.cpp has its rule).
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
  CHECK(problems_of(with(base(), "parallel.tp", 4)).empty());  // 50257 padded to 50688
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
  CHECK(problems_of(with(with(moe, "parallel.tp", 2), "model.activation", "swiglu")).empty());  // with biases
  CHECK(problems_of(with(with(moe, "parallel.ep", 2), "parallel.distributed_optimizer", true)).empty());
  CHECK(problems_of(with(with(with(moe, "parallel.ep", 2), "sample.prompt", "The"), "data.tokenizer", "gpt2:t")).empty());
  require_one(with(moe, "model.moe.topk", 2), "model.moe.topk: ", "did you mean \"model.moe.top_k\"");
  // Today's routers: the load bound, renormalised / scaled gates, dense first blocks, sigmoid
  // scores and the expert bias, each refused where it does not apply.
  CHECK(problems_of(with(moe, "model.moe.max_load_factor", 1.25)).empty());
  require_one(with(moe, "model.moe.max_load_factor", 0.5), "model.moe.max_load_factor: 0.5", "must be >= 1");
  require_one(with(with(moe, "model.moe.max_load_factor", 2.0), "model.moe.capacity_factor", 1.0),
              "model.moe.max_load_factor: 2", "applies to dropless routing only");
  require_one(with(moe, "model.moe.router_topk_scaling_factor", 0.0), "model.moe.router_topk_scaling_factor: 0",
              "must be > 0");
  require_one(with(moe, "model.moe.first_k_dense_replace", 12), "model.moe.first_k_dense_replace: 12",
              "leaves no MoE block");
  const json sig = with(with(moe, "model.moe.router_score_function", "sigmoid"), "model.moe.router_enable_expert_bias", true);
  CHECK(problems_of(sig).empty());
  CHECK(config_from_json(sig).model.moe.normalizes_gates());  // sigmoid: renormalised over the top-k (top_k 2)
  require_one(with(moe, "model.moe.router_enable_expert_bias", true), "model.moe.router_enable_expert_bias: true",
              "needs model.moe.router_score_function \"sigmoid\"");
  require_one(with(sig, "model.moe.z_loss_coeff", 0.001), "model.moe.z_loss_coeff: 0.001", "a softmax router's");
  require_one(with(sig, "model.moe.router_pre_softmax", false), "model.moe.router_pre_softmax: false",
              "applies to softmax scores");
  require_one(with(sig, "model.moe.router_bias_update_rate", 0.0), "model.moe.router_bias_update_rate: 0",
              "must be > 0");
  require_one(with(base(), "model.moe", 3), "model.moe: 3: ", "expected an object");
  require_one(with(base(), "parallel.order", "tp-ep-dp"), "parallel.order: ", "tp-cp-dp-pp");
  // Context parallelism: whole chunks, an order naming cp, and what is per CP rank refused.
  const json cp2 = with(base(), "parallel.cp", 2);
  CHECK(problems_of(cp2).empty());
  CHECK(problems_of(with(cp2, "parallel.cp_comm", "all_gather")).empty());
  require_one(with(base(), "parallel.cp_comm", "ring"), "parallel.cp_comm: ", "all_gather");
  require_one(with(base(), "parallel.cp", 0), "parallel.cp: 0: ", "must be >= 1");
  require_one(with(with(base(), "parallel.cp", 3), "model.seq_len", 16), "parallel.cp: 3: ",
              "model.seq_len (16) must be a multiple of 2 x parallel.cp (6)");
  require_one(with(cp2, "parallel.order", "tp-dp-pp"), "parallel.order: ", "names no cp axis");
  CHECK(problems_of(with(cp2, "parallel.order", "dp-cp-pp-tp")).empty());
  require_one(with(with(with(with(cp2, "parallel.tp", 4), "parallel.sequence_parallel", true), "model.seq_len", 4),
                   "training.micro_batch_size", 1),
              "parallel.sequence_parallel: ", "micro_batch_size * seq_len / cp (1 * 4 / 2 = 2), must be a multiple");
  CHECK(problems_of(with(with(cp2, "model.moe.num_experts", 4), "model.moe.aux_loss_coeff", 0.01)).empty());
  CHECK(problems_of(with(with(cp2, "model.moe.num_experts", 4), "model.moe.capacity_factor", 1.5)).empty());
  require_one(with(cp2, "parallel.grad_compression", "int8"), "parallel.grad_compression: ", "context parallelism");
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
              "sentencepiece:<model file>\" or \"hf:<directory with tokenizer.json>");
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
  CHECK(t.data.tokenizer.kind == TokenizerKind::SENTENCEPIECE);
  CHECK(t.data.tokenizer.path == std::string(std::getenv("HOME")) + "/tok/a.model");
  const Config hf = config_from_json(with(base(), "data.tokenizer", "hf:~/tok/llama3"));
  CHECK(hf.data.tokenizer == TokenizerSpec{TokenizerKind::HF, std::string(std::getenv("HOME")) + "/tok/llama3"});
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
  CHECK(c.training.precision == Precision::FP16);
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

TEST_CASE("config: a key of one mode, given under another, is refused", "[config]") {
  // Recomputation: recompute_modules belongs to "selective", recompute_method and
  // recompute_num_layers to "full"; away from their defaults under another mode they are refused.
  const json selective = with(base(), "training.recompute", "selective");
  const json full = with(base(), "training.recompute", "full");
  CHECK(problems_of(with(selective, "training.recompute_modules", json::array({"norm", "act"}))).empty());
  CHECK(problems_of(with(with(full, "training.recompute_method", "block"), "training.recompute_num_layers", 2)).empty());
  for (const json& other : {base(), full}) {
    INFO(other.dump());
    require_one(with(other, "training.recompute_modules", json::array({"norm"})), "training.recompute_modules: [\"norm\"]: ",
                "applies to training.recompute \"selective\" only");
  }
  for (const json& other : {base(), selective}) {
    INFO(other.dump());
    require_one(with(other, "training.recompute_num_layers", 2), "training.recompute_num_layers: 2: ",
                "applies to training.recompute \"full\" only");
    require_one(with(other, "training.recompute_method", "block"), "training.recompute_method: \"block\": ",
                "applies to training.recompute \"full\" only");
  }
  require_one(with(base(), "training.recompute_num_layers", 3), "training.recompute_num_layers: 3: ",
              "(it is \"none\"); remove training.recompute_num_layers or set training.recompute to \"full\"");
  // At their defaults they are no problem (a written-out config carries them all).
  CHECK(problems_of(with(with(with(base(), "training.recompute_modules", json::array({"core_attn"})),
                              "training.recompute_method", "uniform"), "training.recompute_num_layers", 1)).empty());

  // ZeRO-3's reshard_after_forward under another stage.
  const json dp2 = with(base(), "parallel.dp", 2);
  CHECK(problems_of(with(with(dp2, "parallel.zero_stage", 3), "parallel.reshard_after_forward", false)).empty());
  CHECK(problems_of(with(dp2, "parallel.reshard_after_forward", nullptr)).empty());
  for (const int stage : {0, 1, 2}) {
    INFO("stage " << stage);
    require_one(with(with(dp2, "parallel.zero_stage", stage), "parallel.reshard_after_forward", false),
                "parallel.reshard_after_forward: false: ",
                fmt::format("applies to parallel.zero_stage 3 only (it is {}", stage));
  }
  // distributed_optimizer false beside a stage that shards the optimizer state: a contradiction,
  // not resolved to true without a word. Absent, or true, it resolves with the stage.
  for (const int stage : {1, 2, 3}) {
    INFO("stage " << stage);
    require_one(with(with(dp2, "parallel.zero_stage", stage), "parallel.distributed_optimizer", false),
                "parallel.distributed_optimizer: false: ", fmt::format("contradicts parallel.zero_stage {}", stage));
    CHECK(config_from_json(with(dp2, "parallel.zero_stage", stage)).parallel.distributed_optimizer);
  }
  CHECK(problems_of(with(with(dp2, "parallel.zero_stage", 0), "parallel.distributed_optimizer", false)).empty());
  CHECK(config_from_json(with(dp2, "parallel.distributed_optimizer", true)).parallel.zero_stage == 1);
}

TEST_CASE("config: checkpoint.init is not checkpoint.dir nor inside it", "[config]") {
  const std::string dir = tmp_dir() + "/init_in_dir";
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/base/step_00000000");
  std::filesystem::create_directories(dir + "/other");
  std::filesystem::create_symlink(dir + "/base", dir + "/link");
  const json j = with(base(), "checkpoint.dir", dir + "/base");
  for (const std::string& init : {dir + "/base", dir + "/base/", dir + "/./other/../base", dir + "/link",
                                  dir + "/base/step_00000000"}) {
    INFO(init);
    require_one(with(j, "checkpoint.init", init), "checkpoint.init: ",
                "is checkpoint.dir (" + dir + "/base) or inside it");
  }
  CHECK(problems_of(with(j, "checkpoint.init", dir + "/other")).empty());
  CHECK(problems_of(with(j, "checkpoint.init", dir + "/base_2")).empty());  // a prefix of the name is not inside
  CHECK(problems_of(with(with(j, "checkpoint.init", dir + "/base"), "checkpoint.dir", "")).empty());
}
