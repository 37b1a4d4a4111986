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

// The same file written a tensor at a time (write_safetensors is this): the header, from the
// tensors' names, types and shapes in file order, at construction; then append() each tensor's
// bytes in that order; finish() fsyncs and renames into place. Destroyed unfinished, the
// temporary file is removed and `path` left as it was.
class SafetensorsWriter {
 public:
  struct TensorEntry {
    std::string name;
    DType dtype = DType::F32;
    std::vector<int64_t> shape;
  };
  SafetensorsWriter(const std::string& path, const std::vector<TensorEntry>& tensors,
                    const std::map<std::string, std::string>& metadata = {});
  ~SafetensorsWriter();
  SafetensorsWriter(const SafetensorsWriter&) = delete;
  SafetensorsWriter& operator=(const SafetensorsWriter&) = delete;
  void append(const void* data);  // the next tensor's numel * dtype_size bytes
  void finish();

 private:
  void abandon();
  std::string path_, tmp_;
  int fd_ = -1;
  std::vector<size_t> sizes_;
  size_t next_ = 0;
};

// Reads every tensor; InputError naming the file on any malformed content.
std::vector<TensorRecord> read_safetensors(const std::string& path);

// Reads tensors one at a time, each with one positioned read: the header is parsed and checked at
// open (every entry's offsets against its shape, and the entries, sorted by offset, laid end to end
// from the start of the data section to the end of the file, as the format requires), the data
// is read on demand.
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
  // Bytes [offset, offset + bytes) of the tensor's data (within it: an InputError otherwise).
  void read_range(const Entry& e, uint64_t offset, uint64_t bytes, void* out) const;

 private:
  void check_tiling(uint64_t data_size) const;  // InputError naming the first tensor out of place

  std::string path_;
  int fd_ = -1;
  int64_t data_begin_ = 0;  // 8 + the header length
  std::map<std::string, Entry> entries_;
};

// Entry `name` of `reader` as fp32 weights into `out` (its numel values): F32 as stored, BF16 and
// F16 widened exactly. InputError naming the file and the tensor for another dtype, and for a value
// that is not finite (NaN, inf), with its index in the tensor's shape: a weight that is not a
// number would otherwise surface steps later as a "diverged" run.
void read_weights_f32(const SafetensorsReader& reader, const std::string& name, const SafetensorsReader::Entry& e,
                      float* out);
// Whether read_weights_f32 reads the type: F32, BF16, F16.
bool is_weight_dtype(DType dtype);

}  // namespace tetra
