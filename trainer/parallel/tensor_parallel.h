// Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) and sequence parallelism (Korthikanti et
// al. 2022): the communication of a tensor-parallel model chunk, apart from the model's maths.
//
// A linear layer Y = X A + b (our weights are stored (out, in): A = W^T) is split over the p ranks
// of the TP group in one of two ways:
//   column-parallel   A = [A_1 … A_p]          rank i computes Y_i = X A_i + b_i, its own output
//                                               columns, from the whole X
//   row-parallel      A = [A_1; …; A_p]        rank i holds X_i (its columns of X, the output of a
//                     X = [X_1 … X_p]          column-parallel layer) and computes X_i A_i, a
//                                               partial sum: Y = sum_i X_i A_i + b
// A Transformer block pairs them (W_qkv column / W_o row, W_fc column / W_p row) so that nothing
// is communicated between the two GEMMs of a pair, only around them, by two conjugate operators:
//   f  "copy to the TP region" (before a column-parallel GEMM)
//        forward   identity                    backward  all-reduce of dX
//   g  "reduce from the TP region" (after a row-parallel GEMM)
//        forward   all-reduce of Y             backward  identity
// With sequence parallelism the residual stream (and the norms on it) lives on shards of N/p
// rows; f becomes an all-gather of the shards (backward: reduce-scatter) and g a reduce-scatter
// to the shards (backward: all-gather). The transposes are exact: <f(x), y> = <x, f^T(y)>
// (tests/parallel checks each pair on every rank). Shards are blocks of the flattened B*T rows:
// every op on the residual stream is row-wise, so any row partition is a valid "sequence" split.
//
// The rank-0 rule: a term that is the same on every rank and added to a partial sum (the
// row-parallel bias, the residual, the position embedding) is added by TP rank 0 only, before g
// sums the ranks; everything else of the group computes exactly what a single device would.
#pragma once

#include <cstdint>

#include "kernels/backend.h"

namespace tetra {

class Communicator;

// The tensor-parallel context of one model chunk: the group, this rank's place in it, whether the
// residual stream is sequence-parallel, and the geometry of its shards (N rows of width C). Without
// a group (null or of size 1) every operator below is the identity.
class TensorParallel {
 public:
  TensorParallel(Communicator* group, bool sequence_parallel, Backend& be, DType act, int64_t rows, int64_t width);

  bool enabled() const { return comm_ != nullptr; }
  int64_t size() const { return size_; }
  int64_t rank() const { return rank_; }
  bool sequence_parallel() const { return sp_; }
  Communicator* comm() const { return comm_; }
  int64_t rows() const { return N_; }         // N: rows of the whole residual stream
  int64_t shard_rows() const { return Ns_; }  // Ns: this rank's rows (N / p with SP, else N)
  int64_t width() const { return C_; }
  DType act() const { return act_; }          // the activations' type
  size_t shard_bytes() const;                 // Ns * C elements of the activation type

  // The rank-0 rule: `term` on TP rank 0, null on the others.
  const void* once(const void* term) const { return rank_ == 0 ? term : nullptr; }
  // Whether a row-parallel GEMM adds the residual itself (beta = 1 over a copy of it): without
  // sequence parallelism, on rank 0. With it the residual is added to the reduced shard instead.
  bool residual_in_product() const { return !sp_ && rank_ == 0; }
  // Where a row-parallel product goes: `out` itself, or with sequence parallelism the (N, C)
  // `partial` that g reduce-scatters into `out`.
  void* product_target(void* out, void* partial) const { return sp_ ? partial : out; }

  // ---- f: copy to the TP region ----------------------------------------------------------------
  // forward: identity, or (SP) the all-gather of the shards. Returns the region's input: `shard`
  // itself without SP (it holds every row), else `full` (N, C) after the all-gather of the ranks'
  // shards (Ns, C). (A norm output kept on its shard is gathered again in backward: Megatron's
  // column-parallel input under sequence parallelism.)
  const void* copy_to_region(void* full, const void* shard);
  // backward: `dx_partial` (N, C) holds this rank's partial gradient of the region's input; the
  // sum over the group goes to `dx` (Ns, C). Without SP in place (dx == dx_partial).
  void copy_to_region_backward(void* dx, void* dx_partial);

  // ---- g: reduce from the TP region --------------------------------------------------------------
  // forward: `partial` (N, C) (== out without SP) holds this rank's partial sum; `out` (Ns, C)
  // receives the sum over the group plus `residual` (added here with SP, where the product could
  // not carry it; may be null).
  void reduce_from_region(void* out, void* partial, const void* residual);
  // backward: the gradient of every row, (N, C): `dy` itself without SP, else the all-gather of
  // the shards `dy` (Ns, C) into `full` (N, C).
  const void* reduce_from_region_backward(void* full, const void* dy);

 private:
  Communicator* comm_;
  Backend& be_;
  DType act_;
  int64_t size_ = 1, rank_ = 0;
  bool sp_ = false;
  int64_t N_, Ns_, C_;
};

// A linear layer's weights: W (out, in) and its bias (out, may be null), of the activation type.
struct LinearWeights {
  const void* w = nullptr;
  const void* b = nullptr;
};
// Its gradients (fp32, accumulated: +=); b may be null.
struct LinearGrads {
  float* w = nullptr;
  float* b = nullptr;
};

// Column-parallel linear, forward: y (N, out) = x (N, in) W^T + b for this rank's output columns;
// x is the whole input (after copy_to_region). With `gelu_out` non-null the GELU rides on the
// GEMM: y keeps the pre-activation, gelu_out = gelu(y) (Backend::gemm_gelu).
void column_parallel_linear_forward(const TensorParallel& tp, Backend& be, const void* x, int64_t in, LinearWeights w,
                                    void* y, int64_t out, void* gelu_out = nullptr);
// Column-parallel linear, backward: dx_partial (N, in) = dy W (this rank's share of the input
// gradient), dW += dy^T x, db += colsum dy; then f's backward sums the shares into dx (Ns, in).
void column_parallel_linear_backward(TensorParallel& tp, Backend& be, const void* dy, int64_t out, const void* x,
                                     int64_t in, LinearWeights w, LinearGrads g, void* dx_partial, void* dx);

// Row-parallel linear, forward: out (Ns, C) = residual + sum_i x_i W_i^T + b, x (N, in) this
// rank's columns of the input, W_i (C, in) its slice; the bias and residual by the rank-0 rule
// (residual may be null). `partial` (N, C): the product's buffer under sequence parallelism.
void row_parallel_linear_forward(TensorParallel& tp, Backend& be, const void* x, int64_t in, LinearWeights w,
                                 const void* residual, void* out, void* partial);
// Row-parallel linear, backward from dy_full (N, C), the gradient of every row
// (reduce_from_region_backward): dx (N, in) = dy W_i, or with `gelu_pre` non-null
// dx = (dy W_i) * gelu'(gelu_pre) (the GELU's derivative on the GEMM, Backend::gemm_dgelu);
// dW_i += dy^T x; db += colsum dy (b is replicated: every rank's gradient is the whole one).
void row_parallel_linear_backward(const TensorParallel& tp, Backend& be, const void* dy_full, const void* x,
                                  int64_t in, LinearWeights w, LinearGrads g, void* dx,
                                  const void* gelu_pre = nullptr);

}  // namespace tetra
