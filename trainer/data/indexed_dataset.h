// Megatron-LM's indexed dataset format ("MMapIndexedDataset") and a writer for it. The .idx is
// read through a read-only memory map; the .bin with pread (a .bin cut short under a running job
// is then an InputError naming it, not a SIGBUS: see BinFile in indexed_dataset.cpp). Datasets tokenised for Megatron (tools/preprocess_data.py) load unchanged,
// and tools/indexed_dataset.py writes and reads the same files from numpy.
//
// A dataset is two files sharing a prefix:
//   PREFIX.bin  the tokens of every sequence, back to back, in one element type (little-endian)
//   PREFIX.idx  the index, all little-endian:
//     offset 0   magic        9 bytes  "MMIDIDX\0\0"
//     offset 9   version      u64      1
//     offset 17  dtype code   u8       1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64,
//                                      7 float32, 8 uint16
//     offset 18  seq_count    u64      S
//     offset 26  doc_count    u64      D (= documents + 1: document_indices starts with 0)
//     offset 34  sequence lengths   int32[S]  tokens per sequence
//                sequence pointers  int64[S]  byte offset of each sequence in .bin
//                document indices   int64[D]  sequence index where each document ends
//     (multimodal datasets append int8[S] sequence modes; they are ignored here.)
//
// Validation at open makes the pointers redundant: pointer i must equal the byte size of
// sequences [0, i), so the .bin is exactly the concatenation of all sequences and global token t
// sits at byte t * dtype_size. read() therefore spans sequence boundaries with one linear copy.
//
// Every problem with the files is an InputError naming the file and what would fix it. Both must
// be regular files: a named pipe, a directory or a device is refused at open without reading it
// (open never blocks on a FIFO).
#pragma once

#include <cstdint>
#include <cstdio>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace tetra {

// Megatron's numeric codes for the element type of the .bin.
enum class IndexedDType : uint8_t {
  U8 = 1,
  I8 = 2,
  I16 = 3,
  I32 = 4,
  I64 = 5,
  F64 = 6,
  F32 = 7,
  U16 = 8
};

size_t indexed_dtype_size(IndexedDType t);
std::string_view indexed_dtype_name(IndexedDType t);  // numpy's names: "uint16", "int32", ...
// The smallest token type for ids in [0, vocab_size): U16 when vocab_size <= 65536, else I32.
IndexedDType token_dtype_for_vocab(int64_t vocab_size);

class IndexedDataset {
 public:
  // `prefix` without extension: opens prefix.bin and prefix.idx and validates them.
  static IndexedDataset open(const std::string& prefix);

  IndexedDataset(IndexedDataset&&) noexcept;
  IndexedDataset& operator=(IndexedDataset&&) noexcept;
  ~IndexedDataset();

  const std::string& prefix() const { return prefix_; }
  std::string bin_path() const { return prefix_ + ".bin"; }
  std::string idx_path() const { return prefix_ + ".idx"; }
  IndexedDType dtype() const { return dtype_; }
  int64_t num_sequences() const { return num_sequences_; }
  int64_t num_documents() const { return num_documents_; }
  int64_t num_tokens() const { return num_tokens_; }
  int64_t sequence_length(int64_t i) const;
  // Global token offset of sequence i's first token in the concatenation of all sequences.
  int64_t sequence_offset(int64_t i) const;

  // Tokens [start, start + count) of the concatenation of all sequences, as int32. Thread-safe.
  // InputError naming the .bin if the file has lost those bytes since open (cut short).
  void read(int64_t start, int64_t count, int32_t* out) const;  // out: (count,)

  // Largest / smallest token id in the whole .bin. The first call scans the file (parallel),
  // later calls are free. Not safe to call for the first time from two threads at once.
  int64_t max_token() const;
  int64_t min_token() const;

 private:
  class Mapping;  // a read-only mmap of one file, unmapped on destruction
  class BinFile;  // the open .bin, read with pread
  IndexedDataset() = default;
  void scan_token_range() const;
  template <typename T> void scan_range_as(int64_t& lo, int64_t& hi) const;

  std::string prefix_;
  std::unique_ptr<Mapping> idx_map_;
  std::unique_ptr<BinFile> bin_;
  IndexedDType dtype_ = IndexedDType::I32;
  int64_t num_sequences_ = 0;
  int64_t num_documents_ = 0;
  int64_t num_tokens_ = 0;
  const uint8_t* lengths_ = nullptr;   // int32 (S,) inside the .idx mapping, unaligned
  const uint8_t* pointers_ = nullptr;  // int64 (S,) inside the .idx mapping, unaligned
  mutable bool range_known_ = false;
  mutable int64_t min_token_ = 0;
  mutable int64_t max_token_ = 0;
};

// Writes a dataset one document (= one sequence) at a time. Tokens go to PREFIX.bin.tmp as they
// arrive; finish() writes PREFIX.idx.tmp, fsyncs both, removes any old PREFIX.idx, then renames
// .bin.tmp -> .bin and .idx.tmp -> .idx. At no moment does a half-written dataset pass as
// complete: until the last rename there is either the old pair or no .idx at all. A writer
// destroyed without finish() removes its temporary files.
class IndexedDatasetWriter {
 public:
  // dtype: an integer type (U8, I8, I16, U16, I32, I64). InputError if PREFIX.bin.tmp cannot be
  // created (missing directory, no permission).
  IndexedDatasetWriter(std::string prefix, IndexedDType dtype);
  ~IndexedDatasetWriter();
  IndexedDatasetWriter(const IndexedDatasetWriter&) = delete;
  IndexedDatasetWriter& operator=(const IndexedDatasetWriter&) = delete;

  // Appends one document. InputError if a token does not fit the element type.
  void add_document(std::span<const int32_t> tokens);
  void finish();

  int64_t num_documents() const { return static_cast<int64_t>(lengths_.size()); }
  int64_t num_tokens() const { return num_tokens_; }

 private:
  void write_bytes(const void* data, size_t size, const std::string& path, std::FILE* f);

  std::string prefix_;
  IndexedDType dtype_;
  std::FILE* bin_ = nullptr;
  std::string bin_tmp_, idx_tmp_;  // the temporary files this writer made (files.h's create_temp_beside)
  bool finished_ = false;
  int64_t num_tokens_ = 0;
  std::vector<int32_t> lengths_;
};

}  // namespace tetra
