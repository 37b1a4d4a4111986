// Test-only fault injection into the training step, driven by environment variables (read once
// into RuntimeOptions::step_fault, trainer/core/runtime_options.h, and installed here with
// set_step_faults) so that no config key (and no production code path) exists for it. Used by
// tests/cli/test_resilience.sh to check that a corrupted step never reaches the weights. Not for
// production use.
//
//   TETRA_TEST_FAULT        nan-loss | inf-loss | spike-loss | nan-grad
//   TETRA_TEST_FAULT_STEPS  comma-separated 1-based steps, e.g. "4" or "4,5,6"
//   TETRA_TEST_FAULT_RANK   the global rank that is corrupted (default 0)
//
// nan-loss / inf-loss: the first per-token loss of the step's first micro-batch becomes NaN / inf
// (the step's reported loss follows; the gradients do not). spike-loss: that micro-batch's
// per-token losses are multiplied by 1000. nan-grad: after the gradient reduction, the first
// element of this rank's owned gradient range becomes NaN (the norm follows; the loss does not).
#pragma once

#include <cstdint>

#include "kernels/backend.h"
#include "trainer/core/runtime_options.h"

namespace tetra {

// The process's faults (none until set).
void set_step_faults(const StepFaultHook& faults);
// The slow rank of the straggler test (TETRA_TEST_SLOW_RANK / _MS; none until set).
void set_slow_rank(const TimingHooks& timing);

// Inside a step: the slow rank sleeps its delay (a span "test delay" of its timeline).
void inject_slowness(int rank);

// After the forward pass of micro-batch `micro` of step `step`: `losses` (n) per-token losses.
void inject_loss_fault(int rank, int64_t step, int64_t micro, Backend& be, float* losses, int64_t n);
// After the gradients of step `step` are reduced: `owned_grad` is this rank's first owned element.
void inject_grad_fault(int rank, int64_t step, Backend& be, float* owned_grad);

}  // namespace tetra
