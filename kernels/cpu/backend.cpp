// The CPU backend's memory ops and its factory. Backend memory is ordinary host memory: buffers
// are 64-byte aligned (one cache line, one AVX-512 vector) so vectorised kernels and oneDNN never
// split a vector across lines, and every "device" copy is a memcpy. Ops run to completion before
// returning, so synchronize() has nothing to wait for.
//
// The constructor and destructor live in gemm.cpp: they create and destroy the oneDNN GEMM cache,
// whose type is complete only there.
#include <cstdlib>
#include <cstring>

#include "kernels/cpu/cpu_backend.h"
#include "trainer/core/check.h"

namespace tetra {

namespace {
constexpr size_t kAlignment = 64;
}  // namespace

void* CpuBackend::alloc(size_t bytes) {
  // aligned_alloc wants a size that is a multiple of the alignment; a zero-byte request still
  // returns a unique pointer that free() accepts.
  size_t rounded = (bytes + kAlignment - 1) / kAlignment * kAlignment;
  if (rounded == 0) rounded = kAlignment;
  void* ptr = std::aligned_alloc(kAlignment, rounded);
  TETRA_CHECK(ptr != nullptr, "cpu alloc of {} bytes ({} rounded) failed", bytes, rounded);
  return ptr;
}

void CpuBackend::free(void* ptr) { std::free(ptr); }

void CpuBackend::memset_zero(void* ptr, size_t bytes) {
  if (bytes > 0) std::memset(ptr, 0, bytes);
}

void CpuBackend::copy_to_host(void* host_dst, const void* src, size_t bytes) {
  if (bytes > 0) std::memcpy(host_dst, src, bytes);
}

void CpuBackend::copy_from_host(void* dst, const void* host_src, size_t bytes) {
  if (bytes > 0) std::memcpy(dst, host_src, bytes);
}

void CpuBackend::copy(void* dst, const void* src, size_t bytes) {
  if (bytes > 0 && dst != src) std::memcpy(dst, src, bytes);
}

std::unique_ptr<Backend> make_cpu_backend(int threads) {
  return std::make_unique<CpuBackend>(threads);
}

}  // namespace tetra
