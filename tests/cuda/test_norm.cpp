// CUDA LayerNorm / RMSNorm (kernels/cuda/norm.cu) against the CPU ops: forward (out, mean, rstd)
// and backward (dx accumulated into the residual gradient, dweight/dbias accumulated), in fp32,
// bf16 and fp16 activations with fp32 or same-type weights, over row widths that take the vector path
// (C = 768) and the scalar one (C = 1, 5, 771), row counts from 1 to past one tile per block of
// backward's row partition, with and without bias, and bitwise reruns of backward.
//
// Tolerances:
// - Statistics and fp32 outputs: the row sums run in another order than the CPU's (lane-strided
//   partial sums and a shuffle tree vs 16-wide SIMD partial sums), a relative error of a few ulp
//   times log2(C) on mean and variance; x carries an offset of 0.5 so that x - mean is not the
//   whole of x. rtol 1e-5 with atol 5e-5 on values of order 1..3 (out, dx) leaves a margin of
//   ~10 over that; a wrong formula or a missed element errs by > 1e-2.
// - dweight / dbias: sums over N rows of terms of order 1 with random signs, in different orders
//   (blocks of >= 16 rows and a tree on the GPU, blocks of >= 16 rows on the CPU). The rounding
//   error grows like eps sqrt(depth) sqrt(N); atol 1e-5 + 2e-7 N is ~10x that at N = 33 and ~100x
//   at N = 40000, and still far below one missing row's contribution (~0.5).
// - bf16 / fp16 outputs (out, dx): additionally 1 ulp, at most 2^-7 (bf16) or 2^-10 (fp16) of the
//   value, as both round a nearby fp32 value.
#include <cstdint>
#include <string>
#include <vector>

#include "tests/cuda/cuda_testing.h"

