// The CPU backend's memory ops and its factory. Backend memory is host memory (host_memory.h:
// 64-byte aligned, large blocks on huge pages), and every "device" copy is a memcpy. Ops run to
// completion before returning, so synchronize() has nothing to wait for.
//
// The constructor and destructor live in gemm.cpp: they create and destroy the oneDNN GEMM cache,
// whose type is complete only there.
#include <algorithm>
#include <cstring>

#include "kernels/cpu/cpu_backend.h"
#include "kernels/cpu/dispatch.h"
#include "kernels/cpu/host_memory.h"
#include "kernels/common/check.h"
#include "kernels/common/math.h"

namespace tetra {

void* CpuBackend::alloc(size_t bytes) {
  void* ptr = cpu::host_alloc(bytes, "a backend buffer");
  tally_.on_alloc(ptr, bytes);
  return ptr;
}

void CpuBackend::free(void* ptr) {
  tally_.on_free(ptr);
  cpu::host_free(ptr);
}

std::string CpuBackend::memory_report() const { return cpu::huge_page_report(); }

namespace {

// Large fills and copies are split over the team: one core does not saturate memory bandwidth
// (zeroing GPT-2's 0.5 GB gradient buffer: 55 ms on one thread, about half on two).
constexpr size_t kParallelBytes = size_t{1} << 20;
constexpr size_t kLine = 64;

template <typename F>
void for_each_chunk(size_t bytes, int threads, F&& f) {
  if (bytes < kParallelBytes) {
    f(size_t{0}, bytes);
    return;
  }
  const int nt = cpu::team_size(threads);
  const size_t share = math::ceil_div(bytes, nt);  // nt chunks always cover every byte
  const size_t chunk = math::round_up(share, kLine);  // chunks start on cache lines
#pragma omp parallel for num_threads(nt) schedule(static)
  for (int i = 0; i < nt; ++i) {
    const size_t begin = std::min(bytes, static_cast<size_t>(i) * chunk);
    const size_t end = std::min(bytes, begin + chunk);
    if (end > begin) f(begin, end - begin);
  }
}

}  // namespace

void CpuBackend::memset_zero(void* ptr, size_t bytes) {
  char* p = static_cast<char*>(ptr);
  for_each_chunk(bytes, threads_, [&](size_t begin, size_t n) { std::memset(p + begin, 0, n); });
}

void CpuBackend::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(host_dst, src, bytes);
}

void CpuBackend::copy_from_host(void* dst, const void* host_src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, host_src, bytes);
}

void CpuBackend::copy(void* dst, const void* src, size_t bytes) {
  if (dst == src) return;
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  for_each_chunk(bytes, threads_, [&](size_t begin, size_t n) { std::memcpy(d + begin, s + begin, n); });
}

std::unique_ptr<Backend> make_cpu_backend(int threads) {
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace tetra
