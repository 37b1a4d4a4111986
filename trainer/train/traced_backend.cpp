#include "trainer/train/traced_backend.h"

#include <utility>

#include "trainer/core/trace.h"

namespace tetra {

namespace {

class TracedBackend final : public Backend {
 public:
  explicit TracedBackend(std::unique_ptr<Backend> inner)
      : inner_(std::move(inner)), sync_(!inner_->host_memory()) {}

  std::string name() const override { return inner_->name(); }
  bool host_memory() const override { return inner_->host_memory(); }
  std::string kernel_report() const override { return inner_->kernel_report(); }
  std::string memory_report() const override { return inner_->memory_report(); }

  void* alloc(size_t bytes) override { return inner_->alloc(bytes); }
  void free(void* ptr) override { inner_->free(ptr); }
  MemoryStats memory_stats() const override { return inner_->memory_stats(); }
  void memset_zero(void* ptr, size_t bytes) override {
    op("memset_zero", [&] { inner_->memset_zero(ptr, bytes); }, bytes);
  }
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override {
    op("copy_to_host", [&] { inner_->copy_to_host(host_dst, src, bytes); }, bytes);
  }
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override {
    op("copy_from_host", [&] { inner_->copy_from_host(dst, host_src, bytes); }, bytes);
  }
  void copy(void* dst, const void* src, size_t bytes) override {
    op("copy", [&] { inner_->copy(dst, src, bytes); }, bytes);
  }
  void copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows) override {
    op("copy_2d", [&] { inner_->copy_2d(dst, dst_pitch, src, src_pitch, width, rows); }, width * rows);
  }
  void synchronize() override {
    op("synchronize", [&] { inner_->synchronize(); });
  }

  void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha, const void* A, int64_t lda,
            const void* B, int64_t ldb, DType ab_type, float beta, void* C, int64_t ldc, DType c_type,
            const void* bias) override {
    gemm_op("gemm", M, N, K, [&] {
      inner_->gemm(trans_a, trans_b, M, N, K, alpha, A, lda, B, ldb, ab_type, beta, C, ldc, c_type, bias);
    });
  }
  void gemm_grouped(bool trans_a, bool trans_b, int64_t G, const int64_t* rows, int64_t N, int64_t K, float alpha,
                    const void* A, int64_t lda, const void* const* B, int64_t ldb, DType ab_type, float beta,
                    void* C, int64_t ldc, DType c_type, const void* const* bias) override {
    gemm_op("gemm_grouped", total_rows(G, rows), N, K, [&] {
      inner_->gemm_grouped(trans_a, trans_b, G, rows, N, K, alpha, A, lda, B, ldb, ab_type, beta, C, ldc, c_type,
                           bias);
    }, G);
  }
  void gemm_grouped_k(bool trans_a, bool trans_b, int64_t G, const int64_t* rows, int64_t M, int64_t N, float alpha,
                      const void* A, int64_t lda, const void* B, int64_t ldb, DType ab_type, float beta,
                      void* const* C, int64_t ldc, DType c_type) override {
    gemm_op("gemm_grouped_k", M, N, total_rows(G, rows), [&] {
      inner_->gemm_grouped_k(trans_a, trans_b, G, rows, M, N, alpha, A, lda, B, ldb, ab_type, beta, C, ldc, c_type);
    }, G);
  }
  void bias_backward(float* dbias, const void* dout, int64_t N, int64_t OC, DType act) override {
    op("bias_backward", [&] { inner_->bias_backward(dbias, dout, N, OC, act); });
  }
  void gemm_gelu(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
                 const void* B, int64_t ldb, const void* bias, void* pre, void* out, DType act) override {
    gemm_op("gemm_gelu", M, N, K,
            [&] { inner_->gemm_gelu(trans_a, trans_b, M, N, K, A, lda, B, ldb, bias, pre, out, act); });
  }
  void gemm_dgelu(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A, int64_t lda,
                  const void* B, int64_t ldb, const void* pre, void* dpre, DType act) override {
    gemm_op("gemm_dgelu", M, N, K,
            [&] { inner_->gemm_dgelu(trans_a, trans_b, M, N, K, A, lda, B, ldb, pre, dpre, act); });
  }

