#include "trainer/model/sampler.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "kernels/common/math.h"
#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"
#include "trainer/model/gpt.h"

namespace tetra {

namespace {

// Philox stream of the sampling draws (distinct from the parameter-initialisation streams, which
// are keyed by parameter names).
uint64_t sampling_stream() { return math::fnv1a64("tetra.sampling"); }

}  // namespace

double sampling_uniform(uint64_t seed, uint64_t i) {
  const math::Philox4 r = math::philox4x32(i, sampling_stream(), seed);
  // 53 bits (a double's mantissa) from two 32-bit words, offset by half a step: never 0 or 1.
  const uint64_t bits = (static_cast<uint64_t>(r.v[0]) << 21) | (r.v[1] >> 11);
  return (static_cast<double>(bits) + 0.5) * 0x1.0p-53;
}

int32_t sample_token(std::span<const float> logits, double temperature, int64_t top_k, double u) {
  const int64_t V = static_cast<int64_t>(logits.size());
  TETRA_CHECK(V > 0 && V <= std::numeric_limits<int32_t>::max(), "sampling from {} logits", V);
  TETRA_CHECK(temperature >= 0 && top_k >= 0 && u > 0 && u < 1,
              "sampling with temperature {}, top_k {}, draw {}", temperature, top_k, u);
  for (int64_t i = 0; i < V; ++i)
    if (std::isnan(logits[i]))
      throw Error(fmt::format("sampling: logit {} of {} is NaN (the model has diverged)", i, V));
  auto argmax = [&]() {
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (logits[i] > logits[best]) best = i;
    return static_cast<int32_t>(best);
  };
  if (temperature == 0) return argmax();

  // Candidates: the top_k largest logits (ties towards lower indices), or every token.
  const int64_t k = top_k == 0 || top_k >= V ? V : top_k;
  std::vector<int32_t> cand(static_cast<size_t>(V));
  std::iota(cand.begin(), cand.end(), 0);
  if (k < V) {
    std::partial_sort(cand.begin(), cand.begin() + k, cand.end(), [&](int32_t a, int32_t b) {
      return logits[a] > logits[b] || (logits[a] == logits[b] && a < b);
    });
    cand.resize(static_cast<size_t>(k));
  }
  double max_logit = -std::numeric_limits<double>::infinity();
  for (int32_t c : cand) max_logit = std::max(max_logit, static_cast<double>(logits[c]));
  if (!std::isfinite(max_logit)) return argmax();  // +inf dominates; all -inf: nothing to weigh

  // softmax(logits / temperature) over the candidates, unnormalised, in double; then the first
  // candidate whose cumulative weight exceeds u * total.
  std::vector<double> weight(cand.size());
  double total = 0.0;
  for (size_t j = 0; j < cand.size(); ++j) {
    weight[j] = std::exp((static_cast<double>(logits[cand[j]]) - max_logit) / temperature);
    total += weight[j];
  }
  const double target = u * total;
  double acc = 0.0;
  size_t last_positive = 0;
  for (size_t j = 0; j < cand.size(); ++j) {
    if (weight[j] <= 0.0) continue;
    acc += weight[j];
    last_positive = j;
    if (target < acc) return cand[j];
  }
  return cand[last_positive];  // u * total rounded above the final sum
}

Sampler::Sampler(Gpt& model, Backend& be, Communicator* tp, Communicator* ep)
    : model_(model), be_(be), tp_(tp && tp->size() > 1 ? tp : nullptr), ep_(ep && ep->size() > 1 ? ep : nullptr) {
  const ModelDims& d = model.dims();
  TETRA_CHECK(d.B == 1, "the sampling model must be built with micro_batch 1, not {}", d.B);
  TETRA_CHECK(d.tp == (tp_ ? tp_->size() : 1), "the sampling model is split over {} ranks, its group has {}",
              d.tp, tp_ ? tp_->size() : 1);
  tokens_buf_ = BackendBuffer(be_, static_cast<size_t>(d.T) * 4);
  row_buf_ = BackendBuffer(be_, static_cast<size_t>(d.Vl) * 4);
  if (tp_) full_buf_ = BackendBuffer(be_, static_cast<size_t>(d.Vl * d.tp) * 4);
  if (ep_) choice_buf_ = BackendBuffer(be_, 4);
  tokens_ = tokens_buf_.as<int32_t>();
  row_ = row_buf_.as<float>();
  full_ = tp_ ? full_buf_.as<float>() : row_;
  be_.memset_zero(row_, static_cast<size_t>(d.Vl) * 4);  // the padding's entries, gathered, never read
  host_tokens_.resize(static_cast<size_t>(d.T));
  host_row_.resize(static_cast<size_t>(d.Vl * d.tp));
}

Sampler::~Sampler() = default;

std::vector<int32_t> Sampler::generate(const void* weights, std::span<const int32_t> context,
                                       const SampleConfig& s, int32_t eod, int64_t vocab_limit) {
  const ModelDims& d = model_.dims();
  const int64_t T = d.T, V = d.V;  // V: this rank's real vocabulary rows, of the Vl it holds
  TETRA_CHECK(!context.empty(), "sampling needs a context of at least one token");
  TETRA_CHECK(vocab_limit > 0 && vocab_limit <= d.Vg, "sampling below id {} from a vocabulary of {}",
              vocab_limit, d.Vg);
  const size_t act_size = dtype_size(model_.act());
  std::vector<int32_t> ids(context.begin(), context.end());
  std::vector<int32_t> out;
  for (int64_t i = 0; i < s.max_tokens; ++i) {
    // The last T ids at positions 0..n-1; filler (id 0) after them, which row n-1 never sees.
    const int64_t n = std::min<int64_t>(static_cast<int64_t>(ids.size()), T);
    std::fill(host_tokens_.begin(), host_tokens_.end(), 0);
    std::copy(ids.end() - n, ids.end(), host_tokens_.begin());
    be_.copy_from_host(tokens_, host_tokens_.data(), static_cast<size_t>(T) * 4);
    model_.forward_logits(weights, tokens_);
    // Row n-1 of this rank's (T, V) slice, as fp32; then the whole row, vocabulary slices in
    // TP-rank order (rank r holds ids [r Vl, r Vl + V): the row is indexed by id, and the last
    // rank's padding, past id Vg, is never read).
    const char* row = static_cast<const char*>(model_.logits()) + static_cast<size_t>((n - 1) * V) * act_size;
    be_.cast(row_, DType::F32, row, model_.act(), V);
    if (tp_) tp_->all_gather(full_, row_, d.Vl, DType::F32);
    be_.copy_to_host(host_row_.data(), full_, host_row_.size() * 4);
    int32_t token = sample_token(std::span<const float>(host_row_.data(), static_cast<size_t>(vocab_limit)),
                                 s.temperature, s.top_k, sampling_uniform(s.seed, static_cast<uint64_t>(i)));
    if (ep_) {  // EP rank 0's choice on every rank: the next forward is collective over the group
      be_.copy_from_host(choice_buf_.get(), &token, 4);
      ep_->broadcast(choice_buf_.get(), 1, DType::I32, 0);
      be_.copy_to_host(&token, choice_buf_.get(), 4);
    }
    if (token == eod) break;
    out.push_back(token);
    ids.push_back(token);
  }
  return out;
}

}  // namespace tetra
