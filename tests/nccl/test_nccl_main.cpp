// The NCCL communicator on GPUs: `mpirun -np 2 test_nccl` (one GPU per rank) and a plain
// singleton run (a one-rank NCCL communicator). Exits 77 (ctest: skipped) without a GPU, or with
// fewer GPUs than ranks (NCCL refuses two ranks on one device).
//
// The collectives are checked as tests/dist checks MPI, by the same code (tests/comm/comm_checks.h):
// every rank fills its buffers from its global rank, and the result it expects from each
// collective is a plain loop over the members, computed on the host. Buffers are device memory of
// the CUDA backend: uploaded with copy_from_host, read back with copy_to_host (which synchronises
// the compute stream), so every check also checks the stream order: a result is visible only
// because wait() made the compute stream wait for the operation. Values are small integers, exact
// in fp32, bf16 and i32 in any combining order, so results compare exactly.
// Checked on the world group and on the same ranks in the reverse order (group rank != global
// rank), with the stats of communicator.h recomputed call by call.
//
// Point to point: the patterns a single NCCL stream would deadlock on (both ranks send first; tags
// received in the other order; a 1F1B pipeline's sends and receives), with messages of 16 MiB, far
// beyond NCCL's buffers, so a send completes only once its receive runs.
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "kernels/cuda/cuda_backend.h"
#include "tests/comm/comm_checks.h"
#include "kernels/common/check.h"
#include "trainer/comm/bootstrap.h"
#include "trainer/comm/mpi_communicator.h"
#include "trainer/comm/nccl_communicator.h"

using namespace tetra;

