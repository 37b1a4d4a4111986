// The safetensors file format (huggingface/safetensors): an 8-byte little-endian header length N,
// N bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the raw little-endian tensor bytes. Tetra writes weights, gradients and checkpoint shards
// in it, so other tools (PyTorch, numpy) read them without Tetra.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "trainer/core/dtype.h"

namespace tetra {

struct TensorRecord {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> data;  // numel * dtype_size bytes
  int64_t numel() const;
};

// Writes atomically: to `path.tmp`, fsync, then rename over `path`.
void write_safetensors(const std::string& path, const std::vector<TensorRecord>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Reads every tensor; InputError naming the file on any malformed content.
std::vector<TensorRecord> read_safetensors(const std::string& path);

}  // namespace tetra
