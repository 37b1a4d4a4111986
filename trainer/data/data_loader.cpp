// DataLoader (Megatron's pretraining sampler order) and the config -> sample-source factory.
#include "trainer/data/data_loader.h"

#include <string>
#include <vector>

#include "kernels/common/check.h"

namespace tetra {

DataLoader::DataLoader(std::shared_ptr<SampleSource> source, int64_t seq_len,
                       int64_t micro_batch_size, int64_t dp_rank, int64_t dp_size)
    : source_(std::move(source)),
      seq_len_(seq_len),
      micro_batch_size_(micro_batch_size),
      dp_rank_(dp_rank),
      dp_size_(dp_size) {
  TETRA_CHECK(source_ != nullptr, "DataLoader without a source");
  TETRA_CHECK(source_->seq_len() == seq_len_, "source seq_len {} != loader seq_len {}",
              source_->seq_len(), seq_len_);
  TETRA_CHECK(micro_batch_size_ >= 1, "micro_batch_size {}", micro_batch_size_);
  TETRA_CHECK(dp_size_ >= 1 && dp_rank_ >= 0 && dp_rank_ < dp_size_, "dp_rank {} of dp_size {}",
              dp_rank_, dp_size_);
}

void DataLoader::next(int32_t* tokens) {
  const int64_t first = consumed_ + dp_rank_ * micro_batch_size_;
  for (int64_t b = 0; b < micro_batch_size_; ++b)
    source_->sample(first + b, tokens + b * (seq_len_ + 1));
  consumed_ += micro_batch_size_ * dp_size_;
}

void DataLoader::set_consumed_samples(int64_t consumed) {
  TETRA_CHECK(consumed >= 0, "consumed samples {}", consumed);
  consumed_ = consumed;
}

namespace {

// Validation must never read training's shuffle order: its seed is derived, not shared.
constexpr uint64_t kValidSeedSalt = 0x56414C4944415445ull;  // "VALIDATE"

// One IndexedSamples per entry of `list` (the whole dataset, or its data.split part `part` when
// part >= 0), blended by the entries' weights when there are several, shuffled with shuffle_seed.
std::shared_ptr<SampleSource> make_indexed_stack(const Config& cfg,
                                                 const std::vector<DataSource>& list,
                                                 const char* key, int part, uint64_t shuffle_seed,
                                                 int64_t total_samples) {
  std::vector<double> split_weights;
  if (part >= 0) {
    split_weights = parse_data_split(cfg.data.split);
    TETRA_CHECK(split_weights.size() == 3, "data.split \"{}\" passed validation but does not parse",
                cfg.data.split);
  }
  std::vector<std::shared_ptr<SampleSource>> sources;
  std::vector<double> weights;
  for (size_t i = 0; i < list.size(); ++i) {
    try {
      auto ds = std::make_shared<const IndexedDataset>(IndexedDataset::open(list[i].path));
      if (part < 0) {
        sources.push_back(std::make_shared<IndexedSamples>(std::move(ds), cfg.model.seq_len,
                                                           cfg.model.vocab_size));
      } else {
        const auto bounds = split_document_bounds(split_weights, ds->num_documents());
        DocumentRange range{bounds[part], bounds[part + 1], cfg.data.split, part};
        sources.push_back(std::make_shared<IndexedSamples>(std::move(ds), cfg.model.seq_len,
                                                           cfg.model.vocab_size, std::move(range)));
      }
    } catch (const InputError& e) {
      // Say which config entry it was: the same file may be listed under train and valid.
      throw InputError(fmt::format("{}[{}] (path '{}'): {}", key, i, list[i].path, e.what()));
    }
    weights.push_back(list[i].weight);
  }
  // Each dataset is shuffled on its own, then the blend interleaves them (Megatron's order: each
  // GPTDataset shuffles, the BlendedDataset interleaves). Every table is then bounded by the
  // datasets' sizes: a shuffle over the blend would be a permutation of total_samples entries,
  // proportional to training.steps. Dataset i's seed is shuffle_seed + i (ShuffledSamples mixes
  // it), so a single dataset is shuffled with shuffle_seed itself.
  if (sources.size() == 1) return std::make_shared<ShuffledSamples>(sources[0], shuffle_seed);
  for (size_t i = 0; i < sources.size(); ++i)
    sources[i] = std::make_shared<ShuffledSamples>(std::move(sources[i]), shuffle_seed + i);
  try {
    return std::make_shared<BlendedSamples>(std::move(sources), std::move(weights),
                                            total_samples);
  } catch (const InputError& e) {
    throw InputError(fmt::format("{}: {}", key, e.what()));
  }
}

}  // namespace

std::shared_ptr<SampleSource> make_train_source(const Config& cfg, int64_t total_samples) {
  if (cfg.data.synthetic)
    return std::make_shared<SyntheticSamples>(cfg.model.vocab_size, cfg.model.seq_len,
                                              cfg.training.seed, /*stream=*/0);
  TETRA_INPUT_CHECK(!cfg.data.train.empty(),
                    "data.train is empty and data.synthetic is false: list at least one dataset "
                    "prefix (PREFIX.bin + PREFIX.idx) or set data.synthetic to true");
  const int part = cfg.data.split.empty() ? -1 : 0;
  return make_indexed_stack(cfg, cfg.data.train, "data.train", part, cfg.training.seed,
                            total_samples);
}

std::shared_ptr<SampleSource> make_valid_source(const Config& cfg, int64_t total_samples) {
  if (cfg.data.synthetic)
    return std::make_shared<SyntheticSamples>(cfg.model.vocab_size, cfg.model.seq_len,
                                              cfg.training.seed, /*stream=*/1);
  const uint64_t seed = cfg.training.seed ^ kValidSeedSalt;
  if (!cfg.data.split.empty())  // validation guarantees data.valid is empty
    return make_indexed_stack(cfg, cfg.data.train, "data.train", /*part=*/1, seed, total_samples);
  if (cfg.data.valid.empty()) return nullptr;
  return make_indexed_stack(cfg, cfg.data.valid, "data.valid", /*part=*/-1, seed, total_samples);
}

}  // namespace tetra
