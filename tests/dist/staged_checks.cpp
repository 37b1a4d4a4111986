// The backend-memory communicators (see staged_checks.h). Buffers live in guarded backend memory
// (kernels/cpu/guarded_backend.h) and are read and written by the test through copies only, so
// the staged communicator is checked to reach them through Backend copies alone: a direct access
// by it, or by MPI, would kill the rank. Values are small integers, exact in every type whatever
// the combining order, so results are compared exactly; each rank computes the expected result of
// each collective from the group's members.
#include "tests/dist/staged_checks.h"

#include <array>
#include <cmath>
#include <cstring>
#include <memory>

#include <fmt/format.h>

#include "kernels/cpu/guarded_backend.h"
#include "trainer/core/check.h"
#include "trainer/dist/staged_communicator.h"

namespace tetra_dist_test {

namespace {

using namespace tetra;

struct Checker {
  std::vector<std::string>& failures;
  int rank;
  std::string where;
  int64_t checks = 0;
  void expect(bool ok, const std::string& what) {
    ++checks;
    if (!ok) failures.push_back(fmt::format("rank {} [{}]: {}", rank, where, what));
  }
};

// Element i of global rank g's data: integers in [-5, 5]; sums over 4 ranks are exact in bf16.
double val(int g, int64_t i, int salt) { return static_cast<double>((g * 5 + i * 3 + salt) % 11) - 5.0; }

std::vector<uint8_t> encode(DType t, const std::vector<double>& v) {
  std::vector<uint8_t> out(v.size() * dtype_size(t));
  for (size_t i = 0; i < v.size(); ++i) {
    uint8_t* p = out.data() + i * dtype_size(t);
    if (t == DType::F32) {
      const float x = static_cast<float>(v[i]);
      std::memcpy(p, &x, 4);
    } else if (t == DType::BF16) {
      const uint16_t b = math::f32_to_bf16_bits(static_cast<float>(v[i]));
      std::memcpy(p, &b, 2);
    } else if (t == DType::F16) {
      const uint16_t b = math::f32_to_f16_bits(static_cast<float>(v[i]));
      std::memcpy(p, &b, 2);
    } else {
      const int32_t x = static_cast<int32_t>(v[i]);
      std::memcpy(p, &x, 4);
    }
  }
  return out;
}

std::vector<double> decode(DType t, const std::vector<uint8_t>& bytes) {
  std::vector<double> out(bytes.size() / dtype_size(t));
  for (size_t i = 0; i < out.size(); ++i) {
    const uint8_t* p = bytes.data() + i * dtype_size(t);
    if (t == DType::F32) {
      float x;
      std::memcpy(&x, p, 4);
      out[i] = x;
    } else if (t == DType::BF16 || t == DType::F16) {
      uint16_t b;
      std::memcpy(&b, p, 2);
      out[i] = t == DType::F16 ? math::f16_bits_to_f32(b) : math::bf16_bits_to_f32(b);
    } else {
      int32_t x;
      std::memcpy(&x, p, 4);
      out[i] = x;
    }
  }
  return out;
}

// n elements of type t in backend memory, set and read through copies.
struct Dev {
  Backend& be;
  DType t;
  int64_t n;
  void* p;
  Dev(Backend& b, DType type, int64_t count, double fill) : be(b), t(type), n(count), p(b.alloc(count * dtype_size(type))) {
    set(std::vector<double>(static_cast<size_t>(n), fill));
  }
  ~Dev() { be.free(p); }
  Dev(const Dev&) = delete;
  Dev& operator=(const Dev&) = delete;
  void set(const std::vector<double>& v) {
    const std::vector<uint8_t> bytes = encode(t, v);
    be.copy_from_host(p, bytes.data(), bytes.size());
  }
  std::vector<double> get() const {
    std::vector<uint8_t> bytes(static_cast<size_t>(n) * dtype_size(t));
    be.copy_to_host(bytes.data(), p, bytes.size());
    return decode(t, bytes);
  }
  void* at(int64_t i) { return static_cast<char*>(p) + i * static_cast<int64_t>(dtype_size(t)); }
};

std::vector<double> values(int g, int64_t n, int salt) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = val(g, i, salt);
  return v;
}

// Calls and payload per op, as the host communicator must count them (groups of size > 1).
struct Expected {
  int p;
  std::array<int64_t, kCommOps> calls{}, payload{};
  void add(CommOp op, int64_t bytes) {
    if (p == 1) return;
    calls[static_cast<int>(op)] += 1;
    payload[static_cast<int>(op)] += bytes;
  }
};

// Every operation of `c` (a staged communicator over `host`) on backend memory of `be`.
void check_one(Checker& ck, Communicator& c, Communicator& host, Backend& be) {
  const int p = c.size(), r = c.rank(), g = ck.rank;
  const std::vector<int>& m = c.members();
  const std::string where = ck.where;
  const CommStats host0 = host.stats(), staged0 = c.stats();
  Expected want{p};

  const int64_t n = 13;
  for (DType t : {DType::F32, DType::BF16, DType::F16, DType::I32})
    for (ReduceOp op : {ReduceOp::SUM, ReduceOp::MAX}) {
      ck.where = fmt::format("{} all_reduce {} {}", where, dtype_name(t), op == ReduceOp::SUM ? "sum" : "max");
      Dev b(be, t, n, 0);
      b.set(values(g, n, 1));
      c.all_reduce(b.p, n, t, op);
      want.add(CommOp::ALL_REDUCE, n * static_cast<int64_t>(dtype_size(t)));
      const std::vector<double> got = b.get();
      for (int64_t i = 0; i < n; ++i) {
        double e = op == ReduceOp::SUM ? 0.0 : -1e9;
        for (int q : m) e = op == ReduceOp::SUM ? e + val(q, i, 1) : std::max(e, val(q, i, 1));
        ck.expect(got[static_cast<size_t>(i)] == e, fmt::format("element {}: {} != {}", i, got[static_cast<size_t>(i)], e));
      }
    }

  const int64_t blk = 3;
  for (DType t : {DType::F32, DType::BF16, DType::F16})
    for (bool in_place : {false, true}) {
      ck.where = fmt::format("{} reduce_scatter {}{}", where, dtype_name(t), in_place ? " in place" : "");
      Dev send(be, t, p * blk, 0), out(be, t, blk, 99);
      send.set(values(g, p * blk, 2));
      c.reduce_scatter(in_place ? send.at(r * blk) : out.p, send.p, blk, t);
      want.add(CommOp::REDUCE_SCATTER, p * blk * static_cast<int64_t>(dtype_size(t)));
      const std::vector<double> got = (in_place ? send : out).get();
      for (int64_t i = 0; i < blk; ++i) {
        double e = 0.0;
        for (int q : m) e += val(q, r * blk + i, 2);
        ck.expect(got[static_cast<size_t>((in_place ? r * blk : 0) + i)] == e, fmt::format("element {}", i));
      }
      if (in_place)  // the other blocks of the send buffer keep this rank's own input
        for (int64_t j = 0; j < p * blk; ++j)
          if (j / blk != r) ck.expect(got[static_cast<size_t>(j)] == val(g, j, 2), fmt::format("untouched {}", j));
    }

  for (bool in_place : {false, true}) {
    ck.where = fmt::format("{} all_gather i32{}", where, in_place ? " in place" : "");
    Dev recv(be, DType::I32, p * blk, 99), send(be, DType::I32, blk, 0);
    if (in_place) {
      std::vector<double> v(static_cast<size_t>(p * blk), 99);
      for (int64_t i = 0; i < blk; ++i) v[static_cast<size_t>(r * blk + i)] = val(g, i, 3);
      recv.set(v);
    } else {
      send.set(values(g, blk, 3));
    }
    c.all_gather(recv.p, in_place ? recv.at(r * blk) : send.p, blk, DType::I32);
    want.add(CommOp::ALL_GATHER, p * blk * 4);
    const std::vector<double> got = recv.get();
    for (int q = 0; q < p; ++q)
      for (int64_t i = 0; i < blk; ++i)
        ck.expect(got[static_cast<size_t>(q * blk + i)] == val(m[q], i, 3), fmt::format("block {} element {}", q, i));
  }

  // all_to_all_v: sender s sends (s + 2d) % 3 elements to group rank d, its blocks in reverse
  // destination order with one-element gaps; receivers place blocks with two-element gaps, which
  // must keep their values.
  {
    ck.where = where + " all_to_all_v f32";
    const auto cnt = [](int s_global, int d) { return static_cast<int64_t>((s_global + 2 * d) % 3); };
    const auto code = [](int s_global, int d, int64_t k) { return static_cast<double>(s_global * 16 + d * 4 + k); };
    std::vector<int64_t> sc(p), so(p), rc(p), ro(p);
    int64_t off = 0, total = 0, roff = 0;
    for (int d = p - 1; d >= 0; --d) {
      sc[d] = cnt(g, d), so[d] = off, off += sc[d] + 1, total += sc[d];
    }
    for (int s = 0; s < p; ++s) rc[s] = cnt(m[s], r), ro[s] = roff, roff += rc[s] + 2;
    std::vector<double> sv(static_cast<size_t>(off), -1), expected(static_cast<size_t>(roff), -3);
    for (int d = 0; d < p; ++d)
      for (int64_t k = 0; k < sc[d]; ++k) sv[static_cast<size_t>(so[d] + k)] = code(g, d, k);
    for (int s = 0; s < p; ++s)
      for (int64_t k = 0; k < rc[s]; ++k) expected[static_cast<size_t>(ro[s] + k)] = code(m[s], r, k);
    Dev send(be, DType::F32, off, 0), recv(be, DType::F32, roff, -3);
    send.set(sv);
    c.all_to_all_v(send.p, sc, so, recv.p, rc, ro, DType::F32);
    if (p > 1) want.add(CommOp::ALL_TO_ALL, total * 4);
    ck.expect(recv.get() == expected, "received blocks, gaps untouched");
  }

  for (int root = 0; root < p; ++root) {
    ck.where = fmt::format("{} broadcast from {}", where, root);
    Dev b(be, DType::F32, n, -7);
    if (r == root) b.set(values(g, n, 4));
    c.broadcast(b.p, n, DType::F32, root);
    want.add(CommOp::BROADCAST, n * 4);
    ck.expect(b.get() == values(m[root], n, 4), "values");
  }

  // A ring inside group_start/group_end (with p = 1: to itself); the receive is copied back by
  // group_end, and waiting before it throws without losing the data.
  {
    ck.where = where + " ring";
    const int next = (r + 1) % p, prev = (r - 1 + p) % p;
    const int64_t k = 11;
    Dev out(be, DType::BF16, k, 0), in(be, DType::BF16, k, -1);
    out.set(values(g, k, 5));
    c.group_start();
    WorkHandle hs = c.send_async(out.p, k, DType::BF16, next);
    WorkHandle hr = c.recv_async(in.p, k, DType::BF16, prev);
    bool threw = false;
    try {
      hr->wait();
    } catch (const Error&) {
      threw = true;
    }
    ck.expect(threw, "wait() before group_end() throws");
    c.group_end();
    want.add(CommOp::SEND, k * 2);
    want.add(CommOp::RECV, k * 2);
    ck.expect(in.get() == values(m[prev], k, 5), "received after group_end()");
    hs->wait();
    hr->wait();
  }

  // Crossed asynchronous sends on two tags between pairs, received in the other order.
  if (p >= 2 && !(p % 2 == 1 && r == p - 1)) {
    ck.where = where + " crossed sends with tags";
    const int peer = r ^ 1;
    const int64_t k = 1 << 16;
    Dev a(be, DType::F32, k, 0), b(be, DType::F32, k, 0), got_a(be, DType::F32, k, -1), got_b(be, DType::F32, k, -1);
    a.set(values(g, k, 6));
    b.set(values(g, k, 7));
    WorkHandle sa = c.send_async(a.p, k, DType::F32, peer, 0);
    WorkHandle sb = c.send_async(b.p, k, DType::F32, peer, 1);
    WorkHandle rb = c.recv_async(got_b.p, k, DType::F32, peer, 1);
    WorkHandle ra = c.recv_async(got_a.p, k, DType::F32, peer, 0);
    c.wait(*rb, CommOp::RECV);
    c.wait(*ra, CommOp::RECV);
    c.wait(*sa, CommOp::SEND);
    c.wait(*sb, CommOp::SEND);
    for (int j = 0; j < 2; ++j) {
      want.add(CommOp::SEND, k * 4);
      want.add(CommOp::RECV, k * 4);
    }
    ck.expect(got_a.get() == values(m[peer], k, 6) && got_b.get() == values(m[peer], k, 7), "tagged streams");
  }

  // Asynchronous all_reduces in flight together, waited for in reverse order of issue.
  {
    ck.where = where + " async";
    std::vector<std::unique_ptr<Dev>> bufs;
    std::vector<WorkHandle> works;
    for (int j = 0; j < 4; ++j) {
      bufs.push_back(std::make_unique<Dev>(be, DType::F32, n, 0));
      bufs.back()->set(values(g, n, 10 + j));
      works.push_back(c.all_reduce_async(bufs.back()->p, n, DType::F32, ReduceOp::SUM));
      want.add(CommOp::ALL_REDUCE, n * 4);
    }
    for (int j = 3; j >= 0; --j) c.wait(*works[static_cast<size_t>(j)], CommOp::ALL_REDUCE);
    for (int j = 0; j < 4; ++j) {
      std::vector<double> e(static_cast<size_t>(n), 0.0);
      for (int q : m) {
        const std::vector<double> v = values(q, n, 10 + j);
        for (int64_t i = 0; i < n; ++i) e[static_cast<size_t>(i)] += v[static_cast<size_t>(i)];
      }
      ck.expect(bufs[static_cast<size_t>(j)]->get() == e, fmt::format("operation {}", j));
    }
  }

  // Misuse is refused as by the host communicator.
  {
    ck.where = where + " misuse";
    Dev b(be, DType::F32, 8 * p, 0);
    const std::vector<int64_t> wrong(static_cast<size_t>(p + 1), 0);
    bool threw = false;
    try {
      c.all_to_all_v(b.p, wrong, wrong, b.p, wrong, wrong, DType::F32);
    } catch (const Error&) {
      threw = true;
    }
    ck.expect(threw, "all_to_all_v with size()+1 counts throws");
    if (p > 1) {
      threw = false;
      try {
        c.reduce_scatter(b.at(2 * r + 1), b.p, 2, DType::F32);  // overlaps the send buffer off its block
      } catch (const Error&) {
        threw = true;
      }
      ck.expect(threw, "reduce_scatter into the send buffer off this rank's block throws");
    }
  }
  c.barrier();

  // Accounting: the host communicator counted each call once; the staged one only waits.
  ck.where = where + " stats";
  for (int i = 0; i < kCommOps; ++i) {
    const char* op = comm_op_name(static_cast<CommOp>(i));
    ck.expect(host.stats().calls[i] - host0.calls[i] == want.calls[i],
              fmt::format("{} calls {} != {}", op, host.stats().calls[i] - host0.calls[i], want.calls[i]));
    ck.expect(host.stats().payload_bytes[i] - host0.payload_bytes[i] == want.payload[i],
              fmt::format("{} payload {} != {}", op, host.stats().payload_bytes[i] - host0.payload_bytes[i],
                          want.payload[i]));
    ck.expect(c.stats().calls[i] == staged0.calls[i] && c.stats().payload_bytes[i] == staged0.payload_bytes[i],
              fmt::format("the staged communicator counted {} itself", op));
  }
  ck.where = where;
}

}  // namespace

