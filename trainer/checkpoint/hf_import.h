// Hugging Face checkpoints in: a model directory (config.json and model.safetensors, or sharded
// model-0000k-of-0000n.safetensors with model.safetensors.index.json) read as a Tetra model and
// its fp32 weights, the inverse of hf_export.h.
//
// Families: Llama 2 / 3.x (model_type "llama"), Mistral ("mistral", without a sliding window) and
// Qwen2 / 2.5 ("qwen2": biases on q, k and v; without a sliding window), all rmsnorm + SwiGLU +
// RoPE (rotate-half, Tetra's own convention: q and k rows are taken as they are), GQA, tied or
// untied embeddings, any head_dim, RoPE scaling "linear" and "llama3" from `rope_scaling` or
// transformers v5's `rope_parameters`; and GPT-2 ("gpt2": Conv1D weights transposed into Tetra's
// (out, in)). Whatever in config.json would change the maths and Tetra does not implement is an
// InputError naming the key (a sliding window, another RoPE type, another activation, biases on
// o_proj or the MLP, MoE routers, q/k norms; `rope_parameters` and `rope_scaling` that disagree);
// so is a tensor the model does not have, one it needs and the files lack, a shape that differs,
// and a value that is not finite. Stored types F32, BF16 and F16 are read exactly into fp32.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trainer/config/config.h"

namespace tetra {

struct HfModel {
  std::string dir;
  std::string model_type;    // config.json's
  nlohmann::json model;      // the run config's `model` section
  std::vector<std::string> weight_files;  // the safetensors files, in index order
  // Where each key of `model` comes from ("seq_len" -> "max_position_embeddings"), so that a
  // problem with model.<key> can name what to change.
  std::map<std::string, std::string> sources;
};

// Reads dir/config.json (and finds the weight files). `seq_len`: model.seq_len to write (0: GPT-2
// n_positions, else max_position_embeddings capped at 4096), given as `seq_len_from` (the option
// or key messages name).
HfModel read_hf_model(const std::string& dir, int64_t seq_len = 0, const std::string& seq_len_from = "--seq-len");

// The weights of `m` (a resolved config of the model read_hf_model gave) in the single-rank
// parameter layout's order (ParamLayout::build(m)), as fp32. Every tensor's name, shape and type
// is checked from the files' headers before anything is allocated, then the host's memory against
// the weights plus `also_needed_bytes` (what the caller allocates beside them); every value read
// must be finite. InputError naming the file and tensor otherwise.
std::vector<float> read_hf_weights(const HfModel& hf, const ModelConfig& m, uint64_t also_needed_bytes = 0);

// InputError "<what> needs X GiB of host memory but this machine has Y GiB ..." when `bytes` do
// not fit in 95% of the machine's memory, or in what the process's address-space limit leaves.
void check_host_memory_for(const std::string& what, uint64_t bytes);

// The problems of a config built from `hf` (ConfigError's), one per line, each model.<key> with
// the config.json key (or option) it came from.
std::string hf_config_problems(const HfModel& hf, const std::vector<std::string>& problems);

}  // namespace tetra
