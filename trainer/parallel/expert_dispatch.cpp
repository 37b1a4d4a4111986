#include "trainer/parallel/expert_dispatch.h"

#include <chrono>

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"

namespace tetra {

namespace {

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The element counts and offsets of an all_to_all_v side that moves rows[r] rows of width C to
// (or from) each rank r, back to back.
void row_extents(const std::vector<int64_t>& rows, int64_t C, std::vector<int64_t>& counts,
                 std::vector<int64_t>& offsets) {
  counts.resize(rows.size());
  offsets.resize(rows.size());
  int64_t at = 0;
  for (size_t r = 0; r < rows.size(); ++r) {
    counts[r] = rows[r] * C, offsets[r] = at;
    at += counts[r];
  }
}

}  // namespace

ExpertExchange plan_expert_exchange(const std::vector<int64_t>& kept, const int32_t* recv_counts, int ep, int64_t El,
                                    std::vector<int32_t>& regroup, std::vector<int32_t>& ungroup) {
  ExpertExchange x;
  x.send_rows.assign(static_cast<size_t>(ep), 0);
  x.recv_rows.assign(static_cast<size_t>(ep), 0);
  x.expert_rows.assign(static_cast<size_t>(El), 0);
  for (int r = 0; r < ep; ++r)
    for (int64_t j = 0; j < El; ++j) {
      x.send_rows[r] += kept[r * El + j];
      const int64_t c = recv_counts[r * El + j];
      x.recv_rows[r] += c;
      x.expert_rows[j] += c;
    }
  for (int r = 0; r < ep; ++r) x.R += x.recv_rows[r];
  TETRA_CHECK(static_cast<int64_t>(regroup.size()) >= x.R && static_cast<int64_t>(ungroup.size()) >= x.R,
              "expert exchange: {} rows received, maps sized for {}", x.R, regroup.size());
  // Source-major (as received: source q's rows for its local experts in expert order) to
  // expert-major (local expert j's rows from every source, sources in order).
  std::vector<int64_t> src_start(static_cast<size_t>(ep), 0), exp_start(static_cast<size_t>(El), 0);
  for (int r = 1; r < ep; ++r) src_start[r] = src_start[r - 1] + x.recv_rows[r - 1];
  for (int64_t j = 1; j < El; ++j) exp_start[j] = exp_start[j - 1] + x.expert_rows[j - 1];
  std::vector<int64_t> fill = exp_start;
  for (int r = 0; r < ep; ++r) {
    int64_t sp = src_start[r];
    for (int64_t j = 0; j < El; ++j)
      for (int64_t t = 0; t < recv_counts[r * El + j]; ++t, ++sp) {
        const int64_t q = fill[j]++;
        regroup[q] = static_cast<int32_t>(sp);
        ungroup[sp] = static_cast<int32_t>(q);
      }
  }
  return x;
}

ExpertDispatcher::ExpertDispatcher(Communicator* ep, Backend& be, DType act, int64_t C, int64_t E)
    : ep_(ep && ep->size() > 1 ? ep : nullptr), be_(be), act_(act), C_(C), E_(E) {
  const int n = size();
  TETRA_CHECK(E % n == 0, "{} experts cannot be split evenly over {} EP ranks", E, n);
  El_ = E / n;
}

int ExpertDispatcher::size() const { return ep_ ? ep_->size() : 1; }

ExpertExchange ExpertDispatcher::exchange_counts(const std::vector<int64_t>& kept, int32_t* counts,
                                                 std::vector<int32_t>& h_counts, std::vector<int32_t>& regroup,
                                                 std::vector<int32_t>& ungroup) {
  TETRA_CHECK(ep_, "exchange_counts without an expert-parallel group");
  const int ep = ep_->size();
  // Rank r sends each EP rank q the kept counts of q's experts.
  const auto t0 = std::chrono::steady_clock::now();
  for (int64_t e = 0; e < E_; ++e) h_counts[e] = static_cast<int32_t>(kept[e]);
  be_.copy_from_host(counts, h_counts.data(), static_cast<size_t>(E_) * 4);
  std::vector<int64_t> n(ep, El_), off(ep);
  for (int r = 0; r < ep; ++r) off[r] = r * El_;
  ep_->all_to_all_v(counts, n, off, counts + E_, n, off, DType::I32);
  be_.copy_to_host(h_counts.data() + E_, counts + E_, static_cast<size_t>(ep * El_) * 4);
  traffic_.dispatch_s += since(t0);
  return plan_expert_exchange(kept, h_counts.data() + E_, ep, El_, regroup, ungroup);
}

// Rows sent to EP rank r: the blocks of its experts, contiguous in x_perm's expert order.
void ExpertDispatcher::dispatch(const ExpertExchange& x, const void* send, void* src, const int32_t* regroup,
                                void* recv) {
  const auto t0 = std::chrono::steady_clock::now();
  const int ep = ep_->size();
  std::vector<int64_t> sc, so, rc, ro;
  row_extents(x.send_rows, C_, sc, so);
  row_extents(x.recv_rows, C_, rc, ro);
  ep_->all_to_all_v(send, sc, so, src, rc, ro, act_);
  be_.moe_gather_rows(recv, src, regroup, x.R, C_, act_);
  traffic_.dispatch_s += since(t0);
  for (int r = 0; r < ep; ++r)
    if (r != ep_->rank()) traffic_.dispatch_bytes += sc[r] * static_cast<int64_t>(dtype_size(act_));
}

void ExpertDispatcher::combine(const ExpertExchange& x, const void* expert_major, void* src, const int32_t* ungroup,
                               void* local) {
  const auto t0 = std::chrono::steady_clock::now();
  const int ep = ep_->size();
  be_.moe_gather_rows(src, expert_major, ungroup, x.R, C_, act_);
  std::vector<int64_t> sc, so, rc, ro;
  row_extents(x.recv_rows, C_, sc, so);
  row_extents(x.send_rows, C_, rc, ro);
  ep_->all_to_all_v(src, sc, so, local, rc, ro, act_);
  traffic_.combine_s += since(t0);
  for (int r = 0; r < ep; ++r)
    if (r != ep_->rank()) traffic_.combine_bytes += sc[r] * static_cast<int64_t>(dtype_size(act_));
}

ExpertTraffic ExpertDispatcher::take_traffic() {
  const ExpertTraffic t = traffic_;
  traffic_ = ExpertTraffic{};
  return t;
}

}  // namespace tetra
