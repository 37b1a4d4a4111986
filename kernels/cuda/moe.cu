// Mixture-of-Experts ops on the GPU: the fp32 router (softmax, top-k, and their backward with the
// load-balancing and z-loss gradients) and the row movement around the expert GEMMs (gather of
// token rows into expert-sorted order, the gate-weighted combine back, and its backward).
// kernels/cpu/moe.cpp is the reference; the shapes and contracts are in kernels/backend.h.
//
// Router: one warp per token row (E experts strided over the lanes): max, sum of exponentials
// and the dot product of backward are warp reductions; top-k is K rounds of a warp arg-max in
// which a larger probability wins and equal probabilities go to the lower expert index (the CPU's
// strict-greater scan in index order), skipping experts already chosen.
//
// Rows: one block per output row, 16-byte loads and stores where the row length and the pointers
// allow. combine sums in fp32 in k order with fmaf, rounded once; that is the product-then-add
// the host compiler fuses in the CPU loop, so the two backends give the same bits.
// combine_backward runs one block per (token, k) assignment: dy's row is written (positions are
// distinct, so no two blocks write the same row) and the gate's gradient is a block dot product.
// Nothing is accumulated across blocks: every result has a fixed summation order.
#include <cstdint>
#include <initializer_list>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/pack.cuh"

namespace tetra {
namespace cuda {
namespace {

constexpr int kRouterWarps = 4;  // rows per block of the router kernels
constexpr int kRowThreads = 128;

// ---- router ---------------------------------------------------------------------------------

__global__ void __launch_bounds__(kRouterWarps * 32)
router_forward_kernel(float* probs, float* lse, int32_t* topk_idx, float* topk_prob,
                      const float* logits, int64_t N, int64_t E, int64_t K, bool sigmoid,
                      const float* select_bias) {
  const int lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x * int64_t{kRouterWarps} + threadIdx.x / 32;
  if (row >= N) return;  // the whole warp leaves together; the kernel has no __syncthreads
  const float* l = logits + row * E;
  float* p = probs + row * E;
  int32_t* idx = topk_idx + row * K;

  float mx = -INFINITY;
  if (!sigmoid) {
    for (int64_t j = lane; j < E; j += 32) mx = fmaxf(mx, l[j]);
    mx = warp_max(mx);
  }
  // The score of expert j (softmax: once the sum is known).
  float s = 0.0f;
  for (int64_t j = lane; j < E; j += 32) s += sigmoid ? math::sigmoid(l[j]) : expf(l[j] - mx);
  s = warp_sum(s);
  if (lane == 0) lse[row] = sigmoid ? s : mx + logf(s);
  auto score = [&](int64_t j) { return sigmoid ? math::sigmoid(l[j]) : expf(l[j] - mx) / s; };
  for (int64_t j = lane; j < E; j += 32) p[j] = sigmoid ? math::sigmoid(l[j]) / s : score(j);
  // Each lane reads back only the probabilities it wrote itself; topk_idx is shared (below).

  for (int64_t k = 0; k < K; ++k) {
    int64_t best = -1;
    float best_key = 0.0f, best_s = 0.0f;
    for (int64_t j = lane; j < E; j += 32) {
      bool taken = false;
      for (int64_t q = 0; q < k; ++q) taken = taken || idx[q] == j;
      const float sj = sigmoid ? math::sigmoid(l[j]) : p[j];
      const float key = select_bias ? sj + select_bias[j] : sj;
      if (!taken && (best < 0 || key > best_key)) best = j, best_key = key, best_s = sj;
    }
    // Warp arg-max: the larger key, on equal ones the lower index; -1 loses to anything.
    for (int o = 16; o > 0; o >>= 1) {
      const int64_t other = __shfl_xor_sync(kFullMask, best, o);
      const float other_key = __shfl_xor_sync(kFullMask, best_key, o);
      const float other_s = __shfl_xor_sync(kFullMask, best_s, o);
      const bool take = other >= 0 && (best < 0 || other_key > best_key ||
                                       (other_key == best_key && other < best));
      if (take) best = other, best_key = other_key, best_s = other_s;
    }
    if (lane == 0) {
      idx[k] = static_cast<int32_t>(best);
      topk_prob[row * K + k] = best_s;
    }
    __syncwarp();  // lane 0's idx[k] is visible to the whole warp in the next round
  }
}

__global__ void __launch_bounds__(kRouterWarps * 32)
router_backward_kernel(float* dlogits, const float* probs, const float* lse,
                       const int32_t* topk_idx, const float* dtopk_prob,
                       const float* expert_grad, float z_scale, int64_t N, int64_t E, int64_t K,
                       bool sigmoid) {
  const int lane = threadIdx.x % 32;
  const int64_t row = blockIdx.x * int64_t{kRouterWarps} + threadIdx.x / 32;
  if (row >= N) return;
  const float* p = probs + row * E;
  const int32_t* idx = topk_idx + row * K;
  const float* dtp = dtopk_prob + row * K;
  // ds[j] = the dtopk_prob of the slot that chose j (each expert is chosen once at most).
  auto ds_of = [&](int64_t j) {
    float d = 0.0f;
    for (int64_t k = 0; k < K; ++k)
      if (idx[k] == j) d += dtp[k];
    return d;
  };
  auto dp_of = [&](int64_t j) { return expert_grad ? expert_grad[j] : 0.0f; };
  float dot = 0.0f;
  for (int64_t j = lane; j < E; j += 32) dot += p[j] * (sigmoid ? dp_of(j) : dp_of(j) + ds_of(j));
  dot = warp_sum(dot);
  if (!sigmoid) {
    const float z = 2.0f * z_scale * lse[row];
    for (int64_t j = lane; j < E; j += 32)
      dlogits[row * E + j] = p[j] * (dp_of(j) + ds_of(j) - dot) + z * p[j];
  } else {
    const float S = lse[row];
    for (int64_t j = lane; j < E; j += 32) {
      const float sj = p[j] * S;
      dlogits[row * E + j] = (ds_of(j) + (dp_of(j) - dot) / S) * sj * (1.0f - sj);
    }
  }
}

// ---- gates ----------------------------------------------------------------------------------

__global__ void moe_gates_kernel(float* gates, const float* topk_prob, int64_t N, int64_t K, bool normalize,
                                 float scale) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < N) math::moe_gates_row(gates + i * K, topk_prob + i * K, K, normalize, scale);
}

__global__ void moe_gates_backward_kernel(float* dtopk_prob, const float* dgates, const float* topk_prob, int64_t N,
                                          int64_t K, bool normalize, float scale) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i < N) math::moe_gates_row_backward(dtopk_prob + i * K, dgates + i * K, topk_prob + i * K, K, normalize, scale);
}

