#include "trainer/parallel/vocab_parallel.h"

#include <algorithm>

#include "trainer/comm/communicator.h"

namespace tetra {

void vocab_parallel_embedding_forward(TensorParallel& tp, Backend& be, VocabSlice vocab, const int32_t* tokens,
                                      int64_t B, int64_t T, const void* wte, const void* wpe, void* out,
                                      void* partial, const int32_t* positions) {
  void* e = tp.product_target(out, partial);
  be.embedding_forward(e, tokens, wte, tp.once(wpe), B, T, tp.width(), vocab.v0, vocab.rows, tp.act(), tp.act(),
                       positions);
  tp.reduce_from_region(out, e, /*residual=*/nullptr);
}

void vocab_parallel_embedding_backward(TensorParallel& tp, Backend& be, VocabSlice vocab, const int32_t* tokens,
                                       int64_t B, int64_t T, const void* dout, void* full, float* dwte,
                                       float* dwpe, const int32_t* positions) {
  const void* de = tp.reduce_from_region_backward(full, dout);
  be.embedding_backward(dwte, dwpe, de, tokens, B, T, tp.width(), vocab.v0, vocab.rows, tp.act(), positions);
}

void vocab_parallel_cross_entropy(TensorParallel& tp, Backend& be, VocabSlice vocab, float* losses, void* logits,
                                  const int32_t* targets, float dloss_scale, float* row_max, float* sums,
                                  int64_t rows) {
  const int64_t N = rows < 0 ? tp.rows() : rows, V = vocab.rows;
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

void vocab_parallel_linear_cross_entropy(TensorParallel& tp, Backend& be, VocabSlice vocab, const void* x,
                                         int64_t C, const void* w, float* dw, const int32_t* targets, float* losses,
                                         float dloss_scale, int64_t chunk, void* logits, float* row_max, float* sums,
                                         void* dx_partial) {
  const int64_t N = tp.rows(), V = vocab.rows;
  const DType t = tp.act();
  const size_t es = dtype_size(t);
  for (int64_t r0 = 0; r0 < N; r0 += chunk) {
    const int64_t n = std::min(chunk, N - r0);
    const char* xc = static_cast<const char*>(x) + static_cast<size_t>(r0 * C) * es;
    be.gemm(false, true, n, V, C, 1.0f, xc, C, w, C, t, 0.0f, logits, V, t);
    vocab_parallel_cross_entropy(tp, be, vocab, losses + r0, logits, targets + r0, dloss_scale, row_max, sums, n);
    if (dloss_scale == 0.0f) continue;
    be.gemm(false, false, n, C, V, 1.0f, logits, V, w, C, t, 0.0f,
            static_cast<char*>(dx_partial) + static_cast<size_t>(r0 * C) * es, C, t);
    be.gemm(true, false, V, C, n, 1.0f, logits, V, xc, C, t, 1.0f, dw, C, DType::F32);
  }
}

}  // namespace tetra
