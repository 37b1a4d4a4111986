// The Megatron indexed dataset format: files written by hand, by the C++ writer and by
// tools/indexed_dataset.py, and every validation error.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "tests/unit/data_testing.h"

using namespace tetra;
using namespace tetra::data_testing;
using Catch::Matchers::Contains;
// =============================================================================================
// Format
// =============================================================================================
TEST_CASE("indexed dataset: C++ writer round trip, bytes on disk follow the format", "[data]") {
  for (IndexedDType dtype : {IndexedDType::U16, IndexedDType::I32}) {
    const std::string prefix = tmp_prefix(fmt::format("writer_{}", indexed_dtype_name(dtype)));
    const int64_t vocab = dtype == IndexedDType::U16 ? 65536 : 1000000;
    const auto docs = make_docs(vocab, static_cast<uint64_t>(dtype));
    {
      IndexedDatasetWriter w(prefix, dtype);
      for (const auto& d : docs) {
        std::vector<int32_t> d32(d.begin(), d.end());
        w.add_document(d32);
      }
      w.finish();
    }
    CHECK_FALSE(std::filesystem::exists(prefix + ".bin.tmp"));
    CHECK_FALSE(std::filesystem::exists(prefix + ".idx.tmp"));
    // The files are byte for byte what the format description says.
    const uint8_t code = static_cast<uint8_t>(dtype);
    if (dtype == IndexedDType::U16) {
      CHECK(read_file(prefix + ".bin") == bin_bytes<uint16_t>(docs));
      CHECK(read_file(prefix + ".idx") == idx_bytes(docs, code, 2));
    } else {
      CHECK(read_file(prefix + ".bin") == bin_bytes<int32_t>(docs));
      CHECK(read_file(prefix + ".idx") == idx_bytes(docs, code, 4));
    }
    const IndexedDataset ds = IndexedDataset::open(prefix);
    CHECK(ds.dtype() == dtype);
    CHECK(ds.num_sequences() == static_cast<int64_t>(docs.size()));
    CHECK(ds.num_documents() == static_cast<int64_t>(docs.size()));
    int64_t offset = 0;
    for (size_t i = 0; i < docs.size(); ++i) {
      CHECK(ds.sequence_length(static_cast<int64_t>(i)) == static_cast<int64_t>(docs[i].size()));
      CHECK(ds.sequence_offset(static_cast<int64_t>(i)) == offset);
      offset += static_cast<int64_t>(docs[i].size());
    }
    const auto all = concat(docs);
    check_reads(ds, all);
    CHECK(ds.max_token() == *std::max_element(all.begin(), all.end()));
    CHECK(ds.min_token() == *std::min_element(all.begin(), all.end()));
  }
}

TEST_CASE("indexed dataset: reads hand-written files of every integer type", "[data]") {
  const std::vector<std::vector<int64_t>> docs = {{5, 0, 120}, {}, {7}, {1, 2, 3, 4, 126}};
  const std::vector<std::vector<int64_t>> signed_docs = {{-5, 0, 120}, {7, -128}, {1, 2}};
  const auto check = [](const std::string& prefix, const std::vector<std::vector<int64_t>>& d,
                        IndexedDType expect) {
    const IndexedDataset ds = IndexedDataset::open(prefix);
    CHECK(ds.dtype() == expect);
    const auto all = concat(d);
    check_reads(ds, all);
    CHECK(ds.max_token() == *std::max_element(all.begin(), all.end()));
    CHECK(ds.min_token() == *std::min_element(all.begin(), all.end()));
  };
  std::string p = tmp_prefix("hand_u8");
  write_by_hand<uint8_t>(p, docs, 1);
  check(p, docs, IndexedDType::U8);
  p = tmp_prefix("hand_i8");
  write_by_hand<int8_t>(p, signed_docs, 2);
  check(p, signed_docs, IndexedDType::I8);
  p = tmp_prefix("hand_i16");
  write_by_hand<int16_t>(p, signed_docs, 3);
  check(p, signed_docs, IndexedDType::I16);
  p = tmp_prefix("hand_i32");
  write_by_hand<int32_t>(p, docs, 4);
  check(p, docs, IndexedDType::I32);
  p = tmp_prefix("hand_i64");
  write_by_hand<int64_t>(p, docs, 5);
  check(p, docs, IndexedDType::I64);
  p = tmp_prefix("hand_u16");
  write_by_hand<uint16_t>(p, {{65535, 0}, {40000}}, 8);
  check(p, {{65535, 0}, {40000}}, IndexedDType::U16);
}

