// The MPI communicators under a real launch: `mpirun -np 4 test_comm` (and a plain singleton run).
//
// Every rank fills its buffers from its global rank, so the result each rank expects from a
// collective is a plain loop over the group's members, computed locally. Each check runs on every
// communicator of several rank grids, so group membership and member order are checked by the
// data too. With np 4: tp2 x dp2 with ep2; tp2 x pp2 in the default order and in "pp-dp-tp" (where
// the mp group's order, tp fastest, differs from the ranks' order); dp4 with ep2 in "dp-tp-pp";
// pp4 (middle stages alone in their embedding group). Each grid's groups are also checked in their
// backend-memory role, staged over guarded memory (staged_checks.h).
// Values are small integers, exact in fp32, bf16, fp16 and i32 whatever order MPI combines them
// in, so results are compared exactly; the one fp32 sum of inexact values has a stated tolerance.
// Stats are compared with the formulas of communicator.h, recomputed here call by call.
//
// Exits 1 with a message per failed check (after every rank has finished), or at once through
// MPI_Abort on an unexpected exception.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include "trainer/core/check.h"
#include "trainer/dist/bootstrap.h"
#include "trainer/dist/mpi_communicator.h"
#include "trainer/dist/process_groups.h"
#include "tests/dist/staged_checks.h"

using namespace tetra;

