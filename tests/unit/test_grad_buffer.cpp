// GradBuffer: bucket plan, overlap (each bucket's reduction issued as soon as backward reports its
// last group, not after backward), shards of the distributed optimizer, and the sequence-parallel
// partial gradients. A recording communicator stands in for MPI: it logs every call in order.
#include <catch2/catch.hpp>

#include <string>
#include <vector>

#include "kernels/backend.h"
#include "trainer/comm/communicator.h"
#include "trainer/params/param_layout.h"
#include "trainer/optim/grad_buffer.h"

namespace {

using namespace tetra;

class DoneWork : public Work {
 public:
  void wait() override {}
  bool test() override { return true; }
};

// Records (op, element offset into `base`, count) of each call; moves no data.
class RecordingComm : public Communicator {
 public:
  RecordingComm(std::string name, int rank, int size, const float* base, std::vector<std::string>& log)
      : name_(std::move(name)), rank_(rank), size_(size), base_(base), log_(log) {
    for (int r = 0; r < size; ++r) members_.push_back(r);
  }
  const std::string& name() const override { return name_; }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  const std::vector<int>& members() const override { return members_; }
  WorkHandle all_reduce_async(void* buf, int64_t count, DType, ReduceOp) override {
    return record("all_reduce", buf, count);
  }
  WorkHandle reduce_scatter_async(void* recv, const void* send, int64_t recv_count, DType, ReduceOp) override {
    CHECK(recv == static_cast<const float*>(send) + rank_ * recv_count);  // in place, this rank's block
    return record("reduce_scatter", send, recv_count * size_);
  }
  WorkHandle all_gather_async(void* recv, const void*, int64_t send_count, DType) override {
    return record("all_gather", recv, send_count * size_);
  }
  WorkHandle all_to_all_v_async(const void*, const std::vector<int64_t>&, const std::vector<int64_t>&, void*,
                                const std::vector<int64_t>&, const std::vector<int64_t>&, DType) override {
    return record("all_to_all", nullptr, 0);
  }
  WorkHandle broadcast_async(void* buf, int64_t count, DType, int) override { return record("broadcast", buf, count); }
  WorkHandle send_async(const void* buf, int64_t count, DType, int, int) override { return record("send", buf, count); }
  WorkHandle recv_async(void* buf, int64_t count, DType, int, int) override { return record("recv", buf, count); }
  void group_start() override {}
  void group_end() override {}
  void barrier() override {}

 private:
  WorkHandle record(const char* op, const void* buf, int64_t count) {
    const bool in_grads = buf && static_cast<const float*>(buf) >= base_;
    const int64_t offset = in_grads ? static_cast<const float*>(buf) - base_ : -1;
    log_.push_back(name_ + " " + op + " @" + std::to_string(offset) + " x" + std::to_string(count));
    return std::make_unique<DoneWork>();
  }
  std::string name_;
  int rank_, size_;
  std::vector<int> members_;
  const float* base_;
  std::vector<std::string>& log_;
};

ModelConfig tiny() {
  ModelConfig m;
  m.vocab_size = 64;
  m.seq_len = 16;
  m.num_layers = 4;
  m.hidden_size = 32;
  m.num_heads = 4;
  m.num_kv_heads = 4;
  m.ffn_hidden_size = 128;
  return m;
}

std::string hook(int g) { return "hook " + std::to_string(g); }

}  // namespace

