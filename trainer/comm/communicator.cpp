// CommStats and the per-call accounting formulas of communicator.h (ring-algorithm wire bytes).
#include "trainer/comm/communicator.h"

#include "kernels/common/check.h"
#include "trainer/comm/comm_accounting.h"
#include "trainer/core/trace.h"

namespace tetra {

const char* comm_op_name(CommOp op) {
  switch (op) {
    case CommOp::ALL_REDUCE: return "all_reduce";
    case CommOp::REDUCE_SCATTER: return "reduce_scatter";
    case CommOp::ALL_GATHER: return "all_gather";
    case CommOp::ALL_TO_ALL: return "all_to_all";
    case CommOp::BROADCAST: return "broadcast";
    case CommOp::SEND: return "send";
    case CommOp::RECV: return "recv";
    case CommOp::COUNT_: break;
  }
  return "?";
}

double CommStats::total_sent() const {
  double total = 0.0;
  for (double b : sent_bytes) total += b;
  return total;
}

double CommStats::total_blocked_s() const {
  double total = 0.0;
  for (double t : blocked_s) total += t;
  return total;
}

void CommStats::reset() { *this = CommStats{}; }

void CommStats::add(const CommStats& other) {
  for (int i = 0; i < kCommOps; ++i) {
    calls[i] += other.calls[i];
    payload_bytes[i] += other.payload_bytes[i];
    sent_bytes[i] += other.sent_bytes[i];
    blocked_s[i] += other.blocked_s[i];
  }
}

void account_call(CommStats& stats, CommOp op, int group_size, int64_t payload_bytes) {
  if (group_size <= 1) return;
  const double payload = static_cast<double>(payload_bytes);
  const double p = group_size;
  double sent = 0.0;
  switch (op) {
    case CommOp::ALL_REDUCE: sent = payload * (2.0 * (p - 1.0)) / p; break;
    case CommOp::REDUCE_SCATTER:
    case CommOp::ALL_GATHER: sent = payload * (p - 1.0) / p; break;
    case CommOp::BROADCAST:
    case CommOp::SEND: sent = payload; break;
    case CommOp::RECV: sent = 0.0; break;
    case CommOp::ALL_TO_ALL:
    case CommOp::COUNT_: TETRA_CHECK(false, "account_call cannot count {}", comm_op_name(op));
  }
  const int i = static_cast<int>(op);
  stats.calls[i] += 1;
  stats.payload_bytes[i] += payload_bytes;
  stats.sent_bytes[i] += sent;
}

void account_all_to_all(CommStats& stats, int group_size, int64_t payload_bytes, int64_t to_others_bytes) {
  if (group_size <= 1) return;
  const int i = static_cast<int>(CommOp::ALL_TO_ALL);
  stats.calls[i] += 1;
  stats.payload_bytes[i] += payload_bytes;
  stats.sent_bytes[i] += static_cast<double>(to_others_bytes);
}

void Communicator::trace_wait(CommOp op, std::chrono::steady_clock::time_point t0,
                              std::chrono::steady_clock::time_point t1) {
  trace::complete("wait", fmt::format("wait {} {}", name(), comm_op_name(op)), t0, t1,
                  "\"group\":" + trace::quote(name()) + ",\"op\":" + trace::quote(comm_op_name(op)));
}

}  // namespace tetra
