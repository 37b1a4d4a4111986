// The bytes a backend's alloc() holds: each live allocation's size, their sum and its high-water
// mark. Backends note every alloc and free here (neither is in the step loop, so the lock costs
// nothing); the trainer's memory plan is checked against the peak (tests/parity/test_memory_plan.py).
#pragma once

#include <cstddef>
#include <mutex>
#include <unordered_map>

namespace tetra {

struct MemoryStats {
  size_t live = 0;  // bytes of the allocations not freed yet (as asked for, before any rounding)
  size_t peak = 0;  // the most `live` has been since the backend was made
  bool tracked = false;  // false: the backend does not count (both figures are 0)
};

class AllocationTally {
 public:
  void on_alloc(const void* ptr, size_t bytes) {
    std::lock_guard<std::mutex> lock(mutex_);
    sizes_[ptr] = bytes;
    live_ += bytes;
    if (live_ > peak_) peak_ = live_;
  }
  void on_free(const void* ptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = sizes_.find(ptr);
    if (it == sizes_.end()) return;
    live_ -= it->second;
    sizes_.erase(it);
  }
  MemoryStats stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return {live_, peak_, true};
  }

 private:
  mutable std::mutex mutex_;
  std::unordered_map<const void*, size_t> sizes_;
  size_t live_ = 0, peak_ = 0;
};

}  // namespace tetra
