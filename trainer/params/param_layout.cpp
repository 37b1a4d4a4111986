#include "trainer/params/param_layout.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "kernels/common/math.h"
#include "kernels/common/check.h"

namespace tetra {

namespace {

constexpr int64_t kAlign = 16;

struct LayoutBuilder {
  ParamLayout& layout;
  int group = 0;

  int64_t add(std::string name, std::vector<int64_t> global_shape, ParamInit init, bool decay,
              bool matmul, std::vector<RowBlock> row_blocks = {}, int64_t col_start = 0,
              int64_t cols = -1, std::vector<int64_t> local_shape = {}, int64_t pad_rows = 0) {
    ParamSpec p;
    p.name = std::move(name);
    p.global_shape = global_shape;
    p.shape = std::move(global_shape);
    p.row_blocks = std::move(row_blocks);
    p.col_start = col_start;
    if (!local_shape.empty()) {
      p.shape = std::move(local_shape);
    } else {
      if (!p.row_blocks.empty()) {
        int64_t rows = pad_rows;
        for (const RowBlock& b : p.row_blocks) rows += b.rows;
        p.shape[0] = rows;
      }
      p.pad_rows = pad_rows;
      if (cols >= 0) p.shape[1] = cols;
    }
    p.tp_split = p.shape != p.global_shape;
    p.numel = 1;
    for (int64_t d : p.shape) p.numel *= d;
    p.offset = layout.total;
    p.group = group;
    p.init = init;
    p.weight_decay = decay;
    p.matmul = matmul;
    layout.total += math::round_up(p.numel, kAlign);
    layout.params.push_back(std::move(p));
    return layout.params.back().offset;
  }
  // Replicated over TP; its gradient is a per-shard partial sum under sequence parallelism.
  int64_t norm_param(std::string name, int64_t C, ParamInit init) {
    const int64_t off = add(std::move(name), {C}, init, false, false);
    layout.params.back().sp_partial = layout.slicing.sequence_parallel && layout.slicing.tp > 1;
    return off;
  }
  // One tensor of the experts [e0, e0 + El) this EP rank holds, each expert's ETP slice as the dense
  // MLP's TP slice (fc rows [r F/p, (r+1) F/p) of gate and up; proj columns; proj bias replicated). The
  // slices are row blocks and a column range of the tensor's 2-D view (param_layout.h).
  enum class Expert { FC_W, FC_B, PROJ_W, PROJ_B };
  int64_t expert(std::string name, Expert part, int64_t E, int64_t C, int64_t F, bool swiglu, ParamInit init,
                 bool decay, bool matmul) {
    const TensorSlicing& s = layout.slicing;
    const int64_t p = s.expert_tp(), r = s.expert_tp_rank(), El = E / s.ep, e0 = s.ep_rank * El, Fl = F / p;
    const int64_t FCg = swiglu ? 2 * F : F, FCl = swiglu ? 2 * Fl : Fl;
    const bool split = p > 1 || s.ep > 1;
    std::vector<RowBlock> rows;
    std::vector<int64_t> global, local;
    int64_t col_start = 0;
    switch (part) {
      case Expert::FC_W:
        global = {E, FCg, C}, local = {El, FCl, C};
        if (p == 1 && split) rows.push_back({e0 * FCg, El * FCg});
        if (p > 1)
          for (int64_t e = e0; e < e0 + El; ++e) {
            rows.push_back({e * FCg + r * Fl, Fl});
            if (swiglu) rows.push_back({e * FCg + F + r * Fl, Fl});
          }
        break;
      case Expert::FC_B:
        global = {E, FCg}, local = {El, FCl};
        if (swiglu && p > 1) {  // expert e's row: its gate columns [r Fl, ..), then its up columns [F + r Fl, ..)
          for (int64_t e = e0; e < e0 + El; ++e) {
            rows.push_back({e, 1, r * Fl, Fl});
            rows.push_back({e, 1, F + r * Fl, Fl});
          }
        } else {
          if (s.ep > 1) rows.push_back({e0, El});
          col_start = r * Fl;
        }
        break;
      case Expert::PROJ_W:
        global = {E, C, F}, local = {El, C, Fl};
        if (s.ep > 1) rows.push_back({e0 * C, El * C});
        col_start = r * Fl;
        break;
      case Expert::PROJ_B:
        global = {E, C}, local = {El, C};
        if (s.ep > 1) rows.push_back({e0, El});
        break;
    }
    const int64_t off = add(std::move(name), global, init, decay, matmul, rows, col_start, -1, local);
    ParamSpec& ps = layout.params.back();
    ps.tp_split = p > 1 && part != Expert::PROJ_B;
    ps.ep_split = s.ep > 1;
    ps.expert = true;
    return off;
  }
  void end_group() {
    const int64_t begin = layout.groups.empty() ? 0 : layout.groups.back().second;
    layout.total = math::round_up(layout.total, layout.slicing.group_align);
    layout.groups.emplace_back(begin, layout.total);
    ++group;
  }
};

}  // namespace

int64_t ParamSpec::held() const {
  return numel - pad_rows * (shape.size() > 1 ? shape.back() : 1);
}

int64_t ParamSpec::global_index(int64_t i) const {
  if (!tp_split && !ep_split) return i;
  const int64_t cols = shape.size() > 1 ? shape.back() : 1;
  const int64_t gcols = global_shape.size() > 1 ? global_shape.back() : 1;
  int64_t start = 0;  // local index of the block's first element
  for (const RowBlock& b : row_blocks) {
    const int64_t bc = b.cols > 0 ? b.cols : cols, c0 = b.cols > 0 ? b.col0 : col_start;
    if (i < start + b.rows * bc) return (b.global_start + (i - start) / bc) * gcols + c0 + (i - start) % bc;
    start += b.rows * bc;
  }
  // No row blocks: every row (past them: the vocabulary's padding, which no caller asks for).
  return i / cols * gcols + col_start + i % cols;
}

std::vector<RowBlock> ParamSpec::blocks() const {
  const int64_t cols = shape.size() > 1 ? shape.back() : 1;
  std::vector<RowBlock> out;
  if (row_blocks.empty()) {
    int64_t rows = 1;  // of the 2-D view: every dim but the last
    for (size_t d = 0; d + 1 < shape.size(); ++d) rows *= shape[d];
    out.push_back({0, shape.size() > 1 ? rows : (shape.empty() ? 1 : shape[0]), col_start, cols});
    return out;
  }
  for (const RowBlock& b : row_blocks)
    out.push_back(b.cols > 0 ? b : RowBlock{b.global_start, b.rows, col_start, cols});
  return out;
}

ParamLayout ParamLayout::build(const ModelConfig& m, const TensorSlicing& slicing, const StageSlice& stage_in) {
  const int64_t p = slicing.tp, r = slicing.tp_rank;
  const int64_t C = m.hidden_size, V = m.vocab_size, HS = m.head_size();
  const int64_t NH = m.num_heads, NKV = m.num_kv_heads, F = m.ffn_hidden_size;
  TETRA_CHECK(p >= 1 && r >= 0 && r < p, "bad tensor-parallel rank {} of {}", r, p);
  // The config validation reports these to the user; here they are invariants.
  TETRA_CHECK(NH % p == 0 && NKV % p == 0 && F % p == 0, "tp {} must divide num_heads {}, num_kv_heads {}, "
              "ffn_hidden_size {}", p, NH, NKV, F);
  const int64_t Vl = m.padded_vocab_size(p) / p, Vr = m.vocab_rows(p, r);  // rows held, real rows
  TETRA_CHECK(Vr > 0, "tp rank {} of {} would hold only vocabulary padding ({} rows of {} padded to {})", r, p, Vl,
              V, Vl * p);
  TETRA_CHECK(slicing.group_align >= kAlign && slicing.group_align % kAlign == 0,
              "group_align {} must be a positive multiple of {}", slicing.group_align, kAlign);
  const int64_t NHl = NH / p, NKVl = NKV / p, Fl = F / p;
  const bool swiglu = m.activation == Activation::SWIGLU;
  const bool norm_bias = m.norm == Norm::LAYERNORM && m.bias;

  StageSlice stage = stage_in;
  if (stage.chunks.empty()) stage.chunks = {{0, m.num_layers}};
  for (const auto& [begin, end] : stage.chunks)
    TETRA_CHECK(0 <= begin && begin <= end && end <= m.num_layers, "stage layer range [{}, {}) outside 0 .. {}",
                begin, end, m.num_layers);

  ParamLayout layout;
  layout.slicing = slicing;
  layout.stage = stage;
  layout.blocks.resize(static_cast<size_t>(m.num_layers));
  layout.layer_group.assign(static_cast<size_t>(m.num_layers), -1);
  LayoutBuilder b{layout};
  const std::vector<RowBlock> vocab_rows = {{r * Vl, Vr}};
  auto add_vocab = [&](std::string name, bool matmul) {
    const int64_t off = b.add(std::move(name), {V, C}, ParamInit::NORMAL, true, matmul, vocab_rows, 0, -1, {}, Vl - Vr);
    layout.params.back().tp_split = p > 1 || Vl > Vr;
    return off;
  };
  const std::vector<RowBlock> qkv_rows = {
      {r * NHl * HS, NHl * HS}, {NH * HS + r * NKVl * HS, NKVl * HS}, {(NH + NKV) * HS + r * NKVl * HS, NKVl * HS}};
  std::vector<RowBlock> fc_rows = {{r * Fl, Fl}};
  if (swiglu) fc_rows.push_back({F + r * Fl, Fl});
  const int64_t fc_global = swiglu ? 2 * F : F;

  // The token embedding is a matmul parameter only when tied (it is then the output projection).
  if (stage.first) {
    layout.embedding_group = b.group;
    layout.wte = add_vocab("embedding.wte", m.tie_embeddings);
    if (m.position == Position::LEARNED)
      layout.wpe = b.add("embedding.wpe", {m.seq_len, C}, ParamInit::NORMAL, false, false);
    b.end_group();
  }
  for (const auto& [first_layer, end_layer] : stage.chunks)
    for (int64_t i = first_layer; i < end_layer; ++i) {
      BlockParams bp;
      const std::string n = fmt::format("layers.{}.", i);
      bp.norm1_w = b.norm_param(n + "norm1.weight", C, ParamInit::ONES);
      if (norm_bias) bp.norm1_b = b.norm_param(n + "norm1.bias", C, ParamInit::ZEROS);
      bp.qkv_w = b.add(n + "attn.qkv.weight", {(NH + 2 * NKV) * HS, C}, ParamInit::NORMAL, true, true, qkv_rows);
      if (m.has_qkv_bias()) bp.qkv_b = b.add(n + "attn.qkv.bias", {(NH + 2 * NKV) * HS}, ParamInit::ZEROS, false, false, qkv_rows);
      if (m.qk_norm) {  // replicated; every TP rank's gradient sums over its own heads only
        bp.q_norm_w = b.add(n + "attn.q_norm.weight", {HS}, ParamInit::ONES, false, false);
        layout.params.back().sp_partial = p > 1;
        bp.k_norm_w = b.add(n + "attn.k_norm.weight", {HS}, ParamInit::ONES, false, false);
        layout.params.back().sp_partial = p > 1;
      }
      bp.attn_proj_w = b.add(n + "attn.proj.weight", {C, NH * HS}, ParamInit::NORMAL_SCALED, true, true, {},
                             r * NHl * HS, NHl * HS);
      if (m.bias) bp.attn_proj_b = b.add(n + "attn.proj.bias", {C}, ParamInit::ZEROS, false, false);
      bp.norm2_w = b.norm_param(n + "norm2.weight", C, ParamInit::ONES);
      if (norm_bias) bp.norm2_b = b.norm_param(n + "norm2.bias", C, ParamInit::ZEROS);
      if (m.moe.is_moe_layer(i)) {
        bp.moe = true;
        bp.router_w = b.add(n + "mlp.router.weight", {m.moe.num_experts, C}, ParamInit::NORMAL, false, true);
        // Folded experts (etp < tp): the TP group's shares route different rows, each summing the
        // router's gradient over its own.
        layout.params.back().sp_partial = slicing.expert_tp() < p;
        if (m.moe.has_shared_expert()) {  // split over TP like the dense MLP; dense parameters of the block
          const int64_t FS = m.moe.shared_expert_ffn_hidden_size, FSl = FS / p;
          TETRA_CHECK(FS % p == 0, "tp {} must divide moe.shared_expert_ffn_hidden_size {}", p, FS);
          std::vector<RowBlock> shared_rows = {{r * FSl, FSl}};
          if (swiglu) shared_rows.push_back({FS + r * FSl, FSl});
          const int64_t shared_fc = swiglu ? 2 * FS : FS;
          const std::string se = n + "mlp.shared_expert.";
          bp.shared_fc_w = b.add(se + "fc.weight", {shared_fc, C}, ParamInit::NORMAL, true, true, shared_rows);
          if (m.bias) bp.shared_fc_b = b.add(se + "fc.bias", {shared_fc}, ParamInit::ZEROS, false, false, shared_rows);
          bp.shared_proj_w =
              b.add(se + "proj.weight", {C, FS}, ParamInit::NORMAL_SCALED, true, true, {}, r * FSl, FSl);
          if (m.bias) bp.shared_proj_b = b.add(se + "proj.bias", {C}, ParamInit::ZEROS, false, false);
          if (m.moe.shared_expert_gate)  // replicated, like the router
            bp.shared_gate_w = b.add(n + "mlp.shared_expert_gate.weight", {1, C}, ParamInit::NORMAL, false, true);
        }
      } else {
      bp.fc_w = b.add(n + "mlp.fc.weight", {fc_global, C}, ParamInit::NORMAL, true, true, fc_rows);
      if (m.bias) bp.fc_b = b.add(n + "mlp.fc.bias", {fc_global}, ParamInit::ZEROS, false, false, fc_rows);
      bp.mlp_proj_w = b.add(n + "mlp.proj.weight", {C, F}, ParamInit::NORMAL_SCALED, true, true, {}, r * Fl, Fl);
      if (m.bias) bp.mlp_proj_b = b.add(n + "mlp.proj.bias", {C}, ParamInit::ZEROS, false, false);
      }
      TETRA_CHECK(layout.layer_group[static_cast<size_t>(i)] < 0, "layer {} in two stage ranges", i);
      layout.blocks[static_cast<size_t>(i)] = bp;
      layout.layer_group[static_cast<size_t>(i)] = b.group;
      b.end_group();
    }
  if (stage.last) {
    layout.head_group = b.group;
    layout.final_norm_w = b.norm_param("final_norm.weight", C, ParamInit::ONES);
    if (norm_bias) layout.final_norm_b = b.norm_param("final_norm.bias", C, ParamInit::ZEROS);
    if (!m.tie_embeddings) {
      layout.lm_head = add_vocab("lm_head.weight", true);
    } else if (!stage.first) {
      layout.wte = add_vocab("embedding.wte", true);
      layout.params.back().stage_copy = true;
    }
    b.end_group();
  }
  layout.dense_groups = static_cast<int>(layout.groups.size());
  layout.expert_begin = layout.total;
  // The experts of every MoE block this rank holds, after all dense parameters (one group per block).
  if (m.moe.enabled()) {
    const int64_t E = m.moe.num_experts, FE = m.moe.ffn_hidden_size;
    TETRA_CHECK(FE > 0 && FE % slicing.expert_tp() == 0 && p % slicing.expert_tp() == 0 && E % slicing.ep == 0 && slicing.ep_rank >= 0 && slicing.ep_rank < slicing.ep,
                "expert layout: {} experts of ffn {} over ep rank {} of {}, etp {} (tp {})", E, FE, slicing.ep_rank,
                slicing.ep, slicing.expert_tp(), p);
    for (const auto& [first_layer, end_layer] : stage.chunks)
      for (int64_t i = first_layer; i < end_layer; ++i) {
        if (!m.moe.is_moe_layer(i)) continue;
        BlockParams& bp = layout.blocks[static_cast<size_t>(i)];
        const std::string n = fmt::format("layers.{}.mlp.experts.", i);
        using X = LayoutBuilder::Expert;
        bp.experts_fc_w = b.expert(n + "fc.weight", X::FC_W, E, C, FE, swiglu, ParamInit::NORMAL, true, true);
        if (m.bias) bp.experts_fc_b = b.expert(n + "fc.bias", X::FC_B, E, C, FE, swiglu, ParamInit::ZEROS, false, false);
        bp.experts_proj_w =
            b.expert(n + "proj.weight", X::PROJ_W, E, C, FE, swiglu, ParamInit::NORMAL_SCALED, true, true);
        if (m.bias) bp.experts_proj_b = b.expert(n + "proj.bias", X::PROJ_B, E, C, FE, swiglu, ParamInit::ZEROS, false, false);
        bp.expert_group = b.group;
        b.end_group();
      }
  }
  return layout;
}

int ParamLayout::group_of(int64_t offset) const {
  auto it = std::upper_bound(groups.begin(), groups.end(), offset,
                             [](int64_t o, const std::pair<int64_t, int64_t>& g) { return o < g.first; });
  TETRA_CHECK(it != groups.begin() && offset < std::prev(it)->second, "offset {} lies in no parameter group",
              offset);
  return static_cast<int>(std::prev(it) - groups.begin());
}

int64_t ParamLayout::count() const {
  int64_t n = 0;
  for (const ParamSpec& p : params) n += p.held();
  return n;
}

int64_t ParamLayout::matmul_count() const {
  int64_t n = 0;
  for (const ParamSpec& p : params)
    if (p.matmul) n += p.held();
  return n;
}

double ParamLayout::active_matmul_count(const ModelConfig& m) const {
  double n = 0;
  for (const ParamSpec& p : params)
    if (p.matmul)
      n += p.expert ? static_cast<double>(p.held()) * m.moe.top_k / m.moe.num_experts : static_cast<double>(p.held());
  return n;
}

double ParamLayout::active_count(const ModelConfig& m) const {
  double n = 0;
  for (const ParamSpec& p : params)
    n += p.expert ? static_cast<double>(p.held()) * m.moe.top_k / m.moe.num_experts : static_cast<double>(p.held());
  return n;
}

const ParamSpec* ParamLayout::find(const std::string& name) const {
  for (const ParamSpec& p : params)
    if (p.name == name) return &p;
  return nullptr;
}

void init_params(const ParamLayout& layout, const ModelConfig& m, uint64_t seed, float* master) {
  const float std = static_cast<float>(m.init_std);
  // GPT-2 / Megatron: output projections of residual branches scaled by 1/sqrt(2 L).
  const float scaled_std = std / std::sqrt(2.0f * static_cast<float>(m.num_layers));
#pragma omp parallel for schedule(static)  // the buffer's first touch: page faults on every thread
  for (int64_t i = 0; i < layout.total; ++i) master[i] = 0.0f;
  for (const ParamSpec& p : layout.params) {
    float* w = master + p.offset;
    const uint64_t stream = math::fnv1a64(p.name.c_str());
    switch (p.init) {
      case ParamInit::ZEROS: break;
      case ParamInit::ONES:
        for (int64_t n = 0; n < p.numel; ++n) w[n] = 1.0f;
        break;
      case ParamInit::NORMAL:
      case ParamInit::NORMAL_SCALED: {
        const float s = p.init == ParamInit::NORMAL ? std : scaled_std;
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < p.held(); ++n)  // the padding stays zero
          w[n] = s * math::philox_normal(seed, stream, static_cast<uint64_t>(p.global_index(n)));
        break;
      }
    }
  }
}

