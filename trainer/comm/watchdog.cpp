// The watchdog thread and its record (see watchdog.h).
#include "trainer/comm/watchdog.h"

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "trainer/comm/bootstrap.h"

namespace tetra {

namespace {

using Clock = std::chrono::steady_clock;

struct Wait {
  int64_t id;
  const std::string* group;
  const std::vector<int>* members;
  const char* op;
  Clock::time_point since;
};

// The process's record and the thread that watches it.
struct State {
  std::mutex mutex;
  std::condition_variable cv;
  bool stop = false;
  double timeout_s = 0.0;
  int rank = 0;
  std::string where;
  HangHook hang;  // test-only (watchdog_step_begin)
  int64_t next_id = 0;
  std::vector<Wait> waits;  // blocking waits in progress (any thread)
  int64_t step = 0;         // the step in progress, 0 = none
  Clock::time_point step_since;
  std::thread thread;
  ~State() {  // a process that returns without watchdog_stop()
    {
      std::lock_guard<std::mutex> lock(mutex);
      stop = true;
    }
    cv.notify_all();
    if (thread.joinable()) thread.join();
  }
};

State g_state;
std::atomic<bool> g_on{false};

double seconds(Clock::time_point from, Clock::time_point to) {
  return std::chrono::duration<double>(to - from).count();
}

// The report of a timed-out rank, or "" when nothing has lasted longer than the timeout.
// Called with the mutex held.
std::string overdue_report(const State& s, Clock::time_point now) {
  const bool step_overdue = s.step > 0 && seconds(s.step_since, now) > s.timeout_s;
  const Wait* longest = nullptr;
  for (const Wait& w : s.waits)
    if (longest == nullptr || w.since < longest->since) longest = &w;
  const bool wait_overdue = longest != nullptr && seconds(longest->since, now) > s.timeout_s;
  if (!step_overdue && !wait_overdue) return "";

  std::string what = s.step > 0 ? fmt::format("has been in step {} for {:.1f} s", s.step, seconds(s.step_since, now))
                                 : std::string("is outside the training steps");
  std::string why;
  if (longest != nullptr)
    why = fmt::format("waiting {:.1f} s in {} on group '{}' (global ranks [{}]) for a member that has not joined "
                      "it (hung or dead)",
                      seconds(longest->since, now), longest->op, *longest->group, fmt::join(*longest->members, ", "));
  else
    why = "not waiting in any collective: this rank is stuck in its own work (a kernel, I/O, a deadlock), and the "
          "ranks waiting for it time out too";
  return fmt::format("watchdog: rank {} {} {} (training.collective_timeout_s = {}): {}; ending the job", s.rank,
                     s.where, what, s.timeout_s, why);
}

[[noreturn]] void report_and_abort(const std::string& report, double timeout_s) {
  std::fprintf(stderr, "error: %s\n", report.c_str());
  std::fflush(stderr);
  if (spdlog::default_logger()) spdlog::default_logger()->flush();
  // The other stuck ranks reach their own timeouts within moments: let them report too, so the
  // log shows which rank is the odd one out, then end the job. alarm(): should MPI_Abort itself
  // hang (an unreachable peer), SIGALRM's default action ends this process.
  const double grace_s = std::clamp(timeout_s / 4.0, 0.2, 2.0);
  std::this_thread::sleep_for(std::chrono::duration<double>(grace_s));
  alarm(30);
  dist_abort(kWatchdogExitCode);
}

void watch(State* s) {
  const auto poll = std::chrono::duration<double>(std::clamp(s->timeout_s / 10.0, 0.05, 2.0));
  std::unique_lock<std::mutex> lock(s->mutex);
  while (!s->stop) {
    s->cv.wait_for(lock, poll);
    if (s->stop) return;
    const std::string report = overdue_report(*s, Clock::now());
    if (report.empty()) continue;
    const double timeout_s = s->timeout_s;
    lock.unlock();
    report_and_abort(report, timeout_s);
  }
}

}  // namespace

void watchdog_start(double timeout_s, int rank, const std::string& where, const HangHook& hang) {
  std::lock_guard<std::mutex> lock(g_state.mutex);
  g_state.rank = rank;
  g_state.where = where;
  g_state.hang = hang;
  if (timeout_s <= 0.0 || g_state.thread.joinable()) return;
  g_state.stop = false;
  g_state.timeout_s = timeout_s;
  g_state.thread = std::thread(watch, &g_state);
  g_on = true;
}

void watchdog_stop() {
  {
    std::lock_guard<std::mutex> lock(g_state.mutex);
    if (!g_state.thread.joinable()) return;
    g_state.stop = true;
    g_on = false;
  }
  g_state.cv.notify_all();
  g_state.thread.join();
}

WatchedWait::WatchedWait(const std::string& group, const std::vector<int>& members, const char* op) {
  if (!g_on.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(g_state.mutex);
  id_ = g_state.next_id++;
  g_state.waits.push_back(Wait{id_, &group, &members, op, Clock::now()});
}

WatchedWait::~WatchedWait() {
  if (id_ < 0) return;
  std::lock_guard<std::mutex> lock(g_state.mutex);
  auto& w = g_state.waits;
  w.erase(std::remove_if(w.begin(), w.end(), [this](const Wait& x) { return x.id == id_; }), w.end());
}

void watchdog_step_begin(int64_t step) {
  if (g_on.load(std::memory_order_relaxed)) {
    std::lock_guard<std::mutex> lock(g_state.mutex);
    g_state.step = step;
    g_state.step_since = Clock::now();
  }
  // Test-only: a rank that hangs in its own work (see watchdog.h).
  const HangHook& hang = g_state.hang;
  const int64_t hang_rank = hang.rank;
  if (hang.step == step && hang_rank == g_state.rank) {
    const int64_t hang_s = hang.seconds;
    std::fprintf(stderr, "TETRA_TEST_HANG: rank %lld sleeps %lld s at the start of step %lld\n",
                 static_cast<long long>(hang_rank), static_cast<long long>(hang_s), static_cast<long long>(step));
    std::fflush(stderr);
    std::this_thread::sleep_for(std::chrono::seconds(hang_s));
  }
}

void watchdog_step_end() {
  if (!g_on.load(std::memory_order_relaxed)) return;
  std::lock_guard<std::mutex> lock(g_state.mutex);
  g_state.step = 0;
}

}  // namespace tetra
