#include "trainer/params/recompute.h"

#include <algorithm>

namespace tetra {

Recomputation Recomputation::from(const TrainingConfig& t) {
  Recomputation r;
  r.kind = t.recompute;
  r.method = t.recompute_method;
  r.num_layers = t.recompute_num_layers;
  if (r.kind == Recompute::SELECTIVE) {
    for (RecomputeModule m : t.recompute_modules) {
      switch (m) {
        case RecomputeModule::NORM: r.norm = true; break;
        case RecomputeModule::ACT: r.act = true; break;
        case RecomputeModule::MOE_ACT: r.moe_act = true; break;
        case RecomputeModule::CORE_ATTN: r.core_attn = true; break;
      }
    }
  }
  return r;
}

int64_t RecomputeUnits::longest() const {
  int64_t n = 0;
  for (const auto& [b, e] : units) n = std::max(n, e - b);
  return n;
}

bool RecomputeUnits::ends_unit(int64_t l) const {
  const int64_t u = unit_of[static_cast<size_t>(l)];
  return u >= 0 && units[static_cast<size_t>(u)].second == l + 1;
}

RecomputeUnits plan_recompute_units(const Recomputation& rc, int64_t L, const std::vector<bool>& moe) {
  RecomputeUnits r;
  r.unit_of.assign(static_cast<size_t>(L), -1);
  if (rc.kind != Recompute::FULL) return r;
  const int64_t k = std::max<int64_t>(1, rc.num_layers);
  auto close = [&](int64_t b, int64_t e) {
    for (int64_t l = b; l < e; ++l) r.unit_of[static_cast<size_t>(l)] = static_cast<int64_t>(r.units.size());
    r.units.emplace_back(b, e);
  };
  if (rc.method == RecomputeMethod::BLOCK) {
    for (int64_t l = 0; l < std::min(k, L); ++l) close(l, l + 1);
    return r;
  }
  int64_t b = 0;
  for (int64_t l = 0; l < L; ++l) {
    const bool last = l + 1 - b == k || l + 1 == L || moe[static_cast<size_t>(l)];
    if (last) {
      close(b, l + 1);
      b = l + 1;
    }
  }
  return r;
}

}  // namespace tetra
