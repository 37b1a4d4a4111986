#include "trainer/plan/step_time.h"

#include <algorithm>
#include <cmath>
#include <set>

#include <fmt/format.h>

#include "trainer/comm/rank_grid.h"
#include "trainer/model/flops.h"
#include "trainer/parallel/comm_volume.h"
#include "trainer/parallel/pipeline_schedule.h"
#include "trainer/train/memory_plan.h"

namespace tetra {

const char* plan_group_name(PlanGroup g) {
  static const char* names[] = {"tp", "cp", "ep", "pp", "dp", "edp", "embedding"};
  return names[static_cast<int>(g)];
}

double StepPrediction::exposed_comm_s() const {
  double t = 0.0;
  for (const GroupTime& g : groups) t += g.exposed_s;
  return t;
}

std::vector<double> simulate_pipeline(ScheduleKind kind, int pp, int vp, int m,
                                      const std::vector<std::vector<double>>& forward,
                                      const std::vector<std::vector<double>>& backward, double message_s,
                                      std::vector<double>* busy) {
  const PipelineSchedule& s = PipelineSchedule::build(kind, pp, vp, m);
  const int S = s.stages();
  std::vector<std::vector<double>> fwd_end(static_cast<size_t>(S), std::vector<double>(static_cast<size_t>(m), -1.0));
  std::vector<std::vector<double>> bwd_end = fwd_end;
  std::vector<double> free_at(static_cast<size_t>(pp), 0.0), work(static_cast<size_t>(pp), 0.0);
  std::vector<size_t> next(static_cast<size_t>(pp), 0);
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < pp; ++r) {
      const auto& list = s.ranks[static_cast<size_t>(r)];
      for (size_t& i = next[static_cast<size_t>(r)]; i < list.size(); ++i) {
        const PipeAction& a = list[i];
        const int st = s.stage_of(r, a.chunk);
        const size_t mb = static_cast<size_t>(a.micro_batch);
        double ready = 0.0;
        if (a.forward && st > 0) {
          if (fwd_end[static_cast<size_t>(st - 1)][mb] < 0) break;
          ready = fwd_end[static_cast<size_t>(st - 1)][mb] + message_s;
        } else if (!a.forward && st < S - 1) {
          if (bwd_end[static_cast<size_t>(st + 1)][mb] < 0) break;
          ready = bwd_end[static_cast<size_t>(st + 1)][mb] + message_s;
        }
        const double d = (a.forward ? forward : backward)[static_cast<size_t>(r)][static_cast<size_t>(a.chunk)];
        const double start = std::max(free_at[static_cast<size_t>(r)], ready);
        free_at[static_cast<size_t>(r)] = start + d;
        work[static_cast<size_t>(r)] += d;
        (a.forward ? fwd_end : bwd_end)[static_cast<size_t>(st)][mb] = start + d;
        progress = true;
      }
    }
  }
  if (busy) *busy = work;
  return free_at;
}

double gemm_seconds(const GpuSpec& g, double peak, double M, double N, double K, double es, double out_es) {
  if (M <= 0 || N <= 0 || K <= 0) return 0.0;
  const double tiles = std::ceil(M / static_cast<double>(g.tile_m)) * std::ceil(N / static_cast<double>(g.tile_n));
  const double sms = static_cast<double>(g.sms);
  // Fewer tiles than SMs: K is split so that the SMs have work (as far as K allows).
  const double split = tiles < sms ? std::max(1.0, std::min(std::floor(sms / tiles), std::floor(K / 256.0))) : 1.0;
  const double units = tiles * split;
  const double wave = units / (std::ceil(units / sms) * sms);
  const double tc = 2.0 * M * N * K / (peak * g.gemm_efficiency * wave);
  const double tm = (es * (M * K + K * N) + out_es * M * N) / (g.hbm_bandwidth * g.hbm_efficiency);
  return std::max(tc, tm) + std::max(g.kernel_overhead, g.gemm_latency);
}

