// The CUDA RoPE and causal attention ops against the CPU backend. The fused flash kernels: fp32,
// bf16 and fp16, MHA and GQA, head sizes 64 / 128 / 32 / 80 (plus 20, 160 and 256 for the
// unvectorised and generic kernels), T = 1, 17, 128, 257 and B = 1..3. cuDNN's SDPA (forced
// through the backend's AttentionPath) in its own test case, on six representative bf16 / fp16
// shapes. Each shape is a section of its own, so one failing shape cannot hide the others. Every
// GPU output buffer is filled with garbage before the op, so an element the op fails to write
// cannot pass; every GPU op is run twice and must give bitwise-identical results (determinism).
//
// Tolerances. The CPU computes attention in fp32 on fp32 copies of the inputs, with its own exp;
// the GPU in fp32 with exp2f, in another summation order; both read the same stored inputs, and
// the backward ops of both get the same (CPU-computed) out and lse. Errors of fp32 arithmetic are
// then a few ulp of the magnitudes summed, which a host loop (in double) bounds per element:
//   out[i]      : sum_j p_ij |v_j|
//   dv[j]       : sum_i p_ij |dO_i|                  (over the query heads of the group)
//   dq[i], dk[j]: scale sum m_ij |k_j| (resp. |q_i|),
//                 m_ij = p_ij (sum_x |dO_ix v_jx| + sum_x |dO_ix O_ix|)
// (m_ij bounds |dS_ij| and the terms whose rounding makes up its error). fp32 allows
// 5e-5 * bound + 1e-5 |ref|. bf16: the GPU kernels round P and dS to bf16 before their products
// as flash kernels do (relative error 2^-9 of each term, so at most 2^-9 * bound; cuDNN does the
// same), and both sides round the result to bf16, which may land one ulp (2^-7 |ref|) apart: bf16
// allows 2^-8 * bound + 2^-7 |ref| + 1e-5. fp16 the same with its 11-bit significand: P and dS
// rounded to fp16 (2^-11 of each term, doubled: 2^-10 * bound), the result one fp16 ulp apart
// (2^-10 |ref|); and where P or dS falls below fp16's normal range (2^-14) their rounding is
// absolute, 2^-25 per term: over T = 257 keys of |v|, |k| <= 3 at most 2.3e-5, so abs 3e-5.
// lse is an fp32 log-sum-exp on both sides: 5e-5 + 1e-5 |ref|.
// A wrong mask, index or scale gives errors of the order of the values, far above these.
#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

#include "kernels/cuda/cuda_backend.h"
#include "tests/cuda/cuda_testing.h"
#include "kernels/common/check.h"

