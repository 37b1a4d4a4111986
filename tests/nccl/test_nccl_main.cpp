// The NCCL communicator on GPUs: `mpirun -np 2 test_nccl` (one GPU per rank) and a plain
// singleton run (a one-rank NCCL communicator). Exits 77 (ctest: skipped) without a GPU, or with
// fewer GPUs than ranks (NCCL refuses two ranks on one device).
//
// As tests/dist does for MPI: every rank fills its buffers from its global rank, and the result it
// expects from each collective is a plain loop over the members, computed on the host. Buffers are
// device memory of the CUDA backend: uploaded with copy_from_host, read back with copy_to_host
// (which synchronises the compute stream), so every check also checks the stream order: a result
// is visible only because wait() made the compute stream wait for the operation. Values are small
// integers, exact in fp32, bf16, fp16 and i32 in any combining order, so results compare exactly.
// Checked on the world group and on the same ranks in the reverse order (group rank != global
// rank), with the stats of communicator.h recomputed call by call.
//
// Point to point: the patterns a single NCCL stream would deadlock on (both ranks send first; tags
// received in the other order; a 1F1B pipeline's sends and receives), with messages of 16 MiB, far
// beyond NCCL's buffers, so a send completes only once its receive runs.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kernels/common/math.h"
#include "kernels/cuda/cuda_backend.h"
#include "trainer/core/check.h"
#include "trainer/dist/bootstrap.h"
#include "trainer/dist/mpi_communicator.h"
#include "trainer/dist/nccl_communicator.h"

using namespace tetra;

