// CudaBackend's blocks of attention for context parallelism (Backend::attention_block_forward /
// _backward, contracts in kernels/backend.h): plain kernels, one thread per query row (forward,
// dq) or per key row (dk, dv), fp32 math, no atomics (each output row has one writer, and every
// sum runs in a fixed order). They are the reference-quality path that makes ring attention run
// on the GPU; the tensor-core flash kernels do not take strided blocks yet.
//
// Forward: per query, an online softmax over the visible keys, then the merge into the running
// (o, lse):  lse = log(exp(lse_old) + exp(lse_b)), o = o_old exp(lse_old - lse) + o_b exp(lse_b - lse).
// Backward, with the finished lse and D_i = dout_i . out_i:
//   p_ij = exp(s_ij - lse_i), ds_ij = p_ij (dout_i . v_j - D_i),
//   dq_i += scale sum_j ds_ij k_j,  dk_j += scale sum_i ds_ij q_i,  dv_j += sum_i p_ij dout_i.

#include <cuda_runtime.h>

#include <cmath>

#include "kernels/common/check.h"
#include "kernels/cuda/common.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tetra {
namespace {

constexpr int kMaxHS = 256;
constexpr int kThreads = 128;

struct View {
  const void* p;
  int64_t row, seq;
};
__device__ __forceinline__ int64_t at(const View& v, int64_t b, int64_t t, int64_t h, int HS) {
  return b * v.seq + t * v.row + h * HS;
}

struct Shape {
  int64_t B, Tq, Tk;
  int NH, NKV, HS, G;
  bool causal;
  float scale;
  int64_t lse_ld;
};

// The keys query i sees: [0, Tk), or [0, i] in a causal block.
__device__ __forceinline__ int64_t keys_of(const Shape& s, int64_t i) { return s.causal ? i + 1 : s.Tk; }

template <typename T>
__global__ void __launch_bounds__(kThreads)
    block_forward_kernel(Shape s, View q, View k, View v, View o, float* lse, bool first) {
  const int64_t n = s.B * s.NH * s.Tq;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % s.Tq, bh = idx / s.Tq;
    const int h = static_cast<int>(bh % s.NH);
    const int64_t b = bh / s.NH;
    const int kvh = h / s.G;
    const T* qp = static_cast<const T*>(q.p) + at(q, b, i, h, s.HS);
    float qr[kMaxHS], acc[kMaxHS];
    for (int x = 0; x < s.HS; ++x) {
      qr[x] = cuda::ld(qp + x) * s.scale;
      acc[x] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    const int64_t nk = keys_of(s, i);
    for (int64_t j = 0; j < nk; ++j) {
      const T* kp = static_cast<const T*>(k.p) + at(k, b, j, kvh, s.HS);
      const T* vp = static_cast<const T*>(v.p) + at(v, b, j, kvh, s.HS);
      float sc = 0.0f;
      for (int x = 0; x < s.HS; ++x) sc += qr[x] * cuda::ld(kp + x);
      const float mn = fmaxf(m, sc);
      const float corr = expf(m - mn), pj = expf(sc - mn);
      l = l * corr + pj;
      for (int x = 0; x < s.HS; ++x) acc[x] = acc[x] * corr + pj * cuda::ld(vp + x);
      m = mn;
    }
    float* op = static_cast<float*>(const_cast<void*>(o.p)) + at(o, b, i, h, s.HS);
    float* lp = lse + bh * s.lse_ld + i;
    if (l == 0.0f) {  // no visible key: the block adds nothing
      if (first) {
        for (int x = 0; x < s.HS; ++x) op[x] = 0.0f;
        *lp = -INFINITY;
      }
      continue;
    }
    const float lse_b = m + logf(l);
    const float old = first ? -INFINITY : *lp;
    if (old == -INFINITY) {
      for (int x = 0; x < s.HS; ++x) op[x] = acc[x] / l;
      *lp = lse_b;
      continue;
    }
    const float mx = fmaxf(old, lse_b);
    const float merged = mx + logf(expf(old - mx) + expf(lse_b - mx));
    const float w_old = expf(old - merged), w_new = expf(lse_b - merged) / l;
    for (int x = 0; x < s.HS; ++x) op[x] = op[x] * w_old + acc[x] * w_new;
    *lp = merged;
  }
}

template <typename T>
__device__ float dot_rows(const T* a, const T* b, int HS) {
  float acc = 0.0f;
  for (int x = 0; x < HS; ++x) acc += cuda::ld(a + x) * cuda::ld(b + x);
  return acc;
}

// dq: one thread per (b, h, i).
template <typename T>
__global__ void __launch_bounds__(kThreads)
    block_dq_kernel(Shape s, View q, View k, View v, View dout, View out, const float* lse, View dq) {
  const int64_t n = s.B * s.NH * s.Tq;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = idx % s.Tq, bh = idx / s.Tq;
    const int h = static_cast<int>(bh % s.NH);
    const int64_t b = bh / s.NH;
    const int kvh = h / s.G;
    const T* qp = static_cast<const T*>(q.p) + at(q, b, i, h, s.HS);
    const T* dop = static_cast<const T*>(dout.p) + at(dout, b, i, h, s.HS);
    const float D = dot_rows(dop, static_cast<const T*>(out.p) + at(out, b, i, h, s.HS), s.HS);
    const float li = lse[bh * s.lse_ld + i];
    float acc[kMaxHS];
    for (int x = 0; x < s.HS; ++x) acc[x] = 0.0f;
    const int64_t nk = keys_of(s, i);
    for (int64_t j = 0; j < nk; ++j) {
      const T* kp = static_cast<const T*>(k.p) + at(k, b, j, kvh, s.HS);
      const T* vp = static_cast<const T*>(v.p) + at(v, b, j, kvh, s.HS);
      const float p = expf(dot_rows(qp, kp, s.HS) * s.scale - li);
      const float ds = p * (dot_rows(dop, vp, s.HS) - D);
      for (int x = 0; x < s.HS; ++x) acc[x] += ds * cuda::ld(kp + x);
    }
    float* d = static_cast<float*>(const_cast<void*>(dq.p)) + at(dq, b, i, h, s.HS);
    for (int x = 0; x < s.HS; ++x) d[x] += acc[x] * s.scale;
  }
}

