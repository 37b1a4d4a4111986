// Dataset preparation: the thread pool, the split, and the tokenize -> write pipeline. See
// prepare.h.
#include "trainer/data/prepare.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <exception>
#include <mutex>
#include <thread>

#include "kernels/common/check.h"
#include "trainer/core/output_path.h"
#include "trainer/data/indexed_dataset.h"
#include "trainer/data/tokenizer.h"

namespace tetra {

namespace {

// Tokenizer threads: beyond any machine's cores, and each one costs a thread and its buffers.
constexpr int kMaxThreads = 4096;

// Runs fn(i) for every i in [0, n) on `threads` threads, the calling thread being one of them,
// and returns when all are done. Indices are handed out one at a time (documents differ widely in
// size), so which thread runs which index varies; callers store results by index. fn must not
// throw.
class WorkerPool {
 public:
  explicit WorkerPool(int threads) {
    for (int t = 1; t < threads; ++t) workers_.emplace_back([this] { loop(); });
  }
  ~WorkerPool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    start_.notify_all();
    for (std::thread& w : workers_) w.join();
  }
  WorkerPool(const WorkerPool&) = delete;
  WorkerPool& operator=(const WorkerPool&) = delete;

  void run(size_t n, const std::function<void(size_t)>& fn) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      fn_ = &fn;
      n_ = n;
      next_.store(0);
      busy_ = workers_.size();
      ++generation_;
    }
    start_.notify_all();
    work();
    std::unique_lock<std::mutex> lock(mutex_);
    done_.wait(lock, [this] { return busy_ == 0; });
    fn_ = nullptr;
  }

 private:
  void work() {
    for (size_t i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1)) (*fn_)(i);
  }
  void loop() {
    uint64_t seen = 0;
    for (;;) {
      {
        std::unique_lock<std::mutex> lock(mutex_);
        start_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
      }
      work();
      std::lock_guard<std::mutex> lock(mutex_);
      if (--busy_ == 0) done_.notify_one();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex mutex_;
  std::condition_variable start_, done_;
  const std::function<void(size_t)>* fn_ = nullptr;
  size_t n_ = 0;
  std::atomic<size_t> next_{0};
  size_t busy_ = 0;
  uint64_t generation_ = 0;
  bool stop_ = false;
};

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

const char* const kPartNames[] = {"train", "valid", "test"};

}  // namespace

double PrepareSummary::tokens_per_byte() const {
  if (text_bytes <= 0) return 0.0;
  return static_cast<double>(tokens - documents) / static_cast<double>(text_bytes);
}

// ---------------------------------------------------------------------------------------------
// Split
// ---------------------------------------------------------------------------------------------
DocumentSplitter::DocumentSplitter(std::vector<int64_t> weights)
    : weights_(std::move(weights)), credit_(weights_.size(), 0) {
  TETRA_CHECK(!weights_.empty(), "a split needs at least one part");
  for (int64_t w : weights_) {
    TETRA_CHECK(w > 0, "split weight {}", w);
    total_ += w;
  }
}

size_t DocumentSplitter::next() {
  size_t best = 0;
  for (size_t k = 0; k < weights_.size(); ++k) {
    credit_[k] += weights_[k];
    if (credit_[k] > credit_[best]) best = k;
  }
  credit_[best] -= total_;
  return best;
}

std::vector<int64_t> parse_split(std::string_view spec) {
  const std::string usage = fmt::format(
      "--split {}: give two or three positive whole-number weights, train,valid[,test], such as "
      "98,2 or 949,50,1",
      spec);
  std::vector<int64_t> weights;
  size_t start = 0;
  for (;;) {
    const size_t comma = spec.find(',', start);
    const std::string part(
        spec.substr(start, comma == std::string_view::npos ? spec.npos : comma - start));
    TETRA_INPUT_CHECK(!part.empty() && part.size() <= 9 &&
                          part.find_first_not_of("0123456789") == std::string::npos,
                      "{}", usage);
    weights.push_back(std::stoll(part));
    TETRA_INPUT_CHECK(weights.back() > 0, "{}", usage);
    if (comma == std::string_view::npos) break;
    start = comma + 1;
  }
  TETRA_INPUT_CHECK(weights.size() == 2 || weights.size() == 3, "{}", usage);
  return weights;
}

std::vector<std::string> split_prefixes(const std::string& prefix, size_t parts) {
  TETRA_CHECK(parts >= 2 && parts <= 3, "{} split parts", parts);
  std::vector<std::string> out;
  for (size_t k = 0; k < parts; ++k) out.push_back(prefix + "_" + kPartNames[k]);
  return out;
}

