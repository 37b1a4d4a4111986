// Dataset preparation (trainer/data/prepare*.h): text and JSONL documents tokenized into an indexed
// dataset and read back, thread-count independence, the split, every bad input (message and no
// dataset left behind), UTF-8 validation, and llm.c shards written here by the format's rules.
//
// The tokenizer is a stand-in that maps byte b to id b, so the expected tokens of any text are
// its bytes: the reference needs no tokenizer at all.
#include <span>
#include <string_view>

#include <nlohmann/json.hpp>

#include "tests/unit/data_testing.h"
#include "trainer/data/prepare.h"
#include "trainer/data/prepare_llmc.h"
#include "trainer/data/tokenizer.h"

using namespace tetra;
using namespace tetra::data_testing;
using Catch::Matchers::Contains;

namespace {

namespace fs = std::filesystem;

// Byte b -> id b; the end-of-document id is `eod` (vocab must exceed 256 and eod).
class ByteTokenizer : public Tokenizer {
 public:
  explicit ByteTokenizer(int64_t vocab = 257, int32_t eod = 256) : vocab_(vocab), eod_(eod) {}
  std::string name() const override { return "bytes"; }
  int64_t vocab_size() const override { return vocab_; }
  int32_t eod_id() const override { return eod_; }
  void encode(std::string_view text, std::vector<int32_t>& out) const override {
    for (char c : text) out.push_back(static_cast<uint8_t>(c));
  }
  std::string decode(std::span<const int32_t> ids) const override {
    std::string s;
    for (int32_t id : ids)
      if (id < 256) s += static_cast<char>(id);
    return s;
  }

 private:
  int64_t vocab_;
  int32_t eod_;
};

std::string fresh_dir(const std::string& name) {
  const std::string d = tmp_dir() + "/prepare/" + name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d;
}

void write_text(const std::string& path, std::string_view text) {
  fs::create_directories(fs::path(path).parent_path());
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(text.data(), static_cast<std::streamsize>(text.size()));
  REQUIRE(f.good());
}

// The documents of a dataset, one vector per sequence.
std::vector<std::vector<int32_t>> read_docs(const std::string& prefix) {
  const IndexedDataset ds = IndexedDataset::open(prefix);
  std::vector<std::vector<int32_t>> docs;
  for (int64_t i = 0; i < ds.num_sequences(); ++i) {
    std::vector<int32_t> d(static_cast<size_t>(ds.sequence_length(i)));
    ds.read(ds.sequence_offset(i), ds.sequence_length(i), d.data());
    docs.push_back(d);
  }
  return docs;
}

// What the byte tokenizer must give for `text`: its bytes, then the end-of-document id.
std::vector<int32_t> doc_of(std::string_view text, int32_t eod = 256) {
  std::vector<int32_t> d;
  for (char c : text) d.push_back(static_cast<uint8_t>(c));
  d.push_back(eod);
  return d;
}

bool no_dataset_at(const std::string& prefix) {
  for (const char* ext : {".bin", ".idx", ".bin.tmp", ".idx.tmp"})
    if (fs::exists(prefix + ext)) return false;
  return true;
}

TokenizeOptions options(std::vector<std::string> inputs, std::string output,
                        DocumentFormat format = DocumentFormat::TEXT, int threads = 2) {
  TokenizeOptions o;
  o.inputs = std::move(inputs);
  o.output_prefix = std::move(output);
  o.format = format;
  o.threads = threads;
  return o;
}

// The InputError of a tokenize run; checks that nothing is left at the output prefix(es).
std::string tokenize_error(const TokenizeOptions& o, const Tokenizer& t = ByteTokenizer()) {
  const std::string msg = input_error([&] { tokenize_to_dataset(t, o); });
  CHECK(no_dataset_at(o.output_prefix));
  if (!o.split.empty())
    for (const std::string& p : split_prefixes(o.output_prefix, o.split.size()))
      CHECK(no_dataset_at(p));
  return msg;
}

// Deterministic pseudo-random ASCII text of `n` bytes (letters, spaces, newlines).
std::string some_text(uint64_t seed, size_t n) {
  std::string s;
  uint64_t x = 0x9E3779B97F4A7C15ull ^ (seed * 0xBF58476D1CE4E5B9ull + 1);
  for (size_t i = 0; i < n; ++i) {
    x ^= x << 13;
    x ^= x >> 7;
    x ^= x << 17;
    const uint64_t r = x % 40;
    s += r < 26 ? static_cast<char>('a' + r) : (r < 38 ? ' ' : '\n');
  }
  return s;
}

}  // namespace

