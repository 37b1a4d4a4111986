// Model size and FLOPs accounting (for --dry-run, tokens/s and MFU).
//   FLOPs per token of a training step = 6 N + 12 L C T    (PaLM, appendix B)
// N = parameters of matrix multiplies, the output projection included (embedding lookups are not
// matmuls); 12 L C T counts the attention score and value products, forward and backward (C the
// attention width num_heads x head_dim, the hidden size unless model.head_dim sets another).
// Mixture of Experts: a token goes through top_k of num_experts experts, so N counts the experts'
// matmul parameters times top_k / num_experts (the activated ones), the router and the shared
// expert (with its gate) in full.
#pragma once

#include <cstdint>

#include "trainer/config/config.h"
#include "trainer/params/param_layout.h"

namespace tetra {

struct ModelStats {
  int64_t params = 0;
  int64_t matmul_params = 0;
  int64_t active_params = 0;          // parameters one token uses (== params for a dense model)
  int64_t active_matmul_params = 0;
  double train_flops_per_token = 0.0;
};

inline ModelStats model_stats(const ModelConfig& m, const ParamLayout& layout) {
  ModelStats s;
  s.params = layout.count();
  s.matmul_params = layout.matmul_count();
  s.active_params = static_cast<int64_t>(layout.active_count(m));
  s.active_matmul_params = static_cast<int64_t>(layout.active_matmul_count(m));
  s.train_flops_per_token = 6.0 * static_cast<double>(s.active_matmul_params) +
                            12.0 * static_cast<double>(m.num_layers * m.num_heads * m.head_size() * m.seq_len);
  return s;
}

}  // namespace tetra
