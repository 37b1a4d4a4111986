// TensorBoard event files, written natively (no TensorFlow or PyTorch): `tensorboard --logdir
// <logging.dir>` shows a run's scalars.
//
// A file is a sequence of TFRecords, each
//   uint64 length | uint32 masked_crc32c(length) | data[length] | uint32 masked_crc32c(data)
// (little-endian; masked(c) = ((c >> 15) | (c << 17)) + 0xa282ead8, CRC-32C the Castagnoli CRC),
// whose data is one `Event` protocol-buffer message, encoded here by hand from TensorFlow's
// event.proto and summary.proto:
//   Event   { double wall_time = 1; int64 step = 2; string file_version = 3; Summary summary = 5; }
//   Summary { repeated Value value = 1; }
//   Value   { string tag = 1; float simple_value = 2; }
// The first event carries file_version "brain.Event:2"; each later one a step's scalars.
// A failed write is a warning naming the file, once, and the file is not written again in the run
// (files.h's AppendFile): TensorBoard reads the records before a cut one.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "trainer/core/files.h"

namespace tetra {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78) of `n` bytes, continuing from `crc`.
uint32_t crc32c(const void* data, size_t n, uint32_t crc = 0);

class TensorBoardWriter {
 public:
  // Creates `dir` and in it events.out.tfevents.<seconds>.<host>.<pid>; InputError naming the file
  // if it cannot.
  explicit TensorBoardWriter(const std::string& dir);
  // One event holding every (tag, value) of a step.
  void scalars(int64_t step, const std::vector<std::pair<std::string, double>>& values);
  const std::string& path() const { return path_; }
  bool failed() const { return out_.failed(); }

 private:
  void record(const std::string& event);
  std::string path_;
  AppendFile out_;
};

}  // namespace tetra
