// Activation recomputation's plan (trainer/params/recompute.h): the config keys and their rules,
// the modes as the model reads them, and the full-recomputation units of a chunk.
#include <catch2/catch.hpp>
#include <utility>
#include <vector>

#include "tests/unit/config_testing.h"
#include "trainer/params/recompute.h"

using namespace tetra;
using namespace tetra::config_testing;
using nlohmann::json;

namespace {

using Units = std::vector<std::pair<int64_t, int64_t>>;

Recomputation full(RecomputeMethod method, int64_t layers) {
  Recomputation r;
  r.kind = Recompute::FULL;
  r.method = method;
  r.num_layers = layers;
  return r;
}

}  // namespace

TEST_CASE("recompute: config keys, defaults and rules", "[recompute][config]") {
  const Config d = config_from_json(base());
  CHECK(d.training.recompute == Recompute::NONE);
  CHECK(d.training.recompute_modules == std::vector<RecomputeModule>{RecomputeModule::CORE_ATTN});
  CHECK(d.training.recompute_method == RecomputeMethod::UNIFORM);
  CHECK(d.training.recompute_num_layers == 1);

  json j = with(base(), "training.recompute", "selective");
  j = with(j, "training.recompute_modules", json::array({"norm", "act"}));
  const Recomputation sel = Recomputation::from(config_from_json(j).training);
  CHECK((sel.kind == Recompute::SELECTIVE && sel.norm && sel.act && !sel.core_attn && !sel.moe_act));
  // Modules outside selective are refused (test_config_rules.cpp), and the defaults name nothing.
  require_one(with(j, "training.recompute", "none"), "training.recompute_modules: [\"norm\",\"act\"]: ",
              "applies to training.recompute \"selective\" only");
  const Recomputation none = Recomputation::from(config_from_json(base()).training);
  CHECK((!none.norm && !none.act && !none.core_attn));

  require_one(with(base(), "training.recompute", "partial"), "training.recompute: \"partial\": ",
              "must be one of none, selective, full");
  require_one(with(j, "training.recompute_modules", json::array({"norm", "attn"})),
              "training.recompute_modules[1]: \"attn\": ", "must be one of norm, act, moe_act, core_attn");
  require_one(with(j, "training.recompute_modules", json::array({"act", "act"})),
              "training.recompute_modules[1]: \"act\": ", "listed twice");
  require_one(with(j, "training.recompute_modules", "norm"), "training.recompute_modules: \"norm\": ",
              "expected a list of strings");
  require_one(with(j, "training.recompute_modules", json::array()), "training.recompute_modules: []: ",
              "needs at least one module");
  require_one(with(j, "training.recompute_modules", json::array({"moe_act"})), "training.recompute_modules: ",
              "the model has no MoE blocks");
  require_one(with(base(), "training.recompute_num_layers", 0), "training.recompute_num_layers: 0: ", "must be >= 1");
  require_one(with(base(), "training.recompute_method", "blocks"), "training.recompute_method: \"blocks\": ",
              "must be one of uniform, block");
}

TEST_CASE("recompute: full recomputation units", "[recompute]") {
  const std::vector<bool> dense(5, false);
  RecomputeUnits u = plan_recompute_units(full(RecomputeMethod::UNIFORM, 2), 5, dense);
  CHECK(u.units == Units{{0, 2}, {2, 4}, {4, 5}});
  CHECK(u.unit_of == std::vector<int64_t>{0, 0, 1, 1, 2});
  CHECK(u.longest() == 2);
  CHECK((!u.ends_unit(0) && u.ends_unit(1) && u.ends_unit(4)));

  // A MoE block ends its unit (its routing and experts are kept, not rerun).
  const std::vector<bool> moe{true, false, false, true, false};
  u = plan_recompute_units(full(RecomputeMethod::UNIFORM, 3), 5, moe);
  CHECK(u.units == Units{{0, 1}, {1, 4}, {4, 5}});

  // Block: the first n layers one by one, the rest kept.
  u = plan_recompute_units(full(RecomputeMethod::BLOCK, 2), 5, dense);
  CHECK(u.units == Units{{0, 1}, {1, 2}});
  CHECK(u.unit_of == std::vector<int64_t>{0, 1, -1, -1, -1});
  CHECK((u.full(1) && !u.full(2)));
  u = plan_recompute_units(full(RecomputeMethod::BLOCK, 9), 3, std::vector<bool>(3, false));
  CHECK(u.units.size() == 3);

  // Units larger than the chunk: one unit; no full recomputation: no units.
  u = plan_recompute_units(full(RecomputeMethod::UNIFORM, 8), 3, std::vector<bool>(3, false));
  CHECK(u.units == Units{{0, 3}});
  u = plan_recompute_units(Recomputation{}, 3, std::vector<bool>(3, false));
  CHECK((u.units.empty() && u.longest() == 0 && !u.full(0)));
}
