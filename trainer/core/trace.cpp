#include "trainer/core/trace.h"

#include <cmath>
#include <map>
#include <mutex>

#include "trainer/core/files.h"

namespace tetra::trace {

namespace detail {
std::atomic<bool> recording{false};
}

namespace {

struct Event {
  const char* cat;
  std::string name, args;
  Clock::time_point t0, t1;
  int tid;  // -1: an asynchronous span
};

struct Recorder {
  std::mutex mutex;
  std::vector<Event> events;
  std::map<int, std::string> thread_names;
  int next_tid = 0;
  double skew_s = 0.0, epoch_s = 0.0, offset_s = 0.0;
};

// Never destroyed: a communicator's worker thread may outlive main's return (detached, comm_worker.h).
Recorder& recorder() {
  static Recorder* r = new Recorder;
  return *r;
}

// The calling thread's track: its number (assigned on first use, under the recorder's mutex).
thread_local int this_tid = -1;

int tid_locked(Recorder& r) {
  if (this_tid < 0) {
    this_tid = r.next_tid++;
    if (!r.thread_names.count(this_tid)) r.thread_names[this_tid] = fmt::format("thread {}", this_tid);
  }
  return this_tid;
}

}  // namespace

void start() {
  Recorder& r = recorder();
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    r.events.clear();
    // Room for a few steps' spans up front: a reallocation inside a profiled step would show up
    // as time outside every span.
    r.events.reserve(1 << 16);
  }
  detail::recording.store(true, std::memory_order_relaxed);
}

void stop() { detail::recording.store(false, std::memory_order_relaxed); }

void name_thread(const std::string& name) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.thread_names[tid_locked(r)] = name;
}

// An event of the calling thread's track (async: of none).
void record(const char* cat, std::string name, Clock::time_point t0, Clock::time_point t1, std::string args,
            bool async) {
  if (!on()) return;
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.events.push_back(Event{cat, std::move(name), std::move(args), t0, t1, async ? -1 : tid_locked(r)});
}

void complete(const char* cat, std::string name, Clock::time_point t0, Clock::time_point t1, std::string args) {
  record(cat, std::move(name), t0, t1, std::move(args), false);
}

void async_span(const char* cat, std::string name, Clock::time_point t0, Clock::time_point t1, std::string args) {
  record(cat, std::move(name), t0, t1, std::move(args), true);
}

std::string quote(std::string_view text) {
  std::string out = "\"";
  for (const char c : text) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) out += fmt::format("\\u{:04x}", static_cast<int>(c));
        else out += c;
    }
  }
  return out + "\"";
}

Span& Span::arg(const char* key, std::string_view v) { return on_ ? add(key, quote(v)) : *this; }

Span& Span::arg(const char* key, double v) {
  if (!on_) return *this;
  return add(key, std::isfinite(v) ? fmt::format("{}", v) : std::string("null"));
}

Span& Span::add(const char* key, const std::string& value) {
  if (!on_) return *this;
  if (!args_.empty()) args_ += ',';
  args_ += quote(key) + ":" + value;
  return *this;
}

void set_test_skew(double skew_s) { recorder().skew_s = skew_s; }

double seconds(Clock::time_point t) {
  return std::chrono::duration<double>(t.time_since_epoch()).count() + recorder().skew_s;
}

double now_s() { return seconds(Clock::now()); }

void set_common_clock(double epoch_s, double offset_s) {
  recorder().epoch_s = epoch_s;
  recorder().offset_s = offset_s;
}

int64_t recorded() {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  return static_cast<int64_t>(r.events.size());
}

int64_t write(const std::string& path, const ProcessInfo& info) {
  Recorder& r = recorder();
  std::lock_guard<std::mutex> lock(r.mutex);
  auto us = [&](Clock::time_point t) { return (seconds(t) - r.offset_s - r.epoch_s) * 1e6; };
  std::string out;
  out.reserve(r.events.size() * 128 + 1024);
  out += "{\"displayTimeUnit\":\"ms\",\"otherData\":{" + info.other_data + "},\"traceEvents\":[\n";
  out += fmt::format("{{\"ph\":\"M\",\"name\":\"process_name\",\"pid\":{},\"tid\":0,\"args\":{{\"name\":{}}}}}",
                     info.rank, quote(info.name));
  out += fmt::format(",\n{{\"ph\":\"M\",\"name\":\"process_sort_index\",\"pid\":{},\"tid\":0,\"args\":"
                     "{{\"sort_index\":{}}}}}", info.rank, info.rank);
  for (const auto& [tid, name] : r.thread_names) {
    out += fmt::format(",\n{{\"ph\":\"M\",\"name\":\"thread_name\",\"pid\":{},\"tid\":{},\"args\":{{\"name\":{}}}}}",
                       info.rank, tid, quote(name));
    out += fmt::format(",\n{{\"ph\":\"M\",\"name\":\"thread_sort_index\",\"pid\":{},\"tid\":{},\"args\":"
                       "{{\"sort_index\":{}}}}}", info.rank, tid, tid);
  }
  int64_t id = 0;
  for (const Event& e : r.events) {
    const double ts = us(e.t0), dur = std::chrono::duration<double, std::micro>(e.t1 - e.t0).count();
    if (e.tid < 0) {
      ++id;
      out += fmt::format(",\n{{\"ph\":\"b\",\"cat\":\"{}\",\"name\":{},\"id\":{},\"pid\":{},\"tid\":0,\"ts\":{:.3f},"
                         "\"args\":{{{}}}}}", e.cat, quote(e.name), id, info.rank, ts, e.args);
      out += fmt::format(",\n{{\"ph\":\"e\",\"cat\":\"{}\",\"name\":{},\"id\":{},\"pid\":{},\"tid\":0,\"ts\":{:.3f}}}",
                         e.cat, quote(e.name), id, info.rank, ts + dur);
      continue;
    }
    out += fmt::format(",\n{{\"ph\":\"X\",\"cat\":\"{}\",\"name\":{},\"pid\":{},\"tid\":{},\"ts\":{:.3f},"
                       "\"dur\":{:.3f},\"args\":{{{}}}}}",
                       e.cat, quote(e.name), info.rank, e.tid, ts, dur, e.args);
  }
  out += "\n]}\n";
  write_file_atomic(path, out);
  return static_cast<int64_t>(r.events.size());
}

}  // namespace tetra::trace