// =============================================================================================
// Documents in, dataset out
// =============================================================================================
TEST_CASE("prepare: text files are one document each, in listed order, each ending in EOD",
          "[data][prepare]") {
  const std::string dir = fresh_dir("text");
  const std::string extra = dir + "/extra.txt", corpus = dir + "/corpus";
  write_text(extra, "first given\n");
  write_text(corpus + "/b.txt", "beta\nsecond line\n");
  write_text(corpus + "/a.txt", "alpha");
  write_text(corpus + "/sub/c.txt", "gamma \xCE\xB3 \xE2\x98\x83\n");  // "gamma γ ☃"
  write_text(corpus + "/.hidden", "never read");
  write_text(corpus + "/.git/config", "never read");
  // Files in the order given, a directory's files sorted by path, hidden names skipped.
  const std::vector<std::string> texts = {"first given\n", "alpha", "beta\nsecond line\n",
                                          "gamma \xCE\xB3 \xE2\x98\x83\n"};

  const std::string out = dir + "/out";
  const PrepareSummary s = tokenize_to_dataset(ByteTokenizer(), options({extra, corpus}, out));
  CHECK_FALSE(fs::exists(out + ".bin.tmp"));
  CHECK_FALSE(fs::exists(out + ".idx.tmp"));
  const auto docs = read_docs(out);
  REQUIRE(docs.size() == texts.size());
  int64_t bytes = 0, tokens = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    CHECK(docs[i] == doc_of(texts[i]));
    bytes += static_cast<int64_t>(texts[i].size());
    tokens += static_cast<int64_t>(texts[i].size()) + 1;
  }
  CHECK(IndexedDataset::open(out).dtype() == IndexedDType::U16);
  CHECK(IndexedDataset::open(out).num_documents() == 4);
  CHECK(s.files == 4);
  CHECK(s.documents == 4);
  CHECK(s.tokens == tokens);
  CHECK(s.text_bytes == bytes);
  CHECK(s.input_bytes == bytes);      // text files: the file is the text
  CHECK(s.tokens_per_byte() == 1.0);  // one id per byte, EOD not counted
  CHECK(s.dtype == "uint16");
  REQUIRE(s.datasets.size() == 1);
  CHECK(s.datasets[0].prefix == out);
  CHECK(s.datasets[0].documents == 4);
  CHECK(s.datasets[0].tokens == tokens);
}

TEST_CASE("prepare: JSONL lines are one document each: escapes, CRLF, blank lines, other key",
          "[data][prepare]") {
  const std::string dir = fresh_dir("jsonl");
  const std::string in = dir + "/docs.jsonl";
  write_text(in,
             "{\"text\": \"first\", \"id\": 1}\n"
             "\n"                                                       // blank: skipped
             "{\"id\": 2, \"text\": \"caf\\u00e9 \xE2\x98\x83\\n\"}\n"  // escape and raw UTF-8
             "{\"text\": \"\"}\n"  // empty text: a document of EOD
             "{\"text\": \"crlf\"}\r\n"
             "   \t\n"  // whitespace only: skipped
             "{\"text\": \"no newline at the end\", \"body\": \"b\"}");
  const std::vector<std::string> texts = {"first", "caf\xC3\xA9 \xE2\x98\x83\n", "", "crlf",
                                          "no newline at the end"};
  const std::string out = dir + "/out";
  const PrepareSummary s =
      tokenize_to_dataset(ByteTokenizer(), options({in}, out, DocumentFormat::JSONL));
  const auto docs = read_docs(out);
  REQUIRE(docs.size() == texts.size());
  for (size_t i = 0; i < texts.size(); ++i) CHECK(docs[i] == doc_of(texts[i]));
  int64_t bytes = 0;
  for (const auto& t : texts) bytes += static_cast<int64_t>(t.size());
  CHECK(s.text_bytes == bytes);
  CHECK(s.input_bytes == static_cast<int64_t>(fs::file_size(in)));
  CHECK(s.documents == 5);

  // Another field, read from every line that has it.
  const std::string in2 = dir + "/body.jsonl";
  write_text(in2, "{\"body\": \"one\"}\n{\"body\": \"two\", \"text\": 5}\n");
  TokenizeOptions o = options({in2}, dir + "/body", DocumentFormat::JSONL, 1);
  o.json_key = "body";
  tokenize_to_dataset(ByteTokenizer(), o);
  CHECK(read_docs(dir + "/body") ==
        std::vector<std::vector<int32_t>>{doc_of("one"), doc_of("two")});
}

