// The CPU kernels' scratch: owned by one CpuBackend, so two backends never share a buffer and a
// backend's scratch goes when it does.
//
// Each kernel keeps its scratch in a struct of its own, declared beside the kernel (in its file's
// anonymous namespace); that type is what finds the kernel's slot here. A kernel asks, on the
// calling (host) thread and before its parallel region, for either
//   per_thread<S>()  one S per thread of the backend's OpenMP team; thread t of the region uses
//                    element omp_get_thread_num(). Regions run num_threads(n) with n at most the
//                    backend's thread count, so every thread has its element.
//   shared<S>()      one S for the whole call (buffers its threads fill together, or a table).
// A slot is made (its S default-constructed) the first time a kernel asks for it and kept until
// the backend is destroyed. Kernels only grow what is inside (cpu::grow, vector::resize), so once
// the largest shape has been seen a training step allocates nothing.
//
// Like the rest of the backend, not thread-safe: one backend is driven by one host thread.
#pragma once

#include <memory>
#include <span>
#include <typeindex>
#include <typeinfo>
#include <vector>

namespace tetra::cpu {

class CpuScratch {
 public:
  explicit CpuScratch(int threads) : threads_(threads) {}
  CpuScratch(const CpuScratch&) = delete;
  CpuScratch& operator=(const CpuScratch&) = delete;

  int threads() const { return threads_; }

  template <typename S>
  std::span<S> per_thread() {
    std::vector<S>& slots = slot<std::vector<S>>();
    if (slots.empty()) slots.resize(static_cast<size_t>(threads_));
    return std::span<S>(slots);
  }

  template <typename S>
  S& shared() {
    return slot<S>();
  }

 private:
  struct Slot {
    std::type_index type;
    std::shared_ptr<void> object;  // an S; shared_ptr<void> keeps S's destructor
  };

  // A handful of kernels ask, so a linear search finds a slot.
  template <typename S>
  S& slot() {
    for (Slot& s : slots_)
      if (s.type == std::type_index(typeid(S))) return *static_cast<S*>(s.object.get());
    slots_.push_back(Slot{std::type_index(typeid(S)), std::make_shared<S>()});
    return *static_cast<S*>(slots_.back().object.get());
  }

  int threads_;
  std::vector<Slot> slots_;
};

}  // namespace tetra::cpu