namespace {

struct Rates {
  const GpuSpec& g;
  double peak;
  double gemm(double M, double N, double K, double es, double out_es) const { return gemm_seconds(g, peak, M, N, K, es, out_es); }
  double stream(double bytes) const {
    return bytes <= 0 ? 0.0 : bytes / (g.hbm_bandwidth * g.hbm_efficiency) + g.kernel_overhead;
  }
};

// One op's forward and backward seconds.
struct Op {
  std::string name;
  double fwd = 0.0, bwd = 0.0;
};

// The ring model of one group's collectives per step.
double group_seconds(const GroupVolume& v, int64_t g, const LinkSpec& link) {
  if (g <= 1) return 0.0;
  const double gf = static_cast<double>(g), frac = (gf - 1.0) / gf;
  double t = 0.0;
  auto at = [&](CommOp op) { return static_cast<int>(op); };
  auto payload = [&](CommOp op) { return static_cast<double>(v.payload_bytes[static_cast<size_t>(at(op))]); };
  auto calls = [&](CommOp op) { return static_cast<double>(v.calls[static_cast<size_t>(at(op))]); };
  t += 2.0 * frac * payload(CommOp::ALL_REDUCE) / link.bandwidth + 2.0 * (gf - 1.0) * link.latency * calls(CommOp::ALL_REDUCE);
  for (CommOp op : {CommOp::REDUCE_SCATTER, CommOp::ALL_GATHER, CommOp::ALL_TO_ALL})
    t += frac * payload(op) / link.bandwidth + (gf - 1.0) * link.latency * calls(op);
  t += payload(CommOp::BROADCAST) / link.bandwidth + (gf - 1.0) * link.latency * calls(CommOp::BROADCAST);
  t += payload(CommOp::SEND) / link.bandwidth + link.latency * calls(CommOp::SEND);
  return t;
}

// The link `rank`'s group of `kind` runs on: intra_node when its members share one node; else the
// network, whose bus bandwidth grows with the group's members per node (NCCL runs a ring per NIC,
// each carrying its share; each GPU has its own NIC), up to the node's own links. A ring over the
// group crosses the network once per node it spans and NVLink between the other neighbours: the
// latency of one ring step is the mean of the two over the ring's edges (NCCL's own tuning model
// counts the hops of each kind the same way).
std::pair<LinkSpec, bool> group_link(const RankGrid& grid, GroupKind kind, int rank, const ClusterSpec& c) {
  const std::vector<int> members = grid.group(kind, rank);
  int64_t same_node = 0;
  std::set<int64_t> nodes;
  for (int m : members) {
    nodes.insert(m / c.gpus_per_node);
    if (m / c.gpus_per_node == rank / c.gpus_per_node) ++same_node;
  }
  if (nodes.size() == 1) return {c.intra, false};
  LinkSpec link = c.inter;
  link.bandwidth = std::min(c.intra.bandwidth, c.inter.bandwidth * static_cast<double>(std::max<int64_t>(1, same_node)));
  const double g = static_cast<double>(members.size()), k = static_cast<double>(nodes.size());
  link.latency = (k * c.inter.latency + (g - k) * c.intra.latency) / g;
  return {link, true};
}

// The part of the expert-parallel exchanges' time `total` (s, over `exchanges` block forwards and
// backwards of micro-batches) not hidden behind the experts' compute (`fwd`, `bwd` s per block)
// when each exchange is split into `chunks` (expert_dispatch.h's pipeline): every chunk's
// dispatch issued at once, chunk j's experts once its rows are in, its combine issued after them,
// the exchanges in issue order on one link. 1 without overlap.
double ep_exposed_fraction(int64_t chunks, double fwd, double bwd, double total, double exchanges) {
  if (chunks <= 1 || total <= 0.0 || exchanges <= 0.0) return 1.0;
  const double c = static_cast<double>(chunks);
  const double half = total / (2.0 * exchanges) / 2.0;  // dispatch, and combine, of one pass
  double exposed = 0.0;
  for (const double e : {fwd, bwd}) {
    double link = 0.0, compute = 0.0;
    std::vector<double> arrived;
    for (int64_t j = 0; j < chunks; ++j) arrived.push_back(link += half / c);
    for (int64_t j = 0; j < chunks; ++j) {
      compute = std::max(compute, arrived[static_cast<size_t>(j)]) + e / c;
      link = std::max(link, compute) + half / c;
    }
    exposed += std::max(link, compute) - e;
  }
  return std::clamp(exposed * exchanges / total, 0.0, 1.0);
}

}  // namespace

