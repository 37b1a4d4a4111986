// The fused, chunked output layer and loss (trainer/parallel/vocab_parallel.h,
// vocab_parallel_linear_cross_entropy) against a double-precision plain loop: the per-row losses,
// the input gradient dx = dlogits W and the weight gradient dW += dlogits^T x, for chunks that
// divide the rows, that do not, and one chunk of every row; and the chunked losses and gradients
// against the unchunked ops (logits kept, cross-entropy in place, the two GEMMs).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <vector>

#include "kernels/backend.h"
#include "tests/unit/kernel_testing.h"
#include "trainer/parallel/tensor_parallel.h"
#include "trainer/parallel/vocab_parallel.h"

using namespace tetra;

namespace {

constexpr int64_t N = 10, C = 8, V = 13;
constexpr float kScale = 0.1f;  // dloss_scale: the gradient of 0.1 x the summed losses

struct Reference {
  std::vector<double> losses, dx, dw;
};

// loss_i = logsumexp(x_i W^T) - (x_i W^T)[t_i]; dlogits = scale (softmax - onehot).
Reference reference(const std::vector<float>& x, const std::vector<float>& w, const std::vector<int32_t>& t) {
  Reference r{std::vector<double>(N), std::vector<double>(N * C, 0.0), std::vector<double>(V * C, 0.0)};
  for (int64_t i = 0; i < N; ++i) {
    std::vector<double> z(V);
    double m = -1e300;
    for (int64_t v = 0; v < V; ++v) {
      double s = 0.0;
      for (int64_t c = 0; c < C; ++c) s += static_cast<double>(x[i * C + c]) * w[v * C + c];
      z[v] = s;
      m = std::max(m, s);
    }
    double se = 0.0;
    for (double s : z) se += std::exp(s - m);
    r.losses[i] = std::log(se) + m - z[t[i]];
    for (int64_t v = 0; v < V; ++v) {
      const double g = kScale * (std::exp(z[v] - m) / se - (v == t[i] ? 1.0 : 0.0));
      for (int64_t c = 0; c < C; ++c) {
        r.dx[i * C + c] += g * w[v * C + c];
        r.dw[v * C + c] += g * x[i * C + c];
      }
    }
  }
  return r;
}

template <class T>
double worst_rel(const std::vector<T>& got, const std::vector<double>& want) {
  double norm = 0.0, err = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    norm = std::max(norm, std::abs(want[i]));
    err = std::max(err, std::abs(static_cast<double>(got[i]) - want[i]));
  }
  return err / norm;
}

}  // namespace

TEST_CASE("fused chunked output layer and loss match a double loop and the unchunked ops", "[loss]") {
  std::unique_ptr<Backend> be = make_cpu_backend(2);
  const std::vector<float> x = tetra_test::randn(N * C, 1), w = tetra_test::randn(V * C, 2, 0.5f);
  std::vector<int32_t> targets(N);
  for (int64_t i = 0; i < N; ++i) targets[i] = static_cast<int32_t>((7 * i + 3) % V);
  const Reference ref = reference(x, w, targets);
  TensorParallel tp(nullptr, false, *be, DType::F32, N, C);
  const VocabSlice vocab{0, V};

  // Unchunked: the logits kept, the loss writes their gradient in place, then the two GEMMs.
  std::vector<float> logits(N * V), losses0(N), dx0(N * C), dw0(V * C, 0.0f);
  be->gemm(false, true, N, V, C, 1.0f, x.data(), C, w.data(), C, DType::F32, 0.0f, logits.data(), V, DType::F32);
  vocab_parallel_cross_entropy(tp, *be, vocab, losses0.data(), logits.data(), targets.data(), kScale, nullptr, nullptr);
  be->gemm(false, false, N, C, V, 1.0f, logits.data(), V, w.data(), C, DType::F32, 0.0f, dx0.data(), C, DType::F32);
  be->gemm(true, false, V, C, N, 1.0f, logits.data(), V, x.data(), C, DType::F32, 1.0f, dw0.data(), C, DType::F32);

  for (int64_t chunk : {int64_t{1}, int64_t{3}, int64_t{5}, N}) {
    INFO("chunk " << chunk);
    std::vector<float> scratch(chunk * V), losses(N), dx(N * C), dw(V * C, 0.0f);
    vocab_parallel_linear_cross_entropy(tp, *be, vocab, x.data(), C, w.data(), dw.data(), targets.data(),
                                        losses.data(), kScale, chunk, scratch.data(), nullptr, nullptr, dx.data());
    // fp32 against double: a few ulps of the sums of C and V terms (measured ~1e-7).
    CHECK(worst_rel(losses, ref.losses) < 1e-6);
    CHECK(worst_rel(dx, ref.dx) < 1e-6);
    CHECK(worst_rel(dw, ref.dw) < 1e-6);
    // Against the unchunked ops: each row's loss and input gradient the same computation.
    std::vector<double> l0(losses0.begin(), losses0.end()), x0(dx0.begin(), dx0.end()), w0(dw0.begin(), dw0.end());
    CHECK(worst_rel(losses, l0) < 1e-6);
    CHECK(worst_rel(dx, x0) < 1e-6);
    CHECK(worst_rel(dw, w0) < 1e-6);
  }

  // Without a gradient (evaluation): the losses only, nothing written to dx or dW.
  std::vector<float> scratch(3 * V), losses(N), dx(N * C, 7.0f), dw(V * C, 7.0f);
  vocab_parallel_linear_cross_entropy(tp, *be, vocab, x.data(), C, w.data(), nullptr, targets.data(), losses.data(),
                                      0.0f, 3, scratch.data(), nullptr, nullptr, dx.data());
  CHECK(worst_rel(losses, ref.losses) < 1e-6);
  CHECK((dx == std::vector<float>(N * C, 7.0f) && dw == std::vector<float>(V * C, 7.0f)));
}
