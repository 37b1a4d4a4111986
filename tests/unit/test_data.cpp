// The data module: the Megatron indexed dataset format (written by hand, by the C++ writer and by
// tools/indexed_dataset.py), every validation error, sample windows, the blend, the shuffle, the
// synthetic stream and the per-DP-rank loader order.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <vector>

#include <catch2/catch.hpp>

#include "trainer/core/check.h"
#include "trainer/data/data_loader.h"
#include "trainer/data/indexed_dataset.h"
#include "trainer/data/sample_source.h"

using namespace tetra;
using Catch::Matchers::Contains;

namespace {

std::string tmp_dir() {
  static const std::string dir = [] {
    std::string d = std::string(TETRA_TEST_TMPDIR) + "/data";
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

std::string tmp_prefix(const std::string& name) {
  const std::string p = tmp_dir() + "/" + name;
  for (const char* ext : {".bin", ".idx", ".bin.tmp", ".idx.tmp"}) std::remove((p + ext).c_str());
  return p;
}

// The message of the InputError `f` throws; fails the test if it throws nothing or another type.
std::string input_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const InputError& e) {
    return e.what();
  } catch (const std::exception& e) {
    FAIL("expected an InputError, got another exception: " << e.what());
  }
  FAIL("expected an InputError, nothing was thrown");
  return "";
}

// ---- hand-written files, following the format description, independently of the writer -------
void put_bytes(std::vector<uint8_t>& b, const void* p, size_t n) {
  const auto* c = static_cast<const uint8_t*>(p);
  b.insert(b.end(), c, c + n);
}
template <typename T> void put(std::vector<uint8_t>& b, T v) { put_bytes(b, &v, sizeof(T)); }

void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

// .idx bytes for `docs` (one sequence each) with element size `elem` and type code `code`.
std::vector<uint8_t> idx_bytes(const std::vector<std::vector<int64_t>>& docs, uint8_t code,
                               size_t elem) {
  std::vector<uint8_t> b;
  put_bytes(b, "MMIDIDX\0\0", 9);
  put<uint64_t>(b, 1);
  put<uint8_t>(b, code);
  put<uint64_t>(b, docs.size());
  put<uint64_t>(b, docs.size() + 1);
  for (const auto& d : docs) put<int32_t>(b, static_cast<int32_t>(d.size()));
  int64_t ptr = 0;
  for (const auto& d : docs) {
    put<int64_t>(b, ptr);
    ptr += static_cast<int64_t>(d.size() * elem);
  }
  for (size_t i = 0; i <= docs.size(); ++i) put<int64_t>(b, static_cast<int64_t>(i));
  return b;
}

template <typename T>
std::vector<uint8_t> bin_bytes(const std::vector<std::vector<int64_t>>& docs) {
  std::vector<uint8_t> b;
  for (const auto& d : docs)
    for (int64_t v : d) put<T>(b, static_cast<T>(v));
  return b;
}

template <typename T> void write_by_hand(const std::string& prefix,
                                         const std::vector<std::vector<int64_t>>& docs,
                                         uint8_t code) {
  write_file(prefix + ".idx", idx_bytes(docs, code, sizeof(T)));
  write_file(prefix + ".bin", bin_bytes<T>(docs));
}

std::vector<int64_t> concat(const std::vector<std::vector<int64_t>>& docs) {
  std::vector<int64_t> all;
  for (const auto& d : docs) all.insert(all.end(), d.begin(), d.end());
  return all;
}

// Documents of varied length (one empty) with ids in [0, vocab).
std::vector<std::vector<int64_t>> make_docs(int64_t vocab, uint64_t salt) {
  std::vector<int64_t> lens = {7, 1, 0, 13, 5, 30, 2};
  std::vector<std::vector<int64_t>> docs;
  uint64_t x = 88172645463325252ull ^ salt;
  for (int64_t n : lens) {
    std::vector<int64_t> d;
    for (int64_t i = 0; i < n; ++i) {
      x ^= x << 13;
      x ^= x >> 7;
      x ^= x << 17;  // xorshift64
      d.push_back(static_cast<int64_t>(x % static_cast<uint64_t>(vocab)));
    }
    docs.push_back(d);
  }
  return docs;
}

// Every read of every span equals the plain concatenation.
void check_reads(const IndexedDataset& ds, const std::vector<int64_t>& all) {
  REQUIRE(ds.num_tokens() == static_cast<int64_t>(all.size()));
  std::vector<int32_t> out(all.size());
  for (int64_t start = 0; start < ds.num_tokens(); ++start) {
    for (int64_t count : {int64_t{1}, int64_t{3}, ds.num_tokens() - start}) {
      if (start + count > ds.num_tokens()) continue;
      ds.read(start, count, out.data());
      for (int64_t i = 0; i < count; ++i) REQUIRE(out[i] == all[start + i]);
    }
  }
}

std::string tools_dir() {
  // This file is tests/unit/test_data.cpp; the tool lives in tools/ at the repository root.
  return (std::filesystem::path(__FILE__).parent_path().parent_path().parent_path() / "tools")
      .string();
}

// A source whose sample i is (tag, i, i+1, ...): tells which sample landed where.
class CountingSource : public SampleSource {
 public:
  CountingSource(int64_t n, int64_t seq_len, int32_t tag) : n_(n), seq_len_(seq_len), tag_(tag) {}
  int64_t num_samples() const override { return n_; }
  int64_t seq_len() const override { return seq_len_; }
  void sample(int64_t i, int32_t* out) override {
    REQUIRE(i >= 0);
    REQUIRE(i < n_);
    out[0] = tag_;
    for (int64_t t = 1; t <= seq_len_; ++t) out[t] = static_cast<int32_t>(i + t - 1);
  }
  std::string describe() const override { return "counting"; }