namespace {

int g_rank = 0;
int64_t g_checks = 0, g_failures = 0;
std::string g_where;  // grid / group / op being checked, for messages

void expect(bool ok, const std::string& what) {
  ++g_checks;
  if (ok) return;
  ++g_failures;
  std::fprintf(stderr, "FAIL rank %d [%s]: %s\n", g_rank, g_where.c_str(), what.c_str());
}

// A typed host buffer addressed in doubles; every value used is exact in its type.
struct Buf {
  DType type;
  std::vector<uint8_t> bytes;
  Buf(DType t, int64_t n, double fill = 0.0) : type(t), bytes(static_cast<size_t>(n) * dtype_size(t)) {
    for (int64_t i = 0; i < n; ++i) set(i, fill);
  }
  int64_t size() const { return static_cast<int64_t>(bytes.size() / dtype_size(type)); }
  void* data() { return bytes.data(); }
  void* at(int64_t i) { return bytes.data() + i * dtype_size(type); }
  void set(int64_t i, double v) {
    if (type == DType::F32) {
      const float x = static_cast<float>(v);
      std::memcpy(at(i), &x, 4);
    } else if (type == DType::BF16) {
      const uint16_t b = math::f32_to_bf16_bits(static_cast<float>(v));
      std::memcpy(at(i), &b, 2);
    } else if (type == DType::F16) {
      const uint16_t b = math::f32_to_f16_bits(static_cast<float>(v));
      std::memcpy(at(i), &b, 2);
    } else {
      const int32_t x = static_cast<int32_t>(v);
      std::memcpy(at(i), &x, 4);
    }
  }
  double get(int64_t i) const {
    const uint8_t* p = bytes.data() + i * dtype_size(type);
    if (type == DType::F32) {
      float x;
      std::memcpy(&x, p, 4);
      return x;
    }
    if (type == DType::BF16 || type == DType::F16) {
      uint16_t b;
      std::memcpy(&b, p, 2);
      return type == DType::F16 ? math::f16_bits_to_f32(b) : math::bf16_bits_to_f32(b);
    }
    int32_t x;
    std::memcpy(&x, p, 4);
    return x;
  }
};

// Element i of global rank g's data: integers in [-6, 6], distinct across ranks 0..12. Sums over
// up to 4 ranks stay within +-24: exact in bf16 (8 significant bits), fp16 (11), fp32 and i32.
double val(int g, int64_t i, int salt) { return static_cast<double>((g * 7 + i * 3 + salt) % 13) - 6.0; }

const DType kTypes[] = {DType::F32, DType::BF16, DType::F16, DType::I32};
const ReduceOp kOps[] = {ReduceOp::SUM, ReduceOp::MAX};
const char* op_name(ReduceOp op) { return op == ReduceOp::SUM ? "sum" : "max"; }

double reduce_members(const std::vector<int>& members, ReduceOp op, int64_t i, int salt) {
  double acc = op == ReduceOp::SUM ? 0.0 : -1e30;
  for (int m : members) acc = op == ReduceOp::SUM ? acc + val(m, i, salt) : std::max(acc, val(m, i, salt));
  return acc;
}

// The accounting of communicator.h, recomputed for each call this test makes.
struct ExpectedStats {
  CommStats s;
  int p;
  void add(CommOp op, int64_t payload, double sent) {
    if (p == 1) return;  // a group of one counts nothing
    const int i = static_cast<int>(op);
    s.calls[i] += 1;
    s.payload_bytes[i] += payload;
    s.sent_bytes[i] += sent;
  }
  void all_reduce(int64_t bytes) { add(CommOp::ALL_REDUCE, bytes, 2.0 * (p - 1) * bytes / p); }
  void reduce_scatter(int64_t input_bytes) {
    add(CommOp::REDUCE_SCATTER, input_bytes, 1.0 * (p - 1) * input_bytes / p);
  }
  void all_gather(int64_t output_bytes) { add(CommOp::ALL_GATHER, output_bytes, 1.0 * (p - 1) * output_bytes / p); }
  void broadcast(int64_t bytes) { add(CommOp::BROADCAST, bytes, static_cast<double>(bytes)); }
  void send(int64_t bytes) { add(CommOp::SEND, bytes, static_cast<double>(bytes)); }
  void recv(int64_t bytes) { add(CommOp::RECV, bytes, 0.0); }
};

void compare_stats(const CommStats& got, const ExpectedStats& want) {
  for (int i = 0; i < kCommOps; ++i) {
    const CommOp op = static_cast<CommOp>(i);
    expect(got.calls[i] == want.s.calls[i],
           fmt::format("stats {} calls {} != {}", comm_op_name(op), got.calls[i], want.s.calls[i]));
    expect(got.payload_bytes[i] == want.s.payload_bytes[i],
           fmt::format("stats {} payload {} != {}", comm_op_name(op), got.payload_bytes[i], want.s.payload_bytes[i]));
    // Sums of a few products of small integers with (p-1)/p: equal up to double rounding.
    expect(std::abs(got.sent_bytes[i] - want.s.sent_bytes[i]) <= 1e-9 * (1.0 + want.s.sent_bytes[i]),
           fmt::format("stats {} sent {} != {}", comm_op_name(op), got.sent_bytes[i], want.s.sent_bytes[i]));
  }
  double total = 0.0;
  for (double b : want.s.sent_bytes) total += b;
  expect(std::abs(got.total_sent() - total) <= 1e-9 * (1.0 + total), "stats total_sent");
}

template <typename F>
bool throws_error(F&& f) {
  try {
    f();
  } catch (const Error&) {
    return true;
  }
  return false;
}

// ---------------------------------------------------------------------------------------------
// One communicator: every operation, every type, with the stats it must have counted.
// ---------------------------------------------------------------------------------------------
void check_communicator(Communicator& c, const std::vector<int>& grid_members) {
  const int p = c.size(), r = c.rank();
  const std::vector<int>& m = c.members();
  ExpectedStats want{CommStats{}, p};
  c.stats().reset();
  const std::string where = g_where;

  // Membership, and that the MPI communicator holds exactly these ranks in this order.
  expect(m == grid_members, fmt::format("members [{}] != grid [{}]", fmt::join(m, ","), fmt::join(grid_members, ",")));
  expect(p == static_cast<int>(m.size()) && r >= 0 && r < p && m[r] == g_rank, "rank/size/members");
  {
    Buf mine(DType::I32, 1, g_rank), all(DType::I32, p, -1);
    c.all_gather(all.data(), mine.data(), 1, DType::I32);
    want.all_gather(p * 4);
    for (int k = 0; k < p; ++k) expect(all.get(k) == m[k], fmt::format("all_gather of global ranks, slot {}", k));
  }

  const int64_t n = 37;  // odd, not a multiple of anything
  for (DType t : kTypes)
    for (ReduceOp op : kOps) {
      g_where = fmt::format("{} all_reduce {} {}", where, dtype_name(t), op_name(op));
      Buf b(t, n);
      for (int64_t i = 0; i < n; ++i) b.set(i, val(g_rank, i, 1));
      c.all_reduce(b.data(), n, t, op);
      want.all_reduce(n * dtype_size(t));
      for (int64_t i = 0; i < n; ++i)
        expect(b.get(i) == reduce_members(m, op, i, 1), fmt::format("element {}: {} != {}", i, b.get(i),
                                                                    reduce_members(m, op, i, 1)));
    }

  if (p >= 2) {
    // bf16 sum rounds the fp32 sum to nearest even: group rank 0 gives 1, rank 1 a fraction of
    // bf16's step at 1 (2^-7), the others 0 (exact in any combining order).
    g_where = where + " all_reduce bf16 rounding";
    const double frac[3] = {3.0 / 256, 1.0 / 256, 5.0 / 512};  // 1.5, 0.5 (tie), 1.25 steps
    const double rounded[3] = {1.015625, 1.0, 1.0078125};     // even, even, nearest
    Buf b(DType::BF16, 3);
    for (int i = 0; i < 3; ++i) b.set(i, r == 0 ? 1.0 : (r == 1 ? frac[i] : 0.0));
    c.all_reduce(b.data(), 3, DType::BF16, ReduceOp::SUM);
    want.all_reduce(3 * 2);
    for (int i = 0; i < 3; ++i) expect(b.get(i) == rounded[i], fmt::format("element {}: {}", i, b.get(i)));

    // fp16 the same with its step at 1 of 2^-10: one rounding of the fp32 sum, ties to even.
    g_where = where + " all_reduce f16 rounding";
    const double frac16[3] = {3.0 / 2048, 1.0 / 2048, 5.0 / 4096};  // 1.5, 0.5 (tie), 1.25 steps
    const double rounded16[3] = {1.001953125, 1.0, 1.0009765625};   // even, even, nearest
    Buf h(DType::F16, 3);
    for (int i = 0; i < 3; ++i) h.set(i, r == 0 ? 1.0 : (r == 1 ? frac16[i] : 0.0));
    c.all_reduce(h.data(), 3, DType::F16, ReduceOp::SUM);
    want.all_reduce(3 * 2);
    for (int i = 0; i < 3; ++i) expect(h.get(i) == rounded16[i], fmt::format("element {}: {}", i, h.get(i)));

    // fp32 sum of inexact values, against the double-precision sum of the same fp32 inputs: p - 1
    // additions, each rounding a partial sum of magnitude <= p by at most 2^-24 of it, so
    // |error| <= p^2 * 2^-24 ~ p^2 * 6e-8. And bitwise the same on every rank of the group.
    g_where = where + " all_reduce f32 inexact";
    const int64_t k = 1000;
    Buf x(DType::F32, k);
    for (int64_t i = 0; i < k; ++i) x.set(i, std::sin(0.37 * g_rank + 0.011 * i));
    c.all_reduce(x.data(), k, DType::F32, ReduceOp::SUM);
    want.all_reduce(k * 4);
    for (int64_t i = 0; i < k; ++i) {
      double ref = 0.0;
      for (int g : m) ref += static_cast<float>(std::sin(0.37 * g + 0.011 * i));
      expect(std::abs(x.get(i) - ref) <= p * p * 6e-8, fmt::format("element {}: {} vs {}", i, x.get(i), ref));
    }
    Buf copies(DType::F32, k * p);
    c.all_gather(copies.data(), x.data(), k, DType::F32);
    want.all_gather(k * p * 4);
    for (int q = 0; q < p; ++q)
      expect(std::memcmp(copies.bytes.data() + q * k * 4, x.bytes.data(), k * 4) == 0,
             fmt::format("the all_reduce result of group rank {} differs from this rank's", q));
  }

  const int64_t blk = 5;
  for (DType t : kTypes)
    for (ReduceOp op : kOps)
      for (bool in_place : {false, true}) {
        g_where = fmt::format("{} reduce_scatter {} {}{}", where, dtype_name(t), op_name(op),
                              in_place ? " in place" : "");
        Buf send(t, p * blk), out(t, blk, 99);
        for (int64_t j = 0; j < p * blk; ++j) send.set(j, val(g_rank, j, 2));
        void* recv = in_place ? send.at(r * blk) : out.data();
        c.reduce_scatter(recv, send.data(), blk, t, op);
        want.reduce_scatter(p * blk * dtype_size(t));
        const Buf& res = in_place ? send : out;
        const int64_t base = in_place ? r * blk : 0;
        for (int64_t i = 0; i < blk; ++i)
          expect(res.get(base + i) == reduce_members(m, op, r * blk + i, 2), fmt::format("element {}", i));
      }

  for (DType t : kTypes)
    for (bool in_place : {false, true}) {
      g_where = fmt::format("{} all_gather {}{}", where, dtype_name(t), in_place ? " in place" : "");
      Buf recv(t, p * blk, 99), send(t, blk);
      for (int64_t i = 0; i < blk; ++i) (in_place ? recv : send).set((in_place ? r * blk : 0) + i, val(g_rank, i, 3));
      c.all_gather(recv.data(), in_place ? recv.at(r * blk) : send.data(), blk, t);
      want.all_gather(p * blk * dtype_size(t));
      for (int q = 0; q < p; ++q)
        for (int64_t i = 0; i < blk; ++i)
          expect(recv.get(q * blk + i) == val(m[q], i, 3), fmt::format("block {} element {}", q, i));
    }

  // all_to_all_v: sender s sends cnt(s, d) elements to group rank d (0, 1 or 2: uneven, some
  // empty), its blocks laid out in reverse destination order with one-element gaps; receivers
  // place blocks in source order with two-element gaps, which must stay untouched.
  for (DType t : kTypes) {
    g_where = fmt::format("{} all_to_all_v {}", where, dtype_name(t));
    const auto cnt = [](int s_global, int d) { return static_cast<int64_t>((s_global + 2 * d) % 3); };
    const auto code = [](int s_global, int d, int64_t k) { return static_cast<double>(s_global * 16 + d * 4 + k); };
    std::vector<int64_t> sc(p), so(p), rc(p), ro(p);
    int64_t off = 0, total = 0;
    for (int d = p - 1; d >= 0; --d) {
      sc[d] = cnt(g_rank, d);
      so[d] = off;
      off += sc[d] + 1;
      total += sc[d];
    }
    Buf send(t, off, -1);
    for (int d = 0; d < p; ++d)
      for (int64_t k = 0; k < sc[d]; ++k) send.set(so[d] + k, code(g_rank, d, k));
    int64_t roff = 0;
    for (int s = 0; s < p; ++s) {
      rc[s] = cnt(m[s], r);
      ro[s] = roff;
      roff += rc[s] + 2;
    }
    Buf recv(t, roff, -3);
    c.all_to_all_v(send.data(), sc, so, recv.data(), rc, ro, t);
    const int64_t e = dtype_size(t);
    want.add(CommOp::ALL_TO_ALL, total * e, static_cast<double>((total - sc[r]) * e));
    Buf expected(t, roff, -3);
    for (int s = 0; s < p; ++s)
      for (int64_t k = 0; k < rc[s]; ++k) expected.set(ro[s] + k, code(m[s], r, k));
    for (int64_t i = 0; i < roff; ++i) expect(recv.get(i) == expected.get(i), fmt::format("element {}", i));
  }

  for (int root = 0; root < p; ++root) {
    g_where = fmt::format("{} broadcast from {}", where, root);
    Buf b(DType::F32, n, -7);
    if (r == root)
      for (int64_t i = 0; i < n; ++i) b.set(i, val(g_rank, i, 4));
    c.broadcast(b.data(), n, DType::F32, root);
    want.broadcast(n * 4);
    for (int64_t i = 0; i < n; ++i) expect(b.get(i) == val(m[root], i, 4), fmt::format("element {}", i));
  }

  // Rings inside group_start/group_end, both directions (with p = 1: to itself).
  for (int dir : {1, -1}) {
    g_where = fmt::format("{} ring {}", where, dir);
    const int next = (r + dir + p) % p, prev = (r - dir + p) % p;
    const int64_t k = 11;
    Buf out(DType::BF16, k), in(DType::BF16, k, -1);
    for (int64_t i = 0; i < k; ++i) out.set(i, val(g_rank, i, 5));
    c.group_start();
    WorkHandle hs = c.send_async(out.data(), k, DType::BF16, next);
    WorkHandle hr = c.recv_async(in.data(), k, DType::BF16, prev);
    expect(throws_error([&] { hr->wait(); }), "wait() before group_end() must throw, not hang");
    expect(!hr->test(), "test() before group_end()");
    c.group_end();
    expect(hs->test() && hr->test(), "send and recv complete after group_end()");
    hs->wait();
    hr->wait();
    want.send(k * 2);
    want.recv(k * 2);
    for (int64_t i = 0; i < k; ++i) expect(in.get(i) == val(m[prev], i, 5), fmt::format("element {}", i));
  }

  // Plain blocking send/recv between pairs (2j, 2j+1): the even rank sends first.
  if (p >= 2 && !(p % 2 == 1 && r == p - 1)) {
    g_where = where + " send/recv pairs";
    const int peer = r ^ 1;
    Buf out(DType::I32, 7), in(DType::I32, 7, -1);
    for (int64_t i = 0; i < 7; ++i) out.set(i, 1000 * g_rank + i);
    if (r % 2 == 0) {
      c.send(out.data(), 7, DType::I32, peer);
      c.recv(in.data(), 7, DType::I32, peer);
    } else {
      c.recv(in.data(), 7, DType::I32, peer);
      c.send(out.data(), 7, DType::I32, peer);
    }
    want.send(28);
    want.recv(28);
    for (int64_t i = 0; i < 7; ++i) expect(in.get(i) == 1000 * m[peer] + i, fmt::format("element {}", i));
  }
  // Pipeline-style exchange: every pair sends each other a large message (beyond any eager limit,
  // so a send completes only when matched) on two tags, posts the receives in the other tag order
  // and only then waits. A send queued behind the rank's own blocking work would deadlock here;
  // tags must keep the two streams apart although both messages have the same size.
  if (p >= 2 && !(p % 2 == 1 && r == p - 1)) {
    g_where = where + " crossed sends with tags";
    const int peer = r ^ 1;
    const int64_t k = 1 << 20;  // 4 MiB each
    Buf a(DType::F32, k), b(DType::F32, k), got_a(DType::F32, k, -1), got_b(DType::F32, k, -1);
    for (int64_t i = 0; i < k; i += 4099) {
      a.set(i, val(g_rank, i, 6));
      b.set(i, val(g_rank, i, 7));
    }
    WorkHandle sa = c.send_async(a.data(), k, DType::F32, peer, /*tag=*/0);
    WorkHandle sb = c.send_async(b.data(), k, DType::F32, peer, /*tag=*/1);
    WorkHandle rb = c.recv_async(got_b.data(), k, DType::F32, peer, /*tag=*/1);
    WorkHandle ra = c.recv_async(got_a.data(), k, DType::F32, peer, /*tag=*/0);
    c.wait(*rb, CommOp::RECV);
    c.wait(*ra, CommOp::RECV);
    c.wait(*sa, CommOp::SEND);
    c.wait(*sb, CommOp::SEND);
    for (int j = 0; j < 2; ++j) {
      want.send(k * 4);
      want.recv(k * 4);
    }
    for (int64_t i = 0; i < k; i += 4099) {
      expect(got_a.get(i) == val(m[peer], i, 6), fmt::format("tag 0 element {}", i));
      expect(got_b.get(i) == val(m[peer], i, 7), fmt::format("tag 1 element {}", i));
    }
  }
  if (p == 1) {
    g_where = where + " misuse";
    Buf b(DType::F32, 1);
    expect(throws_error([&] { c.send(b.data(), 1, DType::F32, 0); }), "send to itself outside a group throws");
  }

  // Ordered execution: 12 async all_reduces; once the last is waited for, every earlier one is done.
  {
    g_where = where + " async order";
    std::vector<Buf> bufs;
    std::vector<WorkHandle> works;
    for (int j = 0; j < 12; ++j) bufs.emplace_back(DType::F32, n);
    for (int j = 0; j < 12; ++j) {
      for (int64_t i = 0; i < n; ++i) bufs[j].set(i, val(g_rank, i, 10 + j));
      works.push_back(c.all_reduce_async(bufs[j].data(), n, DType::F32, ReduceOp::SUM));
      want.all_reduce(n * 4);
    }
    works.back()->wait();
    for (int j = 0; j < 12; ++j) {
      expect(works[j]->test(), fmt::format("op {} done once op 11 is", j));
      works[j]->wait();
      for (int64_t i = 0; i < n; ++i) expect(bufs[j].get(i) == reduce_members(m, ReduceOp::SUM, i, 10 + j), "value");
    }
  }

  // Misuse: a collective inside a group, wrong vector lengths.
  {
    g_where = where + " misuse";
    Buf b(DType::F32, 4);
    c.group_start();
    expect(throws_error([&] { c.all_reduce(b.data(), 4, DType::F32); }), "collective inside a group throws");
    c.group_end();
    const std::vector<int64_t> short_counts(p + 1, 0);
    expect(throws_error([&] { c.all_to_all_v(b.data(), short_counts, short_counts, b.data(), short_counts,
                                             short_counts, DType::F32); }),
           "all_to_all_v with size()+1 counts throws");
    expect(throws_error([&] { c.broadcast(b.data(), 4, DType::F32, p); }), "broadcast from root size() throws");
  }

  c.barrier();
  g_where = where + " stats";
  compare_stats(c.stats(), want);
  g_where = where;
}

// Asynchronous operations progress while this thread computes without calling MPI: test() alone
// (which reads a flag) must turn true. 4 MiB is far beyond the eager limit: a transfer that needed
// the caller inside MPI would never finish.
void check_progress(ProcessGroups& pg) {
  g_where = "progress";
  const int64_t big = int64_t{1} << 20;
  Buf a(DType::F32, big), b(DType::F32, big);
  for (int64_t i = 0; i < big; ++i) {
    a.set(i, val(g_rank, i, 6));
    b.set(i, val(g_rank, i, 7));
  }
  WorkHandle wa = pg.world->all_reduce_async(a.data(), big, DType::F32, ReduceOp::SUM);
  WorkHandle wb = pg.dp->all_reduce_async(b.data(), big, DType::F32, ReduceOp::MAX);
  const auto start = std::chrono::steady_clock::now();
  double sink = 0.0;
  while (!(wa->test() && wb->test()) && std::chrono::steady_clock::now() - start < std::chrono::seconds(60)) {
    for (int i = 0; i < 100000; ++i) sink += std::sqrt(static_cast<double>(i));  // compute, no MPI
    std::this_thread::yield();
  }
  expect(wa->test() && wb->test(), fmt::format("async all_reduce not complete after 60 s of polling (sink {})", sink));
  wb->wait();  // reverse order of issue
  wa->wait();
  const std::vector<int>& wm = pg.world->members();
  const std::vector<int>& dm = pg.dp->members();
  int64_t bad = 0;
  for (int64_t i = 0; i < big; i += 97) {
    bad += a.get(i) != reduce_members(wm, ReduceOp::SUM, i, 6);
    bad += b.get(i) != reduce_members(dm, ReduceOp::MAX, i, 7);
  }
  expect(bad == 0, fmt::format("{} wrong elements", bad));
}

// A communicator destroyed while an operation is in flight (a rank unwinding an error) returns
// at once instead of waiting for peers that may never come; the operation still completes when
// they do, and its handle stays valid.
void check_destroy_in_flight(int world) {
  if (world < 2) return;
  g_where = "destroy in flight";
  std::vector<int> all;
  for (int q = 0; q < world; ++q) all.push_back(q);
  auto c = make_mpi_communicator("late", all);
  Buf b(DType::I32, 3);
  for (int i = 0; i < 3; ++i) b.set(i, g_rank + i);
  if (g_rank == 0) {
    WorkHandle w = c->all_reduce_async(b.data(), 3, DType::I32, ReduceOp::SUM);
    c.reset();  // the others have not issued theirs yet: they wait at the barrier below
    MPI_Barrier(MPI_COMM_WORLD);
    w->wait();
  } else {
    MPI_Barrier(MPI_COMM_WORLD);
    c->all_reduce(b.data(), 3, DType::I32);
    c.reset();
  }
  for (int i = 0; i < 3; ++i)
    expect(b.get(i) == world * (world - 1) / 2 + world * i, fmt::format("element {}: {}", i, b.get(i)));
}

// make_mpi_communicator's argument checks (collective: every rank runs them).
void check_creation_errors(int world) {
  g_where = "creation";
  std::string msg;
  try {
    make_mpi_communicator("bad", {world});
  } catch (const Error& e) {
    msg = e.what();
  }
  expect(msg.find("'bad'") != std::string::npos &&
             msg.find(fmt::format("member {} is not a rank", world)) != std::string::npos,
         "out-of-range member refused: " + msg);
  const auto refused = [](const char* name, std::vector<int> members, const std::string& why) {
    std::string text;
    try {
      make_mpi_communicator(name, std::move(members));
    } catch (const Error& e) {
      text = e.what();
    }
    expect(text.find(fmt::format("'{}'", name)) != std::string::npos && text.find(why) != std::string::npos,
           fmt::format("group '{}' refused with \"{}\": got \"{}\"", name, why, text));
  };
  refused("twice", {g_rank, g_rank}, fmt::format("member {} is listed twice", g_rank));
  if (world >= 2) refused("other", {(g_rank + 1) % world}, fmt::format("this rank ({}) is not a member", g_rank));
  if (world >= 4) {
    // Ranks 0, 1, 2 disagree on their group (rank 0 lists {0, 1}, ranks 1 and 2 list {0, 1, 2}).
    std::vector<int> members = g_rank == 0 ? std::vector<int>{0, 1}
                               : g_rank <= 2 ? std::vector<int>{0, 1, 2} : std::vector<int>{g_rank};
    msg.clear();
    try {
      make_mpi_communicator("odd", members);
    } catch (const Error& e) {
      msg = e.what();
    }
    if (g_rank <= 2)
      expect(msg.find("'odd'") != std::string::npos && msg.find("do not agree") != std::string::npos,
             "inconsistent member lists refused on every rank that joined: " + msg);
    else
      expect(msg.empty(), "a consistent size-1 group is accepted: " + msg);
  }
}

std::vector<GridSizes> grids_for(int world) {
  if (world == 4)
    return {{4, 2, 1, 2, 2, "tp-dp-pp"}, {4, 2, 2, 1, 1, "tp-dp-pp"}, {4, 2, 2, 1, 1, "pp-dp-tp"},
            {4, 1, 1, 4, 2, "dp-tp-pp"}, {4, 1, 4, 1, 1, "pp-dp-tp"}};
  return {{world, 1, 1, world, 1, "tp-dp-pp"}, {world, world, 1, 1, 1, "tp-dp-pp"}};
}

}  // namespace

