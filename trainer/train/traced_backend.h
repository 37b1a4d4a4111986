// The traced backend: another backend's ops, each recorded as a span of the calling thread's
// timeline while the profiler records (trainer/core/trace.h; outside the profiled steps an op
// costs one extra virtual call and one atomic load). GEMMs carry their shape and FLOPs.
//
// Where backend ops run asynchronously (a GPU stream), each op is followed by a synchronisation
// while recording, so that its span is the op's time and not its launch's: a profiled step runs
// serialised there (slower than the others; the log says so).
#pragma once

#include <memory>

#include "kernels/backend.h"

namespace tetra {

std::unique_ptr<Backend> make_traced_backend(std::unique_ptr<Backend> inner);

}  // namespace tetra
