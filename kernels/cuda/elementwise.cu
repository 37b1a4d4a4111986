// Element-wise ops on the GPU: residual add, GELU and SwiGLU, forward and backward.
//
// All of them are memory-bound, so each thread moves 16 bytes per access (kVec<T> elements,
// vec.cuh) wherever the pointers allow: the flat ops (add, GELU) peel a scalar head up to the
// first 16-byte boundary when all their pointers share the same misalignment, and fall back to
// scalar accesses only when they do not; SwiGLU (rows of [gate | up]) is vectorised when F is a
// multiple of the vector width and its pointers are 16-byte aligned. The math is fp32 through
// the shared scalar functions of kernels/common/math.h (the CPU backend calls the same ones), in
// the same expression order as kernels/cpu/elementwise.cpp, so the backends differ only where
// the compilers contract a*b+c into a fused multiply-add differently.
//
// Aliasing: each thread reads all its inputs of an element (or chunk) before it writes that
// element, and no thread touches another thread's elements, so `out` may alias `a` or `b` (add)
// and dx may alias dy or x (GELU backward) or x (SwiGLU backward, where dx and x have the same
// (N, 2F) layout).
#include <initializer_list>

#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"
#include "kernels/cuda/vec.cuh"

namespace tetra {
namespace {

using cuda::bf16_t;
using cuda::kVec;

constexpr int kThreads = 256;

// The flat element-wise functions: out = f(a) or f(a, b).
struct AddOp {
  static constexpr bool kBinary = true;
  __device__ float operator()(float a, float b) const { return a + b; }
};
struct GeluOp {
  static constexpr bool kBinary = false;
  __device__ float operator()(float x, float) const { return math::gelu(x); }
};
struct GeluGradOp {  // (x, dy) -> gelu'(x) dy
  static constexpr bool kBinary = true;
  __device__ float operator()(float x, float dy) const { return math::gelu_grad(x) * dy; }
};

// out[i] = op(a[i], b[i]) for i < n: elements [0, head) one by one, then chunks of K elements
// from `head` on (16-byte aligned there when K > 1), then the scalar tail. b is unused (may be
// null) for a unary op.
template <typename T, int K, typename Op>
__global__ void __launch_bounds__(kThreads)
    map_kernel(T* out, const T* a, const T* b, int64_t n, int64_t head, Op op) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t chunks = (n - head) / K;
  for (int64_t c = first; c < chunks; c += stride) {
    const int64_t i = head + c * K;
    float va[K], vb[K] = {}, vo[K];
    cuda::load_floats<K>(a + i, va);
    if constexpr (Op::kBinary) cuda::load_floats<K>(b + i, vb);
#pragma unroll
    for (int k = 0; k < K; ++k) vo[k] = op(va[k], vb[k]);
    cuda::store_floats<K>(out + i, vo);
  }
  // The head and the tail: fewer than 2 K elements, handled by the first threads.
  const int64_t tail = head + chunks * K;
  const int64_t rest = head + (n - tail);
  for (int64_t e = first; e < rest; e += stride) {
    const int64_t i = e < head ? e : tail + (e - head);
    out[i] = cuda::from_float<T>(op(cuda::ld(a + i), Op::kBinary ? cuda::ld(b + i) : 0.0f));
  }
}

// Launches map_kernel vectorised when out, a (and b) have the same offset from a 16-byte
// boundary (after a scalar head they are all aligned), else scalar.
template <typename T, typename Op>
void launch_map(T* out, const T* a, const T* b, int64_t n, Op op, cudaStream_t stream) {
  if (n <= 0) return;
  constexpr int K = kVec<T>;
  const auto misalign = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16; };
  const uintptr_t m = misalign(a);
  const bool vector =
      m % sizeof(T) == 0 && misalign(out) == m && (!Op::kBinary || misalign(b) == m);
  if (vector) {
    int64_t head = m == 0 ? 0 : static_cast<int64_t>((16 - m) / sizeof(T));
    if (head > n) head = n;
    map_kernel<T, K, Op><<<cuda::grid_for((n - head) / K + 1, kThreads), kThreads, 0, stream>>>(
        out, a, b, n, head, op);
  } else {
    map_kernel<T, 1, Op><<<cuda::grid_for(n, kThreads), kThreads, 0, stream>>>(out, a, b, n, 0, op);
  }
  TETRA_CUDA_LAUNCHED();
}

// x (N, 2F) = [gate | up] per row, y (N, F) = silu(gate) * up. Chunk c of K elements covers row
// c / (F / K), columns (c % (F / K)) K onwards.
template <typename T, int K>
__global__ void __launch_bounds__(kThreads)
    swiglu_forward_kernel(T* y, const T* x, int64_t N, int64_t F) {
  const int64_t per_row = F / K;
  const int64_t chunks = N * per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks;
       c += stride) {
    const int64_t i = c / per_row, j = (c - i * per_row) * K;
    const T* gate = x + i * 2 * F + j;
    float g[K], u[K], out[K];
    cuda::load_floats<K>(gate, g);
    cuda::load_floats<K>(gate + F, u);
#pragma unroll
    for (int k = 0; k < K; ++k) out[k] = math::silu(g[k]) * u[k];
    cuda::store_floats<K>(y + i * F + j, out);
  }
}

