// Vocab-parallel embedding and cross-entropy (Megatron-LM): the vocabulary's V rows are split over
// the TP group, rank i holding rows [v0, v0 + Vl), Vl = V / p, of the token embedding (and, tied or
// not, of the output layer W_out, so that rank i's logits are the columns [v0, v0 + Vl)).
//
// Embedding:  e = sum_i onehot(tokens)[:, v0_i : v0_i + Vl] wte_i  (+ wpe on rank 0)
//   each rank looks up its own rows (a zero row for a token outside its slice) and g
//   (reduce_from_region, tensor_parallel.h) sums the ranks: a row-parallel layer whose input is
//   the one-hot matrix. Backward: g's transpose hands every rank the whole gradient, and each
//   accumulates the rows of its slice.
// Cross-entropy without the (N, V) logits ever gathered:
//   m_i   = max over the group of each rank's row max               all-reduce MAX  (N floats)
//   s_i   = sum over the group of sum_j exp(logit_ij - m_i)           all-reduce SUM  (N floats)
//   t_i   = the target's logit, found on the one rank holding it     (in the same SUM, N floats)
//   loss_i = log s_i + m_i - t_i;  dlogits_ij = scale (exp(logit_ij - m_i) / s_i - [j == target])
// Without tensor parallelism both are the plain single-device ops.
#pragma once

#include <cstdint>

#include "kernels/backend.h"
#include "trainer/parallel/tensor_parallel.h"

namespace tetra {

// This rank's slice of the vocabulary.
struct VocabSlice {
  int64_t v0 = 0, rows = 0;  // [v0, v0 + rows)
};

// out (Ns, C) = the embeddings of tokens (B, T) (+ wpe (T, C), added by TP rank 0; may be null).
// `partial` (N, C): the lookup's buffer under sequence parallelism.
void vocab_parallel_embedding_forward(TensorParallel& tp, Backend& be, VocabSlice vocab, const int32_t* tokens,
                                      int64_t B, int64_t T, const void* wte, const void* wpe, void* out,
                                      void* partial);
// dwte += the rows of this rank's slice, dwpe += (may be null), from dout (Ns, C); `full` (N, C)
// receives the gathered gradient under sequence parallelism.
void vocab_parallel_embedding_backward(TensorParallel& tp, Backend& be, VocabSlice vocab, const int32_t* tokens,
                                       int64_t B, int64_t T, const void* dout, void* full, float* dwte,
                                       float* dwpe);

// The loss over logits (N, Vl), this rank's vocabulary columns, of the activation type: losses
// (N) fp32; if dloss_scale != 0 the logits are overwritten with their gradient (scaled by it).
// row_max (N) and sums (2 N) are fp32 scratch, used with tp > 1 only (may be null otherwise).
void vocab_parallel_cross_entropy(TensorParallel& tp, Backend& be, VocabSlice vocab, float* losses, void* logits,
                                  const int32_t* targets, float dloss_scale, float* row_max, float* sums);

}  // namespace tetra