// ---- gather ---------------------------------------------------------------------------------

// dst[p, :] = src[rows[p], :], rows of `words` W-sized words (W: the widest word the row length
// and both pointers allow).
template <typename W>
__global__ void __launch_bounds__(kRowThreads)
gather_rows_kernel(W* dst, const W* src, const int32_t* rows, int64_t words) {
  const int64_t p = blockIdx.x;
  const W* s = src + static_cast<int64_t>(rows[p]) * words;
  W* d = dst + p * words;
  for (int64_t i = threadIdx.x; i < words; i += blockDim.x) d[i] = s[i];
}

template <typename W>
void launch_gather(void* dst, const void* src, const int32_t* rows, int64_t M, int64_t row_bytes,
                   cudaStream_t stream) {
  const int64_t words = row_bytes / static_cast<int64_t>(sizeof(W));
  gather_rows_kernel<W><<<static_cast<unsigned>(M), kRowThreads, 0, stream>>>(
      static_cast<W*>(dst), static_cast<const W*>(src), rows, words);
  TETRA_CUDA_LAUNCHED();
}

// ---- combine --------------------------------------------------------------------------------

// out[i, :] = (accumulate ? out[i, :] : 0) + sum_k w[i, k] y[pos[i, k], :], fp32, k in order.
// VEC > 1: C % VEC == 0 and out, y aligned to 16 bytes.
template <typename T, int VEC>
__global__ void __launch_bounds__(kRowThreads)
combine_kernel(T* out, const T* y, const int32_t* pos, const float* w, int64_t K, int64_t C,
               bool accumulate) {
  const int64_t i = blockIdx.x;
  T* o = out + i * C;
  const int32_t* pr = pos + i * K;
  for (int64_t c = threadIdx.x * int64_t{VEC}; c < C; c += int64_t{blockDim.x} * VEC) {
    float acc[VEC];
    if (accumulate) {
      const Pack<T, VEC> a = load_pack<T, VEC>(o + c);
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = to_float(a.v[v]);
    } else {
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = 0.0f;
    }
    for (int64_t k = 0; k < K; ++k) {
      const int32_t p = pr[k];
      if (p < 0) continue;
      const float g = w ? w[i * K + k] : 1.0f;
      const Pack<T, VEC> yv = load_pack<T, VEC>(y + static_cast<int64_t>(p) * C + c);
#pragma unroll
      for (int v = 0; v < VEC; ++v) acc[v] = fmaf(g, to_float(yv.v[v]), acc[v]);
    }
    Pack<T, VEC> r;
#pragma unroll
    for (int v = 0; v < VEC; ++v) r.v[v] = from_float<T>(acc[v]);
    store_pack<T, VEC>(o + c, r);
  }
}