void init_params_range(const ParamLayout& layout, const ModelConfig& m, uint64_t seed, int64_t first, int64_t count,
                       float* out) {
  const float std = static_cast<float>(m.init_std);
  const float scaled_std = std / std::sqrt(2.0f * static_cast<float>(m.num_layers));
  const int64_t last = first + count;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < count; ++i) out[i] = 0.0f;
  for (const ParamSpec& p : layout.params) {
    const int64_t lo = std::max(first, p.offset), hi = std::min(last, p.offset + p.numel);
    if (lo >= hi) continue;
    const uint64_t stream = math::fnv1a64(p.name.c_str());
    float* w = out + (lo - first);
    switch (p.init) {  // as init_params: element n of the parameter, n in [lo, hi) - p.offset
      case ParamInit::ZEROS: break;
      case ParamInit::ONES:
        for (int64_t n = lo - p.offset; n < hi - p.offset; ++n) w[n - (lo - p.offset)] = 1.0f;
        break;
      case ParamInit::NORMAL:
      case ParamInit::NORMAL_SCALED: {
        const float s = p.init == ParamInit::NORMAL ? std : scaled_std;
        const int64_t n0 = lo - p.offset, n1 = std::min(hi - p.offset, p.held());  // the padding stays zero
#pragma omp parallel for schedule(static)
        for (int64_t n = n0; n < n1; ++n)
          w[n - n0] = s * math::philox_normal(seed, stream, static_cast<uint64_t>(p.global_index(n)));
        break;
      }
    }
  }
}

}  // namespace tetra
