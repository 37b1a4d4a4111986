#include "trainer/parallel/tensor_parallel.h"

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"

namespace tetra {

TensorParallel::TensorParallel(Communicator* group, bool sequence_parallel, Backend& be, DType act, int64_t rows,
                               int64_t width)
    : comm_(group && group->size() > 1 ? group : nullptr), be_(be), act_(act), N_(rows), Ns_(rows), C_(width) {
  if (comm_) {
    size_ = comm_->size();
    rank_ = comm_->rank();
  }
  sp_ = sequence_parallel && size_ > 1;
  if (sp_) {
    TETRA_CHECK(N_ % size_ == 0, "sequence parallelism needs B*T ({}) divisible by tp ({})", N_, size_);
    Ns_ = N_ / size_;
  }
}

size_t TensorParallel::shard_bytes() const { return static_cast<size_t>(Ns_ * C_) * dtype_size(act_); }

// f forward: identity | all-gather.
const void* TensorParallel::copy_to_region(void* full, const void* shard) {
  if (!sp_) return shard;
  comm_->all_gather(full, shard, Ns_ * C_, act_);
  return full;
}

// f backward: all-reduce | reduce-scatter (the all-gather's transpose).
void TensorParallel::copy_to_region_backward(void* dx, void* dx_partial) {
  if (!comm_) return;  // dx_partial == dx
  if (!sp_)
    comm_->all_reduce(dx_partial, N_ * C_, act_);
  else
    comm_->reduce_scatter(dx, dx_partial, Ns_ * C_, act_);
}

// g forward: all-reduce | reduce-scatter (+ the residual on the shard).
void TensorParallel::reduce_from_region(void* out, void* partial, const void* residual) {
  if (!comm_) return;  // partial == out, residual and bias already added
  if (!sp_) {
    comm_->all_reduce(out, N_ * C_, act_);
    return;
  }
  comm_->reduce_scatter(out, partial, Ns_ * C_, act_);
  if (residual) be_.add(out, out, residual, Ns_ * C_, act_);
}

// g backward: identity | all-gather (the reduce-scatter's transpose).
const void* TensorParallel::reduce_from_region_backward(void* full, const void* dy) {
  if (!sp_) return dy;
  comm_->all_gather(full, dy, Ns_ * C_, act_);
  return full;
}

void column_parallel_linear_forward(const TensorParallel& tp, Backend& be, const void* x, int64_t in, LinearWeights w,
                                    void* y, int64_t out, void* gelu_out) {
  const int64_t N = tp.rows();
  const DType t = tp.act();
  if (gelu_out)
    be.gemm_gelu(false, true, N, out, in, x, in, w.w, in, w.b, y, gelu_out, t);
  else
    be.gemm(false, true, N, out, in, 1.0f, x, in, w.w, in, t, 0.0f, y, out, t, w.b);
}

void column_parallel_linear_backward(TensorParallel& tp, Backend& be, const void* dy, int64_t out, const void* x,
                                     int64_t in, LinearWeights w, LinearGrads g, void* dx_partial, void* dx) {
  const int64_t N = tp.rows();
  const DType t = tp.act();
  be.gemm(false, false, N, in, out, 1.0f, dy, out, w.w, in, t, 0.0f, dx_partial, in, t);
  be.gemm(true, false, out, in, N, 1.0f, dy, out, x, in, t, 1.0f, g.w, in, DType::F32);
  if (g.b) be.bias_backward(g.b, dy, N, out, t);
  tp.copy_to_region_backward(dx, dx_partial);
}

void row_parallel_linear_forward(TensorParallel& tp, Backend& be, const void* x, int64_t in, LinearWeights w,
                                 const void* residual, void* out, void* partial) {
  const int64_t N = tp.rows(), C = tp.width();
  const DType t = tp.act();
  void* y = tp.product_target(out, partial);
  const bool fused = residual && tp.residual_in_product();
  if (fused) be.copy(y, residual, tp.shard_bytes());
  be.gemm(false, true, N, C, in, 1.0f, x, in, w.w, in, t, fused ? 1.0f : 0.0f, y, C, t, tp.once(w.b));
  tp.reduce_from_region(out, y, residual);
}

void row_parallel_linear_backward(const TensorParallel& tp, Backend& be, const void* dy_full, const void* x,
                                  int64_t in, LinearWeights w, LinearGrads g, void* dx, const void* gelu_pre) {
  const int64_t N = tp.rows(), C = tp.width();
  const DType t = tp.act();
  if (gelu_pre)
    be.gemm_dgelu(false, false, N, in, C, dy_full, C, w.w, in, gelu_pre, dx, t);
  else
    be.gemm(false, false, N, in, C, 1.0f, dy_full, C, w.w, in, t, 0.0f, dx, in, t);
  be.gemm(true, false, C, in, N, 1.0f, dy_full, C, x, in, t, 1.0f, g.w, in, DType::F32);
  if (g.b) be.bias_backward(g.b, dy_full, N, C, t);
}

}  // namespace tetra