TEST_CASE("prepare: the files do not depend on the thread count, and a large vocab gives int32",
          "[data][prepare]") {
  const std::string dir = fresh_dir("threads");
  // 3000 lines of 0..600 bytes: with 1 thread 12 batches of 256 documents, so batches, the pool
  // and the in-order write are all exercised.
  std::string jsonl;
  std::vector<std::string> texts;
  for (uint64_t i = 0; i < 3000; ++i) {
    texts.push_back(some_text(i, (i * 7919) % 601));
    jsonl += nlohmann::json{{"text", texts.back()}}.dump() + "\n";
  }
  write_text(dir + "/in.jsonl", jsonl);

  for (const bool big_vocab : {false, true}) {
    // vocab 70000 does not fit uint16: the dataset must be int32 and keep EOD 69999 intact.
    const ByteTokenizer tok = big_vocab ? ByteTokenizer(70000, 69999) : ByteTokenizer();
    std::vector<uint8_t> bin1, idx1;
    for (const int threads : {1, 2, 3, 8}) {
      const std::string out = dir + fmt::format("/out_{}_{}", big_vocab, threads);
      tokenize_to_dataset(tok, options({dir + "/in.jsonl"}, out, DocumentFormat::JSONL, threads));
      if (threads == 1) {
        const auto docs = read_docs(out);
        REQUIRE(docs.size() == texts.size());
        for (size_t i = 0; i < texts.size(); ++i)
          REQUIRE(docs[i] == doc_of(texts[i], tok.eod_id()));
        CHECK(IndexedDataset::open(out).dtype() ==
              (big_vocab ? IndexedDType::I32 : IndexedDType::U16));
        bin1 = read_file(out + ".bin");
        idx1 = read_file(out + ".idx");
      } else {
        CHECK(read_file(out + ".bin") == bin1);
        CHECK(read_file(out + ".idx") == idx1);
      }
    }
  }
}

TEST_CASE("prepare: progress reports grow to the total and end with one final call",
          "[data][prepare]") {
  const std::string dir = fresh_dir("progress");
  for (int i = 0; i < 40; ++i)
    write_text(dir + fmt::format("/in/{:02}.txt", i), some_text(i, 5000));
  TokenizeOptions o = options({dir + "/in"}, dir + "/out", DocumentFormat::TEXT, 1);
  o.progress_interval_s = 0.0;  // every batch
  std::vector<PrepareProgress> calls;
  o.progress = [&](const PrepareProgress& p) { calls.push_back(p); };
  const PrepareSummary s = tokenize_to_dataset(ByteTokenizer(), o);
  REQUIRE(calls.size() >= 2);
  for (size_t i = 0; i < calls.size(); ++i) {
    CHECK(calls[i].bytes_total == 40 * 5000);
    CHECK(calls[i].done == (i + 1 == calls.size()));
    if (i > 0) {
      CHECK(calls[i].bytes_done >= calls[i - 1].bytes_done);
      CHECK(calls[i].documents >= calls[i - 1].documents);
      CHECK(calls[i].seconds >= calls[i - 1].seconds);
    }
  }
  CHECK(calls.back().bytes_done == 40 * 5000);
  CHECK(calls.back().documents == s.documents);
  CHECK(calls.back().tokens == s.tokens);
}

// =============================================================================================
// Split
// =============================================================================================
TEST_CASE("prepare: the splitter deals exact shares in a fixed, even pattern", "[data][prepare]") {
  // Weights 3,1 by hand: credits (3,1) -> train (-1,1); (2,2) tie -> train (-2,2);
  // (1,3) -> valid (1,-1); (4,0) -> train (0,0): the pattern T T V T repeats.
  DocumentSplitter s31({3, 1});
  for (int rep = 0; rep < 5; ++rep)
    for (size_t want : {0u, 0u, 1u, 0u}) CHECK(s31.next() == want);

  for (const std::vector<int64_t>& w :
       {std::vector<int64_t>{98, 2}, std::vector<int64_t>{949, 50, 1}, std::vector<int64_t>{1, 1},
        std::vector<int64_t>{7, 5, 3}}) {
    DocumentSplitter s(w);
    const int64_t total = std::accumulate(w.begin(), w.end(), int64_t{0});
    std::vector<int64_t> count(w.size(), 0);
    for (int64_t i = 1; i <= 3 * total; ++i) {
      const size_t part = s.next();
      REQUIRE(part < w.size());
      ++count[part];
      // Never more than one document away from the exact share, at any point.
      for (size_t k = 0; k < w.size(); ++k)
        REQUIRE(std::abs(static_cast<double>(count[k]) -
                         static_cast<double>(i * w[k]) / static_cast<double>(total)) < 1.0 + 1e-9);
      if (i % total == 0)
        for (size_t k = 0; k < w.size(); ++k) REQUIRE(count[k] == w[k] * (i / total));
    }
  }

  CHECK(parse_split("98,2") == std::vector<int64_t>{98, 2});
  CHECK(parse_split("949,50,1") == std::vector<int64_t>{949, 50, 1});
  for (const char* bad :
       {"", "98", "98,0", "a,b", "1,2,3,4", "98,,2", "-1,2", "98,2,", "0.98,0.02"})
    CHECK_THAT(input_error([&] { parse_split(bad); }), Contains("--split"));
}

