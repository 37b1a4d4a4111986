// CudaBackend's RoPE and causal attention ops (contracts in kernels/backend.h), and the choice of
// attention path.
//
// Attention runs either through cuDNN's fused SDPA (attention_cudnn.cu: bf16 or fp16, HS a multiple
// of 8 up to 128, where cuDNN has a plan for the shape) or through Tetra's own flash kernels
// (attention_flash_bf16.cu: bf16 and fp16 on tensor cores, HS up to 128;
// attention_flash_generic.cu: every dtype and HS up to 256). The
// backend's AttentionPath (kernels/backend.h; the user's TETRA_ATTENTION) picks the path: AUTO (the
// default) takes cuDNN where it can and the fused kernels otherwise (where cuDNN has no plan for
// a shape, or its plan fails to execute; the first such reason is printed once, with cuDNN's own
// message), FUSED always the fused kernels, CUDNN always cuDNN (an Error naming the shape and
// cuDNN's reason where it has no plan or the plan does not run). Both paths produce the same lse
// (natural log-sum-exp of the scaled scores), so a forward on one path and a backward on the
// other agree.
// attention_path() reports the path of the last attention op.
//
// RoPE rotates the q and k heads in place with math::rope_rotate, the function the CPU backend
// uses; the inverse frequencies are computed on the host by math::rope_inv_freq (bit-identical to
// the CPU's table) and passed to the kernel by value, and the angle is float(t) * inv_freq as on
// the CPU.
#include <cstdio>
#include <type_traits>

#include "kernels/cuda/attention.cuh"
#include "kernels/cuda/cuda_backend.h"

namespace tetra {

void CudaAttentionStateDeleter::operator()(CudaAttentionState* s) const {
  if (s->d_rows) cudaFree(s->d_rows);
  delete s;
}

CudaAttentionState& CudaBackend::attention_state() {
  if (!attention_) attention_.reset(new CudaAttentionState);
  return *attention_;
}

std::string CudaBackend::attention_path() const {
  return attention_ ? attention_->last_path : "none";
}

std::string CudaBackend::attention_report() const {
  if (!attention_ || (attention_->forward_paths.empty() && attention_->backward_paths.empty())) return "";
  auto join = [](const std::set<std::string>& paths) {
    std::string out;
    for (const std::string& p : paths) out += (out.empty() ? "" : " and ") + p;
    return out.empty() ? std::string("not run") : out;
  };
  std::string r = fmt::format("attention forward {}, backward {}", join(attention_->forward_paths),
                              join(attention_->backward_paths));
  if (!attention_->fallback_reason.empty())
    r += fmt::format(" (cuDNN passed over for {})", attention_->fallback_reason);
  return r;
}

namespace cuda::attn {

void fused_forward(const Dims& d, DType act, void* out, float* lse, const void* qkv,
                   cudaStream_t stream) {
  with_float_type(act, "attention_forward", "act", [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, float>) {
      if (flash_mma_supports(d)) {
        flash_mma_forward<T>(d, static_cast<T*>(out), lse, static_cast<const T*>(qkv), stream);
        return;
      }
    }
    flash_generic_forward<T>(d, static_cast<T*>(out), lse, static_cast<const T*>(qkv), stream);
  });
}

void fused_backward(const Dims& d, DType act, void* dqkv, const void* dout, const void* qkv,
                    const void* out, const float* lse, float* d_rows, cudaStream_t stream) {
  with_float_type(act, "attention_backward", "act", [&](auto tag) {
    using T = decltype(tag);
    attention_row_dots<T>(d, d_rows, static_cast<const T*>(dout), static_cast<const T*>(out),
                          stream);
    if constexpr (!std::is_same_v<T, float>) {
      if (flash_mma_supports(d)) {
        flash_mma_backward<T>(d, static_cast<T*>(dqkv), static_cast<const T*>(dout),
                              static_cast<const T*>(qkv), lse, d_rows, stream);
        return;
      }
    }
    flash_generic_backward<T>(d, static_cast<T*>(dqkv), static_cast<const T*>(dout),
                              static_cast<const T*>(qkv), lse, d_rows, stream);
  });
}

}  // namespace cuda::attn

