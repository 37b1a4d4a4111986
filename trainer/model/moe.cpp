// The MoE blocks' forward and backward (see moe.h for the math and the expert-parallel
// exchanges) and their activation arena; the host-side routing plan, row bound, statistics and
// expert biases are moe_routing.cpp's.
#include "trainer/model/moe.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "kernels/common/check.h"
#include "trainer/core/arena.h"
#include "trainer/comm/communicator.h"
#include "trainer/model/moe_shared.h"
#include "trainer/parallel/expert_dispatch.h"

namespace tetra {

namespace {
MoeRouteBias g_route_bias = MoeRouteBias::kNone;
}  // namespace

void set_moe_route_bias(MoeRouteBias bias) { g_route_bias = bias; }

namespace {


double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

// Saved by forward for backward, per MoE block. Backend memory unless noted.
struct MoeLayers::Layer {
  int64_t block = 0;
  float* logits;      // (N, E)
  float* probs;       // (N, E)
  float* lse;         // (N)
  int32_t* topk_idx;  // (N, K)
  float* topk_prob;   // (N, K) the chosen experts' probabilities
  float* gates;       // (N, K) the gates: topk_prob renormalised or scaled (else topk_prob itself)
  int32_t* pos;       // (N, K)
  int32_t* rows;      // (M_max)
  void* region;       // the kept rows: x_exp, fc, act (rows_region elements)
  void* x_exp;        // (R, C) the rows the local experts see, expert-major (in region)
  void* fc;           // (R, FC) in region; null for a block over the bound (recomputed)
  void* act;          // (R, F) in region; the scratch's when recomputed (moe_act or over the bound)
  void* y_local;      // (M_max, C) expert outputs of this rank's assignments (x_perm order)
  int32_t* regroup;   // (R_max) expert-major row -> source-major row (ep > 1)
  int32_t* ungroup;   // (R_max) source-major row -> expert-major row (ep > 1)
  MoeSharedExpert::Saved shared;  // the shared expert's (model.moe.shared_expert_ffn_hidden_size)
  // Host.
  MoeRoutingPlan plan;
  std::vector<int64_t> routed_seq;  // tokens routed to each expert over the whole sequence (CP group)
  ExpertExchange x;  // rows to / from each EP rank, rows of each local expert (R in all)
  int64_t M = 0;
  bool over = false;  // R > B: the experts ran in passes of B rows and backward recomputes fc
  float loss_weight = 0.0f;
};

struct MoeLayers::Scratch {
  void* send;          // (M_max, C) x_perm before dispatch (ep > 1)
  void* src;           // (R_max, C) received rows, source-major (ep > 1)
  void* y_exp;         // (R_max, C) expert outputs, expert-major (ep > 1; else the layer's y_local)
  float* dgates;       // (N, K)
  float* dtopk;        // (N, K) the chosen probabilities' gradient (gates transformed; else dgates)
  float* dlogits;      // (N, E)
  void* dlogits_act;   // (N, E) act
  float* expert_grad;  // (E)
  float* select_bias;  // (E) the block's expert bias, uploaded for its router (expert bias only)
  void* dy_local;      // (M_max, C)
  void* dy_exp;        // (R_max, C) (ep > 1: over y_exp, which only forward uses; else dy_local)
  void* dact;          // (B, F)
  void* act;           // (B, F) the experts' activation, recomputed (moe_act, or a block over the
                       // bound; else null)
  void* fc;            // (B, FC) a pass's fc of a block over the bound (null when none can be)
  void* dfc;           // (B, FC)
  void* dx_exp;        // (R_max, C)
  void* dx_local;      // (M_max, C) (ep > 1; else dx_exp)
  int32_t* counts;     // (E + ep El) send and received per-expert counts
  int32_t* cp_counts;  // (B, 2 cp, E) assignments per sequence chunk and expert (capacity under CP), or
                       // (shares, E) per share (capacity with folded experts)
  MoeSharedExpert::Scratch shared;  // the shared expert's
  // Host staging, sized at construction: what forward reads back from backend memory (the
  // router's choice, the received counts, the loss statistics' inputs) and the host-built index
  // maps it uploads.
  std::vector<int32_t> h_idx;                 // (N K)
  std::vector<int32_t> h_counts;              // (E + ep El)
  std::vector<int32_t> h_regroup, h_ungroup;  // (R_max)
  std::vector<float> h_probs, h_lse, h_eg;    // (N E), (N), (E)
  std::vector<double> h_psum;                 // (E) the probability sums of the aux loss
  std::vector<int32_t> h_routed;              // (E) routed counts, reduced over the CP group
  std::vector<int32_t> h_cp_counts;           // as cp_counts
  std::vector<int64_t> h_before;              // (B, 2, E) assignments before each local chunk
};

namespace {

struct Sizes {
  // N: the rows this rank routes (a share's, at most ceil(Nfull / shares)); Nfull: the caller's rows.
  int64_t N, Nfull, shares, C, E, K, El, F, FC, cap, M_max, R_max, ep;
  int64_t cp, cp_chunks;  // context parallelism; B 2 cp sequence chunks when capacity spans them (else 0)
  // B: the rows of the local experts a slot keeps per block (the bound); rows_region: the
  // elements of a block's kept rows region, B (C + FC + F) (F: when the activation is kept), at
  // least R_max C so that a block over the bound keeps its input rows there.
  int64_t B, rows_region;
  bool gates;          // the gates are transformed (renormalised or scaled): kept apart
  bool bias;           // the router adds an expert bias to the scores for the choice
  bool recompute_act;  // the experts' activation is scratch, recomputed in backward
  bool shared;         // a shared expert beside the routed ones, of shape sh
  MoeSharedExpert::Shape sh;
};

Sizes sizes_of(const ModelConfig& cfg, DType act, int64_t Nfull, int64_t ep, int64_t tp, bool recompute_act,
               int64_t cp, int64_t etp) {
  Sizes s{};
  const MoeConfig& m = cfg.moe;
  if (etp <= 0) etp = tp;
  s.shares = tp / etp;
  s.Nfull = Nfull;
  const int64_t N = (Nfull + s.shares - 1) / s.shares;
  s.N = N;
  s.C = cfg.hidden_size;
  s.E = m.num_experts;
  s.K = m.top_k;
  s.ep = ep;
  s.El = s.E / ep;
  s.F = m.ffn_hidden_size / etp;
  s.FC = cfg.activation == Activation::SWIGLU ? 2 * s.F : s.F;
  s.cap = moe_capacity(m, Nfull * cp);  // over the whole sequence's tokens (cp Nfull)
  s.cp = cp;
  s.cp_chunks = cp > 1 && s.cap >= 0 ? Nfull * cp / cfg.seq_len * 2 * cp : s.shares > 1 && s.cap >= 0 ? s.shares : 0;
  s.M_max = s.cap < 0 ? N * s.K : std::min(N * s.K, s.E * s.cap);
  // Worst case at the experts: every EP rank sends all its (kept) rows here. A token chooses K
  // distinct experts, so one expert receives at most N rows (cap when fewer) from each rank.
  const int64_t per_expert = s.cap < 0 ? N : std::min(N, s.cap);
  s.R_max = ep == 1 ? s.M_max : ep * std::min(s.M_max, s.El * per_expert);
  s.recompute_act = recompute_act;
  s.gates = m.transforms_gates();
  s.bias = m.router_enable_expert_bias;
  s.B = moe_row_bound(m, N, ep, s.R_max);
  const int64_t width = s.C + s.FC + (recompute_act ? 0 : s.F);
  // A block over the bound keeps only its input rows (R_max C at most) in the region: B is raised
  // so that B (C + FC + F) >= R_max C (B = R_max already has it).
  s.B = std::max(s.B, std::min(s.R_max, (s.R_max * s.C + width - 1) / width));
  s.rows_region = s.B * width;
  s.shared = m.has_shared_expert();
  if (s.shared) s.sh = MoeSharedExpert::Shape::of(cfg, act, Nfull, tp, recompute_act);
  return s;
}

// What every slot shares: the backward's gradients, the exchange buffers, the recomputed
// activation (moe_act) and, for a block over the bound, its experts' hidden rows a pass at a time.
// The row-wide (C) buffers hold R_max rows, the hidden-wide (F, FC) ones B.
template <class S>
size_t carve_scratch(ArenaCarver& c, const Sizes& z, DType act, S& x) {
  const bool over = z.B < z.R_max;  // a block can exceed the bound
  x.act = z.recompute_act || over ? c.take(z.B * z.F, act) : nullptr;
  x.fc = over ? c.take(z.B * z.FC, act) : nullptr;
  const bool ep = z.ep > 1;
  x.send = ep ? c.take(z.M_max * z.C, act) : nullptr;
  x.src = ep ? c.take(z.R_max * z.C, act) : nullptr;
  x.y_exp = ep ? c.take(z.R_max * z.C, act) : nullptr;
  x.dgates = c.f32(z.N * z.K);
  x.dtopk = z.gates ? c.f32(z.N * z.K) : x.dgates;
  x.dlogits = c.f32(z.N * z.E);
  x.dlogits_act = act == DType::F32 ? nullptr : c.take(z.N * z.E, act);
  x.expert_grad = c.f32(z.E);
  x.select_bias = z.bias ? c.f32(z.E) : nullptr;
  x.dy_local = c.take(z.M_max * z.C, act);
  x.dy_exp = ep ? x.y_exp : x.dy_local;
  x.dact = c.take(z.B * z.F, act);
  x.dfc = c.take(z.B * z.FC, act);
  x.dx_exp = c.take(z.R_max * z.C, act);
  x.dx_local = ep ? c.take(z.M_max * z.C, act) : x.dx_exp;
  x.counts = c.i32(z.E + z.ep * z.El);
  x.cp_counts = z.cp_chunks > 0 ? c.i32(z.cp_chunks * z.E) : nullptr;
  if (z.shared) MoeSharedExpert::carve_scratch(c, z.sh, x.shared);
  return c.used();
}

// One slot: the saved state of each of the chunk's MoE blocks (`layers`, or measure only when it
// is empty). The kept rows (x_exp, fc, act) share one region per block, placed by forward.
// `shared`: the scratch's part of the shared expert (its recomputed activation).
template <class L>
size_t carve_slot(ArenaCarver& c, const Sizes& z, DType act, int64_t moe_blocks, L* const* layers,
                  const MoeSharedExpert::Scratch& shared) {
  for (int64_t j = 0; j < moe_blocks; ++j) {
    L tmp;
    L& s = layers ? *layers[j] : tmp;
    s.logits = c.f32(z.N * z.E);
    s.probs = c.f32(z.N * z.E);
    s.lse = c.f32(z.N);
    s.topk_idx = c.i32(z.N * z.K);
    s.topk_prob = c.f32(z.N * z.K);
    s.gates = z.gates ? c.f32(z.N * z.K) : s.topk_prob;
    s.pos = c.i32(z.N * z.K);
    s.rows = c.i32(z.M_max);
    s.region = c.take(z.rows_region, act);
    s.y_local = c.take(z.M_max * z.C, act);
    s.regroup = z.ep > 1 ? c.i32(z.R_max) : nullptr;
    s.ungroup = z.ep > 1 ? c.i32(z.R_max) : nullptr;
    if (z.shared) MoeSharedExpert::carve_saved(c, z.sh, shared, s.shared);
  }
  return c.used();
}

// Blocks [l0, l0 + layers) (layers < 0: to the model's last).
int64_t layer_end(const ModelConfig& cfg, int64_t l0, int64_t layers) {
  return layers < 0 ? cfg.num_layers : std::min(cfg.num_layers, l0 + layers);
}

int64_t count_moe_blocks(const ModelConfig& cfg, int64_t l0, int64_t layers) {
  int64_t n = 0;
  for (int64_t l = l0; l < layer_end(cfg, l0, layers); ++l) n += cfg.moe.is_moe_layer(l) ? 1 : 0;
  return n;
}

}  // namespace

ActivationSizes MoeLayers::sizes_for(const ModelConfig& cfg, DType act, int64_t N, int64_t ep, int64_t tp,
                                    int64_t l0, int64_t layers, bool recompute_act, int64_t cp, int64_t etp) {
  if (!cfg.moe.enabled() || count_moe_blocks(cfg, l0, layers) == 0) return {};
  const Sizes z = sizes_of(cfg, act, N, ep, tp, recompute_act, cp, etp);
  ActivationSizes out;
  Scratch unused;
  ArenaCarver sc(nullptr), sl(nullptr);
  out.scratch = carve_scratch(sc, z, act, unused);
  out.slot = carve_slot<Layer>(sl, z, act, count_moe_blocks(cfg, l0, layers), nullptr, unused.shared);
  return out;
}

MoeLayers::MoeLayers(const ModelConfig& cfg, const ParamLayout& layout, Backend& be, DType act, int64_t N,
                     Communicator* ep, Communicator* tp, int64_t l0, int64_t layers, bool recompute_act,
                     int64_t slots, const ActivationRegions* regions, Communicator* cp, Communicator* etp,
                     Communicator* eshare, int ep_chunks, bool local_rows)
    : cfg_(cfg),
      layout_(layout),
      be_(be),
      act_(act),
      ep_(ep && ep->size() > 1 ? ep : nullptr),
      tp_(tp && tp->size() > 1 ? tp : nullptr),
      cp_(cp && cp->size() > 1 ? cp : nullptr) {
  const int64_t cp_size = cp_ ? cp_->size() : 1;
  const int64_t tp_size = tp_ ? tp_->size() : 1;
  TETRA_CHECK(layout.slicing.tp == tp_size, "the parameter layout is for tp {}, the MoE blocks for {}",
              layout.slicing.tp, tp_size);
  // Folded experts: the ETP group's partial sums, the share's rows. Unfolded: the TP group's, every row.
  share_ = eshare && eshare->size() > 1 ? eshare : nullptr;
  etp_ = share_ ? (etp && etp->size() > 1 ? etp : nullptr) : tp_;
  const int64_t etp_size = etp_ ? etp_->size() : 1;
  TETRA_CHECK(layout.slicing.expert_tp() == etp_size && tp_size == etp_size * (share_ ? share_->size() : 1),
              "the parameter layout is for etp {} of tp {}, the MoE blocks for etp {} of {} share(s)",
              layout.slicing.expert_tp(), layout.slicing.tp, etp_size, share_ ? share_->size() : 1);
  const int64_t ep_size = ep_ ? ep_->size() : 1;
  TETRA_CHECK(layout.slicing.ep == ep_size && layout.slicing.ep_rank == (ep_ ? ep_->rank() : 0),
              "the parameter layout is for EP rank {} of {}, the model for rank {} of {}", layout.slicing.ep_rank,
              layout.slicing.ep, ep_ ? ep_->rank() : 0, ep_size);
  // Local rows (whole folded experts under SP, moe_local_rows()): the N rows are this rank's share
  // itself, the output their whole value.
  TETRA_CHECK(!local_rows || (share_ && !etp_ && !cfg.moe.has_shared_expert() && !cfg.moe.capacity_factor),
              "MoE blocks on their local rows need whole folded experts, no shared expert and no capacity");
  const Sizes z = sizes_of(cfg, act, N, ep_size, local_rows ? etp_size : tp_size, recompute_act, cp_size, etp_size);
  recompute_act_ = recompute_act;
  Nfull_ = N;
  seq_rows_ = local_rows ? N * share_->size() : N;
  const int64_t share = share_ && !local_rows ? share_->rank() : 0;
  r0_ = std::min(N, share * z.N);
  N_ = std::min(N, r0_ + z.N) - r0_;  // this share's rows (the last shares may hold fewer, or none)
  C_ = z.C, E_ = z.E, K_ = z.K, El_ = z.El, F_ = z.F, FC_ = z.FC, cap_ = z.cap;
  M_max_ = z.M_max, R_max_ = z.R_max, B_ = z.B;
  e0_ = layout.slicing.ep_rank * El_;
  dispatcher_ = std::make_unique<ExpertDispatcher>(ep_, be, act, C_, E_, ep_ ? ep_chunks : 1);
  swiglu_ = cfg.activation == Activation::SWIGLU;
  const int64_t end = layer_end(cfg, l0, layers);
  std::vector<int64_t> blocks;
  for (int64_t l = 0; l < cfg.num_layers; ++l) {
    const bool here = l >= l0 && l < end && cfg.moe.is_moe_layer(l);
    index_of_layer_.push_back(here ? static_cast<int>(blocks.size()) : -1);
    if (here) blocks.push_back(l);
  }
  blocks_ = static_cast<int64_t>(blocks.size());
  sc_ = std::make_unique<Scratch>();
  sc_->h_idx.resize(static_cast<size_t>(N_ * K_));
  sc_->h_counts.resize(static_cast<size_t>(E_ + ep_size * El_));
  sc_->h_regroup.resize(static_cast<size_t>(R_max_));
  sc_->h_ungroup.resize(static_cast<size_t>(R_max_));
  sc_->h_probs.resize(static_cast<size_t>(N_ * E_));
  sc_->h_psum.resize(static_cast<size_t>(E_));
  sc_->h_routed.resize(static_cast<size_t>(E_));
  sc_->h_cp_counts.resize(static_cast<size_t>(z.cp_chunks * E_));
  sc_->h_before.resize(static_cast<size_t>((cp_size > 1 ? z.cp_chunks / cp_size : 1) * E_));
  sc_->h_lse.resize(static_cast<size_t>(N_));
  sc_->h_eg.resize(static_cast<size_t>(E_));
  expert_bias_.assign(blocks.size(), std::vector<float>(static_cast<size_t>(E_), 0.0f));
  for (int64_t l : blocks) {
    MoeLayerStats st;
    st.layer = l;
    st.tokens_per_expert.assign(static_cast<size_t>(E_), 0);
    stats_.layers.push_back(std::move(st));
  }
  if (blocks_ == 0) return;  // no MoE block in this chunk: nothing is kept
  TETRA_CHECK(slots >= 1, "MoE blocks need at least one activation slot, not {}", slots);
  const ActivationSizes size =
      sizes_for(cfg, act, N, ep_size, local_rows ? etp_size : tp_size, l0, layers, recompute_act, cp_size, etp_size);
  ActivationRegions r;
  if (regions) {
    TETRA_CHECK(regions->count >= slots && regions->slot_stride >= size.slot && regions->scratch_bytes >= size.scratch,
                "MoE activation regions of {} slot(s) of {} bytes and {} bytes of scratch, the blocks need {} of {} "
                "and {}", regions->count, regions->slot_stride, regions->scratch_bytes, slots, size.slot,
                size.scratch);
    r = *regions;
  } else {
    bytes_ = size.scratch + static_cast<size_t>(slots) * size.slot;
    arena_ = BackendBuffer(be_, bytes_);
    r = ActivationRegions{arena_.as<char>(), size.scratch, arena_.as<char>() + size.scratch, size.slot, slots};
  }
  ArenaCarver sc(r.scratch);
  carve_scratch(sc, z, act, *sc_);
  if (z.shared) shared_ = std::make_unique<MoeSharedExpert>(be_, z.sh, sc_->shared);
  for (int64_t i = 0; i < slots; ++i) {
    std::vector<Layer*> ptrs;
    for (int64_t l : blocks) {
      layers_.push_back(std::make_unique<Layer>());
      layers_.back()->block = l;
      ptrs.push_back(layers_.back().get());
    }
    ArenaCarver c(r.slot(i));
    carve_slot<Layer>(c, z, act, blocks_, ptrs.data(), sc_->shared);
  }
}

MoeLayers::Layer& MoeLayers::layer(int64_t slot, int64_t l) {
  TETRA_CHECK(l >= 0 && l < static_cast<int64_t>(index_of_layer_.size()) && index_of_layer_[l] >= 0,
              "block {} is not a MoE block of this chunk", l);
  const size_t i = static_cast<size_t>(slot * blocks_ + index_of_layer_[l]);
  TETRA_CHECK(slot >= 0 && i < layers_.size(), "MoE activation slot {} of {}", slot,
              blocks_ > 0 ? layers_.size() / static_cast<size_t>(blocks_) : 0);
  return *layers_[i];
}

MoeLayers::~MoeLayers() = default;

MoeStepStats MoeLayers::take_stats() {
  MoeStepStats out = stats_;
  const ExpertTraffic traffic = dispatcher_->take_traffic();
  out.dispatch_s += traffic.dispatch_s;
  out.combine_s += traffic.combine_s;
  out.dispatch_bytes += traffic.dispatch_bytes;
  out.combine_bytes += traffic.combine_bytes;
  for (MoeLayerStats& l : out.layers)
    if (l.micro_batches > 0) {
      l.aux_loss /= static_cast<double>(l.micro_batches);
      l.z_loss /= static_cast<double>(l.micro_batches);
    }
  for (MoeLayerStats& l : stats_.layers) {
    std::fill(l.tokens_per_expert.begin(), l.tokens_per_expert.end(), 0);
    l.dropped = l.micro_batches = l.max_rows = l.over_bound = 0;
    l.aux_loss = l.z_loss = 0.0;
  }
  stats_.expert_s = stats_.dispatch_s = stats_.combine_s = 0.0;
  stats_.dispatch_bytes = stats_.combine_bytes = 0;
  return out;
}

namespace {

// Calls f(j, a, b) for each local expert j with rows [a, b) of [r0, r1) (expert-major rows,
// expert j's block of n_j rows after those of experts < j).
template <class F>
void for_expert_pieces(const std::vector<int64_t>& expert_rows, int64_t r0, int64_t r1, F&& f) {
  int64_t o = 0;
  for (size_t j = 0; j < expert_rows.size(); ++j) {
    const int64_t a = std::max(o, r0), b = std::min(o + expert_rows[j], r1);
    if (b > a) f(static_cast<int64_t>(j), a, b);
    o += expert_rows[j];
  }
}

// The local experts of one window [r0, r1) as the groups of grouped GEMMs (Backend::gemm_grouped):
// expert j's rows in the window (0 for an expert outside it), one block after another from r0, and
// per expert the pointers of its parameters at `offset` + j `per_expert` (null where the expert
// has no rows in the window, or there is no such parameter: offset < 0).
struct ExpertGroups {
  std::vector<int64_t> rows;
  ExpertGroups(const std::vector<int64_t>& expert_rows, int64_t r0, int64_t r1) : rows(expert_rows.size(), 0) {
    for_expert_pieces(expert_rows, r0, r1, [&](int64_t j, int64_t a, int64_t b) { rows[static_cast<size_t>(j)] = b - a; });
  }
  int64_t count() const { return static_cast<int64_t>(rows.size()); }
  template <class T, class View>
  std::vector<T> per_expert(const View& view, int64_t offset, int64_t per_expert) const {
    std::vector<T> out(rows.size(), nullptr);
    if (offset >= 0)
      for (size_t j = 0; j < rows.size(); ++j)
        if (rows[j] > 0) out[j] = view(offset + static_cast<int64_t>(j) * per_expert);
    return out;
  }
};

}  // namespace

// Each projection and each weight gradient is one grouped GEMM over all local experts (their row
// blocks one after another): the same products as one gemm per expert, bit for bit, run together.
void MoeLayers::experts_forward(const Layer& s, const BlockParams& p, const WeightView& weights, int64_t r0,
                                int64_t r1, void* fc_rows, void* act_rows, void* y_rows) {
  const size_t es = dtype_size(act_);
  const ExpertGroups g(s.x.expert_rows, r0, r1);
  const auto w1 = g.per_expert<const void*>(weights, p.experts_fc_w, FC_ * C_);
  const auto b1 = g.per_expert<const void*>(weights, p.experts_fc_b, FC_);
  const auto w2 = g.per_expert<const void*>(weights, p.experts_proj_w, C_ * F_);
  const bool tp0 = !etp_ || etp_->rank() == 0;  // the proj bias once over the ETP partial sums
  const auto b2 = g.per_expert<const void*>(weights, tp0 ? p.experts_proj_b : -1, C_);
  const char* x = static_cast<const char*>(s.x_exp) + r0 * C_ * es;  // the window's rows
  char* y = static_cast<char*>(y_rows) + r0 * C_ * es;
  // fc = x W1_j^T + b1_j            (n, FC)
  be_.gemm_grouped(false, true, g.count(), g.rows.data(), FC_, C_, 1.0f, x, C_, w1.data(), C_, act_, 0.0f, fc_rows,
                   FC_, act_, b1.data());
  if (r1 > r0) {
    if (swiglu_)
      be_.swiglu_forward(act_rows, fc_rows, r1 - r0, F_, act_);
    else
      be_.gelu_forward(act_rows, fc_rows, (r1 - r0) * F_, act_);
  }
  // y = a W2_j^T + b2_j             (n, C)
  be_.gemm_grouped(false, true, g.count(), g.rows.data(), C_, F_, 1.0f, act_rows, F_, w2.data(), F_, act_, 0.0f, y,
                   C_, act_, b2.data());
}

void MoeLayers::experts_backward(const Layer& s, const BlockParams& p, const WeightView& weights,
                                 const GradTarget& grads, int64_t r0, int64_t r1, void* fc_rows, void* act_rows,
                                 bool refc, bool react) {
  const size_t es = dtype_size(act_);
  const ExpertGroups g(s.x.expert_rows, r0, r1);
  const auto w1 = g.per_expert<const void*>(weights, p.experts_fc_w, FC_ * C_);
  const auto w2 = g.per_expert<const void*>(weights, p.experts_proj_w, C_ * F_);
  const auto gw1 = g.per_expert<void*>(grads, p.experts_fc_w, FC_ * C_);
  const auto gw2 = g.per_expert<void*>(grads, p.experts_proj_w, C_ * F_);
  auto gb = [&](int64_t offset, int64_t j, int64_t per_expert) -> float* { return grads(offset + j * per_expert); };
  const char* x = static_cast<const char*>(s.x_exp) + r0 * C_ * es;  // the window's rows
  const char* dy = static_cast<const char*>(sc_->dy_exp) + r0 * C_ * es;
  char* dx = static_cast<char*>(sc_->dx_exp) + r0 * C_ * es;
  const char* a = static_cast<const char*>(act_rows);
  const char* dfc = static_cast<const char*>(sc_->dfc);
  const int64_t n_rows = r1 - r0;
  if (refc) {  // a block over the bound: fc again, as forward computed it
    const auto b1 = g.per_expert<const void*>(weights, p.experts_fc_b, FC_);
    be_.gemm_grouped(false, true, g.count(), g.rows.data(), FC_, C_, 1.0f, x, C_, w1.data(), C_, act_, 0.0f,
                     fc_rows, FC_, act_, b1.data());
  }
  if (react && n_rows > 0) {  // moe_act (or over the bound): the activation again, from fc
    if (swiglu_)
      be_.swiglu_forward(act_rows, fc_rows, n_rows, F_, act_);
    else
      be_.gelu_forward(act_rows, fc_rows, n_rows * F_, act_);
  }
  // dact = dy W2_j (n, F); dW2_j += dy^T a (C, F); db2_j += colsum dy.
  be_.gemm_grouped(false, false, g.count(), g.rows.data(), F_, C_, 1.0f, dy, C_, w2.data(), F_, act_, 0.0f,
                   sc_->dact, F_, act_);
  be_.gemm_grouped_k(true, false, g.count(), g.rows.data(), C_, F_, 1.0f, dy, C_, a, F_, act_, 1.0f, gw2.data(), F_,
                     DType::F32);
  if (p.experts_proj_b >= 0)
    for_expert_pieces(s.x.expert_rows, r0, r1, [&](int64_t j, int64_t lo, int64_t hi) {
      be_.bias_backward(gb(p.experts_proj_b, j, C_), dy + (lo - r0) * C_ * es, hi - lo, C_, act_);
    });
  if (n_rows > 0) {
    if (swiglu_)
      be_.swiglu_backward(sc_->dfc, fc_rows, sc_->dact, n_rows, F_, act_);
    else
      be_.gelu_backward(sc_->dfc, fc_rows, sc_->dact, n_rows * F_, act_);
  }
  // dx = dfc W1_j (n, C); dW1_j += dfc^T x (FC, C); db1_j += colsum dfc.
  be_.gemm_grouped(false, false, g.count(), g.rows.data(), C_, FC_, 1.0f, dfc, FC_, w1.data(), C_, act_, 0.0f, dx,
                   C_, act_);
  be_.gemm_grouped_k(true, false, g.count(), g.rows.data(), FC_, C_, 1.0f, dfc, FC_, x, C_, act_, 1.0f, gw1.data(),
                     C_, DType::F32);
  if (p.experts_fc_b >= 0)
    for_expert_pieces(s.x.expert_rows, r0, r1, [&](int64_t j, int64_t lo, int64_t hi) {
      be_.bias_backward(gb(p.experts_fc_b, j, FC_), dfc + (lo - r0) * FC_ * es, hi - lo, FC_, act_);
    });
}

void MoeLayers::place_rows(Layer& s) {
  const size_t es = dtype_size(act_);
  char* base = static_cast<char*>(s.region);
  s.over = s.x.R > B_;
  if (!s.over) {  // x_exp (B, C), fc (B, FC), act (B, F) unless recomputed
    s.fc = base + static_cast<size_t>(B_ * C_) * es;
    s.act = recompute_act_ ? sc_->act : base + static_cast<size_t>(B_ * (C_ + FC_)) * es;
  } else {  // only x_exp (R, C) is kept
    s.fc = nullptr;
    s.act = nullptr;
  }
}

void MoeLayers::forward(int64_t l, const WeightView& weights, const void* h, const void* residual, void* out,
                        float loss_weight, int64_t slot) {
  Layer& s = layer(slot, l);
  const BlockParams& p = layout_.blocks[l];
  const size_t es = dtype_size(act_);
  s.loss_weight = loss_weight;
  const void* h_all = h;  // every row (the shared expert's input)
  h = static_cast<const char*>(h) + static_cast<size_t>(r0_ * C_) * es;  // this share's rows
  // Router: fp32 logits, softmax, top-K.
  if (N_ > 0)
    be_.gemm(false, true, N_, E_, C_, 1.0f, h, C_, weights(p.router_w), C_, act_, 0.0f, s.logits, E_, DType::F32);
  if (g_route_bias != MoeRouteBias::kNone) {  // test-only (set_moe_route_bias)
    std::vector<float>& lg = sc_->h_probs;    // (N E), not yet in use
    be_.copy_to_host(lg.data(), s.logits, lg.size() * 4);
    for (int64_t i = 0; i < N_; ++i)
      for (int64_t e = 0; e < (g_route_bias == MoeRouteBias::kOne ? K_ : 1); ++e)
        lg[static_cast<size_t>(i * E_ + e)] += g_route_bias == MoeRouteBias::kOne ? 30.0f : 3.0f;
    be_.copy_from_host(s.logits, lg.data(), lg.size() * 4);
  }
  const float* select_bias = nullptr;
  if (cfg_.moe.router_enable_expert_bias) {  // the block's bias, host state, for the choice
    be_.copy_from_host(sc_->select_bias, expert_bias_[static_cast<size_t>(index_of_layer_[l])].data(),
                       static_cast<size_t>(E_) * 4);
    select_bias = sc_->select_bias;
  }
  if (N_ > 0) be_.moe_router_forward(s.probs, s.lse, s.topk_idx, s.topk_prob, s.logits, N_, E_, K_, score(), select_bias);
  if (s.gates != s.topk_prob && N_ > 0)
    be_.moe_gates_forward(s.gates, s.topk_prob, N_, K_, cfg_.moe.normalizes_gates(),
                          static_cast<float>(cfg_.moe.router_topk_scaling_factor.value_or(1.0)));
  std::vector<int32_t>& idx = sc_->h_idx;
  be_.copy_to_host(idx.data(), s.topk_idx, idx.size() * 4);
  s.plan = plan_routing(idx.data());
  s.M = static_cast<int64_t>(s.plan.rows.size());
  if (N_ > 0) be_.copy_from_host(s.pos, s.plan.pos.data(), s.plan.pos.size() * 4);
  if (s.M > 0) be_.copy_from_host(s.rows, s.plan.rows.data(), static_cast<size_t>(s.M) * 4);

  s.x_exp = s.region;
  if (!ep_) {
    be_.moe_gather_rows(s.x_exp, h, s.rows, s.M, C_, act_);
    s.x.expert_rows = s.plan.kept;
    s.x.R = s.M;
    place_rows(s);
  } else {
    s.x = dispatcher_->exchange_counts(s.plan.kept, sc_->counts, sc_->h_counts, sc_->h_regroup, sc_->h_ungroup);
    TETRA_CHECK(s.x.R <= R_max_, "MoE dispatch: {} rows for this rank's experts, planned for at most {}", s.x.R,
                R_max_);
    place_rows(s);
    if (s.x.R > 0) {
      be_.copy_from_host(s.regroup, sc_->h_regroup.data(), static_cast<size_t>(s.x.R) * 4);
      be_.copy_from_host(s.ungroup, sc_->h_ungroup.data(), static_cast<size_t>(s.x.R) * 4);
    }
    be_.moe_gather_rows(sc_->send, h, s.rows, s.M, C_, act_);
  }
  // Row `row` of a row-major buffer of `width` act values (null stays null).
  auto rows_at = [es](void* base, int64_t row, int64_t width) -> void* {
    return base ? static_cast<char*>(base) + static_cast<size_t>(row * width) * es : nullptr;
  };
  // The experts over rows [a, b) of the expert-major rows (a chunk's, or all of them).
  auto experts = [&](int64_t a, int64_t b, void* y) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!s.over) {
      experts_forward(s, p, weights, a, b, rows_at(s.fc, a, FC_), rows_at(s.act, a, F_), y);
    } else {  // over the bound: passes of B rows through the scratch; backward computes fc again
      // (the passes at multiples of B whatever the chunks: an expert's rows split the same way)
      for (int64_t r0 = a; r0 < b; r0 = std::min(b, (r0 / B_ + 1) * B_))
        experts_forward(s, p, weights, r0, std::min(b, (r0 / B_ + 1) * B_), sc_->fc, sc_->act, y);
    }
    stats_.expert_s += since(t0);
  };
  if (!ep_) {
    experts(0, s.x.R, s.y_local);
  } else {
    // Every chunk's dispatch issued, then chunk j's experts as soon as its rows are in while the
    // later chunks travel, and its combine on its way before chunk j + 1's experts.
    const int chunks = s.x.chunks();
    std::vector<WorkHandle> in(static_cast<size_t>(chunks)), out_w(static_cast<size_t>(chunks));
    for (int j = 0; j < chunks; ++j) in[j] = dispatcher_->start_dispatch(s.x, j, sc_->send, sc_->src);
    for (int j = 0; j < chunks; ++j) {
      dispatcher_->finish_dispatch(s.x, j, in[j], sc_->src, s.regroup, s.x_exp);
      experts(s.x.chunk_rows[j], s.x.chunk_rows[j + 1], sc_->y_exp);
      out_w[j] = dispatcher_->start_combine(s.x, j, sc_->y_exp, sc_->src, s.ungroup, s.y_local);
    }
    for (WorkHandle& w : out_w) dispatcher_->finish_combine(w);
  }
  if (!residual)
    be_.memset_zero(out, static_cast<size_t>(Nfull_ * C_) * es);
  else if (out != residual)
    be_.copy(out, residual, static_cast<size_t>(Nfull_ * C_) * es);
  // (the other shares' rows: their ranks' part of the sum the caller reduces over TP)
  be_.moe_combine(static_cast<char*>(out) + static_cast<size_t>(r0_ * C_) * es, s.y_local, s.pos, s.gates, N_, K_, C_,
                  /*accumulate=*/true, act_);
  if (shared_) {  // every token through the shared expert, added beside the routed ones
    const auto t0 = std::chrono::steady_clock::now();
    shared_->forward(s.shared, p, weights, h_all, out, !tp_ || tp_->rank() == 0);
    stats_.expert_s += since(t0);
  }

