// The checkpoint directory's names and the resolver (trainer/checkpoint/commit.h): which
// checkpoint `resume: auto` takes in each state a crashed save can leave, and what recovery does
// with the names a save leaves behind. A checkpoint here is a directory with a manifest.json
// (what marks a committed save); its contents are read_manifest's to check, elsewhere.
#include <filesystem>
#include <fstream>
#include <string>

#include <catch2/catch.hpp>

#include "trainer/checkpoint/commit.h"
#include "trainer/checkpoint/manifest.h"
#include "kernels/common/check.h"

namespace fs = std::filesystem;

namespace {

std::string fresh_dir(const std::string& name) {
  const fs::path d = fs::path(TETRA_TEST_TMPDIR) / "checkpoint_commit" / name;
  fs::remove_all(d);
  fs::create_directories(d);
  return d.string();
}

void make_checkpoint(const std::string& dir, const std::string& name) {
  fs::create_directories(fs::path(dir) / name);
  std::ofstream(fs::path(dir) / name / "manifest.json") << "{}";
}

void write(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

tetra::CheckpointConfig auto_resume(const std::string& dir) {
  tetra::CheckpointConfig c;
  c.dir = dir;
  c.resume.kind = tetra::ResumeKind::AUTO;
  return c;
}

}  // namespace

TEST_CASE("checkpoint names: the step a directory's name holds", "[checkpoint]") {
  CHECK(tetra::step_of_checkpoint_name("step_00000008") == 8);
  CHECK(tetra::step_of_checkpoint_name(".step_00000012.old") == 12);
  CHECK(tetra::step_of_checkpoint_name("step_") == -1);
  CHECK(tetra::step_of_checkpoint_name("step_12a") == -1);
  CHECK(tetra::step_of_checkpoint_name(".step_00000012.tmp") == 12);
  CHECK(tetra::step_of_checkpoint_name(".step_00000012.del") == -1);
  CHECK(tetra::step_of_checkpoint_name("best") == -1);
}

TEST_CASE("resume auto: latest first, else the newest complete checkpoint", "[checkpoint]") {
  const std::string d = fresh_dir("resolve");
  CHECK(tetra::checkpoint_to_resume(auto_resume(d)).empty());  // nothing there: a fresh start
  make_checkpoint(d, "step_00000002");
  make_checkpoint(d, "step_00000004");
  fs::create_directories(fs::path(d) / ".step_00000008.tmp");  // a save that stopped while staging
  // A step_* without a manifest (step_* are renamed in complete, so it was damaged) beyond the step
  // to resume: refused, since this run's save of that step would replace it; once moved away, fine.
  fs::create_directories(fs::path(d) / "step_00000006");
  CHECK_THROWS_WITH(tetra::checkpoint_to_resume(auto_resume(d), 10),
                    Catch::Matchers::Contains("holds step_00000006 without its manifest.json") &&
                        Catch::Matchers::Contains("newer than the checkpoint to resume from (step 4)"));
  write(d + "/latest", "step_00000002\n");
  CHECK_THROWS_AS(tetra::checkpoint_to_resume(auto_resume(d), 10), tetra::InputError);
  // A run that saves no step as late (its last step 5), or a reader that saves none: no refusal.
  CHECK(tetra::checkpoint_to_resume(auto_resume(d), 5) == (fs::path(d) / "step_00000002").string());
  CHECK(tetra::checkpoint_to_resume(auto_resume(d)) == (fs::path(d) / "step_00000002").string());
  // A file in a step_*'s place is refused too.
  fs::remove(fs::path(d) / "step_00000006");
  write(d + "/step_00000006", "not a checkpoint\n");
  CHECK_THROWS_WITH(tetra::checkpoint_to_resume(auto_resume(d), 10),
                    Catch::Matchers::Contains("holds step_00000006, which is not a directory"));
  fs::remove(fs::path(d) / "latest");
  fs::remove(fs::path(d) / "step_00000006");
  // No latest: the newest complete step.
  CHECK(tetra::checkpoint_to_resume(auto_resume(d)) == (fs::path(d) / "step_00000004").string());
  // latest names one: that one, even if it is not the newest.
  write(d + "/latest", "step_00000002\n");
  CHECK(tetra::checkpoint_to_resume(auto_resume(d)) == (fs::path(d) / "step_00000002").string());
  // latest names one that is not there: the newest complete.
  write(d + "/latest", "step_00000006\n");
  CHECK(tetra::checkpoint_to_resume(auto_resume(d)) == (fs::path(d) / "step_00000004").string());
  // latest outside the directory: refused.
  write(d + "/latest", "../elsewhere/step_00000002\n");
  CHECK_THROWS_AS(tetra::checkpoint_to_resume(auto_resume(d)), tetra::InputError);
  // resume "none" with checkpoints there: refused (its saves would rotate them away).
  tetra::CheckpointConfig none = auto_resume(d);
  none.resume.kind = tetra::ResumeKind::NONE;
  CHECK_THROWS_AS(tetra::checkpoint_to_resume(none), tetra::InputError);
}

TEST_CASE("resume auto: a copy a re-save set aside counts where its step is missing", "[checkpoint]") {
  const std::string d = fresh_dir("set_aside");
  make_checkpoint(d, "step_00000004");
  make_checkpoint(d, ".step_00000006.old");  // the save crashed between setting it aside and renaming in
  write(d + "/latest", "step_00000006\n");
  CHECK(tetra::checkpoint_to_resume(auto_resume(d)) == (fs::path(d) / ".step_00000006.old").string());
  // Recovery (the next save's first state) puts it back and removes what crashed saves left.
  fs::create_directories(fs::path(d) / ".step_00000008.tmp");
  fs::create_directories(fs::path(d) / ".step_00000002.del");
  tetra::recover_checkpoint_dir(d);
  CHECK(fs::exists(fs::path(d) / "step_00000006" / "manifest.json"));
  CHECK(!fs::exists(fs::path(d) / ".step_00000006.old"));
  CHECK(!fs::exists(fs::path(d) / ".step_00000008.tmp"));
  CHECK(!fs::exists(fs::path(d) / ".step_00000002.del"));
  CHECK(tetra::checkpoint_to_resume(auto_resume(d)) == (fs::path(d) / "step_00000006").string());
  // Where the step is complete again, a set-aside copy is stale: removed, never preferred.
  make_checkpoint(d, ".step_00000006.old");
  CHECK(tetra::checkpoint_to_resume(auto_resume(d)) == (fs::path(d) / "step_00000006").string());
  tetra::recover_checkpoint_dir(d);
  CHECK(!fs::exists(fs::path(d) / ".step_00000006.old"));
}

TEST_CASE("rotation keeps the newest steps of this run's line, never the current one nor a later one",
          "[checkpoint]") {
  const std::string d = fresh_dir("rotate");
  for (const char* n : {"step_00000002", "step_00000004", "step_00000008", "step_00000010"}) make_checkpoint(d, n);
  // A run resumed from step 4 saves step 6 while 8 and 10 (of the run it rolled back from) exist:
  // keep 2 keeps 4 and 6, its own newest; 8 and 10 stay until its saves reach them.
  make_checkpoint(d, "step_00000006");
  tetra::rotate_checkpoints(d, 2, "step_00000006");
  CHECK(!fs::exists(fs::path(d) / "step_00000002"));
  CHECK(fs::exists(fs::path(d) / "step_00000004"));
  CHECK(fs::exists(fs::path(d) / "step_00000006"));
  CHECK(fs::exists(fs::path(d) / "step_00000008"));
  CHECK(fs::exists(fs::path(d) / "step_00000010"));
  for (const auto& e : fs::directory_iterator(d)) CHECK(e.path().filename().string().rfind(".step_", 0) != 0);
}

TEST_CASE("resume auto: a staged copy that finished writing is preferred to a set-aside one", "[checkpoint]") {
  // A re-save without exchange, stopped between its two renames: step_6 is missing, the old copy
  // is .step_6.old and the new one, complete, .step_6.tmp.
  const std::string d = fresh_dir("staged");
  make_checkpoint(d, "step_00000004");
  make_checkpoint(d, ".step_00000006.old");
  make_checkpoint(d, ".step_00000006.tmp");
  fs::create_directories(fs::path(d) / ".step_00000008.tmp");  // a staging that did not finish
  write(d + "/latest", "step_00000006\n");
  CHECK(tetra::checkpoint_to_resume(auto_resume(d)) == (fs::path(d) / ".step_00000006.tmp").string());
  tetra::recover_checkpoint_dir(d);
  CHECK(fs::exists(fs::path(d) / "step_00000006" / "manifest.json"));
  for (const char* n : {".step_00000006.old", ".step_00000006.tmp", ".step_00000008.tmp"})
    CHECK(!fs::exists(fs::path(d) / n));
  CHECK(tetra::checkpoint_to_resume(auto_resume(d)) == (fs::path(d) / "step_00000006").string());
}