namespace {

using cuda::attn::Dims;

Dims attention_dims(int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, DType act,
                    const char* op) {
  TETRA_CHECK(act == DType::F32 || act == DType::BF16 || act == DType::F16,
              "{}: activation type must be F32, BF16 or F16, got {}", op, dtype_name(act));
  TETRA_CHECK(B > 0 && T > 0 && NH > 0 && NKV > 0 && HS > 0,
              "{}: sizes must be positive, got B={} T={} NH={} NKV={} HS={}", op, B, T, NH, NKV,
              HS);
  TETRA_CHECK(NH % NKV == 0, "{}: NH ({}) must be a multiple of NKV ({})", op, NH, NKV);
  return Dims{B, T, NH, NKV, HS};
}

std::string shape_text(const Dims& d, DType act) {
  return fmt::format("B={} T={} NH={} NKV={} HS={} {}", d.B, d.T, d.NH, d.NKV, d.HS,
                     dtype_name(act));
}

// The cuDNN state, created on first use; null (with the reason in st.cudnn_init_error) if cuDNN
// cannot be initialised.
cuda::attn::CudnnSdpa* cudnn_state(CudaAttentionState& st, cudaStream_t stream) {
  if (!st.cudnn_tried) {
    st.cudnn_tried = true;
    try {
      st.cudnn = cuda::attn::cudnn_sdpa_create(stream);
    } catch (const Error& e) {
      st.cudnn_init_error = e.what();
    }
  }
  return st.cudnn.get();
}

// Auto mode passes cuDNN over for this shape: the first time, the reason is kept for the kernel
// report; where cuDNN itself refused (the shape and type were ones it takes), it is also printed,
// once per backend, with cuDNN's own message, so a refusal is never silent.
void note_fallback(CudaAttentionState& st, const char* op, const Dims& d, DType act,
                   const std::string& why, bool cudnn_refused) {
  if (st.fallback_reason.empty()) st.fallback_reason = shape_text(d, act) + ": " + why;
  if (!cudnn_refused || st.refusal_printed) return;
  st.refusal_printed = true;
  std::fprintf(stderr, "tetra: %s: cuDNN SDPA refused %s: %s; the fused kernels run instead\n", op,
               shape_text(d, act).c_str(), why.c_str());
}

// The (B, NH, T) fp32 scratch of the backward (the fused kernels' D, cuDNN's softmax_sum), grown
// at the first sight of a larger shape (waiting for work that may still read the old buffer).
float* backward_rows(CudaAttentionState& st, const Dims& d, cudaStream_t stream) {
  const size_t need = static_cast<size_t>(d.B * d.NH * d.T);
  if (need > st.d_rows_floats) {
    TETRA_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (st.d_rows) TETRA_CUDA_CHECK(cudaFree(st.d_rows));
    st.d_rows = nullptr;
    st.d_rows_floats = 0;
    TETRA_CUDA_CHECK(cudaMalloc(&st.d_rows, need * sizeof(float)));
    st.d_rows_floats = need;
  }
  return st.d_rows;
}

// ---- RoPE ------------------------------------------------------------------------------------
constexpr int kMaxRopeHalf = 256;  // HS <= 512
struct RopeInvFreqs {
  float inv[kMaxRopeHalf];  // math::rope_inv_freq(i, HS, freqs)
};

// One thread per rotated pair (x[i], x[i + HS/2]) of a q or k head; sign = +1 forward, -1 the
// inverse rotation (backward).
template <typename T>
__global__ void rope_kernel(T* qkv, int64_t pairs, int T_, int heads, int half, int64_t row,
                            int HS, float sign, RopeInvFreqs f, const int32_t* positions) {
  for (int64_t idx = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; idx < pairs;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int i = static_cast<int>(idx % half);
    const int64_t rest = idx / half;
    const int hd = static_cast<int>(rest % heads);
    const int64_t bt = rest / heads;
    const int t = static_cast<int>(bt % T_);
    const float angle = static_cast<float>(positions ? positions[t] : t) * f.inv[i];
    float sn, cs;
    sincosf(angle, &sn, &cs);
    T* x = qkv + bt * row + static_cast<int64_t>(hd) * HS + i;
    float x0 = cuda::ld(x), x1 = cuda::ld(x + half);
    math::rope_rotate(x0, x1, cs, sign * sn);
    cuda::st(x, x0);
    cuda::st(x + half, x1);
  }
}

void rope(void* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV, int64_t HS, const math::RopeFreqs& freqs,
          DType act, float sign, cudaStream_t stream, const char* op, const int32_t* positions) {
  TETRA_CHECK(B > 0 && T > 0 && NH > 0 && NKV > 0 && HS > 0,
              "{}: sizes must be positive, got B={} T={} NH={} NKV={} HS={}", op, B, T, NH, NKV,
              HS);
  TETRA_CHECK(HS % 2 == 0, "{}: head size must be even, got HS={}", op, HS);
  TETRA_CHECK(HS / 2 <= kMaxRopeHalf, "{}: head size {} above the {} supported", op, HS,
              2 * kMaxRopeHalf);
  TETRA_CHECK(freqs.theta > 0.0f, "{}: theta must be positive, got {}", op, freqs.theta);
  TETRA_CHECK(freqs.factor > 0.0f && (freqs.kind != math::RopeFreqs::LLAMA3 ||
                                      (freqs.high_freq_factor > freqs.low_freq_factor && freqs.low_freq_factor > 0.0f &&
                                       freqs.original_max_position > 0.0f)),
              "{}: rope scaling factor {} (llama3: low_freq_factor {} < high_freq_factor {}, original length {})", op,
              freqs.factor, freqs.low_freq_factor, freqs.high_freq_factor, freqs.original_max_position);
  TETRA_CHECK(T <= (int64_t{1} << 30), "{}: T={} too large", op, T);
  RopeInvFreqs f{};
  const int half = static_cast<int>(HS / 2);
  for (int i = 0; i < half; ++i) f.inv[i] = math::rope_inv_freq(i, static_cast<int>(HS), freqs);
  const int64_t pairs = B * T * (NH + NKV) * half;
  cuda::with_float_type(act, op, "act", [&](auto tag) {
    using S = decltype(tag);
    rope_kernel<S><<<cuda::grid_for(pairs, 256), 256, 0, stream>>>(
        static_cast<S*>(qkv), pairs, static_cast<int>(T), static_cast<int>(NH + NKV), half,
        (NH + 2 * NKV) * HS, static_cast<int>(HS), sign, f, positions);
    TETRA_CUDA_LAUNCHED();
  });
}

}  // namespace