// dk, dv: one thread per (b, kv head, j), over the G query heads and the queries that see key j.
template <typename T>
__global__ void __launch_bounds__(kThreads)
    block_dkv_kernel(Shape s, View q, View k, View v, View dout, View out, const float* lse, View dk, View dv) {
  const int64_t n = s.B * s.NKV * s.Tk;
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < n;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t j = idx % s.Tk, bk = idx / s.Tk;
    const int kvh = static_cast<int>(bk % s.NKV);
    const int64_t b = bk / s.NKV;
    const T* kp = static_cast<const T*>(k.p) + at(k, b, j, kvh, s.HS);
    const T* vp = static_cast<const T*>(v.p) + at(v, b, j, kvh, s.HS);
    float ak[kMaxHS], av[kMaxHS];
    for (int x = 0; x < s.HS; ++x) ak[x] = av[x] = 0.0f;
    for (int g = 0; g < s.G; ++g) {
      const int h = kvh * s.G + g;
      for (int64_t i = s.causal ? j : 0; i < s.Tq; ++i) {
        const T* qp = static_cast<const T*>(q.p) + at(q, b, i, h, s.HS);
        const T* dop = static_cast<const T*>(dout.p) + at(dout, b, i, h, s.HS);
        const float D = dot_rows(dop, static_cast<const T*>(out.p) + at(out, b, i, h, s.HS), s.HS);
        const float p = expf(dot_rows(qp, kp, s.HS) * s.scale - lse[(b * s.NH + h) * s.lse_ld + i]);
        const float ds = p * (dot_rows(dop, vp, s.HS) - D);
        for (int x = 0; x < s.HS; ++x) {
          ak[x] += ds * cuda::ld(qp + x);
          av[x] += p * cuda::ld(dop + x);
        }
      }
    }
    float* dkp = static_cast<float*>(const_cast<void*>(dk.p)) + at(dk, b, j, kvh, s.HS);
    float* dvp = static_cast<float*>(const_cast<void*>(dv.p)) + at(dv, b, j, kvh, s.HS);
    for (int x = 0; x < s.HS; ++x) {
      dkp[x] += ak[x] * s.scale;
      dvp[x] += av[x];
    }
  }
}

