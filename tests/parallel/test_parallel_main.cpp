// The parallel layer's pieces under a real launch: `mpirun -np 4 test_parallel` (and np 2, and a
// plain singleton run, where every operator must be the identity).
//
// Tensor parallelism (trainer/parallel/tensor_parallel.h), over one TP group of every rank, with
// and without sequence parallelism:
//   - conjugacy of each pair, as linear maps on the group's buffers: <f(x), y> = <x, f^T(y)> and
//     <g(p), y> = <p, g^T(y)> for random x, y, p (a replicated tensor counted once, a sharded or
//     per-rank one summed over the ranks), to fp32 summation tolerance;
//   - f forward is the concatenation of the shards, g forward the sum of the partials;
//   - column- and row-parallel linear layers against the single-device product X W^T + b
//     (+ residual), written as a plain double-precision loop: each rank's slice of W, the bias and
//     residual by the rank-0 rule, and their backward (dX, dW, db) against the same loop.
// Vocab-parallel cross-entropy (vocab_parallel.h): the loss of every row and its logits' gradient
// against a plain log-sum-exp over the whole vocabulary.
// Expert dispatch (expert_dispatch.h), over one EP group of every rank: the regrouping maps are
// inverse permutations, every expert receives exactly its rows (each row's values name its source
// rank, its expert and its index), and dispatch followed by combine is the identity, exactly.
//
// Exits 1 with a message per failed check (after every rank has finished), or at once through
// MPI_Abort on an unexpected exception.
#include <cmath>
#include <cstdio>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <mpi.h>

#include "kernels/backend.h"
#include "kernels/common/check.h"
#include "trainer/comm/bootstrap.h"
#include "trainer/comm/communicator.h"
#include "trainer/comm/mpi_communicator.h"
#include "trainer/parallel/expert_dispatch.h"
#include "trainer/parallel/tensor_parallel.h"
#include "trainer/parallel/vocab_parallel.h"

using namespace tetra;

