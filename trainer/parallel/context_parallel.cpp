#include "trainer/parallel/context_parallel.h"

#include <utility>

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"

namespace tetra {

namespace {
constexpr int kKvTag = 1, kGradTag = 2;  // the ring's K/V blocks and their gradients
}  // namespace

std::vector<int32_t> ContextParallel::positions_of(int64_t T, int cp, int rank) {
  const int64_t c = T / (2 * cp);
  std::vector<int32_t> p(static_cast<size_t>(2 * c));
  for (int64_t t = 0; t < c; ++t) {
    p[static_cast<size_t>(t)] = static_cast<int32_t>(rank * c + t);
    p[static_cast<size_t>(c + t)] = static_cast<int32_t>((2 * cp - 1 - rank) * c + t);
  }
  return p;
}

ContextParallel::ContextParallel(Communicator* comm, CpComm mode, Backend& be, DType act, int64_t B, int64_t T,
                                 int64_t NH, int64_t NKV, int64_t HS)
    : comm_(comm && comm->size() > 1 ? comm : nullptr), mode_(mode), be_(be), act_(act), B_(B), T_(T), Tl_(T),
      NH_(NH), NKV_(NKV), HS_(HS) {
  if (!comm_) return;
  size_ = comm_->size();
  rank_ = comm_->rank();
  TETRA_CHECK(T % (2 * size_) == 0, "context parallelism: seq_len {} is not a multiple of 2 x cp ({})", T, 2 * size_);
  Tl_ = T / size_;
  host_positions_ = positions_of(T, size_, rank_);
}

void ContextParallel::set_buffers(const ContextParallelBuffers& b) {
  b_ = b;
  if (enabled())
    be_.copy_from_host(b_.positions, host_positions_.data(), host_positions_.size() * sizeof(int32_t));
}

void ContextParallel::pack_kv(void* dst, const void* qkv) {
  const size_t es = dtype_size(act_);
  const size_t row = static_cast<size_t>(QKV()) * es, kv = static_cast<size_t>(2 * NKV_ * HS_) * es;
  be_.copy_2d(dst, kv, static_cast<const char*>(qkv) + static_cast<size_t>(NH_ * HS_) * es, row, kv,
              static_cast<size_t>(B_ * Tl_));
}

ContextParallel::BlockRange ContextParallel::block_range(int64_t Tl, int r, int s) {
  const int64_t half = Tl / 2;
  BlockRange b;
  b.q0 = s > r ? half : 0;   // s > r: the second chunk's queries only
  b.Tq = Tl - b.q0;
  b.Tk = s < r ? half : Tl;  // s < r: the first chunk's keys only
  b.causal = s == r;
  return b;
}

AttnBlock ContextParallel::block_of(const void* qkv, const void* kv, int s, float* lse) const {
  const size_t es = dtype_size(act_);
  const int64_t qkv_row = QKV(), kv_row = 2 * NKV_ * HS_;
  const BlockRange range = block_range(Tl_, rank_, s);
  AttnBlock b;
  b.B = B_;
  b.NH = NH_;
  b.NKV = NKV_;
  b.HS = HS_;
  b.lse_ld = Tl_;
  const int64_t q0 = range.q0;
  b.Tq = range.Tq;
  b.Tk = range.Tk;
  b.causal = range.causal;
  const char* q = static_cast<const char*>(qkv) + static_cast<size_t>(q0 * qkv_row) * es;
  const char* k = static_cast<const char*>(kv);
  b.q = AttnView{const_cast<char*>(q), qkv_row, Tl_ * qkv_row};
  b.k = AttnView{const_cast<char*>(k), kv_row, Tl_ * kv_row};
  b.v = AttnView{const_cast<char*>(k + static_cast<size_t>(NKV_ * HS_) * es), kv_row, Tl_ * kv_row};
  b.lse = lse + q0;
  return b;
}

AttnView ContextParallel::o_view(int s) const {
  const int64_t q0 = block_range(Tl_, rank_, s).q0, row = NH_ * HS_;
  return AttnView{b_.o + q0 * row, row, Tl_ * row};
}

void ContextParallel::gather_kv(const void* qkv) {
  if (mode_ == CpComm::P2P) {
    pack_kv(b_.kv[0], qkv);
    return;
  }
  // The local block is packed into the dK/dV buffer (free until the gather is done; at least a
  // block's bytes), then gathered with the others'.
  pack_kv(b_.dkv[0], qkv);
  comm_->all_gather(b_.kv[0], b_.dkv[0], kv_numel(), act_);
}

template <class Block>
int ContextParallel::walk_ring(Block&& block) {
  const int64_t n = kv_numel();
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  int cur = 0;
  for (int i = 0; i < size_; ++i) {
    const int s = (rank_ + size_ - i) % size_;  // whose K/V this rank holds at step i
    if (mode_ == CpComm::ALL_GATHER) {
      block(i, s, static_cast<const char*>(b_.kv[0]) + static_cast<size_t>(s * n) * dtype_size(act_), s);
      continue;
    }
    WorkHandle send, recv;
    if (i + 1 < size_) {  // the next block travels while this one computes (ungrouped: a group
                          // would complete the transfers before the block is issued)
      send = comm_->send_async(b_.kv[cur], n, act_, next, kKvTag);
      recv = comm_->recv_async(b_.kv[1 - cur], n, act_, prev, kKvTag);
    }
    block(i, s, b_.kv[cur], cur);
    if (send) comm_->wait(*send, CommOp::SEND);
    if (recv) comm_->wait(*recv, CommOp::RECV);
    cur = 1 - cur;
  }
  return cur;
}

void ContextParallel::forward(void* att, float* lse, const void* qkv) {
  TETRA_CHECK(enabled(), "ContextParallel::forward without a CP group");
  gather_kv(qkv);
  walk_ring([&](int i, int s, const void* kv, int) {
    be_.attention_block_forward(block_of(qkv, kv, s, lse), o_view(s), i == 0, act_);
  });
  be_.cast(att, act_, b_.o, DType::F32, B_ * Tl_ * NH_ * HS_);
}

void ContextParallel::backward(void* dqkv, const void* datt, const void* qkv, const void* att, const float* lse) {
  TETRA_CHECK(enabled(), "ContextParallel::backward without a CP group");
  const int64_t n = kv_numel(), row = NH_ * HS_, qkv_row = QKV(), kv_row = 2 * NKV_ * HS_;
  const size_t es = dtype_size(act_);
  const int next = (rank_ + 1) % size_, prev = (rank_ + size_ - 1) % size_;
  const bool gathered = mode_ == CpComm::ALL_GATHER;
  be_.memset_zero(b_.grad, static_cast<size_t>(B_ * Tl_ * qkv_row) * 4);
  gather_kv(qkv);
  // The dK/dV accumulators: one per rank's block (all_gather; zeroed after the gather staged in
  // them), or the travelling one (p2p).
  be_.memset_zero(b_.dkv[0], static_cast<size_t>((gathered ? size_ : 1) * n) * 4);
  float* lse_mut = const_cast<float*>(lse);  // read only by the backward block
  const int cur = walk_ring([&](int, int s, const void* kv, int slot) {
    // The block's dout / out views, its dq view (the q columns of grad) and rank s's dK/dV.
    float* dkv = gathered ? b_.dkv[0] + slot * n : b_.dkv[slot];
    const int64_t q0 = block_range(Tl_, rank_, s).q0;
    const AttnView dout{const_cast<char*>(static_cast<const char*>(datt) + static_cast<size_t>(q0 * row) * es), row,
                        Tl_ * row};
    const AttnView out{const_cast<char*>(static_cast<const char*>(att) + static_cast<size_t>(q0 * row) * es), row,
                       Tl_ * row};
    const AttnView dq{b_.grad + q0 * qkv_row, qkv_row, Tl_ * qkv_row};
    const AttnView dk{dkv, kv_row, Tl_ * kv_row}, dv{dkv + NKV_ * HS_, kv_row, Tl_ * kv_row};
    be_.attention_block_backward(block_of(qkv, kv, s, lse_mut), dout, out, dq, dk, dv, act_);
    if (gathered) return;
    // p2p: the gradient of rank s's K/V moves on with it (after cp hops it is home): sent after
    // the block, received into the buffer the next step accumulates into; nothing computes
    // meanwhile (exposed, and counted as the cp group's wait).
    WorkHandle dsend = comm_->send_async(b_.dkv[slot], n, DType::F32, next, kGradTag);
    WorkHandle drecv = comm_->recv_async(b_.dkv[1 - slot], n, DType::F32, prev, kGradTag);
    comm_->wait(*dsend, CommOp::SEND);
    comm_->wait(*drecv, CommOp::RECV);
  });
  // This rank's own dK/dV, summed over every rank's queries: home after the ring, or each
  // rank's block reduce-scattered to it.
  float* home = b_.dkv[gathered ? 1 : cur];
  if (gathered) comm_->reduce_scatter(home, b_.dkv[0], n, DType::F32, ReduceOp::SUM);
  // grad's k/v columns <- the home dK/dV; then the whole (B, Tl, QKV) fp32 gradient to act.
  be_.copy_2d(b_.grad + NH_ * HS_, static_cast<size_t>(qkv_row) * 4, home, static_cast<size_t>(2 * NKV_ * HS_) * 4,
              static_cast<size_t>(2 * NKV_ * HS_) * 4, static_cast<size_t>(B_ * Tl_));
  be_.cast(dqkv, act_, b_.grad, DType::F32, B_ * Tl_ * qkv_row);
}

}  // namespace tetra
