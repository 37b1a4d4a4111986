#include "trainer/optim/compression.h"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "kernels/common/math.h"
#include "kernels/common/check.h"

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

// Calls f(k, value) for the n decompressed elements of int8 `packed`.
template <class F>
void for_each_int8(const uint16_t* packed, int64_t n, F f) {
  const int64_t nb = blocks_of(n);
  const uint8_t* bytes = reinterpret_cast<const uint8_t*>(packed + 2 * nb);
  for (int64_t b = 0; b < nb; ++b) {
    const float step = get_scale(packed, b) / 127.0f;
    const int64_t end = std::min(n, (b + 1) * kSignBlock);
    for (int64_t k = b * kSignBlock; k < end; ++k) f(k, static_cast<float>(static_cast<int8_t>(bytes[k])) * step);
  }
}

}  // namespace

int64_t sign_packed_words(int64_t n) {
  TETRA_CHECK(n >= 0 && n % 16 == 0, "sign compression needs a multiple of 16 elements, got {}", n);
  return 2 * blocks_of(n) + n / 16;
}

int64_t int8_packed_words(int64_t n) {
  TETRA_CHECK(n >= 0 && n % 16 == 0, "int8 compression needs a multiple of 16 elements, got {}", n);
  return 2 * blocks_of(n) + n / 2;
}

int64_t packed_words(Codec codec, int64_t n) {
  return codec == Codec::INT8 ? int8_packed_words(n) : sign_packed_words(n);
}

void int8_compress(const float* x, float* error, int64_t n, uint16_t* packed, const Rounding& rounding) {
  const int64_t nb = blocks_of(n);
  uint8_t* bytes = reinterpret_cast<uint8_t*>(packed + 2 * nb);
  float v[kSignBlock];
  uint32_t random[4] = {0, 0, 0, 0};
  uint64_t drawn = ~uint64_t{0};  // the Philox block in `random`
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t begin = b * kSignBlock, len = std::min(n, begin + kSignBlock) - begin;
    float s = 0.0f;
    bool finite = true;
    for (int64_t k = 0; k < len; ++k) {
      v[k] = error ? x[begin + k] + error[begin + k] : x[begin + k];
      s = std::max(s, std::fabs(v[k]));
      finite = finite && std::isfinite(v[k]);
    }
    if (!finite) {  // a NaN scale: the block decompresses to NaN (the step guard skips the step),
      put_scale(packed, b, std::nanf(""));  // and its errors stay as they were
      std::memset(bytes + begin, 0, static_cast<size_t>(len));
      continue;
    }
    put_scale(packed, b, s);
    const float levels = s > 0.0f ? 127.0f / s : 0.0f, step = s / 127.0f;
    for (int64_t k = 0; k < len; ++k) {
      const uint64_t index = rounding.first + static_cast<uint64_t>(begin + k);
      if (index / 4 != drawn) {  // one Philox call gives four elements their numbers
        drawn = index / 4;
        const math::Philox4 r = math::philox4x32(drawn, rounding.stream, rounding.key);
        for (int i = 0; i < 4; ++i) random[i] = r.v[i];
      }
      const float u = math::uint_to_unit(random[index % 4]);
      const float q = std::min(127.0f, std::floor(std::fabs(v[k]) * levels + u));
      const int8_t signed_q = static_cast<int8_t>(v[k] < 0.0f ? -q : q);
      bytes[begin + k] = static_cast<uint8_t>(signed_q);
      if (error) error[begin + k] = v[k] - static_cast<float>(signed_q) * step;
    }
  }
}

void int8_decompress(const uint16_t* packed, int64_t n, float* out) {
  for_each_int8(packed, n, [out](int64_t k, float value) { out[k] = value; });
}

