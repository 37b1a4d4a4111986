// The MPI communicators under a real launch: `mpirun -np 4 test_comm` (and a plain singleton run).
//
// Every rank fills its buffers from its global rank, so the result each rank expects from a
// collective is a plain loop over the group's members, computed locally (comm_checks.h, shared with
// the staged and NCCL tests). Each check runs on every communicator of several rank grids, so group
// membership and member order are checked by the data too. With np 4: tp2 x dp2 with ep2; tp2 x pp2 in the default order and in "pp-dp-tp" (where
// the mp group's order, tp fastest, differs from the ranks' order); dp4 with ep2 in "dp-tp-pp";
// pp4 (middle stages alone in their embedding group). Each grid's groups are also checked in their
// backend-memory role, staged over guarded memory (staged_checks.h).
// Values are small integers, exact in fp32, bf16, fp16 and i32 whatever order MPI combines them in, so
// results are compared exactly; the one fp32 sum of inexact values has a stated tolerance.
// Stats are compared with the formulas of communicator.h, recomputed here call by call.
//
// Exits 1 with a message per failed check (after every rank has finished), or at once through
// MPI_Abort on an unexpected exception.
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <mpi.h>

#include "kernels/common/check.h"
#include "trainer/comm/bootstrap.h"
#include "trainer/comm/mpi_communicator.h"
#include "trainer/comm/process_groups.h"
#include "tests/comm/comm_checks.h"
#include "tests/comm/staged_checks.h"

using namespace tetra;