namespace tetra::cuda_testing {
namespace {

struct AttnCase {
  DType act;
  int64_t B, T, NH, NKV, HS;
};

std::string describe(const AttnCase& c) {
  return std::string(dtype_name(c.act)) + " B=" + std::to_string(c.B) +
         " T=" + std::to_string(c.T) + " NH=" + std::to_string(c.NH) +
         " NKV=" + std::to_string(c.NKV) + " HS=" + std::to_string(c.HS);
}

CudaBackend& cuda_backend() { return dynamic_cast<CudaBackend&>(*backends().gpu); }

// The shared backend's attention path for the lifetime of the object ("fused" or "cudnn"; AUTO, the
// default, again afterwards).
class AttentionMode {
 public:
  explicit AttentionMode(const std::string& mode) {
    cuda_backend().set_attention_path(mode == "cudnn" ? AttentionPath::CUDNN : AttentionPath::FUSED);
  }
  ~AttentionMode() { cuda_backend().set_attention_path(AttentionPath::AUTO); }
  AttentionMode(const AttentionMode&) = delete;
  AttentionMode& operator=(const AttentionMode&) = delete;
};

// Requires |got - ref| <= rel_bound * bound + rel_ref * |ref| + abs for every element.
void require_within(const std::vector<float>& ref, const std::vector<float>& got,
                    const std::vector<double>& bound, double rel_bound, double rel_ref, double abs,
                    const std::string& what) {
  REQUIRE(ref.size() == got.size());
  REQUIRE(ref.size() == bound.size());
  size_t bad = 0, worst = 0;
  double worst_excess = -1e300;
  for (size_t i = 0; i < ref.size(); ++i) {
    const double allowed = rel_bound * bound[i] + rel_ref * std::fabs(ref[i]) + abs;
    const double err = std::fabs(static_cast<double>(got[i]) - ref[i]);
    const double excess = std::isfinite(err) ? err - allowed : 1e300;
    if (!(excess <= 0.0)) ++bad;
    if (excess > worst_excess) worst_excess = excess, worst = i;
  }
  INFO(what << ": " << bad << " of " << ref.size() << " elements out of tolerance; worst at "
            << worst << ": cpu " << ref[worst] << " cuda " << got[worst] << " bound "
            << bound[worst]);
  REQUIRE(bad == 0);
}

// Per-element error scales of out (B, T, NH HS) and dqkv (qkv's layout); see the file comment.
struct Scales {
  std::vector<double> out, dqkv;
};

Scales error_scales(const AttnCase& c, const std::vector<float>& qkv,
                    const std::vector<float>& out, const std::vector<float>& lse,
                    const std::vector<float>& dout) {
  const int64_t B = c.B, T = c.T, NH = c.NH, NKV = c.NKV, HS = c.HS;
  const int64_t row = (NH + 2 * NKV) * HS, G = NH / NKV;
  const double scale = 1.0 / std::sqrt(static_cast<double>(HS));
  Scales s;
  s.out.assign(static_cast<size_t>(B * T * NH * HS), 0.0);
  s.dqkv.assign(static_cast<size_t>(B * T * row), 0.0);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < NH; ++h) {
      const int64_t kvh = h / G;
      for (int64_t i = 0; i < T; ++i) {
        const float* q = &qkv[(b * T + i) * row + h * HS];
        const float* dor = &dout[(b * T + i) * NH * HS + h * HS];
        const float* o = &out[(b * T + i) * NH * HS + h * HS];
        double d_abs = 0.0;
        for (int64_t x = 0; x < HS; ++x) d_abs += std::fabs(static_cast<double>(dor[x]) * o[x]);
        const double lse_i = lse[(b * NH + h) * T + i];
        double* ob = &s.out[(b * T + i) * NH * HS + h * HS];
        double* dqb = &s.dqkv[(b * T + i) * row + h * HS];
        for (int64_t j = 0; j <= i; ++j) {
          const float* k = &qkv[(b * T + j) * row + (NH + kvh) * HS];
          const float* v = &qkv[(b * T + j) * row + (NH + NKV + kvh) * HS];
          double dot = 0.0, dp_abs = 0.0;
          for (int64_t x = 0; x < HS; ++x) {
            dot += static_cast<double>(q[x]) * k[x];
            dp_abs += std::fabs(static_cast<double>(dor[x]) * v[x]);
          }
          const double p = std::exp(scale * dot - lse_i);
          const double m = p * (dp_abs + d_abs);
          double* dkb = &s.dqkv[(b * T + j) * row + (NH + kvh) * HS];
          double* dvb = &s.dqkv[(b * T + j) * row + (NH + NKV + kvh) * HS];
          for (int64_t x = 0; x < HS; ++x) {
            ob[x] += p * std::fabs(v[x]);
            dvb[x] += p * std::fabs(dor[x]);
            dqb[x] += scale * m * std::fabs(k[x]);
            dkb[x] += scale * m * std::fabs(q[x]);
          }
        }
      }
    }
  return s;
}

struct Tolerance {
  double rel_bound, rel_ref, abs;
};
Tolerance tolerance(DType act) {
  if (act == DType::F32) return {5e-5, 1e-5, 1e-6};
  if (act == DType::F16) return {1.0 / 1024, 1.0 / 1024, 3e-5};
  return {1.0 / 256, 1.0 / 128, 1e-5};
}

// Runs `op` on the cuDNN path where cuDNN may legitimately have no plan (a shape outside the
// `required` ones): false, with a warning naming cuDNN's reason, if it had none.
template <typename F>
bool run_optional(bool required, const std::string& what, F&& op) {
  if (required) {
    op();
    return true;
  }
  try {
    op();
    return true;
  } catch (const Error& e) {
    const std::string msg = e.what();
    INFO(msg);
    REQUIRE(msg.find("no SDPA plan") != std::string::npos);
    WARN("cuDNN has no plan for " << what << ": " << msg);
    return false;
  }
}

// One shape on one path ("fused" or "cudnn", forced), forward and backward against the CPU; a
// cuDNN shape that is not `required` may be refused (reported, not failed).
void check_attention_case(const AttnCase& c, uint64_t seed, const std::string& path,
                          bool required = true) {
  INFO(describe(c) << " path " << path);
  Backend& cpu = *backends().cpu;
  CudaBackend& gpu = cuda_backend();
  const int64_t B = c.B, T = c.T, NH = c.NH, NKV = c.NKV, HS = c.HS;
  const size_t n_qkv = static_cast<size_t>(B * T * (NH + 2 * NKV) * HS);
  const size_t n_out = static_cast<size_t>(B * T * NH * HS);
  const size_t n_lse = static_cast<size_t>(B * NH * T);
  const Tolerance tol = tolerance(c.act);

  Twin qkv(random_values(n_qkv, seed, 3.0f), c.act);
  Twin dout(random_values(n_out, seed + 1, 1.0f), c.act);
  Twin out(n_out, c.act), lse(n_lse, DType::F32), dqkv(n_qkv, c.act);
  const std::vector<float> garbage_out = random_values(n_out, seed + 2, 1e3f);
  const std::vector<float> garbage_lse = random_values(n_lse, seed + 3, 1e3f);
  const std::vector<float> garbage_qkv = random_values(n_qkv, seed + 4, 1e3f);

  cpu.attention_forward(out.cpu(), lse.cpu_f32(), qkv.cpu(), B, T, NH, NKV, HS, c.act);
  const std::vector<float> ref_out = out.cpu_values(), ref_lse = lse.cpu_values();
  // The backward inputs of both backends: the CPU's forward results.
  Twin out_in(ref_out, c.act), lse_in(ref_lse, DType::F32);
  dqkv.upload(garbage_qkv);
  cpu.attention_backward(dqkv.cpu(), dout.cpu(), qkv.cpu(), out_in.cpu(), lse_in.cpu_f32(), B, T,
                         NH, NKV, HS, c.act);
  const std::vector<float> ref_dqkv = dqkv.cpu_values();
  const Scales scales =
      error_scales(c, qkv.cpu_values(), ref_out, ref_lse, dout.cpu_values());

  AttentionMode mode(path);
  auto forward = [&] {
    out.upload(garbage_out);
    lse.upload(garbage_lse);
    gpu.attention_forward(out.gpu(), lse.gpu_f32(), qkv.gpu(), B, T, NH, NKV, HS, c.act);
  };
  if (run_optional(required, describe(c) + " forward", forward)) {
    REQUIRE(gpu.attention_path() == path);
    const std::vector<float> got_out = out.gpu_values(), got_lse = lse.gpu_values();
    require_within(ref_out, got_out, scales.out, tol.rel_bound, tol.rel_ref, tol.abs, "out");
    require_close(ref_lse, got_lse, 1e-5, 5e-5, "lse");
    forward();
    REQUIRE(out.gpu_values() == got_out);
    REQUIRE(lse.gpu_values() == got_lse);
  }
  auto backward = [&] {
    dqkv.upload(garbage_qkv);
    gpu.attention_backward(dqkv.gpu(), dout.gpu(), qkv.gpu(), out_in.gpu(), lse_in.gpu_f32(), B,
                           T, NH, NKV, HS, c.act);
  };
  if (run_optional(required, describe(c) + " backward", backward)) {
    REQUIRE(gpu.attention_path() == path);
    const std::vector<float> got = dqkv.gpu_values();
    require_within(ref_dqkv, got, scales.dqkv, tol.rel_bound, tol.rel_ref, tol.abs, "dqkv");
    backward();
    REQUIRE(dqkv.gpu_values() == got);
  }
}

std::vector<AttnCase> attention_cases(DType act) {
  std::vector<AttnCase> cases;
  const int64_t heads[3][2] = {{4, 4}, {8, 2}, {8, 1}};
  int64_t n = 0;
  for (const auto& hk : heads)
    for (int64_t HS : {64, 128, 32, 80})
      for (int64_t T : {1, 17, 128, 257}) cases.push_back({act, 1 + n++ % 3, T, hk[0], hk[1], HS});
  // HS not a multiple of 8 (element-wise loads), and the generic kernels' wider register tiles.
  cases.push_back({act, 2, 70, 4, 2, 20});
  cases.push_back({act, 2, 33, 4, 2, 160});
  cases.push_back({act, 1, 40, 2, 1, 256});
  return cases;
}

// The fused kernels on every shape of attention_cases, each shape its own section: a failing
// shape is reported and the others still run.
void check_fused(DType act, uint64_t seed) {
  for (const AttnCase& c : attention_cases(act)) {
    seed += 10;
    DYNAMIC_SECTION(describe(c)) { check_attention_case(c, seed, "fused"); }
  }
}

// cuDNN on a few representative shapes (each plan compiles at run time, about a second apiece):
// MHA, GQA and MQA, both head sizes the models use, T a multiple of 64 and not, one short
// sequence (which cuDNN may refuse: reported, not failed). Each is its own section.
struct CudnnCase {
  AttnCase c;
  bool required;
};
const CudnnCase kCudnnCases[] = {
    {{DType::BF16, 2, 128, 4, 4, 64}, true},   // MHA
    {{DType::BF16, 1, 256, 8, 2, 128}, true},  // GQA, HS 128
    {{DType::BF16, 1, 512, 8, 1, 64}, true},   // MQA, a longer sequence
    {{DType::F16, 2, 128, 4, 4, 128}, true},   // fp16
    {{DType::F16, 1, 257, 8, 2, 64}, true},    // fp16 GQA, T not a multiple of 64
    {{DType::BF16, 3, 17, 4, 2, 32}, false},   // short, HS 32
};

}  // namespace