namespace tetra::cuda_testing {
namespace {

std::vector<float> offset_values(size_t n, uint64_t seed, float offset) {
  std::vector<float> v = random_values(n, seed);
  for (float& x : v) x += offset;
  return v;
}

double out_rtol(DType act) { return storage_ulp(act) + 1e-5; }
constexpr double kOutAtol = 5e-5;

struct Config {
  NormKind kind;
  DType act, w;
  bool bias;
};

std::string describe(const Config& c, int64_t N, int64_t C) {
  return std::string(c.kind == NormKind::LAYERNORM ? "layernorm" : "rmsnorm") +
         " act " + type_name(c.act) + " w " + type_name(c.w) + (c.bias ? " bias" : "") +
         " N=" + std::to_string(N) + " C=" + std::to_string(C);
}

std::vector<Config> configs() {
  std::vector<Config> out;
  for (NormKind kind : {NormKind::LAYERNORM, NormKind::RMSNORM})
    for (auto [act, w] :
         {std::pair{DType::F32, DType::F32}, {DType::BF16, DType::BF16}, {DType::BF16, DType::F32},
          {DType::F16, DType::F16}, {DType::F16, DType::F32}})
      for (bool bias : {true, false}) out.push_back({kind, act, w, bias});
  return out;
}

// Runs forward on both backends and compares out, mean (LayerNorm) and rstd.
void check_forward(const Config& c, int64_t N, int64_t C, uint64_t seed) {
  Backend& cpu = *backends().cpu;
  Backend& gpu = *backends().gpu;
  const size_t nc = static_cast<size_t>(N * C);
  const bool ln = c.kind == NormKind::LAYERNORM;
  Twin x(offset_values(nc, seed, 0.5f), c.act);
  Twin weight(offset_values(static_cast<size_t>(C), seed + 1, 1.0f), c.w);
  Twin bias(random_values(static_cast<size_t>(C), seed + 2), c.w);
  Twin out(nc, c.act), mean(static_cast<size_t>(N), DType::F32),
      rstd(static_cast<size_t>(N), DType::F32);
  const float eps = 1e-5f;
  cpu.norm_forward(c.kind, out.cpu(), ln ? mean.cpu_f32() : nullptr, rstd.cpu_f32(), x.cpu(),
                   weight.cpu(), c.bias ? bias.cpu() : nullptr, N, C, eps, c.act, c.w);
  gpu.norm_forward(c.kind, out.gpu(), ln ? mean.gpu_f32() : nullptr, rstd.gpu_f32(), x.gpu(),
                   weight.gpu(), c.bias ? bias.gpu() : nullptr, N, C, eps, c.act, c.w);
  require_close(out.cpu_values(), out.gpu_values(), out_rtol(c.act), kOutAtol, "norm out");
  require_close(mean.cpu_values(), mean.gpu_values(), 1e-5, 1e-6, "norm mean");
  require_close(rstd.cpu_values(), rstd.gpu_values(), 1e-5, 0.0, "norm rstd");
}

// Runs backward on both backends from the same saved statistics (the CPU forward's) and
// accumulating into the same initial dx, dweight, dbias; compares them all. With `rerun`, runs
// the GPU backward a second time from the same initial values and requires identical bits.
void check_backward(const Config& c, int64_t N, int64_t C, uint64_t seed, bool param_grads,
                    bool rerun) {
  Backend& cpu = *backends().cpu;
  Backend& gpu = *backends().gpu;
  const size_t nc = static_cast<size_t>(N * C), cs = static_cast<size_t>(C);
  const bool ln = c.kind == NormKind::LAYERNORM;
  Twin x(offset_values(nc, seed, 0.5f), c.act);
  Twin weight(offset_values(cs, seed + 1, 1.0f), c.w);
  Twin out(nc, c.act), mean(static_cast<size_t>(N), DType::F32),
      rstd(static_cast<size_t>(N), DType::F32);
  cpu.norm_forward(c.kind, out.cpu(), ln ? mean.cpu_f32() : nullptr, rstd.cpu_f32(), x.cpu(),
                   weight.cpu(), nullptr, N, C, 1e-5f, c.act, c.w);
  mean.upload(mean.cpu_values());  // the same statistics on both backends
  rstd.upload(rstd.cpu_values());

  const std::vector<float> dx0 = random_values(nc, seed + 3), dw0 = random_values(cs, seed + 4),
                           db0 = random_values(cs, seed + 5);
  Twin dout(random_values(nc, seed + 6), c.act), dx(dx0, c.act);
  Twin dweight(dw0, DType::F32), dbias(db0, DType::F32);
  float* dw_cpu = param_grads ? dweight.cpu_f32() : nullptr;
  float* db_cpu = param_grads && c.bias ? dbias.cpu_f32() : nullptr;
  float* dw_gpu = param_grads ? dweight.gpu_f32() : nullptr;
  float* db_gpu = param_grads && c.bias ? dbias.gpu_f32() : nullptr;
  cpu.norm_backward(c.kind, dx.cpu(), dw_cpu, db_cpu, dout.cpu(), x.cpu(), weight.cpu(),
                    ln ? mean.cpu_f32() : nullptr, rstd.cpu_f32(), N, C, c.act, c.w);
  gpu.norm_backward(c.kind, dx.gpu(), dw_gpu, db_gpu, dout.gpu(), x.gpu(), weight.gpu(),
                    ln ? mean.gpu_f32() : nullptr, rstd.gpu_f32(), N, C, c.act, c.w);
  const double param_atol = 1e-5 + 2e-7 * static_cast<double>(N);
  require_close(dx.cpu_values(), dx.gpu_values(), out_rtol(c.act), kOutAtol, "norm dx");
  // Null gradients are left untouched (still their initial values on both backends).
  require_close(dweight.cpu_values(), dweight.gpu_values(), 1e-5, param_atol, "norm dweight");
  require_close(dbias.cpu_values(), dbias.gpu_values(), 1e-5, param_atol, "norm dbias");
  if (!param_grads) REQUIRE(dweight.gpu_values() == dw0);
  if (!param_grads || !c.bias) REQUIRE(dbias.gpu_values() == db0);

  if (!rerun) return;
  const std::vector<float> dx1 = dx.gpu_values(), dw1 = dweight.gpu_values(),
                           db1 = dbias.gpu_values();
  dx.upload(dx0);
  dweight.upload(dw0);
  dbias.upload(db0);
  gpu.norm_backward(c.kind, dx.gpu(), dw_gpu, db_gpu, dout.gpu(), x.gpu(), weight.gpu(),
                    ln ? mean.gpu_f32() : nullptr, rstd.gpu_f32(), N, C, c.act, c.w);
  REQUIRE(dx.gpu_values() == dx1);
  REQUIRE(dweight.gpu_values() == dw1);
  REQUIRE(dbias.gpu_values() == db1);
}

}  // namespace

TEST_CASE("cuda norm forward matches the cpu", "[cuda][norm]") {
  for (const Config& c : configs())
    for (int64_t N : {1, 7, 33})
      for (int64_t C : {1, 5, 768, 771}) DYNAMIC_SECTION(describe(c, N, C)) {
          check_forward(c, N, C, 100 + N * C);
        }
}

TEST_CASE("cuda norm backward matches the cpu and reruns bitwise", "[cuda][norm]") {
  for (const Config& c : configs())
    for (int64_t N : {1, 7, 33})
      for (int64_t C : {1, 5, 768, 771}) DYNAMIC_SECTION(describe(c, N, C)) {
          check_backward(c, N, C, 200 + N * C, true, true);
        }
}

TEST_CASE("cuda norm backward without parameter gradients only accumulates dx", "[cuda][norm]") {
  for (const Config& c : configs()) DYNAMIC_SECTION(describe(c, 33, 768)) {
      check_backward(c, 33, 768, 300, false, false);
    }
}

TEST_CASE("cuda norm backward over many rows: several row blocks and tiles per block",
          "[cuda][norm]") {
  // N = 40000 rows: backward cuts them into 1000 blocks of 40 rows, each two tiles (32 + 8), so
  // the partial sums carry over between tiles; N = 1000 gives 63 blocks, the last one short.
  const Config ln{NormKind::LAYERNORM, DType::F32, DType::F32, true};
  const Config rms{NormKind::RMSNORM, DType::BF16, DType::BF16, false};
  const Config rms16{NormKind::RMSNORM, DType::F16, DType::F16, false};
  for (const Config& c : {ln, rms, rms16}) {
    DYNAMIC_SECTION(describe(c, 40000, 5)) { check_backward(c, 40000, 5, 400, true, true); }
    DYNAMIC_SECTION(describe(c, 1000, 768)) { check_backward(c, 1000, 768, 500, true, true); }
    DYNAMIC_SECTION(describe(c, 40000, 5) << " forward") { check_forward(c, 40000, 5, 600); }
  }
}

}  // namespace tetra::cuda_testing
