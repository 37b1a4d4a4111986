#include "trainer/optim/compressed_exchange.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"

namespace tetra {

namespace {

// Appends [b, e) to `out`, merging with the last range when adjacent.
void add_range(std::vector<GradRange>& out, int64_t b, int64_t e) {
  if (b >= e) return;
  if (!out.empty() && out.back().offset + out.back().numel == b)
    out.back().numel += e - b;
  else
    out.push_back(GradRange{b, e - b});
}

// `excluded` (sorted ranges of y) as ranges of the compact buffer that holds
// `ranges` back to back.
std::vector<GradRange> compact_within(const std::vector<GradRange>& excluded, const std::vector<GradRange>& ranges) {
  std::vector<GradRange> out;
  int64_t compact = 0;
  for (const GradRange& r : ranges) {
    for (const GradRange& q : excluded) {
      const int64_t b = std::max(r.offset, q.offset), e = std::min(r.offset + r.numel, q.offset + q.numel);
      if (b < e) out.push_back(GradRange{compact + b - r.offset, e - b});
    }
    compact += r.numel;
  }
  return out;
}

void zero_ranges(float* buf, const std::vector<GradRange>& ranges) {
  for (const GradRange& r : ranges) std::fill(buf + r.offset, buf + r.offset + r.numel, 0.0f);
}

}  // namespace

ExchangePlan plan_exchange(const Config& cfg, const ParamLayout& part, int64_t size) {
  ExchangePlan plan;
  if (part.groups.empty()) return plan;
  plan.begin = part.groups.front().first;
  plan.end = part.groups.back().second;
  plan.sharded = cfg.parallel.distributed_optimizer && size > 1;
  plan.codec = cfg.parallel.grad_compression == GradCompression::INT8 ? Codec::INT8 : Codec::SIGN;
  const bool tied_across_stages = cfg.model.tie_embeddings && cfg.parallel.pp > 1;
  for (const ParamSpec& p : part.params) {
    if (tied_across_stages && p.name == "embedding.wte") {
      plan.tied_offset = p.offset;
      plan.tied_numel = p.numel;
    } else if (cfg.parallel.tp > 1 && !p.tp_split) {
      plan.exact.push_back(GradRange{p.offset, p.numel});
      plan.exact_numel += p.numel;
    }
  }
  const int64_t align = 16 * size;
  auto padded = [align](int64_t n) { return (n + align - 1) / align * align; };
  std::vector<GradRange> pieces;  // y ranges
  int64_t y = 0;
  auto add_segment = [&](int64_t b, int64_t e) {
    if (b >= e) return;
    plan.segments.push_back(ExchangeSegment{b, y, e - b});
    y += e - b;
  };
  const std::vector<BucketPlan> buckets = plan_buckets(part, cfg.parallel.bucket_size);
  for (auto it = buckets.rbegin(); it != buckets.rend(); ++it) {  // buffer order
    const int64_t start = y;
    if (plan.sharded || plan.tied_offset < 0) {
      add_segment(it->begin, it->end);
    } else {  // the bucket without the tied embedding
      add_segment(it->begin, std::min(it->end, std::max(it->begin, plan.tied_offset)));
      add_segment(std::max(it->begin, std::min(it->end, plan.tied_offset + plan.tied_numel)), it->end);
    }
    y = start + padded(y - start);
    if (y > start) pieces.push_back(GradRange{start, y - start});
  }
  if (plan.tied_offset >= 0) {
    const int64_t start = y;
    add_segment(plan.tied_offset, plan.tied_offset + plan.tied_numel);
    y = start + padded(plan.tied_numel);
    pieces.push_back(GradRange{start, y - start});
  }
  plan.y_numel = y;
  plan.chunks = plan_chunks(pieces, size, plan.codec);
  if (plan.tied_offset >= 0) {
    plan.chunks.pieces.back().rng_id = 0xFFFF;  // the same on both stages
    plan.tied_words = plan.chunks.words - plan.chunks.pieces.back().offset;
  }
  return plan;
}

CompressedExchange::CompressedExchange(const Config& cfg, const ParamLayout& part, const GradBuffer& buffer,
                                       Communicator* group, const std::string& key, int part_id)
    : cfg_(cfg), group_(group && group->size() > 1 ? group : nullptr), key_(key) {
  plan_ = plan_exchange(cfg, part, group_ ? group_->size() : 1);
  // The optimizer state is sharded when the dense part's is (the DP group is the larger one).
  momentum_ = plan_.codec == Codec::SIGN && !(cfg.parallel.distributed_optimizer && cfg.parallel.dp_cp() > 1);
  if (!group_ || plan_.end == plan_.begin) return;
  TETRA_CHECK(buffer.sharded() == plan_.sharded, "the part's optimizer state is {} but the exchange expects it {}",
              buffer.sharded() ? "sharded" : "whole", plan_.sharded ? "sharded" : "whole");
  // Every rank and part rounds with its own numbers; the same group rank on another pipeline stage
  // (the tied piece's other holder) with the same ones.
  rounding_key_ = cfg.training.seed ^ (0x9E3779B97F4A7C15ull * static_cast<uint64_t>(1 + part_id * 65536 +
                                                                                      group_->rank()));
  const bool tied = plan_.tied_offset >= 0;
  mine_ = plan_.chunks.owned(group_->rank());
  for (const GradRange& r : mine_) mine_numel_ += r.numel;
  tied_mine_at_ = mine_numel_ - (tied ? mine_.back().numel : 0);
  // The optimizer's ranges: this rank's shards of the buckets (distributed optimizer: y is the
  // part itself up to the tied piece), or the whole part in order.
  const std::vector<GradRange>& owned = buffer.owned();
  if (plan_.sharded) {
    TETRA_CHECK(owned.size() + (tied ? 1 : 0) == mine_.size(), "the optimizer owns {} ranges, the 1-bit plan {}",
                owned.size(), mine_.size());
    for (size_t i = 0; i < owned.size(); ++i)
      TETRA_CHECK(owned[i].offset == plan_.begin + mine_[i].offset && owned[i].numel == mine_[i].numel,
                  "the optimizer's shard {} [{}, +{}) is not the 1-bit plan's [{}, +{})", i, owned[i].offset,
                  owned[i].numel, plan_.begin + mine_[i].offset, mine_[i].numel);
  } else {
    int64_t at = plan_.begin;
    for (const GradRange& r : owned) {
      TETRA_CHECK(r.offset == at, "the optimizer's ranges are not the whole part in order (range at {}, expected {})",
                  r.offset, at);
      at += r.numel;
    }
    TETRA_CHECK(at == plan_.end, "the optimizer holds [{}, {}) of the part [{}, {})", plan_.begin, at, plan_.begin,
                plan_.end);
  }
  // Zeros in y: what no segment fills (piece padding), and within the segments the padding
  // between parameters, the TP replicas and (in its bucket) the tied embedding.
  {
    std::vector<GradRange> zero_buf;  // buffer ranges
    std::vector<GradRange> special = plan_.exact;
    if (tied) special.push_back(GradRange{plan_.tied_offset, plan_.tied_numel});
    auto by_offset = [](const GradRange& a, const GradRange& b) { return a.offset < b.offset; };
    std::sort(special.begin(), special.end(), by_offset);
    int64_t at = plan_.begin;
    size_t x = 0;
    for (const ParamSpec& p : part.params) {
      add_range(zero_buf, at, p.offset);
      if (x < special.size() && special[x].offset == p.offset)
        add_range(zero_buf, p.offset, p.offset + special[x++].numel);
      at = std::max(at, p.offset + p.numel);
    }
    add_range(zero_buf, at, plan_.end);
    int64_t y = 0;
    for (size_t i = 0; i < plan_.segments.size(); ++i) {
      const ExchangeSegment& s = plan_.segments[i];
      add_range(excluded_y_, y, s.y);
      const bool tied_segment = tied && i + 1 == plan_.segments.size();
      for (const GradRange& z : zero_buf) {
        if (tied_segment) break;  // the tied piece holds the embedding itself
        const int64_t b = std::max(z.offset, s.buf), e = std::min(z.offset + z.numel, s.buf + s.numel);
        if (b < e) add_range(excluded_y_, s.y + b - s.buf, s.y + e - s.buf);
      }
      y = s.y + s.numel;
    }
    add_range(excluded_y_, y, plan_.y_numel);
    std::sort(excluded_y_.begin(), excluded_y_.end(), by_offset);
  }
  excluded_mine_ = compact_within(excluded_y_, mine_);
  if (tied) {
    const ChunkPlan::Piece& piece = plan_.chunks.pieces.back();
    tied_only_.dp = plan_.chunks.dp;
    tied_only_.pieces = {ChunkPlan::Piece{piece.begin, piece.shard, 0, piece.rng_id}};
    tied_only_.codec = plan_.chunks.codec;
    tied_only_.words = plan_.tied_words;
  }
  const size_t words = static_cast<size_t>(plan_.chunks.dp * plan_.chunks.words);
  y_.assign(static_cast<size_t>(plan_.y_numel), 0.0f);
  worker_error_.assign(static_cast<size_t>(plan_.y_numel), 0.0f);
  server_error_.assign(static_cast<size_t>(mine_numel_), 0.0f);
  avg_.assign(static_cast<size_t>(mine_numel_), 0.0f);
  exact_sum_.assign(static_cast<size_t>(plan_.exact_numel), 0.0f);
  send_.assign(words, 0);
  recv_.assign(words, 0);
}

void CompressedExchange::exchange(float* grads, const float* m, const float* v, int64_t step) {
  const int64_t n = plan_.end - plan_.begin;
  if (n == 0) return;
  const float b1 = static_cast<float>(cfg_.optimizer.beta1);
  float* g = grads + plan_.begin;
  if (!group_) {  // nothing to exchange: the gradient is this rank's alone
    if (momentum_)
      for (int64_t k = 0; k < n; ++k) g[k] = b1 * m[plan_.begin + k] + (1.0f - b1) * g[k];
    return;
  }
  const int64_t p = group_->size();
  // onebit: Adam's frozen denominator d = sqrt(v / (1 - beta2^W)) + eps, as math::adamw_update
  // forms it; int8: 1.
  const double warmup = static_cast<double>(cfg_.parallel.onebit_warmup_steps);
  const float bc2 = static_cast<float>(1.0 - std::pow(cfg_.optimizer.beta2, warmup));
  const float eps = static_cast<float>(cfg_.optimizer.eps);
  const bool scaled = plan_.codec == Codec::SIGN;
  auto denom = [&](int64_t k) { return scaled ? std::sqrt(v[k] / bc2) + eps : 1.0f; };  // k: buffer offset
  const Rounding worker_rounding{rounding_key_, static_cast<uint64_t>(step) * 2, 0};
  const Rounding server_rounding{rounding_key_, static_cast<uint64_t>(step) * 2 + 1, 0};

  // x_i: the momentum estimate b1 m + (1 - b1) p g_i, or p g_i (its mean over the group is the
  // reduced gradient: the gradients are pre-scaled to sum to it).
  if (momentum_) {
    const float c = (1.0f - b1) * static_cast<float>(p);
    const float* mp = m + plan_.begin;
    for (int64_t k = 0; k < n; ++k) g[k] = b1 * mp[k] + c * g[k];
  } else {
    const float s = static_cast<float>(p);
    for (int64_t k = 0; k < n; ++k) g[k] *= s;
  }
  // TP replicas: the exact mean of x_i, all-reduced in fp32.
  int64_t at = 0;
  for (const GradRange& r : plan_.exact) {
    std::copy(grads + r.offset, grads + r.offset + r.numel, exact_sum_.data() + at);
    at += r.numel;
  }
  if (plan_.exact_numel > 0) group_->all_reduce(exact_sum_.data(), plan_.exact_numel, DType::F32, ReduceOp::SUM);
  // y_i = x_i / d in y's layout, the excluded elements zero.
  for (const ExchangeSegment& s : plan_.segments)
    for (int64_t i = 0; i < s.numel; ++i) y_[s.y + i] = grads[s.buf + i] / denom(s.buf + i);
  zero_ranges(y_.data(), excluded_y_);

  // Worker stage: compressed shards to their owners (a compressed reduce-scatter).
  exchange_worker_compress(plan_.chunks, y_.data(), worker_error_.data(), send_.data(), worker_rounding);
  zero_ranges(worker_error_.data(), excluded_y_);
  const int64_t words = plan_.chunks.words;
  std::vector<int64_t> counts(static_cast<size_t>(p), words), offsets(static_cast<size_t>(p));
  for (int64_t r = 0; r < p; ++r) offsets[static_cast<size_t>(r)] = r * words;
  group_->all_to_all_v(send_.data(), counts, offsets, recv_.data(), counts, offsets, DType::BF16);
  exchange_server_average(plan_.chunks, recv_.data(), avg_.data());
  zero_ranges(avg_.data(), excluded_mine_);

  // Back from y units (x = d y) into the buffer: the segments' elements of y, then the replicas.
  auto put = [&](const ExchangeSegment& s) {
    for (int64_t i = 0; i < s.numel; ++i) grads[s.buf + i] = y_[s.y + i] * denom(s.buf + i);
  };
  auto put_exact = [&] {
    const float inv_p = 1.0f / static_cast<float>(p);
    int64_t k = 0;
    for (const GradRange& r : plan_.exact)
      for (int64_t i = 0; i < r.numel; ++i) grads[r.offset + i] = exact_sum_[k++] * inv_p;
  };
  const bool tied = plan_.tied_offset >= 0;
  if (plan_.sharded) {
    // The owner's gradient estimate, into its shards of the buffer (the optimizer's ranges; y is
    // the part itself there).
    at = 0;
    for (size_t j = 0; j + (tied ? 1 : 0) < mine_.size(); ++j) {
      const GradRange& r = mine_[j];
      for (int64_t i = 0; i < r.numel; ++i) {
        const int64_t k = plan_.begin + r.offset + i;
        grads[k] = avg_[at + i] * denom(k);
      }
      at += r.numel;
    }
    if (tied) {  // server stage of the tied piece: every rank decompresses the whole embedding's estimate
      exchange_server_compress(tied_only_, avg_.data() + tied_mine_at_, server_error_.data() + tied_mine_at_,
                               send_.data(), server_rounding);
      zero_ranges(server_error_.data(), excluded_mine_);
      group_->all_gather(recv_.data(), send_.data(), tied_only_.words, DType::BF16);
      exchange_gather_decompress(tied_only_, recv_.data(), y_.data());
      put(plan_.segments.back());
    }
    put_exact();
    return;
  }
  // Server stage: the averages, compressed again with the server error, to every rank.
  exchange_server_compress(plan_.chunks, avg_.data(), server_error_.data(), send_.data(), server_rounding);
  zero_ranges(server_error_.data(), excluded_mine_);
  group_->all_gather(recv_.data(), send_.data(), words, DType::BF16);
  exchange_gather_decompress(plan_.chunks, recv_.data(), y_.data());
  zero_ranges(y_.data(), excluded_y_);
  for (const ExchangeSegment& s : plan_.segments) put(s);  // x = d * decompressed y
  put_exact();
}

void CompressedExchange::add_extras(std::vector<CheckpointExtra>& out, const std::string& kind, float* data, int64_t y0,
                                int64_t numel) const {
  const bool tied = plan_.tied_offset >= 0;
  for (size_t i = 0; i < plan_.segments.size(); ++i) {
    const ExchangeSegment& s = plan_.segments[i];
    const int64_t b = std::max(y0, s.y), e = std::min(y0 + numel, s.y + s.numel);
    if (b >= e) continue;
    // Buffer ranges [lo, hi) of this overlap, less the tied embedding outside its own piece.
    std::vector<std::pair<int64_t, int64_t>> ranges = {{s.buf + b - s.y, s.buf + e - s.y}};
    if (tied && i + 1 < plan_.segments.size()) {
      const int64_t t0 = plan_.tied_offset, t1 = t0 + plan_.tied_numel;
      const auto [lo, hi] = ranges[0];
      ranges = {{lo, std::min(hi, std::max(lo, t0))}, {std::max(lo, std::min(hi, t1)), hi}};
    }
    for (const auto& [lo, hi] : ranges) {
      if (lo >= hi) continue;
      CheckpointExtra x;
      x.kind = kind;
      x.data = data + (s.y + lo - s.buf - y0);
      x.ranges = {GradRange{lo, hi - lo}};
      x.host = true;
      out.push_back(std::move(x));
    }
  }
}

void CompressedExchange::checkpoint_state(std::vector<CheckpointExtra>& out) {
  if (!group_ || plan_.end == plan_.begin) return;
  const bool onebit = plan_.codec == Codec::SIGN;
  const std::string codec = onebit ? "onebit" : "int8";
  const std::string sharded = onebit && plan_.sharded ? "_sharded" : "";
  add_extras(out, fmt::format("optim/{}_worker_error/{}{}", codec, key_, sharded), worker_error_.data(), 0,
             plan_.y_numel);
  // The server error of an element is the residual of its average, whoever owns it: it reshards
  // over any group size. Distributed optimizer: the tied piece's only.
  int64_t at = 0;
  for (size_t j = 0; j < mine_.size(); ++j) {
    const bool tied_shard = plan_.tied_offset >= 0 && j + 1 == mine_.size();
    if (!plan_.sharded || tied_shard)
      add_extras(out, fmt::format("optim/{}_server_error{}", codec, sharded), server_error_.data() + at,
                 mine_[j].offset, mine_[j].numel);
    at += mine_[j].numel;
  }
}

}  // namespace tetra
