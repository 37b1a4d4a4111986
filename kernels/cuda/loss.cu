// Softmax cross-entropy on the GPU: the fused op (loss and, optionally, the logits' gradient,
// in place over the logits if the caller wishes) and the three passes of the vocab-parallel
// variant. Contracts in kernels/backend.h; the reference is kernels/cpu/loss.cpp, whose
// formulas these kernels follow, with the same exponential (math::exp_fast).
//
// The (N, V) logits are the largest tensor of a GPT step (V = 50257), so every kernel here is one
// block per row streaming the row with 16-byte loads: a scalar head up to the row's first 16-byte
// boundary (rows of an odd V start anywhere), 16-byte chunks, a scalar tail.
//
// The fused op reads each row twice and writes it once, never more: pass 1 keeps a running
// (max, sum of exp(l - max)) per thread, rescaling the sum when the max grows (online softmax),
// and combines the threads' pairs with block reductions into the row's max M and sum S, the loss
// (M - l[t]) + log(S); pass 2 (if dlogits) reads the row again (from L2, just read) and writes
// dloss_scale * (exp(l - M) / S - onehot(t)). Every thread reads an element before it writes the
// same element, and all of pass 1's reads finish (block barrier) before pass 2's first write, so
// dlogits may alias logits.
//
// The vocab-parallel passes: (1) row max over the slice; (2) sum of exp(l - M) with the global M
// and the target's logit if the slice holds it; (3) loss and gradient from the global M, S and
// target logit, as the fused pass 2.
//
// A target < 0 is an ignored row: loss 0 and a zero gradient row (the fused op skips pass 1). A
// target >= V in the fused op, a caller error that the CPU backend reports, gives a NaN loss and a
// zero gradient row here instead of a read out of bounds (the host cannot see targets without
// waiting for the GPU).
#include <cmath>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/vec.cuh"

