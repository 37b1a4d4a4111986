// Autoregressive sampling of token ids from a Gpt: the token-choice math (temperature, top-k) and
// the generation loop.
//
// The loop recomputes the forward pass over the whole context for every new token (no KV cache):
// samples are short and occasional (at evaluations, and `tetra generate`), and this keeps the
// model's one forward path the only one. The context is the last T (seq_len) tokens, placed at
// positions 0.. of a (1, T) row; the positions after it hold filler tokens that causal attention
// keeps from influencing the row whose logits are read.
//
// Determinism: the uniform draw for the i-th generated token is a pure function of (seed, i)
// (Philox), and token choice is a pure function of the logits and that draw. With tensor
// parallelism every rank gathers the same whole logit row, so every rank picks the same token
// without further communication, and the text does not depend on the layout beyond the logits'
// own rounding. With expert parallelism the experts of a MoE block are spread over the ranks of
// the EP group, whose all-to-alls are collective: every rank of the group runs each forward of
// the sample with the same context, and the token EP rank 0 picks is broadcast over the group,
// so that the ranks' contexts (and their stops) cannot drift apart whatever the rounding of their
// own logits.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kernels/backend.h"
#include "trainer/config/config.h"

namespace tetra {

class Communicator;
class Gpt;

// The i-th uniform draw in (0, 1) of the sampling stream `seed` (53 random bits).
double sampling_uniform(uint64_t seed, uint64_t i);

// Picks a token from `logits` (V values) with the uniform draw `u` in (0, 1):
//   temperature == 0   the argmax (the lowest index among equal maxima; top_k is irrelevant)
//   temperature > 0    from softmax(logits / temperature) restricted to the top_k largest logits
//                      (ties broken towards lower indices; top_k 0 or >= V: every token),
//                      by inverting the cumulative distribution at u.
// Throws tetra::Error if a logit is NaN (a diverged model).
int32_t sample_token(std::span<const float> logits, double temperature, int64_t top_k, double u);

class Sampler {
 public:
  // `model`: built with micro_batch 1. `tp`: its tensor-parallel group, `ep`: its expert-parallel
  // group (null or size 1: none); every rank of both runs generate() together.
  Sampler(Gpt& model, Backend& be, Communicator* tp, Communicator* ep = nullptr);
  ~Sampler();
  Sampler(const Sampler&) = delete;
  Sampler& operator=(const Sampler&) = delete;

  // Generates up to s.max_tokens ids after `context` (non-empty), stopping before `eod` (which is
  // not returned). Only ids below `vocab_limit` (the tokenizer's vocabulary, which may be smaller
  // than the model's padded one) are ever chosen. `weights`: the model's weights (type act).
  std::vector<int32_t> generate(const void* weights, std::span<const int32_t> context,
                                const SampleConfig& s, int32_t eod, int64_t vocab_limit);

 private:
  Gpt& model_;
  Backend& be_;
  Communicator* tp_;
  Communicator* ep_;
  BackendBuffer tokens_buf_, row_buf_, full_buf_;  // own the three below (full_buf_ with tp > 1)
  BackendBuffer choice_buf_;                       // (1) int32: the token broadcast over ep (ep > 1)
  int32_t* tokens_ = nullptr;  // (1, T) backend memory
  float* row_ = nullptr;       // (V_local) fp32: this rank's slice of the row that is read
  float* full_ = nullptr;      // (V) fp32: the whole row, gathered over tp (row_ itself without)
  std::vector<int32_t> host_tokens_;
  std::vector<float> host_row_;
};

}  // namespace tetra