namespace {

int g_rank = 0, g_size = 1;
int64_t g_checks = 0, g_failures = 0;
std::string g_where;

void expect(bool ok, const std::string& what) {
  ++g_checks;
  if (ok) return;
  ++g_failures;
  std::fprintf(stderr, "rank %d [%s]: FAILED: %s\n", g_rank, g_where.c_str(), what.c_str());
}

// |got - want| <= tol * max(1, |want|)
void expect_close(double got, double want, double tol, const std::string& what) {
  expect(std::fabs(got - want) <= tol * std::max(1.0, std::fabs(want)),
         fmt::format("{}: got {:.9g}, want {:.9g} (tolerance {:g})", what, got, want, tol));
}

double sum_over_ranks(double v) {
  double out = 0.0;
  MPI_Allreduce(&v, &out, 1, MPI_DOUBLE, MPI_SUM, MPI_COMM_WORLD);
  return out;
}

double dot(const float* a, const float* b, int64_t n) {
  double s = 0.0;
  for (int64_t i = 0; i < n; ++i) s += static_cast<double>(a[i]) * b[i];
  return s;
}

// The same pseudo-random values on every rank for `seed`; `salt` (e.g. the rank) makes them differ.
std::vector<float> randoms(int64_t n, uint32_t seed, uint32_t salt = 0) {
  std::mt19937 gen(seed * 7919u + salt * 104729u + 1u);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = u(gen);
  return v;
}

// fp32 sums over <= a few hundred terms of magnitude <= 1, compared with double: 1e-5 relative.
constexpr double kTol = 1e-5;

// ---- tensor parallelism: the conjugate pairs ---------------------------------------------------
void check_pairs(Communicator* comm, Backend& be, bool sp) {
  const int p = comm ? comm->size() : 1, r = comm ? comm->rank() : 0;
  const int64_t C = 5, N = 4 * 3;  // N divisible by 1, 2, 3, 4
  TensorParallel tp(comm, sp, be, DType::F32, N, C);
  const bool shard = tp.sequence_parallel();
  const int64_t Ns = tp.shard_rows();
  g_where = fmt::format("tp{} {} pairs", p, shard ? "sp" : "no-sp");
  expect(Ns == (shard ? N / p : N), fmt::format("shard rows {}", Ns));

  // f: forward from the shards (sp) or a replicated X, backward from per-rank partials.
  {
    const std::vector<float> whole = randoms(N * C, 11);  // the concatenated shards / the replicated X
    std::vector<float> full(static_cast<size_t>(N * C), 0.0f), mine(static_cast<size_t>(Ns * C));
    for (int64_t i = 0; i < Ns * C; ++i) mine[i] = whole[static_cast<size_t>((shard ? r * Ns * C : 0) + i)];
    const float* fx = static_cast<const float*>(tp.copy_to_region(full.data(), mine.data()));
    double worst = 0.0;
    for (int64_t i = 0; i < N * C; ++i) worst = std::max(worst, std::fabs(double(fx[i]) - whole[i]));
    expect(worst == 0.0, fmt::format("f forward is the concatenation of the shards (worst {:g})", worst));

    std::vector<float> y = randoms(N * C, 12, static_cast<uint32_t>(r));  // per-rank partial gradients
    const double lhs = sum_over_ranks(dot(fx, y.data(), N * C));  // sum_i <f(x)_i, y_i>
    std::vector<float> dx(static_cast<size_t>(Ns * C), 0.0f);
    std::vector<float> ycopy = y;
    tp.copy_to_region_backward(shard ? dx.data() : ycopy.data(), ycopy.data());
    const float* ft = shard ? dx.data() : ycopy.data();
    // <x, f^T(y)>: sharded x summed over the ranks; a replicated x counted once (rank 0's).
    const double local = dot(whole.data() + (shard ? r * Ns * C : 0), ft, Ns * C);
    const double rhs = shard ? sum_over_ranks(local) : sum_over_ranks(r == 0 ? local : 0.0);
    expect_close(lhs, rhs, kTol, "<f(x), y> = <x, f^T(y)>");
    // f^T(y) is the sum of the partials (on this rank's rows).
    double worst_sum = 0.0;
    std::vector<double> total(static_cast<size_t>(N * C), 0.0);
    for (int q = 0; q < p; ++q) {
      const std::vector<float> yq = randoms(N * C, 12, static_cast<uint32_t>(q));
      for (int64_t i = 0; i < N * C; ++i) total[i] += yq[i];
    }
    for (int64_t i = 0; i < Ns * C; ++i)
      worst_sum = std::max(worst_sum, std::fabs(ft[i] - total[static_cast<size_t>((shard ? r * Ns * C : 0) + i)]));
    expect(worst_sum <= 1e-5, fmt::format("f backward sums the partials (worst {:g})", worst_sum));
  }
  // g: forward from per-rank partials, backward from the shards (sp) or a replicated dY.
  {
    // Without SP the partial is reduced in place (out == partial), with SP into the shard.
    std::vector<float> partial = randoms(N * C, 21, static_cast<uint32_t>(r));
    const std::vector<float> partial0 = partial;
    std::vector<float> out(static_cast<size_t>(Ns * C), 0.0f);
    float* gp = static_cast<float*>(tp.product_target(out.data(), partial.data()));
    expect(gp == (shard ? partial.data() : out.data()), "the product's buffer: the partial with SP, else the output");
    if (!shard) {
      out = partial;
      gp = out.data();
    }
    tp.reduce_from_region(out.data(), gp, nullptr);
    gp = out.data();
    std::vector<double> total(static_cast<size_t>(N * C), 0.0);
    for (int q = 0; q < p; ++q) {
      const std::vector<float> pq = randoms(N * C, 21, static_cast<uint32_t>(q));
      for (int64_t i = 0; i < N * C; ++i) total[i] += pq[i];
    }
    double worst = 0.0;
    for (int64_t i = 0; i < Ns * C; ++i)
      worst = std::max(worst, std::fabs(gp[i] - total[static_cast<size_t>((shard ? r * Ns * C : 0) + i)]));
    expect(worst <= 1e-5, fmt::format("g forward sums the partials (worst {:g})", worst));

    const std::vector<float> ywhole = randoms(N * C, 22);  // the concatenated shards / the replicated dY
    const float* ymine = ywhole.data() + (shard ? r * Ns * C : 0);
    // <g(p), y>: sharded output summed over ranks; a replicated one counted once.
    const double local = dot(gp, ymine, Ns * C);
    const double lhs = shard ? sum_over_ranks(local) : sum_over_ranks(r == 0 ? local : 0.0);
    std::vector<float> full(static_cast<size_t>(N * C), 0.0f);
    std::vector<float> dy(ymine, ymine + Ns * C);
    const float* gt = static_cast<const float*>(tp.reduce_from_region_backward(full.data(), dy.data()));
    const double rhs = sum_over_ranks(dot(partial0.data(), gt, N * C));  // sum_i <p_i, g^T(y)_i>
    expect_close(lhs, rhs, kTol, "<g(p), y> = <p, g^T(y)>");
  }
}

// ---- tensor parallelism: column- and row-parallel linear against one device ---------------------
void check_linear(Communicator* comm, Backend& be, bool sp) {
  const int p = comm ? comm->size() : 1, r = comm ? comm->rank() : 0;
  const int64_t N = 12, C = 6, F = 4 * p;  // F: the hidden width, split over the ranks
  const int64_t Fl = F / p;
  TensorParallel tp(comm, sp, be, DType::F32, N, C);
  const bool shard = tp.sequence_parallel();
  const int64_t Ns = tp.shard_rows(), row0 = shard ? r * Ns : 0;
  g_where = fmt::format("tp{} {} linear", p, shard ? "sp" : "no-sp");

  // The whole model: h = X W1^T + b1 (N, F) column-parallel; out = res + h W2^T + b2 (N, C) row-parallel.
  const std::vector<float> X = randoms(N * C, 31), W1 = randoms(F * C, 32), b1 = randoms(F, 33);
  const std::vector<float> W2 = randoms(C * F, 34), b2 = randoms(C, 35), res = randoms(N * C, 36);
  std::vector<double> H(static_cast<size_t>(N * F)), OUT(static_cast<size_t>(N * C));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t f = 0; f < F; ++f) {
      double s = b1[f];
      for (int64_t c = 0; c < C; ++c) s += double(X[i * C + c]) * W1[f * C + c];
      H[i * F + f] = s;
    }
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c) {
      double s = double(res[i * C + c]) + b2[c];
      for (int64_t f = 0; f < F; ++f) s += H[i * F + f] * W2[c * F + f];
      OUT[i * C + c] = s;
    }
  // This rank's slices: W1 rows [r Fl, (r+1) Fl) (column-parallel), W2 columns of the same range.
  std::vector<float> W1l(static_cast<size_t>(Fl * C)), b1l(static_cast<size_t>(Fl)), W2l(static_cast<size_t>(C * Fl));
  for (int64_t f = 0; f < Fl; ++f) {
    b1l[f] = b1[r * Fl + f];
    for (int64_t c = 0; c < C; ++c) W1l[f * C + c] = W1[(r * Fl + f) * C + c];
  }
  for (int64_t c = 0; c < C; ++c)
    for (int64_t f = 0; f < Fl; ++f) W2l[c * Fl + f] = W2[c * F + r * Fl + f];

  // Forward: x's shard -> f -> column-parallel -> row-parallel (+ residual) -> g.
  std::vector<float> x(static_cast<size_t>(N * C), 0.0f), xs(static_cast<size_t>(Ns * C));
  for (int64_t i = 0; i < Ns * C; ++i) xs[i] = X[row0 * C + i];
  const void* xf = tp.copy_to_region(x.data(), xs.data());
  std::vector<float> h(static_cast<size_t>(N * Fl));
  column_parallel_linear_forward(tp, be, xf, C, LinearWeights{W1l.data(), b1l.data()}, h.data(), Fl);
  double worst = 0.0;
  for (int64_t i = 0; i < N; ++i)
    for (int64_t f = 0; f < Fl; ++f) worst = std::max(worst, std::fabs(h[i * Fl + f] - H[i * F + r * Fl + f]));
  expect(worst <= 1e-5, fmt::format("column-parallel output = this rank's columns of X W^T + b (worst {:g})", worst));
  std::vector<float> out(static_cast<size_t>(Ns * C)), partial(static_cast<size_t>(N * C));
  std::vector<float> res_mine(res.begin() + row0 * C, res.begin() + (row0 + Ns) * C);
  if (!shard) out.resize(static_cast<size_t>(N * C));
  row_parallel_linear_forward(tp, be, h.data(), Fl, LinearWeights{W2l.data(), b2.data()}, res_mine.data(), out.data(),
                              partial.data());
  worst = 0.0;
  for (int64_t i = 0; i < Ns * C; ++i) worst = std::max(worst, std::fabs(out[i] - OUT[row0 * C + i]));
  expect(worst <= 1e-5, fmt::format("row-parallel output = residual + sum_i X_i W_i^T + b once (worst {:g})", worst));

  // Backward of the same two layers from dOUT (N, C): the single-device gradients by loops.
  const std::vector<float> DOUT = randoms(N * C, 37);
  std::vector<double> DH(static_cast<size_t>(N * F), 0.0), DX(static_cast<size_t>(N * C), 0.0);
  std::vector<double> DW2(static_cast<size_t>(C * F), 0.0), DB2(static_cast<size_t>(C), 0.0);
  std::vector<double> DW1(static_cast<size_t>(F * C), 0.0), DB1(static_cast<size_t>(F), 0.0);
  for (int64_t i = 0; i < N; ++i)
    for (int64_t c = 0; c < C; ++c) {
      const double d = DOUT[i * C + c];
      DB2[c] += d;
      for (int64_t f = 0; f < F; ++f) {
        DH[i * F + f] += d * W2[c * F + f];
        DW2[c * F + f] += d * H[i * F + f];
      }
    }
  for (int64_t i = 0; i < N; ++i)
    for (int64_t f = 0; f < F; ++f) {
      const double d = DH[i * F + f];
      DB1[f] += d;
      for (int64_t c = 0; c < C; ++c) {
        DX[i * C + c] += d * W1[f * C + c];
        DW1[f * C + c] += d * X[i * C + c];
      }
    }
  std::vector<float> dshard(DOUT.begin() + row0 * C, DOUT.begin() + (row0 + Ns) * C), dfull(static_cast<size_t>(N * C));
  const void* dy = tp.reduce_from_region_backward(dfull.data(), dshard.data());
  std::vector<float> dh(static_cast<size_t>(N * Fl)), gW2(static_cast<size_t>(C * Fl), 0.0f), gb2(static_cast<size_t>(C), 0.0f);
  row_parallel_linear_backward(tp, be, dy, h.data(), Fl, LinearWeights{W2l.data(), b2.data()},
                               LinearGrads{gW2.data(), gb2.data()}, dh.data());
  std::vector<float> gW1(static_cast<size_t>(Fl * C), 0.0f), gb1(static_cast<size_t>(Fl), 0.0f);
  std::vector<float> dxp(static_cast<size_t>(N * C)), dx(static_cast<size_t>(Ns * C));
  column_parallel_linear_backward(tp, be, dh.data(), Fl, xf, C, LinearWeights{W1l.data(), b1l.data()},
                                  LinearGrads{gW1.data(), gb1.data()}, dxp.data(), shard ? dx.data() : dxp.data());
  const float* dxr = shard ? dx.data() : dxp.data();
  double wdx = 0.0, wdw = 0.0, wdb = 0.0;
  for (int64_t i = 0; i < Ns * C; ++i) wdx = std::max(wdx, std::fabs(dxr[i] - DX[row0 * C + i]));
  for (int64_t f = 0; f < Fl; ++f) {
    wdb = std::max(wdb, std::fabs(gb1[f] - DB1[r * Fl + f]));
    for (int64_t c = 0; c < C; ++c) {
      wdw = std::max(wdw, std::fabs(gW1[f * C + c] - DW1[(r * Fl + f) * C + c]));
      wdw = std::max(wdw, std::fabs(gW2[c * Fl + f] - DW2[c * F + r * Fl + f]));
    }
  }
  for (int64_t c = 0; c < C; ++c) wdb = std::max(wdb, std::fabs(gb2[c] - DB2[c]));
  expect(wdx <= 1e-4, fmt::format("dX through both layers and f, g (worst {:g})", wdx));
  expect(wdw <= 1e-4, fmt::format("dW of this rank's slices (worst {:g})", wdw));
  expect(wdb <= 1e-4, fmt::format("db: column-parallel slice, row-parallel whole (worst {:g})", wdb));
}

