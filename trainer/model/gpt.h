// The decoder-only Transformer (GPT-2 and Llama styles are both configs of it), forward and
// backward written by hand against the Backend op interface.
//
// Per block (pre-norm):            shapes, N = B*T rows
//   h   = norm1(x)                 (N, C)
//   qkv = h W_qkv^T + b            (N, (NH + 2 NKV) HS)      RoPE on q, k if position == rope
//   a   = causal_attention(qkv)    (N, NH HS)
//   x   = x + a W_o^T + b          residual add fused into the GEMM (beta = 1)
//   h   = norm2(x)
//   u   = h W_fc^T + b             (N, F) gelu, or (N, 2F) = [gate | up] swiglu
//   g   = gelu(u) | silu(gate)*up  (N, F)
//   x   = x + g W_p^T + b
// then logits = norm_f(x) W_out^T (N, V) and a fused softmax-cross-entropy (fp32 math) that writes
// the logits' gradient in place while computing the loss, so the logits are written once.
//
// Every activation the backward pass needs is kept in one arena allocated at construction; the
// step loop allocates nothing. Parameter gradients accumulate (+=) into the fp32 gradient buffer,
// so micro-batches accumulate without extra passes and tied embeddings need no special case.
#pragma once

#include <cstdint>
#include <memory>

#include "kernels/backend.h"
#include "trainer/config/config.h"
#include "trainer/model/param_layout.h"

namespace tetra {

struct ModelDims {
  int64_t B, T, C, NH, NKV, HS, F, FC, V, L, QKV;  // FC = F (gelu) or 2F (swiglu); QKV = (NH+2NKV)HS
  int64_t N() const { return B * T; }
  static ModelDims from(const ModelConfig& m, int64_t micro_batch);
};

class Gpt {
 public:
  Gpt(const ModelConfig& cfg, const ParamLayout& layout, Backend& be, DType act, int64_t micro_batch);
  ~Gpt();
  Gpt(const Gpt&) = delete;
  Gpt& operator=(const Gpt&) = delete;

  // Bytes of activation memory this model holds (the arena).
  size_t activation_bytes() const { return arena_bytes_; }
  static size_t activation_bytes_for(const ModelConfig& cfg, DType act, int64_t micro_batch);

  // tokens, targets: (B, T) int32 in backend memory. weights: the compute copy (type act) of the
  // parameter buffer. Writes per-token losses (N) F32. If `dloss_scale` != 0 the logits' gradient
  // (scaled by it) is kept for backward().
  void forward(const void* weights, const int32_t* tokens, const int32_t* targets, float* losses,
               float dloss_scale);
  // Accumulates every parameter's gradient into `grads` (fp32, layout offsets). Requires the
  // immediately preceding forward() to have been run with dloss_scale != 0.
  void backward(const void* weights, float* grads, const int32_t* tokens);

  const ModelDims& dims() const { return d_; }

  struct Acts;  // activation pointers into the arena (gpt.cpp)

 private:
  const void* w(const void* weights, int64_t offset) const;

  const ModelConfig& cfg_;
  const ParamLayout& layout_;
  Backend& be_;
  DType act_;
  ModelDims d_;
  NormKind norm_;
  float eps_;
  bool rope_;    // position == "rope"
  bool swiglu_;  // activation == "swiglu"
  size_t arena_bytes_ = 0;
  void* arena_ = nullptr;
  std::unique_ptr<Acts> a_;
};

}  // namespace tetra