namespace {

using namespace tetra_dist_test;

Checker ck;  // this rank's checks, with the group / op being checked

// Point to point between two ranks (group ranks 0 and 1), outside groups.
void check_p2p(Communicator& c, Backend& be, ExpectedStats& want, const std::string& where) {
  const int r = c.rank(), peer = 1 - r;
  const std::vector<int>& m = c.members();
  const int64_t big = int64_t{4} << 20;  // 16 MiB of fp32: beyond NCCL's buffers

  // Both ranks send first, then receive, on one tag: each direction is its own channel.
  ck.where = where + " both send first";
  {
    Buf out(&be, DType::F32, big), in(&be, DType::F32, big, -1);
    for (int64_t i = 0; i < big; i += 4099) out.set(i, val(m[r], i, 6));
    out.upload();
    WorkHandle s = c.send_async(out.ptr(), big, DType::F32, peer, 0);
    WorkHandle v = c.recv_async(in.ptr(), big, DType::F32, peer, 0);
    c.wait(*s, CommOp::SEND);
    c.wait(*v, CommOp::RECV);
    want.send(big * 4);
    want.recv(big * 4);
    in.download();
    int64_t bad = 0;
    for (int64_t i = 0; i < big; i += 4099) bad += in.get(i) != val(m[peer], i, 6);
    ck.expect(bad == 0, fmt::format("{} wrong elements", bad));
  }

  // Tags received in the other order than sent, three messages per tag (order within a tag kept).
  ck.where = where + " tags crossed";
  {
    const int64_t k = 1 << 20;
    std::vector<std::unique_ptr<Buf>> bufs;
    std::vector<WorkHandle> works;
    for (int j = 0; j < 6; ++j) bufs.push_back(std::make_unique<Buf>(&be, DType::F32, k, -1));
    if (r == 0) {
      for (int j = 0; j < 6; ++j) {  // message j: tag j % 2, sent in order 0..5
        for (int64_t i = 0; i < k; i += 1021) bufs[j]->set(i, 100 * j + i % 7);
        bufs[j]->upload();
        works.push_back(c.send_async(bufs[j]->ptr(), k, DType::F32, peer, j % 2));
        want.send(k * 4);
      }
    } else {
      for (int j : {1, 3, 5, 0, 2, 4}) {  // tag 1's messages first
        works.push_back(c.recv_async(bufs[j]->ptr(), k, DType::F32, peer, j % 2));
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
      ck.expect(bad == 0, fmt::format("{} wrong elements", bad));
    }
  }

  // A 1F1B pipeline of two stages, 4 micro-batches: stage 0 sends activations (tag 0) and
  // receives gradients (tag 1), stage 1 the reverse, each issuing in its schedule's order without
  // host waits; the gradient of micro-batch j is the activation + 1000.
  ck.where = where + " 1f1b";
  {
    const int mb = 4;
    const int64_t k = big / 4;
    std::vector<std::unique_ptr<Buf>> act, grad;
    for (int j = 0; j < mb; ++j) {
      act.push_back(std::make_unique<Buf>(&be, DType::F32, k, -1));
      grad.push_back(std::make_unique<Buf>(&be, DType::F32, k, -1));
    }
    std::vector<WorkHandle> sends;
    if (r == 0) {
      std::vector<WorkHandle> recvs;
      for (int j = 0; j < mb; ++j) {
        for (int64_t i = 0; i < k; i += 997) act[j]->set(i, j * 10 + i % 5);
        act[j]->upload();
        sends.push_back(c.send_async(act[j]->ptr(), k, DType::F32, peer, 0));
        if (j >= 1) recvs.push_back(c.recv_async(grad[j - 1]->ptr(), k, DType::F32, peer, 1));  // warm-up of 1
      }
      recvs.push_back(c.recv_async(grad[mb - 1]->ptr(), k, DType::F32, peer, 1));
      for (WorkHandle& w : recvs) c.wait(*w, CommOp::RECV);
      int64_t bad = 0;
      for (int j = 0; j < mb; ++j) {
        grad[j]->download();
        for (int64_t i = 0; i < k; i += 997) bad += grad[j]->get(i) != j * 10 + i % 5 + 1000;
      }
      ck.expect(bad == 0, fmt::format("{} wrong gradient elements", bad));
    } else {
      for (int j = 0; j < mb; ++j) {
        WorkHandle in = c.recv_async(act[j]->ptr(), k, DType::F32, peer, 0);
        c.wait(*in, CommOp::RECV);
        act[j]->download();  // the stage's "compute": on the host, the result sent back
        for (int64_t i = 0; i < k; i += 997) grad[j]->set(i, act[j]->get(i) + 1000);
        grad[j]->upload();
        sends.push_back(c.send_async(grad[j]->ptr(), k, DType::F32, peer, 1));
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
  const std::string where = ck.where;
  ExpectedStats want{CommStats{}, p};
  c.stats().reset();
  ck.expect(m == members && member(r) == ck.rank, fmt::format("members [{}]", fmt::join(m, ",")));

  for (int64_t n : {int64_t{37}, (int64_t{1} << 20) + 3}) check_all_reduce(ck, c, &be, want, n, kAllTypes, kAllOps);
  check_half_rounding(ck, c, &be, want);
  check_reduce_scatter(ck, c, &be, want, /*blk=*/5, kAllTypes, kAllOps, /*send_blocks_kept=*/false);
  check_all_gather(ck, c, &be, want, /*blk=*/5, kAllTypes);
  check_all_to_all_v(ck, c, &be, want, kAllTypes);
  check_broadcast(ck, c, &be, want, /*n=*/1001);

  // Grouped: a ring in both directions plus two messages to itself with crossed tags.
  for (int dir : {1, -1}) {
    ck.where = fmt::format("{} group ring {}", where, dir);
    const int next = (r + dir + p) % p, prev = (r - dir + p) % p;
    const int64_t k = 11;
    Buf out(&be, DType::BF16, k), in(&be, DType::BF16, k, -1), self_a(&be, DType::I32, 3), self_b(&be, DType::I32, 4),
        got_a(&be, DType::I32, 3, -1), got_b(&be, DType::I32, 4, -1);
    for (int64_t i = 0; i < k; ++i) out.set(i, val(ck.rank, i, 5));
    for (int64_t i = 0; i < 3; ++i) self_a.set(i, 10 + i);
    for (int64_t i = 0; i < 4; ++i) self_b.set(i, 20 + i);
    out.upload();
    self_a.upload();
    self_b.upload();
    c.group_start();
    WorkHandle hs = c.send_async(out.ptr(), k, DType::BF16, next);
    WorkHandle h1 = c.send_async(self_a.ptr(), 3, DType::I32, r, 7);
    WorkHandle h2 = c.send_async(self_b.ptr(), 4, DType::I32, r, 6);
    WorkHandle h3 = c.recv_async(got_b.ptr(), 4, DType::I32, r, 6);
    WorkHandle h4 = c.recv_async(got_a.ptr(), 3, DType::I32, r, 7);
    WorkHandle hr = c.recv_async(in.ptr(), k, DType::BF16, prev);
    ck.expect(throws_error([&] { hr->wait(); }), "wait() before group_end() must throw, not hang");
    ck.expect(!hr->test(), "test() before group_end()");
    c.group_end();
    for (WorkHandle* h : {&hs, &h1, &h2, &h3, &h4, &hr}) (*h)->wait();
    for (int64_t bytes : {k * 2, int64_t{12}, int64_t{16}}) {
      want.send(bytes);
      want.recv(bytes);
    }
    in.download();
    got_a.download();
    got_b.download();
    for (int64_t i = 0; i < k; ++i) ck.expect(in.get(i) == val(member(prev), i, 5), fmt::format("element {}", i));
    for (int64_t i = 0; i < 3; ++i) ck.expect(got_a.get(i) == 10 + i, "self tag 7");
    for (int64_t i = 0; i < 4; ++i) ck.expect(got_b.get(i) == 20 + i, "self tag 6");
  }

  if (p == 2) check_p2p(c, be, want, where);
  ck.where = where + " misuse";
  {
    Buf b(&be, DType::F32, 4);
    ck.expect(throws_error([&] { c.send(b.ptr(), 1, DType::F32, r); }), "send to itself outside a group throws");
    ck.expect(throws_error([&] { c.send(b.ptr(), 1, DType::F32, 0, 5000); }), "tag beyond 1023 throws");
    c.group_start();
    ck.expect(throws_error([&] { c.all_reduce(b.ptr(), 4, DType::F32); }), "collective inside a group throws");
    c.group_end();
    ck.expect(throws_error([&] { c.broadcast(b.ptr(), 4, DType::F32, p); }), "broadcast from root size() throws");
  }

  // Order and completion: 8 async all_reduces; test() turns true without any wait, and once the
  // compute stream waited for the last one, a copy on the compute stream sees every result.
  {
    ck.where = where + " async";
    const int64_t n = 1 << 16;
    std::vector<std::unique_ptr<Buf>> bufs;
    std::vector<WorkHandle> works;
    for (int j = 0; j < 8; ++j) {
      bufs.push_back(std::make_unique<Buf>(&be, DType::F32, n));
      for (int64_t i = 0; i < n; ++i) bufs[j]->set(i, val(ck.rank, i, 10 + j));
      bufs[j]->upload();
      works.push_back(c.all_reduce_async(bufs[j]->ptr(), n, DType::F32, ReduceOp::SUM));
      want.all_reduce(n * 4);
    }
    const auto start = std::chrono::steady_clock::now();
    while (!works.back()->test() && std::chrono::steady_clock::now() - start < std::chrono::seconds(60))
      std::this_thread::sleep_for(std::chrono::microseconds(100));
    ck.expect(works.back()->test(), "the last all_reduce is not complete after 60 s");
    for (WorkHandle& w : works) c.wait(*w, CommOp::ALL_REDUCE);
    Buf copy(&be, DType::F32, n, -1);
    be.copy(copy.ptr(), bufs[3]->ptr(), static_cast<size_t>(n) * 4);  // on the compute stream, after the waits
    copy.download();
    int64_t bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += copy.get(i) != reduce_members(m, ReduceOp::SUM, i, 13);
    ck.expect(bad == 0, fmt::format("{} wrong elements in a compute-stream copy of all_reduce 3", bad));
  }

  c.barrier();
  ck.where = where + " stats";
  compare_stats(ck, c.stats(), want);
  ck.where = where;
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
  ck.rank = info.rank;
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
      if (ck.rank == 0)
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
      ck.where = "world";
      std::unique_ptr<Communicator> c = make_nccl_communicator(*world, be.stream());
      check_communicator(*c, be, all);
    }
    {
      ck.where = "reversed";
      std::unique_ptr<Communicator> c = make_nccl_communicator(*host_reversed, be.stream());
      check_communicator(*c, be, reversed);
    }
    int32_t failures = static_cast<int32_t>(std::min<int64_t>(ck.failures, 1 << 20));
    world->all_reduce(&failures, 1, DType::I32, ReduceOp::SUM);
    if (ck.rank == 0)
      std::printf("test_nccl: %d rank(s), %lld checks on rank 0, %s\n", info.size, static_cast<long long>(ck.checks),
                  failures == 0 ? "no failures" : "FAILURES");
    code = failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d [%s]: unexpected exception: %s\n", ck.rank, ck.where.c_str(), e.what());
    dist_abort(1);
  }
  dist_finalize();
  return code;
}
