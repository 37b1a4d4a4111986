#include "trainer/checkpoint/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "trainer/checkpoint/commit.h"
#include "trainer/core/files.h"
#include "trainer/core/json_text.h"
#include "kernels/common/check.h"
#include "kernels/common/math.h"

namespace tetra {

int64_t TensorRecord::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

DType dtype_from_name(const std::string& s, const std::string& path, const std::string& tensor) {
  if (s == "F32") return DType::F32;
  if (s == "BF16") return DType::BF16;
  if (s == "F16") return DType::F16;
  if (s == "I32") return DType::I32;
  throw InputError(fmt::format("{}: tensor {}: unsupported safetensors dtype \"{}\" (Tetra reads F32, BF16, F16, "
                               "I32)", path, tensor, s));
}

void write_all(int fd, const void* data, size_t bytes, const std::string& path) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd, p, bytes);
    if (n < 0) throw Error(fmt::format("{}: write failed: {}", path, std::strerror(errno)));
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

}  // namespace

SafetensorsWriter::SafetensorsWriter(const std::string& path, const std::vector<TensorEntry>& tensors,
                                     const std::map<std::string, std::string>& metadata)
    : path_(path) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const TensorEntry& t : tensors) {
    int64_t numel = 1;
    for (int64_t d : t.shape) numel *= d;
    sizes_.push_back(static_cast<size_t>(numel) * dtype_size(t.dtype));
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + sizes_.back()}}};
    offset += sizes_.back();
  }
  std::string text = header.dump();
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');  // align the data section to 8 bytes
  uint64_t n = text.size();

  uint8_t length_le[8];  // the format's length is little-endian whatever the host
  for (int i = 0; i < 8; ++i) length_le[i] = static_cast<uint8_t>(n >> (8 * i));

  checkpoint_io_point("create", path + ".tmp");  // fault-injection points of a checkpoint save (commit.h)
  fd_ = create_temp_beside(path, &tmp_);
  try {
    write_all(fd_, length_le, 8, tmp_);
    write_all(fd_, text.data(), text.size(), tmp_);
  } catch (...) {
    abandon();
    throw;
  }
}

SafetensorsWriter::~SafetensorsWriter() { abandon(); }

void SafetensorsWriter::abandon() {
  if (fd_ < 0) return;
  ::close(fd_);
  fd_ = -1;
  std::error_code ec;
  std::filesystem::remove(tmp_, ec);
}

void SafetensorsWriter::append(const void* data) {
  TETRA_CHECK(fd_ >= 0 && next_ < sizes_.size(), "{}: tensor {} appended to a file of {}", path_, next_ + 1,
              sizes_.size());
  try {
    write_all(fd_, data, sizes_[next_], tmp_);
  } catch (...) {
    abandon();
    throw;
  }
  ++next_;
}

