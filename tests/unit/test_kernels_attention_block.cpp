// Context parallelism's attention blocks (Backend::attention_block_forward / _backward) and the
// block plan of ring attention (ContextParallel::block_range, positions_of): a causal sequence
// cut into CP ranks' chunks and computed block by block, merged by log-sum-exp, must equal the
// whole sequence's causal attention, forward (out, lse) and backward (dq, dk, dv), and every
// rank must do the same work.
#include <catch2/catch.hpp>

#include <set>
#include <utility>

#include "attention_testing.h"
#include "kernels/backend.h"
#include "trainer/parallel/context_parallel.h"

using namespace tetra;
using namespace tetra::attn_testing;

namespace {

struct Dims {
  int64_t B, T, NH, NKV, HS;
  int cp;
  int64_t qkv() const { return (NH + 2 * NKV) * HS; }
};

// Rows `pos` of every sequence of x (B, T, width) -> (B, pos.size(), width).
std::vector<float> gather_rows(const std::vector<float>& x, int64_t B, int64_t T, int64_t width,
                               const std::vector<int32_t>& pos) {
  const int64_t Tl = static_cast<int64_t>(pos.size());
  std::vector<float> out(static_cast<size_t>(B * Tl * width));
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < Tl; ++t)
      std::copy_n(x.begin() + (b * T + pos[static_cast<size_t>(t)]) * width, width,
                  out.begin() + (b * Tl + t) * width);
  return out;
}

void check_blocks(const Dims& d) {
  auto be = make_cpu_backend(0);
  const int64_t Q = d.qkv(), A = d.NH * d.HS, KV = d.NKV * d.HS, Tl = d.T / d.cp;
  const std::vector<float> qkv = random_floats(static_cast<size_t>(d.B * d.T * Q), 11, -2.0f, 2.0f);
  const std::vector<float> dout = random_floats(static_cast<size_t>(d.B * d.T * A), 12);
  std::vector<float> out(static_cast<size_t>(d.B * d.T * A)), lse(static_cast<size_t>(d.B * d.NH * d.T));
  std::vector<float> dqkv(qkv.size());
  be->attention_forward(out.data(), lse.data(), qkv.data(), d.B, d.T, d.NH, d.NKV, d.HS, DType::F32);
  be->attention_backward(dqkv.data(), dout.data(), qkv.data(), out.data(), lse.data(), d.B, d.T, d.NH, d.NKV, d.HS,
                         DType::F32);

  std::vector<std::vector<int32_t>> pos;
  std::vector<std::vector<float>> local_qkv, dk, dv;
  for (int r = 0; r < d.cp; ++r) {
    pos.push_back(ContextParallel::positions_of(d.T, d.cp, r));
    local_qkv.push_back(gather_rows(qkv, d.B, d.T, Q, pos.back()));
    dk.emplace_back(static_cast<size_t>(d.B * Tl * KV), 0.0f);
    dv.emplace_back(static_cast<size_t>(d.B * Tl * KV), 0.0f);
  }
  auto view = [](const float* p, int64_t row, int64_t seq) { return AttnView{const_cast<float*>(p), row, seq}; };
  for (int r = 0; r < d.cp; ++r) {
    INFO("CP rank " << r << " of " << d.cp);
    std::vector<float> o(static_cast<size_t>(d.B * Tl * A)), l(static_cast<size_t>(d.B * d.NH * Tl));
    std::vector<float> dq(static_cast<size_t>(d.B * Tl * A), 0.0f);
    const std::vector<float> my_out = gather_rows(out, d.B, d.T, A, pos[static_cast<size_t>(r)]);
    const std::vector<float> my_dout = gather_rows(dout, d.B, d.T, A, pos[static_cast<size_t>(r)]);
    std::vector<float> my_lse(l.size());  // the reference's lse at this rank's positions
    for (int64_t bh = 0; bh < d.B * d.NH; ++bh)
      for (int64_t t = 0; t < Tl; ++t)
        my_lse[static_cast<size_t>(bh * Tl + t)] = lse[static_cast<size_t>(bh * d.T + pos[static_cast<size_t>(r)][t])];
    const float* q = local_qkv[static_cast<size_t>(r)].data();
    for (int i = 0; i < d.cp; ++i) {  // the ring's order
      const int s = (r + d.cp - i) % d.cp;
      const ContextParallel::BlockRange range = ContextParallel::block_range(Tl, r, s);
      const float* kv = local_qkv[static_cast<size_t>(s)].data();
      AttnBlock blk;
      blk.B = d.B;
      blk.Tq = range.Tq;
      blk.Tk = range.Tk;
      blk.NH = d.NH;
      blk.NKV = d.NKV;
      blk.HS = d.HS;
      blk.causal = range.causal;
      blk.q = view(q + range.q0 * Q, Q, Tl * Q);
      blk.k = view(kv + A, Q, Tl * Q);
      blk.v = view(kv + A + KV, Q, Tl * Q);
      blk.lse = l.data() + range.q0;
      blk.lse_ld = Tl;
      be->attention_block_forward(blk, view(o.data() + range.q0 * A, A, Tl * A), i == 0, DType::F32);
      // The backward against the finished output's lse (the reference's).
      blk.lse = my_lse.data() + range.q0;
      be->attention_block_backward(blk, view(my_dout.data() + range.q0 * A, A, Tl * A),
                                   view(my_out.data() + range.q0 * A, A, Tl * A),
                                   view(dq.data() + range.q0 * A, A, Tl * A),
                                   view(dk[static_cast<size_t>(s)].data(), KV, Tl * KV),
                                   view(dv[static_cast<size_t>(s)].data(), KV, Tl * KV), DType::F32);
    }
    // fp32 merges of O(1) values: a few roundings apart from the one-pass kernel.
    require_close("out", o, my_out, [](size_t) { return 2e-5; });
    require_close("lse", l, my_lse, [](size_t) { return 2e-5; });
    const std::vector<float> ref_d = gather_rows(dqkv, d.B, d.T, Q, pos[static_cast<size_t>(r)]);
    std::vector<float> want_dq(dq.size());
    for (int64_t row = 0; row < d.B * Tl; ++row)
      std::copy_n(ref_d.begin() + row * Q, A, want_dq.begin() + row * A);
    require_close("dq", dq, want_dq, [](size_t) { return 5e-5; });
  }
  for (int s = 0; s < d.cp; ++s) {  // each rank's dk, dv: the sum of every rank's queries' blocks
    INFO("dk, dv of CP rank " << s << " of " << d.cp);
    const std::vector<float> ref_d = gather_rows(dqkv, d.B, d.T, Q, pos[static_cast<size_t>(s)]);
    std::vector<float> want_k(dk[0].size()), want_v(dv[0].size());
    for (int64_t row = 0; row < d.B * Tl; ++row) {
      std::copy_n(ref_d.begin() + row * Q + A, KV, want_k.begin() + row * KV);
      std::copy_n(ref_d.begin() + row * Q + A + KV, KV, want_v.begin() + row * KV);
    }
    require_close("dk", dk[static_cast<size_t>(s)], want_k, [](size_t) { return 5e-5; });
    require_close("dv", dv[static_cast<size_t>(s)], want_v, [](size_t) { return 5e-5; });
  }
}

}  // namespace

