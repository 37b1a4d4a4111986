// Where every parameter of the model lives in the one contiguous parameter buffer.
//
// Parameters are laid out back to back (each padded to 16 elements, 64 bytes in fp32) in a fixed
// order derived from the config alone. The same offsets index the fp32 master weights, the
// compute copy, the fp32 gradients and both Adam moments, which is what lets the optimizer and the
// gradient norm run over single contiguous buffers. Names follow the PyTorch state-dict style
// ("layers.3.attn.qkv.weight") and are the keys of exported weights and checkpoints.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/config/config.h"

namespace tetra {

enum class ParamInit : uint8_t { NORMAL, NORMAL_SCALED, ZEROS, ONES };

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in elements, into every parameter-sized buffer
  int64_t numel = 0;
  ParamInit init = ParamInit::NORMAL;
  bool weight_decay = false;  // 2-D weights except position embeddings
  bool matmul = false;        // counted in the 6N FLOPs of a training step
};

// Offsets of one transformer block's parameters (-1 where the config has no such parameter).
struct BlockParams {
  int64_t norm1_w = -1, norm1_b = -1;
  int64_t qkv_w = -1, qkv_b = -1;
  int64_t attn_proj_w = -1, attn_proj_b = -1;
  int64_t norm2_w = -1, norm2_b = -1;
  int64_t fc_w = -1, fc_b = -1;
  int64_t mlp_proj_w = -1, mlp_proj_b = -1;
};

struct ParamLayout {
  std::vector<ParamSpec> params;
  int64_t total = 0;  // elements, including padding
  int64_t wte = -1, wpe = -1, final_norm_w = -1, final_norm_b = -1, lm_head = -1;
  std::vector<BlockParams> blocks;

  static ParamLayout build(const ModelConfig& m);
  int64_t count() const;          // parameters (without padding)
  int64_t matmul_count() const;   // parameters of matrix multiplies, lm_head / tied wte included
  // Offset of the output projection (lm_head, or wte when embeddings are tied).
  int64_t output_weight() const { return lm_head >= 0 ? lm_head : wte; }
};

// Fills `master` (fp32, layout.total elements, host memory) with the initial weights. Element n of
// a parameter is a pure function of (seed, parameter name, n), so any slice of any parameter can
// be generated alone: every parallel layout starts from the same model.
void init_params(const ParamLayout& layout, const ModelConfig& m, uint64_t seed, float* master);

}  // namespace tetra