// ---------------------------------------------------------------------------------------------
// Tokenize
// ---------------------------------------------------------------------------------------------
PrepareSummary tokenize_to_dataset(const Tokenizer& tokenizer, const TokenizeOptions& opt) {
  const auto t0 = std::chrono::steady_clock::now();
  TETRA_INPUT_CHECK(opt.threads >= 0 && opt.threads <= kMaxThreads,
                    "--threads {}: give 0 (all hardware threads) or up to {}", opt.threads, kMaxThreads);
  const int threads = opt.threads > 0
                          ? opt.threads
                          : std::max(1, static_cast<int>(std::thread::hardware_concurrency()));
  TETRA_INPUT_CHECK(!opt.json_key.empty() || opt.format == DocumentFormat::TEXT,
                    "--json-key is empty: name the JSON field that holds the text");

  // Everything that can be checked before reading a document is checked first.
  std::vector<InputFile> files = list_input_files(opt.inputs);
  check_files_not_empty(files);
  check_output_prefix(opt.output_prefix, "--output");
  const std::vector<std::string> prefixes =
      opt.split.empty() ? std::vector<std::string>{opt.output_prefix}
                        : split_prefixes(opt.output_prefix, opt.split.size());
  const std::vector<std::string> input_names = input_paths(files);
  for (const std::string& p : prefixes)
    for (const char* ext : {".bin", ".idx"}) check_output_file("--output", p + ext, opt.force, input_names);
  const int64_t vocab = tokenizer.vocab_size();
  const int32_t eod = tokenizer.eod_id();
  TETRA_CHECK(eod >= 0 && eod < vocab, "tokenizer {}: end-of-document id {} outside vocab {}",
              tokenizer.name(), eod, vocab);
  const IndexedDType dtype = token_dtype_for_vocab(vocab);

  PrepareSummary summary;
  summary.files = static_cast<int64_t>(files.size());
  summary.dtype = std::string(indexed_dtype_name(dtype));
  std::vector<std::unique_ptr<IndexedDatasetWriter>> writers;
  for (const std::string& p : prefixes) {
    writers.push_back(std::make_unique<IndexedDatasetWriter>(p, dtype));
    summary.datasets.push_back({p, 0, 0});
  }
  DocumentSplitter splitter(opt.split.empty() ? std::vector<int64_t>{1} : opt.split);

  DocumentReader reader(std::move(files), opt.format);
  summary.input_bytes = reader.bytes_total();
  WorkerPool pool(threads);
  std::vector<RawDocument> batch;
  std::vector<std::vector<int32_t>> tokens;  // (batch,) tokens of each document
  std::vector<int64_t> text_bytes;           // (batch,)
  std::vector<std::exception_ptr> errors;    // (batch,) what went wrong, if anything
  const size_t max_docs = 256 * static_cast<size_t>(threads);
  const int64_t max_bytes = (int64_t{1} << 20) * threads;
  double last_report = 0.0;

  const auto report = [&](bool done) {
    if (!opt.progress) return;
    PrepareProgress p;
    p.bytes_done = reader.bytes_read();
    p.bytes_total = reader.bytes_total();
    p.documents = summary.documents;
    p.tokens = summary.tokens;
    p.seconds = seconds_since(t0);
    p.done = done;
    opt.progress(p);
  };

  while (reader.next_batch(batch, max_docs, max_bytes)) {
    const size_t n = batch.size();
    if (tokens.size() < n) tokens.resize(n);
    text_bytes.assign(n, 0);
    errors.assign(n, nullptr);
    pool.run(n, [&](size_t i) {
      try {
        std::string storage;
        const std::string_view text = document_text(batch[i], opt.format, opt.json_key, storage);
        std::vector<int32_t>& out = tokens[i];
        out.clear();
        tokenizer.encode(text, out);
        for (int32_t id : out)
          TETRA_CHECK(id >= 0 && id < vocab,
                      "tokenizer {} gave id {} outside its vocab {} for {}:{}", tokenizer.name(),
                      id, vocab, batch[i].file, batch[i].line);
        out.push_back(eod);
        text_bytes[i] = static_cast<int64_t>(text.size());
      } catch (...) {
        errors[i] = std::current_exception();
      }
    });
    // In input order: the first bad document is the one reported, whatever the thread count.
    for (size_t i = 0; i < n; ++i) {
      if (errors[i]) std::rethrow_exception(errors[i]);
      const size_t part = splitter.next();
      writers[part]->add_document(tokens[i]);
      const auto count = static_cast<int64_t>(tokens[i].size());
      summary.datasets[part].documents += 1;
      summary.datasets[part].tokens += count;
      summary.documents += 1;
      summary.tokens += count;
      summary.text_bytes += text_bytes[i];
    }
    if (seconds_since(t0) - last_report >= opt.progress_interval_s) {
      last_report = seconds_since(t0);
      report(false);
    }
  }

  if (!opt.split.empty()) {
    for (size_t k = 0; k < prefixes.size(); ++k) {
      TETRA_INPUT_CHECK(summary.datasets[k].documents > 0,
                        "--split {}: the {} part got none of the {} documents; give more "
                        "documents or a larger weight to that part",
                        fmt::join(opt.split, ","), kPartNames[k], summary.documents);
    }
  }
  // Rename into place only now. Should a later part fail, the parts already renamed go too: a run
  // leaves all of its datasets or none.
  for (size_t k = 0; k < writers.size(); ++k) {
    try {
      writers[k]->finish();
    } catch (...) {
      for (size_t j = 0; j < k; ++j) {
        std::remove((prefixes[j] + ".idx").c_str());
        std::remove((prefixes[j] + ".bin").c_str());
      }
      throw;
    }
  }
  summary.seconds = seconds_since(t0);
  report(true);
  return summary;
}

}  // namespace tetra
