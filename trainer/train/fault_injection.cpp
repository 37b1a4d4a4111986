// Test-only fault injection (see fault_injection.h).
#include "trainer/train/fault_injection.h"

#include <cstdlib>
#include <limits>
#include <sstream>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

namespace tetra {

namespace {

struct Faults {
  std::string kind;
  std::vector<int64_t> steps;
  int rank = 0;

  bool hits(int r, int64_t step) const {
    if (kind.empty() || r != rank) return false;
    for (int64_t s : steps)
      if (s == step) return true;
    return false;
  }
};

const Faults& faults() {
  static const Faults f = [] {
    Faults out;
    const char* kind = std::getenv("TETRA_TEST_FAULT");
    const char* steps = std::getenv("TETRA_TEST_FAULT_STEPS");
    const char* rank = std::getenv("TETRA_TEST_FAULT_RANK");
    if (kind == nullptr || steps == nullptr) return out;
    out.kind = kind;
    std::stringstream in(steps);
    for (std::string item; std::getline(in, item, ',');)
      if (!item.empty()) out.steps.push_back(std::atoll(item.c_str()));
    if (rank != nullptr) out.rank = std::atoi(rank);
    return out;
  }();
  return f;
}

}  // namespace

void inject_loss_fault(int rank, int64_t step, int64_t micro, Backend& be, float* losses, int64_t n) {
  const Faults& f = faults();
  if (micro != 0 || n <= 0 || !f.hits(rank, step)) return;
  std::vector<float> host(static_cast<size_t>(n));
  be.copy_to_host(host.data(), losses, host.size() * 4);
  if (f.kind == "nan-loss") host[0] = std::numeric_limits<float>::quiet_NaN();
  else if (f.kind == "inf-loss") host[0] = std::numeric_limits<float>::infinity();
  else if (f.kind == "spike-loss") for (float& x : host) x *= 1000.0f;
  else return;
  spdlog::warn("TETRA_TEST_FAULT: {} injected into step {} on rank {}", f.kind, step, rank);
  be.copy_from_host(losses, host.data(), host.size() * 4);
}

void inject_grad_fault(int rank, int64_t step, Backend& be, float* owned_grad) {
  const Faults& f = faults();
  if (f.kind != "nan-grad" || !f.hits(rank, step)) return;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  spdlog::warn("TETRA_TEST_FAULT: nan-grad injected into step {} on rank {}", step, rank);
  be.copy_from_host(owned_grad, &nan, 4);
}

}  // namespace tetra