int64_t check_staged_communicators(ProcessGroups& pg, int world_rank, std::vector<std::string>& failures) {
  Checker ck{failures, world_rank, "staged"};
  // Default: backend memory is host memory, one communicator serves both roles.
  pg.use_backend_memory({});
  for (int k = 0; k < kGroupKinds; ++k) {
    const GroupKind kind = static_cast<GroupKind>(k);
    ck.where = fmt::format("default role / {}", group_kind_name(kind));
    ck.expect(&pg.backend(kind) == &pg.get(kind), "the host communicator serves backend memory");
  }

  std::unique_ptr<Backend> be = make_guarded_backend(make_cpu_backend(1));
  int made = 0;
  pg.use_backend_memory([&](const std::string& name, const std::vector<int>& members, Communicator& host) {
    ++made;
    ck.where = "factory / " + name;
    ck.expect(name == host.name() && members == host.members(), "called with the group's name and members");
    return make_staged_communicator(host, *be);
  });
  ck.where = "factory";
  ck.expect(made == kGroupKinds, fmt::format("called once per group kind ({} times)", made));
  for (int k = 0; k < kGroupKinds; ++k) {
    const GroupKind kind = static_cast<GroupKind>(k);
    Communicator& host = pg.get(kind);
    Communicator& staged = pg.backend(kind);
    ck.where = fmt::format("staged {}", group_kind_name(kind));
    ck.expect(&staged != &host && staged.name() == host.name() && staged.rank() == host.rank() &&
                  staged.size() == host.size() && staged.members() == host.members(),
              "a distinct communicator over the same group");
    check_one(ck, staged, host, *be);
    // The group's stats are the sum of both roles'; set_stats restores a snapshot of the sum.
    const CommStats sum = pg.stats(kind);
    const double blocked = host.stats().total_blocked_s() + staged.stats().total_blocked_s();
    bool equal = std::abs(sum.total_blocked_s() - blocked) <= 1e-12 * (1.0 + blocked);
    for (int i = 0; i < kCommOps; ++i)
      equal = equal && sum.calls[i] == host.stats().calls[i] + staged.stats().calls[i] &&
              sum.payload_bytes[i] == host.stats().payload_bytes[i] + staged.stats().payload_bytes[i];
    ck.expect(equal, "ProcessGroups::stats is the sum of the host and backend communicators' stats");
    CommStats snapshot{};
    snapshot.calls[0] = 5;
    pg.set_stats(kind, snapshot);
    ck.expect(pg.stats(kind).calls[0] == 5 && pg.stats(kind).calls[1] == 0, "set_stats");
  }
  pg.use_backend_memory({});  // before the backend goes
  return ck.checks;
}

}  // namespace tetra_dist_test