void CudaBackend::rope_forward(void* qkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                               int64_t HS, const math::RopeFreqs& freqs, DType act, const int32_t* positions) {
  rope(qkv, B, T, NH, NKV, HS, freqs, act, 1.0f, cuda::as_stream(stream()), "rope_forward", positions);
}

void CudaBackend::rope_backward(void* dqkv, int64_t B, int64_t T, int64_t NH, int64_t NKV,
                                int64_t HS, const math::RopeFreqs& freqs, DType act, const int32_t* positions) {
  rope(dqkv, B, T, NH, NKV, HS, freqs, act, -1.0f, cuda::as_stream(stream()), "rope_backward", positions);
}

// ---- attention -------------------------------------------------------------------------------
void CudaBackend::attention_forward(void* out, float* lse, const void* qkv, int64_t B, int64_t T,
                                    int64_t NH, int64_t NKV, int64_t HS, DType act) {
  const Dims d = attention_dims(B, T, NH, NKV, HS, act, "attention_forward");
  CudaAttentionState& st = attention_state();
  const cudaStream_t stream = cuda::as_stream(stream_);
  const AttentionPath mode = attention_path_;
  if (mode != AttentionPath::FUSED) {
    const std::string ineligible = cuda::attn::cudnn_sdpa_eligible(d, act);
    std::string why = ineligible;
    if (why.empty()) {
      cuda::attn::CudnnSdpa* sdpa = cudnn_state(st, stream);
      why = sdpa ? cuda::attn::cudnn_sdpa_forward(*sdpa, d, act, out, lse, qkv)
                 : st.cudnn_init_error;
    }
    if (why.empty()) {
      st.last_path = "cudnn";
      st.forward_paths.insert("cudnn");
      return;
    }
    if (mode == AttentionPath::CUDNN)
      throw Error(fmt::format("attention_forward: TETRA_ATTENTION=cudnn, but cuDNN has no SDPA "
                              "plan that runs for {}: {}",
                              shape_text(d, act), why));
    note_fallback(st, "attention_forward", d, act, why, ineligible.empty());
  }
  cuda::attn::fused_forward(d, act, out, lse, qkv, stream);
  st.last_path = "fused";
  st.forward_paths.insert("fused");
}

void CudaBackend::attention_backward(void* dqkv, const void* dout, const void* qkv,
                                     const void* out, const float* lse, int64_t B, int64_t T,
                                     int64_t NH, int64_t NKV, int64_t HS, DType act) {
  const Dims d = attention_dims(B, T, NH, NKV, HS, act, "attention_backward");
  CudaAttentionState& st = attention_state();
  const cudaStream_t stream = cuda::as_stream(stream_);
  const AttentionPath mode = attention_path_;
  float* rows = backward_rows(st, d, stream);
  if (mode != AttentionPath::FUSED) {
    const std::string ineligible = cuda::attn::cudnn_sdpa_eligible(d, act);
    std::string why = ineligible;
    if (why.empty()) {
      cuda::attn::CudnnSdpa* sdpa = cudnn_state(st, stream);
      why = sdpa ? cuda::attn::cudnn_sdpa_backward(*sdpa, d, act, dqkv, dout, qkv, out, lse, rows)
                 : st.cudnn_init_error;
    }
    if (why.empty()) {
      st.last_path = "cudnn";
      st.backward_paths.insert("cudnn");
      return;
    }
    if (mode == AttentionPath::CUDNN)
      throw Error(fmt::format("attention_backward: TETRA_ATTENTION=cudnn, but cuDNN has no SDPA "
                              "plan that runs for {}: {}",
                              shape_text(d, act), why));
    note_fallback(st, "attention_backward", d, act, why, ineligible.empty());
  }
  cuda::attn::fused_backward(d, act, dqkv, dout, qkv, out, lse, rows, stream);
  st.last_path = "fused";
  st.backward_paths.insert("fused");
}

}  // namespace tetra
