// The guarded-memory backend (kernels/cpu/guarded_backend.h): its ops give the CPU backend's
// results bit for bit; its memory faults when the host touches it outside an op (checked in a
// forked child, which must die of SIGSEGV with a report naming the allocation, while a control
// child that touches host memory exits normally); host pointers given to ops and copies that run
// past an allocation are refused with messages that name them.
#include <catch2/catch.hpp>

#include <execinfo.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "kernels/cpu/guarded_backend.h"
#include "kernel_testing.h"
#include "kernels/common/check.h"

using namespace tetra;
using Catch::Matchers::Contains;

namespace {

std::unique_ptr<Backend> guarded() { return make_guarded_backend(make_cpu_backend(1)); }

// A backend copy of `host`.
template <typename T>
T* upload(Backend& be, const std::vector<T>& host) {
  T* p = static_cast<T*>(be.alloc(host.size() * sizeof(T)));
  be.copy_from_host(p, host.data(), host.size() * sizeof(T));
  return p;
}

template <typename T>
std::vector<T> download(Backend& be, const T* p, size_t n) {
  std::vector<T> host(n);
  be.copy_to_host(host.data(), p, n * sizeof(T));
  return host;
}

struct ChildResult {
  int signal = 0;     // the signal that ended it, 0 if it exited
  int exit_code = -1;
  std::string err;    // its stderr
};

// Runs `body` in a forked child with stderr captured.
ChildResult run_in_child(const std::function<void()>& body) {
  void* frames[2];
  backtrace(frames, 2);  // loads what the report's backtrace needs before the fork
  int fds[2];
  REQUIRE(pipe(fds) == 0);
  const pid_t pid = fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    // stderr captured; stdout (where the test framework's own fatal-signal report goes, chained
    // after the backend's) discarded.
    dup2(fds[1], STDERR_FILENO);
    const int null = open("/dev/null", O_WRONLY);
    if (null >= 0) dup2(null, STDOUT_FILENO);
    close(fds[0]);
    body();
    _exit(0);
  }
  close(fds[1]);
  ChildResult r;
  char buf[4096];
  for (ssize_t n; (n = read(fds[0], buf, sizeof(buf))) > 0;) r.err.append(buf, static_cast<size_t>(n));
  close(fds[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (WIFSIGNALED(status)) r.signal = WTERMSIG(status);
  if (WIFEXITED(status)) r.exit_code = WEXITSTATUS(status);
  return r;
}

std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("guarded backend: ops and copies give the CPU backend's results bit for bit", "[backend][guarded]") {
  auto cpu = make_cpu_backend(1);
  auto g = guarded();
  CHECK(g->name() == "cpu-guarded");
  CHECK_FALSE(g->host_memory());
  const int64_t M = 7, N = 5, K = 9;

  // gemm with bias (fp32), the ops of a norm, a cast to bf16, a cross-entropy, AdamW.
  std::vector<float> a = tetra_test::randn(M * K, 1), b = tetra_test::randn(N * K, 2), bias = tetra_test::randn(N, 3);
  std::vector<float> c_cpu(M * N, 0.5f);
  cpu->gemm(false, true, M, N, K, 1.0f, a.data(), K, b.data(), K, DType::F32, 1.0f, c_cpu.data(), N, DType::F32,
            bias.data());
  float *ga = upload(*g, a), *gb = upload(*g, b), *gbias = upload(*g, bias), *gc = upload(*g, std::vector<float>(M * N, 0.5f));
  g->gemm(false, true, M, N, K, 1.0f, ga, K, gb, K, DType::F32, 1.0f, gc, N, DType::F32, gbias);
  tetra_test::expect_bitwise_equal(download(*g, gc, M * N), c_cpu, "gemm");

  std::vector<float> w = tetra_test::randn(K, 4, 0.1f, 1.0f), out_cpu(M * K), rstd_cpu(M);
  cpu->norm_forward(NormKind::RMSNORM, out_cpu.data(), nullptr, rstd_cpu.data(), a.data(), w.data(), nullptr, M, K,
                    1e-5f, DType::F32, DType::F32);
  float *gw = upload(*g, w), *gout = static_cast<float*>(g->alloc(M * K * 4)), *grstd = static_cast<float*>(g->alloc(M * 4));
  g->norm_forward(NormKind::RMSNORM, gout, nullptr, grstd, ga, gw, nullptr, M, K, 1e-5f, DType::F32, DType::F32);
  tetra_test::expect_bitwise_equal(download(*g, gout, M * K), out_cpu, "norm out");
  tetra_test::expect_bitwise_equal(download(*g, grstd, M), rstd_cpu, "norm rstd");

  std::vector<uint16_t> bf_cpu(M * K);
  cpu->cast(bf_cpu.data(), DType::BF16, a.data(), DType::F32, M * K);
  auto* gbf = static_cast<uint16_t*>(g->alloc(M * K * 2));
  g->cast(gbf, DType::BF16, ga, DType::F32, M * K);
  tetra_test::expect_bitwise_equal(download(*g, gbf, M * K), bf_cpu, "cast");

  std::vector<int32_t> targets = {0, 3, 8, -1, 2, 5, 1};
  std::vector<float> loss_cpu(M), dlogits_cpu(M * K);
  cpu->cross_entropy(loss_cpu.data(), dlogits_cpu.data(), DType::F32, a.data(), DType::F32, targets.data(), M, K,
                     0.25f);
  int32_t* gt = upload(*g, targets);
  float *gloss = static_cast<float*>(g->alloc(M * 4)), *gdl = static_cast<float*>(g->alloc(M * K * 4));
  g->cross_entropy(gloss, gdl, DType::F32, ga, DType::F32, gt, M, K, 0.25f);
  tetra_test::expect_bitwise_equal(download(*g, gloss, M), loss_cpu, "cross_entropy losses");
  tetra_test::expect_bitwise_equal(download(*g, gdl, M * K), dlogits_cpu, "cross_entropy dlogits");

  const int64_t n = 33;
  std::vector<float> p = tetra_test::randn(n, 5), gr = tetra_test::randn(n, 6), m = tetra_test::randn(n, 7, 0.1f),
                     v = tetra_test::randn(n, 8, 0.01f, 0.05f);
  math::AdamParams hp{};
  hp.lr = 1e-2f, hp.beta1 = 0.9f, hp.beta2 = 0.95f, hp.eps = 1e-8f, hp.weight_decay = 0.1f;
  hp.bias_correction1 = 0.1f, hp.bias_correction2 = 0.05f, hp.grad_scale = 0.5f;
  float *gp = upload(*g, p), *ggr = upload(*g, gr), *gm = upload(*g, m), *gv = upload(*g, v);
  cpu->adamw(p.data(), gr.data(), m.data(), v.data(), n, hp, nullptr, DType::F32);
  g->adamw(gp, ggr, gm, gv, n, hp, nullptr, DType::F32);
  tetra_test::expect_bitwise_equal(download(*g, gp, n), p, "adamw params");
  tetra_test::expect_bitwise_equal(download(*g, gm, n), m, "adamw m");
  tetra_test::expect_bitwise_equal(download(*g, gv, n), v, "adamw v");
  tetra_test::expect_bitwise_equal(download(*g, ggr, n), gr, "adamw grads (zeroed)");

  // copy (within one allocation and across two) and memset_zero of a part.
  g->copy(gc + 1, ga, 10 * 4);
  g->memset_zero(gc + 20, 3 * 4);
  std::vector<float> want = c_cpu;
  std::copy(a.begin(), a.begin() + 10, want.begin() + 1);
  std::fill(want.begin() + 20, want.begin() + 23, 0.0f);
  tetra_test::expect_bitwise_equal(download(*g, gc, M * N), want, "copy and memset_zero");

  for (void* q : {static_cast<void*>(ga), static_cast<void*>(gb), static_cast<void*>(gbias), static_cast<void*>(gc),
                  static_cast<void*>(gw), static_cast<void*>(gout), static_cast<void*>(grstd), static_cast<void*>(gbf),
                  static_cast<void*>(gt), static_cast<void*>(gloss), static_cast<void*>(gdl), static_cast<void*>(gp),
                  static_cast<void*>(ggr), static_cast<void*>(gm), static_cast<void*>(gv)})
    g->free(q);
}

TEST_CASE("guarded backend: fresh memory reads as 0xFF bytes (NaN), not zeros", "[backend][guarded]") {
  auto g = guarded();
  auto* p = static_cast<uint32_t*>(g->alloc(4 * 1000));
  const std::vector<uint32_t> host = download(*g, p, 1000);
  size_t not_ff = 0;
  for (uint32_t x : host) not_ff += x != 0xFFFFFFFFu;
  CHECK(not_ff == 0);
  g->free(p);
}

TEST_CASE("guarded backend: the host touching its memory outside an op dies of SIGSEGV, with a report",
          "[backend][guarded]") {
  auto g = guarded();
  auto* p = static_cast<float*>(g->alloc(64));
  g->memset_zero(p, 64);  // an op opened and closed it again

  const ChildResult read = run_in_child([&] {
    volatile float x = p[3];
    (void)x;
  });
  CHECK(read.signal == SIGSEGV);
  CHECK_THAT(read.err, Contains("host access to backend memory") && Contains("byte 12 of an allocation of 64 bytes"));

  std::vector<float> host(16, 1.0f);
  const ChildResult write = run_in_child([&] {
    g->copy_from_host(p, host.data(), 64);
    p[0] = 2.0f;
  });
  CHECK(write.signal == SIGSEGV);

  // Control: the same child touching host memory, and backend memory through copy_to_host, exits.
  const ChildResult fine = run_in_child([&] {
    g->copy_to_host(host.data(), p, 64);
    volatile float x = host[3];
    (void)x;
  });
  CHECK(fine.signal == 0);
  CHECK(fine.exit_code == 0);
  g->free(p);
}

TEST_CASE("guarded backend: host pointers given to ops, and copies past an allocation, are refused",
          "[backend][guarded]") {
  auto g = guarded();
  auto* p = static_cast<float*>(g->alloc(16 * 4));
  std::vector<float> host(64, 0.0f);
  CHECK_THAT(error_of([&] { g->gemm(false, true, 4, 4, 4, 1.0f, p, 4, p, 4, DType::F32, 0.0f, host.data(), 4, DType::F32); }),
             Contains("gemm: argument C") && Contains("not backend memory"));
  CHECK_THAT(error_of([&] { g->sum(p, host.data(), 4); }), Contains("sum: argument x"));
  CHECK_THAT(error_of([&] { g->copy_to_host(p + 8, p, 16); }), Contains("copy_to_host: host_dst") &&
                                                                  Contains("is backend memory"));
  CHECK_THAT(error_of([&] { g->copy_from_host(host.data(), p, 16); }), Contains("copy_from_host: argument dst"));
  CHECK_THAT(error_of([&] { g->copy_from_host(p + 4, host.data(), 13 * 4); }),
             Contains("52 bytes at dst (byte 16 of an allocation of 64) run past its end"));
  CHECK_THAT(error_of([&] { g->copy(p, p + 1, 16 * 4); }), Contains("copy") && Contains("run past its end"));
  CHECK_THAT(error_of([&] { g->memset_zero(p, 65); }), Contains("memset_zero") && Contains("run past its end"));
  // The memory is protected again after a refused op: the host still cannot read it.
  const ChildResult after = run_in_child([&] {
    volatile float x = p[0];
    (void)x;
  });
  CHECK(after.signal == SIGSEGV);
  g->free(p);
}
