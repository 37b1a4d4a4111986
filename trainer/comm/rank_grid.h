// The rank grid: which global rank holds which (tp, cp, pp, dp) coordinate, and which ranks form
// each process group. A pure function of the sizes and an order string — no communication — so
// every rank computes the same grid and every group the code uses is derived from it.
//
// Megatron's convention. world = tp x cp x pp x dp. The order string names the four axes joined
// by '-', fastest-varying first. With the default "tp-cp-dp-pp":
//
//   rank = tp + TP * (cp + CP * (dp + DP * pp))
//
// so tensor-parallel neighbours are adjacent ranks (they share a node), context-parallel ones
// next. In general, for order "a-b-c-d": rank = a + A * (b + B * (c + C * d)). An order of the
// three other axes (the spellings before context parallelism) is accepted while cp is 1.
//
// The experts have a layout of their own (Megatron-Core's MoE parallel folding). Each expert is
// split over ETP ranks, a divisor of TP: the tp coordinate splits into the expert-TP rank and the
// share, the group of ETP ranks among the tp / ETP that route the same rows,
//
//   etp = tp % ETP,  share = tp / ETP     (S = TP / ETP shares; 1 when ETP = TP, the default)
//
// and expert parallelism is carved out of the shares and data parallelism: EP divides S x DP and
// the flattened coordinate x = share + S dp splits into an expert-parallel and an
// expert-data-parallel part,
//
//   ep = x % EP,  edp = x / EP            (x = edp * EP + ep; unfolded, x = dp)
//
// Groups (members listed in group-rank order):
//   TP  vary tp            (same cp, dp, pp)    PP  vary pp   (same tp, cp, dp)
//   CP  vary cp            (same tp, dp, pp)    EP  vary ep   (same etp, cp, pp, edp)
//   ETP vary etp           (same share, cp, dp, pp): the ranks of one expert's slices
//   ESHARE vary share      (same etp, cp, dp, pp): the TP ranks routing the other rows of the
//       micro-batch (one member unfolded)
//   DP  vary cp and dp, cp fastest (same tp, pp): the replicas of a dense parameter, whose
//       gradients reduce (and whose optimizer state shards) over dp x cp (Megatron's data-parallel
//       group "with context parallel"); the data loader uses the dp coordinate alone
//   EDP vary cp and edp, cp fastest (same etp, pp, ep): an expert's replicas
//   MP  model parallel: vary tp and pp (same cp, dp), tp fastest then pp
//   WORLD every rank, 0 .. world-1
//   EMBEDDING  the first and last pipeline stage of the rank's (tp, dp): the ranks holding the
//       input embedding and the output projection, whose tied weights' grads are summed. One
//       member when pp == 1. A middle stage holds no embedding: its group is itself alone, so
//       every rank is in exactly one group of each kind and its communicator is a no-op.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace tetra {

struct GridSizes {
  int64_t world = 1, tp = 1, pp = 1, dp = 1, ep = 1;
  std::string order = "tp-cp-dp-pp";
  int64_t cp = 1;
  int64_t etp = 0;  // the experts' tensor parallelism, a divisor of tp; 0: tp
  int64_t expert_tp() const { return etp > 0 ? etp : tp; }
};

struct GridCoord {
  int tp = 0, pp = 0, dp = 0, ep = 0, edp = 0, cp = 0;  // ep = x % ep_size, edp = x / ep_size
  int etp = 0, share = 0;                               // etp = tp % etp_size, share = tp / etp_size
};

enum class GroupKind : uint8_t { TP, PP, DP, EP, EDP, MP, EMBEDDING, WORLD, CP, ETP, ESHARE };
constexpr int kGroupKinds = 11;
// "tp", "pp", "dp", "ep", "edp", "mp", "embedding", "world", "cp", "etp", "eshare"
const char* group_kind_name(GroupKind kind);

class RankGrid {
 public:
  // Validates the sizes and the order string; throws tetra::InputError naming the values.
  static RankGrid build(const GridSizes& s);

  const GridSizes& sizes() const { return sizes_; }
  int world() const { return static_cast<int>(sizes_.world); }

  GridCoord coord(int rank) const;
  int rank_of(int tp, int dp, int pp, int cp = 0) const;

  // Members (global ranks) of `rank`'s group of this kind, in group-rank order.
  std::vector<int> group(GroupKind kind, int rank) const;
  // Every group of this kind, each once, ordered by their smallest member.
  std::vector<std::vector<int>> groups(GroupKind kind) const;

 private:
  enum Axis { AXIS_TP = 0, AXIS_DP = 1, AXIS_PP = 2, AXIS_CP = 3 };
  GridSizes sizes_;
  int64_t stride_[4] = {1, 1, 1, 1};  // rank stride of each axis, indexed by Axis
};

}  // namespace tetra
