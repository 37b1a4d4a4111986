// Activation recomputation, the plan (Korthikanti et al. 2022; Megatron-LM's --recompute-granularity,
// --recompute-modules, --recompute-method, --recompute-num-layers): which activations of a model
// chunk are kept from forward to backward and which are computed again in backward.
//
//   none       every tensor backward reads is kept
//   selective  the outputs of the named modules are not kept; backward recomputes them from a
//              kept input just before it needs them:
//                norm       the norm outputs ln1, ln2 from the block input and res_mid
//                act        the MLP activation gelu(fc) / swiglu(fc) from fc
//                moe_act    the same inside each expert (trainer/model/moe.h)
//                core_attn  the attention output and its log-sum-exp statistics from q, k, v
//                           (the attention then keeps no flash statistics)
//   full       a chunk's layers form units; a unit keeps only its input (the residual stream
//              entering its first layer) and backward reruns the unit's forward before its
//              backward: "uniform" units of recompute_num_layers consecutive layers, or "block":
//              the chunk's first recompute_num_layers layers each a unit of one (the others kept
//              whole). A MoE block ends its unit: its routing and expert activations are kept
//              (the MoeLayers arena), so the unit's recomputation reruns no expert exchange.
// A recomputation runs the same kernels on the same values as the first forward, so losses and
// gradients are bitwise those of "none" (tests/parity/test_recompute.py). Under tensor
// parallelism a recomputed forward repeats its collectives (trainer/parallel/comm_volume.cpp
// counts them).
#pragma once

#include <cstdint>
#include <vector>

#include "trainer/config/config.h"

namespace tetra {

struct Recomputation {
  Recompute kind = Recompute::NONE;
  // Selective modules (only when kind == SELECTIVE).
  bool norm = false, act = false, core_attn = false, moe_act = false;
  RecomputeMethod method = RecomputeMethod::UNIFORM;  // kind == FULL
  int64_t num_layers = 1;

  static Recomputation from(const TrainingConfig& t);
};

// The full-recomputation units of a chunk of L layers: unit_of[l] is the unit of chunk layer l
// (-1: the layer is not fully recomputed), units[u] = [begin, end) of chunk layers. `moe[l]`:
// whether chunk layer l is a MoE block (it ends its unit).
struct RecomputeUnits {
  std::vector<int64_t> unit_of;
  std::vector<std::pair<int64_t, int64_t>> units;
  int64_t longest() const;  // layers of the longest unit (0 without any)
  bool full(int64_t l) const { return unit_of[static_cast<size_t>(l)] >= 0; }
  // Layer l is the last of its unit: backward reruns the unit's forward there.
  bool ends_unit(int64_t l) const;
};
RecomputeUnits plan_recompute_units(const Recomputation& rc, int64_t L, const std::vector<bool>& moe);

}  // namespace tetra
