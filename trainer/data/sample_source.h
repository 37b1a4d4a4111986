// Where training samples come from. A sample is a window of T+1 tokens (T = seq_len): the model
// reads tokens [0, T) and predicts tokens [1, T+1). Sources stack:
//
//   IndexedSamples     consecutive windows of one Megatron indexed dataset, or of a range of its
//                      documents (data.split's train / valid / test parts)
//   SyntheticSamples   a learnable random stream, for runs without data (tests, benchmarks)
//   BlendedSamples     several sources mixed by weight, Megatron's deterministic blend
//   ShuffledSamples    an epoch-wise permutation of any source of modest size
//
// Every sample is a pure function of the source's configuration and the sample index, so the same
// config gives the same data on any parallel layout and after a resume.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "trainer/data/indexed_dataset.h"

namespace tetra {

class SampleSource {
 public:
  virtual ~SampleSource() = default;
  // Samples in one pass over the source. sample(i) takes 0 <= i < num_samples(), except where
  // takes_any_index() is true: ShuffledSamples (epoch i / num_samples()) and BlendedSamples (the
  // greedy goes on past its nominal total) take any i >= 0.
  virtual int64_t num_samples() const = 0;
  virtual bool takes_any_index() const { return false; }
  virtual int64_t seq_len() const = 0;
  // out: (seq_len + 1,) tokens. Not const: a source may cache (ShuffledSamples, BlendedSamples).
  virtual void sample(int64_t i, int32_t* out) = 0;
  // One line for the log: what this source is.
  virtual std::string describe() const = 0;
};

// data.split (Megatron's --split) over a dataset of n documents: the {train, valid, test} weights
// w (parse_data_split) cut the documents into the contiguous ranges [0, a), [a, b), [b, n) with
//   a = round(n * w0 / S),  b = round(n * (w0 / S + w1 / S)),  S = w0 + w1 + w2,
// computed in Megatron's order (weights normalised first, then summed) and with Python's round
// (ties to even), so a dataset splits at the same documents here and in Megatron.
// Returns {0, a, b, n}: part p (0 train, 1 valid, 2 test) is documents [bounds[p], bounds[p+1]).
std::array<int64_t, 4> split_document_bounds(const std::vector<double>& weights,
                                             int64_t num_documents);

// "train", "valid", "test": part p of a split, for messages.
const char* split_part_name(int part);

// Documents [begin, end) of a dataset: one part of data.split, named in messages and describe().
struct DocumentRange {
  int64_t begin = 0;
  int64_t end = 0;
  std::string split;  // data.split as written, e.g. "98,2"
  int part = 0;       // 0 train, 1 valid, 2 test
};

// Sample i = tokens [i*T, i*T + T + 1) of the concatenation of all documents (windows overlap by
// one token and run across document boundaries, as in llm.c and nanoGPT);
// num_samples = (num_tokens - 1) / T. InputError (naming the file) if the dataset has fewer than
// T + 1 tokens, or holds a token id outside [0, vocab_size).
//
// With a DocumentRange, the same over the concatenation of documents [begin, end) only: no window
// reaches a token outside the range, so the parts of a split never share a document. A document is
// one sequence of the dataset (as `tetra data` and Megatron's preprocess_data.py write them); a
// sentence-split dataset (more sequences than documents) is an InputError, as is a range too short
// for one sample (naming the dataset, the split, the part and its document and token counts).
class IndexedSamples : public SampleSource {
 public:
  IndexedSamples(std::shared_ptr<const IndexedDataset> dataset, int64_t seq_len,
                 int64_t vocab_size);
  IndexedSamples(std::shared_ptr<const IndexedDataset> dataset, int64_t seq_len,
                 int64_t vocab_size, DocumentRange range);
  int64_t num_samples() const override { return num_samples_; }
  int64_t seq_len() const override { return seq_len_; }
  void sample(int64_t i, int32_t* out) override;
  std::string describe() const override;
  // Tokens [token_begin, token_end) of the dataset are the ones samples read.
  int64_t token_begin() const { return token_begin_; }
  int64_t token_end() const { return token_end_; }

 private:
  void check_vocab(int64_t vocab_size) const;

  std::shared_ptr<const IndexedDataset> dataset_;
  int64_t seq_len_;
  bool has_range_ = false;
  DocumentRange range_;
  int64_t token_begin_ = 0;
  int64_t token_end_ = 0;
  int64_t num_samples_ = 0;
};

// A stationary first-order Markov chain over the vocabulary, with a fixed sparse transition table:
// every token a has exactly 4 distinct successors succ[a][0..3], each followed with probability
// 1/4. The table is drawn from `seed`; the walks from (seed, stream), so the train (stream 0) and
// validation (stream 1) streams speak the same "language" with different samples. Sample i starts
// at a uniform token and takes T uniform steps, all from Philox counters (seed, stream, i):
// sample(i) is a pure function of (vocab_size, seq_len, seed, stream, i).
//
// Entropy: the next token given the previous one has exactly ln 4 = 1.3863 nats of entropy, and
// every target position has its previous token in view, so a model that learns the table reaches
// a loss of ln 4, whatever the token. An untrained model starts near ln V; one that learns only
// token frequencies stays far above ln 4.
// num_samples = 2^40 (never exhausted). vocab_size >= 4.
class SyntheticSamples : public SampleSource {
 public:
  static constexpr int64_t kSuccessors = 4;
  static constexpr double kEntropyNats = 1.3862943611198906;  // ln 4

