// Hugging Face export: Tetra's parameters renamed and re-laid out as one of transformers' model
// classes, with the config.json that class reads, so `from_pretrained(dir)` loads the model.
//
// Two architectures hold every model Tetra can be configured as, except mixed ones:
//   Llama (LlamaForCausalLM): rmsnorm, swiglu, rope, no biases; any num_kv_heads, tied or not.
//     Tetra's fused qkv (rows [q heads | k heads | v heads]) is split into q_proj, k_proj, v_proj;
//     the fused fc (rows [gate | up]) into gate_proj and up_proj. Tetra's RoPE rotates halves
//     (element i pairs with i + HS/2, kernels/common/math.h) as HF's rotate_half does, so q and k
//     need no permutation (the permutation in HF's Meta-Llama converter undoes Meta's
//     interleaved pairs, which Tetra does not use).
//   GPT-2 (GPT2LMHeadModel): layernorm, gelu (tanh: HF's "gelu_new"), learned positions, biases,
//     multi-head attention. Its Conv1D layers store weights as (in, out): Tetra's (out, in)
//     weights are transposed. c_attn's output columns are [q | k | v], Tetra's qkv row order.
// Linear weights are (out, in) in Llama, as in Tetra. Tied embeddings write no lm_head.weight
// (HF ties it to the input embedding, from tie_word_embeddings).
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trainer/checkpoint/safetensors.h"
#include "trainer/config/config.h"
#include "kernels/common/dtype.h"

namespace tetra {

enum class HfArch : uint8_t { LLAMA, QWEN2, QWEN3, GPT2, MIXTRAL, QWEN3_MOE, QWEN2_MOE };

// "llama" | "qwen2" | "qwen3" | "gpt2" | "mixtral" | "qwen3_moe" | "qwen2_moe" (config.json's model_type)
const char* hf_model_type(HfArch arch);

// The architecture `m` exports as. InputError naming every config key whose value has no
// equivalent in it (position rope selects Llama, or Qwen2 with model.qkv_bias, or Qwen3 with
// model.qk_norm; learned selects GPT-2).
HfArch hf_architecture(const ModelConfig& m);

// config.json for `m` as `arch`, weights stored as `dtype` (F32, BF16 or F16). `eos_token_id` < 0:
// unknown (written as null).
nlohmann::ordered_json hf_config(const ModelConfig& m, HfArch arch, DType dtype, int64_t eos_token_id = -1);

// A parameter's global tensor (row-major, ParamLayout's global_shape), by Tetra name
// ("layers.0.attn.qkv.weight").
using HfWeightSource = std::function<std::vector<float>(const std::string& tetra_name)>;

// Every tensor of the Hugging Face state dict, in `dtype` (F32, or BF16 / F16 rounded to nearest
// even; fp16 overflows to infinity beyond 65504).
std::vector<TensorRecord> hf_tensors(const ModelConfig& m, HfArch arch, DType dtype, const HfWeightSource& weights);

// The safetensors metadata transformers requires of a state dict file ({"format": "pt"}).
std::map<std::string, std::string> hf_metadata();

// Checks the output directory of an export before anything is read or written (it creates
// nothing): `out` that does not exist must be creatable (its nearest existing ancestor a writable
// directory); one that exists must be a writable directory, and empty unless `force` (which then
// replaces OUT/model.safetensors and OUT/config.json, each a regular file if present, and leaves
// the rest). InputError naming `out` and what would fix it otherwise; the messages name the
// option `--force` (`tetra ckpt export-hf`'s) where `can_force` (import-hf has none).
void hf_check_output_dir(const std::string& out, bool force, bool can_force = true);

}  // namespace tetra
