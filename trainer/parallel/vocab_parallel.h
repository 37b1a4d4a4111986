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
// `partial` (N, C): the lookup's buffer under sequence parallelism. `positions` (T, backend memory;
// null: 0 .. T-1): each token's row of wpe (context parallelism).
void vocab_parallel_embedding_forward(TensorParallel& tp, Backend& be, VocabSlice vocab, const int32_t* tokens,
                                      int64_t B, int64_t T, const void* wte, const void* wpe, void* out,
                                      void* partial, const int32_t* positions = nullptr);
// dwte += the rows of this rank's slice, dwpe += (may be null), from dout (Ns, C); `full` (N, C)
// receives the gathered gradient under sequence parallelism.
void vocab_parallel_embedding_backward(TensorParallel& tp, Backend& be, VocabSlice vocab, const int32_t* tokens,
                                       int64_t B, int64_t T, const void* dout, void* full, float* dwte,
                                       float* dwpe, const int32_t* positions = nullptr);

// The loss over logits (N, Vl), this rank's vocabulary columns, of the activation type: losses
// (N) fp32; if dloss_scale != 0 the logits are overwritten with their gradient (scaled by it).
// row_max (N) and sums (2 N) are fp32 scratch, used with tp > 1 only (may be null otherwise).
// `rows`: of the logits (-1: the group's N).
void vocab_parallel_cross_entropy(TensorParallel& tp, Backend& be, VocabSlice vocab, float* losses, void* logits,
                                  const int32_t* targets, float dloss_scale, float* row_max, float* sums,
                                  int64_t rows = -1);

// The output layer and the loss fused, `chunk` rows at a time, so that the (N, Vl) logits are
// never held: for each chunk of rows of x (N, C) (the whole input, after copy_to_region),
//   logits = x_c W^T (chunk, Vl) in `logits` (scratch), their loss into losses (N) fp32, and, if
//   dloss_scale != 0, their gradient in place, then dx_partial_c = dlogits W (this rank's share
//   of the input gradient, (N, C) at the end, for f's backward) and dW += dlogits^T x_c.
// Each row's loss, logits' gradient and input gradient are those of the unchunked ops; the weight
// gradient sums the chunks' products in fp32 (another order of the same sum). row_max (chunk),
// sums (2 chunk) fp32 scratch as vocab_parallel_cross_entropy's.
void vocab_parallel_linear_cross_entropy(TensorParallel& tp, Backend& be, VocabSlice vocab, const void* x,
                                         int64_t C, const void* w, float* dw, const int32_t* targets, float* losses,
                                         float dloss_scale, int64_t chunk, void* logits, float* row_max, float* sums,
                                         void* dx_partial);

}  // namespace tetra
