// Sample sources: windows of an indexed dataset, the synthetic Markov stream, the deterministic
// blend and the epoch-wise shuffle. See sample_source.h for what each one promises.
#include "trainer/data/sample_source.h"

#include <algorithm>
#include <cmath>

#include "kernels/common/math.h"
#include "kernels/common/check.h"

namespace tetra {

namespace {

// SplitMix64's finaliser: turns related seeds (seed, seed + 1, ...) into unrelated Philox keys.
uint64_t mix64(uint64_t x) {
  x += 0x9E3779B97F4A7C15ull;
  x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
  x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
  return x ^ (x >> 31);
}

// Uniform integer in [0, n) from 32 random bits (multiply-shift; bias < n / 2^32, irrelevant for
// a synthetic corpus).
inline int32_t uniform_below(uint32_t bits, int64_t n) {
  return static_cast<int32_t>((static_cast<uint64_t>(bits) * static_cast<uint64_t>(n)) >> 32);
}

// Domain separators, so the table, the walks and the shuffles never share Philox counters.
constexpr uint64_t kTableCounterHi = uint64_t{1} << 63;   // sample indices stay below 2^40
constexpr uint64_t kStreamSalt = 0x53594E5448455449ull;   // "SYNTHETI"
constexpr uint64_t kShuffleSalt = 0x53485546464C4521ull;  // "SHUFFLE!"

}  // namespace

// ---------------------------------------------------------------------------------------------
// data.split
// ---------------------------------------------------------------------------------------------
std::array<int64_t, 4> split_document_bounds(const std::vector<double>& weights,
                                             int64_t num_documents) {
  TETRA_CHECK(weights.size() == 3 && num_documents >= 0, "{} split weights, {} documents",
              weights.size(), num_documents);
  TETRA_CHECK(std::isfinite(weights[0]) && std::isfinite(weights[1]) &&
                  std::isfinite(weights[2]) && weights[0] >= 0 && weights[1] >= 0 &&
                  weights[2] >= 0 && weights[0] + weights[1] + weights[2] > 0,
              "split weights {}, {}, {}", weights[0], weights[1], weights[2]);
  // Weights whose sum overflows (near 1e308) are scaled by the largest first: the same ratios.
  // Only then: otherwise the division below is Megatron's, bit for bit.
  std::vector<double> w = weights;
  if (!std::isfinite(w[0] + w[1] + w[2])) {
    const double max = std::max({w[0], w[1], w[2]});
    for (double& x : w) x /= max;
  }
  const double sum = w[0] + w[1] + w[2];
  // Megatron (blended_megatron_dataset_builder): bookends = cumulative sums of the normalised
  // weights, boundary = int(round(bookend * n)). std::nearbyint in the default rounding mode
  // rounds ties to even, as Python's round does (2.5 -> 2, 3.5 -> 4).
  const double n = static_cast<double>(num_documents);
  double cum = 0.0;
  std::array<int64_t, 4> bounds{0, 0, 0, num_documents};
  for (int p = 0; p < 2; ++p) {
    cum += w[p] / sum;
    bounds[p + 1] = std::clamp(static_cast<int64_t>(std::nearbyint(cum * n)), bounds[p],
                               num_documents);
  }
  return bounds;
}

const char* split_part_name(int part) {
  static const char* const kNames[] = {"train", "valid", "test"};
  TETRA_CHECK(part >= 0 && part < 3, "split part {}", part);
  return kNames[part];
}

// ---------------------------------------------------------------------------------------------
// IndexedSamples
// ---------------------------------------------------------------------------------------------
IndexedSamples::IndexedSamples(std::shared_ptr<const IndexedDataset> dataset, int64_t seq_len,
                               int64_t vocab_size)
    : dataset_(std::move(dataset)), seq_len_(seq_len) {
  TETRA_CHECK(dataset_ != nullptr && seq_len_ >= 1 && vocab_size >= 1, "seq_len {} vocab_size {}",
              seq_len_, vocab_size);
  const int64_t n = dataset_->num_tokens();
  TETRA_INPUT_CHECK(n >= seq_len_ + 1,
                    "dataset {} has {} tokens, fewer than one sample of model.seq_len + 1 = {} "
                    "tokens; use more data or a shorter model.seq_len",
                    dataset_->prefix(), n, seq_len_ + 1);
  token_end_ = n;
  num_samples_ = (n - 1) / seq_len_;
  check_vocab(vocab_size);
}

IndexedSamples::IndexedSamples(std::shared_ptr<const IndexedDataset> dataset, int64_t seq_len,
                               int64_t vocab_size, DocumentRange range)
    : dataset_(std::move(dataset)), seq_len_(seq_len), has_range_(true), range_(std::move(range)) {
  TETRA_CHECK(dataset_ != nullptr && seq_len_ >= 1 && vocab_size >= 1, "seq_len {} vocab_size {}",
              seq_len_, vocab_size);
  const int64_t docs = dataset_->num_documents(), seqs = dataset_->num_sequences();
  const std::string part = fmt::format("the {} part of data.split \"{}\"",
                                       split_part_name(range_.part), range_.split);
  TETRA_INPUT_CHECK(docs == seqs,
                    "dataset {} has {} documents in {} sequences (sentence-split), but {} is cut "
                    "at document boundaries with one sequence per document; prepare the dataset "
                    "without sentence splitting, or split it when preparing (tetra data tokenize "
                    "--split) and list the parts in data.train and data.valid instead of data.split",
                    dataset_->prefix(), docs, seqs, part);
  TETRA_CHECK(range_.begin >= 0 && range_.begin <= range_.end && range_.end <= docs,
              "documents [{}, {}) of {} in {}", range_.begin, range_.end, docs,
              dataset_->prefix());
  // Document d is sequence d: its first token sits at sequence_offset(d).
  auto doc_start = [&](int64_t d) {
    return d < seqs ? dataset_->sequence_offset(d) : dataset_->num_tokens();
  };
  token_begin_ = doc_start(range_.begin);
  token_end_ = doc_start(range_.end);
  const int64_t n = token_end_ - token_begin_;
  TETRA_INPUT_CHECK(
      n >= seq_len_ + 1,
      "dataset {}: {} is documents [{}, {}) of its {}, {} documents holding {} tokens, fewer than "
      "one sample of model.seq_len + 1 = {} tokens; give the {} part a larger share in data.split, "
      "use a dataset with more documents, or a shorter model.seq_len",
      dataset_->prefix(), part, range_.begin, range_.end, docs, range_.end - range_.begin, n,
      seq_len_ + 1, split_part_name(range_.part));
  num_samples_ = (n - 1) / seq_len_;
  check_vocab(vocab_size);
}

void IndexedSamples::check_vocab(int64_t vocab_size) const {
  const int64_t lo = dataset_->min_token(), hi = dataset_->max_token();
  TETRA_INPUT_CHECK(hi < vocab_size,
                    "dataset {} holds token id {} but model.vocab_size is {}: the data was "
                    "tokenised with a larger vocabulary; raise model.vocab_size to at least {} or "
                    "tokenise with the model's tokenizer",
                    dataset_->bin_path(), hi, vocab_size, hi + 1);
  TETRA_INPUT_CHECK(lo >= 0, "dataset {} holds negative token id {}: token ids must be in [0, {})",
                    dataset_->bin_path(), lo, vocab_size);
}

void IndexedSamples::sample(int64_t i, int32_t* out) {
  TETRA_CHECK(i >= 0 && i < num_samples_, "sample {} of {} in {}", i, num_samples_,
              dataset_->prefix());
  dataset_->read(token_begin_ + i * seq_len_, seq_len_ + 1, out);
}

std::string IndexedSamples::describe() const {
  if (!has_range_)
    return fmt::format("{} ({} documents, {} tokens of {}, {} samples of {}+1)",
                       dataset_->prefix(), dataset_->num_documents(), dataset_->num_tokens(),
                       indexed_dtype_name(dataset_->dtype()), num_samples_, seq_len_);
  return fmt::format("{} docs [{}, {}) of {} (split {}, {} part: {} tokens of {}, {} samples of "
                     "{}+1)",
                     dataset_->prefix(), range_.begin, range_.end, dataset_->num_documents(),
                     range_.split, split_part_name(range_.part), token_end_ - token_begin_,
                     indexed_dtype_name(dataset_->dtype()), num_samples_, seq_len_);
}

// ---------------------------------------------------------------------------------------------
// SyntheticSamples
// ---------------------------------------------------------------------------------------------
SyntheticSamples::SyntheticSamples(int64_t vocab_size, int64_t seq_len, uint64_t seed,
                                   uint64_t stream)
    : vocab_size_(vocab_size),
      seq_len_(seq_len),
      seed_(seed),
      stream_key_(mix64(seed ^ mix64(kStreamSalt + stream))) {
  TETRA_INPUT_CHECK(vocab_size_ >= kSuccessors && vocab_size_ <= (int64_t{1} << 31) - 1,
                    "synthetic data needs model.vocab_size in [{}, 2^31), got {}", kSuccessors,
                    vocab_size_);
  TETRA_CHECK(seq_len_ >= 1, "seq_len {}", seq_len_);
  // Successors of token a: distinct draws from Philox counters (a, table domain + round, seed).
  table_.resize(static_cast<size_t>(vocab_size_) * kSuccessors);
  for (int64_t a = 0; a < vocab_size_; ++a) {
    int32_t* succ = &table_[static_cast<size_t>(a) * kSuccessors];
    int64_t have = 0;
    for (uint64_t round = 0; have < kSuccessors; ++round) {
      math::Philox4 r = math::philox4x32(static_cast<uint64_t>(a), kTableCounterHi + round, seed_);
      for (int w = 0; w < 4 && have < kSuccessors; ++w) {
        const int32_t cand = uniform_below(r.v[w], vocab_size_);
        if (std::find(succ, succ + have, cand) == succ + have) succ[have++] = cand;
      }
    }
  }
}

void SyntheticSamples::sample(int64_t i, int32_t* out) {
  TETRA_CHECK(i >= 0 && i < num_samples(), "synthetic sample {}", i);
  // Block 0 gives the start token; block b >= 1 gives 2-bit choices for steps 64(b-1) .. 64b-1.
  math::Philox4 r = math::philox4x32(0, static_cast<uint64_t>(i), stream_key_);
  out[0] = uniform_below(r.v[0], vocab_size_);
  for (int64_t t = 1; t <= seq_len_; ++t) {
    const int64_t s = t - 1;
    if (s % 64 == 0)
      r = math::philox4x32(static_cast<uint64_t>(s / 64 + 1), static_cast<uint64_t>(i),
                           stream_key_);
    const uint32_t choice = (r.v[(s % 64) / 16] >> (2 * (s % 16))) & 3u;
    out[t] = table_[static_cast<size_t>(out[t - 1]) * kSuccessors + choice];
  }
}

std::string SyntheticSamples::describe() const {
  return fmt::format(
      "synthetic Markov stream (vocab {}, {} successors per token, entropy {:.4f} "
      "nats/token, seed {}, samples of {}+1)",
      vocab_size_, kSuccessors, kEntropyNats, seed_, seq_len_);
}

// ---------------------------------------------------------------------------------------------
// BlendedSamples
// ---------------------------------------------------------------------------------------------
namespace {

// Megatron's choice for blended sample k: the source furthest behind its target share.
inline int32_t blend_choose(const std::vector<double>& w, const int64_t* counts, int64_t k) {
  int32_t best = 0;
  double best_err = w[0] * static_cast<double>(k + 1) - static_cast<double>(counts[0]);
  for (size_t i = 1; i < w.size(); ++i) {
    const double err = w[i] * static_cast<double>(k + 1) - static_cast<double>(counts[i]);
    if (err > best_err) {
      best_err = err;
      best = static_cast<int32_t>(i);
    }
  }
  return best;
}

// w / sum(w); when the sum overflows (weights near 1e308), (w / max) / sum(w / max) instead, the
// same ratios without the overflow. The plain form otherwise: it is what Megatron computes, and
// what the order of existing runs was computed with, bit for bit.
std::vector<double> normalise_weights(std::vector<double> w) {
  double sum = 0.0, max = 0.0;
  for (double x : w) {
    sum += x;
    max = std::max(max, x);
  }
  if (!std::isfinite(sum)) {
    for (double& x : w) x /= max;
    sum = 0.0;
    for (double x : w) sum += x;
  }
  for (double& x : w) x /= sum;
  return w;
}

}  // namespace

BlendedSamples::BlendedSamples(std::vector<std::shared_ptr<SampleSource>> sources,
                               std::vector<double> weights, int64_t total_samples)
    : sources_(std::move(sources)), weights_(std::move(weights)), total_samples_(total_samples) {
  TETRA_CHECK(!sources_.empty() && sources_.size() == weights_.size(), "{} sources with {} weights",
              sources_.size(), weights_.size());
  TETRA_CHECK(total_samples_ >= 1, "total_samples {}", total_samples_);
  seq_len_ = sources_[0]->seq_len();
  for (size_t i = 0; i < sources_.size(); ++i) {
    TETRA_CHECK(sources_[i]->seq_len() == seq_len_, "source {} has seq_len {}, source 0 has {}", i,
                sources_[i]->seq_len(), seq_len_);
    TETRA_INPUT_CHECK(std::isfinite(weights_[i]) && weights_[i] > 0.0,
                      "data weight {} of {} must be a positive number", weights_[i],
                      sources_[i]->describe());
    wraps_.push_back(!sources_[i]->takes_any_index());
  }
  const std::vector<double> raw = weights_;
  weights_ = normalise_weights(raw);
  for (size_t i = 0; i < sources_.size(); ++i)
    TETRA_INPUT_CHECK(weights_[i] > 0.0,
                      "data weight {} of {} is too small a share of the total weight to draw "
                      "any sample from (it normalises to 0: the largest weight is over 1e308 "
                      "times larger); raise it or remove the entry",
                      raw[i], sources_[i]->describe());
  const size_t S = sources_.size();
  checkpoints_.assign(S, 0);  // before sample 0: nothing taken
  frontier_counts_.assign(S, 0);
  cached_source_.resize(kChunk);
  cached_index_.resize(kChunk);
}

void BlendedSamples::keep_checkpoint(int64_t k, const std::vector<int64_t>& counts) {
  const size_t S = sources_.size();
  if (k % kCheckpoint == 0 && static_cast<size_t>(k / kCheckpoint) == checkpoints_.size() / S)
    checkpoints_.insert(checkpoints_.end(), counts.begin(), counts.end());
}

void BlendedSamples::advance(int64_t& k, std::vector<int64_t>& counts, int64_t end) {
  while (k < end) {
    keep_checkpoint(k, counts);
    // Up to the next checkpoint boundary (or `end`) without looking at boundaries.
    const int64_t stop = std::min(end, (k / kCheckpoint + 1) * kCheckpoint);
    for (; k < stop; ++k) ++counts[blend_choose(weights_, counts.data(), k)];
  }
  keep_checkpoint(k, counts);
}

void BlendedSamples::load_chunk(int64_t chunk) {
  const size_t S = sources_.size();
  const int64_t begin = chunk * kChunk, end = begin + kChunk;
  // Start from the later of: the frontier (if not past `begin`) and the last checkpoint at or
  // before `begin` that has been reached.
  const int64_t reached = static_cast<int64_t>(checkpoints_.size() / S);
  const int64_t c = std::min(begin / kCheckpoint, reached - 1);
  int64_t k = c * kCheckpoint;
  std::vector<int64_t> counts(checkpoints_.begin() + c * S, checkpoints_.begin() + (c + 1) * S);
  if (frontier_k_ <= begin && frontier_k_ > k) {
    k = frontier_k_;
    counts = frontier_counts_;
  }
  advance(k, counts, begin);
  for (; k < end; ++k) {
    const int32_t i = blend_choose(weights_, counts.data(), k);
    cached_source_[k - begin] = i;
    cached_index_[k - begin] = counts[i]++;
  }
  keep_checkpoint(k, counts);
  frontier_k_ = k;
  frontier_counts_ = std::move(counts);
  cached_chunk_ = chunk;
}

std::pair<int32_t, int64_t> BlendedSamples::locate(int64_t k) {
  TETRA_CHECK(k >= 0, "blended sample {}", k);
  if (k / kChunk != cached_chunk_) load_chunk(k / kChunk);
  const int32_t i = cached_source_[k % kChunk];
  const int64_t index = cached_index_[k % kChunk];
  return {i, wraps_[i] ? index % sources_[i]->num_samples() : index};
}

int64_t BlendedSamples::table_bytes() const {
  return static_cast<int64_t>(checkpoints_.capacity() * sizeof(int64_t) +
                              frontier_counts_.capacity() * sizeof(int64_t) +
                              cached_source_.capacity() * sizeof(int32_t) +
                              cached_index_.capacity() * sizeof(int64_t) + wraps_.size() / 8 +
                              weights_.capacity() * sizeof(double));
}

void BlendedSamples::sample(int64_t k, int32_t* out) {
  auto [i, j] = locate(k);
  sources_[i]->sample(j, out);
}

std::string BlendedSamples::describe() const {
  std::string s =
      fmt::format("blend of {} sources over {} samples:", sources_.size(), total_samples_);
  for (size_t i = 0; i < sources_.size(); ++i)
    s += fmt::format(" [{:.4f}] {};", weights_[i], sources_[i]->describe());
  return s;
}

// ---------------------------------------------------------------------------------------------
// ShuffledSamples
// ---------------------------------------------------------------------------------------------
namespace {

// Fisher-Yates: for x = n-1 .. 1, swap perm[x] with perm[u(x)], u(x) uniform in [0, x] from 64
// random bits of Philox counter (x / 2, epoch) (Lemire's multiply-shift; bias below n / 2^64).
// The targets depend only on x, not on the array, so they are drawn a batch ahead and prefetched:
// for n = 1e8 the swaps are random accesses into 400 MB, and without the prefetch the loop waits
// on memory at every step.
void shuffle_permutation(std::vector<uint32_t>& perm, int64_t n, uint64_t key, uint64_t epoch) {
  constexpr int64_t kBatch = 256;
  perm.resize(static_cast<size_t>(n));
  for (int64_t x = 0; x < n; ++x) perm[x] = static_cast<uint32_t>(x);
  int64_t target[kBatch];
  math::Philox4 r{};
  int64_t block = -1;  // Philox counter of r: one block serves x = 2b and 2b + 1
  for (int64_t hi = n - 1; hi >= 1; hi -= kBatch) {
    const int64_t lo = std::max<int64_t>(1, hi - kBatch + 1);
    for (int64_t x = hi; x >= lo; --x) {
      if ((x >> 1) != block) {
        block = x >> 1;
        r = math::philox4x32(static_cast<uint64_t>(block), epoch, key);
      }
      const uint64_t bits = (x & 1) ? (uint64_t{r.v[2]} | (uint64_t{r.v[3]} << 32))
                                    : (uint64_t{r.v[0]} | (uint64_t{r.v[1]} << 32));
      const auto u = static_cast<int64_t>(
          (static_cast<unsigned __int128>(bits) * static_cast<unsigned __int128>(x + 1)) >> 64);
      target[hi - x] = u;
      __builtin_prefetch(&perm[u], 1);
    }
    for (int64_t x = hi; x >= lo; --x) std::swap(perm[x], perm[target[hi - x]]);
  }
}

}  // namespace

ShuffledSamples::ShuffledSamples(std::shared_ptr<SampleSource> source, uint64_t seed)
    : source_(std::move(source)), seed_(seed) {
  TETRA_CHECK(source_ != nullptr, "null source");
  n_ = source_->num_samples();
  TETRA_INPUT_CHECK(n_ >= 1 && n_ < (int64_t{1} << 32),
                    "cannot shuffle {} samples (at most 2^32 - 1): {}", n_, source_->describe());
}

int64_t ShuffledSamples::source_index(int64_t g) {
  TETRA_CHECK(g >= 0, "shuffled sample {}", g);
  const int64_t epoch = g / n_, j = g % n_;
  if (epoch != cached_epoch_) {
    shuffle_permutation(perm_, n_, mix64(seed_ ^ kShuffleSalt), static_cast<uint64_t>(epoch));
    cached_epoch_ = epoch;
  }
  return perm_[j];
}

void ShuffledSamples::sample(int64_t g, int32_t* out) { source_->sample(source_index(g), out); }

std::string ShuffledSamples::describe() const {
  return fmt::format("shuffled (seed {}, new order every {} samples) {}", seed_, n_,
                     source_->describe());
}

}  // namespace tetra