TEST_CASE("indexed dataset: interoperates with tools/indexed_dataset.py", "[data]") {
  const std::string tool = tools_dir();
  REQUIRE(std::filesystem::exists(tool + "/indexed_dataset.py"));
  // Python writes, C++ reads.
  const std::string py_prefix = tmp_prefix("python_written");
  const auto docs = make_docs(65536, 3);
  std::string lists;
  for (const auto& d : docs) {
    lists += "[";
    for (int64_t v : d) lists += std::to_string(v) + ",";
    lists += "],";
  }
  const std::string write_cmd = fmt::format(
      "/usr/bin/python3 -B -c \"import sys; sys.path.insert(0, '{}'); import indexed_dataset as d; "
      "d.write('{}', [{}], 'uint16')\"",
      tool, py_prefix, lists);
  REQUIRE(std::system(write_cmd.c_str()) == 0);
  const IndexedDataset ds = IndexedDataset::open(py_prefix);
  CHECK(ds.dtype() == IndexedDType::U16);
  CHECK(ds.num_sequences() == static_cast<int64_t>(docs.size()));
  check_reads(ds, concat(docs));

  // C++ writes, Python reads and compares (exit code 0 only when every sequence matches).
  const std::string cpp_prefix = tmp_prefix("cpp_written");
  {
    IndexedDatasetWriter w(cpp_prefix, IndexedDType::I32);
    for (const auto& d : docs) {
      std::vector<int32_t> d32(d.begin(), d.end());
      w.add_document(d32);
    }
    w.finish();
  }
  const std::string read_cmd = fmt::format(
      "/usr/bin/python3 -B -c \"import sys; sys.path.insert(0, '{}'); import indexed_dataset as d; "
      "got = [x.tolist() for x in d.read('{}')]; sys.exit(0 if got == [{}] and "
      "d.read_index('{}')[0] == 'int32' else 1)\"",
      tool, cpp_prefix, lists, cpp_prefix);
  CHECK(std::system(read_cmd.c_str()) == 0);
}

TEST_CASE("indexed dataset: writer is atomic and rejects what it cannot write", "[data]") {
  const std::string prefix = tmp_prefix("atomic");
  const std::vector<int32_t> old_doc = {1, 2, 3, 4};
  {
    IndexedDatasetWriter w(prefix, IndexedDType::U16);
    w.add_document(old_doc);
    w.finish();
  }
  {
    // Abandoned half-way: the old dataset stays as it was, no temporaries remain.
    IndexedDatasetWriter w(prefix, IndexedDType::U16);
    const std::vector<int32_t> doc = {9, 9, 9};
    w.add_document(doc);
    CHECK(std::filesystem::exists(prefix + ".bin.tmp"));
  }
  CHECK_FALSE(std::filesystem::exists(prefix + ".bin.tmp"));
  CHECK_FALSE(std::filesystem::exists(prefix + ".idx.tmp"));
  const IndexedDataset ds = IndexedDataset::open(prefix);
  REQUIRE(ds.num_tokens() == 4);
  std::vector<int32_t> out(4);
  ds.read(0, 4, out.data());
  CHECK(out == old_doc);

  const std::string unwritable = tmp_dir() + "/no_such_dir/x";
  const std::string msg =
      input_error([&] { IndexedDatasetWriter w(unwritable, IndexedDType::I32); });
  CHECK_THAT(msg, Contains(unwritable + ".bin.tmp"));

  IndexedDatasetWriter w(tmp_prefix("too_big"), IndexedDType::U16);
  const std::vector<int32_t> big = {1, 70000};
  CHECK_THAT(input_error([&] { w.add_document(big); }), Contains("70000") && Contains("uint16"));
}

