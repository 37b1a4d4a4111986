// The rank grid against an independent reshape: ranks are numbered by a counter running through
// nested loops (slowest axis outermost) into an index array idx[pp][dp][tp], and each group is
// read by slicing that array — no stride formula. Checked over every layout of many world sizes
// and every axis order, up to 4096 ranks, plus Megatron's documented 8-rank example and the
// validation messages.
#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "kernels/common/check.h"
#include "trainer/comm/rank_grid.h"

using namespace tetra;

namespace {

const GroupKind kAllKinds[] = {GroupKind::TP, GroupKind::PP,  GroupKind::DP,        GroupKind::EP,
                               GroupKind::EDP, GroupKind::MP, GroupKind::EMBEDDING, GroupKind::WORLD};

// The reference: idx(t, d, p) filled by counting through the loops of `order`.
struct Reshape {
  int TP, PP, DP, EP;
  std::vector<int> idx;  // [pp][dp][tp]
  int& at(int t, int d, int p) { return idx[(static_cast<size_t>(p) * DP + d) * TP + t]; }

  Reshape(int tp, int pp, int dp, int ep, const std::string& order) : TP(tp), PP(pp), DP(dp), EP(ep) {
    idx.assign(static_cast<size_t>(tp) * pp * dp, -1);
    // Axis names fastest first; loop over them slowest first.
    std::vector<std::string> axes;
    for (size_t start = 0;;) {
      const size_t dash = order.find('-', start);
      axes.push_back(order.substr(start, dash == std::string::npos ? std::string::npos : dash - start));
      if (dash == std::string::npos) break;
      start = dash + 1;
    }
    std::map<std::string, int> extent{{"tp", tp}, {"dp", dp}, {"pp", pp}};
    int counter = 0;
    std::map<std::string, int> c;
    for (c[axes[2]] = 0; c[axes[2]] < extent[axes[2]]; ++c[axes[2]])
      for (c[axes[1]] = 0; c[axes[1]] < extent[axes[1]]; ++c[axes[1]])
        for (c[axes[0]] = 0; c[axes[0]] < extent[axes[0]]; ++c[axes[0]]) at(c["tp"], c["dp"], c["pp"]) = counter++;
  }

