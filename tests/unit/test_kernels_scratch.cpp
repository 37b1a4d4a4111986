// The CPU kernels' scratch belongs to the backend instance (kernels/cpu/scratch.h): two backends
// used in turn, one of them destroyed and replaced between calls, give bitwise the results of one
// backend making the same calls. The sizes change from call to call (large, small, large, small),
// so scratch shared between instances, freed under one, or kept stale from another shape would
// show here.
#include <catch2/catch.hpp>

#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "kernels/cpu/cpu_backend.h"
#include "tests/unit/attention_testing.h"
#include "tests/unit/kernel_testing.h"

using namespace tetra;
using namespace tetra::attn_testing;

namespace {

struct Size {
  AttnDims attn;
  int64_t N, C, V;  // norm rows and channels; cross-entropy rows N and vocabulary V
};

const Size kLarge{{2, 130, 4, 2, 24}, 96, 80, 1000};
const Size kSmall{{1, 40, 2, 1, 16}, 20, 48, 300};

using Results = std::vector<std::pair<std::string, std::vector<float>>>;

// Every op with scratch at one size: attention forward and backward in fp32 and bf16 (AMX tiles
// where the CPU has them, else the flash kernels), RoPE, LayerNorm forward and backward (the
// dweight / dbias partials), cross-entropy into a bf16 gradient (a row per thread) and a bf16 GEMM
// (AMX's packing buffers where it runs). Inputs depend on the size only.
Results run_ops(CpuBackend& be, const Size& s) {
  Results r;
  const AttnDims& d = s.attn;
  const std::vector<float> qkv = round_bf16(random_floats(d.qkv_size(), 31, -2.0f, 2.0f));
  const std::vector<float> dout = round_bf16(random_floats(d.out_size(), 32));
  for (DType act : {DType::F32, DType::BF16}) {
    const std::string name = act == DType::F32 ? "attention f32 " : "attention bf16 ";
    AttnRun a = run_attention(be, d, qkv, &dout, act);
    r.emplace_back(name + "out", std::move(a.out));
    r.emplace_back(name + "lse", std::move(a.lse));
    r.emplace_back(name + "dqkv", std::move(a.dqkv));
  }
  std::vector<float> roped = qkv;
  be.rope_forward(roped.data(), d.B, d.T, d.NH, d.NKV, d.HS, 10000.0f, DType::F32);
  r.emplace_back("rope", std::move(roped));

  const std::vector<float> x = random_floats(s.N * s.C, 33), w = random_floats(s.C, 34),
                           b = random_floats(s.C, 35), dy = random_floats(s.N * s.C, 36);
  std::vector<float> y(s.N * s.C), mean(s.N), rstd(s.N), dx(s.N * s.C, 0.0f), dw(s.C, 0.0f),
      db(s.C, 0.0f);
  be.norm_forward(NormKind::LAYERNORM, y.data(), mean.data(), rstd.data(), x.data(), w.data(),
                  b.data(), s.N, s.C, 1e-5f, DType::F32, DType::F32);
  be.norm_backward(NormKind::LAYERNORM, dx.data(), dw.data(), db.data(), dy.data(), x.data(),
                   w.data(), mean.data(), rstd.data(), s.N, s.C, DType::F32, DType::F32);
  r.emplace_back("norm out", std::move(y));
  r.emplace_back("norm rstd", std::move(rstd));
  r.emplace_back("norm dx", std::move(dx));
  r.emplace_back("norm dweight", std::move(dw));
  r.emplace_back("norm dbias", std::move(db));

  const std::vector<float> logits = random_floats(s.N * s.V, 37, -4.0f, 4.0f);
  std::vector<int32_t> targets(s.N);
  for (int64_t i = 0; i < s.N; ++i) targets[i] = static_cast<int32_t>((i * 37) % s.V);
  std::vector<float> losses(s.N);
  std::vector<bf16> dlogits(s.N * s.V);
  be.cross_entropy(losses.data(), dlogits.data(), DType::BF16, logits.data(), DType::F32,
                   targets.data(), s.N, s.V, 0.5f);
  r.emplace_back("loss", std::move(losses));
  r.emplace_back("dlogits", to_f32(dlogits));

  const int64_t M = s.N, K = s.C, Nc = s.attn.T;
  const std::vector<bf16> A = to_bf16(random_floats(M * K, 38));
  const std::vector<bf16> B = to_bf16(random_floats(K * Nc, 39));
  std::vector<float> C(M * Nc);
  be.gemm(false, false, M, Nc, K, 1.0f, A.data(), K, B.data(), Nc, DType::BF16, 0.0f, C.data(), Nc,
          DType::F32, nullptr);
  r.emplace_back("gemm bf16", std::move(C));
  return r;
}

void require_same(const Results& got, const Results& want, const char* call) {
  INFO("call " << call);
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < got.size(); ++i)
    tetra_test::expect_bitwise_equal(got[i].second, want[i].second, got[i].first);
}

}  // namespace

TEST_CASE("cpu scratch: two backends in turn, one destroyed between calls, match one backend",
          "[kernels]") {
  CpuBackend one(2);
  const Results want[4] = {run_ops(one, kLarge), run_ops(one, kSmall), run_ops(one, kLarge),
                           run_ops(one, kSmall)};

  auto a = std::make_unique<CpuBackend>(2);
  auto b = std::make_unique<CpuBackend>(2);
  require_same(run_ops(*a, kLarge), want[0], "1 (a, large)");
  require_same(run_ops(*b, kSmall), want[1], "2 (b, small)");
  a.reset();  // its scratch is freed; b's must be untouched
  require_same(run_ops(*b, kLarge), want[2], "3 (b, large, after a was destroyed)");
  a = std::make_unique<CpuBackend>(2);
  require_same(run_ops(*a, kSmall), want[3], "4 (a new a, small)");
  require_same(run_ops(*b, kSmall), want[3], "5 (b, small)");
}