 private:
  int64_t n_, seq_len_;
  int32_t tag_;
};

}  // namespace

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
TEST_CASE("IndexedSamples: windows of T+1 tokens across document boundaries", "[data]") {
  const auto docs = make_docs(500, 11);  // 58 tokens in 7 documents, one empty
  const std::string p = tmp_prefix("windows");
  write_by_hand<uint16_t>(p, docs, 8);
  const auto all = concat(docs);
  auto ds = std::make_shared<const IndexedDataset>(IndexedDataset::open(p));
  for (int64_t T : {1, 4, 8, 57}) {
    IndexedSamples s(ds, T, 500);
    REQUIRE(s.num_samples() == (static_cast<int64_t>(all.size()) - 1) / T);
    std::vector<int32_t> out(T + 1);
    for (int64_t i = 0; i < s.num_samples(); ++i) {
      s.sample(i, out.data());
      for (int64_t t = 0; t <= T; ++t) REQUIRE(out[t] == all[i * T + t]);
    }
  }
  // Too short for one sample: names the file, its token count and seq_len + 1.
  CHECK_THAT(input_error([&] { IndexedSamples s(ds, 58, 500); }),
             Contains(p) && Contains("58 tokens") && Contains("59"));
  // A token id outside the vocabulary.
  const int64_t max_id = *std::max_element(all.begin(), all.end());
  CHECK_NOTHROW(IndexedSamples(ds, 4, max_id + 1));
  CHECK_THAT(input_error([&] { IndexedSamples s(ds, 4, max_id); }),
             Contains(p + ".bin") && Contains(std::to_string(max_id)) && Contains("vocab_size"));
  // A negative id (signed storage).
  const std::string neg = tmp_prefix("negative");
  write_by_hand<int16_t>(neg, {{1, 2, -3, 4}}, 3);
  auto nds = std::make_shared<const IndexedDataset>(IndexedDataset::open(neg));
  CHECK_THAT(input_error([&] { IndexedSamples s(nds, 2, 10); }), Contains(neg) && Contains("-3"));
}