void int8_decompress_add(const uint16_t* packed, int64_t n, float alpha, float* out) {
  for_each_int8(packed, n, [out, alpha](int64_t k, float value) { out[k] += alpha * value; });
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

ChunkPlan plan_chunks(const std::vector<GradRange>& buckets, int64_t dp, Codec codec) {
  TETRA_CHECK(dp >= 1, "plan_chunks: dp {} must be >= 1", dp);
  ChunkPlan plan;
  plan.dp = dp;
  plan.codec = codec;
  for (const GradRange& b : buckets) {
    TETRA_CHECK(b.numel % (16 * dp) == 0,
                "bucket [{}, {}) of {} elements does not split into {} shards of a multiple of 16 elements",
                b.offset, b.offset + b.numel, b.numel, dp);
    ChunkPlan::Piece p;
    p.begin = b.offset;
    p.shard = b.numel / dp;
    p.offset = plan.words;
    p.rng_id = static_cast<uint16_t>(plan.pieces.size());
    plan.words += packed_words(codec, p.shard);
    plan.pieces.push_back(p);
  }
  return plan;
}

namespace {

// Piece `piece`'s call: its own stream, elements numbered from `first` within the piece.
void compress(const ChunkPlan& plan, const float* x, float* error, int64_t n, uint16_t* packed, Rounding rounding,
              const ChunkPlan::Piece& piece, uint64_t first) {
  rounding.stream = (rounding.stream << 16) | piece.rng_id;
  rounding.first = first;
  if (plan.codec == Codec::INT8)
    int8_compress(x, error, n, packed, rounding);
  else
    sign_compress(x, error, n, packed);
}

void decompress(const ChunkPlan& plan, const uint16_t* packed, int64_t n, float* out) {
  if (plan.codec == Codec::INT8)
    int8_decompress(packed, n, out);
  else
    sign_decompress(packed, n, out);
}

}  // namespace

void exchange_worker_compress(const ChunkPlan& plan, const float* x, float* worker_error, uint16_t* send,
                              const Rounding& rounding) {
  for (int64_t r = 0; r < plan.dp; ++r)
    for (size_t i = 0; i < plan.pieces.size(); ++i) {
      const ChunkPlan::Piece& p = plan.pieces[i];
      const int64_t begin = plan.shard_begin(i, r);
      compress(plan, x + begin, worker_error ? worker_error + begin : nullptr, p.shard,
               send + r * plan.words + p.offset, rounding, p, static_cast<uint64_t>(r * p.shard));
    }
}

void exchange_server_average(const ChunkPlan& plan, const uint16_t* recv, float* avg) {
  const float inv = 1.0f / static_cast<float>(plan.dp);
  int64_t at = 0;
  for (const ChunkPlan::Piece& p : plan.pieces) {
    float* out = avg + at;
    std::fill(out, out + p.shard, 0.0f);
    for (int64_t s = 0; s < plan.dp; ++s) {
      const uint16_t* packed = recv + s * plan.words + p.offset;
      if (plan.codec == Codec::INT8)
        int8_decompress_add(packed, p.shard, 1.0f, out);
      else
        sign_decompress_add(packed, p.shard, 1.0f, out);
    }
    for (int64_t k = 0; k < p.shard; ++k) out[k] *= inv;
    at += p.shard;
  }
}

void exchange_server_compress(const ChunkPlan& plan, float* avg, float* server_error, uint16_t* packed,
                              const Rounding& rounding) {
  int64_t at = 0;
  for (const ChunkPlan::Piece& p : plan.pieces) {
    compress(plan, avg + at, server_error ? server_error + at : nullptr, p.shard, packed + p.offset, rounding, p, 0);
    decompress(plan, packed + p.offset, p.shard, avg + at);
    at += p.shard;
  }
}

void exchange_gather_decompress(const ChunkPlan& plan, const uint16_t* gathered, float* out) {
  for (int64_t r = 0; r < plan.dp; ++r)
    for (size_t i = 0; i < plan.pieces.size(); ++i)
      decompress(plan, gathered + r * plan.words + plan.pieces[i].offset, plan.pieces[i].shard,
                 out + plan.shard_begin(i, r));
}

}  // namespace tetra