namespace {

int g_rank = 0;
int64_t g_checks = 0, g_failures = 0;
std::string g_where;

void expect(bool ok, const std::string& what) {
  ++g_checks;
  if (ok) return;
  ++g_failures;
  std::fprintf(stderr, "FAIL rank %d [%s]: %s\n", g_rank, g_where.c_str(), what.c_str());
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

// A typed buffer on the device with a host copy, addressed in doubles (values exact in every type).
struct Buf {
  Backend* be;
  DType type;
  int64_t n;
  std::vector<uint8_t> host;
  void* dev;
  Buf(Backend& b, DType t, int64_t count, double fill = 0.0)
      : be(&b), type(t), n(count), host(static_cast<size_t>(count) * dtype_size(t)), dev(b.alloc(host.size())) {
    for (int64_t i = 0; i < n; ++i) set(i, fill);
    upload();
  }
  ~Buf() { be->free(dev); }
  Buf(const Buf&) = delete;
  Buf& operator=(const Buf&) = delete;
  void* at(int64_t i) { return static_cast<char*>(dev) + i * static_cast<int64_t>(dtype_size(type)); }
  void set(int64_t i, double v) {
    uint8_t* p = host.data() + i * static_cast<int64_t>(dtype_size(type));
    if (type == DType::F32) {
      const float x = static_cast<float>(v);
      std::memcpy(p, &x, 4);
    } else if (type == DType::BF16) {
      const uint16_t b = math::f32_to_bf16_bits(static_cast<float>(v));
      std::memcpy(p, &b, 2);
    } else if (type == DType::F16) {
      const uint16_t b = math::f32_to_f16_bits(static_cast<float>(v));
      std::memcpy(p, &b, 2);
    } else {
      const int32_t x = static_cast<int32_t>(v);
      std::memcpy(p, &x, 4);
    }
  }
  double get(int64_t i) const {
    const uint8_t* p = host.data() + i * static_cast<int64_t>(dtype_size(type));
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
  void upload() { be->copy_from_host(dev, host.data(), host.size()); }
  Buf& download() {
    be->copy_to_host(host.data(), dev, host.size());
    return *this;
  }
};

// Element i of global rank g's data: integers in [-6, 6] (sums over a few ranks exact in bf16).
double val(int g, int64_t i, int salt) { return static_cast<double>((g * 7 + i * 3 + salt) % 13) - 6.0; }

const DType kTypes[] = {DType::F32, DType::BF16, DType::F16, DType::I32};
const ReduceOp kOps[] = {ReduceOp::SUM, ReduceOp::MAX};

double reduce_members(const std::vector<int>& members, ReduceOp op, int64_t i, int salt) {
  double acc = op == ReduceOp::SUM ? 0.0 : -1e30;
  for (int m : members) acc = op == ReduceOp::SUM ? acc + val(m, i, salt) : std::max(acc, val(m, i, salt));
  return acc;
}

// The accounting of communicator.h, recomputed for each call (a group of one counts nothing).
struct ExpectedStats {
  CommStats s;
  int p;
  void add(CommOp op, int64_t payload, double sent) {
    if (p == 1) return;
    const int i = static_cast<int>(op);
    s.calls[i] += 1;
    s.payload_bytes[i] += payload;
    s.sent_bytes[i] += sent;
  }
  void all_reduce(int64_t b) { add(CommOp::ALL_REDUCE, b, 2.0 * (p - 1) * b / p); }
  void reduce_scatter(int64_t in) { add(CommOp::REDUCE_SCATTER, in, 1.0 * (p - 1) * in / p); }
  void all_gather(int64_t out) { add(CommOp::ALL_GATHER, out, 1.0 * (p - 1) * out / p); }
  void broadcast(int64_t b) { add(CommOp::BROADCAST, b, static_cast<double>(b)); }
  void send(int64_t b) { add(CommOp::SEND, b, static_cast<double>(b)); }
  void recv(int64_t b) { add(CommOp::RECV, b, 0.0); }
};

void compare_stats(const CommStats& got, const ExpectedStats& want) {
  for (int i = 0; i < kCommOps; ++i) {
    const char* op = comm_op_name(static_cast<CommOp>(i));
    expect(got.calls[i] == want.s.calls[i], fmt::format("stats {} calls {} != {}", op, got.calls[i], want.s.calls[i]));
    expect(got.payload_bytes[i] == want.s.payload_bytes[i],
           fmt::format("stats {} payload {} != {}", op, got.payload_bytes[i], want.s.payload_bytes[i]));
    // Sums of products of small integers with (p-1)/p: equal up to double rounding.
    expect(std::abs(got.sent_bytes[i] - want.s.sent_bytes[i]) <= 1e-9 * (1.0 + want.s.sent_bytes[i]),
           fmt::format("stats {} sent {} != {}", op, got.sent_bytes[i], want.s.sent_bytes[i]));
  }
}

// Point to point between two ranks (group ranks 0 and 1), outside groups.
void check_p2p(Communicator& c, Backend& be, ExpectedStats& want, const std::string& where) {
  const int r = c.rank(), peer = 1 - r;
  const std::vector<int>& m = c.members();
  const int64_t big = int64_t{4} << 20;  // 16 MiB of fp32: beyond NCCL's buffers

  // Both ranks send first, then receive, on one tag: each direction is its own channel.
  g_where = where + " both send first";
  {
    Buf out(be, DType::F32, big), in(be, DType::F32, big, -1);
    for (int64_t i = 0; i < big; i += 4099) out.set(i, val(m[r], i, 6));
    out.upload();
    WorkHandle s = c.send_async(out.dev, big, DType::F32, peer, 0);
    WorkHandle v = c.recv_async(in.dev, big, DType::F32, peer, 0);
    c.wait(*s, CommOp::SEND);
    c.wait(*v, CommOp::RECV);
    want.send(big * 4);
    want.recv(big * 4);
    in.download();
    int64_t bad = 0;
    for (int64_t i = 0; i < big; i += 4099) bad += in.get(i) != val(m[peer], i, 6);
    expect(bad == 0, fmt::format("{} wrong elements", bad));
  }

  // Tags received in the other order than sent, three messages per tag (order within a tag kept).
  g_where = where + " tags crossed";
  {
    const int64_t k = 1 << 20;
    std::vector<std::unique_ptr<Buf>> bufs;
    std::vector<WorkHandle> works;
    for (int j = 0; j < 6; ++j) bufs.push_back(std::make_unique<Buf>(be, DType::F32, k, -1));
    if (r == 0) {
      for (int j = 0; j < 6; ++j) {  // message j: tag j % 2, sent in order 0..5
        for (int64_t i = 0; i < k; i += 1021) bufs[j]->set(i, 100 * j + i % 7);
        bufs[j]->upload();
        works.push_back(c.send_async(bufs[j]->dev, k, DType::F32, peer, j % 2));
        want.send(k * 4);
      }
    } else {
      for (int j : {1, 3, 5, 0, 2, 4}) {  // tag 1's messages first
        works.push_back(c.recv_async(bufs[j]->dev, k, DType::F32, peer, j % 2));
        want.recv(k * 4);
      }
    }
    for (WorkHandle& w : works) c.wait(*w, r == 0 ? CommOp::SEND : CommOp::RECV);
    if (r == 1) {
      int64_t bad = 0;
      for (int j = 0; j < 6; ++j) {
        bufs[j]->download();
        for (int64_t i = 0; i < k; i += 1021) bad += bufs[j]->get(i) != 100 * j + i % 7;
      }
      expect(bad == 0, fmt::format("{} wrong elements", bad));
    }
  }

  // A 1F1B pipeline of two stages, 4 micro-batches: stage 0 sends activations (tag 0) and
  // receives gradients (tag 1), stage 1 the reverse, each issuing in its schedule's order without
  // host waits; the gradient of micro-batch j is the activation + 1000.
  g_where = where + " 1f1b";
  {
    const int mb = 4;
    const int64_t k = big / 4;
    std::vector<std::unique_ptr<Buf>> act, grad;
    for (int j = 0; j < mb; ++j) {
      act.push_back(std::make_unique<Buf>(be, DType::F32, k, -1));
      grad.push_back(std::make_unique<Buf>(be, DType::F32, k, -1));
    }
    std::vector<WorkHandle> sends;
    if (r == 0) {
      std::vector<WorkHandle> recvs;
      for (int j = 0; j < mb; ++j) {
        for (int64_t i = 0; i < k; i += 997) act[j]->set(i, j * 10 + i % 5);
        act[j]->upload();
        sends.push_back(c.send_async(act[j]->dev, k, DType::F32, peer, 0));
        if (j >= 1) recvs.push_back(c.recv_async(grad[j - 1]->dev, k, DType::F32, peer, 1));  // warm-up of 1
      }
      recvs.push_back(c.recv_async(grad[mb - 1]->dev, k, DType::F32, peer, 1));
      for (WorkHandle& w : recvs) c.wait(*w, CommOp::RECV);
      int64_t bad = 0;
      for (int j = 0; j < mb; ++j) {
        grad[j]->download();
        for (int64_t i = 0; i < k; i += 997) bad += grad[j]->get(i) != j * 10 + i % 5 + 1000;
      }
      expect(bad == 0, fmt::format("{} wrong gradient elements", bad));
    } else {
      for (int j = 0; j < mb; ++j) {
        WorkHandle in = c.recv_async(act[j]->dev, k, DType::F32, peer, 0);
        c.wait(*in, CommOp::RECV);
        act[j]->download();  // the stage's "compute": on the host, the result sent back
        for (int64_t i = 0; i < k; i += 997) grad[j]->set(i, act[j]->get(i) + 1000);
        grad[j]->upload();
        sends.push_back(c.send_async(grad[j]->dev, k, DType::F32, peer, 1));
      }
    }
    for (WorkHandle& w : sends) c.wait(*w, CommOp::SEND);
    for (int j = 0; j < mb; ++j) {
      want.send(k * 4);
      want.recv(k * 4);
    }
  }
}

// One communicator: every operation, every type.
void check_communicator(Communicator& c, Backend& be, const std::vector<int>& members) {
  const int p = c.size(), r = c.rank();
  const std::vector<int>& m = c.members();
  const auto member = [&](int q) { return m[static_cast<size_t>(q)]; };
  const std::string where = g_where;
  ExpectedStats want{CommStats{}, p};
  c.stats().reset();
  expect(m == members && member(r) == g_rank, fmt::format("members [{}]", fmt::join(m, ",")));

  for (int64_t n : {int64_t{37}, (int64_t{1} << 20) + 3})
    for (DType t : kTypes)
      for (ReduceOp op : kOps) {
        g_where = fmt::format("{} all_reduce {} {} n={}", where, dtype_name(t), op == ReduceOp::SUM ? "sum" : "max", n);
        Buf b(be, t, n);
        for (int64_t i = 0; i < n; ++i) b.set(i, val(g_rank, i, 1));
        b.upload();
        c.all_reduce(b.dev, n, t, op);
        want.all_reduce(n * static_cast<int64_t>(dtype_size(t)));
        b.download();
        int64_t bad = 0;
        for (int64_t i = 0; i < n; ++i) bad += b.get(i) != reduce_members(m, op, i, 1);
        expect(bad == 0, fmt::format("{} wrong elements", bad));
      }

  if (p >= 2) {  // bf16 sum rounds the fp32 sum to nearest even (group rank 1 adds a fraction of a step)
    g_where = where + " all_reduce bf16 rounding";
    const double frac[3] = {3.0 / 256, 1.0 / 256, 5.0 / 512}, rounded[3] = {1.015625, 1.0, 1.0078125};
    Buf b(be, DType::BF16, 3);
    for (int i = 0; i < 3; ++i) b.set(i, r == 0 ? 1.0 : (r == 1 ? frac[i] : 0.0));
    b.upload();
    c.all_reduce(b.dev, 3, DType::BF16, ReduceOp::SUM);
    want.all_reduce(6);
    b.download();
    for (int i = 0; i < 3; ++i) expect(b.get(i) == rounded[i], fmt::format("element {}: {}", i, b.get(i)));
    // fp16 the same with its step at 1 of 2^-10 (NCCL adds halves correctly rounded: the same bits).
    g_where = where + " all_reduce f16 rounding";
    const double frac16[3] = {3.0 / 2048, 1.0 / 2048, 5.0 / 4096}, rounded16[3] = {1.001953125, 1.0, 1.0009765625};
    Buf h(be, DType::F16, 3);
    for (int i = 0; i < 3; ++i) h.set(i, r == 0 ? 1.0 : (r == 1 ? frac16[i] : 0.0));
    h.upload();
    c.all_reduce(h.dev, 3, DType::F16, ReduceOp::SUM);
    want.all_reduce(6);
    h.download();
    for (int i = 0; i < 3; ++i) expect(h.get(i) == rounded16[i], fmt::format("element {}: {}", i, h.get(i)));
  }

  const int64_t blk = 5;
  for (DType t : kTypes)
    for (ReduceOp op : kOps)
      for (bool in_place : {false, true}) {
        g_where = fmt::format("{} reduce_scatter {}{}", where, dtype_name(t), in_place ? " in place" : "");
        Buf send(be, t, p * blk), out(be, t, blk, 99);
        for (int64_t j = 0; j < p * blk; ++j) send.set(j, val(g_rank, j, 2));
        send.upload();
        c.reduce_scatter(in_place ? send.at(r * blk) : out.dev, send.dev, blk, t, op);
        want.reduce_scatter(p * blk * static_cast<int64_t>(dtype_size(t)));
        Buf& res = (in_place ? send : out).download();
        const int64_t base = in_place ? r * blk : 0;
        for (int64_t i = 0; i < blk; ++i)
          expect(res.get(base + i) == reduce_members(m, op, r * blk + i, 2), fmt::format("element {}", i));
      }

  for (DType t : kTypes)
    for (bool in_place : {false, true}) {
      g_where = fmt::format("{} all_gather {}{}", where, dtype_name(t), in_place ? " in place" : "");
      Buf recv(be, t, p * blk, 99), send(be, t, blk);
      for (int64_t i = 0; i < blk; ++i) (in_place ? recv : send).set((in_place ? r * blk : 0) + i, val(g_rank, i, 3));
      recv.upload();
      send.upload();
      c.all_gather(recv.dev, in_place ? recv.at(r * blk) : send.dev, blk, t);
      want.all_gather(p * blk * static_cast<int64_t>(dtype_size(t)));
      recv.download();
      for (int q = 0; q < p; ++q)
        for (int64_t i = 0; i < blk; ++i)
          expect(recv.get(q * blk + i) == val(member(q), i, 3), fmt::format("block {} element {}", q, i));
    }

  // all_to_all_v: uneven counts (some empty), blocks in reverse order with gaps that stay untouched.
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
    Buf send(be, t, off, -1);
    for (int d = 0; d < p; ++d)
      for (int64_t k = 0; k < sc[d]; ++k) send.set(so[d] + k, code(g_rank, d, k));
    send.upload();
    int64_t roff = 0;
    for (int s = 0; s < p; ++s) {
      rc[s] = cnt(member(s), r);
      ro[s] = roff;
      roff += rc[s] + 2;
    }
    Buf recv(be, t, roff, -3);
    c.all_to_all_v(send.dev, sc, so, recv.dev, rc, ro, t);
    const int64_t e = static_cast<int64_t>(dtype_size(t));
    want.add(CommOp::ALL_TO_ALL, total * e, static_cast<double>((total - sc[r]) * e));
    recv.download();
    std::vector<double> expected(static_cast<size_t>(roff), -3.0);
    for (int s = 0; s < p; ++s)
      for (int64_t k = 0; k < rc[s]; ++k) expected[static_cast<size_t>(ro[s] + k)] = code(member(s), r, k);
    for (int64_t i = 0; i < roff; ++i)
      expect(recv.get(i) == expected[static_cast<size_t>(i)], fmt::format("element {}", i));
  }

  for (int root = 0; root < p; ++root) {
    g_where = fmt::format("{} broadcast from {}", where, root);
    const int64_t n = 1001;
    Buf b(be, DType::F32, n, -7);
    if (r == root)
      for (int64_t i = 0; i < n; ++i) b.set(i, val(g_rank, i, 4));
    b.upload();
    c.broadcast(b.dev, n, DType::F32, root);
    want.broadcast(n * 4);
    b.download();
    for (int64_t i = 0; i < n; ++i) expect(b.get(i) == val(member(root), i, 4), fmt::format("element {}", i));
  }

  // Grouped: a ring in both directions plus two messages to itself with crossed tags.
  for (int dir : {1, -1}) {
    g_where = fmt::format("{} group ring {}", where, dir);
    const int next = (r + dir + p) % p, prev = (r - dir + p) % p;
    const int64_t k = 11;
    Buf out(be, DType::BF16, k), in(be, DType::BF16, k, -1), self_a(be, DType::I32, 3), self_b(be, DType::I32, 4),
        got_a(be, DType::I32, 3, -1), got_b(be, DType::I32, 4, -1);
    for (int64_t i = 0; i < k; ++i) out.set(i, val(g_rank, i, 5));
    for (int64_t i = 0; i < 3; ++i) self_a.set(i, 10 + i);
    for (int64_t i = 0; i < 4; ++i) self_b.set(i, 20 + i);
    out.upload();
    self_a.upload();
    self_b.upload();
    c.group_start();
    WorkHandle hs = c.send_async(out.dev, k, DType::BF16, next);
    WorkHandle h1 = c.send_async(self_a.dev, 3, DType::I32, r, 7);
    WorkHandle h2 = c.send_async(self_b.dev, 4, DType::I32, r, 6);
    WorkHandle h3 = c.recv_async(got_b.dev, 4, DType::I32, r, 6);
    WorkHandle h4 = c.recv_async(got_a.dev, 3, DType::I32, r, 7);
    WorkHandle hr = c.recv_async(in.dev, k, DType::BF16, prev);
    expect(throws_error([&] { hr->wait(); }), "wait() before group_end() must throw, not hang");
    expect(!hr->test(), "test() before group_end()");
    c.group_end();
    for (WorkHandle* h : {&hs, &h1, &h2, &h3, &h4, &hr}) (*h)->wait();
    for (int64_t bytes : {k * 2, int64_t{12}, int64_t{16}}) {
      want.send(bytes);
      want.recv(bytes);
    }
    in.download();
    got_a.download();
    got_b.download();
    for (int64_t i = 0; i < k; ++i) expect(in.get(i) == val(member(prev), i, 5), fmt::format("element {}", i));
    for (int64_t i = 0; i < 3; ++i) expect(got_a.get(i) == 10 + i, "self tag 7");
    for (int64_t i = 0; i < 4; ++i) expect(got_b.get(i) == 20 + i, "self tag 6");
  }

  if (p == 2) check_p2p(c, be, want, where);
  g_where = where + " misuse";
  {
    Buf b(be, DType::F32, 4);
    expect(throws_error([&] { c.send(b.dev, 1, DType::F32, r); }), "send to itself outside a group throws");
    expect(throws_error([&] { c.send(b.dev, 1, DType::F32, 0, 5000); }), "tag beyond 1023 throws");
    c.group_start();
    expect(throws_error([&] { c.all_reduce(b.dev, 4, DType::F32); }), "collective inside a group throws");
    c.group_end();
    expect(throws_error([&] { c.broadcast(b.dev, 4, DType::F32, p); }), "broadcast from root size() throws");
  }

  // Order and completion: 8 async all_reduces; test() turns true without any wait, and once the
  // compute stream waited for the last one, a copy on the compute stream sees every result.
  {
    g_where = where + " async";
    const int64_t n = 1 << 16;
    std::vector<std::unique_ptr<Buf>> bufs;
    std::vector<WorkHandle> works;
    for (int j = 0; j < 8; ++j) {
      bufs.push_back(std::make_unique<Buf>(be, DType::F32, n));
      for (int64_t i = 0; i < n; ++i) bufs[j]->set(i, val(g_rank, i, 10 + j));
      bufs[j]->upload();
      works.push_back(c.all_reduce_async(bufs[j]->dev, n, DType::F32, ReduceOp::SUM));
      want.all_reduce(n * 4);
    }
    const auto start = std::chrono::steady_clock::now();
    while (!works.back()->test() && std::chrono::steady_clock::now() - start < std::chrono::seconds(60))
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    expect(works.back()->test(), "the last all_reduce is not complete after 60 s");
    for (WorkHandle& w : works) c.wait(*w, CommOp::ALL_REDUCE);
    Buf copy(be, DType::F32, n, -1);
    be.copy(copy.dev, bufs[3]->dev, static_cast<size_t>(n) * 4);  // on the compute stream, after the waits
    copy.download();
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += copy.get(i) != reduce_members(m, ReduceOp::SUM, i, 13);
    expect(bad == 0, fmt::format("{} wrong elements in a compute-stream copy of all_reduce 3", bad));
  }

  c.barrier();
  g_where = where + " stats";
  compare_stats(c.stats(), want);
  g_where = where;
}

}  // namespace

int main(int argc, char** argv) {
  ProcessInfo info;
  try {
    info = dist_init(&argc, &argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "test_nccl: %s\n", e.what());
    return 1;
  }
  g_rank = info.rank;
  std::vector<int> all;
  for (int q = 0; q < info.size; ++q) all.push_back(q);
  int code = 0;
  try {
    std::unique_ptr<Communicator> world = make_mpi_communicator("world", all);
    // Every rank must be able to run (a GPU of its own), else all skip together.
    int devices = 0;
    if (cudaGetDeviceCount(&devices) != cudaSuccess) devices = 0;
    int32_t runnable = devices >= info.size ? 1 : 0;
    world->all_reduce(&runnable, 1, DType::I32, ReduceOp::SUM);  // host memory: the MPI communicator
    if (runnable != info.size) {
      if (g_rank == 0)
        std::printf("test_nccl: skipped: %d rank(s) but %d CUDA device(s) on this node (NCCL needs a GPU per rank)\n",
                    info.size, devices);
      world.reset();
      dist_finalize();
      return 77;
    }
    CudaBackend be(info.local_rank % devices);
    std::vector<int> reversed(all.rbegin(), all.rend());
    std::unique_ptr<Communicator> host_reversed = make_mpi_communicator("reversed", reversed);
    {
      g_where = "world";
      std::unique_ptr<Communicator> c = make_nccl_communicator(*world, be.stream());
      check_communicator(*c, be, all);
    }
    {
      g_where = "reversed";
      std::unique_ptr<Communicator> c = make_nccl_communicator(*host_reversed, be.stream());
      check_communicator(*c, be, reversed);
    }
    int32_t failures = static_cast<int32_t>(std::min<int64_t>(g_failures, 1 << 20));
    world->all_reduce(&failures, 1, DType::I32, ReduceOp::SUM);
    if (g_rank == 0)
      std::printf("test_nccl: %d rank(s), %lld checks on rank 0, %s\n", info.size, static_cast<long long>(g_checks),
                  failures == 0 ? "no failures" : "FAILURES");
    code = failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d [%s]: unexpected exception: %s\n", g_rank, g_where.c_str(), e.what());
    dist_abort(1);
  }
  dist_finalize();
  return code;
}