TEST_CASE("SyntheticSamples: deterministic, learnable to ln 4", "[data]") {
  const int64_t V = 64, T = 256;
  SyntheticSamples a(V, T, 42), b(V, T, 42), other_seed(V, T, 43), valid(V, T, 42, 1);
  std::vector<int32_t> x(T + 1), y(T + 1);
  for (int64_t i : {int64_t{0}, int64_t{1}, int64_t{12345}, (int64_t{1} << 40) - 1}) {
    a.sample(i, x.data());
    b.sample(i, y.data());
    CHECK(x == y);  // a pure function of (seed, i)
    other_seed.sample(i, y.data());
    CHECK(x != y);
    valid.sample(i, y.data());
    CHECK(x != y);  // validation stream: other samples ...
  }
  // ... of the same language: identical successor table. Every token has 4 distinct successors.
  for (int32_t t = 0; t < V; ++t) {
    std::set<int32_t> s(a.successors(t), a.successors(t) + 4);
    CHECK(s.size() == 4);
    CHECK(std::equal(a.successors(t), a.successors(t) + 4, valid.successors(t)));
    for (int32_t n : s) CHECK((n >= 0 && n < V));
  }

  // Empirical conditional entropy H(next | prev) over 2000 samples (512k transitions, ~8000 per
  // context). The plug-in estimator is biased low by about (4-1)/(2*8000) = 2e-4 nats and its
  // noise is ~1e-3, so 5e-3 is a tolerance that still catches any non-uniform choice (a 3-way or
  // 0.3/0.3/0.2/0.2 split is off by >= 0.03).
  std::map<std::pair<int32_t, int32_t>, int64_t> pair_count;
  std::vector<int64_t> prev_count(V, 0);
  int64_t total = 0;
  for (int64_t i = 0; i < 2000; ++i) {
    valid.sample(i, x.data());
    for (int64_t t = 1; t <= T; ++t) {
      const int32_t* succ = a.successors(x[t - 1]);
      REQUIRE(std::find(succ, succ + 4, x[t]) != succ + 4);  // every step follows the table
      ++pair_count[{x[t - 1], x[t]}];
      ++prev_count[x[t - 1]];
      ++total;
    }
  }
  double h = 0.0;
  for (const auto& [k, n] : pair_count) {
    const double p_joint = static_cast<double>(n) / total;
    const double p_cond = static_cast<double>(n) / prev_count[k.first];
    h -= p_joint * std::log(p_cond);
  }
  CHECK(h == Approx(SyntheticSamples::kEntropyNats).margin(5e-3));
  CHECK(SyntheticSamples::kEntropyNats == Approx(std::log(4.0)).epsilon(1e-15));
}

TEST_CASE("ShuffledSamples: a deterministic permutation per epoch, uniform", "[data]") {
  const int64_t n = 1000;
  auto src = std::make_shared<CountingSource>(n, 2, 0);
  ShuffledSamples s(src, 7), same(src, 7), other(src, 8);
  std::vector<int64_t> e0, e1, e0_same, e0_other;
  for (int64_t g = 0; g < n; ++g) {
    e0.push_back(s.source_index(g));
    e0_other.push_back(other.source_index(g));
  }
  for (int64_t g = 0; g < n; ++g) e0_same.push_back(same.source_index(g));
  for (int64_t g = n; g < 2 * n; ++g) e1.push_back(s.source_index(g));
  std::vector<int64_t> sorted0 = e0, sorted1 = e1, iota(n);
  std::iota(iota.begin(), iota.end(), 0);
  std::sort(sorted0.begin(), sorted0.end());
  std::sort(sorted1.begin(), sorted1.end());
  CHECK(sorted0 == iota);  // a permutation
  CHECK(sorted1 == iota);
  CHECK(e0 == e0_same);   // deterministic per seed
  CHECK(e0 != e0_other);  // other seed, other order
  CHECK(e0 != e1);        // other epoch, other order
  CHECK(e0 != iota);
  // Going back to epoch 0 after epoch 1 gives epoch 0's order again (the cache is rebuilt).
  for (int64_t g = 0; g < n; ++g) REQUIRE(s.source_index(g) == e0[g]);
  // sample(g) is the source's sample source_index(g).
  std::vector<int32_t> out(3);
  s.sample(2 * n + 5, out.data());
  CHECK(out[1] == s.source_index(2 * n + 5));

  // Uniformity: n = 4 over 24000 epochs; each of the 24 permutations should appear ~1000 times.
  // Chi-square with 23 degrees of freedom: 70 is far beyond p = 1e-6 (about 61), while a
  // Fisher-Yates off-by-one (Sattolo's cycles only, or u in [0, n)) scores in the thousands.
  auto small = std::make_shared<CountingSource>(4, 2, 0);
  ShuffledSamples sh(small, 99);
  std::map<std::vector<int64_t>, int64_t> seen;
  const int64_t epochs = 24000;
  for (int64_t e = 0; e < epochs; ++e) {
    std::vector<int64_t> perm;
    for (int64_t j = 0; j < 4; ++j) perm.push_back(sh.source_index(e * 4 + j));
    ++seen[perm];
  }
  CHECK(seen.size() == 24);
  double chi2 = 0.0;
  for (const auto& [perm, count] : seen) chi2 += std::pow(count - 1000.0, 2) / 1000.0;
  chi2 += (24 - static_cast<double>(seen.size())) * 1000.0;  // permutations never seen
  CHECK(chi2 < 70.0);

  // Across batches of the prefetching loop (n = 600 > 256): where do the first and last source
  // samples land? 6 position buckets of 100, 3000 epochs: ~500 per bucket. Chi-square with 5
  // degrees of freedom: 30 is beyond p = 2e-5; a shuffle that leaves the ends in place or moves
  // them only within a batch scores in the hundreds.
  auto mid = std::make_shared<CountingSource>(600, 2, 0);
  ShuffledSamples sm(mid, 3);
  for (int64_t tracked : {int64_t{0}, int64_t{599}}) {
    std::vector<double> bucket(6, 0.0);
    for (int64_t e = 0; e < 3000; ++e)
      for (int64_t j = 0; j < 600; ++j)
        if (sm.source_index(e * 600 + j) == tracked) bucket[j / 100] += 1.0;
    double c2 = 0.0;
    for (double b : bucket) c2 += (b - 500.0) * (b - 500.0) / 500.0;
    CHECK(c2 < 30.0);
  }
}

