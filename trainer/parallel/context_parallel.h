// Context parallelism: each sequence split over the cp ranks of a CP group, attention computed
// across them by ring attention (Megatron-LM / TransformerEngine's scheme).
//
// Load balance for the causal mask. A sequence of T tokens is cut into 2 cp chunks of c = T / (2 cp);
// CP rank r keeps chunks r and 2 cp - 1 - r, back to back, as its Tl = T / cp local tokens. Every
// other layer works on those rows as on any rows; attention needs the other ranks' keys and
// values. Block by block, rank r's queries against the keys of rank s:
//   s == r   causal over the local rows (the local order is the global order on both chunks)
//   s <  r   every local query against the first Tl / 2 keys of s (chunk s precedes both chunks of r;
//            chunk 2 cp - 1 - s follows them)
//   s >  r   the last Tl / 2 queries (chunk 2 cp - 1 - r) against every key of s
// so every rank computes one causal Tl x Tl block and cp - 1 blocks of Tl x Tl / 2 keys: the same
// work. Partial results merge by their log-sum-exp (Backend::attention_block_forward).
//
// cp_comm "p2p" (default): the K/V block of the local tokens, (B, Tl, 2 NKV HS) in the activation
// type, passes around the ring (rank r sends to r + 1, receives from r - 1) while the current
// block computes: cp - 1 hops, each posted (outside a communicator group, so that it is in flight
// while the block runs) before a block and waited after it. Backward passes K/V around again the
// same way, with a travelling fp32 gradient dK/dV of the same shape: each rank adds its
// contribution to the block it holds and passes it on after the block (these cp hops are not
// hidden); after cp hops the gradient is home. "all_gather": K/V
// gathered from every rank first, then the blocks; backward gathers again and reduce-scatters
// the fp32 dK/dV (simple; fine with few KV heads).
//
// Positions: positions() gives the global position of each local token (RoPE, learned positions).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "trainer/config/config.h"

namespace tetra {

class Communicator;

// The memory ring attention needs beside the model's activations (carved from a chunk's scratch).
struct ContextParallelBuffers {
  void* kv[2] = {nullptr, nullptr};  // the travelling K/V blocks; all_gather: kv[0] holds cp blocks
  float* o = nullptr;                // (B, Tl, NH HS) fp32 running output
  float* grad = nullptr;             // (B, Tl, QKV) fp32: dq accumulates in its q columns, then dk, dv
  float* dkv[2] = {nullptr, nullptr};  // travelling fp32 dK/dV blocks; all_gather: dkv[0] holds cp
                                       // blocks, dkv[1] receives this rank's summed block
  int32_t* positions = nullptr;      // (Tl) global positions of the local tokens
};

class ContextParallel {
 public:
  // `comm`: the CP group (null or size 1: no context parallelism, every call the identity of plain
  // attention). B, T (the whole sequence), NH, NKV, HS: this rank's shapes.
  ContextParallel(Communicator* comm, CpComm mode, Backend& be, DType act, int64_t B, int64_t T, int64_t NH,
                  int64_t NKV, int64_t HS);

  bool enabled() const { return size_ > 1; }
  int size() const { return size_; }
  int rank() const { return rank_; }
  int64_t local_tokens() const { return Tl_; }
  // The global position of each local token (host copy; the device one is buffers().positions).
  const std::vector<int32_t>& host_positions() const { return host_positions_; }
  static std::vector<int32_t> positions_of(int64_t T, int cp, int rank);
  // The block rank r computes against rank s's K/V (Tl local tokens each): its queries are local
  // rows [q0, q0 + Tq), its keys rows [0, Tk) of s's block (see the header comment).
  struct BlockRange {
    int64_t q0, Tq, Tk;
    bool causal;
  };
  static BlockRange block_range(int64_t Tl, int r, int s);

  // The buffers of a CP group of `cp` ranks, taken from `c` (an ArenaCarver over a chunk's
  // scratch; a null base only sizes them). B, Tl (local tokens), NH, NKV, HS: this rank's.
  template <class Carver>
  static ContextParallelBuffers carve(Carver& c, int cp, CpComm mode, DType act, int64_t B, int64_t Tl, int64_t NH,
                                      int64_t NKV, int64_t HS) {
    ContextParallelBuffers b;
    if (cp <= 1) return b;
    const int64_t kv = B * Tl * 2 * NKV * HS;
    const int64_t blocks = mode == CpComm::ALL_GATHER ? cp : 1;
    b.kv[0] = c.take(blocks * kv, act);
    b.kv[1] = mode == CpComm::P2P ? c.take(kv, act) : nullptr;
    b.o = c.f32(B * Tl * NH * HS);
    b.grad = c.f32(B * Tl * (NH + 2 * NKV) * HS);
    b.dkv[0] = c.f32(blocks * kv);
    b.dkv[1] = c.f32(kv);
    b.positions = c.i32(Tl);
    return b;
  }
  // The buffers carve() took in real memory; uploads the positions.
  void set_buffers(const ContextParallelBuffers& b);
  const int32_t* positions() const { return enabled() ? b_.positions : nullptr; }

  // att (B, Tl, NH HS) act and lse (B, NH, Tl) of the local queries over the whole sequence's
  // causal keys; qkv (B, Tl, QKV) the local tokens' (after RoPE).
  void forward(void* att, float* lse, const void* qkv);
  // dqkv (B, Tl, QKV) act overwritten from datt; att and lse as forward() left them.
  void backward(void* dqkv, const void* datt, const void* qkv, const void* att, const float* lse);

 private:
  int64_t QKV() const { return (NH_ + 2 * NKV_) * HS_; }
  int64_t kv_numel() const { return B_ * Tl_ * 2 * NKV_ * HS_; }
  // Rank r's queries against the K/V block `kv` of rank s (see the header comment); the q view and
  // o / lse offsets follow from (r, s).
  AttnBlock block_of(const void* qkv, const void* kv, int s, float* lse) const;
  AttnView o_view(int s) const;
  void pack_kv(void* dst, const void* qkv);
  // The local K/V block packed where the ring starts (p2p), or every rank's gathered (all_gather).
  void gather_kv(const void* qkv);
  // Calls block(step, s, kv, slot) for the ring's cp steps, rank s's K/V block at kv: the
  // gathered blocks (slot s), or the travelling one (slot: which of the two buffers) with the next
  // hop in flight while block runs. Returns the p2p slot after the last step.
  template <class Block>
  int walk_ring(Block&& block);

  Communicator* comm_ = nullptr;
  CpComm mode_;
  Backend& be_;
  DType act_;
  int size_ = 1, rank_ = 0;
  int64_t B_, T_, Tl_, NH_, NKV_, HS_;
  ContextParallelBuffers b_;
  std::vector<int32_t> host_positions_;
};

}  // namespace tetra