// One block over a row of C: out[c] = g d[c], and the block's sum_c d[c] y[c] (fp32, FMA chain per
// thread, then the block reduction) returned to every thread.
template <typename T, int VEC>
__device__ float scale_row_and_dot(T* out, const T* d, const T* y, float g, int64_t C, float* reduce) {
  float dot = 0.0f;
  for (int64_t c = threadIdx.x * int64_t{VEC}; c < C; c += int64_t{blockDim.x} * VEC) {
    const Pack<T, VEC> dv = load_pack<T, VEC>(d + c);
    const Pack<T, VEC> yv = load_pack<T, VEC>(y + c);
    Pack<T, VEC> r;
#pragma unroll
    for (int v = 0; v < VEC; ++v) {
      const float dc = to_float(dv.v[v]);
      dot = fmaf(dc, to_float(yv.v[v]), dot);
      r.v[v] = from_float<T>(__fmul_rn(g, dc));
    }
    store_pack<T, VEC>(out + c, r);
  }
  return block_sum(dot, reduce);
}

// One block per assignment a = i * K + k: dy[pos[a], :] = w[a] dout[i, :] and
// dw[a] = sum_c dout[i, c] y[pos[a], c]; a dropped assignment (pos < 0) only sets dw[a] = 0.
template <typename T, int VEC>
__global__ void __launch_bounds__(kRowThreads)
combine_backward_kernel(T* dy, float* dw, const T* dout, const T* y, const int32_t* pos,
                        const float* w, int64_t K, int64_t C) {
  __shared__ float reduce[32];
  const int64_t a = blockIdx.x, i = a / K;
  const int32_t p = pos[a];
  if (p < 0) {  // uniform over the block: nobody reaches the block_sum below
    if (threadIdx.x == 0) dw[a] = 0.0f;
    return;
  }
  const float g = w ? w[a] : 1.0f;
  const T* d = dout + i * C;
  const T* yr = y + static_cast<int64_t>(p) * C;
  T* dyr = dy + static_cast<int64_t>(p) * C;
  const float dot = scale_row_and_dot<T, VEC>(dyr, d, yr, g, C, reduce);
  if (threadIdx.x == 0) dw[a] = dot;
}

// ---- the shared expert's gate ---------------------------------------------------------------

// One block per token i: gate[i] = sigmoid(logits[i]), out[i, :] += gate[i] y[i, :] (fp32).
template <typename T, int VEC>
__global__ void __launch_bounds__(kRowThreads)
shared_gate_kernel(T* out, float* gate, const float* logits, const T* y, int64_t C) {
  const int64_t i = blockIdx.x;
  const float g = math::moe_shared_gate(logits[i]);
  if (threadIdx.x == 0) gate[i] = g;
  T* o = out + i * C;
  const T* yr = y + i * C;
  for (int64_t c = threadIdx.x * int64_t{VEC}; c < C; c += int64_t{blockDim.x} * VEC) {
    const Pack<T, VEC> a = load_pack<T, VEC>(o + c);
    const Pack<T, VEC> yv = load_pack<T, VEC>(yr + c);
    Pack<T, VEC> r;
#pragma unroll
    for (int v = 0; v < VEC; ++v) r.v[v] = from_float<T>(fmaf(g, to_float(yv.v[v]), to_float(a.v[v])));
    store_pack<T, VEC>(o + c, r);
  }
}