  if (loss_weight != 0.0f) {
    const std::vector<float>& probs = sc_->h_probs;
    const std::vector<float>& lse = sc_->h_lse;
    be_.copy_to_host(sc_->h_probs.data(), s.probs, probs.size() * 4);
    be_.copy_to_host(sc_->h_lse.data(), s.lse, lse.size() * 4);
    double aux = 0.0, z = 0.0;
    std::vector<double>& psum = sc_->h_psum;
    for (int64_t e = 0; e < E_; ++e) {
      double pe = 0.0;
      for (int64_t i = 0; i < N_; ++i) pe += probs[i * E_ + e];
      psum[static_cast<size_t>(e)] = pe;
    }
    s.routed_seq.assign(s.plan.routed.begin(), s.plan.routed.end());
    // The sequence's statistics: every share's rows (folded experts) and every CP rank's tokens,
    // summed over those groups through backend scratch.
    const double n_seq = static_cast<double>(seq_rows_) * (cp_ ? static_cast<double>(cp_->size()) : 1.0);
    for (Communicator* group : {share_, cp_}) {
      if (!group) continue;
      std::vector<int32_t>& counts = sc_->h_routed;
      for (int64_t e = 0; e < E_; ++e) counts[static_cast<size_t>(e)] = static_cast<int32_t>(s.routed_seq[e]);
      be_.copy_from_host(sc_->expert_grad, counts.data(), counts.size() * 4);
      group->all_reduce(sc_->expert_grad, E_, DType::I32, ReduceOp::SUM);
      be_.copy_to_host(counts.data(), sc_->expert_grad, counts.size() * 4);
      for (int64_t e = 0; e < E_; ++e) s.routed_seq[static_cast<size_t>(e)] = counts[static_cast<size_t>(e)];
      std::vector<float>& p32 = sc_->h_eg;  // (E) floats, rewritten by the backward before use
      std::copy(psum.begin(), psum.end(), p32.begin());
      be_.copy_from_host(sc_->expert_grad, p32.data(), p32.size() * 4);
      group->all_reduce(sc_->expert_grad, E_, DType::F32, ReduceOp::SUM);
      be_.copy_to_host(p32.data(), sc_->expert_grad, p32.size() * 4);
      std::copy(p32.begin(), p32.end(), psum.begin());
    }
    for (int64_t e = 0; e < E_; ++e)
      aux += psum[static_cast<size_t>(e)] * static_cast<double>(s.routed_seq[static_cast<size_t>(e)]);
    aux *= static_cast<double>(E_) / (n_seq * n_seq * static_cast<double>(K_));
    if (score() == MoeScore::SOFTMAX)  // (sigmoid scores have no z-loss; lse holds their sums)
      for (float v : lse) z += static_cast<double>(v) * v;
    z /= static_cast<double>(std::max<int64_t>(N_, 1));
    MoeLayerStats& st = stats_.layers[index_of_layer_[l]];
    for (int64_t e = 0; e < E_; ++e) st.tokens_per_expert[e] += s.plan.routed[e];
    st.dropped += s.plan.dropped;
    st.max_rows = std::max(st.max_rows, s.x.R);
    st.bound_rows = B_;
    st.over_bound += s.over ? 1 : 0;
    st.aux_loss += aux;
    st.z_loss += z;
    ++st.micro_batches;
  }
}

