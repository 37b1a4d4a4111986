#include "trainer/parallel/expert_dispatch.h"

#include <algorithm>
#include <chrono>

#include "kernels/common/check.h"
#include "trainer/comm/communicator.h"

namespace tetra {

namespace {

double since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

ExpertExchange plan_expert_exchange(const std::vector<int64_t>& kept, const int32_t* recv_counts, int ep, int64_t El,
                                    std::vector<int32_t>& regroup, std::vector<int32_t>& ungroup, int chunks) {
  TETRA_CHECK(chunks >= 1 && chunks <= std::max<int64_t>(El, 1), "{} exchange chunks of {} local experts", chunks, El);
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
  // Chunk j: local experts [j El / c, (j + 1) El / c).
  for (int j = 0; j <= chunks; ++j) x.chunk_experts.push_back(j * El / chunks);
  // x_perm holds every expert's rows in global expert order: expert e's first row.
  std::vector<int64_t> first(static_cast<size_t>(ep * El) + 1, 0);
  for (int64_t e = 0; e < ep * El; ++e) first[e + 1] = first[e] + kept[e];
  // Expert-major rows: local expert j's, every source's together, in expert order.
  std::vector<int64_t> exp_start(static_cast<size_t>(El) + 1, 0);
  for (int64_t j = 0; j < El; ++j) exp_start[j + 1] = exp_start[j] + x.expert_rows[j];
  x.chunk_send.assign(static_cast<size_t>(chunks), std::vector<int64_t>(static_cast<size_t>(ep), 0));
  x.chunk_send_at = x.chunk_recv = x.chunk_recv_at = x.chunk_send;
  // Received rows, chunk-major: chunk j's rows from source 0, 1, ... (each source's in expert
  // order), after chunk j - 1's; regrouped to expert-major, inverse maps.
  int64_t sp = 0;
  std::vector<int64_t> fill(exp_start.begin(), exp_start.end() - 1);
  for (int j = 0; j < chunks; ++j) {
    const int64_t j0 = x.chunk_experts[j], j1 = x.chunk_experts[j + 1];
    x.chunk_rows.push_back(exp_start[j0]);
    for (int r = 0; r < ep; ++r) {
      x.chunk_send_at[j][r] = first[r * El + j0];
      x.chunk_send[j][r] = first[r * El + j1] - first[r * El + j0];
      x.chunk_recv_at[j][r] = sp;
      for (int64_t i = j0; i < j1; ++i)
        for (int64_t t = 0; t < recv_counts[r * El + i]; ++t, ++sp) {
          const int64_t q = fill[i]++;
          regroup[q] = static_cast<int32_t>(sp);
          ungroup[sp] = static_cast<int32_t>(q);
        }
      x.chunk_recv[j][r] = sp - x.chunk_recv_at[j][r];
    }
  }
  x.chunk_rows.push_back(x.R);
  return x;
}

ExpertDispatcher::ExpertDispatcher(Communicator* ep, Backend& be, DType act, int64_t C, int64_t E, int chunks)
    : ep_(ep && ep->size() > 1 ? ep : nullptr), be_(be), act_(act), C_(C), E_(E) {
  const int n = size();
  TETRA_CHECK(E % n == 0, "{} experts cannot be split evenly over {} EP ranks", E, n);
  El_ = E / n;
  TETRA_CHECK(chunks >= 1 && chunks <= std::max<int64_t>(El_, 1), "{} exchange chunks of {} local experts", chunks,
              El_);
  chunks_ = ep_ ? chunks : 1;
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
  return plan_expert_exchange(kept, h_counts.data() + E_, ep, El_, regroup, ungroup, chunks_);
}

namespace {

// Element counts and offsets of rows of width C.
std::vector<int64_t> elements(const std::vector<int64_t>& rows, int64_t C) {
  std::vector<int64_t> out(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) out[i] = rows[i] * C;
  return out;
}

}  // namespace

WorkHandle ExpertDispatcher::start_dispatch(const ExpertExchange& x, int j, const void* send, void* src) {
  const auto t0 = std::chrono::steady_clock::now();
  WorkHandle w = ep_->all_to_all_v_async(send, elements(x.chunk_send[j], C_), elements(x.chunk_send_at[j], C_), src,
                                         elements(x.chunk_recv[j], C_), elements(x.chunk_recv_at[j], C_), act_);
  traffic_.dispatch_s += since(t0);
  for (int r = 0; r < ep_->size(); ++r)
    if (r != ep_->rank()) traffic_.dispatch_bytes += x.chunk_send[j][r] * C_ * static_cast<int64_t>(dtype_size(act_));
  return w;
}

void ExpertDispatcher::finish_dispatch(const ExpertExchange& x, int j, WorkHandle& work, const void* src,
                                       const int32_t* regroup, void* recv) {
  const auto t0 = std::chrono::steady_clock::now();
  work->wait();
  const int64_t r0 = x.chunk_rows[j], n = x.chunk_rows[j + 1] - r0;
  const size_t es = dtype_size(act_);
  if (n > 0) be_.moe_gather_rows(static_cast<char*>(recv) + static_cast<size_t>(r0 * C_) * es, src, regroup + r0, n, C_, act_);
  traffic_.dispatch_s += since(t0);
}

WorkHandle ExpertDispatcher::start_combine(const ExpertExchange& x, int j, const void* expert_major, void* src,
                                           const int32_t* ungroup, void* local) {
  const auto t0 = std::chrono::steady_clock::now();
  // Chunk j's received rows, [chunk_recv_at[j][0], + its rows), get their outputs back in place.
  const int64_t s0 = x.chunk_recv_at[j][0];
  int64_t n = 0;
  for (int64_t c : x.chunk_recv[j]) n += c;
  const size_t es = dtype_size(act_);
  if (n > 0) be_.moe_gather_rows(static_cast<char*>(src) + static_cast<size_t>(s0 * C_) * es, expert_major, ungroup + s0, n, C_, act_);
  WorkHandle w = ep_->all_to_all_v_async(src, elements(x.chunk_recv[j], C_), elements(x.chunk_recv_at[j], C_), local,
                                         elements(x.chunk_send[j], C_), elements(x.chunk_send_at[j], C_), act_);
  traffic_.combine_s += since(t0);
  for (int r = 0; r < ep_->size(); ++r)
    if (r != ep_->rank()) traffic_.combine_bytes += x.chunk_recv[j][r] * C_ * static_cast<int64_t>(dtype_size(act_));
  return w;
}

void ExpertDispatcher::finish_combine(WorkHandle& work) {
  const auto t0 = std::chrono::steady_clock::now();
  work->wait();
  traffic_.combine_s += since(t0);
}

// Every chunk at once (the caller computes nothing in between).
void ExpertDispatcher::dispatch(const ExpertExchange& x, const void* send, void* src, const int32_t* regroup,
                                void* recv) {
  std::vector<WorkHandle> w;
  for (int j = 0; j < x.chunks(); ++j) w.push_back(start_dispatch(x, j, send, src));
  for (int j = 0; j < x.chunks(); ++j) finish_dispatch(x, j, w[static_cast<size_t>(j)], src, regroup, recv);
}

void ExpertDispatcher::combine(const ExpertExchange& x, const void* expert_major, void* src, const int32_t* ungroup,
                               void* local) {
  std::vector<WorkHandle> w;
  for (int j = 0; j < x.chunks(); ++j) w.push_back(start_combine(x, j, expert_major, src, ungroup, local));
  for (WorkHandle& h : w) finish_combine(h);
}

ExpertTraffic ExpertDispatcher::take_traffic() {
  const ExpertTraffic t = traffic_;
  traffic_ = ExpertTraffic{};
  return t;
}

}  // namespace tetra
