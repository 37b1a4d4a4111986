// The timeline of a rank: spans recorded during the profiled steps (training.profile_steps) and
// written as one Chrome-trace JSON file per rank (Perfetto and chrome://tracing load it;
// `tetra trace merge` joins the ranks' files into one).
//
// What records spans: the training loop (each step and its phases, the optimizer, checkpoint
// I/O), the pipeline runner (each forward or backward slot), the traced backend (each op,
// trainer/train/traced_backend.h), the communicators (the calling thread's waits; each
// collective and transfer on its group's worker thread, with its group and bytes).
//
// The recorder is one per process (spans come from every layer and several threads, and the
// profiler is off outside the profiled steps, when a span costs one relaxed atomic load).
// Threads are tracks: the thread that first records is named by name_thread() or "thread N".
//
// Clocks: events keep this process's steady clock. On writing, each time is mapped to global
// rank 0's clock (offset measured at start-up, trainer/train/step_trace.h) and made relative to
// rank 0's epoch, so every rank's file shares one time axis.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <fmt/format.h>

namespace tetra::trace {

using Clock = std::chrono::steady_clock;

namespace detail {
extern std::atomic<bool> recording;
}

// True while spans are recorded (inside the profiled steps).
inline bool on() { return detail::recording.load(std::memory_order_relaxed); }

// Starts recording (clearing what an earlier window recorded) / stops it.
void start();
void stop();

// Names the calling thread's track ("main", "comm dp").
void name_thread(const std::string& name);

// One finished span on the calling thread's track: `cat` its kind (step, phase, op, wait,
// collective, p2p, pipeline, optimizer, checkpoint), `args` a JSON object's members without braces
// (`"group":"dp","bytes":4096`) or empty. Recorded only while on().
void complete(const char* cat, std::string name, Clock::time_point t0, Clock::time_point t1, std::string args = {});

// A span that may overlap others of its kind (transfers in flight at once): written as an
// asynchronous pair (Chrome's "b"/"e" events, one track per name in Perfetto) of this process.
void async_span(const char* cat, std::string name, Clock::time_point t0, Clock::time_point t1, std::string args = {});

// A span that records itself when it goes out of scope (nothing when off at construction).
class Span {
 public:
  Span(const char* cat, std::string_view name) : on_(on()) {
    if (on_) cat_ = cat, name_ = name, t0_ = Clock::now();
  }
  template <class A0, class... A>
  Span(const char* cat, fmt::format_string<A0, A...> f, A0&& a0, A&&... a) : on_(on()) {
    if (on_) cat_ = cat, name_ = fmt::format(f, std::forward<A0>(a0), std::forward<A>(a)...), t0_ = Clock::now();
  }
  ~Span() {
    if (on_) complete(cat_, std::move(name_), t0_, Clock::now(), std::move(args_));
  }
  Span(const Span&) = delete;
  Span& operator=(const Span&) = delete;

  // Adds a member to the span's args (a number, or text quoted as JSON).
  Span& arg(const char* key, int64_t v) { return on_ ? add(key, fmt::format("{}", v)) : *this; }
  Span& arg(const char* key, double v);  // a non-finite value as null
  Span& arg(const char* key, std::string_view v);
  bool recording() const { return on_; }

 private:
  Span& add(const char* key, const std::string& value);
  bool on_;
  const char* cat_ = "";
  std::string name_, args_;
  Clock::time_point t0_;
};

// `text` as a JSON string literal (quotes included).
std::string quote(std::string_view text);

// ---- clock and output ------------------------------------------------------------------------
// A test hook: this process's trace clock runs `skew_s` ahead of its steady clock (a rank on
// another node, tests/cli/test_trace.sh).
void set_test_skew(double skew_s);
// This process's trace clock now, in seconds.
double now_s();
// A time point on the trace clock, in seconds.
double seconds(Clock::time_point t);
// The mapping to the common time axis: ts = (t - offset_s - epoch_s) µs, where offset_s is this
// rank's clock minus rank 0's and epoch_s rank 0's clock at ts 0.
void set_common_clock(double epoch_s, double offset_s);

struct ProcessInfo {
  int rank = 0;
  std::string name;        // "rank 3 [tp1 pp0 dp1]"
  std::string other_data;  // JSON object members for the file's "otherData" (without braces)
};
// What was recorded as a Chrome trace (JSON object format), written to `path` through a temporary
// file and a rename. Returns the number of events written.
int64_t write(const std::string& path, const ProcessInfo& info);
// The number of spans recorded since start().
int64_t recorded();

}  // namespace tetra::trace