TEST_CASE("prepare: --split writes train and valid datasets by document", "[data][prepare]") {
  const std::string dir = fresh_dir("split");
  std::string jsonl;
  std::vector<std::string> texts;
  for (int i = 0; i < 8; ++i) {
    texts.push_back(fmt::format("document number {}", i));
    jsonl += nlohmann::json{{"text", texts.back()}}.dump() + "\n";
  }
  write_text(dir + "/in.jsonl", jsonl);
  for (const int threads : {1, 3}) {
    const std::string out = dir + fmt::format("/out{}", threads);
    TokenizeOptions o = options({dir + "/in.jsonl"}, out, DocumentFormat::JSONL, threads);
    o.split = {3, 1};
    const PrepareSummary s = tokenize_to_dataset(ByteTokenizer(), o);
    CHECK(no_dataset_at(out));  // only the parts are written
    // T T V T T T V T (the splitter test derives the pattern by hand).
    const std::vector<std::vector<int32_t>> train = {doc_of(texts[0]), doc_of(texts[1]),
                                                     doc_of(texts[3]), doc_of(texts[4]),
                                                     doc_of(texts[5]), doc_of(texts[7])};
    const std::vector<std::vector<int32_t>> valid = {doc_of(texts[2]), doc_of(texts[6])};
    CHECK(read_docs(out + "_train") == train);
    CHECK(read_docs(out + "_valid") == valid);
    REQUIRE(s.datasets.size() == 2);
    CHECK(s.datasets[0].prefix == out + "_train");
    CHECK(s.datasets[0].documents == 6);
    CHECK(s.datasets[1].documents == 2);
    CHECK(s.datasets[0].tokens + s.datasets[1].tokens == s.tokens);
  }

  // Three documents at 98,2: the valid part would be empty, so nothing is written at all.
  write_text(dir + "/three.jsonl", "{\"text\":\"a\"}\n{\"text\":\"b\"}\n{\"text\":\"c\"}\n");
  TokenizeOptions o = options({dir + "/three.jsonl"}, dir + "/small", DocumentFormat::JSONL);
  o.split = {98, 2};
  const std::string msg = tokenize_error(o);
  CHECK_THAT(msg, Contains("valid part got none of the 3 documents"));

  // A directory holding the valid part's name is refused before anything is written (the
  // train part included): a run leaves all of its datasets or none.
  const std::string late = dir + "/late";
  fs::create_directories(late + "_valid.bin/occupied");
  o = options({dir + "/in.jsonl"}, late, DocumentFormat::JSONL);
  o.split = {3, 1};
  CHECK_THAT(input_error([&] { tokenize_to_dataset(ByteTokenizer(), o); }),
             Contains("late_valid.bin: is a directory; give a file name"));
  CHECK(no_dataset_at(late + "_train"));
  for (const char* ext : {".idx", ".bin.tmp", ".idx.tmp"})
    CHECK_FALSE(fs::exists(late + "_valid" + ext));
}

