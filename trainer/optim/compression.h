// Compression of fp32 vectors with error feedback (1-bit signs, or stochastically rounded int8),
// and the layout of compressed chunks on the data-parallel wire (parallel.grad_compression onebit
// and int8; trainer/optim/compressed_exchange.h uses them).
//
// The compressor (Seide et al. 2014; Tang et al. 2021, 1-bit Adam) maps a block of up to
// kSignBlock elements x to one fp32 scale s = mean |x| and one sign bit per element:
//   C(x)_k = s * (x_k >= 0 ? +1 : -1).
// s = mean |x| minimises || x - s * sign(x) ||_2 over s. With error feedback the compressor is
// applied to x + e, and e <- (x + e) - C(x + e): whatever one step's compression dropped is added
// to the next step's input, so the sum of the decompressed values over T steps equals the exact
// sum minus the last error, whose size does not grow with T. Without error feedback the per-step
// bias (the sign compressor is biased) accumulates linearly in T (tests/unit/test_compression.cpp
// asserts both).
//
// Wire format of n elements (n a multiple of 16), in 16-bit words (the transport moves them as raw
// 2-byte elements, DType::BF16, with no arithmetic): first the ceil(n / kSignBlock) fp32 scales (2
// words each, little-endian halves), then n / 16 words of sign bits, element k in bit k % 16 of
// word k / 16 (1 = non-negative). That is 1 bit per element plus 32 bits per block.
//
// The int8 compressor (QSGD, Alistarh et al. 2017, with 127 levels per sign and error feedback)
// maps a block of up to kSignBlock elements v = x + e to one fp32 scale s = max |v| and one signed
// byte per element, q_k = sign(v_k) floor(127 |v_k| / s + u_k) with u_k uniform in (0, 1):
// stochastic rounding to the neighbouring levels, E[q_k s / 127] = v_k (unbiased), |q_k| <= 127.
// u_k is Philox (kernels/common/math.h) of the caller's (seed, stream) and the element's index, so
// a run is deterministic given the seed and resumes bit-exactly. Error feedback as above.
// Wire format of n elements: the fp32 scales (2 words each), then n / 2 words, element k in byte
// k % 2 (low byte first) of word k / 2, as two's complement: 8 bits per element plus 32 per block,
// 74.6% less than fp32.
//
// ChunkPlan: the gradient buffer is split into buckets (grad_buffer.h); bucket b of S_b elements
// has dp equal shards of S_b / dp elements, shard r belonging to DP rank r (the distributed
// optimizer's ownership, used for both modes). Destination r's message is the concatenation over
// buckets of its compressed shards; every destination's message has the same size, `words`.
//
// These are host-memory loops (the CPU backend's buffers are host memory); they are simple enough
// for the compiler to vectorise the scale and decompression loops.
#pragma once

#include <cstdint>
#include <vector>

#include "trainer/optim/grad_buffer.h"

namespace tetra {

constexpr int64_t kSignBlock = 256;  // elements per fp32 scale: 32 bytes of signs + 4 bytes

enum class Codec : uint8_t { SIGN, INT8 };

// Stochastic rounding's random numbers (int8): element index i of a compression call draws word
// i % 4 of Philox(counter = (i / 4, stream), key = key). The exchange functions below extend the
// caller's stream by the piece's rng_id and number a piece's elements from 0 (worker: destination
// r's shard from r * shard), so two holders of the same piece (a tied embedding's, on two pipeline
// stages) draw the same numbers. Callers give each (step, stage, rank) its own key or stream.
struct Rounding {
  uint64_t key = 0, stream = 0;
  uint64_t first = 0;  // the index of the call's element 0
};

// 16-bit words that n elements (n % 16 == 0) compress to.
int64_t sign_packed_words(int64_t n);
int64_t int8_packed_words(int64_t n);
int64_t packed_words(Codec codec, int64_t n);

// Compresses x (n) + error (n, may be null: no error feedback) into `packed`
// (sign_packed_words(n) words); with error feedback, error <- (x + error) - decompressed.
void sign_compress(const float* x, float* error, int64_t n, uint16_t* packed);

// out (n) = decompressed `packed` (overwrite), or out += alpha * decompressed (accumulate).
void sign_decompress(const uint16_t* packed, int64_t n, float* out);
void sign_decompress_add(const uint16_t* packed, int64_t n, float alpha, float* out);

// The same for int8 (int8_packed_words(n) words); element k rounds with the random number of index
// rounding.first + k.
void int8_compress(const float* x, float* error, int64_t n, uint16_t* packed, const Rounding& rounding);
void int8_decompress(const uint16_t* packed, int64_t n, float* out);
void int8_decompress_add(const uint16_t* packed, int64_t n, float alpha, float* out);

// Where every destination rank's compressed shards sit, for buckets `buckets` (begin/end in
// elements; each size a multiple of 16 * dp).
struct ChunkPlan {
  struct Piece {
    int64_t begin = 0;   // bucket's first element
    int64_t shard = 0;   // elements per destination rank
    int64_t offset = 0;  // word offset of this bucket's shard in a destination's message
    uint16_t rng_id = 0; // int8: the piece's rounding stream (its index unless set otherwise)
  };
  std::vector<Piece> pieces;
  Codec codec = Codec::SIGN;
  int64_t dp = 1;
  int64_t words = 0;  // per destination message
  // Elements of destination r's shard of piece i: [begin + r * shard, begin + (r + 1) * shard).
  int64_t shard_begin(size_t i, int64_t r) const { return pieces[i].begin + r * pieces[i].shard; }
  // The ranges rank r owns (one per bucket, in the buckets' order).
  std::vector<GradRange> owned(int64_t r) const;
};
ChunkPlan plan_chunks(const std::vector<GradRange>& buckets, int64_t dp, Codec codec = Codec::SIGN);

// The two stages of the compressed all-reduce (DeepSpeed's compressed_allreduce), written as pure
// functions of host buffers so they can be checked without communication (with plan.codec):
//   worker:  every rank compresses its vector x (the whole buffer) + its worker error into `send`
//            (dp messages of plan.words, destination-major); an all-to-all delivers to rank r
//            the dp messages of its shards (source-major, `recv`).
//   server:  rank r averages the dp decompressed messages of its shards into `avg` (its owned
//            ranges back to back); with `server_error` (owned ranges back to back, may be null)
//            it compresses avg + server error into `packed` (plan.words) for the all-gather,
//            server error <- input - decompressed; `avg` then holds the decompressed value.
//   gather:  every rank decompresses the dp gathered messages into the whole buffer `out`.
void exchange_worker_compress(const ChunkPlan& plan, const float* x, float* worker_error, uint16_t* send,
                            const Rounding& rounding = {});
void exchange_server_average(const ChunkPlan& plan, const uint16_t* recv, float* avg);
void exchange_server_compress(const ChunkPlan& plan, float* avg, float* server_error, uint16_t* packed,
                            const Rounding& rounding = {});
void exchange_gather_decompress(const ChunkPlan& plan, const uint16_t* gathered, float* out);

}  // namespace tetra