  // Every group of a kind, by slicing.
  std::vector<std::vector<int>> groups(GroupKind kind) {
    std::vector<std::vector<int>> all;
    switch (kind) {
      case GroupKind::TP:
        for (int p = 0; p < PP; ++p)
          for (int d = 0; d < DP; ++d) {
            all.emplace_back();
            for (int t = 0; t < TP; ++t) all.back().push_back(at(t, d, p));
          }
        break;
      case GroupKind::PP:
        for (int d = 0; d < DP; ++d)
          for (int t = 0; t < TP; ++t) {
            all.emplace_back();
            for (int p = 0; p < PP; ++p) all.back().push_back(at(t, d, p));
          }
        break;
      case GroupKind::DP:
        for (int p = 0; p < PP; ++p)
          for (int t = 0; t < TP; ++t) {
            all.emplace_back();
            for (int d = 0; d < DP; ++d) all.back().push_back(at(t, d, p));
          }
        break;
      case GroupKind::EP:  // dp = edp * EP + e: a contiguous run of EP data-parallel ranks
        for (int p = 0; p < PP; ++p)
          for (int t = 0; t < TP; ++t)
            for (int k = 0; k < DP / EP; ++k) {
              all.emplace_back();
              for (int e = 0; e < EP; ++e) all.back().push_back(at(t, k * EP + e, p));
            }
        break;
      case GroupKind::EDP:  // every EP-th data-parallel rank
        for (int p = 0; p < PP; ++p)
          for (int t = 0; t < TP; ++t)
            for (int e = 0; e < EP; ++e) {
              all.emplace_back();
              for (int k = 0; k < DP / EP; ++k) all.back().push_back(at(t, k * EP + e, p));
            }
        break;
      case GroupKind::MP:
        for (int d = 0; d < DP; ++d) {
          all.emplace_back();
          for (int p = 0; p < PP; ++p)
            for (int t = 0; t < TP; ++t) all.back().push_back(at(t, d, p));
        }
        break;
      case GroupKind::EMBEDDING:
        for (int d = 0; d < DP; ++d)
          for (int t = 0; t < TP; ++t) {
            if (PP == 1) {
              all.push_back({at(t, d, 0)});
              continue;
            }
            all.push_back({at(t, d, 0), at(t, d, PP - 1)});
            for (int p = 1; p < PP - 1; ++p) all.push_back({at(t, d, p)});  // middle stages: alone
          }
        break;
      case GroupKind::WORLD:
        all.emplace_back();
        for (int r = 0; r < TP * PP * DP; ++r) all.back().push_back(r);
        break;
      default:  // CP, ETP, ESHARE: checked by the cases below
        break;
    }
    return all;
  }
};

size_t expected_group_size(GroupKind kind, int tp, int pp, int dp, int ep, int pp_coord) {
  switch (kind) {
    case GroupKind::TP: return tp;
    case GroupKind::PP: return pp;
    case GroupKind::DP: return dp;
    case GroupKind::EP: return ep;
    case GroupKind::EDP: return dp / ep;
    case GroupKind::MP: return static_cast<size_t>(tp) * pp;
    case GroupKind::EMBEDDING: return (pp > 1 && (pp_coord == 0 || pp_coord == pp - 1)) ? 2 : 1;
    case GroupKind::WORLD: return static_cast<size_t>(tp) * pp * dp;
    case GroupKind::CP: return 1;
    case GroupKind::ETP: return tp;  // unfolded: the experts split over the whole TP group
    case GroupKind::ESHARE: return 1;
  }
  return 0;
}

// Checks one layout completely; returns the number of groups compared.
int64_t check_layout(int tp, int pp, int dp, int ep, const std::string& order) {
  INFO("tp " << tp << " pp " << pp << " dp " << dp << " ep " << ep << " order " << order);
  const int world = tp * pp * dp;
  const RankGrid grid = RankGrid::build({world, tp, pp, dp, ep, order});
  Reshape ref(tp, pp, dp, ep, order);

  // coord and rank_of against the reference array, and inverse of each other.
  for (int p = 0; p < pp; ++p)
    for (int d = 0; d < dp; ++d)
      for (int t = 0; t < tp; ++t) {
        const int r = ref.at(t, d, p);
        REQUIRE(grid.rank_of(t, d, p) == r);
        const GridCoord c = grid.coord(r);
        REQUIRE((c.tp == t && c.dp == d && c.pp == p && c.ep == d % ep && c.edp == d / ep));
      }

  int64_t compared = 0;
  for (GroupKind kind : kAllKinds) {
    INFO("group kind " << group_kind_name(kind));
    std::vector<std::vector<int>> want = ref.groups(kind);
    std::vector<std::vector<int>> got = grid.groups(kind);
    // Every rank in exactly one group of this kind, of the right size.
    std::vector<int> seen(static_cast<size_t>(world), 0);
    for (const auto& g : got) {
      REQUIRE(g.size() == expected_group_size(kind, tp, pp, dp, ep, grid.coord(g[0]).pp));
      for (int m : g) seen[m] += 1;
    }
    REQUIRE(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
    // group(kind, r) is the reference group holding r, members in the same order.
    std::vector<int> owner(static_cast<size_t>(world), -1);
    for (size_t i = 0; i < want.size(); ++i)
      for (int m : want[i]) owner[m] = static_cast<int>(i);
    for (int r = 0; r < world; ++r) REQUIRE(grid.group(kind, r) == want[owner[r]]);
    // The same set of groups (groups() orders them by smallest member).
    std::sort(want.begin(), want.end());
    std::sort(got.begin(), got.end());
    REQUIRE(got == want);
    compared += static_cast<int64_t>(want.size());
  }
  return compared;
}

const char* const kOrders[] = {"tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "dp-pp-tp", "pp-tp-dp", "pp-dp-tp"};

}  // namespace

TEST_CASE("rank grid: Megatron's 8-rank example (tp 2, pp 2, dp 2, default order)", "[dist][grid]") {
  const RankGrid g = RankGrid::build({8, 2, 2, 2, 1, "tp-dp-pp"});
  using G = std::vector<std::vector<int>>;
  CHECK(g.groups(GroupKind::TP) == G{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK(g.groups(GroupKind::DP) == G{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(g.groups(GroupKind::PP) == G{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK(g.groups(GroupKind::MP) == G{{0, 1, 4, 5}, {2, 3, 6, 7}});
  CHECK(g.groups(GroupKind::EMBEDDING) == G{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK(g.groups(GroupKind::EP) == G{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}});
  CHECK(g.groups(GroupKind::EDP) == g.groups(GroupKind::DP));
  CHECK(g.groups(GroupKind::WORLD) == G{{0, 1, 2, 3, 4, 5, 6, 7}});
  const GridCoord c = g.coord(5);  // 5 = tp 1 + 2 * (dp 0 + 2 * pp 1)
  CHECK((c.tp == 1 && c.dp == 0 && c.pp == 1));
}

TEST_CASE("rank grid: expert groups split dp into an inner ep part and an outer edp part", "[dist][grid]") {
  // tp 1, pp 1, dp 8, ep 4: dp ranks 0-3 form one expert group, 4-7 another; edp pairs dp d, d+4.
  const RankGrid g = RankGrid::build({8, 1, 1, 8, 4, "tp-dp-pp"});
  using G = std::vector<std::vector<int>>;
  CHECK(g.groups(GroupKind::EP) == G{{0, 1, 2, 3}, {4, 5, 6, 7}});
  CHECK(g.groups(GroupKind::EDP) == G{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  CHECK((g.coord(6).ep == 2 && g.coord(6).edp == 1));
  // pp 4: middle stages are alone in their embedding group.
  const RankGrid p = RankGrid::build({4, 1, 4, 1, 1, "tp-dp-pp"});
  CHECK(p.group(GroupKind::EMBEDDING, 0) == std::vector<int>{0, 3});
  CHECK(p.group(GroupKind::EMBEDDING, 3) == std::vector<int>{0, 3});
  CHECK(p.group(GroupKind::EMBEDDING, 1) == std::vector<int>{1});
  CHECK(p.group(GroupKind::EMBEDDING, 2) == std::vector<int>{2});
}

TEST_CASE("rank grid: every layout of small worlds, every order, against the reshape", "[dist][grid]") {
  int64_t layouts = 0, groups = 0;
  for (int world : {1, 2, 3, 4, 6, 8, 12, 16, 24, 30, 32})
    for (int tp = 1; tp <= world; ++tp)
      for (int pp = 1; pp <= world / tp; ++pp) {
        if (world % (tp * pp) != 0) continue;
        const int dp = world / (tp * pp);
        for (int ep = 1; ep <= dp; ++ep) {
          if (dp % ep != 0) continue;
          for (const char* order : kOrders) {
            groups += check_layout(tp, pp, dp, ep, order);
            ++layouts;
          }
        }
      }
  CHECK(layouts > 1000);  // the loops above really ran: 11 worlds, all factorisations, 6 orders
  CHECK(groups > layouts * 8);
}

TEST_CASE("rank grid: large layouts up to 4096 ranks", "[dist][grid]") {
  const struct {
    int tp, pp, dp, ep;
  } layouts[] = {{8, 8, 64, 8}, {8, 16, 32, 32}, {1, 1, 4096, 64}, {4096, 1, 1, 1}, {2, 64, 32, 4}, {7, 3, 5, 5}};
  for (const auto& l : layouts)
    for (const char* order : {"tp-dp-pp", "pp-dp-tp", "dp-tp-pp"}) check_layout(l.tp, l.pp, l.dp, l.ep, order);
}

TEST_CASE("rank grid: invalid sizes and orders are refused with the values", "[dist][grid]") {
  using Catch::Matchers::Contains;
  CHECK_THROWS_AS(RankGrid::build({6, 4, 1, 1, 1, "tp-dp-pp"}), InputError);
  CHECK_THROWS_WITH(RankGrid::build({6, 4, 1, 1, 1, "tp-dp-pp"}),
                    Contains("world size 6 is not tp (4) x pp (1) x dp (1) = 4: launch 4 processes"));
  CHECK_THROWS_WITH(RankGrid::build({8, 2, 1, 1, 1, "tp-dp-pp"}), Contains("set parallel.dp to 4"));
  CHECK_THROWS_WITH(RankGrid::build({4, 1, 1, 4, 3, "tp-dp-pp"}),
                    Contains("parallel.ep (3) must divide parallel.dp (4)"));
  CHECK_THROWS_WITH(RankGrid::build({4, 0, 1, 4, 1, "tp-dp-pp"}), Contains("parallel.tp (0) must be at least 1"));
  CHECK_THROWS_WITH(RankGrid::build({1, 1, 1, 1, 1, "tp-pp"}), Contains("\"tp-pp\"") && Contains("tp, cp, dp, pp"));
  CHECK_THROWS_WITH(RankGrid::build({1, 1, 1, 1, 1, "tp-tp-pp"}), Contains("\"tp-tp-pp\""));
  CHECK_THROWS_WITH(RankGrid::build({1, 1, 1, 1, 1, "tp-dp-pp-"}), Contains("\"tp-dp-pp-\""));
  CHECK_THROWS_WITH(RankGrid::build({1, 1, 1, 1, 1, "tp-dp-ep"}), Contains("\"tp-dp-ep\""));
  CHECK_THROWS_WITH(RankGrid::build({0, 1, 1, 1, 1, "tp-dp-pp"}), Contains("world size (0)"));
  // A product that overflows is a mismatch, not a wrap-around that happens to match.
  CHECK_THROWS_WITH(RankGrid::build({1, int64_t{1} << 32, int64_t{1} << 32, int64_t{1} << 32, 1, "tp-dp-pp"}),
                    Contains("world size 1 is not"));
  for (const char* order : kOrders) CHECK_NOTHROW(RankGrid::build({1, 1, 1, 1, 1, order}));
  const RankGrid g = RankGrid::build({4, 2, 1, 2, 1, "tp-dp-pp"});
  CHECK_THROWS_AS(g.coord(4), Error);
  CHECK_THROWS_AS(g.rank_of(2, 0, 0), Error);
}

TEST_CASE("rank grid: folded experts (etp < tp): shares of the TP group join expert parallelism", "[dist][grid]") {
  using Catch::Matchers::Contains;
  using G = std::vector<std::vector<int>>;
  // Megatron-Bridge's Moonlight layout: tp 2 x dp 4 on 8 ranks, experts etp 1 x ep 8.
  GridSizes s{8, 2, 1, 4, 8, "tp-cp-dp-pp", 1, 1};
  const RankGrid m = RankGrid::build(s);
  CHECK(m.groups(GroupKind::EP) == G{{0, 1, 2, 3, 4, 5, 6, 7}});
  CHECK(m.groups(GroupKind::EDP) == G{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}});
  CHECK(m.groups(GroupKind::ETP) == G{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}});
  CHECK(m.groups(GroupKind::ESHARE) == G{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK((m.coord(5).ep == 5 && m.coord(5).edp == 0 && m.coord(5).share == 1 && m.coord(5).etp == 0));
  // tp 4 = etp 2 x 2 shares, dp 2, ep 2: rank = t + 4 d; share = t / 2, ep = share, edp = d.
  s = GridSizes{8, 4, 1, 2, 2, "tp-cp-dp-pp", 1, 2};
  const RankGrid f = RankGrid::build(s);
  CHECK(f.groups(GroupKind::ETP) == G{{0, 1}, {2, 3}, {4, 5}, {6, 7}});
  CHECK(f.groups(GroupKind::ESHARE) == G{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(f.groups(GroupKind::EP) == G{{0, 2}, {1, 3}, {4, 6}, {5, 7}});
  CHECK(f.groups(GroupKind::EDP) == G{{0, 4}, {1, 5}, {2, 6}, {3, 7}});
  // Unfolded (etp = tp): the same groups as without etp.
  const RankGrid u = RankGrid::build({8, 2, 1, 4, 2, "tp-cp-dp-pp", 1, 2});
  const RankGrid v = RankGrid::build({8, 2, 1, 4, 2, "tp-cp-dp-pp"});
  for (GroupKind k : kAllKinds) CHECK(u.groups(k) == v.groups(k));
  CHECK(u.groups(GroupKind::ESHARE) == G{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}});
  CHECK(u.groups(GroupKind::ETP) == u.groups(GroupKind::TP));
  CHECK_THROWS_WITH(RankGrid::build({4, 2, 1, 2, 1, "tp-cp-dp-pp", 1, 3}), Contains("parallel.etp (3) must divide"));
  CHECK_THROWS_WITH(RankGrid::build({4, 2, 1, 2, 3, "tp-cp-dp-pp", 1, 1}),
                    Contains("parallel.ep (3) must divide (parallel.tp / parallel.etp) x parallel.dp (4)"));
}

TEST_CASE("rank grid: folded expert groups over every small layout partition each stage exactly", "[dist][grid]") {
  // Properties, from the definitions alone: each kind's groups partition the world; an ETP group
  // lies in one TP group (same dp, cp, pp); EP, ETP and EDP (with cp) give each rank of a stage a
  // distinct (etp, ep, edp, cp) and together cover the stage; an ESHARE group holds the TP ranks of
  // one etp coordinate.
  int64_t layouts = 0;
  for (int world : {4, 8, 12, 16})
    for (int tp = 1; tp <= world; ++tp)
      for (int etp = 1; etp <= tp; ++etp)
        for (int cp : {1, 2})
          for (int pp = 1; pp <= 2; ++pp) {
            if (tp % etp != 0 || world % (tp * pp * cp) != 0) continue;
            const int dp = world / (tp * pp * cp), shares = tp / etp;
            for (int ep = 1; ep <= shares * dp; ++ep) {
              if ((shares * dp) % ep != 0) continue;
              const RankGrid g = RankGrid::build({world, tp, pp, dp, ep, "tp-cp-dp-pp", cp, etp});
              ++layouts;
              for (GroupKind k : {GroupKind::EP, GroupKind::EDP, GroupKind::ETP, GroupKind::ESHARE}) {
                std::vector<int> seen(static_cast<size_t>(world), 0);
                for (const auto& grp : g.groups(k))
                  for (int r : grp) ++seen[static_cast<size_t>(r)];
                CHECK(std::all_of(seen.begin(), seen.end(), [](int n) { return n == 1; }));
              }
              for (int r = 0; r < world; ++r) {
                const GridCoord c = g.coord(r);
                CHECK((c.etp == c.tp % etp && c.share == c.tp / etp));
                for (int q : g.group(GroupKind::ETP, r)) {
                  const GridCoord o = g.coord(q);
                  CHECK((o.dp == c.dp && o.cp == c.cp && o.pp == c.pp && o.share == c.share));
                }
                for (int q : g.group(GroupKind::ESHARE, r)) {
                  const GridCoord o = g.coord(q);
                  CHECK((o.dp == c.dp && o.cp == c.cp && o.pp == c.pp && o.etp == c.etp));
                }
                for (int q : g.group(GroupKind::EP, r)) {
                  const GridCoord o = g.coord(q);
                  CHECK((o.etp == c.etp && o.edp == c.edp && o.cp == c.cp && o.pp == c.pp));
                }
                CHECK(static_cast<int>(g.group(GroupKind::EP, r).size()) == ep);
                CHECK(static_cast<int>(g.group(GroupKind::EDP, r).size()) == shares * dp / ep * cp);
              }
              std::map<std::vector<int>, int> owners;  // (pp, etp, ep, edp, cp) -> ranks
              for (int r = 0; r < world; ++r) {
                const GridCoord c = g.coord(r);
                ++owners[{c.pp, c.etp, c.ep, c.edp, c.cp}];
              }
              CHECK(static_cast<int>(owners.size()) == world);
            }
          }
  CHECK(layouts > 100);
}