// ---- vocab-parallel cross-entropy ----------------------------------------------------------------
void check_vocab_loss(Communicator* comm, Backend& be) {
  const int p = comm ? comm->size() : 1, r = comm ? comm->rank() : 0;
  const int64_t N = 6, Vl = 7, V = Vl * p;
  TensorParallel tp(comm, false, be, DType::F32, N, 4);
  g_where = fmt::format("tp{} vocab-parallel loss", p);
  std::vector<float> L = randoms(N * V, 41);
  for (float& v : L) v *= 4.0f;
  std::vector<int32_t> targets(static_cast<size_t>(N));
  for (int64_t i = 0; i < N; ++i) targets[i] = static_cast<int32_t>((i * 5 + 3) % V);
  targets[1] = -1;  // an ignored row
  std::vector<float> mine(static_cast<size_t>(N * Vl));
  for (int64_t i = 0; i < N; ++i)
    for (int64_t j = 0; j < Vl; ++j) mine[i * Vl + j] = L[i * V + r * Vl + j];
  std::vector<float> losses(static_cast<size_t>(N)), row_max(static_cast<size_t>(N)), sums(static_cast<size_t>(2 * N));
  const float scale = 0.5f;
  vocab_parallel_cross_entropy(tp, be, VocabSlice{r * Vl, Vl}, losses.data(), mine.data(), targets.data(), scale,
                               row_max.data(), sums.data());
  double wl = 0.0, wg = 0.0;
  for (int64_t i = 0; i < N; ++i) {
    double m = -1e30, s = 0.0;
    for (int64_t j = 0; j < V; ++j) m = std::max(m, double(L[i * V + j]));
    for (int64_t j = 0; j < V; ++j) s += std::exp(L[i * V + j] - m);
    const bool ignored = targets[i] < 0;
    const double loss = ignored ? 0.0 : std::log(s) + m - L[i * V + targets[i]];
    wl = std::max(wl, std::fabs(losses[i] - loss));
    for (int64_t j = 0; j < Vl; ++j) {
      const int64_t v = r * Vl + j;
      const double grad = ignored ? 0.0 : scale * (std::exp(L[i * V + v] - m) / s - (v == targets[i] ? 1.0 : 0.0));
      wg = std::max(wg, std::fabs(mine[i * Vl + j] - grad));
    }
  }
  expect(wl <= 1e-5, fmt::format("losses = log-sum-exp over the whole vocabulary - target logit (worst {:g})", wl));
  expect(wg <= 1e-6, fmt::format("dlogits of this rank's columns (worst {:g})", wg));
}