TEST_CASE("grad buffer: buckets are whole groups from the end, each at least bucket_size", "[optim]") {
  const ParamLayout layout = ParamLayout::build(tiny());
  const int64_t block = layout.groups[1].second - layout.groups[1].first;
  for (int64_t size : {int64_t{1}, block, block + 1, 3 * block, int64_t{1} << 40}) {
    const std::vector<BucketPlan> plan = plan_buckets(layout, size);
    INFO("bucket_size " << size);
    // Contiguous from the end of the buffer down to 0, in the order backward finishes groups.
    REQUIRE(!plan.empty());
    CHECK(plan.front().end == layout.total);
    CHECK(plan.back().begin == 0);
    for (size_t i = 0; i < plan.size(); ++i) {
      CHECK(plan[i].begin == layout.groups[plan[i].first_group].first);
      CHECK(plan[i].end == layout.groups[plan[i].last_group].second);
      if (i + 1 < plan.size()) {
        CHECK(plan[i + 1].end == plan[i].begin);
        CHECK(plan[i].end - plan[i].begin >= size);  // only the last (first in the buffer) may be short
      }
    }
  }
  CHECK(plan_buckets(layout, 1).size() == layout.groups.size());
  CHECK(plan_buckets(layout, int64_t{1} << 40).size() == 1);
}

TEST_CASE("grad buffer: each bucket's all-reduce is issued when backward reports its last group", "[optim]") {
  const ParamLayout layout = ParamLayout::build(tiny());
  auto be = make_cpu_backend(1);
  std::vector<float> grads(static_cast<size_t>(layout.total));
  std::vector<std::string> log;
  RecordingComm dp("dp", 0, 2, grads.data(), log);
  const int64_t block = layout.groups[1].second - layout.groups[1].first;
  GradBuffer gb(layout, *be, grads.data(), &dp, nullptr, /*distributed_optimizer=*/false, 2 * block);
  // Groups: 0 embedding, 1..4 blocks, 5 final norm. Buckets of >= 2 blocks from the end:
  // {5, 4, 3}, {2, 1}, {0}.
  const std::vector<BucketPlan> plan = plan_buckets(layout, 2 * block);
  REQUIRE(plan.size() == 3);
  for (int g = 5; g >= 0; --g) {
    log.push_back(hook(g));
    gb.group_done(g);
  }
  gb.finish();
  auto at = [&](const BucketPlan& b) {
    return "dp all_reduce @" + std::to_string(b.begin) + " x" + std::to_string(b.end - b.begin);
  };
  const std::vector<std::string> want = {hook(5), hook(4), hook(3), at(plan[0]), hook(2), hook(1),
                                         at(plan[1]), hook(0), at(plan[2])};
  CHECK(log == want);
  CHECK(gb.owned().size() == plan.size());  // one range per bucket
  CHECK(gb.owned_numel() == layout.total);  // plain DP: every rank updates everything

  SECTION("a group reported twice, or a step finished early, is an error") {
    gb.group_done(5);
    CHECK_THROWS_WITH(gb.group_done(5), Catch::Contains("reported twice"));
    CHECK_THROWS_WITH(gb.finish(), Catch::Contains("never completed"));
  }
}

TEST_CASE("grad buffer: the distributed optimizer reduce-scatters aligned shards and gathers them back",
          "[optim]") {
  TensorSlicing slicing;
  slicing.group_align = 16 * 4;  // dp = 4
  const ParamLayout layout = ParamLayout::build(tiny(), slicing);
  auto be = make_cpu_backend(1);
  std::vector<float> grads(static_cast<size_t>(layout.total));
  for (int rank : {0, 3}) {
    std::vector<std::string> log;
    RecordingComm dp("dp", rank, 4, grads.data(), log);
    GradBuffer gb(layout, *be, grads.data(), &dp, nullptr, /*distributed_optimizer=*/true, 1);
    REQUIRE(gb.sharded());
    int64_t owned = 0;
    for (size_t i = 0; i < gb.owned().size(); ++i) {
      const GradRange& r = gb.owned()[i];
      const auto& g = layout.groups[i];  // bucket_size 1: one bucket per group, in buffer order
      CHECK(r.numel * 4 == g.second - g.first);
      CHECK(r.offset == g.first + rank * r.numel);
      CHECK(r.offset % 16 == 0);
      owned += r.numel;
    }
    CHECK(owned * 4 == layout.total);
    for (int g = static_cast<int>(layout.groups.size()) - 1; g >= 0; --g) gb.group_done(g);
    gb.finish();
    gb.gather_params(grads.data(), DType::F32);
    size_t scatters = 0, gathers = 0;
    for (const std::string& l : log) {
      scatters += l.rfind("dp reduce_scatter", 0) == 0;
      gathers += l.rfind("dp all_gather", 0) == 0;
    }
    CHECK(scatters == layout.groups.size());
    CHECK(gathers == layout.groups.size());
  }
}