TEST_CASE("indexed dataset: every malformed input is an InputError naming the file", "[data]") {
  const std::vector<std::vector<int64_t>> docs = {{1, 2, 3}, {4, 5}};
  const std::string p = tmp_prefix("bad");
  const std::string idx = p + ".idx", bin = p + ".bin";
  const auto good_idx = idx_bytes(docs, 4, 4);
  const auto good_bin = bin_bytes<int32_t>(docs);
  const auto open = [&] { IndexedDataset::open(p); };

  SECTION("missing .idx") {
    write_file(bin, good_bin);
    CHECK_THAT(input_error(open), Contains(idx) && Contains("does not exist"));
  }
  SECTION("missing .bin") {
    write_file(idx, good_idx);
    CHECK_THAT(input_error(open), Contains(bin) && Contains("do not exist"));
  }
  SECTION("prefix given with an extension") {
    write_file(idx, good_idx);
    write_file(bin, good_bin);
    CHECK_THAT(input_error([&] { IndexedDataset::open(bin); }),
               Contains("did you mean '" + p + "'"));
  }
  SECTION("wrong magic") {
    auto b = good_idx;
    b[0] = 'X';
    write_file(idx, b);
    write_file(bin, good_bin);
    CHECK_THAT(input_error(open), Contains(idx) && Contains("MMIDIDX"));
  }
  SECTION("wrong version") {
    auto b = good_idx;
    b[9] = 2;
    write_file(idx, b);
    write_file(bin, good_bin);
    CHECK_THAT(input_error(open), Contains(idx) && Contains("version 2"));
  }
  SECTION("unknown dtype code") {
    auto b = good_idx;
    b[17] = 9;
    write_file(idx, b);
    write_file(bin, good_bin);
    CHECK_THAT(input_error(open), Contains(idx) && Contains("code 9"));
  }
  SECTION("float dtype") {
    auto b = good_idx;
    b[17] = 7;
    write_file(idx, b);
    write_file(bin, good_bin);
    CHECK_THAT(input_error(open), Contains(p) && Contains("float32"));
  }
  SECTION("idx shorter than its header") {
    write_file(idx, std::vector<uint8_t>(good_idx.begin(), good_idx.begin() + 20));
    write_file(bin, good_bin);
    CHECK_THAT(input_error(open), Contains(idx) && Contains("truncated"));
  }
  SECTION("idx shorter than its arrays") {
    write_file(idx, std::vector<uint8_t>(good_idx.begin(), good_idx.end() - 1));
    write_file(bin, good_bin);
    const std::string m = input_error(open);
    CHECK_THAT(
        m, Contains(idx) && Contains("truncated") && Contains(std::to_string(good_idx.size() - 1)));
  }
  SECTION("idx with an absurd sequence count") {
    auto b = good_idx;
    const uint64_t huge = ~uint64_t{0} / 2;
    std::memcpy(&b[18], &huge, 8);
    write_file(idx, b);
    write_file(bin, good_bin);
    CHECK_THAT(input_error(open), Contains(idx) && Contains("truncated"));
  }
  SECTION(".bin size does not match the index") {
    write_file(idx, good_idx);
    auto b = good_bin;
    b.resize(b.size() + 4);  // one token too many
    write_file(bin, b);
    const std::string m = input_error(open);
    CHECK_THAT(m, Contains(idx) && Contains(bin) && Contains("does not match") &&
                      Contains("20 bytes") && Contains("24 bytes"));
  }
  SECTION("sequence pointer not at the running offset") {
    auto b = good_idx;
    const int64_t wrong = 16;  // sequence 1 should start at byte 12
    std::memcpy(&b[34 + 2 * 4 + 8], &wrong, 8);
    write_file(idx, b);
    write_file(bin, good_bin);
    CHECK_THAT(input_error(open),
               Contains(idx) && Contains("sequence 1") && Contains("16") && Contains("12"));
  }
  SECTION("empty dataset: no documents") {
    write_by_hand<int32_t>(p, {}, 4);
    CHECK_THAT(input_error(open), Contains(p) && Contains("empty"));
  }
  SECTION("empty dataset: only empty documents") {
    write_by_hand<int32_t>(p, {{}, {}}, 4);
    CHECK_THAT(input_error(open), Contains(p) && Contains("empty"));
  }
}

// =============================================================================================
// Sample sources
// =============================================================================================

