// The backend's scratch area as the kernel files see it: a small device float area (allocated
// once by CudaBackend::scratch() in backend.cu) that reductions use for their per-block partial
// sums. Ops are stream-ordered, so every op may use all of it: the next op's kernels start only
// after this one's have finished reading it.
#pragma once

#include <cstddef>

namespace tetra {

struct CudaScratch {
  float* data = nullptr;
  size_t floats = 0;
};

}  // namespace tetra
