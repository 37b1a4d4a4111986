#include "trainer/checkpoint/safetensors.h"

#include <fcntl.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "trainer/core/check.h"

namespace tetra {

int64_t TensorRecord::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

namespace {

DType dtype_from_name(const std::string& s, const std::string& path) {
  if (s == "F32") return DType::F32;
  if (s == "BF16") return DType::BF16;
  if (s == "I32") return DType::I32;
  throw InputError(fmt::format("{}: unsupported safetensors dtype \"{}\" (Tetra reads F32, BF16, I32)",
                               path, s));
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

void write_safetensors(const std::string& path, const std::vector<TensorRecord>& tensors,
                       const std::map<std::string, std::string>& metadata) {
  nlohmann::ordered_json header = nlohmann::ordered_json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  uint64_t offset = 0;
  for (const TensorRecord& t : tensors) {
    TETRA_CHECK(static_cast<int64_t>(t.data.size()) == t.numel() * static_cast<int64_t>(dtype_size(t.dtype)),
                "tensor {}: {} bytes for {} elements of {}", t.name, t.data.size(), t.numel(),
                dtype_name(t.dtype));
    header[t.name] = {{"dtype", std::string(dtype_name(t.dtype))},
                      {"shape", t.shape},
                      {"data_offsets", {offset, offset + t.data.size()}}};
    offset += t.data.size();
  }
  std::string text = header.dump();
  while ((text.size() + 8) % 8 != 0) text.push_back(' ');  // align the data section to 8 bytes
  uint64_t n = text.size();

  uint8_t length_le[8];  // the format's length is little-endian whatever the host
  for (int i = 0; i < 8; ++i) length_le[i] = static_cast<uint8_t>(n >> (8 * i));

  const std::string tmp = path + ".tmp";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd < 0) throw InputError(fmt::format("{}: cannot create: {}", tmp, std::strerror(errno)));
  try {
    write_all(fd, length_le, 8, tmp);
    write_all(fd, text.data(), text.size(), tmp);
    for (const TensorRecord& t : tensors) write_all(fd, t.data.data(), t.data.size(), tmp);
    if (::fsync(fd) != 0) throw Error(fmt::format("{}: fsync failed: {}", tmp, std::strerror(errno)));
  } catch (...) {
    ::close(fd);
    std::filesystem::remove(tmp);
    throw;
  }
  if (::close(fd) != 0) throw Error(fmt::format("{}: close failed: {}", tmp, std::strerror(errno)));
  std::filesystem::rename(tmp, path);
  // Make the rename itself durable: fsync the directory that holds the file.
  const std::filesystem::path parent = std::filesystem::path(path).parent_path();
  int dir = ::open(parent.empty() ? "." : parent.c_str(), O_RDONLY | O_DIRECTORY);
  if (dir >= 0) {
    ::fsync(dir);
    ::close(dir);
  }
}

std::vector<TensorRecord> read_safetensors(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw InputError(fmt::format("{}: cannot open", path));
  in.seekg(0, std::ios::end);
  const uint64_t file_size = static_cast<uint64_t>(in.tellg());
  in.seekg(0);
  uint64_t n = 0;
  if (file_size < 8 || !in.read(reinterpret_cast<char*>(&n), 8) || n > file_size - 8)
    throw InputError(fmt::format("{}: not a safetensors file (bad header length)", path));
  std::string text(n, '\0');
  if (!in.read(text.data(), static_cast<std::streamsize>(n)))
    throw InputError(fmt::format("{}: truncated safetensors header", path));
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(fmt::format("{}: malformed safetensors header: {}", path, e.what()));
  }
  if (!header.is_object())
    throw InputError(fmt::format("{}: malformed safetensors header: not a JSON object", path));
  const uint64_t data_begin = 8 + n;
  std::vector<TensorRecord> out;
  for (auto it = header.begin(); it != header.end(); ++it) {
    if (it.key() == "__metadata__") continue;
    TensorRecord t;
    t.name = it.key();
    try {
      t.dtype = dtype_from_name(it.value().at("dtype").get<std::string>(), path);
      t.shape = it.value().at("shape").get<std::vector<int64_t>>();
      for (int64_t d : t.shape)
        if (d < 0 || d > (int64_t{1} << 40))
          throw InputError(fmt::format("{}: tensor {}: invalid dimension {}", path, t.name, d));
      auto offs = it.value().at("data_offsets").get<std::vector<uint64_t>>();
      if (offs.size() != 2 || offs[1] < offs[0] || offs[1] > file_size - data_begin ||
          offs[1] - offs[0] != static_cast<uint64_t>(t.numel()) * dtype_size(t.dtype))
        throw InputError(fmt::format("{}: tensor {}: data_offsets do not match its shape or the file size",
                                     path, t.name));
      t.data.resize(offs[1] - offs[0]);
      in.seekg(static_cast<std::streamoff>(data_begin + offs[0]));
      if (!in.read(reinterpret_cast<char*>(t.data.data()), static_cast<std::streamsize>(t.data.size())))
        throw InputError(fmt::format("{}: tensor {}: file truncated", path, t.name));
    } catch (const nlohmann::json::exception& e) {
      throw InputError(fmt::format("{}: tensor {}: malformed entry: {}", path, t.name, e.what()));
    }
    out.push_back(std::move(t));
  }
  return out;
}

}  // namespace tetra
