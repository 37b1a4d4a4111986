// The CUDA backend: the product's engine. GEMMs through cuBLASLt (bf16/fp16/fp32 in, fp32 accumulate,
// bias epilogue), causal attention through cuDNN's fused SDPA with Tetra's own flash-style kernel
// as the fallback, and fused kernels for everything else; element-wise math comes from
// kernels/common/math.h, shared with the CPU backend. Every op is enqueued on the backend's one
// compute stream and returns at once (stream order is the op interface's order); copy_to_host
// and synchronize() wait. Each op lives in its own file under kernels/cuda/; this class only binds
// them to the Backend interface (kernels/backend.h has every op's contract).
//
// This header is plain C++ (no CUDA types): the trainer includes it without nvcc. The stream is
// handed out as void* (a cudaStream_t) for the NCCL communicator, which orders its collectives
// after the compute stream's work with events.
#pragma once

#include <memory>
#include <string>

#include "kernels/backend.h"

namespace tetra {

// Per-file state of the backend, each type complete only in its own .cu file.
struct CudaGemmState;       // gemm.cu: cuBLASLt handle, workspace, cached heuristics per shape
struct CudaAttentionState;  // attention*.cu: cuDNN handle, cached SDPA plans, which path ran
struct CudaScratch;         // backend.cu: a small device scratch area for reductions
struct CudaFusedState;      // fused_state.cu: norm_backward's partials, embedding_backward's sort
struct CudaStaging;         // backend.cu: pinned host buffers that copy_from_host stages through
struct CudaGemmStateDeleter { void operator()(CudaGemmState* s) const; };
struct CudaAttentionStateDeleter { void operator()(CudaAttentionState* s) const; };
struct CudaScratchDeleter { void operator()(CudaScratch* s) const; };
struct CudaFusedStateDeleter { void operator()(CudaFusedState* s) const; };
struct CudaStagingDeleter { void operator()(CudaStaging* s) const; };

// A GPU's identity and dense peaks (device_info.cu says where the figures come from).
struct CudaDeviceInfo {
  std::string name;
  int sm_count = 0;
  int compute_capability = 0;  // 90 for sm_90
  size_t memory_bytes = 0;
  double clock_ghz = 0.0;
  double peak_bf16_flops = 0.0;  // tensor cores, dense, fp32 accumulation (bf16 and fp16)
  double peak_fp32_flops = 0.0;  // CUDA cores (the fp32 GEMM path computes exact fp32, no TF32)
  std::string peak_bf16_source;  // where each peak comes from, for the log line
  std::string peak_fp32_source;
};
CudaDeviceInfo cuda_device_info(int device);

class CudaBackend final : public Backend {
 public:
  explicit CudaBackend(int device, AttentionPath attention = AttentionPath::AUTO);
  ~CudaBackend() override;
  std::string name() const override { return "cuda"; }
  bool host_memory() const override { return false; }
  int device() const { return device_; }
  void* stream() const { return stream_; }  // cudaStream_t
  // "cudnn" or "fused" for the attention path the last attention op took.
  std::string attention_path() const;
  // The path attention ops take from now on (the constructor's, until changed).
  void set_attention_path(AttentionPath path) { attention_path_ = path; }
  // Which implementations ran (attention paths, GELU epilogue or kernels; the trainer logs it).
  std::string kernel_report() const override;
  // Bytes currently allocated through alloc(), and the most ever allocated at once.
  size_t allocated_bytes() const { return allocated_; }
  size_t peak_allocated_bytes() const { return peak_allocated_; }
  MemoryStats memory_stats() const override { return {allocated_, peak_allocated_, true}; }

  void* alloc(size_t bytes) override;
  void free(void* ptr) override;
  void memset_zero(void* ptr, size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void copy_2d(void* dst, size_t dst_pitch, const void* src, size_t src_pitch, size_t width, size_t rows) override;
  void synchronize() override;

  void gemm(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
            const void* A, int64_t lda, const void* B, int64_t ldb, DType ab_type, float beta,
            void* C, int64_t ldc, DType c_type, const void* bias) override;
  void gemm_grouped(bool trans_a, bool trans_b, int64_t G, const int64_t* rows, int64_t N, int64_t K, float alpha,
                    const void* A, int64_t lda, const void* const* B, int64_t ldb, DType ab_type, float beta,
                    void* C, int64_t ldc, DType c_type, const void* const* bias) override;
  void gemm_grouped_k(bool trans_a, bool trans_b, int64_t G, const int64_t* rows, int64_t M, int64_t N,
                      float alpha, const void* A, int64_t lda, const void* B, int64_t ldb, DType ab_type,
                      float beta, void* const* C, int64_t ldc, DType c_type) override;
  void bias_backward(float* dbias, const void* dout, int64_t N, int64_t OC, DType act) override;

  void embedding_forward(void* out, const int32_t* tokens, const void* wte, const void* wpe,
                         int64_t B, int64_t T, int64_t C, int64_t v0, int64_t Vl, DType act,
                         DType w, const int32_t* positions = nullptr) override;
  void embedding_backward(float* dwte, float* dwpe, const void* dout, const int32_t* tokens,
                          int64_t B, int64_t T, int64_t C, int64_t v0, int64_t Vl,
                          DType act, const int32_t* positions = nullptr) override;

  void norm_forward(NormKind kind, void* out, float* mean, float* rstd, const void* x,
                    const void* weight, const void* bias, int64_t N, int64_t C, float eps,
                    DType act, DType w) override;
  void norm_backward(NormKind kind, void* dx, float* dweight, float* dbias, const void* dout,
                     const void* x, const void* weight, const float* mean, const float* rstd,
                     int64_t N, int64_t C, DType act, DType w) override;

  void add(void* out, const void* a, const void* b, int64_t n, DType act) override;
  void gemm_gelu(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A,
                 int64_t lda, const void* B, int64_t ldb, const void* bias, void* pre, void* out,
                 DType act) override;
  void gemm_dgelu(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, const void* A,
                  int64_t lda, const void* B, int64_t ldb, const void* pre, void* dpre,
                  DType act) override;
  void gelu_forward(void* y, const void* x, int64_t n, DType act) override;
  void gelu_backward(void* dx, const void* x, const void* dy, int64_t n, DType act) override;
  void swiglu_forward(void* y, const void* x, int64_t N, int64_t F, DType act) override;
  void swiglu_backward(void* dx, const void* x, const void* dy, int64_t N, int64_t F,
                       DType act) override;

  void rope_forward(void* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                    const math::RopeFreqs& freqs, DType act, const int32_t* positions = nullptr) override;
  void rope_backward(void* dqkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS,
                     const math::RopeFreqs& freqs, DType act, const int32_t* positions = nullptr) override;
  // Context parallelism's blocks (attention_block.cu): plain per-row kernels, not the fused paths.
  void attention_block_forward(const AttnBlock& blk, AttnView o, bool first, DType act) override;
  void attention_block_backward(const AttnBlock& blk, AttnView dout, AttnView out, AttnView dq, AttnView dk,
                                AttnView dv, DType act) override;
  void attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t NH,
                         int64_t NKV, int64_t HS, DType act) override;
  void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                          const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                          int64_t HS, DType act) override;

