// The CUDA attention blocks of context parallelism (attention_block_forward / _backward) against
// the CPU backend's: a causal block that starts a running result, then blocks of half the keys and
// of half the queries merged into it (as the ring does), and the backward accumulating dq, dk, dv
// onto values already there. fp32 and bf16 storage, GQA. Both sides compute in fp32 in different
// orders: a few ulp of O(1) values (fp32: 2e-5 absolute; bf16 inputs are read the same on both
// sides, the math is fp32, so the same bound holds). A wrong mask, merge or index is O(1) off.
#include <string>
#include <vector>

#include "tests/cuda/cuda_testing.h"

namespace tetra::cuda_testing {
namespace {

AttnView view(void* p, int64_t row, int64_t seq) { return AttnView{p, row, seq}; }

void check_blocks(DType act) {
  Backends& be = backends();
  const int64_t B = 2, Tl = 40, NH = 4, NKV = 2, HS = 16, Q = (NH + 2 * NKV) * HS, A = NH * HS, KV = NKV * HS;
  const int64_t half = Tl / 2;
  Twin qkv(random_values(static_cast<size_t>(B * Tl * Q), 1, 2.0f), act);
  Twin other(random_values(static_cast<size_t>(B * Tl * Q), 2, 2.0f), act);  // another rank's tokens
  Twin o(static_cast<size_t>(B * Tl * A), DType::F32), lse(static_cast<size_t>(B * NH * Tl), DType::F32);
  auto block = [&](bool gpu, Twin& kv, int64_t q0, int64_t Tq, int64_t Tk, bool causal) {
    char* q = static_cast<char*>(gpu ? qkv.gpu() : qkv.cpu());
    char* k = static_cast<char*>(gpu ? kv.gpu() : kv.cpu());
    const size_t es = dtype_size(act);
    AttnBlock b;
    b.B = B;
    b.Tq = Tq;
    b.Tk = Tk;
    b.NH = NH;
    b.NKV = NKV;
    b.HS = HS;
    b.causal = causal;
    b.q = view(q + static_cast<size_t>(q0 * Q) * es, Q, Tl * Q);
    b.k = view(k + static_cast<size_t>(A) * es, Q, Tl * Q);
    b.v = view(k + static_cast<size_t>(A + KV) * es, Q, Tl * Q);
    b.lse = (gpu ? lse.gpu_f32() : lse.cpu_f32()) + q0;
    b.lse_ld = Tl;
    return b;
  };
  auto ov = [&](bool gpu, int64_t q0) { return view((gpu ? o.gpu_f32() : o.cpu_f32()) + q0 * A, A, Tl * A); };
  for (bool gpu : {false, true}) {
    Backend& b = gpu ? *be.gpu : *be.cpu;
    b.attention_block_forward(block(gpu, qkv, 0, Tl, Tl, true), ov(gpu, 0), true, act);
    b.attention_block_forward(block(gpu, other, 0, Tl, half, false), ov(gpu, 0), false, act);
    b.attention_block_forward(block(gpu, other, half, half, Tl, false), ov(gpu, half), false, act);
  }
  require_close(o.cpu_values(), o.gpu_values(), 1e-5, 2e-5, "o");
  require_close(lse.cpu_values(), lse.gpu_values(), 1e-5, 2e-5, "lse");

  // Backward with the CPU's finished output (as act) and lse on both sides.
  Twin out(o.cpu_values(), act), dout(random_values(static_cast<size_t>(B * Tl * A), 3), act);
  lse.upload(lse.cpu_values());
  Twin dq(random_values(static_cast<size_t>(B * Tl * A), 4), DType::F32);
  Twin dkv(random_values(static_cast<size_t>(B * Tl * 2 * KV), 5), DType::F32);
  for (bool gpu : {false, true}) {
    Backend& b = gpu ? *be.gpu : *be.cpu;
    const size_t es = dtype_size(act);
    auto at = [&](Twin& t, int64_t q0) {
      return view(static_cast<char*>(gpu ? t.gpu() : t.cpu()) + static_cast<size_t>(q0 * A) * es, A, Tl * A);
    };
    float* dqp = gpu ? dq.gpu_f32() : dq.cpu_f32();
    float* dkp = gpu ? dkv.gpu_f32() : dkv.cpu_f32();
    b.attention_block_backward(block(gpu, other, half, half, Tl, false), at(dout, half), at(out, half),
                               view(dqp + half * A, A, Tl * A), view(dkp, 2 * KV, Tl * 2 * KV),
                               view(dkp + KV, 2 * KV, Tl * 2 * KV), act);
    b.attention_block_backward(block(gpu, qkv, 0, Tl, Tl, true), at(dout, 0), at(out, 0), view(dqp, A, Tl * A),
                               view(dkp, 2 * KV, Tl * 2 * KV), view(dkp + KV, 2 * KV, Tl * 2 * KV), act);
  }
  require_close(dq.cpu_values(), dq.gpu_values(), 1e-5, 5e-5, "dq");
  require_close(dkv.cpu_values(), dkv.gpu_values(), 1e-5, 5e-5, "dk, dv");
}

TEST_CASE("cuda attention blocks (context parallelism): forward merge and backward match the CPU",
          "[cuda][attention]") {
  SECTION("fp32") { check_blocks(DType::F32); }
  SECTION("bf16") { check_blocks(DType::BF16); }
}

}  // namespace
}  // namespace tetra::cuda_testing