TEST_CASE("BlendedSamples: Megatron's greedy blend, exact to one sample at every prefix",
          "[data]") {
  // Equal weights tie at once: ties must go to the lowest source, as in Megatron.
  const std::vector<std::vector<double>> weight_sets = {
      {0.5, 0.3, 0.2}, {3.0, 1.0, 7.0, 0.5}, {1.0}, {1.0, 1.0, 2.0}};
  for (const auto& raw : weight_sets) {
    const size_t S = raw.size();
    std::vector<std::shared_ptr<SampleSource>> sources;
    for (size_t i = 0; i < S; ++i)
      sources.push_back(std::make_shared<CountingSource>(100 + 37 * static_cast<int64_t>(i), 3,
                                                         static_cast<int32_t>(i)));
    const int64_t total = 5 * BlendedSamples::kChunk + 123;
    BlendedSamples blend(sources, raw, total);
    const double sum = std::accumulate(raw.begin(), raw.end(), 0.0);
    for (size_t i = 0; i < S; ++i) CHECK(blend.weights()[i] == Approx(raw[i] / sum));

    // Reference: the plain greedy, written out again.
    std::vector<int64_t> counts(S, 0);
    std::vector<std::pair<int32_t, int64_t>> expect;
    for (int64_t k = 0; k < total; ++k) {
      size_t best = 0;
      double best_err = -1e300;
      for (size_t i = 0; i < S; ++i) {
        const double err = raw[i] / sum * (k + 1) - counts[i];
        if (err > best_err) best_err = err, best = i;
      }
      expect.push_back({static_cast<int32_t>(best), counts[best] % sources[best]->num_samples()});
      ++counts[best];
      // Every prefix of k+1 samples: each source within one sample of its share.
      for (size_t i = 0; i < S; ++i) REQUIRE(std::abs(counts[i] - raw[i] / sum * (k + 1)) <= 1.0);
    }
    // In order, then in a scattered order (chunks replayed out of order).
    for (int64_t k = 0; k < total; ++k) REQUIRE(blend.locate(k) == expect[k]);
    for (int64_t k = total - 1; k >= 0; k -= 97) REQUIRE(blend.locate(k) == expect[k]);
    // sample() reads that source's sample.
    std::vector<int32_t> out(4);
    for (int64_t k : {int64_t{0}, int64_t{1500}, total - 1}) {
      blend.sample(k, out.data());
      CHECK(out[0] == expect[k].first);
      CHECK(out[1] == expect[k].second);
    }
  }
  // Weights must be positive.
  std::vector<std::shared_ptr<SampleSource>> two = {std::make_shared<CountingSource>(5, 3, 0),
                                                    std::make_shared<CountingSource>(5, 3, 1)};
  CHECK_THAT(input_error([&] { BlendedSamples b(two, {1.0, 0.0}, 10); }), Contains("weight 0"));
}