namespace tetra {
namespace {

using cuda::kVec;

constexpr int kRowThreads = 512;

// Calls f(j, v) for every element of the row l[0, n), v a float[K] holding l[j, j + K): chunks of
// kVec<L> for the aligned middle of the row, single elements for its head and tail. The block's
// threads split the row.
template <typename L, typename F>
__device__ __forceinline__ void visit_row(const L* l, int64_t n, F&& f) {
  constexpr int K = kVec<L>;
  const cuda::RowSplit sp = cuda::split_row(l, n);
  const int64_t tail = sp.head + sp.chunks * K;
  for (int64_t e = threadIdx.x; e < sp.head + (n - tail); e += blockDim.x) {
    const int64_t j = e < sp.head ? e : tail + (e - sp.head);
    float v[1] = {cuda::ld(l + j)};
    f(j, v);
  }
  for (int64_t c = threadIdx.x; c < sp.chunks; c += blockDim.x) {
    const int64_t j = sp.head + c * K;
    float v[K];
    cuda::load_floats<K>(l + j, v);
    f(j, v);
  }
}

template <int K>
__device__ __forceinline__ float max_of(const float (&v)[K]) {
  float m = v[0];
#pragma unroll
  for (int k = 1; k < K; ++k) m = fmaxf(m, v[k]);  // fmaxf skips NaN, like the CPU's max
  return m;
}

// Writes g[j, j + K) = v, as one vector store if `vector` (the caller checked the alignment of
// a chunk of K elements of G at j), else element by element.
template <int K, typename G>
__device__ __forceinline__ void store_row_part(G* g, int64_t j, const float (&v)[K], bool vector) {
  if constexpr (K > 1) {
    if (vector) {
      cuda::store_floats<K>(g + j, v);
      return;
    }
  }
#pragma unroll
  for (int k = 0; k < K; ++k) cuda::st(g + j + k, v[k]);
}

// Whether the chunks of the row l (split at l's 16-byte boundaries) are aligned in g for stores
// of kVec<L> elements of G.
template <typename L, typename G>
__device__ __forceinline__ bool chunks_aligned(const G* g, const L* l, int64_t n) {
  constexpr int64_t kBytes = kVec<L> * static_cast<int64_t>(sizeof(G));
  const int64_t align = kBytes < 16 ? kBytes : 16;
  const int64_t head = cuda::split_row(l, n).head;
  return reinterpret_cast<uintptr_t>(g + head) % align == 0;
}

// Writes zeros over the row g[0, n) (an ignored row's gradient), split like visit_row.
template <typename G>
__device__ void zero_row(G* g, int64_t n) {
  constexpr int K = kVec<G>;
  const cuda::RowSplit sp = cuda::split_row(g, n);
  const int64_t tail = sp.head + sp.chunks * K;
  for (int64_t e = threadIdx.x; e < sp.head + (n - tail); e += blockDim.x)
    cuda::st(g + (e < sp.head ? e : tail + (e - sp.head)), 0.0f);
  const float zeros[K] = {};
  for (int64_t c = threadIdx.x; c < sp.chunks; c += blockDim.x)
    cuda::store_floats<K>(g + sp.head + c * K, zeros);
}

// g[j] = scale * (exp(l[j] - M) / S - [j == col]) over the row, k = scale / S (the CPU's
// e * k, and e_t * k - scale at the target). col < 0: no target in this row (slice).
template <typename L, typename G>
__device__ void write_gradient(G* g, const L* l, int64_t n, float M, float k, float scale,
                               int64_t col) {
  const bool vector = chunks_aligned(g, l, n);
  visit_row(l, n, [&](int64_t j, auto& v) {
    constexpr int K = sizeof(v) / sizeof(float);
    float out[K];
#pragma unroll
    for (int q = 0; q < K; ++q) {
      out[q] = math::exp_fast(v[q] - M) * k;
      if (j + q == col) out[q] -= scale;
    }
    store_row_part<K>(g, j, out, vector);
  });
}

// Fused cross-entropy, one block per row i: logits (N, V) of L, dlogits (N, V) of G or null.
template <typename L, typename G>
__global__ void __launch_bounds__(kRowThreads)
    cross_entropy_kernel(float* losses, G* dlogits, const L* logits, const int32_t* targets,
                         int64_t V, float scale) {
  __shared__ float shared[32];
  const int64_t i = blockIdx.x;
  const L* l = logits + i * V;
  G* g = dlogits ? dlogits + i * V : nullptr;
  const int32_t t = targets[i];
  if (t < 0 || t >= V) {  // uniform over the block
    if (threadIdx.x == 0) losses[i] = t < 0 ? 0.0f : NAN;
    if (g) zero_row(g, V);
    return;
  }
  const float lt = threadIdx.x == 0 ? cuda::ld(l + t) : 0.0f;  // before any gradient write

  // Pass 1: per-thread running max m and sum s of exp(l - m).
  float m = -INFINITY, s = 0.0f;
  visit_row(l, V, [&](int64_t, auto& v) {
    constexpr int K = sizeof(v) / sizeof(float);
    const float cm = max_of<K>(v);
    if (cm == -INFINITY) return;  // exp(-inf - M) = 0: nothing to add (and no -inf - -inf)
    if (cm > m) {
      s *= math::exp_fast(m - cm);
      m = cm;
    }
#pragma unroll
    for (int k = 0; k < K; ++k) s += math::exp_fast(v[k] - m);
  });
  const float M = cuda::block_max(m, shared);
  // A thread that saw no element has s = 0 (and m = -inf): it adds 0; a NaN stays NaN.
  const float S = cuda::block_sum(s == 0.0f ? 0.0f : s * math::exp_fast(m - M), shared);
  if (threadIdx.x == 0) losses[i] = (M - lt) + logf(S);  // no rounding of lse at the logits' size
  if (g) write_gradient(g, l, V, M, scale / S, scale, t);
}

// Vocab-parallel pass 1: row_max[i] = max of the slice's row i (N, Vl).
template <typename L>
__global__ void __launch_bounds__(kRowThreads)
    vocab_ce_max_kernel(float* row_max, const L* logits, int64_t Vl) {
  __shared__ float shared[32];
  const int64_t i = blockIdx.x;
  float m = -INFINITY;
  visit_row(logits + i * Vl, Vl, [&](int64_t, auto& v) {
    constexpr int K = sizeof(v) / sizeof(float);
    m = fmaxf(m, max_of<K>(v));
  });
  m = cuda::block_max(m, shared);
  if (threadIdx.x == 0) row_max[i] = m;
}

// Vocab-parallel pass 2: sumexp[i] = sum_j exp(l[i, j] - row_max[i]); target_logit[i] = the
// target's logit if this slice [v0, v0 + Vl) holds it, else 0.
template <typename L>
__global__ void __launch_bounds__(kRowThreads)
    vocab_ce_sums_kernel(float* sumexp, float* target_logit, const L* logits, const float* row_max,
                         const int32_t* targets, int64_t v0, int64_t Vl) {
  __shared__ float shared[32];
  const int64_t i = blockIdx.x;
  const L* l = logits + i * Vl;
  const float M = row_max[i];
  float s = 0.0f;
  visit_row(l, Vl, [&](int64_t, auto& v) {
    constexpr int K = sizeof(v) / sizeof(float);
#pragma unroll
    for (int k = 0; k < K; ++k) s += math::exp_fast(v[k] - M);
  });
  s = cuda::block_sum(s, shared);
  if (threadIdx.x == 0) {
    const int32_t t = targets[i];
    const int64_t c = static_cast<int64_t>(t) - v0;
    sumexp[i] = s;
    target_logit[i] = t >= 0 && c >= 0 && c < Vl ? cuda::ld(l + c) : 0.0f;
  }
}

// Vocab-parallel pass 3 without a gradient: losses only, one thread per row.
__global__ void __launch_bounds__(256)
    vocab_ce_losses_kernel(float* losses, const float* row_max, const float* sumexp,
                           const float* target_logit, const int32_t* targets, int64_t N) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < N; i += stride)
    losses[i] = targets[i] >= 0 ? (row_max[i] - target_logit[i]) + logf(sumexp[i]) : 0.0f;
}

