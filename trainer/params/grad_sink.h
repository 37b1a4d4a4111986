// Where backward accumulates the parameter gradients.
//
// Backward adds (+=) each parameter's fp32 gradient at the layout's offset (ParamSpec::offset) of
// the one gradient buffer, or, with gradients sharded over data parallelism (ZeRO-2,
// grad_buffer.h), into whatever buffer a GradSink gives for that offset: a bucket's staging
// buffer, held only while the bucket's gradient is being computed and reduce-scattered.
#pragma once

#include <cstdint>

namespace tetra {

class GradSink {
 public:
  virtual ~GradSink() = default;
  // The fp32 address of the gradient at layout offset `offset` for the micro-batch being
  // computed: the start of a parameter, or any element inside one (one expert's slice). The
  // gradient of a whole parameter is contiguous there.
  virtual float* at(int64_t offset) = 0;
};

// A backward's gradient target: the whole buffer at the layout's offsets, or a sink.
struct GradTarget {
  GradTarget(float* whole_buffer = nullptr, GradSink* grad_sink = nullptr) : whole(whole_buffer), sink(grad_sink) {}
  float* whole;
  GradSink* sink;
  // Null for an absent parameter (offset < 0).
  float* operator()(int64_t offset) const {
    if (offset < 0) return nullptr;
    return sink ? sink->at(offset) : whole + offset;
  }
  bool present() const { return whole != nullptr || sink != nullptr; }
};

}  // namespace tetra
