// llm.c token shards -> Megatron indexed dataset. The format and the document rule are in
// prepare_llmc.h.
#include "trainer/data/prepare_llmc.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <limits>
#include <memory>

#include "kernels/common/check.h"
#include "trainer/data/indexed_dataset.h"
#include "trainer/core/files.h"
#include "trainer/core/output_path.h"

namespace tetra {

namespace {

constexpr int64_t kHeaderBytes = 4 * kLlmcHeaderInts;

constexpr const char* kFormats =
    "llm.c shards start with magic 20240520 (gpt-2, uint16 tokens, version 1) or 20240801 "
    "(llama-3, uint32 tokens, version 7)";

struct FileCloser {
  void operator()(std::FILE* f) const { std::fclose(f); }
};
using File = std::unique_ptr<std::FILE, FileCloser>;

File open_shard(const std::string& path) {
  const int fd = open_regular_file(path, "llm.c shard", "");  // never blocks on a named pipe
  File f(::fdopen(fd, "rb"));
  if (f == nullptr) {
    const int err = errno;
    ::close(fd);
    throw InputError(fmt::format("cannot open {}: {}", path, std::strerror(err)));
  }
  return f;
}

const char* format_name(int32_t magic) { return magic == kLlmcMagicGpt2 ? "gpt-2" : "llama-3"; }

}  // namespace

LlmcShard read_llmc_header(const std::string& path) {
  File f = open_shard(path);
  struct stat st;
  TETRA_INPUT_CHECK(::fstat(::fileno(f.get()), &st) == 0, "cannot read the size of {}: {}", path,
                    std::strerror(errno));
  LlmcShard s;
  s.path = path;
  s.file_bytes = static_cast<int64_t>(st.st_size);
  TETRA_INPUT_CHECK(s.file_bytes >= kHeaderBytes,
                    "{}: not an llm.c token shard: it has {} bytes, less than the {}-byte header "
                    "(256 int32); {}",
                    path, s.file_bytes, kHeaderBytes, kFormats);
  int32_t header[kLlmcHeaderInts];
  TETRA_INPUT_CHECK(std::fread(header, 4, kLlmcHeaderInts, f.get()) == kLlmcHeaderInts,
                    "cannot read the header of {}: {}", path, std::strerror(errno));
  s.magic = header[0];
  s.version = header[1];
  s.num_tokens = header[2];
  TETRA_INPUT_CHECK(s.magic == kLlmcMagicGpt2 || s.magic == kLlmcMagicLlama3,
                    "{}: byte 0: bad magic {}: not an llm.c token shard; {}", path, s.magic,
                    kFormats);
  const int32_t want_version = s.magic == kLlmcMagicGpt2 ? kLlmcVersionGpt2 : kLlmcVersionLlama3;
  TETRA_INPUT_CHECK(s.version == want_version,
                    "{}: byte 4: version {} with magic {} ({}); llm.c writes version {} there; {}",
                    path, s.version, s.magic, format_name(s.magic), want_version, kFormats);
  s.token_bytes = s.magic == kLlmcMagicGpt2 ? 2 : 4;
  TETRA_INPUT_CHECK(s.num_tokens > 0, "{}: byte 8: token count {}: the shard holds no tokens", path,
                    s.num_tokens);
  const int64_t expect = kHeaderBytes + s.num_tokens * s.token_bytes;
  TETRA_INPUT_CHECK(s.file_bytes == expect,
                    "{}: byte 8: the header promises {} tokens of {} bytes, a file of {} bytes, "
                    "but the file has {} bytes: it was {}",
                    path, s.num_tokens, s.token_bytes, expect, s.file_bytes,
                    s.file_bytes < expect ? "cut short: copy it again"
                                          : "written with a wrong count or has trailing bytes");
  return s;
}

PrepareSummary convert_llmc_shards(const LlmcOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  const auto seconds = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };

