// What the communicator tests share: tests/comm/test_comm_main.cpp (the MPI communicators, on host
// memory), tests/comm/staged_checks.cpp (the staged communicators, on guarded backend memory) and
// tests/nccl/test_nccl_main.cpp (the NCCL communicator, on GPU memory).
//
// Every rank fills its buffers from its global rank (val), so the result each rank expects from a
// collective is a plain loop over the group's members, computed locally. Values are small
// integers, exact in fp32, bf16, fp16 and i32 whatever order the communicator combines them in, so
// results are compared exactly. The accounting each call must add to the communicator's stats is
// recomputed call by call with communicator.h's formulas (ExpectedStats).
//
// The check_* functions run one kind of operation on a communicator, over the buffer memory the
// test gives them (Buf: host memory, or a backend's memory reached only through its copies), add
// each call to `want`, and report through the Checker (its `where`, which the caller sets,
// prefixes their messages and is restored on return). Each binary runs them next to the checks
// that are its own (semantics that differ between communicators: completion of grouped or
// asynchronous operations, misuse, progress).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/common/check.h"
#include "kernels/common/dtype.h"
#include "trainer/comm/communicator.h"

namespace tetra_dist_test {

// Counts checks; prints each failure to stderr as "FAIL rank R [where]: what".
struct Checker {
  int rank = 0;       // global rank
  std::string where;  // grid / group / operation being checked
  int64_t checks = 0, failures = 0;
  void expect(bool ok, const std::string& what);
};

// One check: got == want element for element (the count of differing elements and the first one
// in the message).
void expect_values(Checker& ck, const std::vector<double>& got, const std::vector<double>& want, const std::string& what);

template <typename F>
bool throws_error(F&& f) {
  try {
    f();
  } catch (const tetra::Error&) {
    return true;
  }
  return false;
}

// Element i of global rank g's data: integers in [-6, 6], distinct across ranks 0..12. Sums over
// up to 4 ranks stay within +-24: exact in bf16 (8 significant bits), fp16 (11), fp32 and i32.
double val(int g, int64_t i, int salt);
// The reduction of val(., i, salt) over `members`.
double reduce_members(const std::vector<int>& members, tetra::ReduceOp op, int64_t i, int salt);
const char* op_name(tetra::ReduceOp op);

extern const std::vector<tetra::DType> kAllTypes;     // F32, BF16, F16, I32
extern const std::vector<tetra::ReduceOp> kAllOps;    // SUM, MAX

// A typed buffer addressed in doubles (every value used is exact in its type). Its elements live
// in host memory; with a backend, the buffer the communicator gets (ptr) is the backend's memory,
// which the test reaches only through upload() and download() (Backend copies: a guarded backend
// kills the rank on any other access, and on a GPU the copies order after the compute stream).
// Without one, ptr() is the host memory itself and upload/download do nothing.
class Buf {
 public:
  Buf(tetra::Backend* be, tetra::DType type, int64_t n, double fill = 0.0);  // filled, uploaded
  Buf(tetra::DType type, int64_t n, double fill = 0.0) : Buf(nullptr, type, n, fill) {}
  ~Buf();
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;

  int64_t size() const { return n_; }
  void* ptr() { return dev_ != nullptr ? dev_ : host_.data(); }
  void* at(int64_t i) { return static_cast<char*>(ptr()) + i * static_cast<int64_t>(tetra::dtype_size(type_)); }
  const uint8_t* host_bytes() const { return host_.data(); }
  void set(int64_t i, double v);           // the host copy
  double get(int64_t i) const;             // the host copy
  std::vector<double> values() const;      // the host copy, every element
  Buf& upload();    // host copy -> buffer
  Buf& download();  // buffer -> host copy

 private:
  tetra::Backend* be_;
  tetra::DType type_;
  int64_t n_;
  std::vector<uint8_t> host_;
  void* dev_ = nullptr;
};

// The accounting of communicator.h, recomputed for each call a test makes (a group of one counts
// nothing).
struct ExpectedStats {
  tetra::CommStats s;
  int p;
  void add(tetra::CommOp op, int64_t payload, double sent);
  void all_reduce(int64_t bytes) { add(tetra::CommOp::ALL_REDUCE, bytes, 2.0 * (p - 1) * bytes / p); }
  void reduce_scatter(int64_t input_bytes) {
    add(tetra::CommOp::REDUCE_SCATTER, input_bytes, 1.0 * (p - 1) * input_bytes / p);
  }
  void all_gather(int64_t output_bytes) {
    add(tetra::CommOp::ALL_GATHER, output_bytes, 1.0 * (p - 1) * output_bytes / p);
  }
  void broadcast(int64_t bytes) { add(tetra::CommOp::BROADCAST, bytes, static_cast<double>(bytes)); }
  void send(int64_t bytes) { add(tetra::CommOp::SEND, bytes, static_cast<double>(bytes)); }
  void recv(int64_t bytes) { add(tetra::CommOp::RECV, bytes, 0.0); }
};

// Calls, payload and wire bytes of every op, and their total, against `want`.
void compare_stats(Checker& ck, const tetra::CommStats& got, const ExpectedStats& want);

// ---- operations, each over `be`'s memory (nullptr: host memory) ---------------------------------

// all_reduce of n elements, each type x op.
void check_all_reduce(Checker& ck, tetra::Communicator& c, tetra::Backend* be, ExpectedStats& want, int64_t n,
                      const std::vector<tetra::DType>& types, const std::vector<tetra::ReduceOp>& ops);
// A bf16 / fp16 all_reduce sum rounds the fp32 sum to nearest even (groups of 2 and more).
void check_half_rounding(Checker& ck, tetra::Communicator& c, tetra::Backend* be, ExpectedStats& want);
// reduce_scatter of blocks of blk, into another buffer and in place, each type x op. With
// `send_blocks_kept`, the other blocks of an in-place buffer must keep this rank's input (a
// promise of the staged communicator, not of communicator.h).
void check_reduce_scatter(Checker& ck, tetra::Communicator& c, tetra::Backend* be, ExpectedStats& want, int64_t blk,
                          const std::vector<tetra::DType>& types, const std::vector<tetra::ReduceOp>& ops,
                          bool send_blocks_kept);
// all_gather of blocks of blk, from another buffer and in place, each type.
void check_all_gather(Checker& ck, tetra::Communicator& c, tetra::Backend* be, ExpectedStats& want, int64_t blk,
                      const std::vector<tetra::DType>& types);
// all_to_all_v with uneven counts (some empty), blocks in reverse order with gaps that must stay
// untouched, each type.
void check_all_to_all_v(Checker& ck, tetra::Communicator& c, tetra::Backend* be, ExpectedStats& want,
                        const std::vector<tetra::DType>& types);
// broadcast of n fp32 elements from every root.
void check_broadcast(Checker& ck, tetra::Communicator& c, tetra::Backend* be, ExpectedStats& want, int64_t n);
// Pairs (2j, 2j+1) exchange two messages of k fp32 elements on two tags, asynchronously, and
// post the receives in the other tag order before any wait: a send queued behind the rank's own
// blocking work deadlocks here, and tags must keep the two equal-sized streams apart. Every
// stride-th element carries data, the others zero.
void check_tagged_sends(Checker& ck, tetra::Communicator& c, tetra::Backend* be, ExpectedStats& want, int64_t k,
                        int64_t stride);

}  // namespace tetra_dist_test
