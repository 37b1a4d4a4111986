// Test-only fault injection (see fault_injection.h).
#include "trainer/train/fault_injection.h"

#include <chrono>
#include <limits>
#include <thread>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "trainer/core/trace.h"

namespace tetra {

namespace {

StepFaultHook g_faults;
TimingHooks g_timing;

bool hits(const StepFaultHook& f, int r, int64_t step) {
  if (f.kind.empty() || r != f.rank) return false;
  for (int64_t s : f.steps)
    if (s == step) return true;
  return false;
}

}  // namespace

void set_step_faults(const StepFaultHook& faults) { g_faults = faults; }
void set_slow_rank(const TimingHooks& timing) { g_timing = timing; }

void inject_slowness(int rank) {
  if (rank != g_timing.slow_rank || g_timing.slow_ms <= 0.0) return;
  const trace::Span span("phase", "test delay");
  std::this_thread::sleep_for(std::chrono::duration<double, std::milli>(g_timing.slow_ms));
}

void inject_loss_fault(int rank, int64_t step, int64_t micro, Backend& be, float* losses, int64_t n) {
  const StepFaultHook& f = g_faults;
  if (micro != 0 || n <= 0 || !hits(f, rank, step)) return;
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
  const StepFaultHook& f = g_faults;
  if (f.kind != "nan-grad" || !hits(f, rank, step)) return;
  const float nan = std::numeric_limits<float>::quiet_NaN();
  spdlog::warn("TETRA_TEST_FAULT: nan-grad injected into step {} on rank {}", step, rank);
  be.copy_from_host(owned_grad, &nan, 4);
}

}  // namespace tetra
