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
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/backend.h"

namespace tetra {

class Communicator;

// One micro-batch's exchange on one rank (host side).
struct ExpertExchange {
  std::vector<int64_t> send_rows;    // (ep) rows to EP rank r: this rank's kept rows of r's experts
  std::vector<int64_t> recv_rows;    // (ep) rows from EP rank r
  std::vector<int64_t> expert_rows;  // (El) rows of each local expert, every source's together
  int64_t R = 0;                     // rows received (sum of recv_rows)
};

// Pure: the exchange from this rank's kept counts per expert `kept` (E) and the counts it
// receives, recv_counts[q El + j] = rows EP rank q sends to local expert j (ep El). Writes the
// regrouping maps' first R entries: regroup[q'] = the source-major row landing at expert-major row
// q', ungroup[s] = the expert-major row of source-major row s (inverse permutations).
ExpertExchange plan_expert_exchange(const std::vector<int64_t>& kept, const int32_t* recv_counts, int ep, int64_t El,
                                    std::vector<int32_t>& regroup, std::vector<int32_t>& ungroup);

// What the exchanges cost this rank: wall time, and the payload bytes it sent to other ranks.
struct ExpertTraffic {
  double dispatch_s = 0.0, combine_s = 0.0;  // the count exchange counts as dispatch
  int64_t dispatch_bytes = 0, combine_bytes = 0;
};

class ExpertDispatcher {
 public:
  // ep: the expert-parallel group (null or size 1: no exchange); rows of width C of type act;
  // E experts, El = E / ep on each rank.
  ExpertDispatcher(Communicator* ep, Backend& be, DType act, int64_t C, int64_t E);

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

  // The traffic since the last call (and reset).
  ExpertTraffic take_traffic();

 private:
  Communicator* ep_;
  Backend& be_;
  DType act_;
  int64_t C_, E_, El_;
  ExpertTraffic traffic_;
};

}  // namespace tetra
