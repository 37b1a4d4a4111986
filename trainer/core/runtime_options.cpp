// The one reader of the TETRA_* variables; see runtime_options.h.
#include "trainer/core/runtime_options.h"

#include <charconv>
#include <cstdlib>
#include <optional>
#include <sstream>

#include <fmt/format.h>

#include "kernels/common/check.h"

namespace tetra {

namespace {

// The variable's value, nullptr when unset or empty.
const char* value_of(const char* name) {
  const char* v = std::getenv(name);
  return (v != nullptr && v[0] != '\0') ? v : nullptr;
}

// A switch: unset or empty is off; "1" on, "0" off; anything else is refused (a typo such as
// "true" must not silently mean off).
bool switch_on(const char* name) {
  const char* v = value_of(name);
  if (v == nullptr) return false;
  const std::string s(v);
  TETRA_INPUT_CHECK(s == "0" || s == "1", "{}={} is not a switch value: give 1 (on) or 0 (off), or unset it", name, s);
  return s == "1";
}

// `s` as a whole number, or nullopt.
std::optional<int64_t> whole_number(const std::string& s) {
  int64_t x = 0;
  const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), x);
  if (ec != std::errc() || end != s.data() + s.size()) return std::nullopt;
  return x;
}

// A whole number, or `fallback` when unset or empty; anything else is refused.
int64_t int_or(const char* name, int64_t fallback) {
  const char* v = value_of(name);
  if (v == nullptr) return fallback;
  const std::optional<int64_t> x = whole_number(v);
  TETRA_INPUT_CHECK(x.has_value(), "{}={} is not a whole number", name, v);
  return *x;
}

}  // namespace

RuntimeOptions read_runtime_options() {
  RuntimeOptions o;
  if (const char* v = value_of("TETRA_ATTENTION")) {
    const std::string s(v);
    TETRA_INPUT_CHECK(s == "auto" || s == "fused" || s == "cudnn",
                      "TETRA_ATTENTION={} is not one of auto, fused, cudnn (the CUDA backend's attention path; "
                      "unset it for auto)", s);
    o.attention = s;
  }
  o.nccl_blocking_wait = switch_on("TETRA_NCCL_BLOCKING_WAIT");
  if (const char* v = value_of("TETRA_RENDEZVOUS")) o.rendezvous_dir = v;
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES")) o.cuda_visible_devices = v;

  o.guarded_memory = switch_on("TETRA_TEST_GUARDED_MEMORY");
  const char* kind = value_of("TETRA_TEST_FAULT");
  const char* steps = value_of("TETRA_TEST_FAULT_STEPS");
  if (kind != nullptr || steps != nullptr) {
    TETRA_INPUT_CHECK(kind != nullptr && steps != nullptr,
                      "TETRA_TEST_FAULT and TETRA_TEST_FAULT_STEPS go together (a fault kind and the steps it hits); "
                      "set both or neither");
    const std::string k(kind);
    TETRA_INPUT_CHECK(k == "nan-loss" || k == "inf-loss" || k == "spike-loss" || k == "nan-grad",
                      "TETRA_TEST_FAULT={} is not one of nan-loss, inf-loss, spike-loss, nan-grad", k);
    o.step_fault.kind = k;
    std::stringstream in(steps);
    for (std::string item; std::getline(in, item, ',');) {
      if (item.empty()) continue;
      const std::optional<int64_t> step = whole_number(item);
      TETRA_INPUT_CHECK(step && *step >= 1, "TETRA_TEST_FAULT_STEPS={}: \"{}\" is not a step (1-based, comma-separated)",
                        steps, item);
      o.step_fault.steps.push_back(*step);
    }
    TETRA_INPUT_CHECK(!o.step_fault.steps.empty(), "TETRA_TEST_FAULT_STEPS={} names no step", steps);
    const int64_t rank = int_or("TETRA_TEST_FAULT_RANK", 0);
    TETRA_INPUT_CHECK(rank >= 0 && rank < (int64_t{1} << 20), "TETRA_TEST_FAULT_RANK={} is not a rank (0 to 2^20-1)",
                      rank);
    o.step_fault.rank = static_cast<int>(rank);
  }
  o.hang.rank = int_or("TETRA_TEST_HANG_RANK", -1);
  o.hang.step = int_or("TETRA_TEST_HANG_STEP", -1);
  o.hang.seconds = int_or("TETRA_TEST_HANG_SECONDS", 3600);
  o.timing.slow_rank = int_or("TETRA_TEST_SLOW_RANK", -1);
  o.timing.slow_ms = static_cast<double>(int_or("TETRA_TEST_SLOW_MS", 100));
  o.timing.clock_skew_ms = static_cast<double>(int_or("TETRA_TEST_CLOCK_SKEW_MS", 0));
  o.save_faults.kill_at_call = int_or("TETRA_FAULT_SAVE_AT", 0);
  if (const char* v = value_of("TETRA_FAULT_SAVE_LOG")) o.save_faults.call_log = v;
  o.save_faults.no_exchange = switch_on("TETRA_FAULT_NO_EXCHANGE");
  o.checkpoint_piece = int_or("TETRA_TEST_CHECKPOINT_PIECE", 0);
  TETRA_INPUT_CHECK(o.checkpoint_piece >= 0, "TETRA_TEST_CHECKPOINT_PIECE={} must be a positive number of elements",
                    o.checkpoint_piece);
  if (const char* v = value_of("TETRA_TEST_MOE_ROUTE")) {
    const std::string route = v;
    TETRA_INPUT_CHECK(route == "one" || route == "skew", "TETRA_TEST_MOE_ROUTE={} is not one of one, skew", route);
    o.moe_route = route;
  }
  return o;
}

const char* environment_variable(const char* name) { return std::getenv(name); }

}  // namespace tetra