int main(int argc, char** argv) {
  const char* user_yield = std::getenv("OMPI_MCA_mpi_yield_when_idle");
  const auto t0 = std::chrono::steady_clock::now();
  const ProcessInfo info = dist_init(&argc, &argv);
  const double init_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  g_rank = info.rank;
  try {
    g_where = "bootstrap";
    int mpi_rank = -1, mpi_size = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &mpi_size);
    expect(info.rank == mpi_rank && info.size == mpi_size, "rank and size");
    const bool under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
    expect(info.launcher == (under_mpirun ? "mpirun" : "single"), "launcher " + info.launcher);
    expect(info.local_rank == info.rank, "one node: local rank == rank");  // ctest runs on one host
    const char* yield = std::getenv("OMPI_MCA_mpi_yield_when_idle");
    expect(yield != nullptr && (user_yield != nullptr || std::string(yield) == "1"), "yield_when_idle set");
    const ProcessInfo again = dist_init(&argc, &argv);
    expect(again.rank == info.rank && again.size == info.size && again.launcher == info.launcher,
           "a second dist_init returns the same");
    if (info.rank == 0)
      std::printf("test_comm: %d process(es), launcher %s, dist_init %.3f s\n", info.size, info.launcher.c_str(),
                  init_s);

    for (const GridSizes& sizes : grids_for(info.size)) {
      const RankGrid grid = RankGrid::build(sizes);
      g_where = fmt::format("grid {} create", sizes.order);
      ProcessGroups pg = ProcessGroups::create(grid, info.rank);
      const std::string grid_name =
          fmt::format("tp{} pp{} dp{} ep{} {}", sizes.tp, sizes.pp, sizes.dp, sizes.ep, sizes.order);
      for (int k = 0; k < kGroupKinds; ++k) {
        const GroupKind kind = static_cast<GroupKind>(k);
        g_where = fmt::format("{} / {}", grid_name, group_kind_name(kind));
        expect(pg.get(kind).name() == group_kind_name(kind), "communicator name");
        check_communicator(pg.get(kind), grid.group(kind, info.rank));
      }
      check_progress(pg);
      std::vector<std::string> staged_failures;
      g_checks += tetra_dist_test::check_staged_communicators(pg, info.rank, staged_failures);
      for (const std::string& f : staged_failures) {
        ++g_failures;
        std::fprintf(stderr, "FAIL %s\n", f.c_str());
      }
    }
    check_creation_errors(info.size);
    check_destroy_in_flight(info.size);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d [%s]: unexpected exception: %s\n", g_rank, g_where.c_str(), e.what());
    dist_abort(1);
  }

  int64_t failures = 0;
  MPI_Allreduce(&g_failures, &failures, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0)
    std::printf("test_comm: %lld checks on rank 0, %lld failures on all ranks\n", static_cast<long long>(g_checks),
                static_cast<long long>(failures));
  dist_finalize();
  dist_finalize();  // idempotent
  return failures == 0 ? 0 : 1;
}
