// CUDA token/position embeddings (kernels/cuda/embedding.cu) against the CPU ops, for the whole
// vocabulary and for vocab-parallel slices (v0 > 0, tokens outside the slice), with and without
// wpe, in fp32, bf16 and fp16, at widths that take the vector path (C = 768) and the scalar one
// (C = 1, 5, 771), with heavily repeated token ids.
//
// Tolerance: none, the results must be bitwise the CPU's.
// - Forward: both round the same fp32 value (the wte element, plus the wpe element) once.
// - Backward: the GPU groups the positions of each id by a stable sort and adds them into the
//   row starting from its current value in increasing position order, which are the CPU's
//   additions in the CPU's order (dwpe: over b in order on both); there are no multiplications
//   a compiler could contract differently.
#include <cstdint>
#include <random>
#include <vector>

#include "tests/cuda/cuda_testing.h"

namespace tetra::cuda_testing {
namespace {

// n token ids in [0, V): ids drawn from `distinct` values spread over the vocabulary (so a slice
// holds some and misses others), so they repeat, many times when distinct is small.
std::vector<int32_t> repeated_tokens(size_t n, int64_t V, int64_t distinct, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int64_t> pick(0, distinct - 1);
  std::vector<int32_t> out(n);
  for (auto& t : out) {
    const int64_t k = pick(rng);
    t = static_cast<int32_t>(k * V / distinct + k % 3);  // < V while V / distinct >= 3
  }
  return out;
}

struct Slice {
  int64_t V, v0, Vl;
};

void check_forward(DType act, DType w, int64_t B, int64_t T, int64_t C, Slice s, bool with_wpe,
                   uint64_t seed) {
  Backend& cpu = *backends().cpu;
  Backend& gpu = *backends().gpu;
  const size_t n = static_cast<size_t>(B * T);
  Twin tokens(repeated_tokens(n, s.V, 13, seed));
  Twin wte(random_values(static_cast<size_t>(s.Vl * C), seed + 1), w);
  Twin wpe(random_values(static_cast<size_t>(T * C), seed + 2), w);
  Twin out(random_values(n * static_cast<size_t>(C), seed + 3), act);  // every element rewritten
  cpu.embedding_forward(out.cpu(), tokens.cpu_i32(), wte.cpu(), with_wpe ? wpe.cpu() : nullptr, B,
                        T, C, s.v0, s.Vl, act, w);
  gpu.embedding_forward(out.gpu(), tokens.gpu_i32(), wte.gpu(), with_wpe ? wpe.gpu() : nullptr, B,
                        T, C, s.v0, s.Vl, act, w);
  require_close(out.cpu_values(), out.gpu_values(), 0.0, 0.0, "embedding out");
}

void check_backward(DType act, int64_t B, int64_t T, int64_t C, Slice s, bool with_dwte,
                    bool with_dwpe, int64_t distinct, uint64_t seed) {
  Backend& cpu = *backends().cpu;
  Backend& gpu = *backends().gpu;
  const size_t n = static_cast<size_t>(B * T);
  Twin tokens(repeated_tokens(n, s.V, distinct, seed));
  Twin dout(random_values(n * static_cast<size_t>(C), seed + 1), act);
  const std::vector<float> dwte0 = random_values(static_cast<size_t>(s.Vl * C), seed + 2);
  const std::vector<float> dwpe0 = random_values(static_cast<size_t>(T * C), seed + 3);
  Twin dwte(dwte0, DType::F32), dwpe(dwpe0, DType::F32);
  cpu.embedding_backward(with_dwte ? dwte.cpu_f32() : nullptr, with_dwpe ? dwpe.cpu_f32() : nullptr,
                         dout.cpu(), tokens.cpu_i32(), B, T, C, s.v0, s.Vl, act);
  gpu.embedding_backward(with_dwte ? dwte.gpu_f32() : nullptr, with_dwpe ? dwpe.gpu_f32() : nullptr,
                         dout.gpu(), tokens.gpu_i32(), B, T, C, s.v0, s.Vl, act);
  require_close(dwte.cpu_values(), dwte.gpu_values(), 0.0, 0.0, "embedding dwte");
  require_close(dwpe.cpu_values(), dwpe.gpu_values(), 0.0, 0.0, "embedding dwpe");
  if (!with_dwte) REQUIRE(dwte.gpu_values() == dwte0);
  if (!with_dwpe) REQUIRE(dwpe.gpu_values() == dwpe0);
}

const char* name(DType t) { return type_name(t); }

}  // namespace

TEST_CASE("cuda embedding forward matches the cpu exactly", "[cuda][embedding]") {
  const Slice whole{50, 0, 50}, slice{50, 20, 17};
  for (auto [act, w] :
       {std::pair{DType::F32, DType::F32}, {DType::BF16, DType::BF16}, {DType::BF16, DType::F32},
        {DType::F16, DType::F16}, {DType::F16, DType::F32}})
    for (auto [B, T] : {std::pair<int64_t, int64_t>{1, 1}, {3, 7}, {2, 33}})
      for (int64_t C : {1, 5, 768, 771})
        for (const Slice& s : {whole, slice})
          for (bool with_wpe : {true, false})
            DYNAMIC_SECTION(name(act) << "/" << name(w) << " B=" << B << " T=" << T << " C=" << C
                                      << " v0=" << s.v0 << " wpe=" << with_wpe) {
              check_forward(act, w, B, T, C, s, with_wpe, 10 + B * T * C);
            }
}

TEST_CASE("cuda embedding backward matches the cpu bitwise with repeated tokens",
          "[cuda][embedding]") {
  const Slice whole{50, 0, 50}, slice{50, 20, 17};
  for (DType act : {DType::F32, DType::BF16, DType::F16})
    for (auto [B, T] : {std::pair<int64_t, int64_t>{1, 1}, {3, 7}, {2, 33}})
      for (int64_t C : {1, 5, 768, 771})
        for (const Slice& s : {whole, slice})
          DYNAMIC_SECTION(name(act) << " B=" << B << " T=" << T << " C=" << C << " v0=" << s.v0) {
            check_backward(act, B, T, C, s, true, true, 5, 20 + B * T * C);
          }
}

TEST_CASE("cuda embedding backward with only one of dwte, dwpe", "[cuda][embedding]") {
  const Slice slice{50, 20, 17};
  SECTION("dwte only") { check_backward(DType::BF16, 3, 7, 768, slice, true, false, 5, 30); }
  SECTION("dwpe only") { check_backward(DType::BF16, 3, 7, 768, slice, false, true, 5, 31); }
  SECTION("dwte only, f16") { check_backward(DType::F16, 3, 7, 768, slice, true, false, 5, 32); }
}

TEST_CASE("cuda embedding backward at GPT-2 scale: long runs of one id, many ids",
          "[cuda][embedding]") {
  // 4096 tokens over the GPT-2 vocabulary: a few ids repeated hundreds of times (runs longer
  // than a block's window of 128 keys), and the same over a slice of the vocabulary.
  const int64_t V = 50257;
  for (const Slice& s : {Slice{V, 0, V}, Slice{V, 25000, V - 25000}})
    for (DType act : {DType::F32, DType::BF16, DType::F16}) DYNAMIC_SECTION(name(act) << " v0=" << s.v0) {
        check_backward(act, 4, 1024, 768, s, true, true, 9, 40);
      }
  SECTION("many distinct ids") {
    check_backward(DType::BF16, 4, 1024, 768, Slice{V, 0, V}, true, true, 3000, 41);
  }
}

}  // namespace tetra::cuda_testing