TEST_CASE("grad buffer: sequence-parallel norm gradients are all-reduced over TP per group", "[optim]") {
  TensorSlicing slicing;
  slicing.tp = 2;
  slicing.sequence_parallel = true;
  const ParamLayout layout = ParamLayout::build(tiny(), slicing);
  auto be = make_cpu_backend(1);
  std::vector<float> grads(static_cast<size_t>(layout.total), 1.0f);
  std::vector<std::string> log;
  RecordingComm tp("tp", 0, 2, grads.data(), log);
  GradBuffer gb(layout, *be, grads.data(), nullptr, &tp, false, 1);
  for (int g = static_cast<int>(layout.groups.size()) - 1; g >= 0; --g) gb.group_done(g);
  gb.finish();
  // Layer groups have norm1 and norm2 (weight + bias: 4 C), the final group weight + bias (2 C),
  // the embedding group none.
  const int64_t C = tiny().hidden_size;
  std::vector<std::string> want;
  want.push_back("tp all_reduce @-1 x" + std::to_string(2 * C));
  for (int l = 0; l < tiny().num_layers; ++l) want.push_back("tp all_reduce @-1 x" + std::to_string(4 * C));
  CHECK(log == want);
}

TEST_CASE("grad buffer: ZeRO-2 staging plan", "[optim]") {
  ModelConfig m = tiny();
  m.vocab_size = 1024;  // the embedding larger than a block, as in real models
  const ParamLayout layout = ParamLayout::build(m);  // tied: groups 0 embedding, 1..4 blocks, 5 final norm
  const int64_t block = layout.groups[1].second - layout.groups[1].first;
  const int64_t emb = layout.groups[0].second - layout.groups[0].first;
  REQUIRE(emb > block + (layout.groups[5].second - layout.groups[5].first));
  // bucket_size 1: a bucket per group. Tied: the embedding's bucket is held open for the whole
  // backward and has its own buffer; the final norm's joins the pool (it is no larger); the pool
  // holds two of the largest other bucket (one reduction in flight, one being written).
  const GradBuffer::StagingPlan tied = GradBuffer::staging_plan(layout, 1, true);
  CHECK(tied.own == std::vector<int>{5});
  CHECK(tied.own_numel == std::vector<int64_t>{emb});
  CHECK(tied.buffers == 2);
  CHECK(tied.buffer_numel == block);
  // Untied the embedding's is still the largest: its own, and no longer held.
  const GradBuffer::StagingPlan untied = GradBuffer::staging_plan(layout, 1, false);
  CHECK(untied.own == std::vector<int>{5});
  CHECK(untied.buffers == 2);
  // One bucket for everything: it is its own, no pool.
  const GradBuffer::StagingPlan one = GradBuffer::staging_plan(layout, int64_t{1} << 40, true);
  CHECK(one.own.size() == 1);
  CHECK(one.buffers == 0);
  CHECK(one.bytes() == layout.total * 4);
}