  void cross_entropy(float* losses, void* dlogits, DType dlogits_type, const void* logits,
                     DType logits_type, const int32_t* targets, int64_t N, int64_t V,
                     float dloss_scale) override;
  void vocab_ce_max(float* row_max, const void* logits, DType logits_type, int64_t N,
                    int64_t Vl) override;
  void vocab_ce_sums(float* sumexp, float* target_logit, const void* logits, DType logits_type,
                     const float* row_max, const int32_t* targets, int64_t v0, int64_t N,
                     int64_t Vl) override;
  void vocab_ce_finish(float* losses, void* dlogits, DType dlogits_type, const void* logits,
                       DType logits_type, const float* row_max, const float* sumexp,
                       const float* target_logit, const int32_t* targets, int64_t v0, int64_t N,
                       int64_t Vl, float dloss_scale) override;

  void moe_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_prob,
                          const float* logits, int64_t N, int64_t E, int64_t K, MoeScore score,
                          const float* select_bias) override;
  void moe_router_backward(float* dlogits, const float* probs, const float* lse,
                           const int32_t* topk_idx, const float* dtopk_prob,
                           const float* expert_grad, float z_scale, int64_t N, int64_t E,
                           int64_t K, MoeScore score) override;
  void moe_gates_forward(float* gates, const float* topk_prob, int64_t N, int64_t K, bool normalize,
                         float scale) override;
  void moe_gates_backward(float* dtopk_prob, const float* dgates, const float* topk_prob, int64_t N, int64_t K,
                          bool normalize, float scale) override;
  void moe_shared_gate_forward(void* out, float* gate, const float* logits, const void* y, int64_t N, int64_t C,
                               DType act) override;
  void moe_shared_gate_backward(void* dy, float* dlogits, const void* dout, const void* y, const float* gate,
                                int64_t N, int64_t C, DType act) override;
  void moe_gather_rows(void* dst, const void* src, const int32_t* rows, int64_t M, int64_t C,
                       DType act) override;
  void moe_combine(void* out, const void* y, const int32_t* pos, const float* weights, int64_t N,
                   int64_t K, int64_t C, bool accumulate, DType act) override;
  void moe_combine_backward(void* dy, float* dweights, const void* dout, const void* y,
                            const int32_t* pos, const float* weights, int64_t N, int64_t K,
                            int64_t C, DType act) override;

  void sum_squares(float* out, const float* x, int64_t n) override;
  void sum(float* out, const float* x, int64_t n) override;
  void adamw(float* params, float* grads, float* m, float* v, int64_t n,
             const math::AdamParams& hp, void* compute_copy, DType compute_type) override;
  void cast(void* dst, DType dst_type, const void* src, DType src_type, int64_t n) override;

  // cuBLASLt's plan cache (gemm.cu): plans held, built (heuristic asked), retargeted to other dims
  // of their bucket, re-asked where the cached algorithm failed its check, and cache resets.
  struct GemmPlanStats {
    int64_t cached = 0, built = 0, retargeted = 0, reheuristic = 0, resets = 0;
  };
  GemmPlanStats gemm_plan_stats() const;

  // For the kernel files: the state each owns, created on first use.
  CudaGemmState& gemm_state();
  std::string gemm_report() const;       // gemm.cu
  std::string attention_report() const;  // attention.cu
  CudaAttentionState& attention_state();
  CudaScratch& scratch();
  CudaFusedState& fused_state();

 private:
  int device_;
  AttentionPath attention_path_;
  void* stream_ = nullptr;  // cudaStream_t
  size_t allocated_ = 0, peak_allocated_ = 0;
  std::unique_ptr<CudaGemmState, CudaGemmStateDeleter> gemm_;
  std::unique_ptr<CudaAttentionState, CudaAttentionStateDeleter> attention_;
  std::unique_ptr<CudaScratch, CudaScratchDeleter> scratch_;
  std::unique_ptr<CudaFusedState, CudaFusedStateDeleter> fused_;
  std::unique_ptr<CudaStaging, CudaStagingDeleter> staging_;
};

}  // namespace tetra