TEST_CASE("attention blocks: a sequence cut over CP ranks, computed block by block, equals causal attention",
          "[kernels]") {
  // T / (2 cp) = 5 fits in a tile; 70 makes blocks of two and three tiles with partial ones; GQA,
  // MHA, and HS = 24 (not a whole number of vectors).
  const Dims dims[] = {{2, 20, 4, 2, 8, 2}, {1, 30, 4, 4, 8, 3}, {1, 280, 4, 1, 24, 2}, {2, 80, 2, 2, 16, 4}};
  for (const Dims& d : dims) {
    INFO("B=" << d.B << " T=" << d.T << " NH=" << d.NH << " NKV=" << d.NKV << " HS=" << d.HS << " cp=" << d.cp);
    check_blocks(d);
  }
}

TEST_CASE("context parallel: the ring's blocks cover each causal pair once, the same work on every rank",
          "[kernels]") {
  for (int cp = 1; cp <= 8; ++cp) {
    const int64_t c = 3, T = 2 * cp * c, Tl = T / cp;
    std::set<std::pair<int32_t, int32_t>> seen;  // (query position, key position)
    int64_t work0 = -1;
    for (int r = 0; r < cp; ++r) {
      const std::vector<int32_t> pr = ContextParallel::positions_of(T, cp, r);
      int64_t work = 0;
      for (int s = 0; s < cp; ++s) {
        const std::vector<int32_t> ps = ContextParallel::positions_of(T, cp, s);
        const ContextParallel::BlockRange b = ContextParallel::block_range(Tl, r, s);
        for (int64_t i = 0; i < b.Tq; ++i)
          for (int64_t j = 0; j < (b.causal ? i + 1 : b.Tk); ++j) {
            const int32_t pq = pr[static_cast<size_t>(b.q0 + i)], pk = ps[static_cast<size_t>(j)];
            INFO("cp " << cp << " rank " << r << " block of rank " << s << ": query " << pq << ", key " << pk);
            REQUIRE(pk <= pq);                                // visible under the causal mask
            REQUIRE(seen.insert({pq, pk}).second);            // and computed once
            ++work;
          }
      }
      if (work0 < 0) work0 = work;
      CHECK(work == work0);  // every rank the same number of scores
    }
    CHECK(static_cast<int64_t>(seen.size()) == T * (T + 1) / 2);  // every causal pair
  }
}
