// The one reader of the TETRA_* variables; see runtime_options.h.
#include "trainer/core/runtime_options.h"

#include <cstdlib>
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

bool is_one(const char* name) {
  const char* v = value_of(name);
  return v != nullptr && std::string(v) == "1";
}

int64_t int_or(const char* name, int64_t fallback) {
  const char* v = value_of(name);
  return v != nullptr ? std::atoll(v) : fallback;
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
  o.nccl_blocking_wait = is_one("TETRA_NCCL_BLOCKING_WAIT");
  if (const char* v = value_of("TETRA_RENDEZVOUS")) o.rendezvous_dir = v;
  if (const char* v = std::getenv("CUDA_VISIBLE_DEVICES")) o.cuda_visible_devices = v;

  o.guarded_memory = is_one("TETRA_TEST_GUARDED_MEMORY");
  const char* kind = std::getenv("TETRA_TEST_FAULT");
  const char* steps = std::getenv("TETRA_TEST_FAULT_STEPS");
  if (kind != nullptr && steps != nullptr) {
    o.step_fault.kind = kind;
    std::stringstream in(steps);
    for (std::string item; std::getline(in, item, ',');)
      if (!item.empty()) o.step_fault.steps.push_back(std::atoll(item.c_str()));
    if (const char* rank = std::getenv("TETRA_TEST_FAULT_RANK")) o.step_fault.rank = std::atoi(rank);
  }
  o.hang.rank = int_or("TETRA_TEST_HANG_RANK", -1);
  o.hang.step = int_or("TETRA_TEST_HANG_STEP", -1);
  o.hang.seconds = int_or("TETRA_TEST_HANG_SECONDS", 3600);
  o.timing.slow_rank = int_or("TETRA_TEST_SLOW_RANK", -1);
  o.timing.slow_ms = static_cast<double>(int_or("TETRA_TEST_SLOW_MS", 100));
  o.timing.clock_skew_ms = static_cast<double>(int_or("TETRA_TEST_CLOCK_SKEW_MS", 0));
  o.save_faults.kill_at_call = int_or("TETRA_FAULT_SAVE_AT", 0);
  if (const char* v = value_of("TETRA_FAULT_SAVE_LOG")) o.save_faults.call_log = v;
  if (const char* v = value_of("TETRA_FAULT_NO_EXCHANGE")) o.save_faults.no_exchange = std::string(v) != "0";
  return o;
}

const char* environment_variable(const char* name) { return std::getenv(name); }

}  // namespace tetra
