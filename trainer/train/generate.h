// Text from a trained model: prompt text -> continuation text with the run's tokenizer (the
// trainer's samples at evaluations), exported weights loaded back by name into a parameter
// layout, and the `tetra generate` command built from both.
//
// Exported weights are global tensors in safetensors, keyed by parameter name (the trainer writes
// <logging.dir>/model.safetensors at the end of training, the TP slices gathered), so a model
// trained on any layout loads into any other; `tetra generate` runs one process with tp = 1.
#pragma once

#include <memory>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "trainer/config/config.h"
#include "trainer/params/param_layout.h"
#include "trainer/train/compute_device.h"

namespace tetra {

class Sampler;
class Tokenizer;

// Where the trainer writes the final weights: <logging.dir>/model.safetensors ("" without a
// logging.dir).
std::string final_weights_path(const Config& cfg);

// data.tokenizer, checked against the model: its vocabulary must fit in model.vocab_size (which
// may be padded beyond it). InputError otherwise.
std::unique_ptr<Tokenizer> load_sampling_tokenizer(const Config& cfg);

// The continuation of `prompt`: its ids follow the end-of-document id, so the text is sampled as
// the start of a new document, the way documents follow one another in the packed training data.
// Sampling stops at s.max_tokens or the end-of-document id. The text is the continuation as it
// reads after the prompt (decoded behind the prompt's ids). Every rank of the sampler's TP group
// calls it together.
std::string generate_text(Sampler& sampler, const void* weights, const Tokenizer& tokenizer,
                          const std::string& prompt, const SampleConfig& s);

// `text` for a one-line log: backslash, double quote, newline, carriage return and tab escaped
// as \\ \" \n \r \t, other control bytes as \xNN; everything else (UTF-8 included) unchanged.
std::string escape_text(std::string_view text);

// Checks a weights file before it is opened (a FIFO would block the open): a regular file, not
// empty. InputError naming `path` otherwise; `missing_hint` ends the message for a missing one.
void check_weights_file(const std::string& path, const std::string& missing_hint);

// This layout's slice of every parameter, from a safetensors file of global tensors (F32, BF16 or F16),
// as fp32 host values at the layout's offsets (layout.total elements, padding zero). Every
// parameter must be in the file with its global shape, and the file must hold nothing else:
// InputError naming the file and the tensor otherwise (check_weights_file's first).
std::vector<float> load_weights(const std::string& path, const ParamLayout& layout);

// The single-rank layout's weights (ParamLayout::build(cfg.model)) from a directory: a checkpoint
// (a step_* directory, or a checkpoint.dir whose latest complete step is read) of cfg's model,
// loaded as the trainer loads one; or a Hugging Face model directory (config.json and
// model.safetensors or its shards) whose config.json describes cfg's model. InputError naming the
// directory, and the keys that differ, otherwise. `moe_expert_bias` (may be null) receives a
// checkpoint's MoE expert biases (model.moe.router_enable_expert_bias; empty from a Hugging Face
// directory).
std::vector<float> load_weights_dir(const std::string& dir, const Config& cfg,
                                    std::map<int64_t, std::vector<float>>* moe_expert_bias = nullptr);

struct GeneratedText {
  std::string prompt, continuation;
  std::vector<int32_t> ids;  // the continuation's token ids
};

// A prompt of token ids instead of text (`tetra generate --prompt-ids`): no tokenizer is needed,
// generation stops at max_tokens only, and `logits_out` (if set) receives the prompt's logits, a
// safetensors file with one fp32 tensor "logits" (prompt length, vocab_size).
struct IdPrompt {
  std::vector<int32_t> ids;
  std::string logits_out;
};

// `tetra generate`: one process and tp = 1 whatever cfg.parallel says, weights from
// `weights_path` (empty: final_weights_path(cfg); a file or a directory, load_weights_dir),
// sampling as cfg.sample says, compute in cfg.training.precision with cfg.training.threads on
// `device`. InputError for a missing or mismatched weights file, or a config without
// data.tokenizer (unless `id_prompt` is given).
GeneratedText generate_command(const Config& cfg, const std::string& weights_path, const DeviceOptions& device,
                               const IdPrompt* id_prompt = nullptr);

}  // namespace tetra