// Vocab-parallel pass 3 with the gradient, one block per row: dlogits (N, Vl) of G.
template <typename L, typename G>
__global__ void __launch_bounds__(kRowThreads)
    vocab_ce_finish_kernel(float* losses, G* dlogits, const L* logits, const float* row_max,
                           const float* sumexp, const float* target_logit, const int32_t* targets,
                           int64_t v0, int64_t Vl, float scale) {
  const int64_t i = blockIdx.x;
  const int32_t t = targets[i];
  const float M = row_max[i], S = sumexp[i];
  if (threadIdx.x == 0) losses[i] = t >= 0 ? (M - target_logit[i]) + logf(S) : 0.0f;
  G* g = dlogits + i * Vl;
  if (t < 0) {
    zero_row(g, Vl);
    return;
  }
  const int64_t c = static_cast<int64_t>(t) - v0;
  write_gradient(g, logits + i * Vl, Vl, M, scale / S, scale, c >= 0 && c < Vl ? c : -1);
}

// One block per row: N is the grid's x dimension.
void check_rows(const char* op, int64_t N) {
  TETRA_CHECK(N < (int64_t{1} << 31), "{}: N ({}) must be < 2^31", op, N);
}

void check_alias(const char* op, const void* dlogits, DType dlogits_type, const void* logits,
                 DType logits_type) {
  TETRA_CHECK(dlogits != logits || dlogits_type == logits_type,
              "{}: dlogits ({}) may alias logits ({}) only when both types are equal", op,
              dtype_name(dlogits_type), dtype_name(logits_type));
}

}  // namespace

void CudaBackend::cross_entropy(float* losses, void* dlogits, DType dlogits_type,
                                const void* logits, DType logits_type, const int32_t* targets,
                                int64_t N, int64_t V, float dloss_scale) {
  TETRA_CHECK(N >= 0 && V > 0, "cross_entropy: N ({}) must be >= 0 and V ({}) > 0", N, V);
  TETRA_CHECK(V < (int64_t{1} << 31), "cross_entropy: V ({}) must be < 2^31", V);
  check_alias("cross_entropy", dlogits, dlogits_type, logits, logits_type);
  check_rows("cross_entropy", N);
  if (N == 0) return;
  const cudaStream_t stream = cuda::as_stream(this->stream());
  const unsigned rows = static_cast<unsigned>(N);
  cuda::with_float_type(logits_type, "cross_entropy", "logits type", [&](auto ltag) {
    using L = decltype(ltag);
    const L* l = static_cast<const L*>(logits);
    if (dlogits == nullptr) {
      cross_entropy_kernel<L, float>
          <<<rows, kRowThreads, 0, stream>>>(losses, nullptr, l, targets, V, dloss_scale);
    } else {
      cuda::with_float_type(dlogits_type, "cross_entropy", "dlogits type", [&](auto gtag) {
        using G = decltype(gtag);
        cross_entropy_kernel<L, G><<<rows, kRowThreads, 0, stream>>>(
            losses, static_cast<G*>(dlogits), l, targets, V, dloss_scale);
      });
    }
    TETRA_CUDA_LAUNCHED();
  });
}