// ---- expert dispatch -------------------------------------------------------------------------------
void check_dispatch(Communicator* comm, Backend& be, int chunks) {
  const int ep = comm ? comm->size() : 1, r = comm ? comm->rank() : 0;
  const int64_t El = 3, E = El * ep, C = 3;
  g_where = fmt::format("ep{} dispatch in {} chunk(s)", ep, chunks);
  ExpertDispatcher xd(comm, be, DType::F32, C, E, chunks);
  expect(xd.local_experts() == El, "local experts");
  if (!xd.enabled()) {
    expect(ep == 1, "a dispatcher without a group only for one rank");
    return;
  }
  // This rank's kept rows per expert: a different count per (rank, expert), zero for some.
  std::vector<int64_t> kept(static_cast<size_t>(E));
  int64_t M = 0;
  for (int64_t e = 0; e < E; ++e) M += kept[e] = (r * 3 + e * 2) % 4;
  // Row k of expert e's block: (source rank, expert, k).
  std::vector<float> send(static_cast<size_t>(M * C));
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e)
    for (int64_t k = 0; k < kept[e]; ++k, ++row) {
      send[row * C + 0] = static_cast<float>(r);
      send[row * C + 1] = static_cast<float>(e);
      send[row * C + 2] = static_cast<float>(k);
    }
  const int64_t R_max = static_cast<int64_t>(ep) * El * 4;
  std::vector<int32_t> counts(static_cast<size_t>(E + ep * El)), h_counts(counts.size());
  std::vector<int32_t> regroup(static_cast<size_t>(R_max)), ungroup(static_cast<size_t>(R_max));
  const ExpertExchange x = xd.exchange_counts(kept, counts.data(), h_counts, regroup, ungroup);
  // Inverse permutations of [0, R).
  bool inverse = true;
  for (int64_t q = 0; q < x.R; ++q) inverse = inverse && regroup[q] >= 0 && regroup[q] < x.R && ungroup[regroup[q]] == q;
  expect(inverse, "regroup and ungroup are inverse permutations");
  // The chunks: consecutive experts, their expert-major rows consecutive ranges covering [0, R).
  bool chunk_ok = x.chunks() == chunks && x.chunk_rows.front() == 0 && x.chunk_rows.back() == x.R;
  for (int j = 0; j < x.chunks(); ++j) {
    int64_t rows = 0;
    for (int64_t i = x.chunk_experts[j]; i < x.chunk_experts[j + 1]; ++i) rows += x.expert_rows[i];
    chunk_ok = chunk_ok && x.chunk_rows[j + 1] - x.chunk_rows[j] == rows;
  }
  expect(chunk_ok, "each chunk's experts own one contiguous range of the expert-major rows");
  std::vector<float> src(static_cast<size_t>(std::max<int64_t>(x.R, 1) * C)), recv(src.size());
  xd.dispatch(x, send.data(), src.data(), regroup.data(), recv.data());
  // Expert-major: local expert j's rows from source 0, 1, ... in order, each (q, e0 + j, k = 0..).
  bool rows_ok = true;
  int64_t at = 0;
  for (int64_t j = 0; j < El; ++j) {
    const int64_t e = r * El + j;
    int64_t n = 0;
    for (int q = 0; q < ep; ++q) {
      const int64_t count = (q * 3 + e * 2) % 4;  // what rank q kept for expert e
      for (int64_t k = 0; k < count; ++k, ++at, ++n)
        rows_ok = rows_ok && recv[at * C] == q && recv[at * C + 1] == e && recv[at * C + 2] == k;
    }
    rows_ok = rows_ok && x.expert_rows[j] == n;
  }
  expect(rows_ok && at == x.R, "every local expert receives exactly its rows, sources in order");
  // Scale the rows as an expert would, then combine: the sources get their rows back, in order.
  std::vector<float> back(static_cast<size_t>(std::max<int64_t>(M, 1) * C), -1.0f);
  xd.combine(x, recv.data(), src.data(), ungroup.data(), back.data());
  bool identity = true;
  for (int64_t i = 0; i < M * C; ++i) identity = identity && back[i] == send[i];
  expect(identity, "combine after dispatch is the identity");
  const ExpertTraffic t = xd.take_traffic();
  int64_t to_others = 0;
  for (int q = 0; q < ep; ++q)
    if (q != r) to_others += x.send_rows[q];
  expect(t.dispatch_bytes == to_others * C * 4, "dispatch bytes: the rows sent to other ranks");
}

}  // namespace

