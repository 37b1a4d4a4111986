// Host memory of the CPU backend: its buffers (parameters, gradients, optimizer state, activation
// arena) and the kernels' scratch.
//
// Every block is 64-byte aligned (one cache line, one AVX-512 vector; a tile row that straddles two
// lines loads 2-4x slower). Blocks of kHugeBytes and more are also 2 MiB aligned and advised onto
// transparent huge pages (madvise MADV_HUGEPAGE), which Linux then backs with 2 MiB pages where
// its THP mode is "madvise" (a common default) or "always". 4 KiB pages cover only 8 MiB with the
// whole second-level TLB, so GEMM packing and streaming over GPT-2's buffers (hundreds of MiB)
// missed it on nearly every page: 2 MiB pages made the GPT-2 124M training step 8% faster in bf16
// and ~3% in fp32 (T = 256, batch 4, 2 threads). Where THP is off or absent the advice is
// ignored and the pages stay 4 KiB.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace tetra::cpu {

// Blocks this large or larger are 2 MiB aligned, rounded up to whole 2 MiB pages and advised onto
// huge pages (so at most a third of such a block is rounding).
inline constexpr size_t kHugePageBytes = size_t{2} << 20;
inline constexpr size_t kHugeBytes = size_t{4} << 20;

// bytes of host memory as above (a unique block even for 0 bytes); throws tetra::Error naming
// `what` when the system has none left.
void* host_alloc(size_t bytes, const char* what);
void host_free(void* ptr);

// What the process has on huge pages, for the log: the THP mode (the bracketed word of
// /sys/kernel/mm/transparent_hugepage/enabled) and AnonHugePages of /proc/self/smaps_rollup.
std::string huge_page_report();
// The same from those two files' text ("" where a file could not be read).
std::string describe_huge_pages(const std::string& thp_enabled, const std::string& smaps_rollup);

// std::vector storage from host_alloc.
template <typename T>
struct HostAllocator {
  using value_type = T;
  HostAllocator() = default;
  template <typename U>
  HostAllocator(const HostAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(host_alloc(n * sizeof(T), "kernel scratch")); }
  void deallocate(T* p, size_t) { host_free(p); }
  bool operator==(const HostAllocator&) const { return true; }
};
template <typename T>
using Buffer = std::vector<T, HostAllocator<T>>;

// v's data, grown (never shrunk) to at least n elements.
template <typename V>
typename V::value_type* grow(V& v, int64_t n) {
  if (static_cast<int64_t>(v.size()) < n) v.resize(static_cast<size_t>(n));
  return v.data();
}

}  // namespace tetra::cpu