TEST_CASE("grad buffer: ZeRO-2 reduces every micro-batch's buckets into the compact shard", "[optim]") {
  TensorSlicing slicing;
  slicing.group_align = 16 * 2;  // dp = 2
  const ParamLayout layout = ParamLayout::build(tiny(), slicing);
  const int groups = static_cast<int>(layout.groups.size());
  auto be = make_cpu_backend(1);
  std::vector<std::string> log;
  // The recording communicator moves nothing: a "reduced" shard is this rank's own block of the
  // staging buffer, so the shard must end up as this rank's values summed over the micro-batches.
  RecordingComm dp("dp", 1, 2, nullptr, log);
  auto count = [&](const std::string& op) {
    size_t n = 0;
    for (const std::string& l : log) n += l.rfind("dp " + op, 0) == 0;
    return n;
  };
  // Writes `value` into every element of group g's gradient, as backward would (+=).
  auto write = [&](GradBuffer& gb, int g, float value) {
    const auto [begin, end] = layout.groups[static_cast<size_t>(g)];
    float* p = gb.at(begin);
    for (int64_t i = 0; i < end - begin; ++i) p[i] += value * static_cast<float>(g + 1);
  };
  auto expect_shard = [&](GradBuffer& gb, const std::vector<float>& shard, float total) {
    int64_t at = 0;
    bool ok = true;
    for (const GradRange& r : gb.owned()) {
      for (int64_t i = 0; i < r.numel; ++i) {
        int g = 0;  // the group of element r.offset + i
        while (layout.groups[static_cast<size_t>(g)].second <= r.offset + i) ++g;
        ok = ok && shard[static_cast<size_t>(at + i)] == total * static_cast<float>(g + 1);
      }
      at += r.numel;
    }
    CHECK(at == gb.owned_numel());
    CHECK(ok);
  };

  SECTION("two micro-batches, every group reported in each: a reduce-scatter per bucket and micro-batch") {
    std::vector<float> shard(static_cast<size_t>(layout.total / 2), 0.0f);
    GradBuffer gb(layout, *be, nullptr, &dp, nullptr, true, 1, false, shard.data(), /*tied_embeddings=*/true);
    REQUIRE(gb.shards_gradients());
    for (float value : {1.0f, 10.0f}) {
      for (int g = groups - 1; g >= 0; --g) {
        write(gb, g, value);
        gb.group_done(g);
      }
    }
    gb.finish();
    CHECK(count("reduce_scatter") == 2 * static_cast<size_t>(groups));
    expect_shard(gb, shard, 11.0f);
    // The staging as planned: the tied embedding's bucket its own, two pool buffers for the rest.
    CHECK(gb.staging_bytes() == static_cast<size_t>(GradBuffer::staging_plan(layout, 1, true).bytes()));
  }
  SECTION("a group deferred to the end of the step reports both micro-batches at once: one reduction") {
    std::vector<float> shard(static_cast<size_t>(layout.total / 2), 0.0f);
    GradBuffer gb(layout, *be, nullptr, &dp, nullptr, true, 1, false, shard.data());
    for (float value : {1.0f, 10.0f}) {
      for (int g = groups - 1; g >= 0; --g) {
        write(gb, g, value);
        if (g != 0) gb.group_done(g);
      }
    }
    gb.group_done(0, 2);
    gb.finish();
    CHECK(count("reduce_scatter") == 2 * static_cast<size_t>(groups - 1) + 1);
    expect_shard(gb, shard, 11.0f);
  }
  SECTION("a bucket whose groups report out of step (interleaved chunks) reduces each write exactly once") {
    // One bucket of everything: group 5 runs a micro-batch ahead of the rest.
    std::vector<float> shard(static_cast<size_t>(layout.total / 2), 0.0f);
    GradBuffer gb(layout, *be, nullptr, &dp, nullptr, true, int64_t{1} << 40, false, shard.data());
    REQUIRE(gb.num_buckets() == 1);
    write(gb, 5, 1.0f);
    gb.group_done(5);
    write(gb, 5, 10.0f);
    gb.group_done(5);
    for (float value : {1.0f, 10.0f})
      for (int g = 4; g >= 0; --g) {
        write(gb, g, value);
        gb.group_done(g);
      }
    gb.finish();
    CHECK(count("reduce_scatter") == 2);  // one when every group had reported once, one at twice
    expect_shard(gb, shard, 11.0f);
  }
  SECTION("unreduced gradient left in a staging buffer is an error at finish()") {
    std::vector<float> shard(static_cast<size_t>(layout.total / 2), 0.0f);
    GradBuffer gb(layout, *be, nullptr, &dp, nullptr, true, 1, false, shard.data());
    write(gb, 3, 1.0f);
    CHECK_THROWS_WITH(gb.finish(), Catch::Contains("no group report reduced"));
  }
}