// dgate = dy * up * silu'(gate), dup = dy * silu(gate); dx (N, 2F) = [dgate | dup].
template <typename T, int K>
__global__ void __launch_bounds__(kThreads)
    swiglu_backward_kernel(T* dx, const T* x, const T* dy, int64_t N, int64_t F) {
  const int64_t per_row = F / K;
  const int64_t chunks = N * per_row;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t c = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; c < chunks;
       c += stride) {
    const int64_t i = c / per_row, j = (c - i * per_row) * K;
    const int64_t xo = i * 2 * F + j;
    float g[K], u[K], d[K], dg[K], du[K];
    cuda::load_floats<K>(x + xo, g);
    cuda::load_floats<K>(x + xo + F, u);
    cuda::load_floats<K>(dy + i * F + j, d);
#pragma unroll
    for (int k = 0; k < K; ++k) {
      dg[k] = d[k] * u[k] * math::silu_grad(g[k]);
      du[k] = d[k] * math::silu(g[k]);
    }
    cuda::store_floats<K>(dx + xo, dg);
    cuda::store_floats<K>(dx + xo + F, du);
  }
}

// Vector access for SwiGLU needs every row's halves on 16-byte boundaries: F a multiple of K and
// aligned base pointers.
template <typename T>
bool swiglu_vector(int64_t F, std::initializer_list<const void*> ptrs) {
  if (F % kVec<T> != 0) return false;
  for (const void* p : ptrs)
    if (!cuda::aligned16(p)) return false;
  return true;
}

void check_n(const char* op, int64_t n) { TETRA_CHECK(n >= 0, "{}: n ({}) must be >= 0", op, n); }
void check_nf(const char* op, int64_t N, int64_t F) {
  TETRA_CHECK(N >= 0 && F >= 0, "{}: N ({}) and F ({}) must be >= 0", op, N, F);
}

}  // namespace

void CudaBackend::add(void* out, const void* a, const void* b, int64_t n, DType act) {
  check_n("add", n);
  cuda::with_float_type(act, "add", "activation type", [&](auto tag) {
    using T = decltype(tag);
    launch_map(static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), n, AddOp{},
               cuda::as_stream(stream()));
  });
}

void CudaBackend::gelu_forward(void* y, const void* x, int64_t n, DType act) {
  check_n("gelu_forward", n);
  cuda::with_float_type(act, "gelu_forward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    launch_map(static_cast<T*>(y), static_cast<const T*>(x), static_cast<const T*>(nullptr), n,
               GeluOp{}, cuda::as_stream(stream()));
  });
}

void CudaBackend::gelu_backward(void* dx, const void* x, const void* dy, int64_t n, DType act) {
  check_n("gelu_backward", n);
  cuda::with_float_type(act, "gelu_backward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    launch_map(static_cast<T*>(dx), static_cast<const T*>(x), static_cast<const T*>(dy), n,
               GeluGradOp{}, cuda::as_stream(stream()));
  });
}

void CudaBackend::swiglu_forward(void* y, const void* x, int64_t N, int64_t F, DType act) {
  check_nf("swiglu_forward", N, F);
  if (N == 0 || F == 0) return;
  cuda::with_float_type(act, "swiglu_forward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    T* yt = static_cast<T*>(y);
    const T* xt = static_cast<const T*>(x);
    const cudaStream_t s = cuda::as_stream(stream());
    if (swiglu_vector<T>(F, {y, x})) {
      constexpr int K = kVec<T>;
      swiglu_forward_kernel<T, K>
          <<<cuda::grid_for(N * (F / K), kThreads), kThreads, 0, s>>>(yt, xt, N, F);
    } else {
      swiglu_forward_kernel<T, 1>
          <<<cuda::grid_for(N * F, kThreads), kThreads, 0, s>>>(yt, xt, N, F);
    }
    TETRA_CUDA_LAUNCHED();
  });
}

void CudaBackend::swiglu_backward(void* dx, const void* x, const void* dy, int64_t N, int64_t F,
                                  DType act) {
  check_nf("swiglu_backward", N, F);
  if (N == 0 || F == 0) return;
  cuda::with_float_type(act, "swiglu_backward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    T* dxt = static_cast<T*>(dx);
    const T* xt = static_cast<const T*>(x);
    const T* dyt = static_cast<const T*>(dy);
    const cudaStream_t s = cuda::as_stream(stream());
    if (swiglu_vector<T>(F, {dx, x, dy})) {
      constexpr int K = kVec<T>;
      swiglu_backward_kernel<T, K>
          <<<cuda::grid_for(N * (F / K), kThreads), kThreads, 0, s>>>(dxt, xt, dyt, N, F);
    } else {
      swiglu_backward_kernel<T, 1>
          <<<cuda::grid_for(N * F, kThreads), kThreads, 0, s>>>(dxt, xt, dyt, N, F);
    }
    TETRA_CUDA_LAUNCHED();
  });
}

}  // namespace tetra