  void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe, int64_t B, int64_t T,
                         int64_t C, int64_t v0, int64_t Vl, DType act, DType w, const int32_t* positions) override {
    op("embedding_forward",
       [&] { inner_->embedding_forward(out, tokens, wte, wpe, B, T, C, v0, Vl, act, w, positions); });
  }
  void embedding_backward(float* dwte, float* dwpe, const void* dout, const int32_t* tokens, int64_t B, int64_t T,
                          int64_t C, int64_t v0, int64_t Vl, DType act, const int32_t* positions) override {
    op("embedding_backward",
       [&] { inner_->embedding_backward(dwte, dwpe, dout, tokens, B, T, C, v0, Vl, act, positions); });
  }

  void norm_forward(NormKind kind, void* out, float* mean, float* rstd, const void* x, const void* weight,
                    const void* bias, int64_t N, int64_t C, float eps, DType act, DType w) override {
    op("norm_forward", [&] { inner_->norm_forward(kind, out, mean, rstd, x, weight, bias, N, C, eps, act, w); });
  }
  void norm_backward(NormKind kind, void* dx, float* dweight, float* dbias, const void* dout, const void* x,
                     const void* weight, const float* mean, const float* rstd, int64_t N, int64_t C, DType act,
                     DType w) override {
    op("norm_backward",
       [&] { inner_->norm_backward(kind, dx, dweight, dbias, dout, x, weight, mean, rstd, N, C, act, w); });
  }

  void add(void* out, const void* a, const void* b, int64_t n, DType act) override {
    op("add", [&] { inner_->add(out, a, b, n, act); });
  }
  void gelu_forward(void* y, const void* x, int64_t n, DType act) override {
    op("gelu_forward", [&] { inner_->gelu_forward(y, x, n, act); });
  }
  void gelu_backward(void* dx, const void* x, const void* dy, int64_t n, DType act) override {
    op("gelu_backward", [&] { inner_->gelu_backward(dx, x, dy, n, act); });
  }
  void swiglu_forward(void* y, const void* x, int64_t N, int64_t F, DType act) override {
    op("swiglu_forward", [&] { inner_->swiglu_forward(y, x, N, F, act); });
  }
  void swiglu_backward(void* dx, const void* x, const void* dy, int64_t N, int64_t F, DType act) override {
    op("swiglu_backward", [&] { inner_->swiglu_backward(dx, x, dy, N, F, act); });
  }

  void rope_forward(void* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, const math::RopeFreqs& freqs,
                    DType act, const int32_t* positions) override {
    op("rope_forward", [&] { inner_->rope_forward(qkv, B, T, NH, NKV, HS, freqs, act, positions); });
  }
  void rope_backward(void* dqkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                     const math::RopeFreqs& freqs, DType act, const int32_t* positions) override {
    op("rope_backward", [&] { inner_->rope_backward(dqkv, B, T, NH, NKV, HS, freqs, act, positions); });
  }
  void attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                         int64_t HS, DType act) override {
    op("attention_forward", [&] { inner_->attention_forward(out, lse, qkv, B, T, NH, NKV, HS, act); });
  }
  void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out, const float* lse,
                          int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, DType act) override {
    op("attention_backward",
       [&] { inner_->attention_backward(dqkv, dout, qkv, out, lse, B, T, NH, NKV, HS, act); });
  }
  void attention_block_forward(const AttnBlock& blk, AttnView o, bool first, DType act) override {
    op("attention_block_forward", [&] { inner_->attention_block_forward(blk, o, first, act); });
  }
  void attention_block_backward(const AttnBlock& blk, AttnView dout, AttnView out, AttnView dq, AttnView dk,
                                AttnView dv, DType act) override {
    op("attention_block_backward", [&] { inner_->attention_block_backward(blk, dout, out, dq, dk, dv, act); });
  }

  void cross_entropy(float* losses, void* dlogits, DType dlogits_type, const void* logits, DType logits_type,
                     const int32_t* targets, int64_t N, int64_t V, float dloss_scale) override {
    op("cross_entropy", [&] {
      inner_->cross_entropy(losses, dlogits, dlogits_type, logits, logits_type, targets, N, V, dloss_scale);
    });
  }
  void vocab_ce_max(float* row_max, const void* logits, DType logits_type, int64_t N, int64_t Vl) override {
    op("vocab_ce_max", [&] { inner_->vocab_ce_max(row_max, logits, logits_type, N, Vl); });
  }
  void vocab_ce_sums(float* sumexp, float* target_logit, const void* logits, DType logits_type, const float* row_max,
                     const int32_t* targets, int64_t v0, int64_t N, int64_t Vl) override {
    op("vocab_ce_sums",
       [&] { inner_->vocab_ce_sums(sumexp, target_logit, logits, logits_type, row_max, targets, v0, N, Vl); });
  }
  void vocab_ce_finish(float* losses, void* dlogits, DType dlogits_type, const void* logits, DType logits_type,
                       const float* row_max, const float* sumexp, const float* target_logit, const int32_t* targets,
                       int64_t v0, int64_t N, int64_t Vl, float dloss_scale) override {
    op("vocab_ce_finish", [&] {
      inner_->vocab_ce_finish(losses, dlogits, dlogits_type, logits, logits_type, row_max, sumexp, target_logit,
                              targets, v0, N, Vl, dloss_scale);
    });
  }

  void moe_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_prob, const float* logits,
                          int64_t N, int64_t E, int64_t K, MoeScore score, const float* select_bias) override {
    op("moe_router_forward",
       [&] { inner_->moe_router_forward(probs, lse, topk_idx, topk_prob, logits, N, E, K, score, select_bias); });
  }
  void moe_router_backward(float* dlogits, const float* probs, const float* lse, const int32_t* topk_idx,
                           const float* dtopk_prob, const float* expert_grad, float z_scale, int64_t N, int64_t E,
                           int64_t K, MoeScore score) override {
    op("moe_router_backward", [&] {
      inner_->moe_router_backward(dlogits, probs, lse, topk_idx, dtopk_prob, expert_grad, z_scale, N, E, K, score);
    });
  }
  void moe_gates_forward(float* gates, const float* topk_prob, int64_t N, int64_t K, bool normalize,
                         float scale) override {
    op("moe_gates_forward", [&] { inner_->moe_gates_forward(gates, topk_prob, N, K, normalize, scale); });
  }
  void moe_gates_backward(float* dtopk_prob, const float* dgates, const float* topk_prob, int64_t N, int64_t K,
                          bool normalize, float scale) override {
    op("moe_gates_backward",
       [&] { inner_->moe_gates_backward(dtopk_prob, dgates, topk_prob, N, K, normalize, scale); });
  }
  void moe_shared_gate_forward(void* out, float* gate, const float* logits, const void* y, int64_t N, int64_t C,
                               DType act) override {
    op("moe_shared_gate_forward", [&] { inner_->moe_shared_gate_forward(out, gate, logits, y, N, C, act); });
  }
  void moe_shared_gate_backward(void* dy, float* dlogits, const void* dout, const void* y, const float* gate,
                                int64_t N, int64_t C, DType act) override {
    op("moe_shared_gate_backward",
       [&] { inner_->moe_shared_gate_backward(dy, dlogits, dout, y, gate, N, C, act); });
  }
  void moe_gather_rows(void* dst, const void* src, const int32_t* rows, int64_t M, int64_t C, DType act) override {
    op("moe_gather_rows", [&] { inner_->moe_gather_rows(dst, src, rows, M, C, act); });
  }
  void moe_combine(void* out, const void* y, const int32_t* pos, const float* weights, int64_t N, int64_t K,
                   int64_t C, bool accumulate, DType act) override {
    op("moe_combine", [&] { inner_->moe_combine(out, y, pos, weights, N, K, C, accumulate, act); });
  }
  void moe_combine_backward(void* dy, float* dweights, const void* dout, const void* y, const int32_t* pos,
                            const float* weights, int64_t N, int64_t K, int64_t C, DType act) override {
    op("moe_combine_backward",
       [&] { inner_->moe_combine_backward(dy, dweights, dout, y, pos, weights, N, K, C, act); });
  }

  void sum_squares(float* out, const float* x, int64_t n) override {
    op("sum_squares", [&] { inner_->sum_squares(out, x, n); });
  }
  void sum(float* out, const float* x, int64_t n) override {
    op("sum", [&] { inner_->sum(out, x, n); });
  }
  void adamw(float* params, float* grads, float* m, float* v, int64_t n, const math::AdamParams& hp,
             void* compute_copy, DType compute_type) override {
    op("adamw", [&] { inner_->adamw(params, grads, m, v, n, hp, compute_copy, compute_type); });
  }
  void cast(void* dst, DType dst_type, const void* src, DType src_type, int64_t n) override {
    op("cast", [&] { inner_->cast(dst, dst_type, src, src_type, n); });
  }

 private:
  // `f` (the inner op) as a span while recording; `bytes` (> 0) said in its args.
  template <class F>
  void op(const char* name, F&& f, size_t bytes = 0) {
    if (!trace::on()) return f();
    trace::Span span("op", std::string_view(name));
    if (bytes > 0) span.arg("bytes", static_cast<int64_t>(bytes));
    f();
    if (sync_) inner_->synchronize();
  }
  // A grouped GEMM (groups > 0) is said as one product over all its rows (M, or K for
  // gemm_grouped_k), with the number of groups.
  template <class F>
  void gemm_op(const char* name, int64_t M, int64_t N, int64_t K, F&& f, int64_t groups = 0) {
    if (!trace::on()) return f();
    trace::Span span("op", std::string_view(name));
    span.arg("M", M).arg("N", N).arg("K", K).arg("flops", 2 * M * N * K);
    if (groups > 0) span.arg("groups", groups);
    f();
    if (sync_) inner_->synchronize();
  }

  static int64_t total_rows(int64_t G, const int64_t* rows) {
    int64_t r = 0;
    for (int64_t g = 0; g < G; ++g) r += rows[g];
    return r;
  }

  std::unique_ptr<Backend> inner_;
  bool sync_;  // ops are asynchronous: synchronise after each while recording
};

}  // namespace

std::unique_ptr<Backend> make_traced_backend(std::unique_ptr<Backend> inner) {
  return std::make_unique<TracedBackend>(std::move(inner));
}

}  // namespace tetra