MoeRoutingPlan MoeLayers::plan_routing(const int32_t* idx) {
  if (share_ && cap_ >= 0) {
    // Folded experts (cp 1, config_validate.cpp): the shares hold consecutive rows of the
    // micro-batch. The assignments of every share to every expert, (shares, E), summed over the
    // share group (a share without rows takes part all the same), give the assignments to each
    // expert that precede this share's rows.
    std::vector<int32_t>& table = sc_->h_cp_counts;
    std::fill(table.begin(), table.end(), 0);
    const int64_t g = share_->rank();
    for (int64_t a = 0; a < N_ * K_; ++a) ++table[static_cast<size_t>(g * E_ + idx[a])];
    be_.copy_from_host(sc_->cp_counts, table.data(), table.size() * 4);
    share_->all_reduce(sc_->cp_counts, static_cast<int64_t>(table.size()), DType::I32, ReduceOp::SUM);
    if (N_ == 0) return plan_moe_routing(idx, 0, K_, E_, cap_);
    be_.copy_to_host(table.data(), sc_->cp_counts, table.size() * 4);
    std::vector<int64_t>& before = sc_->h_before;  // (1, E)
    std::fill(before.begin(), before.end(), 0);
    for (int64_t q = 0; q < g; ++q)
      for (int64_t e = 0; e < E_; ++e) before[static_cast<size_t>(e)] += table[static_cast<size_t>(q * E_ + e)];
    return plan_moe_routing(idx, N_, K_, E_, cap_, before.data(), N_);
  }
  if (!cp_ || cap_ < 0) return plan_moe_routing(idx, N_, K_, E_, cap_);
  // Capacity over the whole sequence (context_parallel.h): of each of the B sequences, this rank
  // holds chunks r and 2 cp - 1 - r of c tokens, back to back. The assignments of every chunk to
  // every expert, (B, 2 cp, E), summed over the CP group, give each local chunk the assignments
  // to each expert that precede it in the sequence's (b, t, k) order: the single-rank run's.
  const int64_t cp = cp_->size(), r = cp_->rank(), c = cfg_.seq_len / (2 * cp), B = N_ / (2 * c);
  std::vector<int32_t>& table = sc_->h_cp_counts;
  std::fill(table.begin(), table.end(), 0);
  for (int64_t a = 0; a < N_ * K_; ++a) {
    const int64_t i = a / K_, b = i / (2 * c), q = i % (2 * c) < c ? r : 2 * cp - 1 - r;
    ++table[static_cast<size_t>((b * 2 * cp + q) * E_ + idx[a])];
  }
  be_.copy_from_host(sc_->cp_counts, table.data(), table.size() * 4);
  cp_->all_reduce(sc_->cp_counts, static_cast<int64_t>(table.size()), DType::I32, ReduceOp::SUM);
  be_.copy_to_host(table.data(), sc_->cp_counts, table.size() * 4);
  std::vector<int64_t>& before = sc_->h_before;  // (B, 2, E): before each local chunk, in local order
  std::vector<int64_t> seen(static_cast<size_t>(E_), 0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t q = 0; q < 2 * cp; ++q) {
      if (q == r || q == 2 * cp - 1 - r)
        std::copy(seen.begin(), seen.end(), before.begin() + ((b * 2 + (q == r ? 0 : 1)) * E_));
      for (int64_t e = 0; e < E_; ++e) seen[static_cast<size_t>(e)] += table[static_cast<size_t>((b * 2 * cp + q) * E_ + e)];
    }
  return plan_moe_routing(idx, N_, K_, E_, cap_, before.data(), c);
}

