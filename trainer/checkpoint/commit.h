// How a checkpoint becomes durable, and how a run finds the one to resume: the commit protocol.
//
// The protocol is a state machine over the names in `checkpoint.dir` (D). For a save of step N
// (name S = step_0000000N), each state is what D holds when a crash (kill -9, power loss) stops
// the save there, and what the next `resume: auto` then does:
//
//   state                     D holds (besides older steps)           resume: auto
//   ------------------------  --------------------------------------  -----------------------------
//   0 idle                    latest -> P (complete), maybe S (old)   P
//   1 recovered               stale .*.tmp / .*.del removed;          P
//                             a set-aside .S.old whose S is missing
//                             renamed back to S
//   2 staging                 .S.tmp/ (rank files being written)      P (.S.tmp is never read)
//   3 staged                  .S.tmp/ complete: every rank file,      P
//                             fsync'd, then manifest.json, fsync'd
//   4 placed                  S complete (the new one)                latest -> P, or the newest
//                               fresh step: rename .S.tmp -> S        complete step_* if P is gone
//                               re-save: renameat2(RENAME_EXCHANGE)   (S counts from here on)
//                               swaps .S.tmp and S atomically, so S
//                               is complete at every instant (the old
//                               copy is now in .S.tmp, removed next);
//                               where the filesystem cannot exchange:
//                               S -> .S.old, then .S.tmp -> S (a crash
//                               between leaves .S.old, read as step N)
//   5 published               latest -> S (written to latest.tmp,     S
//                             fsync'd, renamed over latest, the
//                             directory fsync'd)
//   6 rotated                 checkpoints beyond checkpoint.keep      S
//                             (oldest steps first, never S) renamed
//                             to .step_*.del, then removed
//
// So at every instant `latest` names a complete checkpoint or one that is about to be replaced
// atomically, and the resolver never depends on `latest` alone: when it is missing, or names a
// directory that is not a complete checkpoint, the newest complete step_* (or set-aside .S.old)
// is resumed, and the log says so. `latest` must name a directory of D itself (no '/', no "..").
//
// Fault injection (tests), installed by set_save_fault_hooks from the user's TETRA_FAULT_*
// (trainer/core/runtime_options.h): with TETRA_FAULT_SAVE_AT=K the process kills itself with
// SIGKILL at the K-th filesystem call of its checkpoint saves (counted from 1 over the process's
// life); with TETRA_FAULT_SAVE_LOG=FILE each such call appends "<n> <op> <path>" to FILE, which is
// how a test learns how many calls a save makes. TETRA_FAULT_NO_EXCHANGE=1 takes the path of a
// filesystem that cannot exchange two names (NFS, some FUSE mounts): the set-aside re-save.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "trainer/config/config.h"
#include "trainer/core/runtime_options.h"

namespace tetra {

// One filesystem call of a checkpoint save, about to be made (a fault-injection point).
void checkpoint_io_point(const char* op, const std::string& path);
// The process's fault hooks (see above; none until set). Test-only.
void set_save_fault_hooks(const SaveFaultHooks& hooks);

// Marks the scope of a save: only calls inside it are fault-injection points.
class CheckpointSaveScope {
 public:
  CheckpointSaveScope();
  ~CheckpointSaveScope();
  CheckpointSaveScope(const CheckpointSaveScope&) = delete;
  CheckpointSaveScope& operator=(const CheckpointSaveScope&) = delete;
};

// A checkpoint directory of D: its name, its step, and which kind of name it has.
struct CheckpointEntry {
  enum Kind { NAMED = 0, STAGED = 1, SET_ASIDE = 2 };  // step_N, a complete .step_N.tmp, .step_N.old
  std::string name;   // "step_00000008", ".step_00000008.tmp" or ".step_00000008.old"
  int64_t step = 0;
  Kind kind = NAMED;
};

// The complete checkpoints of `dir` (those whose save committed: a manifest.json), by step, oldest
// first, one per step: its step_* where complete, else a complete staged or set-aside copy.
// Error naming `dir` if it cannot be listed.
std::vector<CheckpointEntry> complete_checkpoints(const std::string& dir);

// State 1: where a step_* is missing or incomplete, gives its name to the best complete copy an
// interrupted save left (.S.tmp, else .S.old); removes every other leftover (.*.tmp, .*.old,
// .*.del). Rank 0 only.
void recover_checkpoint_dir(const std::string& dir);

// States 4 and 5: moves the staged `tmp_dir` to `dir/name` and points `latest` at it. Rank 0 only.
void commit_checkpoint(const std::string& dir, const std::string& name, const std::string& tmp_dir);

// State 6: removes this run's checkpoints beyond the `keep` newest steps up to `current` (never
// `current`, never a step beyond it: those a rolled-back run left are replaced by its saves).
void rotate_checkpoints(const std::string& dir, int64_t keep, const std::string& current);

// Takes `dir`/.lock (creating `dir` if needed) for as long as the returned descriptor stays open:
// two runs on one checkpoint.dir would delete each other's staging and rewrite each other's
// `latest`. InputError naming the lock when another process holds it; -1 (with a warning) where
// the filesystem has no locks (some Lustre mounts), so the run goes on unprotected. Rank 0 only.
int lock_checkpoint_dir(const std::string& dir);

// (A file written atomically: trainer/core/files.h's write_file_atomic, given checkpoint_io_point.)

// The checkpoint checkpoint.resume asks for: "" when there is none to resume ("none", or "auto"
// with no checkpoint in `dir`). "auto" takes what `latest` names, or else the newest complete
// checkpoint (saying so in the log). InputError when an explicit path is not a checkpoint, or when
// `latest` names a directory outside `dir`, or names an incomplete one and no complete one exists.
// `last_save` >= 0: the caller saves checkpoints of steps up to it into `dir` (a training run), so
// a step_* there that is not a complete checkpoint, beyond the one resumed and not beyond
// `last_save`, is an InputError too (the save of its step would replace it); -1: it saves none.
std::string checkpoint_to_resume(const CheckpointConfig& cfg, int64_t last_save = -1);

}  // namespace tetra
