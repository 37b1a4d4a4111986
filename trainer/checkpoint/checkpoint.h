// Checkpoints: sharded, atomic, and loadable under any parallel layout.
//
// A checkpoint is a directory `<checkpoint.dir>/step_00001000/`:
//   manifest.json       format and version, the resolved config, the layout it was written
//                       under, the step, the data position (consumed samples), the seed, the fp16
//                       loss scaler's state (replicated: one copy, whatever the layout), and the
//                       tensor index: key -> global shape, dtype and slices, each slice naming the
//                       file and tensor that hold it, its place in the global tensor
//                       (sharding.h's SliceRegion) and a CRC-32 of its bytes;
//   rank_00003.safetensors   the slices rank 3 wrote.
// Keys: "model/<param>" (the fp32 master weights), "optim/exp_avg/<param>" and
// "optim/exp_avg_sq/<param>" (Adam's moments), every one a global tensor whatever the sharding;
// and any CheckpointExtra kinds ("<kind>/<param>").
// Each element is written once: by TP rank 0 for parameters replicated over TP, and by DP rank 0
// unless the distributed optimizer shards the state over DP (then each DP rank writes its shard).
//
// Commit protocol (commit.h, a state machine: a crash at any moment leaves `latest` naming a
// complete checkpoint, or the resolver falling back to the newest complete one): rank 0 recovers
// what crashed saves left and creates `.step_00001000.tmp/`; every rank writes and fsyncs its file
// there (barrier); rank 0 writes manifest.json, fsyncs, moves the directory into place (atomically
// exchanging it with an earlier save of the same step), then replaces `latest` (a one-line file)
// by rename, and only then rotates checkpoints beyond `checkpoint.keep` away.
//
// Loading reads the manifest (manifest.h, the one reader), checks that it holds this model (the `model` config section must be
// equal), and has each rank read only the slices that intersect what its layout holds, verifying
// each slice's checksum; every element the rank needs must be found. The same layout resumes
// bitwise exactly; another layout continues the same training.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kernels/backend.h"
#include "trainer/checkpoint/commit.h"
#include "trainer/checkpoint/manifest.h"
#include "trainer/config/config.h"
#include "trainer/params/param_layout.h"

namespace tetra {

struct ProcessGroups;

// Training progress a checkpoint restores besides tensors.
struct CheckpointState {
  int64_t step = 0;              // steps completed (the LR schedule's position, less the loss
                                 // scaler's skipped steps in fp16)
  int64_t consumed_samples = 0;  // the data loader's position
  std::optional<LossScalerState> loss_scaler;  // fp16 runs (absent from checkpoints of other runs)
  // MoE auxiliary-loss-free balancing: each MoE block's expert bias, by block (the same on every
  // rank that holds the block: saved from any of them; a resume sets every rank's blocks).
  std::map<int64_t, std::vector<float>> moe_expert_bias;
};

// Further optimizer state of one rank (gradient compression's error feedback, compressed_exchange.h),
// saved as global tensors "<kind>/<param>" like the moments and resharded on load. A kind the
// checkpoint lacks (saved without it, or under a layout where it has another meaning, which the
// kind's name then encodes) is loaded as zeros, with a warning.
struct CheckpointExtra {
  std::string kind;               // "optim/onebit_server_error", ...
  float* data = nullptr;          // `ranges` back to back: backend memory, or host memory if `host`
  std::vector<GradRange> ranges;  // the buffer elements this rank holds, in buffer order
  bool writer = true;             // this rank writes them (TP rank 0 only for TP-replicated parameters)
  bool host = false;              // `data` is host memory (state the optimizer keeps on the host)
};

// One rank's buffers (backend memory) that a checkpoint saves and restores.
struct CheckpointBuffers {
  const ParamLayout* layout = nullptr;
  const std::vector<GradRange>* owned = nullptr;  // the optimizer's ranges, in buffer order
  bool sharded = false;           // owned is this rank's DP shard (distributed optimizer)
  float* master_full = nullptr;   // the whole fp32 parameter buffer, or null when...
  float* master_shard = nullptr;  // ...the optimizer holds the owned ranges' master weights
  float* exp_avg = nullptr;       // owned ranges, back to back
  float* exp_avg_sq = nullptr;
  bool zero_moments = false;      // save only: the moments are zero (an import at step 0), written
                                  // from one zero block instead of exp_avg / exp_avg_sq
  void* compute = nullptr;        // weights the model reads (restored from the master weights);
  DType compute_type = DType::F32;  // may equal master_full in fp32
  bool compute_compact = false;     // ZeRO-3: compute holds the owned ranges back to back (16-bit)
  // Load, with master_shard and no master_full: the whole 16-bit compute weights from their owned
  // ranges, all-gathered over DP (collective; GradBuffers::gather_params), so that no rank reads the
  // whole weights. Unset: the loader makes them from every local element.
  std::function<void()> gather_compute;
  std::vector<CheckpointExtra> extra;
};

// Saves step `state.step` under `dir` (collective: every rank calls it). Returns the path.
std::string save_checkpoint(const std::string& dir, const Config& cfg, ProcessGroups& groups, Backend& be,
                            const CheckpointBuffers& buffers, const CheckpointState& state);

// That the checkpoint holds the model `cfg` describes: InputError naming each differing key.
void check_same_model(const Manifest& manifest, const Config& cfg);

// The checkpoint to resume (commit.h's checkpoint_to_resume) as rank 0 finds it, on every rank
// (collective): all ranks load the same step. InputError on a rank that cannot see it.
std::string agree_checkpoint_to_resume(const CheckpointConfig& cfg, ProcessGroups& groups, int64_t last_save = -1);

// Loads `path` into the buffers (collective). InputError naming the file (and tensor) when the
// checkpoint is of another model, incomplete or corrupt. `weights_only` (checkpoint.init): the
// master and compute weights alone (and the MoE expert biases, routing state of the model); the
// moments and extra state are left as they are, and the state returned is step 0.
CheckpointState load_checkpoint(const std::string& path, const Config& cfg, ProcessGroups& groups, Backend& be,
                                const CheckpointBuffers& buffers, bool weights_only = false);

// "step_00001000"
std::string checkpoint_name(int64_t step);

// CRC-32 (IEEE, as zlib's crc32) of `bytes`.
uint32_t crc32(const void* data, size_t bytes);
// The CRC-32 of the bytes before (`crc`) and these (zlib's crc32(crc, data, bytes)):
// crc32_update(crc32(a), b) == crc32(a followed by b).
uint32_t crc32_update(uint32_t crc, const void* data, size_t bytes);
// Test-only (TETRA_TEST_CHECKPOINT_PIECE, runtime_options.h): load_checkpoint reads each saved
// slice `elements` at a time (0: the default, 2^22, 16 MiB of fp32).
void set_checkpoint_read_piece(int64_t elements);

}  // namespace tetra