void CudaBackend::vocab_ce_max(float* row_max, const void* logits, DType logits_type, int64_t N,
                               int64_t Vl) {
  TETRA_CHECK(N >= 0 && Vl > 0, "vocab_ce_max: N ({}) must be >= 0 and Vl ({}) > 0", N, Vl);
  check_rows("vocab_ce_max", N);
  if (N == 0) return;
  const cudaStream_t stream = cuda::as_stream(this->stream());
  cuda::with_float_type(logits_type, "vocab_ce_max", "logits type", [&](auto ltag) {
    using L = decltype(ltag);
    vocab_ce_max_kernel<L><<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(
        row_max, static_cast<const L*>(logits), Vl);
    TETRA_CUDA_LAUNCHED();
  });
}

void CudaBackend::vocab_ce_sums(float* sumexp, float* target_logit, const void* logits,
                                DType logits_type, const float* row_max, const int32_t* targets,
                                int64_t v0, int64_t N, int64_t Vl) {
  TETRA_CHECK(N >= 0 && Vl > 0 && v0 >= 0,
              "vocab_ce_sums: N ({}) must be >= 0, Vl ({}) > 0 and v0 ({}) >= 0", N, Vl, v0);
  check_rows("vocab_ce_sums", N);
  if (N == 0) return;
  const cudaStream_t stream = cuda::as_stream(this->stream());
  cuda::with_float_type(logits_type, "vocab_ce_sums", "logits type", [&](auto ltag) {
    using L = decltype(ltag);
    vocab_ce_sums_kernel<L><<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(
        sumexp, target_logit, static_cast<const L*>(logits), row_max, targets, v0, Vl);
    TETRA_CUDA_LAUNCHED();
  });
}

void CudaBackend::vocab_ce_finish(float* losses, void* dlogits, DType dlogits_type,
                                  const void* logits, DType logits_type, const float* row_max,
                                  const float* sumexp, const float* target_logit,
                                  const int32_t* targets, int64_t v0, int64_t N, int64_t Vl,
                                  float dloss_scale) {
  TETRA_CHECK(N >= 0 && Vl > 0 && v0 >= 0,
              "vocab_ce_finish: N ({}) must be >= 0, Vl ({}) > 0 and v0 ({}) >= 0", N, Vl, v0);
  check_alias("vocab_ce_finish", dlogits, dlogits_type, logits, logits_type);
  check_rows("vocab_ce_finish", N);
  if (N == 0) return;
  const cudaStream_t stream = cuda::as_stream(this->stream());
  if (dlogits == nullptr) {
    vocab_ce_losses_kernel<<<cuda::grid_for(N, 256), 256, 0, stream>>>(losses, row_max, sumexp,
                                                                       target_logit, targets, N);
    TETRA_CUDA_LAUNCHED();
    return;
  }
  cuda::with_float_type(logits_type, "vocab_ce_finish", "logits type", [&](auto ltag) {
    using L = decltype(ltag);
    cuda::with_float_type(dlogits_type, "vocab_ce_finish", "dlogits type", [&](auto gtag) {
      using G = decltype(gtag);
      vocab_ce_finish_kernel<L, G><<<static_cast<unsigned>(N), kRowThreads, 0, stream>>>(
          losses, static_cast<G*>(dlogits), static_cast<const L*>(logits), row_max, sumexp,
          target_logit, targets, v0, Vl, dloss_scale);
      TETRA_CUDA_LAUNCHED();
    });
  });
}

}  // namespace tetra
