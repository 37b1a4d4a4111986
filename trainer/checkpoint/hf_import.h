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
// o_proj or the MLP, MoE routers, q/k norms); so is a tensor the model does not have, one it
// needs and the files lack, and a shape that differs. Stored types F32, BF16 and F16 are read
// exactly into fp32.
#pragma once

#include <cstdint>
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
};

// Reads dir/config.json (and finds the weight files). `seq_len`: model.seq_len to write (0: GPT-2
// n_positions, else max_position_embeddings capped at 4096).
HfModel read_hf_model(const std::string& dir, int64_t seq_len = 0);

// The weights of `m` (a resolved config of the model read_hf_model gave) in the single-rank
// parameter layout's order (ParamLayout::build(m)), as fp32.
std::vector<float> read_hf_weights(const HfModel& hf, const ModelConfig& m);

}  // namespace tetra
