// A pipeline rank's activation memory (trainer/train/pipeline_model.h): its chunks share one
// scratch and one set of slots, as many as the rank's most micro-batches in flight over all
// chunks, which under interleaving is fewer than each chunk's most, summed.
#include <catch2/catch.hpp>
#include <algorithm>

#include "tests/unit/config_testing.h"
#include "trainer/model/gpt.h"
#include "trainer/parallel/pipeline_runner.h"
#include "trainer/train/pipeline_model.h"

using namespace tetra;
using namespace tetra::config_testing;
using nlohmann::json;

namespace {

Config interleaved(const char* recompute) {
  json j = base();
  j = with(j, "model.num_layers", 8);
  j = with(j, "parallel.pp", 4);
  j = with(j, "parallel.virtual_stages", 2);
  j = with(j, "parallel.schedule", "interleaved");
  j = with(j, "training.micro_batch_size", 1);
  j = with(j, "training.global_batch_size", 8);
  j = with(j, "training.recompute", recompute);
  return config_from_json(j);
}

}  // namespace

TEST_CASE("activation slots: interleaved chunks share the rank's slots and one scratch", "[pipeline][memory]") {
  for (const char* rc : {"none", "selective", "full"}) {
    INFO("recompute " << rc);
    const Config cfg = interleaved(rc);
    const PipelineSchedule s = make_schedule(cfg, cfg.grad_accum_steps());
    REQUIRE(s.vp == 2);
    for (int r = 0; r < s.pp; ++r) {
      INFO("pipeline rank " << r);
      int summed = 0;
      for (int c = 0; c < s.vp; ++c) summed += s.max_in_flight(r, c);
      const ActivationSplit split = PipelineModel::activation_split(cfg, r);
      CHECK(split.slots == s.max_in_flight(r));
      CHECK(split.slots == PipelineRunner::slots_needed(s, r));
      if (r == 0) CHECK(split.slots < summed);  // the saving: the chunks do not peak together
      // Each slot and the scratch are the largest chunk's.
      TensorSlicing slicing;
      const ParamLayout layout = ParamLayout::build(cfg.model, slicing, stage_slice(cfg, r));
      size_t slot = 0, scratch = 0, own = 0;
      for (int c = 0; c < s.vp; ++c) {
        const ActivationSizes a = Gpt::activation_sizes_for(
            cfg.model, precision_dtype(cfg.training.precision), 1, 1, false, ChunkShape::of(layout, c, 1), 1,
            Recomputation::from(cfg.training), cfg.training.loss_chunk_rows);
        slot = std::max(slot, a.slot);
        scratch = std::max(scratch, a.scratch);
        own += a.scratch + static_cast<size_t>(s.max_in_flight(r, c)) * a.slot;  // an arena per chunk
      }
      CHECK(split.kept == static_cast<size_t>(split.slots) * slot);
      CHECK(split.scratch == scratch);
      CHECK(PipelineModel::activation_bytes_for(cfg, r) == split.kept + split.scratch);
      if (r == 0) CHECK(split.kept + split.scratch < own);
    }
  }
}

TEST_CASE("activation slots: one per chunk at least, for the forward-only run", "[pipeline]") {
  // Chunk c's evaluation forward runs in slot c.
  for (int pp : {1, 2, 4})
    for (int m : {4, 8}) {
      const PipelineSchedule s = PipelineSchedule::build(pp == 1 ? ScheduleKind::ONE_F_ONE_B : ScheduleKind::INTERLEAVED,
                                                         pp, pp == 1 ? 1 : 2, m);
      for (int r = 0; r < pp; ++r) {
        CHECK(PipelineRunner::slots_needed(s, r) >= s.vp);
        CHECK(PipelineRunner::slots_needed(s, r) >= s.max_in_flight(r));
      }
    }
}