// =============================================================================================
// Bad input: the message names file and line; nothing is left at the output prefix
// =============================================================================================
TEST_CASE("prepare: bad input is an InputError naming file and line, leaving no dataset",
          "[data][prepare]") {
  const std::string dir = fresh_dir("bad");
  const std::string out = dir + "/out";
  const auto text_error = [&](const std::string& name, std::string_view content) {
    write_text(dir + "/" + name, content);
    return tokenize_error(options({dir + "/good.txt", dir + "/" + name}, out));
  };
  const auto jsonl_error = [&](const std::string& name, std::string_view content) {
    write_text(dir + "/" + name, content);
    return tokenize_error(options({dir + "/" + name}, out, DocumentFormat::JSONL));
  };
  write_text(dir + "/good.txt", "a good document\n");

  SECTION("invalid UTF-8 in a text file: line, byte offset, column, the bytes") {
    // "good line\n" is 10 bytes, "second " 7: the 0xFF is byte 17, line 2, column 8.
    const std::string msg = text_error("bad.txt", "good line\nsecond \xFF line\n");
    CHECK_THAT(msg, Contains("bad.txt:2: invalid UTF-8 at byte 17"));
    CHECK_THAT(msg, Contains("column 8"));
    CHECK_THAT(msg, Contains("0xFF"));
  }
  SECTION("a multi-byte character cut short at the end of a file") {
    CHECK_THAT(text_error("cut.txt", "abc\xE2\x82"),
               Contains("cut.txt:1: invalid UTF-8 at byte 3"));
  }
  SECTION("an empty text file") {
    CHECK_THAT(text_error("empty.txt", ""), Contains("empty.txt: the file is empty"));
  }
  SECTION("invalid UTF-8 inside a JSON line: the byte offset counts from the file's start") {
    // Lines 1 and 2 are 13 bytes each; the overlong 0xC0 0xAF sits 9 bytes into line 3.
    const std::string msg =
        jsonl_error("bad.jsonl", "{\"text\":\"a\"}\n{\"text\":\"b\"}\n{\"text\":\"\xC0\xAF\"}\n");
    CHECK_THAT(msg, Contains("bad.jsonl:3: invalid UTF-8 at byte 35"));
    CHECK_THAT(msg, Contains("0xC0"));
  }
  SECTION("an empty JSONL file, and one of blank lines only") {
    CHECK_THAT(jsonl_error("empty.jsonl", ""), Contains("empty.jsonl: the file is empty"));
    CHECK_THAT(jsonl_error("blank.jsonl", "\n  \n\n"), Contains("blank.jsonl: the file is empty"));
  }
  SECTION("a line that is not JSON") {
    const std::string msg = jsonl_error("notjson.jsonl", "{\"text\": \"a\"}\n{\"text\": \"b\"\n");
    // Line 2 is 12 bytes long: the parser runs out of input at column 13.
    CHECK_THAT(msg, Contains("notjson.jsonl:2:13: the line is not JSON (syntax error"));
    CHECK_THAT(msg, !Contains("json.exception"));
  }
  SECTION("a number too large for a double: file, line and the number's column") {
    // nlohmann throws out_of_range.406 for these, with no position: mapped to an InputError.
    std::string msg = jsonl_error("huge.jsonl", "{\"text\": \"ok\"}\n{\"text\": \"a\", \"x\": 1e999}\n");
    CHECK_THAT(msg, Contains("huge.jsonl:2:20: the number 1e999 is too large for a double"));
    CHECK_THAT(msg, !Contains("json.exception"));
    msg = jsonl_error("huge_text.jsonl", "  {\"text\": -1e400}\n");
    CHECK_THAT(msg, Contains("huge_text.jsonl:1:12: the number -1e400 is too large"));
    std::string digits(400, '9');
    msg = jsonl_error("digits.jsonl", "{\"text\": \"a\", \"n\": [1, " + digits + "]}\n");
    CHECK_THAT(msg, Contains("digits.jsonl:1:24: the number 999"));
  }
  SECTION("a line without the text field lists the fields it has") {
    const std::string msg = jsonl_error("nokey.jsonl", "{\"body\": \"x\", \"id\": 3}\n");
    CHECK_THAT(msg, Contains("nokey.jsonl:1: the object has no \"text\" field"));
    CHECK_THAT(msg, Contains("\"body\""));
    CHECK_THAT(msg, Contains("--json-key"));
  }
  SECTION("a text field that is not a string") {
    const std::string msg = jsonl_error("num.jsonl", "{\"text\": \"ok\"}\n{\"text\": 42}\n");
    CHECK_THAT(msg, Contains("num.jsonl:2: field \"text\" is a JSON number, not a string"));
  }
  SECTION("a line that is JSON but not an object") {
    CHECK_THAT(jsonl_error("array.jsonl", "[\"text\", \"a\"]\n"),
               Contains("array.jsonl:1: the line is a JSON array, not an object"));
  }
  SECTION("inputs that do not exist, an empty directory") {
    CHECK_THAT(tokenize_error(options({dir + "/nowhere.txt"}, out)),
               Contains("nowhere.txt does not exist"));
    fs::create_directories(dir + "/nothing");
    CHECK_THAT(tokenize_error(options({dir + "/nothing"}, out)), Contains("holds no files"));
  }
  SECTION("an output that cannot be written") {
    const std::string msg = tokenize_error(options({dir + "/good.txt"}, dir + "/no/such/dir/out"));
    CHECK_THAT(msg, Contains("no/such/dir does not exist"));
    CHECK_THAT(tokenize_error(options({dir + "/good.txt"}, out + ".bin")),
               Contains("did you mean " + out + "?"));
  }
  SECTION("the first bad document in input order is the one reported, whatever the threads") {
    // Line 3 is not JSON, line 7 has bad UTF-8: one batch, so threads race; line 3 must win.
    std::string lines;
    for (int i = 1; i <= 8; ++i)
      lines += i == 3 ? "{oops}\n" : (i == 7 ? "{\"text\": \"\xFF\"}\n" : "{\"text\": \"fine\"}\n");
    write_text(dir + "/two.jsonl", lines);
    for (const int threads : {1, 2, 4})
      CHECK_THAT(tokenize_error(options({dir + "/two.jsonl"}, out, DocumentFormat::JSONL, threads)),
                 Contains("two.jsonl:3:"));
  }
}

