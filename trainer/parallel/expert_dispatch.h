// Expert parallelism's exchanges (GShard, Switch Transformer; Megatron-Core's token dispatcher):
// how the rows a rank routed to experts reach the EP rank that holds each expert, and return.
//
// EP rank r holds experts [r El, (r+1) El), El = E / ep. Each rank has routed its own tokens and
// holds its kept assignments as x_perm (M, C): one contiguous block per expert, in expert order,
// so the rows for rank r are one contiguous run (its experts' blocks). Then:
//   1. counts   all_to_all_v of the kept counts per expert: each rank learns, per source q and
//               local expert j, how many rows it receives (recv[q][j]);
//   2. dispatch all_to_all_v of x_perm's runs to their owners; the received rows arrive
//               source-major and are regrouped expert-major (regroup map), so each local expert's
//               rows are one contiguous block for its GEMMs;
//   3. combine  the reverse regrouping (ungroup map) and all_to_all_v back to the sources, which
//               receive their rows in x_perm order.
// Dispatch followed by combine is the identity on x_perm (tests/parallel checks it on every rank).
// Backward runs the same two exchanges for the output and input gradients. Without an EP group
// nothing moves: the experts read x_perm itself.
//
// Overlap (parallel.ep_overlap_chunks c > 1): the local experts split into c chunks of
// consecutive experts, and each exchange into one all_to_all_v per chunk (chunk j: the rows of
// every rank's chunk-j experts), issued asynchronously. The received rows are chunk-major (chunk
// j's rows from every source, sources in order, after chunk j - 1's); the experts' rows stay
// expert-major, so chunk j's are one contiguous range [chunk_rows j). The caller issues every
// chunk's dispatch, computes chunk j as soon as its rows arrive while the later chunks are in
// flight, and issues chunk j's combine before computing chunk j + 1. The chunks carry the same
// rows as one exchange (the same bytes), in 1 + 4 c all-to-alls per block and micro-batch.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/backend.h"
#include "trainer/comm/communicator.h"

namespace tetra {

// One micro-batch's exchange on one rank (host side).
struct ExpertExchange {
  std::vector<int64_t> send_rows;    // (ep) rows to EP rank r: this rank's kept rows of r's experts
  std::vector<int64_t> recv_rows;    // (ep) rows from EP rank r
  std::vector<int64_t> expert_rows;  // (El) rows of each local expert, every source's together
  int64_t R = 0;                     // rows received (sum of recv_rows)
  // Chunks (one unless overlapped): chunk j holds local experts [chunk_experts[j], [j + 1]).
  std::vector<int64_t> chunk_experts;          // (chunks + 1)
  std::vector<std::vector<int64_t>> chunk_send, chunk_send_at;  // [j][r] rows to r, first x_perm row
  std::vector<std::vector<int64_t>> chunk_recv, chunk_recv_at;  // [j][r] rows from r, first received row
  std::vector<int64_t> chunk_rows;             // (chunks + 1) expert-major (= received) row ranges
  int chunks() const { return static_cast<int>(chunk_rows.size()) - 1; }
};

// Pure: the exchange from this rank's kept counts per expert `kept` (E) and the counts it
// receives, recv_counts[q El + j] = rows EP rank q sends to local expert j (ep El). Writes the
// regrouping maps' first R entries: regroup[q'] = the source-major row landing at expert-major row
// q', ungroup[s] = the expert-major row of source-major row s (inverse permutations).
// The received rows are chunk-major (one chunk: source-major), `chunks` chunks of local experts.
ExpertExchange plan_expert_exchange(const std::vector<int64_t>& kept, const int32_t* recv_counts, int ep, int64_t El,
                                    std::vector<int32_t>& regroup, std::vector<int32_t>& ungroup, int chunks = 1);

// What the exchanges cost this rank: wall time, and the payload bytes it sent to other ranks.
struct ExpertTraffic {
  // The time the caller spent in the exchanges (issuing, waiting and regrouping): with overlapped
  // chunks the part of the exchanges not hidden behind expert compute. The count exchange counts
  // as dispatch.
  double dispatch_s = 0.0, combine_s = 0.0;
  int64_t dispatch_bytes = 0, combine_bytes = 0;
};

class ExpertDispatcher {
 public:
  // ep: the expert-parallel group (null or size 1: no exchange); rows of width C of type act;
  // E experts, El = E / ep on each rank, exchanged in `chunks` chunks (at most El).
  ExpertDispatcher(Communicator* ep, Backend& be, DType act, int64_t C, int64_t E, int chunks = 1);
  int chunks() const { return chunks_; }

  bool enabled() const { return ep_ != nullptr; }
  int size() const;
  int64_t local_experts() const { return El_; }

  // 1. The count exchange: `kept` (E) this rank's kept rows per expert. `counts` (E + ep El) int32
  // backend scratch, `h_counts` the same on the host; the maps as plan_expert_exchange's.
  ExpertExchange exchange_counts(const std::vector<int64_t>& kept, int32_t* counts, std::vector<int32_t>& h_counts,
                                 std::vector<int32_t>& regroup, std::vector<int32_t>& ungroup);
  // 2. send (M, C), x_perm order -> recv (R, C), expert-major. `src` (R, C) scratch (the rows as
  // received, source-major); `regroup` (R) the map in backend memory.
  void dispatch(const ExpertExchange& x, const void* send, void* src, const int32_t* regroup, void* recv);
  // 3. expert_major (R, C) -> local (M, C), x_perm order. `src` scratch and `ungroup` as above.
  void combine(const ExpertExchange& x, const void* expert_major, void* src, const int32_t* ungroup, void* local);

  // The same per chunk, asynchronously. start_dispatch(j): chunk j's rows of `send` on their way
  // into `src`; finish_dispatch(j): waits for them and regroups chunk j's expert-major rows of
  // `recv`. start_combine(j): regroups chunk j's rows of `expert_major` into `src` and sends them
  // back into `local`; finish_combine waits. `src` must stay untouched by the caller meanwhile
  // (each chunk uses its own range of it).
  WorkHandle start_dispatch(const ExpertExchange& x, int j, const void* send, void* src);
  void finish_dispatch(const ExpertExchange& x, int j, WorkHandle& work, const void* src, const int32_t* regroup,
                       void* recv);
  WorkHandle start_combine(const ExpertExchange& x, int j, const void* expert_major, void* src,
                           const int32_t* ungroup, void* local);
  void finish_combine(WorkHandle& work);

  // The traffic since the last call (and reset).
  ExpertTraffic take_traffic();

 private:
  Communicator* ep_;
  Backend& be_;
  DType act_;
  int64_t C_, E_, El_;
  int chunks_ = 1;
  ExpertTraffic traffic_;
};

}  // namespace tetra