// =============================================================================================
// Files that are not regular files, and a .bin that shrinks under a reader
// =============================================================================================
namespace {

// Runs `f` on a thread. Should it still be running after 20 s (an open() blocked on a named pipe,
// the defect this guards against), opens `fifo` for writing, which releases the blocked reader,
// and fails the test instead of hanging it.
std::string input_error_without_blocking(const std::function<void()>& f, const std::string& fifo) {
  std::string msg;
  std::thread t([&] { msg = input_error(f); });
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  bool released = false;
  std::atomic<bool> done{false};
  std::thread watch([&] {
    while (!done && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    if (!done) {
      released = true;
      const int fd = ::open(fifo.c_str(), O_WRONLY | O_NONBLOCK);
      if (fd >= 0) ::close(fd);
    }
  });
  t.join();
  done = true;
  watch.join();
  CHECK_FALSE(released);  // open() blocked on the FIFO
  return msg;
}

}  // namespace

TEST_CASE("indexed dataset: only regular files are opened (a FIFO, a directory, a device is an "
          "InputError naming it)",
          "[data]") {
  namespace fs = std::filesystem;
  const std::vector<std::vector<int64_t>> docs = {{1, 2, 3}, {4, 5}};
  const std::string p = tmp_dir() + "/special";
  fs::remove_all(p + ".idx");
  fs::remove_all(p + ".bin");
  const std::string idx = p + ".idx", bin = p + ".bin";
  const auto open = [&] { IndexedDataset::open(p); };

  SECTION("a named pipe as the .idx does not block") {
    REQUIRE(::mkfifo(idx.c_str(), 0600) == 0);
    write_file(bin, bin_bytes<int32_t>(docs));
    CHECK_THAT(input_error_without_blocking(open, idx),
               Contains(idx + " is a named pipe (FIFO), not a regular file") &&
                   Contains("PREFIX.idx and PREFIX.bin"));
  }
  SECTION("a named pipe as the .bin does not block") {
    write_file(idx, idx_bytes(docs, 4, 4));
    REQUIRE(::mkfifo(bin.c_str(), 0600) == 0);
    CHECK_THAT(input_error_without_blocking(open, bin),
               Contains(bin + " is a named pipe (FIFO), not a regular file"));
  }
  SECTION("a directory as the .idx or the .bin") {
    fs::create_directories(idx);
    write_file(bin, bin_bytes<int32_t>(docs));
    std::string m = input_error(open);
    CHECK_THAT(m, Contains(idx + " is a directory, not a regular file"));
    CHECK_THAT(m, !Contains("No such device"));
    fs::remove_all(idx);
    write_file(idx, idx_bytes(docs, 4, 4));
    fs::remove_all(bin);
    fs::create_directories(bin);
    m = input_error(open);
    CHECK_THAT(m, Contains(bin + " is a directory, not a regular file"));
    CHECK_THAT(m, !Contains("No such device"));
  }
  SECTION("a character device (a link to /dev/zero) as the .bin") {
    write_file(idx, idx_bytes(docs, 4, 4));
    fs::create_symlink("/dev/zero", bin);
    CHECK_THAT(input_error(open), Contains(bin + " is a character device, not a regular file"));
  }
  fs::remove_all(idx);
  fs::remove_all(bin);
}

TEST_CASE("indexed dataset: a .bin cut short after open is an InputError naming it, not SIGBUS",
          "[data]") {
  // 64 documents of 1000 tokens: 128 KB of uint16, 256 KB of int32 (pages well past the cut).
  std::vector<std::vector<int64_t>> docs(64);
  for (size_t d = 0; d < docs.size(); ++d)
    for (int64_t i = 0; i < 1000; ++i) docs[d].push_back((static_cast<int64_t>(d) * 7 + i) % 500);
  for (const bool wide : {false, true}) {
    const std::string p = tmp_prefix(wide ? "cut_under_reader_i32" : "cut_under_reader_u16");
    if (wide)
      write_by_hand<int32_t>(p, docs, 4);
    else
      write_by_hand<uint16_t>(p, docs, 8);
    const std::string bin = p + ".bin";
    auto ds = std::make_shared<const IndexedDataset>(IndexedDataset::open(p));
    IndexedSamples samples(ds, 999, 500);  // reads the whole file once (the token range scan)
    std::vector<int32_t> out(1000);
    samples.sample(3, out.data());
    CHECK(out[0] == docs[2][997]);  // sample 3 starts at token 3 * 999 = 2997

    // Another process truncates the file to 4 KiB while this one still reads it.
    REQUIRE(::truncate(bin.c_str(), 4096) == 0);
    samples.sample(0, out.data());  // still inside the first 4 KiB for uint16 ... and int32
    CHECK(out[0] == docs[0][0]);
    const std::string m = input_error([&] { samples.sample(40, out.data()); });
    CHECK_THAT(m, Contains("dataset tokens " + bin + " were cut short while in use") &&
                      Contains(wide ? "bytes [159840, 163840) are gone"
                                    : "bytes [79920, 81920) are gone") &&
                      Contains(wide ? "had 256000 bytes" : "had 128000 bytes") &&
                      Contains("has 4096 now") && Contains("must not change while a job reads it"));
    // The first scan of a dataset cut short before it: the same error, from any thread.
    const std::string p2 = tmp_prefix(wide ? "cut_before_scan_i32" : "cut_before_scan_u16");
    if (wide)
      write_by_hand<int32_t>(p2, docs, 4);
    else
      write_by_hand<uint16_t>(p2, docs, 8);
    const IndexedDataset ds2 = IndexedDataset::open(p2);
    REQUIRE(::truncate((p2 + ".bin").c_str(), 100) == 0);
    CHECK_THAT(input_error([&] { ds2.max_token(); }),
               Contains("dataset tokens " + p2 + ".bin were cut short"));
  }
}
