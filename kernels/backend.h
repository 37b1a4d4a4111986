// The op interface every backend implements (cpu now, cuda later).
//
// Model, optimizer and training code are written once against this interface. Ops take raw
// pointers into backend memory, sizes and element types; they are stream-ordered: a call may
// return before its work is done, results are visible to later calls on the same backend, and the
// host sees them only after `copy_to_host` (which synchronises). The CPU backend runs each op to
// completion before returning.
//
// Shape letters (llm.c / paper style): B batch, T sequence length, C hidden size, NH query heads,
// NKV key/value heads, HS head size (C / NH), F ffn hidden size, V vocabulary size, N rows (B*T).
//
// Conventions that every implementation must follow (and the CPU tests check):
// - Activation tensors have the activation type `act` (F32, BF16 or F16). Norm statistics, losses,
//   attention log-sum-exp and every parameter gradient are F32.
// - Parameter gradients ACCUMULATE (+=) into F32 buffers: gradient accumulation over micro-batches
//   and parameter sharing need it. Activation gradients OVERWRITE their output, except where a
//   doc comment says "accumulates" (the residual stream).
// - Internal reductions (norm statistics, softmax, loss, dot products) are done in fp32 whatever
//   the storage type.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "kernels/common/allocation_tally.h"
#include "kernels/common/dtype.h"
#include "kernels/common/math.h"

namespace tetra {

enum class NormKind : uint8_t { LAYERNORM, RMSNORM };
// How a MoE router scores the experts (Megatron's moe_router_score_function).
enum class MoeScore : uint8_t { SOFTMAX, SIGMOID };

// A strided view of per-head vectors: head h's HS values of token t of sequence b start at element
// b * seq + t * row + h * HS of p (its element type is the op's: act, or fp32 where it says so).
struct AttnView {
  void* p = nullptr;
  int64_t row = 0, seq = 0;
};

// One block of attention_block_forward / _backward: q (act, NH heads) against k, v (act, NKV
// heads); lse (fp32) holds query i of head h of sequence b at lse[(b * NH + h) * lse_ld + i].
struct AttnBlock {
  int64_t B = 0, Tq = 0, Tk = 0, NH = 0, NKV = 0, HS = 0;
  bool causal = false;
  AttnView q, k, v;
  float* lse = nullptr;
  int64_t lse_ld = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string name() const = 0;
  // True when backend memory is ordinary host memory (the CPU backend): the host may read it
  // directly, without copy_to_host. Callers use it only to skip a copy; whatever reads backend
  // memory on the host when it is true must copy when it is false (the guarded-memory test
  // backend, kernels/cpu/guarded_backend.h, says false, and checks it).
  virtual bool host_memory() const { return false; }
  // For ops with more than one implementation: which ones have run so far, in words (e.g. the
  // CUDA backend's attention path, cuDNN or its own kernels). Empty where there is no choice.
  virtual std::string kernel_report() const { return ""; }
  // How the backend's memory is held, in words, where that affects speed (the CPU backend: how
  // much of the process sits on huge pages). Empty where there is nothing to say.
  virtual std::string memory_report() const { return ""; }

  // ---- memory ------------------------------------------------------------------------------
  // Allocations happen while the run is planned, never inside the step loop.
  virtual void* alloc(size_t bytes) = 0;
  virtual void free(void* ptr) = 0;
  // The bytes alloc() holds now and at most so far (allocation_tally.h; untracked by default).
  virtual MemoryStats memory_stats() const { return {}; }
  virtual void memset_zero(void* ptr, size_t bytes) = 0;
  // copy_to_host returns with the data in host_dst (it synchronises with earlier ops);
  // copy_from_host has read host_src when it returns: the caller may reuse it at once (the
  // trainer refills its host batch buffers right after uploading them).
  virtual void copy_to_host(void* host_dst, const void* src, size_t bytes) = 0;
  virtual void copy_from_host(void* dst, const void* host_src, size_t bytes) = 0;
  virtual void copy(void* dst, const void* src, size_t bytes) = 0;
  // `rows` runs of `width` bytes, from src + r src_pitch to dst + r dst_pitch (a strided view
  // copied in or out of a compact one); the regions must not overlap. A row at a time by
  // default; the CUDA backend does it in one copy.
  virtual void copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows) {
    for (size_t r = 0; r < rows; ++r)
      copy(static_cast<char*>(dst) + r * dst_pitch, static_cast<const char*>(src) + r * src_pitch, width);
  }
  virtual void synchronize() = 0;

