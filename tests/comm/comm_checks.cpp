// The checks the communicator tests share (see comm_checks.h): the buffer over host or backend
// memory, the expected data and accounting, and one function per kind of operation.
#include "tests/comm/comm_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>

#include <fmt/format.h>

#include "kernels/common/math.h"

namespace tetra_dist_test {

using namespace tetra;

void Checker::expect(bool ok, const std::string& what) {
  ++checks;
  if (ok) return;
  ++failures;
  std::fprintf(stderr, "FAIL rank %d [%s]: %s\n", rank, where.c_str(), what.c_str());
}

void expect_values(Checker& ck, const std::vector<double>& got, const std::vector<double>& want, const std::string& what) {
  if (got.size() != want.size()) {
    ck.expect(false, fmt::format("{}: {} elements, expected {}", what, got.size(), want.size()));
    return;
  }
  int64_t bad = 0, first = -1;
  for (size_t i = 0; i < got.size(); ++i)
    if (got[i] != want[i] && bad++ == 0) first = static_cast<int64_t>(i);
  ck.expect(bad == 0, bad == 0 ? what
                               : fmt::format("{}: {} of {} elements wrong, first element {}: {} != {}", what, bad,
                                             got.size(), first, got[static_cast<size_t>(first)],
                                             want[static_cast<size_t>(first)]));
}

double val(int g, int64_t i, int salt) { return static_cast<double>((g * 7 + i * 3 + salt) % 13) - 6.0; }

double reduce_members(const std::vector<int>& members, ReduceOp op, int64_t i, int salt) {
  double acc = op == ReduceOp::SUM ? 0.0 : -1e30;
  for (int m : members) acc = op == ReduceOp::SUM ? acc + val(m, i, salt) : std::max(acc, val(m, i, salt));
  return acc;
}

const char* op_name(ReduceOp op) { return op == ReduceOp::SUM ? "sum" : "max"; }

const std::vector<DType> kAllTypes = {DType::F32, DType::BF16, DType::F16, DType::I32};
const std::vector<ReduceOp> kAllOps = {ReduceOp::SUM, ReduceOp::MAX};

// ---- Buf ------------------------------------------------------------------------------------------

Buf::Buf(Backend* be, DType type, int64_t n, double fill)
    : be_(be), type_(type), n_(n), host_(static_cast<size_t>(n) * dtype_size(type)) {
  if (be_ != nullptr) dev_ = be_->alloc(host_.size());
  for (int64_t i = 0; i < n; ++i) set(i, fill);
  upload();
}

Buf::~Buf() {
  if (be_ != nullptr) be_->free(dev_);
}

void Buf::set(int64_t i, double v) {
  uint8_t* p = host_.data() + i * static_cast<int64_t>(dtype_size(type_));
  if (type_ == DType::F32) {
    const float x = static_cast<float>(v);
    std::memcpy(p, &x, 4);
  } else if (type_ == DType::BF16 || type_ == DType::F16) {
    const uint16_t b = type_ == DType::F16 ? math::f32_to_f16_bits(static_cast<float>(v))
                                           : math::f32_to_bf16_bits(static_cast<float>(v));
    std::memcpy(p, &b, 2);
  } else {
    const int32_t x = static_cast<int32_t>(v);
    std::memcpy(p, &x, 4);
  }
}

double Buf::get(int64_t i) const {
  const uint8_t* p = host_.data() + i * static_cast<int64_t>(dtype_size(type_));
  if (type_ == DType::F32) {
    float x;
    std::memcpy(&x, p, 4);
    return x;
  }
  if (type_ == DType::BF16 || type_ == DType::F16) {
    uint16_t b;
    std::memcpy(&b, p, 2);
    return type_ == DType::F16 ? math::f16_bits_to_f32(b) : math::bf16_bits_to_f32(b);
  }
  int32_t x;
  std::memcpy(&x, p, 4);
  return x;
}

std::vector<double> Buf::values() const {
  std::vector<double> v(static_cast<size_t>(n_));
  for (int64_t i = 0; i < n_; ++i) v[static_cast<size_t>(i)] = get(i);
  return v;
}

Buf& Buf::upload() {
  if (be_ != nullptr) be_->copy_from_host(dev_, host_.data(), host_.size());
  return *this;
}

Buf& Buf::download() {
  if (be_ != nullptr) be_->copy_to_host(host_.data(), dev_, host_.size());
  return *this;
}

// ---- accounting -----------------------------------------------------------------------------------

void ExpectedStats::add(CommOp op, int64_t payload, double sent) {
  if (p == 1) return;
  const int i = static_cast<int>(op);
  s.calls[i] += 1;
  s.payload_bytes[i] += payload;
  s.sent_bytes[i] += sent;
}

void compare_stats(Checker& ck, const CommStats& got, const ExpectedStats& want) {
  for (int i = 0; i < kCommOps; ++i) {
    const char* op = comm_op_name(static_cast<CommOp>(i));
    ck.expect(got.calls[i] == want.s.calls[i], fmt::format("stats {} calls {} != {}", op, got.calls[i], want.s.calls[i]));
    ck.expect(got.payload_bytes[i] == want.s.payload_bytes[i],
              fmt::format("stats {} payload {} != {}", op, got.payload_bytes[i], want.s.payload_bytes[i]));
    // Sums of a few products of small integers with (p-1)/p: equal up to double rounding.
    ck.expect(std::abs(got.sent_bytes[i] - want.s.sent_bytes[i]) <= 1e-9 * (1.0 + want.s.sent_bytes[i]),
              fmt::format("stats {} sent {} != {}", op, got.sent_bytes[i], want.s.sent_bytes[i]));
  }
  double total = 0.0;
  for (double b : want.s.sent_bytes) total += b;
  ck.expect(std::abs(got.total_sent() - total) <= 1e-9 * (1.0 + total), "stats total_sent");
}

// ---- operations -----------------------------------------------------------------------------------

namespace {

int64_t elem(DType t) { return static_cast<int64_t>(dtype_size(t)); }

}  // namespace

void check_all_reduce(Checker& ck, Communicator& c, Backend* be, ExpectedStats& want, int64_t n,
                      const std::vector<DType>& types, const std::vector<ReduceOp>& ops) {
  const std::string where = ck.where;
  for (DType t : types)
    for (ReduceOp op : ops) {
      ck.where = fmt::format("{} all_reduce {} {} n={}", where, dtype_name(t), op_name(op), n);
      Buf b(be, t, n);
      std::vector<double> expected(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) {
        b.set(i, val(ck.rank, i, 1));
        expected[static_cast<size_t>(i)] = reduce_members(c.members(), op, i, 1);
      }
      c.all_reduce(b.upload().ptr(), n, t, op);
      want.all_reduce(n * elem(t));
      expect_values(ck, b.download().values(), expected, "reduced elements");
    }
  ck.where = where;
}

void check_half_rounding(Checker& ck, Communicator& c, Backend* be, ExpectedStats& want) {
  if (c.size() < 2) return;
  const std::string where = ck.where;
  // Group rank 0 gives 1, rank 1 a fraction of the type's step at 1 (bf16 2^-7, fp16 2^-10), the
  // others 0 (exact in any combining order): 1.5, 0.5 (a tie) and 1.25 steps.
  struct Case { DType type; double step; std::vector<double> rounded; };
  const Case cases[] = {{DType::BF16, 1.0 / 128, {1.015625, 1.0, 1.0078125}},             // even, even, nearest
                        {DType::F16, 1.0 / 1024, {1.001953125, 1.0, 1.0009765625}}};   // even, even, nearest
  const int r = c.rank();
  for (const Case& k : cases) {
    ck.where = fmt::format("{} all_reduce {} rounding", where, dtype_name(k.type));
    const double frac[3] = {1.5 * k.step, 0.5 * k.step, 1.25 * k.step};
    Buf b(be, k.type, 3);
    for (int i = 0; i < 3; ++i) b.set(i, r == 0 ? 1.0 : (r == 1 ? frac[i] : 0.0));
    c.all_reduce(b.upload().ptr(), 3, k.type, ReduceOp::SUM);
    want.all_reduce(3 * 2);
    expect_values(ck, b.download().values(), k.rounded, "rounded sums");
  }
  ck.where = where;
}

void check_reduce_scatter(Checker& ck, Communicator& c, Backend* be, ExpectedStats& want, int64_t blk,
                          const std::vector<DType>& types, const std::vector<ReduceOp>& ops, bool send_blocks_kept) {
  const int p = c.size(), r = c.rank();
  const std::string where = ck.where;
  for (DType t : types)
    for (ReduceOp op : ops)
      for (bool in_place : {false, true}) {
        ck.where = fmt::format("{} reduce_scatter {} {}{}", where, dtype_name(t), op_name(op),
                               in_place ? " in place" : "");
        Buf send(be, t, p * blk), out(be, t, blk, 99);
        for (int64_t j = 0; j < p * blk; ++j) send.set(j, val(ck.rank, j, 2));
        send.upload();
        c.reduce_scatter(in_place ? send.at(r * blk) : out.ptr(), send.ptr(), blk, t, op);
        want.reduce_scatter(p * blk * elem(t));
        const std::vector<double> got = (in_place ? send : out).download().values();
        const int64_t base = in_place ? r * blk : 0;
        std::vector<double> block(got.begin() + base, got.begin() + base + blk), expected(static_cast<size_t>(blk));
        for (int64_t i = 0; i < blk; ++i) expected[static_cast<size_t>(i)] = reduce_members(c.members(), op, r * blk + i, 2);
        expect_values(ck, block, expected, "this rank's block");
        if (in_place && send_blocks_kept) {
          bool kept = true;
          for (int64_t j = 0; j < p * blk; ++j)
            if (j / blk != r) kept = kept && got[static_cast<size_t>(j)] == val(ck.rank, j, 2);
          ck.expect(kept, "the other blocks of the send buffer keep this rank's input");
        }
      }
  ck.where = where;
}

void check_all_gather(Checker& ck, Communicator& c, Backend* be, ExpectedStats& want, int64_t blk,
                      const std::vector<DType>& types) {
  const int p = c.size(), r = c.rank();
  const std::string where = ck.where;
  for (DType t : types)
    for (bool in_place : {false, true}) {
      ck.where = fmt::format("{} all_gather {}{}", where, dtype_name(t), in_place ? " in place" : "");
      Buf recv(be, t, p * blk, 99), send(be, t, blk);
      for (int64_t i = 0; i < blk; ++i) (in_place ? recv : send).set((in_place ? r * blk : 0) + i, val(ck.rank, i, 3));
      recv.upload();
      send.upload();
      c.all_gather(recv.ptr(), in_place ? recv.at(r * blk) : send.ptr(), blk, t);
      want.all_gather(p * blk * elem(t));
      std::vector<double> expected(static_cast<size_t>(p * blk));
      for (int q = 0; q < p; ++q)
        for (int64_t i = 0; i < blk; ++i) expected[static_cast<size_t>(q * blk + i)] = val(c.members()[q], i, 3);
      expect_values(ck, recv.download().values(), expected, "every member's block in group order");
    }
  ck.where = where;
}

void check_all_to_all_v(Checker& ck, Communicator& c, Backend* be, ExpectedStats& want,
                        const std::vector<DType>& types) {
  const int p = c.size(), r = c.rank(), g = ck.rank;
  const std::vector<int>& m = c.members();
  const std::string where = ck.where;
  // Sender s sends cnt(s, d) elements (0, 1 or 2) to group rank d, its blocks laid out in reverse
  // destination order with one-element gaps; receivers place blocks in source order with
  // two-element gaps.
  const auto cnt = [](int s_global, int d) { return static_cast<int64_t>((s_global + 2 * d) % 3); };
  const auto code = [](int s_global, int d, int64_t k) { return static_cast<double>(s_global * 16 + d * 4 + k); };
  for (DType t : types) {
    ck.where = fmt::format("{} all_to_all_v {}", where, dtype_name(t));
    std::vector<int64_t> sc(p), so(p), rc(p), ro(p);
    int64_t off = 0, total = 0;
    for (int d = p - 1; d >= 0; --d) {
      sc[d] = cnt(g, d);
      so[d] = off;
      off += sc[d] + 1;
      total += sc[d];
    }
    Buf send(be, t, off, -1);
    for (int d = 0; d < p; ++d)
      for (int64_t k = 0; k < sc[d]; ++k) send.set(so[d] + k, code(g, d, k));
    send.upload();
    int64_t roff = 0;
    for (int s = 0; s < p; ++s) {
      rc[s] = cnt(m[s], r);
      ro[s] = roff;
      roff += rc[s] + 2;
    }
    Buf recv(be, t, roff, -3);
    c.all_to_all_v(send.ptr(), sc, so, recv.ptr(), rc, ro, t);
    want.add(CommOp::ALL_TO_ALL, total * elem(t), static_cast<double>((total - sc[r]) * elem(t)));
    std::vector<double> expected(static_cast<size_t>(roff), -3.0);
    for (int s = 0; s < p; ++s)
      for (int64_t k = 0; k < rc[s]; ++k) expected[static_cast<size_t>(ro[s] + k)] = code(m[s], r, k);
    expect_values(ck, recv.download().values(), expected, "received blocks, gaps untouched");
  }
  ck.where = where;
}

void check_broadcast(Checker& ck, Communicator& c, Backend* be, ExpectedStats& want, int64_t n) {
  const std::string where = ck.where;
  for (int root = 0; root < c.size(); ++root) {
    ck.where = fmt::format("{} broadcast from {}", where, root);
    Buf b(be, DType::F32, n, -7);
    std::vector<double> expected(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      if (c.rank() == root) b.set(i, val(ck.rank, i, 4));
      expected[static_cast<size_t>(i)] = val(c.members()[root], i, 4);
    }
    c.broadcast(b.upload().ptr(), n, DType::F32, root);
    want.broadcast(n * 4);
    expect_values(ck, b.download().values(), expected, "the root's elements");
  }
  ck.where = where;
}

void check_tagged_sends(Checker& ck, Communicator& c, Backend* be, ExpectedStats& want, int64_t k, int64_t stride) {
  const int p = c.size(), r = c.rank();
  if (p < 2 || (p % 2 == 1 && r == p - 1)) return;
  const std::string where = ck.where;
  ck.where = where + " crossed sends with tags";
  const int peer = r ^ 1;
  Buf a(be, DType::F32, k), b(be, DType::F32, k), got_a(be, DType::F32, k, -1), got_b(be, DType::F32, k, -1);
  std::vector<double> want_a(static_cast<size_t>(k), 0.0), want_b(static_cast<size_t>(k), 0.0);
  for (int64_t i = 0; i < k; i += stride) {
    a.set(i, val(ck.rank, i, 6));
    b.set(i, val(ck.rank, i, 7));
    want_a[static_cast<size_t>(i)] = val(c.members()[peer], i, 6);
    want_b[static_cast<size_t>(i)] = val(c.members()[peer], i, 7);
  }
  a.upload();
  b.upload();
  tetra::WorkHandle sa = c.send_async(a.ptr(), k, DType::F32, peer, /*tag=*/0);
  tetra::WorkHandle sb = c.send_async(b.ptr(), k, DType::F32, peer, /*tag=*/1);
  tetra::WorkHandle rb = c.recv_async(got_b.ptr(), k, DType::F32, peer, /*tag=*/1);
  tetra::WorkHandle ra = c.recv_async(got_a.ptr(), k, DType::F32, peer, /*tag=*/0);
  c.wait(*rb, CommOp::RECV);
  c.wait(*ra, CommOp::RECV);
  c.wait(*sa, CommOp::SEND);
  c.wait(*sb, CommOp::SEND);
  for (int j = 0; j < 2; ++j) {
    want.send(k * 4);
    want.recv(k * 4);
  }
  expect_values(ck, got_a.download().values(), want_a, "tag 0 stream");
  expect_values(ck, got_b.download().values(), want_b, "tag 1 stream");
  ck.where = where;
}

}  // namespace tetra_dist_test