Shape shape_of(const AttnBlock& b, const char* op) {
  TETRA_CHECK(b.B > 0 && b.Tq > 0 && b.Tk > 0 && b.NH > 0 && b.NKV > 0 && b.HS > 0,
              "{}: sizes must be positive, got B={} Tq={} Tk={} NH={} NKV={} HS={}", op, b.B, b.Tq, b.Tk, b.NH, b.NKV,
              b.HS);
  TETRA_CHECK(b.NH % b.NKV == 0, "{}: NH ({}) must be a multiple of NKV ({})", op, b.NH, b.NKV);
  TETRA_CHECK(b.HS <= kMaxHS, "{}: head size {} above the {} supported", op, b.HS, kMaxHS);
  TETRA_CHECK(!b.causal || b.Tq == b.Tk, "{}: a causal block needs Tq == Tk, got {} and {}", op, b.Tq, b.Tk);
  TETRA_CHECK(b.lse && b.lse_ld >= b.Tq, "{}: lse needs a leading dimension of at least Tq ({}), got {}", op, b.Tq,
              b.lse_ld);
  return Shape{b.B, b.Tq, b.Tk, static_cast<int>(b.NH), static_cast<int>(b.NKV), static_cast<int>(b.HS),
               static_cast<int>(b.NH / b.NKV), b.causal, 1.0f / std::sqrt(static_cast<float>(b.HS)), b.lse_ld};
}

View view(const AttnView& v) { return View{v.p, v.row, v.seq}; }

}  // namespace

void CudaBackend::attention_block_forward(const AttnBlock& blk, AttnView o, bool first, DType act) {
  const Shape s = shape_of(blk, "attention_block_forward");
  const cudaStream_t stream = cuda::as_stream(this->stream());
  const int64_t n = s.B * s.NH * s.Tq;
  cuda::with_float_type(act, "attention_block_forward", "activation type", [&](auto tag) {
    using S = decltype(tag);
    block_forward_kernel<S><<<cuda::grid_for(n, kThreads), kThreads, 0, stream>>>(
        s, view(blk.q), view(blk.k), view(blk.v), view(o), blk.lse, first);
    TETRA_CUDA_LAUNCHED();
  });
}

void CudaBackend::attention_block_backward(const AttnBlock& blk, AttnView dout, AttnView out, AttnView dq,
                                           AttnView dk, AttnView dv, DType act) {
  const Shape s = shape_of(blk, "attention_block_backward");
  const cudaStream_t stream = cuda::as_stream(this->stream());
  cuda::with_float_type(act, "attention_block_backward", "activation type", [&](auto tag) {
    using S = decltype(tag);
    const int64_t nq = s.B * s.NH * s.Tq, nk = s.B * s.NKV * s.Tk;
    block_dq_kernel<S><<<cuda::grid_for(nq, kThreads), kThreads, 0, stream>>>(
        s, view(blk.q), view(blk.k), view(blk.v), view(dout), view(out), blk.lse, view(dq));
    TETRA_CUDA_LAUNCHED();
    block_dkv_kernel<S><<<cuda::grid_for(nk, kThreads), kThreads, 0, stream>>>(
        s, view(blk.q), view(blk.k), view(blk.v), view(dout), view(out), blk.lse, view(dk), view(dv));
    TETRA_CUDA_LAUNCHED();
  });
}

}  // namespace tetra