void MoeLayers::backward(int64_t l, const WeightView& weights, const GradTarget& grads, const void* h, const void* dout, void* dh,
                         int64_t slot) {
  Layer& s = layer(slot, l);
  const BlockParams& p = layout_.blocks[l];
  if (shared_) {  // its parameters' gradients, while dout is whole (dh may be dout's buffer)
    const auto t0 = std::chrono::steady_clock::now();
    shared_->backward_output(s.shared, p, weights, grads, h, dout, tp_);
    stats_.expert_s += since(t0);
  }
  const size_t es = dtype_size(act_);
  const void* h_share = static_cast<const char*>(h) + static_cast<size_t>(r0_ * C_) * es;
  // Combine: dy = g dout at each kept assignment's row; the gates' gradient <dout, y>.
  be_.moe_combine_backward(sc_->dy_local, sc_->dgates, static_cast<const char*>(dout) + static_cast<size_t>(r0_ * C_) * es,
                           s.y_local, s.pos, s.gates, N_, K_, C_, act_);
  if (etp_) etp_->all_reduce(sc_->dgates, N_ * K_, DType::F32);  // y was this rank's partial sum
  // Row `row` of a row-major buffer of `width` act values (null stays null).
  auto rows_at = [es](void* base, int64_t row, int64_t width) -> void* {
    return base ? static_cast<char*>(base) + static_cast<size_t>(row * width) * es : nullptr;
  };
  auto experts = [&](int64_t a, int64_t b) {
    const auto t0 = std::chrono::steady_clock::now();
    if (!s.over) {
      experts_backward(s, p, weights, grads, a, b, rows_at(s.fc, a, FC_), rows_at(s.act, a, F_), false, recompute_act_);
    } else {
      for (int64_t r0 = a; r0 < b; r0 = std::min(b, (r0 / B_ + 1) * B_))
        experts_backward(s, p, weights, grads, r0, std::min(b, (r0 / B_ + 1) * B_), sc_->fc, sc_->act, true, true);
    }
    stats_.expert_s += since(t0);
  };
  if (!ep_) {
    experts(0, s.x.R);
  } else {  // the forward's chunk pipeline, for the output and input gradients
    const int chunks = s.x.chunks();
    std::vector<WorkHandle> in(static_cast<size_t>(chunks)), out_w(static_cast<size_t>(chunks));
    for (int j = 0; j < chunks; ++j) in[j] = dispatcher_->start_dispatch(s.x, j, sc_->dy_local, sc_->src);
    for (int j = 0; j < chunks; ++j) {
      dispatcher_->finish_dispatch(s.x, j, in[j], sc_->src, s.regroup, sc_->dy_exp);
      experts(s.x.chunk_rows[j], s.x.chunk_rows[j + 1]);
      out_w[j] = dispatcher_->start_combine(s.x, j, sc_->dx_exp, sc_->src, s.ungroup, sc_->dx_local);
    }
    for (WorkHandle& w : out_w) dispatcher_->finish_combine(w);
  }
  // dh: this share's rows (the other rows: the other shares' ranks' part of the sum over TP)
  char* dh_share = static_cast<char*>(dh) + static_cast<size_t>(r0_ * C_) * es;
  if (r0_ > 0) be_.memset_zero(dh, static_cast<size_t>(r0_ * C_) * es);
  if (r0_ + N_ < Nfull_) be_.memset_zero(dh_share + static_cast<size_t>(N_ * C_) * es, static_cast<size_t>((Nfull_ - r0_ - N_) * C_) * es);
  be_.moe_combine(dh_share, sc_->dx_local, s.pos, nullptr, N_, K_, C_, /*accumulate=*/false, act_);

  // Router: the gates' gradient, the load-balancing loss (the same additive term on p[:, e] for
  // every row) and the z-loss, through the softmax.
  const double lw = s.loss_weight;
  // The loss's weight is this rank's share of the sequence's (lw = scale x N): the sequence's loss
  // weighs cp x lw, over cp N tokens.
  // (lw weighs the caller's Nfull rows: the share's rows' loss terms are the whole rows' below)
  const double cp = cp_ ? static_cast<double>(cp_->size()) : 1.0, n_seq = cp * static_cast<double>(seq_rows_);
  const double aux_scale = cfg_.moe.aux_loss_coeff * lw * cp * static_cast<double>(E_) / (n_seq * n_seq * static_cast<double>(K_));
  std::vector<float>& eg = sc_->h_eg;
  for (int64_t e = 0; e < E_; ++e)
    eg[e] = static_cast<float>(aux_scale * static_cast<double>(s.routed_seq[static_cast<size_t>(e)]));
  be_.copy_from_host(sc_->expert_grad, eg.data(), eg.size() * 4);
  const float z_scale = static_cast<float>(cfg_.moe.z_loss_coeff * lw / static_cast<double>(seq_rows_));
  if (sc_->dtopk != sc_->dgates && N_ > 0)  // through the renormalisation and scaling
    be_.moe_gates_backward(sc_->dtopk, sc_->dgates, s.topk_prob, N_, K_, cfg_.moe.normalizes_gates(),
                           static_cast<float>(cfg_.moe.router_topk_scaling_factor.value_or(1.0)));
  if (N_ > 0)
    be_.moe_router_backward(sc_->dlogits, s.probs, s.lse, s.topk_idx, sc_->dtopk, sc_->expert_grad, z_scale, N_, E_,
                            K_, score());
  const void* dl = sc_->dlogits;
  if (act_ != DType::F32 && N_ > 0) {
    be_.cast(sc_->dlogits_act, act_, sc_->dlogits, DType::F32, N_ * E_);
    dl = sc_->dlogits_act;
  }
  // dh += dlogits W_r (N, C) (on ETP rank 0: dh is a partial sum the caller reduces over TP);
  // dW_r += dlogits^T h (E, C): the same on every TP rank (the router is replicated) or, folded, the
  // share's part on its ETP rank 0 (a partial sum, reduced over TP: ParamSpec::sp_partial).
  const bool etp0 = !etp_ || etp_->rank() == 0;
  if (etp0 && N_ > 0)
    be_.gemm(false, false, N_, C_, E_, 1.0f, dl, E_, weights(p.router_w), C_, act_, 1.0f, dh_share, C_, act_);
  if ((etp0 || !share_) && N_ > 0)
    be_.gemm(true, false, E_, C_, N_, 1.0f, dl, E_, h_share, C_, act_, 1.0f, grads(p.router_w), C_, DType::F32);
  if (shared_) shared_->backward_input(p, weights, dh, tp_);  // dh += the shared expert's share
}

}  // namespace tetra