TEST_CASE("prepare: an error after data was written leaves the previous dataset untouched",
          "[data][prepare]") {
  const std::string dir = fresh_dir("late_error");
  const std::string out = dir + "/out";
  write_text(dir + "/first.txt", "an earlier dataset");
  tokenize_to_dataset(ByteTokenizer(), options({dir + "/first.txt"}, out));
  const auto bin = read_file(out + ".bin"), idx = read_file(out + ".idx");

  // 5000 good lines (many batches written to the temporary .bin), then a bad one.
  std::string lines;
  for (int i = 0; i < 5000; ++i) lines += nlohmann::json{{"text", some_text(i, 50)}}.dump() + "\n";
  lines += "{\"text\": null}\n";
  write_text(dir + "/late.jsonl", lines);
  TokenizeOptions o = options({dir + "/late.jsonl"}, out, DocumentFormat::JSONL, 1);
  o.force = true;  // to replace the earlier dataset
  const std::string msg = input_error([&] { tokenize_to_dataset(ByteTokenizer(), o); });
  CHECK_THAT(msg, Contains("late.jsonl:5001: field \"text\" is a JSON null"));
  CHECK_FALSE(fs::exists(out + ".bin.tmp"));
  CHECK_FALSE(fs::exists(out + ".idx.tmp"));
  CHECK(read_file(out + ".bin") == bin);
  CHECK(read_file(out + ".idx") == idx);
  CHECK(read_docs(out) == std::vector<std::vector<int32_t>>{doc_of("an earlier dataset")});
}

// =============================================================================================
// UTF-8
// =============================================================================================
TEST_CASE("prepare: UTF-8 validation follows Unicode's table of well-formed sequences",
          "[data][prepare]") {
  struct Case {
    std::string bytes;
    int64_t bad;  // offset of the first ill-formed sequence, -1 when well-formed
  };
  const std::vector<Case> cases = {
      {"", -1},
      {"plain ASCII, longer than eight bytes", -1},
      {"\x7F", -1},
      {"\xC2\x80 \xDF\xBF", -1},                  // U+0080, U+07FF
      {"\xE0\xA0\x80 \xEF\xBF\xBF", -1},          // U+0800, U+FFFF
      {"\xED\x9F\xBF \xEE\x80\x80", -1},          // U+D7FF, U+E000 around the surrogates
      {"\xF0\x90\x80\x80 \xF4\x8F\xBF\xBF", -1},  // U+10000, U+10FFFF
      {"abcdefgh\xC3\xA9", -1},                   // after a full 8-byte ASCII word
      {"\x80", 0},                                // stray continuation byte
      {"ab\xC0\x80", 2},                          // overlong NUL
      {"\xC1\xBF", 0},                            // overlong
      {"\xE0\x9F\xBF", 0},                        // overlong 3-byte form
      {"x\xED\xA0\x80", 1},                       // surrogate U+D800
      {"\xED\xBF\xBF", 0},                        // surrogate U+DFFF
      {"\xF0\x8F\xBF\xBF", 0},                    // overlong 4-byte form
      {"\xF4\x90\x80\x80", 0},                    // U+110000
      {"\xF5\x80\x80\x80", 0},                    // lead byte beyond U+10FFFF
      {"\xFF", 0},
      {"ok\xE2\x82", 2},                    // truncated at the end
      {"\xE2\x28\xA1", 0},                  // second byte not a continuation
      {"\xF0\x9F\x98", 0},                  // truncated 4-byte sequence
      {"\xF0\x9F\x98\x80\xF0\x9F\x98", 4},  // one good emoji, then a truncated one
      {"abcdefghijklmnop\x80", 16},         // after two ASCII words
  };
  for (const Case& c : cases) {
    INFO("bytes: " << c.bytes.size());
    CHECK(find_invalid_utf8(c.bytes) == c.bad);
  }
  // check_utf8 turns an offset into line and column of the file.
  const std::string msg = input_error([] { check_utf8("ab\ncd\nef\xFFgh", "f.txt", 10, 100); });
  CHECK_THAT(msg, Contains("f.txt:12: invalid UTF-8 at byte 108 of the file (column 3)"));
}