// One block per token i: dy[i, :] = gate[i] dout[i, :], dlogits[i] = gate (1 - gate) <dout_i, y_i>.
template <typename T, int VEC>
__global__ void __launch_bounds__(kRowThreads)
shared_gate_backward_kernel(T* dy, float* dlogits, const T* dout, const T* y, const float* gate, int64_t C) {
  __shared__ float reduce[32];
  const int64_t i = blockIdx.x;
  const float g = gate[i];
  const T* d = dout + i * C;
  const T* yr = y + i * C;
  T* dyr = dy + i * C;
  const float dot = scale_row_and_dot<T, VEC>(dyr, d, yr, g, C, reduce);
  if (threadIdx.x == 0) dlogits[i] = math::moe_shared_gate_grad(g, dot);
}

// Picks the 16-byte path for row kernels over (rows, C) of T when every row start is aligned.
template <typename T>
bool rows_vectorisable(int64_t C, std::initializer_list<const void*> ptrs) {
  if (C % kVec16<T> != 0) return false;
  for (const void* p : ptrs)
    if (!aligned_to(p, 16)) return false;
  return true;
}

}  // namespace
}  // namespace cuda

void CudaBackend::moe_router_forward(float* probs, float* lse, int32_t* topk_idx, float* topk_prob,
                                     const float* logits, int64_t N, int64_t E, int64_t K, MoeScore score,
                                     const float* select_bias) {
  TETRA_CHECK(K >= 1 && K <= E, "moe_router_forward: top-k {} of {} experts", K, E);
  TETRA_CHECK(N >= 0, "moe_router_forward: N ({}) must be >= 0", N);
  if (N == 0) return;
  const int64_t blocks = (N + cuda::kRouterWarps - 1) / cuda::kRouterWarps;
  TETRA_CHECK(blocks <= 0x7fffffff, "moe_router_forward: N ({}) too large", N);
  cuda::router_forward_kernel<<<static_cast<unsigned>(blocks), cuda::kRouterWarps * 32, 0,
                                cuda::as_stream(stream_)>>>(probs, lse, topk_idx, topk_prob,
                                                            logits, N, E, K, score == MoeScore::SIGMOID,
                                                            select_bias);
  TETRA_CUDA_LAUNCHED();
}

void CudaBackend::moe_router_backward(float* dlogits, const float* probs, const float* lse,
                                      const int32_t* topk_idx, const float* dtopk_prob,
                                      const float* expert_grad, float z_scale, int64_t N,
                                      int64_t E, int64_t K, MoeScore score) {
  TETRA_CHECK(N >= 0 && E >= 1 && K >= 0, "moe_router_backward: N {} E {} K {}", N, E, K);
  TETRA_CHECK(score != MoeScore::SIGMOID || z_scale == 0.0f,
              "moe_router_backward: a z-loss ({}) with sigmoid scores", z_scale);
  if (N == 0) return;
  const int64_t blocks = (N + cuda::kRouterWarps - 1) / cuda::kRouterWarps;
  TETRA_CHECK(blocks <= 0x7fffffff, "moe_router_backward: N ({}) too large", N);
  cuda::router_backward_kernel<<<static_cast<unsigned>(blocks), cuda::kRouterWarps * 32, 0,
                                 cuda::as_stream(stream_)>>>(dlogits, probs, lse, topk_idx,
                                                             dtopk_prob, expert_grad, z_scale, N,
                                                             E, K, score == MoeScore::SIGMOID);
  TETRA_CUDA_LAUNCHED();
}