StepPrediction predict_step(const Config& cfg, const ClusterSpec& cluster, const PlanOptions& opt) {
  const ModelConfig& M = cfg.model;
  const ParallelConfig& P = cfg.parallel;
  const TrainingConfig& Tr = cfg.training;
  const GpuSpec& gpu = cluster.gpu;
  const Rates rate{gpu, gpu.peak(Tr.precision)};
  const double a = static_cast<double>(dtype_size(precision_dtype(Tr.precision)));
  const double tp = static_cast<double>(P.tp);
  const double N = static_cast<double>(Tr.micro_batch_size * M.seq_len / P.cp);  // rows per rank
  const double Nn = P.sequence_parallel ? N / tp : N;                         // rows of norms and residual
  const double C = static_cast<double>(M.hidden_size), hs = static_cast<double>(M.head_size());
  const double H = static_cast<double>(M.num_heads) / tp, Hkv = static_cast<double>(M.num_kv_heads) / tp;
  const bool gated = M.activation == Activation::SWIGLU;
  const double F = static_cast<double>(M.ffn_hidden_size) / tp;
  const double Vl = static_cast<double>(M.padded_vocab_size(P.tp)) / tp;
  const int pp = static_cast<int>(P.pp), vp = static_cast<int>(P.virtual_stages);
  const int m = static_cast<int>(cfg.grad_accum_steps());
  auto recomputes = [&](RecomputeModule mod) {
    return Tr.recompute == Recompute::SELECTIVE &&
           std::find(Tr.recompute_modules.begin(), Tr.recompute_modules.end(), mod) != Tr.recompute_modules.end();
  };

  // ---- one layer, one micro-batch --------------------------------------------------------------
  // A GEMM y (rows, out) = x (rows, in) W^T: forward, then backward's input and weight gradients
  // (the latter accumulated in fp32).
  auto linear = [&](const std::string& name, double rows, double in, double out) {
    return Op{name, rate.gemm(rows, out, in, a, a), rate.gemm(rows, in, out, a, a) + rate.gemm(out, in, rows, a, 4.0)};
  };
  auto stream_op = [&](const std::string& name, double fwd_bytes, double bwd_bytes) {
    return Op{name, rate.stream(fwd_bytes), rate.stream(bwd_bytes)};
  };
  // Causal pairs of this rank (context parallel: 1 / cp of them, balanced), per sequence.
  const double T = static_cast<double>(M.seq_len);
  const double pairs = static_cast<double>(Tr.micro_batch_size) * T * (T + 1.0) / 2.0 / static_cast<double>(P.cp);
  const double attn_flops = 4.0 * hs * H * pairs;
  const Op attention{"attention", attn_flops / (rate.peak * gpu.attention_forward_efficiency) + gpu.kernel_overhead,
                     2.5 * attn_flops / (rate.peak * gpu.attention_backward_efficiency) + gpu.kernel_overhead};

  std::vector<Op> common = {
      stream_op("norm 1", 2 * Nn * C * a, 4 * Nn * C * a),
      linear("qkv", N, C, (H + 2 * Hkv) * hs),
      stream_op("rope", M.position == Position::ROPE ? 2 * N * (H + Hkv) * hs * a : 0.0,
                M.position == Position::ROPE ? 2 * N * (H + Hkv) * hs * a : 0.0),
      attention,
      linear("attention proj", N, H * hs, C),
      stream_op("residual 1", 3 * Nn * C * a, 3 * Nn * C * a),
      stream_op("norm 2", 2 * Nn * C * a, 4 * Nn * C * a),
  };
  std::vector<Op> dense = {
      linear("mlp fc", N, C, (gated ? 2 : 1) * F),
      stream_op(gated ? "swiglu" : "gelu", (gated ? 3 : 2) * N * F * a, (gated ? 5 : 3) * N * F * a),
      linear("mlp proj", N, F, C),
      stream_op("residual 2", 3 * Nn * C * a, 3 * Nn * C * a),
  };
  std::vector<Op> moe;
  double expert_fwd = 0.0, expert_bwd = 0.0;  // a MoE block's experts (the EP exchanges' overlap)
  if (M.moe.enabled()) {
    const double E = static_cast<double>(M.moe.num_experts), k = static_cast<double>(M.moe.top_k);
    const double ep = static_cast<double>(P.ep), El = E / ep;
    // Folded experts (parallel.etp < tp): each expert split over etp ranks, each share of the TP
    // group routing N / shares rows.
    const double etp = static_cast<double>(P.expert_tp()), shares = static_cast<double>(P.expert_shares());
    const double Fe = static_cast<double>(M.moe.ffn_hidden_size > 0 ? M.moe.ffn_hidden_size : M.ffn_hidden_size) / etp;
    const double rows = N / shares * k / El;  // per local expert, balanced routing
    Op router = linear("router", N, C, E);
    router.fwd += rate.stream(4 * N * E * 4), router.bwd += rate.stream(4 * N * E * 4);
    Op fc = linear("experts fc", rows, C, (gated ? 2 : 1) * Fe), proj = linear("experts proj", rows, Fe, C);
    for (Op* op : {&fc, &proj}) op->fwd *= El, op->bwd *= El;
    const Op act = stream_op(gated ? "swiglu" : "gelu", (gated ? 3 : 2) * N / shares * k * Fe * a,
                             (gated ? 5 : 3) * N / shares * k * Fe * a);
    expert_fwd = fc.fwd + act.fwd + proj.fwd, expert_bwd = fc.bwd + act.bwd + proj.bwd;
    moe = {router,
           stream_op("dispatch and combine", 4 * N * k * C * a, 4 * N * k * C * a),
           fc, act, proj};
    if (M.moe.has_shared_expert()) {  // every token through it (its gate a C-wide dot per token)
      const double Fs = static_cast<double>(M.moe.shared_expert_ffn_hidden_size) / tp;
      moe.push_back(linear("shared expert fc", N, C, (gated ? 2 : 1) * Fs));
      moe.push_back(stream_op(gated ? "swiglu" : "gelu", (gated ? 3 : 2) * N * Fs * a, (gated ? 5 : 3) * N * Fs * a));
      moe.push_back(linear("shared expert proj", N, Fs, C));
      if (M.moe.shared_expert_gate) moe.push_back(stream_op("shared expert gate", 3 * N * C * a, 4 * N * C * a));
    }
    moe.push_back(stream_op("residual 2", 3 * Nn * C * a, 3 * Nn * C * a));
  }
  // The forward recomputed in backward per layer (full: everything; selective: its modules).
  auto recompute_of = [&](const std::vector<Op>& ops, bool full) {
    double t = 0.0;
    for (const Op& op : ops) {
      const bool again = full || (op.name == "attention" && recomputes(RecomputeModule::CORE_ATTN)) ||
                         ((op.name == "gelu" || op.name == "swiglu") &&
                          (recomputes(RecomputeModule::ACT) || recomputes(RecomputeModule::MOE_ACT))) ||
                         (op.name.starts_with("norm") && recomputes(RecomputeModule::NORM));
      if (again) t += op.fwd;
    }
    return t;
  };
  // A layer's ops: the attention half, then its MLP (dense or MoE).
  auto layer_ops = [&](bool is_moe) {
    std::vector<Op> ops = common;
    const std::vector<Op>& mlp = is_moe ? moe : dense;
    ops.insert(ops.end(), mlp.begin(), mlp.end());
    return ops;
  };
  // One layer's times by kind (dense or MoE) and full recomputation (off or on), computed once.
  struct LayerTime {
    double fwd = 0, bwd = 0, recompute = 0, attention = 0;
  };
  LayerTime layer_time[2][2];
  for (const bool is_moe : {false, true})
    for (const bool full_recompute : {false, true}) {
      LayerTime& lt = layer_time[is_moe][full_recompute];
      const std::vector<Op> ops = layer_ops(is_moe);
      for (const Op& op : ops) lt.fwd += op.fwd, lt.bwd += op.bwd;
      lt.recompute = recompute_of(ops, full_recompute);
      lt.attention = attention.fwd + attention.bwd +
                     (full_recompute || recomputes(RecomputeModule::CORE_ATTN) ? attention.fwd : 0.0);
    }
  // Embedding (first stage) and the head: final norm, output layer, loss (last stage).
  const Op embedding = stream_op("embedding", 2 * N * C * a, 2 * N * C * 4);
  Op head = linear("output layer", N, C, Vl);
  head.fwd += rate.stream(2 * Nn * C * a) + rate.stream(3 * N * Vl * a);
  head.bwd += rate.stream(4 * Nn * C * a);

  // ---- per pipeline rank and chunk --------------------------------------------------------------
  const std::vector<int64_t> stage_layers = cfg.pipeline_stage_layers();
  std::vector<int64_t> first_layer(stage_layers.size(), 0);
  for (size_t s = 1; s < stage_layers.size(); ++s) first_layer[s] = first_layer[s - 1] + stage_layers[s - 1];
  const int S = pp * vp;
  std::vector<std::vector<double>> fwd(static_cast<size_t>(pp), std::vector<double>(static_cast<size_t>(vp), 0.0));
  std::vector<std::vector<double>> bwd = fwd, recompute = fwd, attn = fwd;
  for (int r = 0; r < pp; ++r)
    for (int c = 0; c < vp; ++c) {
      const int s = c * pp + r;
      const int64_t n = stage_layers[static_cast<size_t>(s)];
      // Full recomputation: uniform units recompute every layer; block recomputes the chunk's first
      // recompute_num_layers layers.
      for (int64_t i = 0; i < n; ++i) {
        const bool full = Tr.recompute == Recompute::FULL &&
                          (Tr.recompute_method == RecomputeMethod::UNIFORM || i < Tr.recompute_num_layers);
        const LayerTime& lt = layer_time[M.moe.is_moe_layer(first_layer[static_cast<size_t>(s)] + i)][full];
        fwd[r][c] += lt.fwd, bwd[r][c] += lt.bwd + lt.recompute, recompute[r][c] += lt.recompute;
        attn[r][c] += lt.attention;
      }
      if (s == 0) fwd[r][c] += embedding.fwd, bwd[r][c] += embedding.bwd;
      if (s == S - 1) fwd[r][c] += head.fwd, bwd[r][c] += head.bwd;
    }

  // MoE blocks' forwards (= backwards) of micro-batches on pipeline rank r in a step.
  auto moe_exchanges = [&](int r) {
    double n = 0.0;
    if (!M.moe.enabled()) return n;
    for (int c = 0; c < vp; ++c) {
      const int s = c * pp + r;
      for (int64_t i = 0; i < stage_layers[static_cast<size_t>(s)]; ++i)
        n += M.moe.is_moe_layer(first_layer[static_cast<size_t>(s)] + i) ? 1.0 : 0.0;
    }
    return n * m;
  };

  // ---- communication per group ------------------------------------------------------------------
  GridSizes sizes;
  sizes.world = P.world(), sizes.tp = P.tp, sizes.pp = P.pp, sizes.dp = P.dp, sizes.ep = P.ep, sizes.cp = P.cp;
  sizes.etp = P.expert_tp();
  sizes.order = std::string(to_string(P.order));
  const RankGrid grid = RankGrid::build(sizes);
  StepPrediction out;
  auto link_of = [&](GroupKind kind, int rank) { return group_link(grid, kind, rank, cluster); };
  // With an even split the middle pipeline ranks are alike (the same layers, no embedding or
  // head): one stands for all.
  const bool even = std::all_of(stage_layers.begin(), stage_layers.end(), [&](int64_t n) { return n == stage_layers[0]; });
  std::vector<int> ranks;
  for (int r = 0; r < pp; ++r)
    if (!even || r == 0 || r == 1 || r == pp - 1) ranks.push_back(r);
  double best_step = -1.0;
  for (int r : ranks) {
    const int rank = grid.rank_of(0, 0, r, 0);
    const ParamLayout layout = rank_layout(cfg, 0, r, 0);
    StepVolume vol = predict_step_volume(cfg, layout);
    // MoE all-to-alls: the prediction counts the calls; balanced routing gives the payload.
    if (M.moe.enabled() && P.ep > 1) {
      const int idx = static_cast<int>(CommOp::ALL_TO_ALL);
      const double token_bytes = N / static_cast<double>(P.expert_shares()) * static_cast<double>(M.moe.top_k) * C * a;
      // Of the 1 + 4 c all-to-alls per block and micro-batch (c = ep_overlap_chunks), the 4 c
      // exchanges of dispatch, combine and their gradients carry the tokens, 4 token_bytes in all;
      // the first, the per-expert counts.
      const double per_block = static_cast<double>(1 + 4 * P.ep_overlap_chunks);
      vol.ep.payload_bytes[static_cast<size_t>(idx)] =
          static_cast<int64_t>(static_cast<double>(vol.ep.calls[static_cast<size_t>(idx)]) / per_block * 4.0 * token_bytes);
    }
    std::array<GroupTime, kPlanGroups> gt{};
    auto set = [&](PlanGroup g, GroupKind kind, const GroupVolume& v, int64_t size) {
      const auto [link, inter] = link_of(kind, rank);
      gt[static_cast<size_t>(g)] = GroupTime{size, inter, group_seconds(v, size, link), 0.0};
    };
    set(PlanGroup::TP, GroupKind::TP, vol.tp, P.tp);
    set(PlanGroup::CP, GroupKind::CP, vol.cp, P.cp);
    set(PlanGroup::EP, GroupKind::EP, vol.ep, P.ep);
    set(PlanGroup::PP, GroupKind::PP, vol.pp, P.pp);
    set(PlanGroup::DP, GroupKind::DP, vol.dp, P.dp_cp());
    if (M.moe.enabled()) set(PlanGroup::EDP, GroupKind::EDP, vol.edp, P.edp_cp());
    if (M.tie_embeddings && P.pp > 1)  // the first and last stages' shared word embeddings
      set(PlanGroup::EMBEDDING, GroupKind::EMBEDDING, vol.embedding, static_cast<int64_t>(grid.group(GroupKind::EMBEDDING, rank).size()));
    auto g = [&](PlanGroup k) -> GroupTime& { return gt[static_cast<size_t>(k)]; };

    // Within each action: TP and EP on the critical path, CP behind the attention, spread over
    // the rank's actions in proportion to their compute.
    double compute_total = 0.0, attention_total = 0.0;
    for (int c = 0; c < vp; ++c) compute_total += m * (fwd[r][c] + bwd[r][c]), attention_total += m * attn[r][c];
    GroupTime& tpg = g(PlanGroup::TP);
    tpg.exposed_s = opt.tp_overlap ? std::max(0.0, tpg.total_s - compute_total) : tpg.total_s;
    g(PlanGroup::EP).exposed_s = g(PlanGroup::EP).total_s * ep_exposed_fraction(P.ep_overlap_chunks, expert_fwd,
                                                                                  expert_bwd, g(PlanGroup::EP).total_s,
                                                                                  moe_exchanges(r));
    GroupTime& cpg = g(PlanGroup::CP);
    cpg.exposed_s = P.cp_comm == CpComm::P2P ? std::max(0.0, cpg.total_s - attention_total) : cpg.total_s;
    const double in_action = tpg.exposed_s + g(PlanGroup::EP).exposed_s + cpg.exposed_s;
    const double stretch = compute_total > 0 ? 1.0 + in_action / compute_total : 1.0;
    std::vector<std::vector<double>> f = fwd, b = bwd;
    for (auto& row : f)
      for (double& x : row) x *= stretch;
    for (auto& row : b)
      for (double& x : row) x *= stretch;
    // One activation message between stages.
    const int send = static_cast<int>(CommOp::SEND);
    double message = 0.0;
    if (pp > 1 && vol.pp.calls[static_cast<size_t>(send)] > 0) {
      const auto [link, inter] = link_of(GroupKind::PP, rank);
      (void)inter;
      message = static_cast<double>(vol.pp.payload_bytes[static_cast<size_t>(send)]) /
                    static_cast<double>(vol.pp.calls[static_cast<size_t>(send)]) / link.bandwidth +
                link.latency;
    }
    g(PlanGroup::PP).exposed_s = 0.0;  // inside the simulated span
    std::vector<double> busy;
    const std::vector<double> finish = simulate_pipeline(P.schedule, pp, vp, m, f, b, message, &busy);
    const double span = *std::max_element(finish.begin(), finish.end());

    // DP: buckets behind the last micro-batch's backward (ZeRO-2/3: every micro-batch's), the last
    // bucket exposed; the weights' all-gather after the update.
    double last_bwd = 0.0;
    for (int c = 0; c < vp; ++c) last_bwd += b[r][c];
    const double params = static_cast<double>(layout.count());
    const double bucket = static_cast<double>(P.gradient_bucket_size());
    for (PlanGroup k : {PlanGroup::DP, PlanGroup::EDP}) {
      GroupTime& d = g(k);
      if (d.total_s <= 0) continue;
      const double buckets = std::max(1.0, std::ceil(params / bucket));
      double gather = 0.0, reduce = d.total_s;
      if (P.zero_stage >= 1) {  // the share of all-gathers (updated weights, ZeRO-3's units)
        const GroupVolume& v = k == PlanGroup::DP ? vol.dp : vol.edp;
        const double ag = static_cast<double>(v.payload_bytes[static_cast<size_t>(CommOp::ALL_GATHER)]);
        gather = d.total_s * ag / std::max(1.0, static_cast<double>(v.total_payload()));
        reduce = d.total_s - gather;
      }
      const double window = P.zero_stage >= 2 ? m * last_bwd : last_bwd;
      double exposed = std::max(reduce / buckets, reduce - window);
      if (P.zero_stage == 3)
        exposed += std::max(0.0, gather - compute_total);
      else if (!opt.param_gather_overlap)
        exposed += gather;
      else
        exposed += std::max(0.0, gather - f[r][0]);
      d.exposed_s = exposed;
    }
    g(PlanGroup::EMBEDDING).exposed_s = g(PlanGroup::EMBEDDING).total_s;

    // The update: fp32 master, two moments and gradient read and written, the compute weights
    // written, the gradient norm and zeroing (bytes per parameter of the rank's shard).
    const double owned = P.zero_stage >= 1 ? params / static_cast<double>(P.dp_cp()) : params;
    const double optimizer = rate.stream(owned * (28.0 + a + 8.0)) + rate.stream(params * 4.0);

    double exposed = 0.0;
    for (PlanGroup k : {PlanGroup::DP, PlanGroup::EDP, PlanGroup::EMBEDDING}) exposed += g(k).exposed_s;
    const double step = span + exposed + optimizer;
    if (step > best_step) {
      best_step = step;
      out.step_s = step;
      out.critical_pp_rank = r;
      out.optimizer_s = optimizer;
      out.groups = gt;
      double rec = 0.0;
      for (int c = 0; c < vp; ++c) rec += m * recompute[r][c];
      out.compute_s = compute_total;
      out.recompute_s = rec;
      out.bubble_s = span - busy[static_cast<size_t>(r)];
    }
  }
  // The critical rank's ops, per layer and micro-batch.
  {
    for (const Op& op : layer_ops(M.moe.enabled())) out.ops.push_back({op.name, {op.fwd, op.bwd}});
    out.ops.push_back({"embedding (first stage)", {embedding.fwd, embedding.bwd}});
    out.ops.push_back({"head and loss (last stage)", {head.fwd, head.bwd}});
  }
  Config whole = cfg;
  whole.parallel.tp = whole.parallel.pp = whole.parallel.ep = whole.parallel.cp = 1;
  whole.parallel.etp.reset();
  whole.parallel.ep_overlap_chunks = 1;
  whole.parallel.virtual_stages = 1;
  whole.parallel.stage_layers.clear();
  const ModelStats stats = model_stats(M, rank_layout(whole, 0, 0, 0));
  const double tokens = static_cast<double>(Tr.global_batch_size * M.seq_len);
  out.tokens_per_s_per_gpu = tokens / out.step_s / static_cast<double>(P.world());
  out.mfu = out.tokens_per_s_per_gpu * stats.train_flops_per_token / gpu.peak(Tr.precision);
  return out;
}

}  // namespace tetra