// =============================================================================================
// llm.c shards
// =============================================================================================
namespace {

// An llm.c shard by the rules of dev/data/data_common.py: int32[256] header (magic, version, count)
// then the tokens as uint16 (gpt-2) or uint32 (llama-3). `count` overrides the header's count.
void write_llmc(const std::string& path, int32_t magic, int32_t version,
                const std::vector<int64_t>& tokens, int64_t count = -1) {
  std::vector<uint8_t> b;
  for (int i = 0; i < 256; ++i) {
    const int32_t v = i == 0   ? magic
                      : i == 1 ? version
                      : i == 2 ? static_cast<int32_t>(count >= 0 ? count : tokens.size())
                               : 0;
    put<int32_t>(b, v);
  }
  for (int64_t t : tokens) {
    if (magic == kLlmcMagicGpt2)
      put<uint16_t>(b, static_cast<uint16_t>(t));
    else
      put<uint32_t>(b, static_cast<uint32_t>(t));
  }
  fs::create_directories(fs::path(path).parent_path());
  write_file(path, b);
}

LlmcOptions llmc_options(std::vector<std::string> inputs, std::string out) {
  LlmcOptions o;
  o.inputs = std::move(inputs);
  o.output_prefix = std::move(out);
  return o;
}

std::string llmc_error(const LlmcOptions& o) {
  const std::string msg = input_error([&] { convert_llmc_shards(o); });
  CHECK(no_dataset_at(o.output_prefix));
  return msg;
}

}  // namespace

TEST_CASE("prepare: llm.c gpt-2 shards become documents cut at <|endoftext|>", "[data][prepare]") {
  const std::string dir = fresh_dir("llmc");
  const int64_t E = 50256;
  // llm.c puts the delimiter before every document and cuts shards mid-document; the stream is
  // E 1 2 3 E 4 5 | 6 E E 7 8: documents 1 2 3, 4 5 6 (across the shards), an empty one, 7 8.
  write_llmc(dir + "/shards/a_000000.bin", kLlmcMagicGpt2, 1, {E, 1, 2, 3, E, 4, 5});
  write_llmc(dir + "/shards/a_000001.bin", kLlmcMagicGpt2, 1, {6, E, E, 7, 8});
  write_text(dir + "/shards/README.txt", "not a shard: ignored in a directory");
  const std::vector<std::vector<int32_t>> want = {{1, 2, 3, E}, {4, 5, 6, E}, {E}, {7, 8, E}};

  const PrepareSummary s = convert_llmc_shards(llmc_options({dir + "/shards"}, dir + "/out"));
  CHECK(read_docs(dir + "/out") == want);
  CHECK(IndexedDataset::open(dir + "/out").dtype() == IndexedDType::U16);
  CHECK(s.files == 2);
  CHECK(s.documents == 4);
  CHECK(s.tokens == 12);  // 12 in: the leading delimiter moved to the end of the last document
  CHECK(s.input_bytes == 2 * 1024 + 12 * 2);
  CHECK(s.text_bytes == 0);
  CHECK(s.tokens_per_byte() == 0.0);

  // The same tokens given as files in another order give another stream: 6 E E 7 8 E 1 2 3 E 4 5.
  convert_llmc_shards(
      llmc_options({dir + "/shards/a_000001.bin", dir + "/shards/a_000000.bin"}, dir + "/rev"));
  CHECK(read_docs(dir + "/rev") ==
        std::vector<std::vector<int32_t>>{{6, E}, {E}, {7, 8, E}, {1, 2, 3, E}, {4, 5, E}});

  // Another delimiter on request.
  write_llmc(dir + "/zero.bin", kLlmcMagicGpt2, 1, {0, 9, 0, 8});
  LlmcOptions o = llmc_options({dir + "/zero.bin"}, dir + "/zero_docs");
  o.eot = 0;
  convert_llmc_shards(o);
  CHECK(read_docs(dir + "/zero_docs") == std::vector<std::vector<int32_t>>{{9, 0}, {8, 0}});
}

TEST_CASE("prepare: llm.c llama-3 shards (uint32) become int32 documents", "[data][prepare]") {
  const std::string dir = fresh_dir("llmc_llama");
  const int64_t B = 128000;
  write_llmc(dir + "/l.bin", kLlmcMagicLlama3, 7, {B, 100000, 5, B, 128255, 70000});
  convert_llmc_shards(llmc_options({dir + "/l.bin"}, dir + "/out"));
  CHECK(IndexedDataset::open(dir + "/out").dtype() == IndexedDType::I32);
  CHECK(read_docs(dir + "/out") ==
        std::vector<std::vector<int32_t>>{{100000, 5, B}, {128255, 70000, B}});
}

