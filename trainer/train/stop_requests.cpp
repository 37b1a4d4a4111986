#include "trainer/train/stop_requests.h"

#include <signal.h>

#include <chrono>
#include <csignal>

namespace tetra {

namespace {
volatile std::sig_atomic_t g_stop_signal = 0;
extern "C" void on_stop_signal(int sig) { g_stop_signal = sig; }
// training.exit_after_min counts from the process's start (as a scheduler's time limit does).
const auto g_process_start = std::chrono::steady_clock::now();
}  // namespace

const char* stop_cause_name(StopCause cause) {
  switch (cause) {
    case StopCause::SIGNAL: return "a signal";
    case StopCause::TIME_LIMIT: return "training.exit_after_min";
    case StopCause::EXIT_INTERVAL: return "training.exit_interval";
    case StopCause::NONE: break;
  }
  return "no stop";
}

StopRequests::StopRequests(const TrainingConfig& tc) : tc_(tc) {}

void StopRequests::install_signal_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_stop_signal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGUSR1, &sa, nullptr);
}

int32_t StopRequests::request() const {
  int32_t flag = g_stop_signal != 0 ? 1 : 0;
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - g_process_start).count();
  if (tc_.exit_after_min > 0 && seconds >= 60.0 * tc_.exit_after_min) flag = 2;
  return flag;
}

StopCause StopRequests::check(int64_t step, bool last, int32_t agreed) const {
  if (agreed != 0) return static_cast<StopCause>(agreed);
  if (tc_.exit_interval > 0 && step % tc_.exit_interval == 0 && !last) return StopCause::EXIT_INTERVAL;
  return StopCause::NONE;
}

}  // namespace tetra
