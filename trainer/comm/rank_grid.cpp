// The rank grid: validation, the stride formula and group enumeration (see rank_grid.h).
#include "trainer/comm/rank_grid.h"

#include <algorithm>
#include <climits>

#include <fmt/format.h>

#include "kernels/common/check.h"

namespace tetra {

const char* group_kind_name(GroupKind kind) {
  switch (kind) {
    case GroupKind::TP: return "tp";
    case GroupKind::PP: return "pp";
    case GroupKind::DP: return "dp";
    case GroupKind::EP: return "ep";
    case GroupKind::EDP: return "edp";
    case GroupKind::MP: return "mp";
    case GroupKind::EMBEDDING: return "embedding";
    case GroupKind::WORLD: return "world";
    case GroupKind::CP: return "cp";
    case GroupKind::ETP: return "etp";
    case GroupKind::ESHARE: return "eshare";
  }
  return "?";
}

namespace {

// The axes of an order string, fastest first, as indices 0 = tp, 1 = dp, 2 = pp, 3 = cp; empty
// if the string is not a permutation of the four names (or of tp, dp, pp) joined by '-'.
std::vector<int> parse_order(const std::string& order) {
  static const char* const names[4] = {"tp", "dp", "pp", "cp"};
  std::vector<int> axes;
  size_t start = 0;
  while (true) {
    const size_t dash = order.find('-', start);
    const std::string part = order.substr(start, dash == std::string::npos ? std::string::npos : dash - start);
    int axis = -1;
    for (int a = 0; a < 4; ++a)
      if (part == names[a]) axis = a;
    for (int seen : axes)
      if (seen == axis) axis = -1;
    if (axis < 0) return {};
    axes.push_back(axis);
    if (dash == std::string::npos) break;
    start = dash + 1;
  }
  if (axes.size() == 3 && std::find(axes.begin(), axes.end(), 3) == axes.end()) axes.push_back(3);
  if (axes.size() != 4) return {};
  return axes;
}

}  // namespace

RankGrid RankGrid::build(const GridSizes& s) {
  const struct {
    const char* path;
    int64_t value;
  } degrees[] = {{"parallel.tp", s.tp}, {"parallel.pp", s.pp}, {"parallel.dp", s.dp}, {"parallel.ep", s.ep},
                 {"parallel.cp", s.cp}};
  for (const auto& d : degrees)
    TETRA_INPUT_CHECK(d.value >= 1, "{} ({}) must be at least 1", d.path, d.value);
  TETRA_INPUT_CHECK(s.world >= 1 && s.world <= INT_MAX, "world size ({}) must be between 1 and {}", s.world,
                    INT_MAX);

  int64_t tp_pp0 = 0, tp_pp = 0, product = 0;
  const bool overflow = __builtin_mul_overflow(s.tp, s.pp, &tp_pp0) || __builtin_mul_overflow(tp_pp0, s.cp, &tp_pp) ||
                        __builtin_mul_overflow(tp_pp, s.dp, &product);
  if (overflow || product != s.world) {
    const std::string product_text = overflow ? std::string("more than 2^63") : fmt::format("{}", product);
    std::string fix = fmt::format("launch {} processes or change parallel.dp", product_text);
    if (!overflow && s.world % tp_pp == 0)
      fix = fmt::format("launch {} processes or set parallel.dp to {}", product, s.world / tp_pp);
    if (s.cp > 1)
      throw InputError(fmt::format("world size {} is not tp ({}) x cp ({}) x pp ({}) x dp ({}) = {}: {}", s.world,
                                   s.tp, s.cp, s.pp, s.dp, product_text, fix));
    throw InputError(fmt::format("world size {} is not tp ({}) x pp ({}) x dp ({}) = {}: {}", s.world, s.tp,
                                 s.pp, s.dp, product_text, fix));
  }
  TETRA_INPUT_CHECK(s.etp >= 0 && s.tp % s.expert_tp() == 0, "parallel.etp ({}) must divide parallel.tp ({})",
                    s.etp, s.tp);
  const int64_t shares = s.tp / s.expert_tp();
  TETRA_INPUT_CHECK((shares * s.dp) % s.ep == 0, "parallel.ep ({}) must divide {} ({})", s.ep,
                    shares == 1 ? "parallel.dp" : "(parallel.tp / parallel.etp) x parallel.dp", shares * s.dp);

  const std::vector<int> axes = parse_order(s.order);
  TETRA_INPUT_CHECK(!axes.empty(),
                    "parallel.order \"{}\" must name each of the axes tp, cp, dp, pp once, joined by '-', "
                    "fastest-varying first (e.g. \"tp-cp-dp-pp\")",
                    s.order);
  TETRA_INPUT_CHECK(s.cp == 1 || s.order.find("cp") != std::string::npos,
                    "parallel.order \"{}\" names no cp axis, but parallel.cp is {}: name all four (e.g. "
                    "\"tp-cp-dp-pp\")",
                    s.order, s.cp);

  RankGrid g;
  g.sizes_ = s;
  const int64_t extent[4] = {s.tp, s.dp, s.pp, s.cp};
  int64_t stride = 1;
  for (int axis : axes) {
    g.stride_[axis] = stride;
    stride *= extent[axis];
  }
  return g;
}

GridCoord RankGrid::coord(int rank) const {
  TETRA_CHECK(rank >= 0 && rank < sizes_.world, "rank {} outside the grid of {} ranks", rank, sizes_.world);
  GridCoord c;
  c.tp = static_cast<int>((rank / stride_[AXIS_TP]) % sizes_.tp);
  c.dp = static_cast<int>((rank / stride_[AXIS_DP]) % sizes_.dp);
  c.pp = static_cast<int>((rank / stride_[AXIS_PP]) % sizes_.pp);
  c.cp = static_cast<int>((rank / stride_[AXIS_CP]) % sizes_.cp);
  const int64_t etp = sizes_.expert_tp(), shares = sizes_.tp / etp;
  c.etp = static_cast<int>(c.tp % etp);
  c.share = static_cast<int>(c.tp / etp);
  const int64_t x = c.share + shares * c.dp;
  c.ep = static_cast<int>(x % sizes_.ep);
  c.edp = static_cast<int>(x / sizes_.ep);
  return c;
}

int RankGrid::rank_of(int tp, int dp, int pp, int cp) const {
  TETRA_CHECK(tp >= 0 && tp < sizes_.tp && dp >= 0 && dp < sizes_.dp && pp >= 0 && pp < sizes_.pp && cp >= 0 &&
                  cp < sizes_.cp,
              "coordinate (tp {}, cp {}, dp {}, pp {}) outside the grid tp {} x cp {} x dp {} x pp {}", tp, cp, dp, pp,
              sizes_.tp, sizes_.cp, sizes_.dp, sizes_.pp);
  return static_cast<int>(tp * stride_[AXIS_TP] + dp * stride_[AXIS_DP] + pp * stride_[AXIS_PP] +
                          cp * stride_[AXIS_CP]);
}

std::vector<int> RankGrid::group(GroupKind kind, int rank) const {
  const GridCoord c = coord(rank);
  const int TP = static_cast<int>(sizes_.tp), PP = static_cast<int>(sizes_.pp);
  const int DP = static_cast<int>(sizes_.dp), EP = static_cast<int>(sizes_.ep);
  const int CP = static_cast<int>(sizes_.cp);
  const int ETP = static_cast<int>(sizes_.expert_tp()), S = TP / ETP;
  // The rank of flattened expert coordinate x = share + S dp, at this rank's etp, cp and pp.
  auto expert_rank = [&](int x, int cp) { return rank_of((x % S) * ETP + c.etp, x / S, c.pp, cp); };
  std::vector<int> m;
  switch (kind) {
    case GroupKind::TP:
      for (int t = 0; t < TP; ++t) m.push_back(rank_of(t, c.dp, c.pp, c.cp));
      break;
    case GroupKind::PP:
      for (int p = 0; p < PP; ++p) m.push_back(rank_of(c.tp, c.dp, p, c.cp));
      break;
    case GroupKind::CP:
      for (int k = 0; k < CP; ++k) m.push_back(rank_of(c.tp, c.dp, c.pp, k));
      break;
    case GroupKind::DP:
      for (int d = 0; d < DP; ++d)
        for (int k = 0; k < CP; ++k) m.push_back(rank_of(c.tp, d, c.pp, k));
      break;
    case GroupKind::EP:
      for (int e = 0; e < EP; ++e) m.push_back(expert_rank(c.edp * EP + e, c.cp));
      break;
    case GroupKind::EDP:
      for (int k = 0; k < S * DP / EP; ++k)
        for (int x = 0; x < CP; ++x) m.push_back(expert_rank(k * EP + c.ep, x));
      break;
    case GroupKind::ETP:
      for (int j = 0; j < ETP; ++j) m.push_back(rank_of(c.share * ETP + j, c.dp, c.pp, c.cp));
      break;
    case GroupKind::ESHARE:
      for (int h = 0; h < S; ++h) m.push_back(rank_of(h * ETP + c.etp, c.dp, c.pp, c.cp));
      break;
    case GroupKind::MP:
      for (int p = 0; p < PP; ++p)
        for (int t = 0; t < TP; ++t) m.push_back(rank_of(t, c.dp, p, c.cp));
      break;
    case GroupKind::EMBEDDING:
      if (PP == 1 || (c.pp != 0 && c.pp != PP - 1)) {
        m.push_back(rank);
      } else {
        m.push_back(rank_of(c.tp, c.dp, 0, c.cp));
        m.push_back(rank_of(c.tp, c.dp, PP - 1, c.cp));
      }
      break;
    case GroupKind::WORLD:
      for (int r = 0; r < sizes_.world; ++r) m.push_back(r);
      break;
  }
  return m;
}

std::vector<std::vector<int>> RankGrid::groups(GroupKind kind) const {
  // Ranks in increasing order: the first rank not yet placed is the smallest member of its group.
  std::vector<std::vector<int>> all;
  std::vector<bool> placed(static_cast<size_t>(sizes_.world), false);
  for (int r = 0; r < sizes_.world; ++r) {
    if (placed[r]) continue;
    all.push_back(group(kind, r));
    for (int m : all.back()) placed[m] = true;
  }
  return all;
}

}  // namespace tetra