TEST_CASE("prepare: bad llm.c shards are InputErrors naming file and field, leaving no dataset",
          "[data][prepare]") {
  const std::string dir = fresh_dir("llmc_bad");
  const std::string out = dir + "/out";
  const int64_t E = 50256;
  write_llmc(dir + "/good.bin", kLlmcMagicGpt2, 1, {E, 1, 2});

  write_file(dir + "/tiny.bin", std::vector<uint8_t>(100, 0));
  CHECK_THAT(llmc_error(llmc_options({dir + "/good.bin", dir + "/tiny.bin"}, out)),
             Contains("tiny.bin: not an llm.c token shard: it has 100 bytes"));

  write_llmc(dir + "/magic.bin", 1234, 1, {1, 2});
  CHECK_THAT(llmc_error(llmc_options({dir + "/magic.bin"}, out)),
             Contains("magic.bin: byte 0: bad magic 1234"));

  write_llmc(dir + "/version.bin", kLlmcMagicGpt2, 7, {1, 2});
  CHECK_THAT(llmc_error(llmc_options({dir + "/version.bin"}, out)),
             Contains("version.bin: byte 4: version 7 with magic 20240520"));

  write_llmc(dir + "/short.bin", kLlmcMagicGpt2, 1, {1, 2, 3}, 4);
  std::string msg = llmc_error(llmc_options({dir + "/short.bin"}, out));
  CHECK_THAT(msg, Contains("short.bin: byte 8: the header promises 4 tokens of 2 bytes"));
  CHECK_THAT(msg, Contains("cut short"));

  write_llmc(dir + "/long.bin", kLlmcMagicGpt2, 1, {1, 2, 3}, 2);
  CHECK_THAT(llmc_error(llmc_options({dir + "/long.bin"}, out)), Contains("trailing bytes"));

  write_llmc(dir + "/zero.bin", kLlmcMagicGpt2, 1, {});
  CHECK_THAT(llmc_error(llmc_options({dir + "/zero.bin"}, out)),
             Contains("zero.bin: byte 8: token count 0"));

  write_llmc(dir + "/llama.bin", kLlmcMagicLlama3, 7, {128000, 1});
  CHECK_THAT(llmc_error(llmc_options({dir + "/good.bin", dir + "/llama.bin"}, out)),
             Contains("llama.bin is a llama-3 shard but " + dir + "/good.bin is a gpt-2 shard"));

  write_llmc(dir + "/huge.bin", kLlmcMagicLlama3, 7, {128000, 1, 3000000000});
  CHECK_THAT(llmc_error(llmc_options({dir + "/huge.bin"}, out)),
             Contains("huge.bin: byte 1032: token 3000000000 does not fit int32"));

  write_llmc(dir + "/only_eot.bin", kLlmcMagicGpt2, 1, {E});
  CHECK_THAT(llmc_error(llmc_options({dir + "/only_eot.bin"}, out)), Contains("no document"));

  LlmcOptions o = llmc_options({dir + "/good.bin"}, out);
  o.eot = 70000;
  CHECK_THAT(llmc_error(o), Contains("--eot 70000 cannot occur in gpt-2 shards"));

  CHECK_THAT(llmc_error(llmc_options({dir + "/good.bin"}, dir + "/missing/out")),
             Contains("does not exist"));
}

TEST_CASE("prepare: an existing dataset is replaced only on request, and a prefix must name the files",
          "[data][prepare]") {
  const std::string dir = fresh_dir("existing");
  const std::string out = dir + "/out";
  write_text(dir + "/first.txt", "the first dataset");
  write_text(dir + "/second.txt", "the second one");
  tokenize_to_dataset(ByteTokenizer(), options({dir + "/first.txt"}, out));
  const auto bin = read_file(out + ".bin");
  TokenizeOptions o = options({dir + "/second.txt"}, out);
  CHECK_THAT(input_error([&] { tokenize_to_dataset(ByteTokenizer(), o); }),
             Contains(out + ".bin: the file exists (pass --force to replace it)"));
  CHECK(read_file(out + ".bin") == bin);
  o.force = true;
  tokenize_to_dataset(ByteTokenizer(), o);
  CHECK(read_docs(out) == std::vector<std::vector<int32_t>>{doc_of("the second one")});
  // "dir/" would write dir/.bin and dir/.idx: refused.
  o = options({dir + "/first.txt"}, dir + "/");
  CHECK_THAT(input_error([&] { tokenize_to_dataset(ByteTokenizer(), o); }),
             Contains("names a directory, not a prefix"));
  CHECK_FALSE(fs::exists(dir + "/.bin"));
}