  SyntheticSamples(int64_t vocab_size, int64_t seq_len, uint64_t seed, uint64_t stream = 0);
  int64_t num_samples() const override { return int64_t{1} << 40; }
  int64_t seq_len() const override { return seq_len_; }
  void sample(int64_t i, int32_t* out) override;
  std::string describe() const override;
  // The 4 successors of token a, for tests.
  const int32_t* successors(int32_t a) const {
    return &table_[static_cast<size_t>(a) * kSuccessors];
  }

 private:
  int64_t vocab_size_;
  int64_t seq_len_;
  uint64_t seed_;
  uint64_t stream_key_;
  std::vector<int32_t> table_;  // (V, 4)
};

// Megatron's deterministic blend: blended sample k comes from the source i that maximises
// w[i] * (k + 1) - count_i (ties to the lowest i), where w are the normalised weights and count_i
// the samples taken from source i so far; it is that source's sample count_i (mod num_samples_i,
// unless the source takes any index, as a ShuffledSamples does: then each pass over it is a new
// epoch). So after any prefix of k samples, source i has contributed w[i] * k samples to within
// one. The weights are normalised by their sum, or, should that sum overflow (weights near
// 1e308), by the sum of the weights divided by the largest: never all zero.
//
// Nothing is computed up front: the choices for k's chunk (kChunk samples) are replayed from the
// greedy state (the per-source counts) at the chunk's start, and that state comes from the end of
// the chunk loaded last (reading forward costs one greedy step per sample) or, for a jump back,
// from the nearest checkpoint before it: the counts are kept every kCheckpoint samples as the
// replay passes them (S * 8 bytes per 2^20 samples reached). So construction takes O(S) time and
// memory whatever total_samples is (training.steps = 2^31 - 1 is fine); the first read at sample k
// (a resume) replays the greedy from the last checkpoint reached up to k once (about 0.2 s per
// 10^7 samples of a three-way blend on the build machine). total_samples is what num_samples() reports; any k >= 0 may be read.
class BlendedSamples : public SampleSource {
 public:
  static constexpr int64_t kChunk = 1024;
  static constexpr int64_t kCheckpoint = kChunk * 1024;

  BlendedSamples(std::vector<std::shared_ptr<SampleSource>> sources, std::vector<double> weights,
                 int64_t total_samples);
  int64_t num_samples() const override { return total_samples_; }
  bool takes_any_index() const override { return true; }
  int64_t seq_len() const override { return seq_len_; }
  void sample(int64_t k, int32_t* out) override;
  std::string describe() const override;
  // (source, sample index within that source) of blended sample k.
  std::pair<int32_t, int64_t> locate(int64_t k);
  const std::vector<double>& weights() const { return weights_; }
  // Bytes held by the tables (checkpoints, the replay state, the cached chunk), for tests.
  int64_t table_bytes() const;

 private:
  void load_chunk(int64_t chunk);
  // Runs the greedy from sample `k` with `counts` to sample `end`, keeping checkpoints passed.
  void advance(int64_t& k, std::vector<int64_t>& counts, int64_t end);
  void keep_checkpoint(int64_t k, const std::vector<int64_t>& counts);

  std::vector<std::shared_ptr<SampleSource>> sources_;
  std::vector<bool> wraps_;      // (S,) source i's index is taken mod its num_samples
  std::vector<double> weights_;  // (S,) normalised
  int64_t total_samples_;
  int64_t seq_len_;
  std::vector<int64_t> checkpoints_;  // (reached, S): counts before sample c * kCheckpoint
  int64_t frontier_k_ = 0;            // the greedy state at the end of the chunk loaded last
  std::vector<int64_t> frontier_counts_;  // (S,)
  int64_t cached_chunk_ = -1;
  std::vector<int32_t> cached_source_;  // (kChunk,)
  std::vector<int64_t> cached_index_;   // (kChunk,) count before wrapping
};

// Global index g -> epoch e = g / n, j = g % n -> source sample perm_e[j], where perm_e is a
// Fisher-Yates permutation of [0, n) drawn from Philox counters (seed, e): deterministic per
// (seed, e) and different in every epoch. The current epoch's permutation is cached (4 bytes per
// sample: n = 1e8 takes 400 MB), so accesses should move forward through the epochs, as a
// training run does. n must be < 2^32; the synthetic source needs no shuffling.
class ShuffledSamples : public SampleSource {
 public:
  ShuffledSamples(std::shared_ptr<SampleSource> source, uint64_t seed);
  int64_t num_samples() const override { return n_; }
  bool takes_any_index() const override { return true; }
  int64_t seq_len() const override { return source_->seq_len(); }
  void sample(int64_t g, int32_t* out) override;
  std::string describe() const override;
  // The source sample that global index g reads.
  int64_t source_index(int64_t g);

 private:
  std::shared_ptr<SampleSource> source_;
  uint64_t seed_;
  int64_t n_;
  int64_t cached_epoch_ = -1;
  std::vector<uint32_t> perm_;  // (n,) the cached epoch's permutation
};

}  // namespace tetra