  // ---- dense algebra -----------------------------------------------------------------------
  // Row-major C(M,N) = alpha * op(A) · op(B) + beta * C, then + bias[n] on every row if bias is
  // non-null (bias: N elements of ab_type, the weights' type).
  //   op(A) is (M,K): A stored (M,K) with leading dimension lda, or, if trans_a, stored (K,M).
  //   op(B) is (K,N): B stored (K,N) with ldb, or, if trans_b, stored (N,K).
  // a_type and b_type must be equal (F32, BF16 or F16); c_type is any of the three. beta != 0 reads
  // C. Accumulation is fp32.
  virtual void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                    const void* A, int64_t lda, const void* B, int64_t ldb, DType ab_type,
                    float beta, void* C, int64_t ldc, DType c_type,
                    const void* bias = nullptr) = 0;

  // Grouped GEMMs: G independent products of gemm's contract that share the transposes, types,
  // leading dimensions, alpha and beta, each group with its own row count rows[g] (a host array)
  // and its own B (B[g], a host array of pointers). Group g's rows are the block after those of
  // groups < g: with o_g = rows[0] + ... + rows[g-1], R = o_G,
  //   gemm_grouped:   op(A) (R, K), C (R, N): for each g, rows [o_g, o_g + rows[g]) of C
  //                     = alpha op(A)[o_g .. o_g + rows[g]) · op(B[g]) + beta C[..] + bias[g]
  //                   (bias: null, or a host array of G pointers, each null or N elements)
  //                   — the experts' projections, their row blocks one after another;
  //   gemm_grouped_k: the row blocks are the reduction dimension: op(A) (M, R), op(B) (R, N),
  //                     C[g] (M, N) = alpha op(A)[:, o_g .. o_g + rows[g]) · op(B)[o_g .. o_g + rows[g], :]
  //                               + beta C[g]
  //                   (C: a host array of G pointers) — the experts' weight gradients dW_g += dY_g^T X_g.
  // The groups' outputs must not overlap. A group of 0 rows is skipped (gemm_grouped_k leaves its
  // C[g] as it is). The result is exactly that of the G gemm calls: the same rounding, bit for bit
  // on the CPU backend; what a grouped call may gain is running the groups together (the CPU
  // backend can deal small groups out to its threads, kernels/cpu/gemm.cpp).
  virtual void gemm_grouped(bool trans_a, bool trans_b, int64_t G, const int64_t* rows, int64_t N, int64_t K,
                            float alpha, const void* A, int64_t lda, const void* const* B, int64_t ldb,
                            DType ab_type, float beta, void* C, int64_t ldc, DType c_type,
                            const void* const* bias = nullptr) = 0;
  virtual void gemm_grouped_k(bool trans_a, bool trans_b, int64_t G, const int64_t* rows, int64_t M, int64_t N,
                              float alpha, const void* A, int64_t lda, const void* B, int64_t ldb, DType ab_type,
                              float beta, void* const* C, int64_t ldc, DType c_type) = 0;

  // dbias[j] += sum_i dout[i, j]. dout (N, OC) of type act; dbias F32 (OC).
  virtual void bias_backward(float* dbias, const void* dout, int64_t N, int64_t OC, DType act) = 0;

  // The two GEMMs of a GELU MLP that the GELU can ride on (cuBLASLt's GELU / DGELU epilogues):
  //   gemm_gelu:  pre = op(A)·op(B) + bias;  out = gelu(pre)      (pre is kept for backward)
  //   gemm_dgelu: dpre = (op(A)·op(B)) * gelu'(pre)                  (dpre may not alias pre)
  // A, B, bias (may be null), pre, out, dpre of type act; pre, out, dpre (M, N) contiguous;
  // alpha 1, beta 0 (nothing is read from the outputs). Equal to gemm followed by gelu_forward /
  // gelu_backward, except that a fused epilogue applies the GELU (or its derivative) to the fp32
  // accumulator, where the unfused order rounds it to act first: in bf16 the results may differ
  // by about one bf16 rounding of the product, in fp32 by the GELU's own rounding.
  virtual void gemm_gelu(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                         const void* A, int64_t lda, const void* B, int64_t ldb,
                         const void* bias, void* pre, void* out, DType act) = 0;
  virtual void gemm_dgelu(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                          const void* A, int64_t lda, const void* B, int64_t ldb,
                          const void* pre, void* dpre, DType act) = 0;

  // ---- embeddings ----------------------------------------------------------------------------
  // out[b,t,:] = wte[tokens[b,t] - v0, :] + (wpe ? wpe[p(t), :] : 0), p(t) = t, or positions[t]
  // where given (T int32 in backend memory). out (B,T,C) act; wte (Vl,C) holds the vocabulary
  // rows [v0, v0 + Vl) (all of it: v0 = 0, Vl = V); wpe (at least max p(t) + 1 rows, C) of type w.
  // A token outside [v0, v0 + Vl) contributes a zero row (vocab-parallel embedding: the TP ranks'
  // outputs are summed); ids outside [0, V) are a caller error (checked by the data layer).
  virtual void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe,
                                 int64_t B, int64_t T, int64_t C, int64_t v0, int64_t Vl, DType act,
                                 DType w, const int32_t* positions = nullptr) = 0;
  // dwte[tokens[b,t] - v0, :] += dout[b,t,:] for tokens in [v0, v0 + Vl) (if dwte);
  // dwpe[p(t),:] += dout[b,t,:] (if dwpe; positions distinct). Deterministic: the result must not
  // depend on thread scheduling.
  virtual void embedding_backward(float* dwte, float* dwpe, const void* dout,
                                  const int32_t* tokens, int64_t B, int64_t T, int64_t C,
                                  int64_t v0, int64_t Vl, DType act, const int32_t* positions = nullptr) = 0;

  // ---- normalisation -------------------------------------------------------------------------
  // LAYERNORM: out = (x - mean) * rstd * weight + bias,   rstd = 1/sqrt(var + eps)
  // RMSNORM:   out = x * rstd * weight,                   rstd = 1/sqrt(mean(x^2) + eps)
  // x, out (N, C) act; weight, bias (C) of type w, bias may be null; mean (N) F32 (written only
  // for LAYERNORM, may be null for RMSNORM); rstd (N) F32.
  virtual void norm_forward(NormKind kind, void* out, float* mean, float* rstd, const void* x,
                            const void* weight, const void* bias, int64_t N, int64_t C, float eps,
                            DType act, DType w) = 0;
  // dx ACCUMULATES (+=): it is the residual stream's gradient. dweight, dbias (if non-null) +=.
  virtual void norm_backward(NormKind kind, void* dx, float* dweight, float* dbias,
                             const void* dout, const void* x, const void* weight,
                             const float* mean, const float* rstd, int64_t N, int64_t C,
                             DType act, DType w) = 0;

  // ---- element-wise --------------------------------------------------------------------------
  // out = a + b, n elements of type act (out may alias a or b).
  virtual void add(void* out, const void* a, const void* b, int64_t n, DType act) = 0;
  // y = gelu(x); dx = gelu'(x) * dy (overwrites dx; dx may alias dy).
  virtual void gelu_forward(void* y, const void* x, int64_t n, DType act) = 0;
  virtual void gelu_backward(void* dx, const void* x, const void* dy, int64_t n, DType act) = 0;
  // SwiGLU: x (N, 2F) holds [gate | up] per row; y (N, F) = silu(gate) * up.
  // dx (N, 2F) is overwritten from dy (N, F).
  virtual void swiglu_forward(void* y, const void* x, int64_t N, int64_t F, DType act) = 0;
  virtual void swiglu_backward(void* dx, const void* x, const void* dy, int64_t N, int64_t F,
                               DType act) = 0;

  // ---- attention -----------------------------------------------------------------------------
  // qkv (B, T, (NH + 2*NKV) * HS): per token, NH query heads, then NKV key heads, then NKV value
  // heads, each HS wide. Query head h uses kv head h / (NH / NKV) (GQA; NKV == NH is MHA).
  //
  // RoPE (in place on the q and k parts of qkv; v untouched), position t = token index in its
  // sequence, or positions[t] (T int32 in backend memory: a context-parallel rank's tokens are two
  // distant chunks of the sequence), math::rope_* convention, inverse frequencies
  // math::rope_inv_freq(i, HS, freqs) (a float converts to the default frequencies of that base).
  // Backward applies the inverse rotation to the gradient.
  virtual void rope_forward(void* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                            const math::RopeFreqs& freqs, DType act, const int32_t* positions = nullptr) = 0;
  virtual void rope_backward(void* dqkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                             int64_t HS, const math::RopeFreqs& freqs, DType act,
                             const int32_t* positions = nullptr) = 0;
  // Causal softmax attention with scale 1/sqrt(HS). out (B, T, NH*HS) act; lse (B, NH, T) F32 is
  // the log-sum-exp of each query row's scaled scores (saved for backward). Implementations must
  // not materialise the (B, NH, T, T) score tensor.
  virtual void attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T,
                                 int64_t NH, int64_t NKV, int64_t HS, DType act) = 0;
  // dqkv (same layout as qkv) is overwritten. dout, out (B, T, NH*HS).
  virtual void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                                  const float* lse, int64_t B, int64_t T, int64_t NH,
                                  int64_t NKV, int64_t HS, DType act) = 0;

  // Blocks of attention (context parallelism's ring attention, trainer/parallel/context_parallel.h):
  // a sequence's causal attention computed as blocks of queries x keys that live on different
  // ranks, merged by their log-sum-exp as flash attention merges tiles. A block is Tq queries of
  // `q` against Tk keys and values of `k`, `v`, scale 1/sqrt(HS), every key visible, or with
  // `causal` (Tq == Tk) key j to query i for j <= i. Query head h reads kv head h / (NH / NKV).
  // Forward merges the block into a running result: `o` (fp32, NH heads) and `lse` hold the
  // normalised output and log-sum-exp over the keys seen so far; with `first` there are none yet
  // and both are overwritten. Backward, given the finished output `out` (act) and its lse: dq
  // (fp32, NH heads), dk and dv (fp32, NKV heads) accumulate (+=) the block's gradients; dout,
  // out are act views of NH heads. Implementations must not materialise the (Tq, Tk) scores.
  virtual void attention_block_forward(const AttnBlock& blk, AttnView o, bool first, DType act) = 0;
  virtual void attention_block_backward(const AttnBlock& blk, AttnView dout, AttnView out, AttnView dq,
                                        AttnView dk, AttnView dv, DType act) = 0;

  // ---- loss ----------------------------------------------------------------------------------
  // Softmax cross-entropy over logits (N, V) of logits_type (F32, BF16 or F16; the math is fp32
  // whatever the storage) with targets (N) int32:
  //   losses[i] = logsumexp(logits[i]) - logits[i, targets[i]]            (F32, N)
  // If dlogits is non-null it is written with dloss_scale * (softmax(logits[i]) - onehot(t_i)),
  // of type dlogits_type; dlogits may alias logits when the two types are equal (fused in place).
  // A target < 0 is ignored: loss 0 and zero gradient for that row.
  virtual void cross_entropy(float* losses, void* dlogits, DType dlogits_type, const void* logits,
                             DType logits_type, const int32_t* targets, int64_t N, int64_t V,
                             float dloss_scale) = 0;

  // Vocab-parallel cross-entropy (tensor parallel): each rank holds the logits (N, Vl) of the
  // vocabulary slice [v0, v0 + Vl). The caller combines the three passes with all-reduces over
  // the TP group (MAX after the first, SUM of sumexp and target_logit after the second), so the
  // full (N, V) logits are never gathered. Math fp32 whatever the storage type.
  //   1. row_max[i] = max_j logits[i, j]                                                (F32, N)
  //   2. sumexp[i] = sum_j exp(logits[i, j] - row_max[i]) with the global row_max;
  //      target_logit[i] = logits[i, targets[i] - v0] if v0 <= targets[i] < v0 + Vl, else 0.
  //   3. losses[i] = log(sumexp[i]) + row_max[i] - target_logit[i] with the global sums, and if
  //      dlogits is non-null: dlogits[i, j] = dloss_scale * (exp(logits[i,j] - row_max[i]) /
  //      sumexp[i] - [v0 + j == targets[i]]) (dlogits may alias logits when the types match).
  // A target < 0 marks an ignored row: loss 0, zero gradient, target_logit 0.
  virtual void vocab_ce_max(float* row_max, const void* logits, DType logits_type, int64_t N,
                            int64_t Vl) = 0;
  virtual void vocab_ce_sums(float* sumexp, float* target_logit, const void* logits,
                             DType logits_type, const float* row_max, const int32_t* targets,
                             int64_t v0, int64_t N, int64_t Vl) = 0;
  virtual void vocab_ce_finish(float* losses, void* dlogits, DType dlogits_type,
                               const void* logits, DType logits_type, const float* row_max,
                               const float* sumexp, const float* target_logit,
                               const int32_t* targets, int64_t v0, int64_t N, int64_t Vl,
                               float dloss_scale) = 0;

  // ---- Mixture of Experts (K experts per token out of E; M rows of the expert-sorted buffer) --
  // Router, fp32 whatever the activation type. logits (N, E) F32. The scores, per row:
  //   SOFTMAX  s = softmax(logits); probs (N, E) = s, lse (N) = the row's log-sum-exp
  //   SIGMOID  s = sigmoid(logits) (math::sigmoid); probs = s / S, lse = S = sum_j s_j (the
  //            normalised scores feed the load-balancing loss, as Megatron's)
  // topk_idx (N, K) int32 = the K experts of highest s_j + select_bias[j] (select_bias (E) may be
  // null: 0), in decreasing order (equal keys: the lower expert index first); topk_prob (N, K) F32
  // = their scores s (without the bias: it only selects).
  virtual void moe_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_prob,
                                  const float* logits, int64_t N, int64_t E, int64_t K, MoeScore score,
                                  const float* select_bias) = 0;
  // dlogits (N, E) F32 is overwritten with the gradient of
  //   dp[i, j] = expert_grad[j]                               (w.r.t. probs; expert_grad (E) may
  //                                                            be null: 0; the load-balancing loss)
  //   ds[i, j] = sum_k [topk_idx[i, k] == j] dtopk_prob[i, k] (w.r.t. the chosen scores)
  // SOFTMAX: dlogits = s (dp + ds - sum_j' s_j' (dp + ds)_j') + 2 z_scale lse[i] s (the z-loss);
  // SIGMOID: with s = probs S, dlogits = (ds + (dp - sum_j' probs_j' dp_j') / S) s (1 - s)
  //          (z_scale must be 0: the z-loss is a softmax router's).
  virtual void moe_router_backward(float* dlogits, const float* probs, const float* lse,
                                   const int32_t* topk_idx, const float* dtopk_prob,
                                   const float* expert_grad, float z_scale, int64_t N, int64_t E,
                                   int64_t K, MoeScore score) = 0;
  // Gates from the chosen probabilities, per token (math::moe_gates_row): gates (N, K) F32 =
  // scale topk_prob / (sum over the token's K when normalize, else 1). gates must not alias
  // topk_prob. Backward (math::moe_gates_row_backward): dtopk_prob (N, K) from dgates (N, K).
  virtual void moe_gates_forward(float* gates, const float* topk_prob, int64_t N, int64_t K, bool normalize,
                                 float scale) = 0;
  virtual void moe_gates_backward(float* dtopk_prob, const float* dgates, const float* topk_prob, int64_t N,
                                  int64_t K, bool normalize, float scale) = 0;
  // The shared expert's sigmoid gate (math::moe_shared_gate, _grad): gate (N) F32 = sigmoid(logits)
  // and out[i, :] += gate[i] y[i, :] (fp32, rounded to act once). Backward: dy[i, :] = gate[i]
  // dout[i, :] and dlogits[i] = gate[i] (1 - gate[i]) sum_c dout[i, c] y[i, c] (fp32; linear in y,
  // so with y a TP partial sum dlogits is the partial sum of the whole's). out, y, dout, dy (N, C)
  // of type act; dy may not alias dout or y.
  virtual void moe_shared_gate_forward(void* out, float* gate, const float* logits, const void* y, int64_t N,
                                       int64_t C, DType act) = 0;
  virtual void moe_shared_gate_backward(void* dy, float* dlogits, const void* dout, const void* y,
                                        const float* gate, int64_t N, int64_t C, DType act) = 0;
  // Row gather (token permutation): dst[p, :] = src[rows[p], :] for p < M; rows of C elements of
  // type act. dst must not alias src.
  virtual void moe_gather_rows(void* dst, const void* src, const int32_t* rows, int64_t M,
                               int64_t C, DType act) = 0;
  // Combine (un-permutation): out[i, :] = (accumulate ? out[i, :] : 0)
  //                                       + sum_k (weights ? weights[i, k] : 1) y[pos[i, k], :]
  // for i < N; pos (N, K) int32, a negative position is a dropped assignment (skipped); weights
  // (N, K) F32 or null. The sum is fp32, rounded to act once. out (N, C), y (M, C) of type act.
  virtual void moe_combine(void* out, const void* y, const int32_t* pos, const float* weights,
                           int64_t N, int64_t K, int64_t C, bool accumulate, DType act) = 0;
  // Combine's backward: dy[pos[i, k], :] = weights[i, k] dout[i, :] (rows of dy that no position
  // names are left untouched) and dweights[i, k] = sum_c dout[i, c] y[pos[i, k], c] (fp32; 0 for
  // a dropped assignment). dout (N, C), y and dy (M, C) of type act.
  virtual void moe_combine_backward(void* dy, float* dweights, const void* dout, const void* y,
                                    const int32_t* pos, const float* weights, int64_t N,
                                    int64_t K, int64_t C, DType act) = 0;

  // ---- optimizer and reductions --------------------------------------------------------------
  // out[0] = sum_i x[i]^2 over n F32 elements, accumulated in double then stored as float.
  // Non-finite values propagate (an inf gives inf, a NaN NaN; a sum beyond fp32's range is inf):
  // fp16 loss scaling reads its overflows from the gradient norm this computes.
  virtual void sum_squares(float* out, const float* x, int64_t n) = 0;
  // out[0] = sum_i x[i] over n F32 elements (accumulated in double).
  virtual void sum(float* out, const float* x, int64_t n) = 0;
  // In place AdamW (math::adamw_update) on n elements of fp32 master params with fp32 grads and
  // moments. If compute_copy is non-null the updated params are also written to it, rounded to
  // compute_type (the bf16 or fp16 weights the next forward reads). The grads are zeroed as they are
  // consumed, which leaves the buffer ready for the next step's accumulation without a separate
  // pass over it.
  virtual void adamw(float* params, float* grads, float* m, float* v, int64_t n,
                     const math::AdamParams& hp, void* compute_copy, DType compute_type) = 0;
  // dst = src converted between any two of F32, BF16 and F16 (rounded to nearest even; between the
  // two 16-bit types through fp32), or a copy if equal types, n elements.
  virtual void cast(void* dst, DType dst_type, const void* src, DType src_type, int64_t n) = 0;
};