TEST_CASE("cuda attention fp32: fused kernels match the CPU", "[cuda][attention][fused]") {
  check_fused(DType::F32, 100);
}

TEST_CASE("cuda attention bf16: fused kernels match the CPU", "[cuda][attention][fused]") {
  check_fused(DType::BF16, 5000);
}

TEST_CASE("cuda attention fp16: fused (tensor-core) kernels match the CPU", "[cuda][attention][fused]") {
  check_fused(DType::F16, 8000);
}

// TETRA_ATTENTION=cudnn forced: any refusal of a required shape fails with cuDNN's reason (run
// it under CUDNN_LOGLEVEL_DBG=2 CUDNN_LOGDEST_DBG=stderr for cuDNN's own log, as
// scripts/gpu_check.sh does).
TEST_CASE("cuda attention cuDNN: forced cuDNN path matches the CPU", "[cuda][attention][cudnn]") {
  uint64_t seed = 9000;
  for (const CudnnCase& k : kCudnnCases) {
    seed += 10;
    DYNAMIC_SECTION(describe(k.c)) { check_attention_case(k.c, seed, "cudnn", k.required); }
  }
}

TEST_CASE("cuda attention: path selection and its errors", "[cuda][attention]") {
  CudaBackend& gpu = cuda_backend();
  const int64_t B = 1, T = 128, NH = 4, NKV = 2, HS = 64;
  const size_t n_qkv = static_cast<size_t>(B * T * (NH + 2 * NKV) * HS);
  const size_t n_out = static_cast<size_t>(B * T * NH * HS);
  for (DType act : {DType::F32, DType::BF16, DType::F16}) {
    Twin qkv(random_values(n_qkv, 7, 1.0f), act), out(n_out, act), lse(B * NH * T, DType::F32);
    {  // auto (the default): cuDNN for bf16 / fp16 at HS 64 (a shape it must take), fused for fp32
      gpu.attention_forward(out.gpu(), lse.gpu_f32(), qkv.gpu(), B, T, NH, NKV, HS, act);
      REQUIRE(gpu.attention_path() == (act == DType::F32 ? "fused" : "cudnn"));
      REQUIRE_THAT(gpu.kernel_report(), Catch::Contains("attention forward") &&
                                            Catch::Contains(act == DType::F32 ? "fused" : "cudnn"));
    }
    {
      AttentionMode mode("fused");
      gpu.attention_forward(out.gpu(), lse.gpu_f32(), qkv.gpu(), B, T, NH, NKV, HS, act);
      REQUIRE(gpu.attention_path() == "fused");
    }
    if (act == DType::F32) {  // no cuDNN path for fp32: forcing it is an error naming the shape
      AttentionMode mode("cudnn");
      REQUIRE_THROWS_WITH(
          gpu.attention_forward(out.gpu(), lse.gpu_f32(), qkv.gpu(), B, T, NH, NKV, HS, act),
          Catch::Contains("no SDPA plan") && Catch::Contains("B=1 T=128 NH=4 NKV=2 HS=64"));
    }
  }
}

