#include "trainer/train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <system_error>

#include <fmt/format.h>

#include "kernels/common/check.h"

namespace tetra {

namespace {

const std::array<uint32_t, 256>& crc_table() {
  static const std::array<uint32_t, 256> table = [] {
    std::array<uint32_t, 256> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
      t[i] = c;
    }
    return t;
  }();
  return table;
}

uint32_t masked_crc(const void* data, size_t n) {
  const uint32_t c = crc32c(data, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// Protocol-buffer wire format: a field's key is (number << 3) | wire type.
void varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void key(std::string& out, int field, int wire_type) { varint(out, static_cast<uint64_t>(field << 3 | wire_type)); }
template <typename T>
void fixed(std::string& out, T v) {  // little-endian, as x86 and aarch64 store it
  char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  out.append(b, sizeof(T));
}
void bytes_field(std::string& out, int field, const std::string& bytes) {
  key(out, field, 2);
  varint(out, bytes.size());
  out += bytes;
}

double now_s() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

uint32_t crc32c(const void* data, size_t n, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  const std::array<uint32_t, 256>& t = crc_table();
  crc = ~crc;
  for (size_t i = 0; i < n; ++i) crc = t[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

TensorBoardWriter::TensorBoardWriter(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  char host[256] = "localhost";
  gethostname(host, sizeof(host) - 1);
  path_ = fmt::format("{}/events.out.tfevents.{}.{}.{}", dir, static_cast<int64_t>(now_s()), host, getpid());
  if (const int err = out_.open(path_); err != 0)
    throw InputError(fmt::format("logging.dir: cannot create the TensorBoard file {}: {}; choose a writable directory "
                                 "or set logging.tensorboard to false", path_, ec ? ec.message() : std::strerror(err)));
  std::string event;
  key(event, 1, 1);
  fixed(event, now_s());
  bytes_field(event, 3, "brain.Event:2");
  record(event);
}

void TensorBoardWriter::scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values) {
  std::string summary;
  for (const auto& [tag, v] : values) {
    std::string value;
    bytes_field(value, 1, tag);
    key(value, 2, 5);
    fixed(value, static_cast<float>(v));
    bytes_field(summary, 1, value);
  }
  std::string event;
  key(event, 1, 1);
  fixed(event, now_s());
  key(event, 2, 0);
  varint(event, static_cast<uint64_t>(step));
  bytes_field(event, 5, summary);
  record(event);
}

void TensorBoardWriter::record(const std::string& event) {
  const uint64_t length = event.size();
  std::string header;
  fixed(header, length);
  fixed(header, masked_crc(header.data(), header.size()));
  std::string footer;
  fixed(footer, masked_crc(event.data(), event.size()));
  out_.append(header + event + footer);
}

}  // namespace tetra