  // ---- every header first: one format, a delimiter that fits ----------------------------------
  const std::vector<InputFile> files = list_input_files(opt.inputs, ".bin");
  check_output_prefix(opt.output_prefix, "--output");
  const std::vector<std::string> input_names = input_paths(files);
  for (const char* ext : {".bin", ".idx"}) check_output_file("--output", opt.output_prefix + ext, opt.force, input_names);
  std::vector<LlmcShard> shards;
  for (const InputFile& f : files) {
    shards.push_back(read_llmc_header(f.path));
    const LlmcShard& first = shards.front();
    TETRA_INPUT_CHECK(shards.back().magic == first.magic,
                      "{} is a {} shard but {} is a {} shard: convert shards of one tokenizer "
                      "together",
                      shards.back().path, format_name(shards.back().magic), first.path,
                      format_name(first.magic));
  }
  const bool gpt2 = shards.front().magic == kLlmcMagicGpt2;
  const IndexedDType dtype = gpt2 ? IndexedDType::U16 : IndexedDType::I32;
  const int64_t eot = opt.eot >= 0 ? opt.eot : (gpt2 ? kLlmcEotGpt2 : kLlmcEotLlama3);
  const int64_t max_id =
      gpt2 ? std::numeric_limits<uint16_t>::max() : std::numeric_limits<int32_t>::max();
  TETRA_INPUT_CHECK(eot <= max_id, "--eot {} cannot occur in {} shards (tokens up to {})", eot,
                    format_name(shards.front().magic), max_id);

  PrepareSummary summary;
  summary.files = static_cast<int64_t>(shards.size());
  summary.dtype = std::string(indexed_dtype_name(dtype));
  for (const LlmcShard& s : shards) summary.input_bytes += s.file_bytes;
  IndexedDatasetWriter writer(opt.output_prefix, dtype);

  std::vector<int32_t> doc;  // the document being gathered, across shard boundaries
  bool at_start = true;      // nothing read yet: a delimiter here is the first document's
  const auto emit = [&] {
    doc.push_back(static_cast<int32_t>(eot));
    writer.add_document(doc);
    summary.documents += 1;
    summary.tokens += static_cast<int64_t>(doc.size());
    doc.clear();
  };

  int64_t bytes_done = 0;
  double last_report = 0.0;
  const auto report = [&](bool done) {
    if (!opt.progress) return;
    PrepareProgress p;
    p.bytes_done = bytes_done;
    p.bytes_total = summary.input_bytes;
    p.documents = summary.documents;
    p.tokens = summary.tokens + static_cast<int64_t>(doc.size());
    p.seconds = seconds();
    p.done = done;
    opt.progress(p);
  };

  constexpr int64_t kChunk = int64_t{1} << 20;  // tokens per read
  std::vector<uint8_t> raw;
  for (const LlmcShard& s : shards) {
    File f = open_shard(s.path);
    TETRA_INPUT_CHECK(std::fseek(f.get(), kHeaderBytes, SEEK_SET) == 0, "cannot seek in {}: {}",
                      s.path, std::strerror(errno));
    bytes_done += kHeaderBytes;
    for (int64_t start = 0; start < s.num_tokens; start += kChunk) {
      const int64_t count = std::min(kChunk, s.num_tokens - start);
      raw.resize(static_cast<size_t>(count * s.token_bytes));
      TETRA_INPUT_CHECK(std::fread(raw.data(), 1, raw.size(), f.get()) == raw.size(),
                        "{}: cannot read tokens {}..{} (byte {}): {}; was the file changed while "
                        "being read?",
                        s.path, start, start + count, kHeaderBytes + start * s.token_bytes,
                        std::strerror(errno));
      for (int64_t i = 0; i < count; ++i) {
        int64_t t;
        if (gpt2) {
          uint16_t v;
          std::memcpy(&v, raw.data() + 2 * i, 2);
          t = v;
        } else {
          uint32_t v;
          std::memcpy(&v, raw.data() + 4 * i, 4);
          t = v;
          TETRA_INPUT_CHECK(t <= max_id,
                            "{}: byte {}: token {} does not fit int32; no llama-3 vocabulary is "
                            "that large: is the file corrupt?",
                            s.path, kHeaderBytes + (start + i) * 4, t);
        }
        if (t == eot) {
          if (!at_start) emit();
        } else {
          doc.push_back(static_cast<int32_t>(t));
        }
        at_start = false;
      }
      bytes_done += count * s.token_bytes;
      if (seconds() - last_report >= opt.progress_interval_s) {
        last_report = seconds();
        report(false);
      }
    }
  }
  if (!doc.empty()) emit();
  TETRA_INPUT_CHECK(summary.documents > 0,
                    "{}: the shards hold nothing but one delimiter token {}: no document",
                    shards.front().path, eot);
  writer.finish();
  summary.datasets.push_back({opt.output_prefix, summary.documents, summary.tokens});
  summary.seconds = seconds();
  report(true);
  return summary;
}

}  // namespace tetra
