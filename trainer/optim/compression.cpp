#include "trainer/optim/compression.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "trainer/core/check.h"

namespace tetra {

namespace {

int64_t blocks_of(int64_t n) { return (n + kSignBlock - 1) / kSignBlock; }

void put_scale(uint16_t* packed, int64_t block, float s) {
  uint32_t bits;
  std::memcpy(&bits, &s, 4);
  packed[2 * block] = static_cast<uint16_t>(bits & 0xFFFFu);
  packed[2 * block + 1] = static_cast<uint16_t>(bits >> 16);
}

float get_scale(const uint16_t* packed, int64_t block) {
  const uint32_t bits = static_cast<uint32_t>(packed[2 * block]) | (static_cast<uint32_t>(packed[2 * block + 1]) << 16);
  float s;
  std::memcpy(&s, &bits, 4);
  return s;
}

// Calls f(k, value) for the n decompressed elements of `packed`.
template <class F>
void for_each_decompressed(const uint16_t* packed, int64_t n, F f) {
  const int64_t nb = blocks_of(n);
  const uint16_t* signs = packed + 2 * nb;
  for (int64_t b = 0; b < nb; ++b) {
    const float s = get_scale(packed, b);
    const int64_t end = std::min(n, (b + 1) * kSignBlock);
    for (int64_t k = b * kSignBlock; k < end; ++k) {
      const bool positive = (signs[k >> 4] >> (k & 15)) & 1u;
      f(k, positive ? s : -s);
    }
  }
}

}  // namespace

int64_t sign_packed_words(int64_t n) {
  TETRA_CHECK(n >= 0 && n % 16 == 0, "sign compression needs a multiple of 16 elements, got {}", n);
  return 2 * blocks_of(n) + n / 16;
}

void sign_compress(const float* x, float* error, int64_t n, uint16_t* packed) {
  const int64_t nb = blocks_of(n);
  uint16_t* signs = packed + 2 * nb;
  std::memset(signs, 0, static_cast<size_t>(n / 16) * 2);
  float v[kSignBlock];
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t begin = b * kSignBlock, len = std::min(n, begin + kSignBlock) - begin;
    double abs_sum = 0.0;
    for (int64_t k = 0; k < len; ++k) {
      v[k] = error ? x[begin + k] + error[begin + k] : x[begin + k];
      abs_sum += std::fabs(v[k]);
    }
    const float s = static_cast<float>(abs_sum / static_cast<double>(len));
    put_scale(packed, b, s);
    for (int64_t k = 0; k < len; ++k) {
      const int64_t i = begin + k;
      const bool positive = v[k] >= 0.0f;
      if (positive) signs[i >> 4] = static_cast<uint16_t>(signs[i >> 4] | (1u << (i & 15)));
      if (error) error[i] = v[k] - (positive ? s : -s);
    }
  }
}

void sign_decompress(const uint16_t* packed, int64_t n, float* out) {
  for_each_decompressed(packed, n, [out](int64_t k, float value) { out[k] = value; });
}

void sign_decompress_add(const uint16_t* packed, int64_t n, float alpha, float* out) {
  for_each_decompressed(packed, n, [out, alpha](int64_t k, float value) { out[k] += alpha * value; });
}

std::vector<GradRange> ChunkPlan::owned(int64_t r) const {
  std::vector<GradRange> out;
  for (size_t i = 0; i < pieces.size(); ++i) out.push_back(GradRange{shard_begin(i, r), pieces[i].shard});
  return out;
}

ChunkPlan plan_chunks(const std::vector<GradRange>& buckets, int64_t dp) {
  TETRA_CHECK(dp >= 1, "plan_chunks: dp {} must be >= 1", dp);
  ChunkPlan plan;
  plan.dp = dp;
  for (const GradRange& b : buckets) {
    TETRA_CHECK(b.numel % (16 * dp) == 0,
                "bucket [{}, {}) of {} elements does not split into {} shards of a multiple of 16 elements",
                b.offset, b.offset + b.numel, b.numel, dp);
    ChunkPlan::Piece p;
    p.begin = b.offset;
    p.shard = b.numel / dp;
    p.offset = plan.words;
    plan.words += sign_packed_words(p.shard);
    plan.pieces.push_back(p);
  }
  return plan;
}

ChunkPlan plan_chunks(const ParamLayout& layout, int64_t bucket_size, int64_t dp) {
  std::vector<GradRange> ranges;
  const std::vector<BucketPlan> buckets = plan_buckets(layout, bucket_size);
  for (auto it = buckets.rbegin(); it != buckets.rend(); ++it)  // buffer order
    ranges.push_back(GradRange{it->begin, it->end - it->begin});
  return plan_chunks(ranges, dp);
}

void onebit_worker_compress(const ChunkPlan& plan, const float* x, float* worker_error, uint16_t* send) {
  for (int64_t r = 0; r < plan.dp; ++r)
    for (size_t i = 0; i < plan.pieces.size(); ++i) {
      const int64_t at = plan.shard_begin(i, r);
      sign_compress(x + at, worker_error ? worker_error + at : nullptr, plan.pieces[i].shard,
                    send + r * plan.words + plan.pieces[i].offset);
    }
}

void onebit_server_average(const ChunkPlan& plan, const uint16_t* recv, float* avg) {
  const float inv = 1.0f / static_cast<float>(plan.dp);
  int64_t at = 0;
  for (const ChunkPlan::Piece& p : plan.pieces) {
    float* out = avg + at;
    std::fill(out, out + p.shard, 0.0f);
    for (int64_t s = 0; s < plan.dp; ++s) sign_decompress_add(recv + s * plan.words + p.offset, p.shard, 1.0f, out);
    for (int64_t k = 0; k < p.shard; ++k) out[k] *= inv;
    at += p.shard;
  }
}

void onebit_server_compress(const ChunkPlan& plan, float* avg, float* server_error, uint16_t* packed) {
  int64_t at = 0;
  for (const ChunkPlan::Piece& p : plan.pieces) {
    sign_compress(avg + at, server_error ? server_error + at : nullptr, p.shard, packed + p.offset);
    sign_decompress(packed + p.offset, p.shard, avg + at);
    at += p.shard;
  }
}

void onebit_gather_decompress(const ChunkPlan& plan, const uint16_t* gathered, float* out) {
  for (int64_t r = 0; r < plan.dp; ++r)
    for (size_t i = 0; i < plan.pieces.size(); ++i)
      sign_decompress(gathered + r * plan.words + plan.pieces[i].offset, plan.pieces[i].shard,
                      out + plan.shard_begin(i, r));
}

}  // namespace tetra