void CudaBackend::moe_gates_forward(float* gates, const float* topk_prob, int64_t N, int64_t K, bool normalize,
                                    float scale) {
  TETRA_CHECK(N >= 0 && K >= 1, "moe_gates_forward: N {} K {}", N, K);
  if (N == 0) return;
  const int64_t blocks = (N + cuda::kRowThreads - 1) / cuda::kRowThreads;
  TETRA_CHECK(blocks <= 0x7fffffff, "moe_gates_forward: N ({}) too large", N);
  cuda::moe_gates_kernel<<<static_cast<unsigned>(blocks), cuda::kRowThreads, 0, cuda::as_stream(stream_)>>>(
      gates, topk_prob, N, K, normalize, scale);
  TETRA_CUDA_LAUNCHED();
}

void CudaBackend::moe_gates_backward(float* dtopk_prob, const float* dgates, const float* topk_prob, int64_t N,
                                     int64_t K, bool normalize, float scale) {
  TETRA_CHECK(N >= 0 && K >= 1, "moe_gates_backward: N {} K {}", N, K);
  if (N == 0) return;
  const int64_t blocks = (N + cuda::kRowThreads - 1) / cuda::kRowThreads;
  TETRA_CHECK(blocks <= 0x7fffffff, "moe_gates_backward: N ({}) too large", N);
  cuda::moe_gates_backward_kernel<<<static_cast<unsigned>(blocks), cuda::kRowThreads, 0,
                                    cuda::as_stream(stream_)>>>(dtopk_prob, dgates, topk_prob, N, K, normalize, scale);
  TETRA_CUDA_LAUNCHED();
}

void CudaBackend::moe_gather_rows(void* dst, const void* src, const int32_t* rows, int64_t M,
                                  int64_t C, DType act) {
  TETRA_CHECK(M >= 0 && C >= 0, "moe_gather_rows: M ({}) and C ({}) must be >= 0", M, C);
  TETRA_CHECK(act == DType::F32 || act == DType::BF16 || act == DType::F16,
              "moe_gather_rows: activation type must be F32, BF16 or F16, got {}", dtype_name(act));
  if (M == 0 || C == 0) return;
  TETRA_CHECK(M <= 0x7fffffff, "moe_gather_rows: M ({}) too large", M);
  const cudaStream_t stream = cuda::as_stream(stream_);
  const int64_t row_bytes = C * static_cast<int64_t>(dtype_size(act));
  auto fits = [&](int64_t word) {
    return row_bytes % word == 0 && cuda::aligned_to(dst, word) && cuda::aligned_to(src, word);
  };
  if (fits(16)) {
    cuda::launch_gather<uint4>(dst, src, rows, M, row_bytes, stream);
  } else if (fits(4)) {
    cuda::launch_gather<uint32_t>(dst, src, rows, M, row_bytes, stream);
  } else {
    cuda::launch_gather<uint16_t>(dst, src, rows, M, row_bytes, stream);
  }
}

void CudaBackend::moe_combine(void* out, const void* y, const int32_t* pos, const float* weights,
                              int64_t N, int64_t K, int64_t C, bool accumulate, DType act) {
  TETRA_CHECK(N >= 0 && K >= 0 && C >= 0, "moe_combine: N {} K {} C {}", N, K, C);
  if (N == 0 || C == 0) return;
  TETRA_CHECK(N <= 0x7fffffff, "moe_combine: N ({}) too large", N);
  const cudaStream_t stream = cuda::as_stream(stream_);
  cuda::with_float_type(act, "moe_combine", "activation type", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = cuda::kVec16<T>;
    T* o = static_cast<T*>(out);
    const T* yy = static_cast<const T*>(y);
    if (cuda::rows_vectorisable<T>(C, {o, yy})) {
      cuda::combine_kernel<T, kVec><<<static_cast<unsigned>(N), cuda::kRowThreads, 0, stream>>>(
          o, yy, pos, weights, K, C, accumulate);
    } else {
      cuda::combine_kernel<T, 1><<<static_cast<unsigned>(N), cuda::kRowThreads, 0, stream>>>(
          o, yy, pos, weights, K, C, accumulate);
    }
    TETRA_CUDA_LAUNCHED();
  });
}

