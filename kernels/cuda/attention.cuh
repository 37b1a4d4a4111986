// The attention files' shared declarations: the geometry of qkv, the fused flash-attention
// launchers (attention_flash_bf16.cu: tensor cores for bf16 and fp16 with HS <= 128;
// attention_flash_generic.cu: CUDA cores for fp32 and any other HS up to 256), the cuDNN SDPA path
// (attention_cudnn.cu) and CudaAttentionState, which attention.cu owns. Included by the attention
// .cu files only.
//
// Layout (kernels/backend.h): qkv (B, T, (NH + 2 NKV) HS) holds per token NH query heads, then NKV
// key heads, then NKV value heads; query head h reads kv head h / (NH / NKV). out (B, T, NH HS);
// lse (B, NH, T) the natural log-sum-exp of each query row's scaled scores.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <string>

#include "kernels/cuda/common.cuh"

namespace tetra::cuda::attn {

struct Dims {
  int64_t B, T, NH, NKV, HS;
  int64_t row() const { return (NH + 2 * NKV) * HS; }  // elements per token in qkv
  int64_t group() const { return NH / NKV; }           // query heads per kv head
  float scale() const { return 1.0f / sqrtf(static_cast<float>(HS)); }
};

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
// The largest head size the fused kernels take (the generic kernels' register tiles).
constexpr int64_t kMaxFusedHeadSize = 256;

inline bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// ---- fused flash attention (never materialises the (T, T) scores) ----------------------------
// Forward: out and lse. Backward: dqkv overwritten; d_rows is a (B, NH, T) fp32 scratch for
// D = rowsum(dout * out). Both pick the tensor-core kernels when act is BF16 or F16 and HS <= 128,
// the generic kernels otherwise; deterministic (no atomics: every output element has one writer
// and every sum a fixed order).
void fused_forward(const Dims& d, DType act, void* out, float* lse, const void* qkv,
                   cudaStream_t stream);
void fused_backward(const Dims& d, DType act, void* dqkv, const void* dout, const void* qkv,
                    const void* out, const float* lse, float* d_rows, cudaStream_t stream);

// The kernels behind them, per storage type.
bool flash_mma_supports(const Dims& d);  // HS <= 128
// T is bf16_t or f16_t (instantiated for both).
template <typename T>
void flash_mma_forward(const Dims& d, T* out, float* lse, const T* qkv, cudaStream_t stream);
template <typename T>
void flash_mma_backward(const Dims& d, T* dqkv, const T* dout, const T* qkv, const float* lse,
                        const float* d_rows, cudaStream_t stream);
template <typename T>
void flash_generic_forward(const Dims& d, T* out, float* lse, const T* qkv, cudaStream_t stream);
template <typename T>
void flash_generic_backward(const Dims& d, T* dqkv, const T* dout, const T* qkv,
                            const float* lse, const float* d_rows, cudaStream_t stream);
// d_rows[(b NH + h) T + t] = sum_x dout[b, t, h, x] * out[b, t, h, x]
template <typename T>
void attention_row_dots(const Dims& d, float* d_rows, const T* dout, const T* out,
                        cudaStream_t stream);

// ---- cuDNN fused SDPA (backend graph API) ----------------------------------------------------
// Plans are built once per shape and kept; a shape cuDNN cannot plan or execute is remembered with
// the reason (cuDNN's own message included). Each call returns "" when it enqueued the work, else
// that reason (nothing enqueued). The backward's softmax_sum is a (B, NH, T) fp32 scratch it
// overwrites (rowsum(dout * out), as the fused backward's d_rows).
struct CudnnSdpa;
struct CudnnSdpaDeleter { void operator()(CudnnSdpa* s) const; };
std::unique_ptr<CudnnSdpa, CudnnSdpaDeleter> cudnn_sdpa_create(cudaStream_t stream);
// "" when the shape and type are ones the cuDNN path takes at all, else why not.
std::string cudnn_sdpa_eligible(const Dims& d, DType act);
std::string cudnn_sdpa_forward(CudnnSdpa& s, const Dims& d, DType act, void* out, float* lse,
                               const void* qkv);
std::string cudnn_sdpa_backward(CudnnSdpa& s, const Dims& d, DType act, void* dqkv,
                                const void* dout, const void* qkv, const void* out,
                                const float* lse, float* softmax_sum);

}  // namespace tetra::cuda::attn

namespace tetra {

// Owned by CudaBackend (created at the first attention or RoPE op).
struct CudaAttentionState {
  std::string last_path = "none";  // "cudnn" or "fused" after the first attention op
  std::set<std::string> forward_paths, backward_paths;  // every path taken so far
  std::string fallback_reason;  // why cuDNN was passed over the first time it was (auto mode)
  bool refusal_printed = false;  // a refusal by cuDNN itself was printed (once per backend)
  float* d_rows = nullptr;         // grow-only (B, NH, T) scratch of either backward (D / softmax_sum)
  size_t d_rows_floats = 0;
  std::unique_ptr<cuda::attn::CudnnSdpa, cuda::attn::CudnnSdpaDeleter> cudnn;  // on first use
  std::string cudnn_init_error;  // why the cuDNN handle could not be created, if it could not
  bool cudnn_tried = false;
};

}  // namespace tetra