// RoPE: the same rotation (math::rope_rotate, inverse frequencies from math::rope_inv_freq, angle
// float(t) * inv_freq) on both backends; only cos / sin differ (CUDA's sincosf vs the host libm,
// each within 2 ulp), so fp32 agrees to 1e-5 on |x| <= 1 and bf16 / fp16 to one ulp (2^-7 / 2^-10
// relative).
TEST_CASE("cuda rope: forward and backward match the CPU", "[cuda][rope]") {
  struct RopeCase {
    int64_t B, T, NH, NKV, HS;
    float theta;
  };
  const RopeCase cases[] = {{2, 17, 4, 2, 64, 10000.0f},
                            {1, 33, 3, 1, 32, 500000.0f},
                            {3, 5, 2, 2, 80, 10000.0f},
                            {1, 300, 2, 1, 128, 10000.0f},
                            {2, 9, 1, 1, 6, 100.0f}};
  uint64_t seed = 900;
  for (DType act : {DType::F32, DType::BF16, DType::F16})
    for (const RopeCase& c : cases) {
      INFO(dtype_name(act) << " B=" << c.B << " T=" << c.T << " NH=" << c.NH << " NKV=" << c.NKV
                           << " HS=" << c.HS << " theta=" << c.theta);
      const size_t n = static_cast<size_t>(c.B * c.T * (c.NH + 2 * c.NKV) * c.HS);
      const double rtol = act == DType::F32 ? 1e-5 : storage_ulp(act), atol = 1e-5;
      Twin fwd(random_values(n, seed += 2, 1.0f), act);
      backends().cpu->rope_forward(fwd.cpu(), c.B, c.T, c.NH, c.NKV, c.HS, c.theta, act);
      backends().gpu->rope_forward(fwd.gpu(), c.B, c.T, c.NH, c.NKV, c.HS, c.theta, act);
      require_close(fwd.cpu_values(), fwd.gpu_values(), rtol, atol, "rope_forward");
      Twin bwd(random_values(n, seed + 1, 1.0f), act);
      backends().cpu->rope_backward(bwd.cpu(), c.B, c.T, c.NH, c.NKV, c.HS, c.theta, act);
      backends().gpu->rope_backward(bwd.gpu(), c.B, c.T, c.NH, c.NKV, c.HS, c.theta, act);
      require_close(bwd.cpu_values(), bwd.gpu_values(), rtol, atol, "rope_backward");
    }
}

}  // namespace tetra::cuda_testing