void CudaBackend::moe_combine_backward(void* dy, float* dweights, const void* dout, const void* y,
                                       const int32_t* pos, const float* weights, int64_t N,
                                       int64_t K, int64_t C, DType act) {
  TETRA_CHECK(N >= 0 && K >= 0 && C >= 0, "moe_combine_backward: N {} K {} C {}", N, K, C);
  if (N == 0 || K == 0) return;
  TETRA_CHECK(N * K <= 0x7fffffff, "moe_combine_backward: N*K ({}) too large", N * K);
  const cudaStream_t stream = cuda::as_stream(stream_);
  cuda::with_float_type(act, "moe_combine_backward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = cuda::kVec16<T>;
    T* d_y = static_cast<T*>(dy);
    const T* d_out = static_cast<const T*>(dout);
    const T* yy = static_cast<const T*>(y);
    const unsigned blocks = static_cast<unsigned>(N * K);
    if (cuda::rows_vectorisable<T>(C, {d_y, d_out, yy})) {
      cuda::combine_backward_kernel<T, kVec><<<blocks, cuda::kRowThreads, 0, stream>>>(
          d_y, dweights, d_out, yy, pos, weights, K, C);
    } else {
      cuda::combine_backward_kernel<T, 1><<<blocks, cuda::kRowThreads, 0, stream>>>(
          d_y, dweights, d_out, yy, pos, weights, K, C);
    }
    TETRA_CUDA_LAUNCHED();
  });
}

void CudaBackend::moe_shared_gate_forward(void* out, float* gate, const float* logits, const void* y, int64_t N,
                                          int64_t C, DType act) {
  TETRA_CHECK(N >= 0 && C >= 0, "moe_shared_gate_forward: N {} C {}", N, C);
  if (N == 0) return;
  TETRA_CHECK(N <= 0x7fffffff, "moe_shared_gate_forward: N ({}) too large", N);
  const cudaStream_t stream = cuda::as_stream(stream_);
  cuda::with_float_type(act, "moe_shared_gate_forward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = cuda::kVec16<T>;
    T* o = static_cast<T*>(out);
    const T* yy = static_cast<const T*>(y);
    if (cuda::rows_vectorisable<T>(C, {o, yy})) {
      cuda::shared_gate_kernel<T, kVec><<<static_cast<unsigned>(N), cuda::kRowThreads, 0, stream>>>(o, gate, logits,
                                                                                                    yy, C);
    } else {
      cuda::shared_gate_kernel<T, 1><<<static_cast<unsigned>(N), cuda::kRowThreads, 0, stream>>>(o, gate, logits, yy,
                                                                                                 C);
    }
    TETRA_CUDA_LAUNCHED();
  });
}

void CudaBackend::moe_shared_gate_backward(void* dy, float* dlogits, const void* dout, const void* y,
                                           const float* gate, int64_t N, int64_t C, DType act) {
  TETRA_CHECK(N >= 0 && C >= 0, "moe_shared_gate_backward: N {} C {}", N, C);
  if (N == 0) return;
  TETRA_CHECK(N <= 0x7fffffff, "moe_shared_gate_backward: N ({}) too large", N);
  const cudaStream_t stream = cuda::as_stream(stream_);
  cuda::with_float_type(act, "moe_shared_gate_backward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    constexpr int kVec = cuda::kVec16<T>;
    T* d_y = static_cast<T*>(dy);
    const T* d_out = static_cast<const T*>(dout);
    const T* yy = static_cast<const T*>(y);
    if (cuda::rows_vectorisable<T>(C, {d_y, d_out, yy})) {
      cuda::shared_gate_backward_kernel<T, kVec><<<static_cast<unsigned>(N), cuda::kRowThreads, 0, stream>>>(
          d_y, dlogits, d_out, yy, gate, C);
    } else {
      cuda::shared_gate_backward_kernel<T, 1><<<static_cast<unsigned>(N), cuda::kRowThreads, 0, stream>>>(
          d_y, dlogits, d_out, yy, gate, C);
    }
    TETRA_CUDA_LAUNCHED();
  });
}

}  // namespace tetra