// =============================================================================================
// Loader and factory
// =============================================================================================
TEST_CASE("DataLoader: the samples of a step do not depend on dp; resume continues exactly",
          "[data]") {
  const int64_t T = 3, global = 8;
  auto src = std::make_shared<CountingSource>(1000, T, 0);
  std::vector<std::set<int64_t>> per_step_dp1;
  for (int64_t dp : {1, 2, 4}) {
    const int64_t mbs = global / dp;
    std::vector<DataLoader> loaders;
    for (int64_t r = 0; r < dp; ++r) loaders.emplace_back(src, T, mbs, r, dp);
    std::vector<int32_t> tokens(mbs * (T + 1));
    for (int64_t step = 0; step < 5; ++step) {
      std::set<int64_t> step_samples;
      for (int64_t r = 0; r < dp; ++r) {
        loaders[r].next(tokens.data());
        for (int64_t b = 0; b < mbs; ++b) {
          const int64_t id = tokens[b * (T + 1) + 1];
          REQUIRE(id == step * global + r * mbs + b);  // Megatron's order
          step_samples.insert(id);
        }
        CHECK(loaders[r].consumed_samples() == (step + 1) * global);
      }
      CHECK(step_samples.size() == static_cast<size_t>(global));
      if (dp == 1)
        per_step_dp1.push_back(step_samples);
      else
        CHECK(step_samples == per_step_dp1[step]);
    }
  }
  // Resume: a fresh loader set to the consumed count reads what the running one reads next.
  DataLoader running(src, T, 2, 1, 2), resumed(src, T, 2, 1, 2);
  std::vector<int32_t> a(2 * (T + 1)), b(2 * (T + 1));
  for (int i = 0; i < 3; ++i) running.next(a.data());
  resumed.set_consumed_samples(running.consumed_samples());
  running.next(a.data());
  resumed.next(b.data());
  CHECK(a == b);
}

TEST_CASE("make_train_source / make_valid_source build the configured stack", "[data]") {
  Config cfg;
  cfg.model.vocab_size = 300;
  cfg.model.seq_len = 4;
  cfg.training.seed = 5;
  std::vector<int32_t> x(5), y(5);

  SECTION("synthetic: train and valid share the language, not the samples") {
    cfg.data.synthetic = true;
    auto train = make_train_source(cfg, 100), valid = make_valid_source(cfg, 100);
    REQUIRE(train != nullptr);
    REQUIRE(valid != nullptr);
    CHECK(train->seq_len() == 4);
    CHECK(train->num_samples() == int64_t{1} << 40);
    auto* st = dynamic_cast<SyntheticSamples*>(train.get());
    auto* sv = dynamic_cast<SyntheticSamples*>(valid.get());
    REQUIRE(st != nullptr);
    REQUIRE(sv != nullptr);
    for (int32_t t = 0; t < 300; ++t)
      REQUIRE(std::equal(st->successors(t), st->successors(t) + 4, sv->successors(t)));
    int64_t same = 0;
    for (int64_t i = 0; i < 50; ++i) {
      train->sample(i, x.data());
      valid->sample(i, y.data());
      same += x == y;
    }
    CHECK(same == 0);
  }
  SECTION("datasets: blended, shuffled, every sample a window of one of them") {
    std::vector<std::vector<int64_t>> windows_a, windows_b;
    const auto docs_a = make_docs(300, 1), docs_b = make_docs(300, 2);
    const std::string pa = tmp_prefix("factory_a"), pb = tmp_prefix("factory_b");
    write_by_hand<uint16_t>(pa, docs_a, 8);
    write_by_hand<uint16_t>(pb, docs_b, 8);
    std::set<std::vector<int32_t>> windows;
    for (const auto& all : {concat(docs_a), concat(docs_b)})
      for (size_t i = 0; (i + 1) * 4 < all.size(); ++i)
        windows.insert(std::vector<int32_t>(all.begin() + i * 4, all.begin() + i * 4 + 5));
    cfg.data.train = {{pa, 1.0}, {pb, 3.0}};
    auto train = make_train_source(cfg, 400);
    REQUIRE(dynamic_cast<ShuffledSamples*>(train.get()) != nullptr);
    CHECK(train->num_samples() == 400);
    for (int64_t g = 0; g < 800; ++g) {  // two epochs of the blend
      train->sample(g, x.data());
      REQUIRE(windows.count(x) == 1);
    }
    CHECK(make_valid_source(cfg, 400) == nullptr);  // no data.valid
    cfg.data.valid = {{pa, 1.0}};
    auto valid = make_valid_source(cfg, 400);
    REQUIRE(valid != nullptr);
    CHECK(valid->num_samples() == 14);  // (58 - 1) / 4 windows of dataset a alone
    // A bad entry names its place in the config.
    cfg.data.train = {{pa, 1.0}, {tmp_dir() + "/missing", 1.0}};
    CHECK_THAT(input_error([&] { make_train_source(cfg, 400); }),
               Contains("data.train[1]") && Contains(tmp_dir() + "/missing.idx"));
    cfg.data.train.clear();
    CHECK_THAT(input_error([&] { make_train_source(cfg, 400); }), Contains("data.train is empty"));
  }
}
