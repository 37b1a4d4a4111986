#include "trainer/parallel/vocab_parallel.h"

#include "trainer/comm/communicator.h"

namespace tetra {

void vocab_parallel_embedding_forward(TensorParallel& tp, Backend& be, VocabSlice vocab, const int32_t* tokens,
                                      int64_t B, int64_t T, const void* wte, const void* wpe, void* out,
                                      void* partial) {
  void* e = tp.product_target(out, partial);
  be.embedding_forward(e, tokens, wte, tp.once(wpe), B, T, tp.width(), vocab.v0, vocab.rows, tp.act(), tp.act());
  tp.reduce_from_region(out, e, /*residual=*/nullptr);
}

void vocab_parallel_embedding_backward(TensorParallel& tp, Backend& be, VocabSlice vocab, const int32_t* tokens,
                                       int64_t B, int64_t T, const void* dout, void* full, float* dwte,
                                       float* dwpe) {
  const void* de = tp.reduce_from_region_backward(full, dout);
  be.embedding_backward(dwte, dwpe, de, tokens, B, T, tp.width(), vocab.v0, vocab.rows, tp.act());
}

void vocab_parallel_cross_entropy(TensorParallel& tp, Backend& be, VocabSlice vocab, float* losses, void* logits,
                                  const int32_t* targets, float dloss_scale, float* row_max, float* sums) {
  const int64_t N = tp.rows(), V = vocab.rows;
  const DType t = tp.act();
  void* dlogits = dloss_scale != 0.0f ? logits : nullptr;
  if (!tp.enabled()) {
    be.cross_entropy(losses, dlogits, t, logits, t, targets, N, V, dloss_scale);
    return;
  }
  be.vocab_ce_max(row_max, logits, t, N, V);
  tp.comm()->all_reduce(row_max, N, DType::F32, ReduceOp::MAX);
  be.vocab_ce_sums(sums, sums + N, logits, t, row_max, targets, vocab.v0, N, V);
  tp.comm()->all_reduce(sums, 2 * N, DType::F32, ReduceOp::SUM);
  be.vocab_ce_finish(losses, dlogits, t, logits, t, row_max, sums, sums + N, targets, vocab.v0, N, V, dloss_scale);
}

}  // namespace tetra
