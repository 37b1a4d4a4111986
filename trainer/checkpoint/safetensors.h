// The safetensors file format (huggingface/safetensors): an 8-byte little-endian header length N,
// N bytes of JSON {"name": {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {..}},
// then the raw little-endian tensor bytes. Tetra writes weights, gradients and checkpoint shards
// in it, so other tools (PyTorch, numpy) read them without Tetra.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "kernels/common/dtype.h"

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

// A tensor whose bytes live elsewhere (written without a copy).
struct TensorView {
  std::string name;
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // numel * dtype_size bytes
};
void write_safetensors(const std::string& path, const std::vector<TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata = {});

// Reads every tensor; InputError naming the file on any malformed content.
std::vector<TensorRecord> read_safetensors(const std::string& path);

// Reads tensors one at a time, each with one positioned read: the header is parsed and checked at
// open (every entry's offsets against its shape and the file size), the data is read on demand.
class SafetensorsReader {
 public:
  struct Entry {
    DType dtype = DType::F32;
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;  // byte offsets in the file
  };
  explicit SafetensorsReader(const std::string& path);  // InputError naming the file
  ~SafetensorsReader();
  SafetensorsReader(const SafetensorsReader&) = delete;
  SafetensorsReader& operator=(const SafetensorsReader&) = delete;

  const std::string& path() const { return path_; }
  const std::map<std::string, Entry>& entries() const { return entries_; }
  const Entry* find(const std::string& name) const;
  // Reads entry `e`'s end - begin bytes into `out`. InputError if the file is shorter.
  void read(const Entry& e, void* out) const;

 private:
  std::string path_;
  int fd_ = -1;
  std::map<std::string, Entry> entries_;
};

}  // namespace tetra