namespace {

using namespace tetra_dist_test;

Checker ck;  // this rank's checks, with the grid / group / op being checked

// ---------------------------------------------------------------------------------------------
// One communicator: every operation, every type, with the stats it must have counted.
// ---------------------------------------------------------------------------------------------
void check_communicator(Communicator& c, const std::vector<int>& grid_members) {
  const int p = c.size(), r = c.rank();
  const std::vector<int>& m = c.members();
  ExpectedStats want{CommStats{}, p};
  c.stats().reset();
  const std::string where = ck.where;

  // Membership, and that the MPI communicator holds exactly these ranks in this order.
  ck.expect(m == grid_members, fmt::format("members [{}] != grid [{}]", fmt::join(m, ","), fmt::join(grid_members, ",")));
  ck.expect(p == static_cast<int>(m.size()) && r >= 0 && r < p && m[r] == ck.rank, "rank/size/members");
  {
    Buf mine(DType::I32, 1, ck.rank), all(DType::I32, p, -1);
    c.all_gather(all.ptr(), mine.ptr(), 1, DType::I32);
    want.all_gather(p * 4);
    for (int k = 0; k < p; ++k) ck.expect(all.get(k) == m[k], fmt::format("all_gather of global ranks, slot {}", k));
  }

  const int64_t n = 37;  // odd, not a multiple of anything
  check_all_reduce(ck, c, nullptr, want, n, kAllTypes, kAllOps);
  check_half_rounding(ck, c, nullptr, want);

  if (p >= 2) {
    // fp32 sum of inexact values, against the double-precision sum of the same fp32 inputs: p - 1
    // additions, each rounding a partial sum of magnitude <= p by at most 2^-24 of it, so
    // |error| <= p^2 * 2^-24 ~ p^2 * 6e-8. And bitwise the same on every rank of the group.
    ck.where = where + " all_reduce f32 inexact";
    const int64_t k = 1000;
    Buf x(DType::F32, k);
    for (int64_t i = 0; i < k; ++i) x.set(i, std::sin(0.37 * ck.rank + 0.011 * i));
    c.all_reduce(x.ptr(), k, DType::F32, ReduceOp::SUM);
    want.all_reduce(k * 4);
    for (int64_t i = 0; i < k; ++i) {
      double ref = 0.0;
      for (int g : m) ref += static_cast<float>(std::sin(0.37 * g + 0.011 * i));
      ck.expect(std::abs(x.get(i) - ref) <= p * p * 6e-8, fmt::format("element {}: {} vs {}", i, x.get(i), ref));
    }
    Buf copies(DType::F32, k * p);
    c.all_gather(copies.ptr(), x.ptr(), k, DType::F32);
    want.all_gather(k * p * 4);
    for (int q = 0; q < p; ++q)
      ck.expect(std::memcmp(copies.host_bytes() + q * k * 4, x.host_bytes(), k * 4) == 0,
                fmt::format("the all_reduce result of group rank {} differs from this rank's", q));
    ck.where = where;
  }

  check_reduce_scatter(ck, c, nullptr, want, /*blk=*/5, kAllTypes, kAllOps, /*send_blocks_kept=*/false);
  check_all_gather(ck, c, nullptr, want, /*blk=*/5, kAllTypes);
  check_all_to_all_v(ck, c, nullptr, want, kAllTypes);
  check_broadcast(ck, c, nullptr, want, n);

  // Rings inside group_start/group_end, both directions (with p = 1: to itself).
  for (int dir : {1, -1}) {
    ck.where = fmt::format("{} ring {}", where, dir);
    const int next = (r + dir + p) % p, prev = (r - dir + p) % p;
    const int64_t k = 11;
    Buf out(DType::BF16, k), in(DType::BF16, k, -1);
    for (int64_t i = 0; i < k; ++i) out.set(i, val(ck.rank, i, 5));
    c.group_start();
    WorkHandle hs = c.send_async(out.ptr(), k, DType::BF16, next);
    WorkHandle hr = c.recv_async(in.ptr(), k, DType::BF16, prev);
    ck.expect(throws_error([&] { hr->wait(); }), "wait() before group_end() must throw, not hang");
    ck.expect(!hr->test(), "test() before group_end()");
    c.group_end();
    ck.expect(hs->test() && hr->test(), "send and recv complete after group_end()");
    hs->wait();
    hr->wait();
    want.send(k * 2);
    want.recv(k * 2);
    for (int64_t i = 0; i < k; ++i) ck.expect(in.get(i) == val(m[prev], i, 5), fmt::format("element {}", i));
  }

  // Plain blocking send/recv between pairs (2j, 2j+1): the even rank sends first.
  if (p >= 2 && !(p % 2 == 1 && r == p - 1)) {
    ck.where = where + " send/recv pairs";
    const int peer = r ^ 1;
    Buf out(DType::I32, 7), in(DType::I32, 7, -1);
    for (int64_t i = 0; i < 7; ++i) out.set(i, 1000 * ck.rank + i);
    if (r % 2 == 0) {
      c.send(out.ptr(), 7, DType::I32, peer);
      c.recv(in.ptr(), 7, DType::I32, peer);
    } else {
      c.recv(in.ptr(), 7, DType::I32, peer);
      c.send(out.ptr(), 7, DType::I32, peer);
    }
    want.send(28);
    want.recv(28);
    for (int64_t i = 0; i < 7; ++i) ck.expect(in.get(i) == 1000 * m[peer] + i, fmt::format("element {}", i));
  }
  // Pipeline-style exchange on two tags, 4 MiB each: beyond any eager limit, so a send completes
  // only when matched.
  ck.where = where;
  check_tagged_sends(ck, c, nullptr, want, /*k=*/1 << 20, /*stride=*/4099);
  if (p == 1) {
    ck.where = where + " misuse";
    Buf b(DType::F32, 1);
    ck.expect(throws_error([&] { c.send(b.ptr(), 1, DType::F32, 0); }), "send to itself outside a group throws");
  }

  // Ordered execution: 12 async all_reduces; once the last is waited for, every earlier one is done.
  {
    ck.where = where + " async order";
    std::vector<std::unique_ptr<Buf>> bufs;
    std::vector<WorkHandle> works;
    for (int j = 0; j < 12; ++j) bufs.push_back(std::make_unique<Buf>(DType::F32, n));
    for (int j = 0; j < 12; ++j) {
      for (int64_t i = 0; i < n; ++i) bufs[j]->set(i, val(ck.rank, i, 10 + j));
      works.push_back(c.all_reduce_async(bufs[j]->ptr(), n, DType::F32, ReduceOp::SUM));
      want.all_reduce(n * 4);
    }
    works.back()->wait();
    for (int j = 0; j < 12; ++j) {
      ck.expect(works[j]->test(), fmt::format("op {} done once op 11 is", j));
      works[j]->wait();
      for (int64_t i = 0; i < n; ++i) ck.expect(bufs[j]->get(i) == reduce_members(m, ReduceOp::SUM, i, 10 + j), "value");
    }
  }

  // Misuse: a collective inside a group, wrong vector lengths.
  {
    ck.where = where + " misuse";
    Buf b(DType::F32, 4);
    c.group_start();
    ck.expect(throws_error([&] { c.all_reduce(b.ptr(), 4, DType::F32); }), "collective inside a group throws");
    c.group_end();
    const std::vector<int64_t> short_counts(p + 1, 0);
    ck.expect(throws_error([&] { c.all_to_all_v(b.ptr(), short_counts, short_counts, b.ptr(), short_counts,
                                             short_counts, DType::F32); }),
           "all_to_all_v with size()+1 counts throws");
    ck.expect(throws_error([&] { c.broadcast(b.ptr(), 4, DType::F32, p); }), "broadcast from root size() throws");
  }

  c.barrier();
  ck.where = where + " stats";
  compare_stats(ck, c.stats(), want);
  ck.where = where;
}

// Asynchronous operations progress while this thread computes without calling MPI: test() alone
// (which reads a flag) must turn true. 4 MiB is far beyond the eager limit: a transfer that needed
// the caller inside MPI would never finish.
void check_progress(ProcessGroups& pg) {
  ck.where = "progress";
  const int64_t big = int64_t{1} << 20;
  Buf a(DType::F32, big), b(DType::F32, big);
  for (int64_t i = 0; i < big; ++i) {
    a.set(i, val(ck.rank, i, 6));
    b.set(i, val(ck.rank, i, 7));
  }
  WorkHandle wa = pg.world->all_reduce_async(a.ptr(), big, DType::F32, ReduceOp::SUM);
  WorkHandle wb = pg.dp->all_reduce_async(b.ptr(), big, DType::F32, ReduceOp::MAX);
  const auto start = std::chrono::steady_clock::now();
  double sink = 0.0;
  while (!(wa->test() && wb->test()) && std::chrono::steady_clock::now() - start < std::chrono::seconds(60)) {
    for (int i = 0; i < 100000; ++i) sink += std::sqrt(static_cast<double>(i));  // compute, no MPI
    std::this_thread::yield();
  }
  ck.expect(wa->test() && wb->test(), fmt::format("async all_reduce not complete after 60 s of polling (sink {})", sink));
  wb->wait();  // reverse order of issue
  wa->wait();
  const std::vector<int>& wm = pg.world->members();
  const std::vector<int>& dm = pg.dp->members();
  int64_t bad = 0;
  for (int64_t i = 0; i < big; i += 97) {
    bad += a.get(i) != reduce_members(wm, ReduceOp::SUM, i, 6);
    bad += b.get(i) != reduce_members(dm, ReduceOp::MAX, i, 7);
  }
  ck.expect(bad == 0, fmt::format("{} wrong elements", bad));
}

// A communicator destroyed while an operation is in flight (a rank unwinding an error) returns
// at once instead of waiting for peers that may never come; the operation still completes when
// they do, and its handle stays valid.
void check_destroy_in_flight(int world) {
  if (world < 2) return;
  ck.where = "destroy in flight";
  std::vector<int> all;
  for (int q = 0; q < world; ++q) all.push_back(q);
  auto c = make_mpi_communicator("late", all);
  Buf b(DType::I32, 3);
  for (int i = 0; i < 3; ++i) b.set(i, ck.rank + i);
  if (ck.rank == 0) {
    WorkHandle w = c->all_reduce_async(b.ptr(), 3, DType::I32, ReduceOp::SUM);
    c.reset();  // the others have not issued theirs yet: they wait at the barrier below
    MPI_Barrier(MPI_COMM_WORLD);
    w->wait();
  } else {
    MPI_Barrier(MPI_COMM_WORLD);
    c->all_reduce(b.ptr(), 3, DType::I32);
    c.reset();
  }
  for (int i = 0; i < 3; ++i)
    ck.expect(b.get(i) == world * (world - 1) / 2 + world * i, fmt::format("element {}: {}", i, b.get(i)));
}

// make_mpi_communicator's argument checks (collective: every rank runs them).
void check_creation_errors(int world) {
  ck.where = "creation";
  std::string msg;
  try {
    make_mpi_communicator("bad", {world});
  } catch (const Error& e) {
    msg = e.what();
  }
  ck.expect(msg.find("'bad'") != std::string::npos &&
                msg.find(fmt::format("member {} is not a rank", world)) != std::string::npos,
            "out-of-range member refused: " + msg);
  const auto refused = [](const char* name, std::vector<int> members, const std::string& why) {
    std::string text;
    try {
      make_mpi_communicator(name, std::move(members));
    } catch (const Error& e) {
      text = e.what();
    }
    ck.expect(text.find(fmt::format("'{}'", name)) != std::string::npos && text.find(why) != std::string::npos,
              fmt::format("group '{}' refused with \"{}\": got \"{}\"", name, why, text));
  };
  refused("twice", {ck.rank, ck.rank}, fmt::format("member {} is listed twice", ck.rank));
  if (world >= 2) refused("other", {(ck.rank + 1) % world}, fmt::format("this rank ({}) is not a member", ck.rank));
  if (world >= 4) {
    // Ranks 0, 1, 2 disagree on their group (rank 0 lists {0, 1}, ranks 1 and 2 list {0, 1, 2}).
    std::vector<int> members = ck.rank == 0 ? std::vector<int>{0, 1}
                               : ck.rank <= 2 ? std::vector<int>{0, 1, 2} : std::vector<int>{ck.rank};
    msg.clear();
    try {
      make_mpi_communicator("odd", members);
    } catch (const Error& e) {
      msg = e.what();
    }
    if (ck.rank <= 2)
      ck.expect(msg.find("'odd'") != std::string::npos && msg.find("do not agree") != std::string::npos,
                "inconsistent member lists refused on every rank that joined: " + msg);
    else
      ck.expect(msg.empty(), "a consistent size-1 group is accepted: " + msg);
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
  ck.rank = info.rank;
  try {
    ck.where = "bootstrap";
    int mpi_rank = -1, mpi_size = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &mpi_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &mpi_size);
    ck.expect(info.rank == mpi_rank && info.size == mpi_size, "rank and size");
    const bool under_mpirun = std::getenv("OMPI_COMM_WORLD_SIZE") != nullptr;
    ck.expect(info.launcher == (under_mpirun ? "mpirun" : "single"), "launcher " + info.launcher);
    ck.expect(info.local_rank == info.rank, "one node: local rank == rank");  // ctest runs on one host
    const char* yield = std::getenv("OMPI_MCA_mpi_yield_when_idle");
    ck.expect(yield != nullptr && (user_yield != nullptr || std::string(yield) == "1"), "yield_when_idle set");
    const ProcessInfo again = dist_init(&argc, &argv);
    ck.expect(again.rank == info.rank && again.size == info.size && again.launcher == info.launcher,
              "a second dist_init returns the same");
    if (info.rank == 0)
      std::printf("test_comm: %d process(es), launcher %s, dist_init %.3f s\n", info.size, info.launcher.c_str(),
                  init_s);

    for (const GridSizes& sizes : grids_for(info.size)) {
      const RankGrid grid = RankGrid::build(sizes);
      ck.where = fmt::format("grid {} create", sizes.order);
      ProcessGroups pg = ProcessGroups::create(grid, info.rank);
      const std::string grid_name =
          fmt::format("tp{} pp{} dp{} ep{} {}", sizes.tp, sizes.pp, sizes.dp, sizes.ep, sizes.order);
      for (int k = 0; k < kGroupKinds; ++k) {
        const GroupKind kind = static_cast<GroupKind>(k);
        ck.where = fmt::format("{} / {}", grid_name, group_kind_name(kind));
        ck.expect(pg.get(kind).name() == group_kind_name(kind), "communicator name");
        check_communicator(pg.get(kind), grid.group(kind, info.rank));
      }
      check_progress(pg);
      ck.where = grid_name + " / staged";
      check_staged_communicators(ck, pg);
    }
    check_creation_errors(info.size);
    check_destroy_in_flight(info.size);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d [%s]: unexpected exception: %s\n", ck.rank, ck.where.c_str(), e.what());
    dist_abort(1);
  }

  int64_t failures = 0;
  MPI_Allreduce(&ck.failures, &failures, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  if (ck.rank == 0)
    std::printf("test_comm: %lld checks on rank 0, %lld failures on all ranks\n", static_cast<long long>(ck.checks),
                static_cast<long long>(failures));
  dist_finalize();
  dist_finalize();  // idempotent
  return failures == 0 ? 0 : 1;
}