// Backend memory with one owner: allocated at construction, freed by the destructor (or reset),
// moved, never copied. Every buffer the trainer keeps past a function is one of these, so no code
// path (an exception during set-up included) can leak or double-free backend memory.
class BackendBuffer {
 public:
  BackendBuffer() = default;
  BackendBuffer(Backend& be, size_t bytes) : be_(&be), ptr_(be.alloc(bytes)), bytes_(bytes) {}
  ~BackendBuffer() { reset(); }
  BackendBuffer(BackendBuffer&& o) noexcept : be_(o.be_), ptr_(o.ptr_), bytes_(o.bytes_) { o.release(); }
  BackendBuffer& operator=(BackendBuffer&& o) noexcept {
    if (this != &o) {
      reset();
      be_ = o.be_, ptr_ = o.ptr_, bytes_ = o.bytes_;
      o.release();
    }
    return *this;
  }
  BackendBuffer(const BackendBuffer&) = delete;
  BackendBuffer& operator=(const BackendBuffer&) = delete;

  void* get() const { return ptr_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }
  explicit operator bool() const { return ptr_ != nullptr; }
  // Frees the memory now (nothing if empty).
  void reset() {
    if (ptr_) be_->free(ptr_);
    release();
  }

 private:
  void release() { be_ = nullptr, ptr_ = nullptr, bytes_ = 0; }
  Backend* be_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// The CPU backend (kernels/cpu). `threads` <= 0 means all available cores.
std::unique_ptr<Backend> make_cpu_backend(int threads = 0);

// The CUDA backend's path for causal attention: AUTO takes cuDNN's fused SDPA where it has a plan
// for the shape and Tetra's fused flash kernels otherwise; FUSED always the fused kernels; CUDNN
// always cuDNN (an Error naming the shape where it has no plan). The trainer passes the user's
// choice (TETRA_ATTENTION, trainer/core/runtime_options.h).
enum class AttentionPath { AUTO, FUSED, CUDNN };

// The CUDA backend (kernels/cuda), on GPU `device`. Exists only where Tetra was built with CUDA
// (TETRA_HAVE_CUDA defined); cuda_device_count() is 0 where the driver finds no GPU.
#if defined(TETRA_HAVE_CUDA)
std::unique_ptr<Backend> make_cuda_backend(int device, AttentionPath attention = AttentionPath::AUTO);
int cuda_device_count();
#endif

}  // namespace tetra