int main(int argc, char** argv) {
  const ProcessInfo info = dist_init(&argc, &argv);
  g_rank = info.rank;
  g_size = info.size;
  try {
    std::unique_ptr<Backend> be = make_cpu_backend(1);
    std::vector<int> all;
    for (int i = 0; i < info.size; ++i) all.push_back(i);
    std::unique_ptr<Communicator> group = make_mpi_communicator("tp", all);
    Communicator* comm = info.size > 1 ? group.get() : nullptr;
    for (bool sp : {false, true}) {
      check_pairs(comm, *be, sp);
      check_linear(comm, *be, sp);
    }
    check_vocab_loss(comm, *be);
    for (int chunks : {1, 2, 3}) check_dispatch(comm, *be, chunks);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d [%s]: unexpected exception: %s\n", g_rank, g_where.c_str(), e.what());
    dist_abort(1);
  }
  int64_t failures = 0;
  MPI_Allreduce(&g_failures, &failures, 1, MPI_INT64_T, MPI_SUM, MPI_COMM_WORLD);
  if (g_rank == 0)
    std::printf("test_parallel: %d process(es), %lld checks on rank 0, %lld failures on all ranks\n", g_size,
                static_cast<long long>(g_checks), static_cast<long long>(failures));
  dist_finalize();
  return failures == 0 ? 0 : 1;
}
