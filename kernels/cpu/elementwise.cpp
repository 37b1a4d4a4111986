// Element-wise ops on the CPU: residual add, GELU and SwiGLU (forward and backward), dtype casts,
// and the bias gradient (a column sum).
//
// Activations are stored as float, bf16 or fp16 (template T); math is fp32 through the shared scalar
// functions of kernels/common/math.h, so the CUDA kernels compute the same values. Loops are
// flat over n elements (or rows of the SwiGLU halves) and OpenMP-parallel with a static schedule.
// bias_backward is deterministic: each column's sum runs over the rows in order, inside one
// thread, whatever the number of threads.
#include <omp.h>

#include <algorithm>
#include <cstring>

#include "kernels/common/math.h"
#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/common/check.h"

namespace tetra {
namespace {

using cpu::team_size;
using cpu::with_float_type;

template <typename T>
void add_impl(T* out, const T* a, const T* b, int64_t n, int nt) {
#pragma omp parallel for simd num_threads(nt) schedule(static)
  for (int64_t i = 0; i < n; ++i) out[i] = from_f32<T>(to_f32(a[i]) + to_f32(b[i]));
}

template <typename T>
void gelu_forward_impl(T* y, const T* x, int64_t n, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < n; ++i) y[i] = from_f32<T>(math::gelu(to_f32(x[i])));
}

template <typename T>
void gelu_backward_impl(T* dx, const T* x, const T* dy, int64_t n, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < n; ++i)
    dx[i] = from_f32<T>(math::gelu_grad(to_f32(x[i])) * to_f32(dy[i]));
}

// x (N, 2F) = [gate | up] per row; y (N, F) = silu(gate) * up.
template <typename T>
void swiglu_forward_impl(T* y, const T* x, int64_t N, int64_t F, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const T* gate = x + i * 2 * F;
    const T* up = gate + F;
    T* yr = y + i * F;
    for (int64_t j = 0; j < F; ++j)
      yr[j] = from_f32<T>(math::silu(to_f32(gate[j])) * to_f32(up[j]));
  }
}

// dgate = dy * up * silu'(gate), dup = dy * silu(gate); dx (N, 2F) = [dgate | dup].
template <typename T>
void swiglu_backward_impl(T* dx, const T* x, const T* dy, int64_t N, int64_t F, int nt) {
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t i = 0; i < N; ++i) {
    const T* gate = x + i * 2 * F;
    const T* up = gate + F;
    const T* dyr = dy + i * F;
    T* dgate = dx + i * 2 * F;
    T* dup = dgate + F;
    for (int64_t j = 0; j < F; ++j) {
      float g = to_f32(gate[j]), u = to_f32(up[j]), d = to_f32(dyr[j]);
      dgate[j] = from_f32<T>(d * u * math::silu_grad(g));
      dup[j] = from_f32<T>(d * math::silu(g));
    }
  }
}

template <typename D, typename S>
void convert_impl(D* dst, const S* src, int64_t n, int nt) {
#pragma omp parallel for simd num_threads(nt) schedule(static)
  for (int64_t i = 0; i < n; ++i) dst[i] = from_f32<D>(to_f32(src[i]));
}

// dbias (OC) += column sums of dout (N, OC). Columns are split into tiles of kTile; one thread owns
// a tile and walks all rows in order, summing into a register/stack tile, then adds it once.
template <typename T>
void bias_backward_impl(float* dbias, const T* dout, int64_t N, int64_t OC, int nt) {
  constexpr int64_t kTile = 128;
  const int64_t tiles = math::ceil_div(OC, kTile);
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int64_t tile = 0; tile < tiles; ++tile) {
    const int64_t j0 = tile * kTile;
    const int64_t width = std::min(kTile, OC - j0);
    float acc[kTile] = {};
    for (int64_t i = 0; i < N; ++i) {
      const T* row = dout + i * OC + j0;
#pragma omp simd
      for (int64_t j = 0; j < width; ++j) acc[j] += to_f32(row[j]);
    }
    for (int64_t j = 0; j < width; ++j) dbias[j0 + j] += acc[j];
  }
}

}  // namespace

void CpuBackend::add(void* out, const void* a, const void* b, int64_t n, DType act) {
  const int nt = team_size(threads_);
  with_float_type(act, "add", "activation type", [&](auto tag) {
    using T = decltype(tag);
    add_impl<T>(static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), n, nt);
  });
}

void CpuBackend::gelu_forward(void* y, const void* x, int64_t n, DType act) {
  const int nt = team_size(threads_);
  with_float_type(act, "gelu_forward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    gelu_forward_impl<T>(static_cast<T*>(y), static_cast<const T*>(x), n, nt);
  });
}

void CpuBackend::gelu_backward(void* dx, const void* x, const void* dy, int64_t n, DType act) {
  const int nt = team_size(threads_);
  with_float_type(act, "gelu_backward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    gelu_backward_impl<T>(static_cast<T*>(dx), static_cast<const T*>(x),
                          static_cast<const T*>(dy), n, nt);
  });
}

void CpuBackend::swiglu_forward(void* y, const void* x, int64_t N, int64_t F, DType act) {
  const int nt = team_size(threads_);
  with_float_type(act, "swiglu_forward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    swiglu_forward_impl<T>(static_cast<T*>(y), static_cast<const T*>(x), N, F, nt);
  });
}

void CpuBackend::swiglu_backward(void* dx, const void* x, const void* dy, int64_t N, int64_t F,
                                 DType act) {
  const int nt = team_size(threads_);
  with_float_type(act, "swiglu_backward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    swiglu_backward_impl<T>(static_cast<T*>(dx), static_cast<const T*>(x),
                            static_cast<const T*>(dy), N, F, nt);
  });
}

void CpuBackend::cast(void* dst, DType dst_type, const void* src, DType src_type, int64_t n) {
  TETRA_CHECK(n >= 0, "cast: n ({}) must be >= 0", n);
  if (dst_type == src_type) {
    if (dst != src) std::memmove(dst, src, static_cast<size_t>(n) * dtype_size(dst_type));
    return;
  }
  const int nt = team_size(threads_);
  // Any pair of floating types; between the two 16-bit types the value passes through fp32
  // (exact), so bf16 <-> fp16 rounds once.
  with_float_type(dst_type, "cast", "destination type", [&](auto dtag) {
    with_float_type(src_type, "cast", "source type", [&](auto stag) {
      using D = decltype(dtag);
      using S = decltype(stag);
      convert_impl(static_cast<D*>(dst), static_cast<const S*>(src), n, nt);
    });
  });
}

void CpuBackend::bias_backward(float* dbias, const void* dout, int64_t N, int64_t OC, DType act) {
  TETRA_CHECK(N >= 0 && OC >= 0, "bias_backward: N ({}) and OC ({}) must be >= 0", N, OC);
  const int nt = team_size(threads_);
  with_float_type(act, "bias_backward", "activation type", [&](auto tag) {
    using T = decltype(tag);
    bias_backward_impl<T>(dbias, static_cast<const T*>(dout), N, OC, nt);
  });
}

}  // namespace tetra
