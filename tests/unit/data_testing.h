// Helpers shared by the data tests: temporary paths, hand-built Megatron index files, documents.
#pragma once

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
#include "kernels/common/check.h"
#include "trainer/data/data_loader.h"
#include "trainer/data/indexed_dataset.h"
#include "trainer/data/sample_source.h"

namespace tetra::data_testing {

using namespace tetra;
using Catch::Matchers::Contains;


inline std::string tmp_dir() {
  static const std::string dir = [] {
    std::string d = std::string(TETRA_TEST_TMPDIR) + "/data";
    std::filesystem::create_directories(d);
    return d;
  }();
  return dir;
}

inline std::string tmp_prefix(const std::string& name) {
  const std::string p = tmp_dir() + "/" + name;
  for (const char* ext : {".bin", ".idx", ".bin.tmp", ".idx.tmp"}) std::remove((p + ext).c_str());
  return p;
}

// The message of the InputError `f` throws; fails the test if it throws nothing or another type.
inline std::string input_error(const std::function<void()>& f) {
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
inline void put_bytes(std::vector<uint8_t>& b, const void* p, size_t n) {
  const auto* c = static_cast<const uint8_t*>(p);
  b.insert(b.end(), c, c + n);
}
template <typename T> void put(std::vector<uint8_t>& b, T v) { put_bytes(b, &v, sizeof(T)); }

inline void write_file(const std::string& path, const std::vector<uint8_t>& bytes) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
}

inline std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<uint8_t>(std::istreambuf_iterator<char>(f), {});
}

// .idx bytes for `docs` (one sequence each) with element size `elem` and type code `code`.
inline std::vector<uint8_t> idx_bytes(const std::vector<std::vector<int64_t>>& docs, uint8_t code,
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
inline std::vector<uint8_t> bin_bytes(const std::vector<std::vector<int64_t>>& docs) {
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

inline std::vector<int64_t> concat(const std::vector<std::vector<int64_t>>& docs) {
  std::vector<int64_t> all;
  for (const auto& d : docs) all.insert(all.end(), d.begin(), d.end());
  return all;
}

// Documents of varied length (one empty) with ids in [0, vocab).
inline std::vector<std::vector<int64_t>> make_docs(int64_t vocab, uint64_t salt) {
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
inline void check_reads(const IndexedDataset& ds, const std::vector<int64_t>& all) {
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

inline std::string tools_dir() {
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


}  // namespace tetra::data_testing
