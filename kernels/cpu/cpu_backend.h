// The CPU backend: the numerical reference, and still fast. GEMMs go to oneDNN's matmul (fp32, and
// bf16 x bf16 -> fp32 on AVX512-BF16/AMX); everything else is OpenMP-parallel C++ written so the
// compiler vectorises it. Each op lives in its own file under kernels/cpu/; this class only binds
// them to the Backend interface (see kernels/backend.h for every op's contract).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/common/gemm_groups.h"
#include "kernels/cpu/scratch.h"

namespace tetra {

class CpuBackend final : public Backend {
 public:
  explicit CpuBackend(int threads);
  ~CpuBackend() override;
  std::string name() const override { return "cpu"; }
  bool host_memory() const override { return true; }
  int threads() const { return threads_; }
  // bf16 attention runs on AMX tiles where the CPU has them (attention_amx.cpp), else on the fp32
  // flash kernels (attention.cpp). Off forces the flash kernels (tests compare the two).
  void set_amx_attention(bool on) { amx_attention_ = on; }
  // bf16 GEMMs (bf16 A and B, fp32 or bf16 C) run on AMX tiles where the CPU has them
  // (gemm_amx.cpp), else through oneDNN (gemm.cpp). Off forces oneDNN.
  void set_amx_gemm(bool on) { amx_gemm_ = on; }
  // Grouped GEMMs deal small groups out to the threads, one thread each, where that is exact
  // (gemm.cpp, gemm_problems); off (the default) runs the groups in turn on the whole team. Off
  // by default while the exactness probe is per problem shape: MoE row counts change every step,
  // and the probe's two extra GEMMs per new shape then outweigh the gain over a run's first steps.
  void set_grouped_threads(bool on) { grouped_threads_ = on; }
  // Which kernels the last attention ops and bf16 GEMM ran, e.g. "attention forward amx (bf16
  // tiles), backward amx (bf16 tiles); bf16 gemm amx (bf16 tiles)".
  std::string kernel_report() const override;
  // e.g. "host memory: 2582 MiB of the process on 2 MiB pages (transparent huge pages: madvise)"
  // (host_memory.h).
  std::string memory_report() const override;

  void* alloc(size_t bytes) override;
  void free(void* ptr) override;
  MemoryStats memory_stats() const override { return tally_.stats(); }
  void memset_zero(void* ptr, size_t bytes) override;
  void copy_to_host(void* host_dst, const void* src, size_t bytes) override;
  void copy_from_host(void* dst, const void* host_src, size_t bytes) override;
  void copy(void* dst, const void* src, size_t bytes) override;
  void synchronize() override {}

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
  void attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T, int64_t NH,
                         int64_t NKV, int64_t HS, DType act) override;
  void attention_backward(void* dqkv, const void* dout, const void* qkv, const void* out,
                          const float* lse, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                          int64_t HS, DType act) override;
  void attention_block_forward(const AttnBlock& blk, AttnView o, bool first, DType act) override;
  void attention_block_backward(const AttnBlock& blk, AttnView dout, AttnView out, AttnView dq, AttnView dk,
                                AttnView dv, DType act) override;

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

 private:
  int threads_;
  bool amx_attention_ = true;
  bool amx_gemm_ = true;
  bool grouped_threads_ = false;
  const char* bf16_gemm_kernel_ = nullptr;  // what the last bf16 GEMM ran
  // Runs a bf16 GEMM on AMX tiles if it is one and they are available and enabled.
  bool gemm_amx(bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K, float alpha,
                const void* A, int64_t lda, const void* B, int64_t ldb, DType ab_type, float beta,
                void* C, int64_t ldc, DType c_type, const void* bias);
  const char* attention_forward_kernel_ = nullptr;  // what the last attention ops ran
  const char* attention_backward_kernel_ = nullptr;
  struct GemmCache;                     // oneDNN engine, stream and primitives cached per shape
  std::unique_ptr<GemmCache> gemm_cache_;
  // gemm's oneDNN path on `cache` with `threads` threads: gemm_cache_ and threads_ for gemm, a
  // thread's own cache and 1 for the groups a grouped GEMM spreads over the threads (gemm.cpp).
  void gemm_dnnl(GemmCache& cache, int threads, bool trans_a, bool trans_b, int64_t M, int64_t N, int64_t K,
                 float alpha, const void* A, int64_t lda, const void* B, int64_t ldb, DType ab_type, float beta,
                 void* C, int64_t ldc, DType c_type, const void* bias);
  // Runs grouped_ (the problems of one grouped call, in group order, arguments checked):
  // gemm.cpp, or gemm_loops.cpp in a build without oneDNN.
  void gemm_problems(bool trans_a, bool trans_b, float alpha, int64_t lda, int64_t ldb, DType ab_type, float beta,
                     int64_t ldc, DType c_type);
  // Whether one thread computes this problem's shape bit for bit as the team does (gemm.cpp).
  bool alone_exact(const GemmProblem& p, bool trans_a, bool trans_b, float alpha, int64_t lda, int64_t ldb,
                   DType ab_type, float beta, int64_t ldc, DType c_type);
  std::vector<GemmProblem> grouped_;                     // reused from call to call
  std::vector<std::unique_ptr<GemmCache>> thread_caches_;  // one per thread, made on first use
  cpu::CpuScratch scratch_;  // the kernels' grow-only buffers, one slot per thread (scratch.h)
  AllocationTally tally_;    // what alloc() holds
};

}  // namespace tetra
