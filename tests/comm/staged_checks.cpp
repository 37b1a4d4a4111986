// The backend-memory communicators (see staged_checks.h). Buffers live in guarded backend memory
// (kernels/cpu/guarded_backend.h) and are read and written by the test through copies only (Buf
// over a backend, comm_checks.h), so the staged communicator is checked to reach them through
// Backend copies alone: a direct access by it, or by MPI, would kill the rank. The collectives are
// comm_checks.h's, as the MPI and NCCL tests run them; what is the staged communicator's own
// (grouped sends completed by group_end, the accounting left to the host communicator, the
// factory of ProcessGroups) is checked here.
#include "tests/comm/staged_checks.h"

#include <cmath>
#include <memory>

#include <fmt/format.h>

#include "kernels/cpu/guarded_backend.h"
#include "kernels/common/check.h"
#include "trainer/comm/staged_communicator.h"

namespace tetra_dist_test {

namespace {

using namespace tetra;

// val(g, i, salt) for i < n: global rank g's data.
std::vector<double> values(int g, int64_t n, int salt) {
  std::vector<double> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = val(g, i, salt);
  return v;
}

// Sets every element of b to val(g, ., salt) and uploads it.
Buf& fill(Buf& b, int g, int salt) {
  for (int64_t i = 0; i < b.size(); ++i) b.set(i, val(g, i, salt));
  return b.upload();
}

// Every operation of `c` (a staged communicator over `host`) on backend memory of `be`.
void check_one(Checker& ck, Communicator& c, Communicator& host, Backend& be) {
  const int p = c.size(), r = c.rank(), g = ck.rank;
  const std::vector<int>& m = c.members();
  const std::string where = ck.where;
  const CommStats host0 = host.stats(), staged0 = c.stats();
  ExpectedStats want{CommStats{}, p};

  const int64_t n = 13;
  check_all_reduce(ck, c, &be, want, n, kAllTypes, kAllOps);
  check_reduce_scatter(ck, c, &be, want, /*blk=*/3, kAllTypes, kAllOps, /*send_blocks_kept=*/true);
  check_all_gather(ck, c, &be, want, /*blk=*/3, kAllTypes);
  check_all_to_all_v(ck, c, &be, want, kAllTypes);
  check_broadcast(ck, c, &be, want, n);

  // A ring inside group_start/group_end (with p = 1: to itself); the receive is copied back by
  // group_end, and waiting before it throws without losing the data.
  {
    ck.where = where + " ring";
    const int next = (r + 1) % p, prev = (r - 1 + p) % p;
    const int64_t k = 11;
    Buf out(&be, DType::BF16, k), in(&be, DType::BF16, k, -1);
    fill(out, g, 5);
    c.group_start();
    WorkHandle hs = c.send_async(out.ptr(), k, DType::BF16, next);
    WorkHandle hr = c.recv_async(in.ptr(), k, DType::BF16, prev);
    ck.expect(throws_error([&] { hr->wait(); }), "wait() before group_end() throws");
    c.group_end();
    want.send(k * 2);
    want.recv(k * 2);
    expect_values(ck, in.download().values(), values(m[prev], k, 5), "received after group_end()");
    hs->wait();
    hr->wait();
  }

  ck.where = where;
  check_tagged_sends(ck, c, &be, want, /*k=*/1 << 16, /*stride=*/1);

  // Asynchronous all_reduces in flight together, waited for in reverse order of issue.
  {
    ck.where = where + " async";
    std::vector<std::unique_ptr<Buf>> bufs;
    std::vector<WorkHandle> works;
    for (int j = 0; j < 4; ++j) {
      bufs.push_back(std::make_unique<Buf>(&be, DType::F32, n));
      works.push_back(c.all_reduce_async(fill(*bufs.back(), g, 10 + j).ptr(), n, DType::F32, ReduceOp::SUM));
      want.all_reduce(n * 4);
    }
    for (int j = 3; j >= 0; --j) c.wait(*works[static_cast<size_t>(j)], CommOp::ALL_REDUCE);
    for (int j = 0; j < 4; ++j) {
      std::vector<double> e(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) e[static_cast<size_t>(i)] = reduce_members(m, ReduceOp::SUM, i, 10 + j);
      expect_values(ck, bufs[static_cast<size_t>(j)]->download().values(), e, fmt::format("operation {}", j));
    }
  }

  // Misuse is refused as by the host communicator.
  {
    ck.where = where + " misuse";
    Buf b(&be, DType::F32, 8 * p);
    const std::vector<int64_t> wrong(static_cast<size_t>(p + 1), 0);
    ck.expect(throws_error([&] { c.all_to_all_v(b.ptr(), wrong, wrong, b.ptr(), wrong, wrong, DType::F32); }),
              "all_to_all_v with size()+1 counts throws");
    if (p > 1)  // overlaps the send buffer off this rank's block
      ck.expect(throws_error([&] { c.reduce_scatter(b.at(2 * r + 1), b.ptr(), 2, DType::F32); }),
                "reduce_scatter into the send buffer off this rank's block throws");
  }
  c.barrier();

  // Accounting: the host communicator counted each call once; the staged one only waits.
  ck.where = where + " stats";
  CommStats counted = host.stats();
  for (int i = 0; i < kCommOps; ++i) {
    counted.calls[i] -= host0.calls[i];
    counted.payload_bytes[i] -= host0.payload_bytes[i];
    counted.sent_bytes[i] -= host0.sent_bytes[i];
    ck.expect(c.stats().calls[i] == staged0.calls[i] && c.stats().payload_bytes[i] == staged0.payload_bytes[i],
              fmt::format("the staged communicator counted {} itself", comm_op_name(static_cast<CommOp>(i))));
  }
  compare_stats(ck, counted, want);
  ck.where = where;
}

}  // namespace

void check_staged_communicators(Checker& ck, ProcessGroups& pg) {
  const std::string base = ck.where;
  // Default: backend memory is host memory, one communicator serves both roles.
  pg.use_backend_memory({});
  for (int k = 0; k < kGroupKinds; ++k) {
    const GroupKind kind = static_cast<GroupKind>(k);
    ck.where = fmt::format("{} default role / {}", base, group_kind_name(kind));
    ck.expect(&pg.backend(kind) == &pg.get(kind), "the host communicator serves backend memory");
  }

  std::unique_ptr<Backend> be = make_guarded_backend(make_cpu_backend(1));
  int made = 0;
  pg.use_backend_memory([&](const std::string& name, const std::vector<int>& members, Communicator& host) {
    ++made;
    ck.where = base + " factory / " + name;
    ck.expect(name == host.name() && members == host.members(), "called with the group's name and members");
    return make_staged_communicator(host, *be);
  });
  ck.where = base + " factory";
  ck.expect(made == kGroupKinds, fmt::format("called once per group kind ({} times)", made));
  for (int k = 0; k < kGroupKinds; ++k) {
    const GroupKind kind = static_cast<GroupKind>(k);
    Communicator& host = pg.get(kind);
    Communicator& staged = pg.backend(kind);
    ck.where = fmt::format("{} {}", base, group_kind_name(kind));
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
  ck.where = base;
}

}  // namespace tetra_dist_test
