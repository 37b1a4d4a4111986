// Where backward accumulates the parameter gradients.
//
// Backward adds (+=) each parameter's fp32 gradient at the layout's offset (ParamSpec::offset) of
// the one gradient buffer, or, with gradients sharded over data parallelism (ZeRO-2,
// grad_buffer.h), into whatever buffer a GradSink gives for that offset: a bucket's staging
// buffer, held only while the bucket's gradient is being computed and reduce-scattered.
#pragma once

#include <cstdint>
#include <vector>

namespace tetra {

class GradSink {
 public:
  virtual ~GradSink() = default;
  // The fp32 address of the gradient at layout offset `offset` for the micro-batch being
  // computed: the start of a parameter, or any element inside one (one expert's slice). The
  // gradient of a whole parameter is contiguous there.
  virtual float* at(int64_t offset) = 0;
};

// Where the model reads its weights under ZeRO-3 (weight_units.h): the compute weights are
// sharded over data parallelism and each parameter group (a unit: the embedding, a block, the
// final norm and output layer) is gathered before use. The model says which groups its next
// phase reads (require), then reads them at their layout offsets (at).
class WeightSource {
 public:
  virtual ~WeightSource() = default;
  // The next phase reads these groups (ParamLayout::groups indices): they are made resident,
  // others may be released.
  virtual void require(const std::vector<int>& groups) = 0;
  // The address of the weight at layout offset `offset`, of a required group.
  virtual const void* at(int64_t offset) = 0;
};

// Where a forward or backward reads its weights: the whole buffer of `type` at the layout's
// offsets, or a source.
struct WeightView {
  WeightView(const void* whole_buffer, WeightSource* weight_source, size_t element_size)
      : whole(static_cast<const char*>(whole_buffer)), source(weight_source), es(element_size) {}
  const char* whole;
  WeightSource* source;
  size_t es;
  // Null for an absent parameter (offset < 0); any element of a parameter (one expert's slice).
  const void* operator()(int64_t offset) const {
    if (offset < 0) return nullptr;
    return source ? source->at(offset) : whole + static_cast<size_t>(offset) * es;
  }
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
