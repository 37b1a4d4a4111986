// Per-data-parallel-rank micro-batches, and the sample-source stack built from the config.
//
// Order (Megatron's pretraining sampler): with c samples consumed, one step of micro-batches on
// all DP ranks reads global samples [c, c + mbs * dp); rank r takes [c + r*mbs, c + (r+1)*mbs),
// then c += mbs * dp. So the samples of a global batch are the same set whatever dp is, the order
// is a pure function of c (resume = set_consumed_samples), and a checkpoint taken at dp = 4
// resumes at dp = 2 on exactly the next samples.
#pragma once

#include <cstdint>
#include <memory>

#include "trainer/config/config.h"
#include "trainer/data/sample_source.h"

namespace tetra {

class DataLoader {
 public:
  DataLoader(std::shared_ptr<SampleSource> source, int64_t seq_len, int64_t micro_batch_size,
             int64_t dp_rank, int64_t dp_size);

  // tokens: (micro_batch_size, seq_len + 1), row b = global sample c + dp_rank*mbs + b.
  void next(int32_t* tokens);

  int64_t consumed_samples() const { return consumed_; }
  void set_consumed_samples(int64_t consumed);

  int64_t seq_len() const { return seq_len_; }
  int64_t micro_batch_size() const { return micro_batch_size_; }
  SampleSource& source() const { return *source_; }

 private:
  std::shared_ptr<SampleSource> source_;
  int64_t seq_len_;
  int64_t micro_batch_size_;
  int64_t dp_rank_;
  int64_t dp_size_;
  int64_t consumed_ = 0;  // global samples consumed by all DP ranks together
};

// data.synthetic: SyntheticSamples(vocab, seq_len, training.seed, stream 0).
// Otherwise data.train: one IndexedSamples per entry, each in a ShuffledSamples (entry i seeded
// with training.seed + i), and a BlendedSamples over them (with their weights, for
// total_samples) when there are several. No table grows with total_samples: the shuffles are
// bounded by the datasets' sizes, the blend is computed lazily. With data.split, each entry contributes only its train part (documents
// [0, a) of split_document_bounds). InputError when the list is empty or a dataset (or its
// part) is bad.
std::shared_ptr<SampleSource> make_train_source(const Config& cfg, int64_t total_samples);

// The same for validation: synthetic stream 1 (same Markov table as training, other samples);
// with data.split, the valid part (documents [a, b)) of every data.train entry, blended with the
// same weights; otherwise data.valid. Shuffled with a seed derived from training.seed. nullptr
// when there is no validation data (data.valid empty, no data.split, not synthetic).
std::shared_ptr<SampleSource> make_valid_source(const Config& cfg, int64_t total_samples);

}  // namespace tetra