void SafetensorsWriter::finish() {
  TETRA_CHECK(fd_ >= 0 && next_ == sizes_.size(), "{}: finished after {} of {} tensors", path_, next_, sizes_.size());
  try {
    checkpoint_io_point("fsync", tmp_);
    if (::fsync(fd_) != 0) throw Error(fmt::format("{}: fsync failed: {}", tmp_, std::strerror(errno)));
  } catch (...) {
    abandon();
    throw;
  }
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) {
    std::error_code ec;
    std::filesystem::remove(tmp_, ec);
    throw Error(fmt::format("{}: close failed: {}", tmp_, std::strerror(errno)));
  }
  checkpoint_io_point("rename", tmp_ + " -> " + path_);
  if (::rename(tmp_.c_str(), path_.c_str()) != 0) {
    const int err = errno;
    std::error_code ec;
    std::filesystem::remove(tmp_, ec);
    throw Error(fmt::format("cannot rename {} to {}: {}", tmp_, path_, std::strerror(err)));
  }
  // Make the rename itself durable: fsync the directory that holds the file.
  const std::filesystem::path parent = std::filesystem::path(path_).parent_path();
  checkpoint_io_point("fsync", parent.string());
  int dir = ::open(parent.empty() ? "." : parent.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

void write_safetensors(const std::string& path, const std::vector<TensorView>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<SafetensorsWriter::TensorEntry> entries;
  for (const TensorView& t : tensors) entries.push_back({t.name, t.dtype, t.shape});
  SafetensorsWriter w(path, entries, metadata);
  for (const TensorView& t : tensors) w.append(t.data);
  w.finish();
}

void write_safetensors(const std::string& path, const std::vector<TensorRecord>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  std::vector<TensorView> views;
  for (const TensorRecord& t : tensors) {
    TETRA_CHECK(static_cast<int64_t>(t.data.size()) == t.numel() * static_cast<int64_t>(dtype_size(t.dtype)),
                "tensor {}: {} bytes for {} elements of {}", t.name, t.data.size(), t.numel(),
                dtype_name(t.dtype));
    views.push_back(TensorView{t.name, t.dtype, t.shape, t.data.data()});
  }
  write_safetensors(path, views, metadata);
}

SafetensorsReader::SafetensorsReader(const std::string& path) : path_(path) {
  if (::access(path.c_str(), F_OK) != 0)
    throw InputError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  fd_ = open_regular_file(path, "safetensors file", "give a .safetensors file");  // never blocks on a pipe
  const off_t size = ::lseek(fd_, 0, SEEK_END);
  const uint64_t file_size = size < 0 ? 0 : static_cast<uint64_t>(size);
  uint64_t n = 0;
  if (file_size < 8 || ::pread(fd_, &n, 8, 0) != 8 || n > file_size - 8) {
    ::close(fd_);
    throw InputError(fmt::format("{}: not a safetensors file (bad header length)", path));
  }
  std::string text(n, '\0');
  if (::pread(fd_, text.data(), n, 8) != static_cast<ssize_t>(n)) {
    ::close(fd_);
    throw InputError(fmt::format("{}: truncated safetensors header", path));
  }
  try {
    const std::string where = path + " (header)";
    const nlohmann::json header = parse_json_text(where, text);
    if (!header.is_object()) throw InputError(fmt::format("{}: malformed safetensors header: not a JSON object", path));
    const uint64_t data_begin = 8 + n;
    data_begin_ = static_cast<int64_t>(data_begin);
    for (auto it = header.begin(); it != header.end(); ++it) {
      if (it.key() == "__metadata__") continue;
      Entry e;
      const nlohmann::json& t = it.value();
      const std::string name = it.key();
      e.dtype = dtype_from_name(json_string(where, json_member(where, t, name, "dtype"), name + ".dtype"), path, name);
      const nlohmann::json& shape = json_member(where, t, name, "shape");
      if (!shape.is_array())
        throw InputError(fmt::format("{}: {}.shape: must be an array of sizes, got {}", where, name, json_kind(shape)));
      int64_t numel = 1;
      for (size_t i = 0; i < shape.size(); ++i) {
        const int64_t d = json_integer(where, shape[i], fmt::format("{}.shape[{}]", name, i));
        if (d < 0 || d > (int64_t{1} << 40))
          throw InputError(fmt::format("{}: tensor {}: invalid dimension {}", path, name, d));
        e.shape.push_back(d);
        numel *= d;
      }
      const nlohmann::json& offsets = json_member(where, t, name, "data_offsets");
      std::vector<uint64_t> offs;
      if (offsets.is_array())
        for (size_t i = 0; i < offsets.size(); ++i) {
          const int64_t o = json_integer(where, offsets[i], fmt::format("{}.data_offsets[{}]", name, i));
          if (o < 0) throw InputError(fmt::format("{}: {}.data_offsets[{}]: negative ({})", where, name, i, o));
          offs.push_back(static_cast<uint64_t>(o));
        }
      if (offs.size() != 2 || offs[1] < offs[0] || offs[1] > file_size - data_begin ||
          offs[1] - offs[0] != static_cast<uint64_t>(numel) * dtype_size(e.dtype))
        throw InputError(fmt::format("{}: tensor {}: data_offsets do not match its shape or the file size", path,
                                     name));
      e.begin = data_begin + offs[0];
      e.end = data_begin + offs[1];
      entries_.emplace(name, std::move(e));
    }
    check_tiling(file_size - data_begin);
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

void SafetensorsReader::check_tiling(uint64_t data_size) const {
  // The format (and its reference implementation) lays the tensors end to end: sorted by offset,
  // the first starts at 0, each starts where the one before ends, the last ends at the end of the
  // file. A header length off by a few bytes, or an offset edited into another tensor's bytes,
  // passes every per-tensor check and reads every value from the wrong bytes: refused here.
  std::vector<std::pair<const std::string*, const Entry*>> order;
  for (const auto& [name, e] : entries_) order.emplace_back(&name, &e);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) {
    return a.second->begin != b.second->begin ? a.second->begin < b.second->begin : a.second->end < b.second->end;
  });
  const uint64_t data_begin = static_cast<uint64_t>(data_begin_);
  uint64_t at = 0;  // where the next tensor must start, relative to the data section
  const std::string* previous = nullptr;
  const char* why = "(the tensors must lie end to end in the data section: the header length or an offset is wrong)";
  for (const auto& [name, e] : order) {
    const uint64_t begin = e->begin - data_begin, end = e->end - data_begin;
    if (begin < at)
      throw InputError(fmt::format("{}: tensor {}: data_offsets [{}, {}] overlap tensor {}, which ends at {} {}",
                                   path_, *name, begin, end, *previous, at, why));
    if (begin > at && previous)
      throw InputError(fmt::format("{}: tensor {}: data_offsets [{}, {}] leave bytes [{}, {}) after tensor {} to "
                                   "no tensor {}", path_, *name, begin, end, at, begin, *previous, why));
    if (begin > at)
      throw InputError(fmt::format("{}: tensor {}: data_offsets [{}, {}]: the first tensor must start at 0 {}", path_,
                                   *name, begin, end, why));
    at = end;
    previous = name;
  }
  if (at != data_size)
    throw InputError(fmt::format("{}: the header's tensors cover bytes [0, {}) of a data section of {} bytes{} {}",
                                 path_, at, data_size,
                                 previous ? fmt::format(" (the last is tensor {})", *previous) : std::string(), why));
}

SafetensorsReader::~SafetensorsReader() {
  if (fd_ >= 0) ::close(fd_);
}

const SafetensorsReader::Entry* SafetensorsReader::find(const std::string& name) const {
  auto it = entries_.find(name);
  return it == entries_.end() ? nullptr : &it->second;
}

void SafetensorsReader::read(const Entry& e, void* out) const { read_range(e, 0, e.end - e.begin, out); }

void SafetensorsReader::read_range(const Entry& e, uint64_t offset, uint64_t bytes, void* out) const {
  if (offset > e.end - e.begin || bytes > e.end - e.begin - offset)
    throw InputError(fmt::format("{}: bytes [{}, {}) beyond a tensor of {}", path_, offset, offset + bytes,
                                 e.end - e.begin));
  char* p = static_cast<char*>(out);
  uint64_t at = e.begin + offset;
  const uint64_t end = at + bytes;
  while (at < end) {
    const ssize_t n = ::pread(fd_, p, end - at, static_cast<off_t>(at));
    if (n <= 0) throw InputError(fmt::format("{}: file truncated", path_));
    p += n;
    at += static_cast<uint64_t>(n);
  }
}

bool is_weight_dtype(DType dtype) { return dtype == DType::F32 || dtype == DType::BF16 || dtype == DType::F16; }

void read_weights_f32(const SafetensorsReader& reader, const std::string& name, const SafetensorsReader::Entry& e,
                      float* out) {
  if (!is_weight_dtype(e.dtype))
    throw InputError(fmt::format("{}: tensor {} is {}: weights must be F32, BF16 or F16", reader.path(), name,
                                 dtype_name(e.dtype)));
  int64_t n = 1;
  for (int64_t d : e.shape) n *= d;
  if (e.dtype == DType::F32) {
    reader.read(e, out);
  } else {
    std::vector<uint16_t> raw(static_cast<size_t>(n));
    reader.read(e, raw.data());
    for (size_t i = 0; i < raw.size(); ++i)
      out[i] = e.dtype == DType::BF16 ? math::bf16_bits_to_f32(raw[i]) : math::f16_bits_to_f32(raw[i]);
  }
  for (int64_t i = 0; i < n; ++i) {
    if (std::isfinite(out[i])) continue;
    std::vector<int64_t> index(e.shape.size());  // i as an index into the shape, row-major
    int64_t rest = i;
    for (size_t d = e.shape.size(); d-- > 0;) {
      index[d] = rest % e.shape[d];
      rest /= e.shape[d];
    }
    throw InputError(fmt::format("{}: tensor {} holds {} at [{}] (element {} of {}): weights must be finite numbers "
                                 "(the file is damaged, or the model had diverged when it was saved)",
                                 reader.path(), name, std::isnan(out[i]) ? "NaN" : out[i] > 0 ? "inf" : "-inf",
                                 fmt::join(index, ", "), i, n));
  }
}

std::vector<TensorRecord> read_safetensors(const std::string& path) {
  const SafetensorsReader reader(path);
  // In file order, as the header lists them (std::map orders by name: sort by offset).
  std::vector<std::pair<std::string, const SafetensorsReader::Entry*>> order;
  for (const auto& [name, e] : reader.entries()) order.emplace_back(name, &e);
  std::sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return a.second->begin < b.second->begin; });
  std::vector<TensorRecord> out;
  for (const auto& [name, e] : order) {
    TensorRecord t;
    t.name = name;
    t.dtype = e->dtype;
    t.shape = e->shape;
    t.data.resize(e->end - e->begin);
    reader.read(*e, t.data.data());
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace tetra
