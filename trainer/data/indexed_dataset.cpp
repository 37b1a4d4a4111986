// Megatron indexed dataset: validation at open, reads, the token-range scan, and the writer.
// The format is described in indexed_dataset.h.
#include "trainer/data/indexed_dataset.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <limits>

#include "kernels/common/check.h"
#include "trainer/core/files.h"

namespace tetra {

namespace {

constexpr char kIndexMagic[9] = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
constexpr uint64_t kIndexVersion = 1;
constexpr int64_t kHeaderBytes = 9 + 8 + 1 + 8 + 8;  // magic, version, dtype, seq/doc counts

// What the user can do about a file that is not what we expect.
constexpr const char* kRegenerateHint =
    "write the dataset again with tools/indexed_dataset.py or Megatron-LM's "
    "tools/preprocess_data.py (both write PREFIX.bin and PREFIX.idx together)";

// Loads of little-endian fields at any alignment (the .idx arrays start at byte 34).
template <typename T> T load(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

bool file_exists(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0;
}

bool ends_with(const std::string& s, std::string_view suffix) {
  return s.size() >= suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

// " (did you mean 'x'?)" when the user passed "x.bin" or "x.idx" instead of the prefix "x".
std::string prefix_hint(const std::string& prefix) {
  for (std::string_view ext : {".bin", ".idx"}) {
    if (ends_with(prefix, ext)) {
      std::string stripped = prefix.substr(0, prefix.size() - ext.size());
      return fmt::format(" (data paths are prefixes without extension: did you mean '{}'?)",
                         stripped);
    }
  }
  return "";
}

bool is_integer_dtype(IndexedDType t) { return t != IndexedDType::F32 && t != IndexedDType::F64; }

}  // namespace

size_t indexed_dtype_size(IndexedDType t) {
  switch (t) {
    case IndexedDType::U8: return 1;
    case IndexedDType::I8: return 1;
    case IndexedDType::I16: return 2;
    case IndexedDType::I32: return 4;
    case IndexedDType::I64: return 8;
    case IndexedDType::F64: return 8;
    case IndexedDType::F32: return 4;
    case IndexedDType::U16: return 2;
  }
  return 0;
}

std::string_view indexed_dtype_name(IndexedDType t) {
  switch (t) {
    case IndexedDType::U8: return "uint8";
    case IndexedDType::I8: return "int8";
    case IndexedDType::I16: return "int16";
    case IndexedDType::I32: return "int32";
    case IndexedDType::I64: return "int64";
    case IndexedDType::F64: return "float64";
    case IndexedDType::F32: return "float32";
    case IndexedDType::U16: return "uint16";
  }
  return "?";
}

IndexedDType token_dtype_for_vocab(int64_t vocab_size) {
  return vocab_size <= 65536 ? IndexedDType::U16 : IndexedDType::I32;
}

// What to give instead of a directory, a named pipe or a device.
constexpr const char* kRegularFileHint =
    "a dataset is two regular files, PREFIX.idx and PREFIX.bin: give the prefix of such a pair "
    "(a named pipe or a directory cannot be a dataset)";

// ---------------------------------------------------------------------------------------------
// Read-only mapping of a whole regular file. A zero-byte file maps to nothing (mmap refuses
// length 0). Used for the .idx only, which is read in full at open (validation) and afterwards
// only by sequence_length / sequence_offset (when samples are set up, not while training reads).
// ---------------------------------------------------------------------------------------------
class IndexedDataset::Mapping {
 public:
  Mapping(const std::string& path, const char* role) {
    const int fd = open_regular_file(path, role, kRegularFileHint);
    struct stat st;
    if (::fstat(fd, &st) != 0) {
      int err = errno;
      ::close(fd);
      throw InputError(fmt::format("cannot stat {} ({}): {}", path, role, std::strerror(err)));
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
      void* addr = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
      int err = errno;
      ::close(fd);
      TETRA_INPUT_CHECK(addr != MAP_FAILED, "cannot memory-map {} ({}, {} bytes): {}", path, role,
                        size_, std::strerror(err));
      addr_ = addr;
    } else {
      ::close(fd);
    }
  }
  ~Mapping() {
    if (addr_ != nullptr) ::munmap(addr_, size_);
  }
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;

  const uint8_t* data() const { return static_cast<const uint8_t*>(addr_); }
  int64_t size() const { return static_cast<int64_t>(size_); }

 private:
  void* addr_ = nullptr;
  size_t size_ = 0;
};

// ---------------------------------------------------------------------------------------------
// The .bin, read with pread rather than memory-mapped.
//
// Why: a mapped file that shrinks under the process (another job rewriting the dataset, a
// half-finished copy, a full disk on a network file system) turns the next read of a lost page
// into SIGBUS, which kills the job with no word about which file. pread of a missing range
// returns short instead, which becomes an InputError naming the file. Checking the size with
// fstat before each copy out of a mapping would not be enough (the file can shrink between the
// check and the copy), and catching SIGBUS needs a process-wide handler and siglongjmp out of the
// copy loop, which does not compose with OpenMP threads or other handlers.
// Cost: one system call per sample. Measured on a 2-core build machine, random samples of 2049
// uint16 tokens from the page cache: the mapped copy 1.4-1.8 us, pread 3.1-4.1 us, and fstat +
// the mapped copy 3.7-4.0 us (the per-read size check costs as much as pread, without its
// safety). A training step reads micro_batch_size samples and takes milliseconds or more: the
// difference is below a thousandth of a step. pread is thread-safe (no shared file offset).
// ---------------------------------------------------------------------------------------------
class IndexedDataset::BinFile {
 public:
  BinFile(std::string path, const char* role) : path_(std::move(path)) {
    fd_ = open_regular_file(path_, role, kRegularFileHint);
    struct stat st;
    if (::fstat(fd_, &st) != 0) {
      int err = errno;
      ::close(fd_);
      throw InputError(fmt::format("cannot stat {} ({}): {}", path_, role, std::strerror(err)));
    }
    size_ = static_cast<int64_t>(st.st_size);
  }
  ~BinFile() { ::close(fd_); }
  BinFile(const BinFile&) = delete;
  BinFile& operator=(const BinFile&) = delete;

  int64_t size() const { return size_; }  // at open

  // Bytes [offset, offset + n) into dst. InputError if the file ends before them: it was cut
  // short after open (its size was checked against the .idx then).
  void read_exact(int64_t offset, int64_t n, void* dst) const {
    auto* out = static_cast<uint8_t*>(dst);
    int64_t done = 0;
    while (done < n) {
      const ssize_t got = ::pread(fd_, out + done, static_cast<size_t>(n - done),
                                  static_cast<off_t>(offset + done));
      if (got > 0) {
        done += got;
        continue;
      }
      if (got < 0 && errno == EINTR) continue;
      if (got < 0)
        throw InputError(fmt::format("cannot read bytes [{}, {}) of dataset tokens {}: {}",
                                     offset, offset + n, path_, std::strerror(errno)));
      struct stat st;
      const int64_t now = ::fstat(fd_, &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
      throw InputError(fmt::format(
          "dataset tokens {} were cut short while in use: bytes [{}, {}) are gone (the file had "
          "{} bytes when opened, as its .idx says, and has {} now); a dataset must not change "
          "while a job reads it: restore the file (copy it again or {}) and resume from the "
          "last checkpoint",
          path_, offset + done, offset + n, size_, now, kRegenerateHint));
    }
  }

 private:
  std::string path_;
  int fd_ = -1;
  int64_t size_ = 0;
};

IndexedDataset::IndexedDataset(IndexedDataset&&) noexcept = default;
IndexedDataset& IndexedDataset::operator=(IndexedDataset&&) noexcept = default;
IndexedDataset::~IndexedDataset() = default;

IndexedDataset IndexedDataset::open(const std::string& prefix) {
  IndexedDataset ds;
  ds.prefix_ = prefix;
  const std::string idx = ds.idx_path(), bin = ds.bin_path();

  // ---- both files present -------------------------------------------------------------------
  TETRA_INPUT_CHECK(file_exists(idx),
                    "dataset index {} does not exist{}: a Megatron indexed dataset is two files, "
                    "PREFIX.idx and PREFIX.bin; check the data path '{}'{}",
                    idx, file_exists(bin) ? " (its .bin is there)" : "", prefix,
                    prefix_hint(prefix));
  TETRA_INPUT_CHECK(file_exists(bin),
                    "dataset tokens {} do not exist (its .idx is there): a Megatron indexed "
                    "dataset is two files, PREFIX.idx and PREFIX.bin; copy the .bin next to the "
                    ".idx or {}",
                    bin, kRegenerateHint);

  // ---- the .idx header ----------------------------------------------------------------------
  ds.idx_map_ = std::make_unique<Mapping>(idx, "dataset index");
  const uint8_t* p = ds.idx_map_->data();
  const int64_t idx_size = ds.idx_map_->size();
  TETRA_INPUT_CHECK(idx_size >= kHeaderBytes,
                    "dataset index {} is truncated: it has {} bytes, less than the {}-byte header; "
                    "the file was cut short: copy it again or {}",
                    idx, idx_size, kHeaderBytes, kRegenerateHint);
  TETRA_INPUT_CHECK(std::memcmp(p, kIndexMagic, sizeof(kIndexMagic)) == 0,
                    "{} is not a Megatron indexed dataset index: it does not start with the magic "
                    "bytes \"MMIDIDX\\x00\\x00\" (the mmap format); {}",
                    idx, kRegenerateHint);
  const uint64_t version = load<uint64_t>(p + 9);
  TETRA_INPUT_CHECK(version == kIndexVersion,
                    "dataset index {} has format version {}; only version {} is supported; {}", idx,
                    version, kIndexVersion, kRegenerateHint);
  const uint8_t code = p[17];
  TETRA_INPUT_CHECK(code >= 1 && code <= 8,
                    "dataset index {} has unknown element type code {} (known: 1 uint8, 2 int8, "
                    "3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16); {}",
                    idx, code, kRegenerateHint);
  ds.dtype_ = static_cast<IndexedDType>(code);
  TETRA_INPUT_CHECK(is_integer_dtype(ds.dtype_),
                    "dataset {} stores {} values, not token ids; tokenise the text into an integer "
                    "dataset (uint16 or int32)",
                    prefix, indexed_dtype_name(ds.dtype_));
  const uint64_t seq_count = load<uint64_t>(p + 18);
  const uint64_t doc_count = load<uint64_t>(p + 26);

  // ---- the arrays fit in the file (counts compared before multiplying: no overflow) ---------
  const uint64_t body = static_cast<uint64_t>(idx_size - kHeaderBytes);
  const bool fits = seq_count <= body / 12 && doc_count <= (body - 12 * seq_count) / 8;
  TETRA_INPUT_CHECK(
      fits,
      "dataset index {} is truncated: its header promises {} sequences and {} "
      "document indices, which need {:.0f} bytes, but the file has {} bytes; the file "
      "was cut short: copy it again or {}",
      idx, seq_count, doc_count,
      static_cast<long double>(kHeaderBytes) + 12.0L * seq_count + 8.0L * doc_count, idx_size,
      kRegenerateHint);
  ds.num_sequences_ = static_cast<int64_t>(seq_count);
  ds.num_documents_ = doc_count > 0 ? static_cast<int64_t>(doc_count) - 1 : 0;
  const uint8_t* lengths = p + kHeaderBytes;
  const uint8_t* pointers = lengths + 4 * seq_count;
  ds.lengths_ = lengths;
  ds.pointers_ = pointers;

  // ---- lengths and pointers are consistent: the .bin is the sequences back to back ----------
  const int64_t elem = static_cast<int64_t>(indexed_dtype_size(ds.dtype_));
  int64_t running = 0;  // tokens in sequences [0, i)
  for (int64_t i = 0; i < ds.num_sequences_; ++i) {
    const int32_t len = load<int32_t>(lengths + 4 * i);
    const int64_t ptr = load<int64_t>(pointers + 8 * i);
    TETRA_INPUT_CHECK(len >= 0,
                      "dataset index {} is corrupt: sequence {} has negative length {}; {}", idx, i,
                      len, kRegenerateHint);
    TETRA_INPUT_CHECK(
        ptr == running * elem,
        "dataset index {} is corrupt: sequence {} starts at byte {} of the .bin, but "
        "the lengths of the sequences before it add up to byte {} ({} tokens of {}); {}",
        idx, i, ptr, running * elem, running, indexed_dtype_name(ds.dtype_), kRegenerateHint);
    running += len;
  }
  ds.num_tokens_ = running;

  // ---- the .bin holds exactly those tokens ---------------------------------------------------
  ds.bin_ = std::make_unique<BinFile>(bin, "dataset tokens");
  const int64_t bin_size = ds.bin_->size();
  TETRA_INPUT_CHECK(bin_size == running * elem,
                    "dataset index {} does not match its {}: the index describes {} tokens of {} "
                    "({} bytes) but the .bin has {} bytes; the two files come from different "
                    "preprocessing runs or one was cut short: {}",
                    idx, bin, running, indexed_dtype_name(ds.dtype_), running * elem, bin_size,
                    kRegenerateHint);
  TETRA_INPUT_CHECK(
      running > 0,
      "dataset {} is empty ({} sequences, 0 tokens): there is nothing to train on; "
      "check that the preprocessing input had text, or remove this path from the data "
      "list",
      prefix, seq_count);
  return ds;
}

int64_t IndexedDataset::sequence_length(int64_t i) const {
  TETRA_CHECK(i >= 0 && i < num_sequences_, "sequence {} of {} in {}", i, num_sequences_, prefix_);
  return load<int32_t>(lengths_ + 4 * i);
}

int64_t IndexedDataset::sequence_offset(int64_t i) const {
  TETRA_CHECK(i >= 0 && i < num_sequences_, "sequence {} of {} in {}", i, num_sequences_, prefix_);
  // Validated at open: pointer i == (tokens before sequence i) * element size.
  return load<int64_t>(pointers_ + 8 * i) / static_cast<int64_t>(indexed_dtype_size(dtype_));
}

namespace {

// Bytes read per pread when the element type is not int32 (and has to be widened): 64 KiB on the
// stack, so a sample of up to 32K uint16 tokens is one call.
constexpr int64_t kReadBufferBytes = 64 * 1024;

template <typename T> void convert(const uint8_t* bytes, int64_t count, int32_t* out) {
  for (int64_t i = 0; i < count; ++i) {
    T v;
    std::memcpy(&v, bytes + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
    out[i] = static_cast<int32_t>(v);
  }
}

// Tokens per block of the min/max scan: 4 MiB of int32, 1 MiB of uint8.
constexpr int64_t kScanBlockTokens = int64_t{1} << 20;

}  // namespace

void IndexedDataset::read(int64_t start, int64_t count, int32_t* out) const {
  TETRA_CHECK(start >= 0 && count >= 0 && start + count <= num_tokens_,
              "tokens [{}, {}) of {} ({} tokens)", start, start + count, prefix_, num_tokens_);
  const int64_t elem = static_cast<int64_t>(indexed_dtype_size(dtype_));
  if (dtype_ == IndexedDType::I32) {  // the file's bytes are the output
    bin_->read_exact(start * elem, count * elem, out);
    return;
  }
  alignas(8) uint8_t buf[kReadBufferBytes];
  const int64_t per_read = kReadBufferBytes / elem;
  for (int64_t done = 0; done < count; done += per_read) {
    const int64_t n = std::min(per_read, count - done);
    bin_->read_exact((start + done) * elem, n * elem, buf);
    switch (dtype_) {
      case IndexedDType::U8: convert<uint8_t>(buf, n, out + done); break;
      case IndexedDType::I8: convert<int8_t>(buf, n, out + done); break;
      case IndexedDType::I16: convert<int16_t>(buf, n, out + done); break;
      case IndexedDType::U16: convert<uint16_t>(buf, n, out + done); break;
      case IndexedDType::I64: convert<int64_t>(buf, n, out + done); break;
      case IndexedDType::I32:
      case IndexedDType::F32:
      case IndexedDType::F64: TETRA_CHECK(false, "dtype {} of {}", indexed_dtype_name(dtype_), prefix_);
    }
  }
}

template <typename T> void IndexedDataset::scan_range_as(int64_t& lo, int64_t& hi) const {
  // Blocks of the file, in parallel, each read into its thread's buffer: the raw values, so an
  // int64 token beyond int32 is seen as it is.
  const int64_t blocks = (num_tokens_ + kScanBlockTokens - 1) / kScanBlockTokens;
  T mn = std::numeric_limits<T>::max(), mx = std::numeric_limits<T>::lowest();
  std::exception_ptr error;
#pragma omp parallel
  {
    std::vector<T> buf(static_cast<size_t>(std::min(kScanBlockTokens, num_tokens_)));
#pragma omp for reduction(min : mn) reduction(max : mx) schedule(dynamic)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t begin = b * kScanBlockTokens;
      const int64_t n = std::min(kScanBlockTokens, num_tokens_ - begin);
      try {
        bin_->read_exact(begin * static_cast<int64_t>(sizeof(T)),
                         n * static_cast<int64_t>(sizeof(T)), buf.data());
      } catch (...) {
#pragma omp critical(tetra_scan_error)
        if (!error) error = std::current_exception();
        continue;
      }
      for (int64_t i = 0; i < n; ++i) {
        mn = std::min(mn, buf[i]);
        mx = std::max(mx, buf[i]);
      }
    }
  }
  if (error) std::rethrow_exception(error);
  lo = static_cast<int64_t>(mn);
  hi = static_cast<int64_t>(mx);
}

void IndexedDataset::scan_token_range() const {
  if (range_known_) return;
  int64_t lo = 0, hi = 0;
  switch (dtype_) {
    case IndexedDType::U8: scan_range_as<uint8_t>(lo, hi); break;
    case IndexedDType::I8: scan_range_as<int8_t>(lo, hi); break;
    case IndexedDType::I16: scan_range_as<int16_t>(lo, hi); break;
    case IndexedDType::U16: scan_range_as<uint16_t>(lo, hi); break;
    case IndexedDType::I32: scan_range_as<int32_t>(lo, hi); break;
    case IndexedDType::I64: scan_range_as<int64_t>(lo, hi); break;
    case IndexedDType::F32:
    case IndexedDType::F64: TETRA_CHECK(false, "float dataset {} was rejected at open", prefix_);
  }
  min_token_ = lo;
  max_token_ = hi;
  range_known_ = true;
}

int64_t IndexedDataset::max_token() const {
  scan_token_range();
  return max_token_;
}

int64_t IndexedDataset::min_token() const {
  scan_token_range();
  return min_token_;
}

// ---------------------------------------------------------------------------------------------
// Writer
// ---------------------------------------------------------------------------------------------
namespace {

void fsync_and_close(std::FILE* f, const std::string& path) {
  bool ok = std::fflush(f) == 0 && ::fsync(::fileno(f)) == 0;
  int err = errno;
  ok = (std::fclose(f) == 0) && ok;
  if (!ok) err = err != 0 ? err : errno;
  TETRA_INPUT_CHECK(ok, "cannot finish writing {}: {} (is the disk full?)", path,
                    std::strerror(err));
}

template <typename T> void narrow_into(std::span<const int32_t> tokens, std::vector<uint8_t>& buf,
                                       IndexedDType dtype, const std::string& path) {
  buf.resize(tokens.size() * sizeof(T));
  T* dst = reinterpret_cast<T*>(buf.data());
  for (size_t i = 0; i < tokens.size(); ++i) {
    const int64_t v = tokens[i];
    TETRA_INPUT_CHECK(v >= static_cast<int64_t>(std::numeric_limits<T>::min()) &&
                          v <= static_cast<int64_t>(std::numeric_limits<T>::max()),
                      "token {} does not fit the element type {} of {}: write the dataset as int32",
                      v, indexed_dtype_name(dtype), path);
    dst[i] = static_cast<T>(v);
  }
}

}  // namespace

IndexedDatasetWriter::IndexedDatasetWriter(std::string prefix, IndexedDType dtype)
    : prefix_(std::move(prefix)), dtype_(dtype) {
  TETRA_CHECK(is_integer_dtype(dtype_), "token datasets hold integers, not {}",
              indexed_dtype_name(dtype_));
  int fd = -1;
  try {
    fd = create_temp_beside(prefix_ + ".bin", &bin_tmp_);
  } catch (const Error& e) {
    throw InputError(fmt::format("{}; check that the directory exists and is writable", e.what()));
  }
  bin_ = ::fdopen(fd, "wb");
  TETRA_CHECK(bin_ != nullptr, "fdopen {}: {}", bin_tmp_, std::strerror(errno));
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (finished_) return;
  if (bin_ != nullptr) std::fclose(bin_);
  if (!bin_tmp_.empty()) std::remove(bin_tmp_.c_str());
  if (!idx_tmp_.empty()) std::remove(idx_tmp_.c_str());
}

void IndexedDatasetWriter::write_bytes(const void* data, size_t size, const std::string& path,
                                       std::FILE* f) {
  if (size == 0) return;
  TETRA_INPUT_CHECK(std::fwrite(data, 1, size, f) == size, "cannot write {} bytes to {}: {}", size,
                    path, std::strerror(errno));
}

void IndexedDatasetWriter::add_document(std::span<const int32_t> tokens) {
  TETRA_CHECK(!finished_, "add_document after finish() on {}", prefix_);
  const std::string& tmp = bin_tmp_;
  TETRA_INPUT_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
                    "document {} of {} has {} tokens; the format stores lengths as int32",
                    lengths_.size(), prefix_, tokens.size());
  std::vector<uint8_t> buf;
  switch (dtype_) {
    case IndexedDType::U8: narrow_into<uint8_t>(tokens, buf, dtype_, tmp); break;
    case IndexedDType::I8: narrow_into<int8_t>(tokens, buf, dtype_, tmp); break;
    case IndexedDType::I16: narrow_into<int16_t>(tokens, buf, dtype_, tmp); break;
    case IndexedDType::U16: narrow_into<uint16_t>(tokens, buf, dtype_, tmp); break;
    case IndexedDType::I32: narrow_into<int32_t>(tokens, buf, dtype_, tmp); break;
    case IndexedDType::I64: narrow_into<int64_t>(tokens, buf, dtype_, tmp); break;
    case IndexedDType::F32:
    case IndexedDType::F64: TETRA_CHECK(false, "float writer for {}", prefix_);
  }
  write_bytes(buf.data(), buf.size(), tmp, bin_);
  lengths_.push_back(static_cast<int32_t>(tokens.size()));
  num_tokens_ += static_cast<int64_t>(tokens.size());
}

void IndexedDatasetWriter::finish() {
  TETRA_CHECK(!finished_, "finish() called twice on {}", prefix_);
  const std::string& bin_tmp = bin_tmp_;
  std::FILE* bin = bin_;
  bin_ = nullptr;
  fsync_and_close(bin, bin_tmp);

  int idx_fd = -1;
  try {
    idx_fd = create_temp_beside(prefix_ + ".idx", &idx_tmp_);
  } catch (const Error& e) {
    throw InputError(e.what());
  }
  const std::string& idx_tmp = idx_tmp_;
  std::FILE* idx = ::fdopen(idx_fd, "wb");
  TETRA_CHECK(idx != nullptr, "fdopen {}: {}", idx_tmp, std::strerror(errno));
  const uint64_t seq_count = lengths_.size();
  const uint64_t doc_count = seq_count + 1;  // document_indices = [0, 1, ..., S]
  const uint8_t code = static_cast<uint8_t>(dtype_);
  const int64_t elem = static_cast<int64_t>(indexed_dtype_size(dtype_));
  std::vector<int64_t> pointers(seq_count), doc_indices(doc_count);
  int64_t running = 0;
  for (uint64_t i = 0; i < seq_count; ++i) {
    pointers[i] = running * elem;
    running += lengths_[i];
  }
  for (uint64_t i = 0; i < doc_count; ++i) doc_indices[i] = static_cast<int64_t>(i);
  try {
    write_bytes(kIndexMagic, sizeof(kIndexMagic), idx_tmp, idx);
    write_bytes(&kIndexVersion, 8, idx_tmp, idx);
    write_bytes(&code, 1, idx_tmp, idx);
    write_bytes(&seq_count, 8, idx_tmp, idx);
    write_bytes(&doc_count, 8, idx_tmp, idx);
    write_bytes(lengths_.data(), 4 * seq_count, idx_tmp, idx);
    write_bytes(pointers.data(), 8 * seq_count, idx_tmp, idx);
    write_bytes(doc_indices.data(), 8 * doc_count, idx_tmp, idx);
  } catch (...) {
    std::fclose(idx);
    throw;
  }
  fsync_and_close(idx, idx_tmp);

  // Old .idx first: from here until the last rename there is no complete pair on disk.
  const std::string idx_final = prefix_ + ".idx", bin_final = prefix_ + ".bin";
  TETRA_INPUT_CHECK(std::remove(idx_final.c_str()) == 0 || errno == ENOENT, "cannot replace {}: {}",
                    idx_final, std::strerror(errno));
  TETRA_INPUT_CHECK(std::rename(bin_tmp.c_str(), bin_final.c_str()) == 0,
                    "cannot rename {} to {}: {}", bin_tmp, bin_final, std::strerror(errno));
  TETRA_INPUT_CHECK(std::rename(idx_tmp.c_str(), idx_final.c_str()) == 0,
                    "cannot rename {} to {}: {}", idx_tmp, idx_final, std::strerror(errno));
  finished_ = true;
}

}  // namespace tetra
