// The one reader of a checkpoint's manifest.json, used by the trainer (load_checkpoint) and by
// `tetra ckpt` alike, so the two cannot disagree on what a valid checkpoint is.
//
// read_manifest() checks everything that can be checked without reading tensor bytes, and throws
// InputError naming the manifest and the field (or tensor and slice) at the first problem:
//   - format "tetra-checkpoint", version 1;
//   - every field of the right JSON type (an integer step, an unsigned 32-bit crc32, ...): a
//     field of the wrong type is named with what it holds, never a bare library message;
//   - the step agrees with the directory's name (step_00000008 holds step 8) and with the data
//     position (0 <= step <= consumed_samples; no samples without steps);
//   - config.model is a valid model, and the tensor index holds exactly its tensors, with its
//     shapes, in F32 (plus gradient compression's error-feedback kinds where present);
//   - every slice names a plain file of the checkpoint directory (no '/', no "..") and lies inside
//     its tensor.
// What needs the bytes (checksums, that the slices cover their tensor exactly once) is checked by
// the reader of the bytes: load_checkpoint for what a rank needs, `tetra ckpt inspect` for all.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "trainer/checkpoint/sharding.h"
#include "trainer/config/config.h"

namespace tetra {

// The fp16 dynamic loss scaler's state (trainer/optim/loss_scaler.h), as a checkpoint records it: the
// checkpoint layer stores and validates it, the optimizer layer gives it meaning.
struct LossScalerState {
  double scale = 1.0;
  int64_t growth_tracker = 0;      // overflow-free steps since the last overflow or growth
  int64_t hysteresis_tracker = 1;  // overflows left before the scale halves
  int64_t skipped_steps = 0;       // overflow steps skipped since the run began (resumes included)
  int64_t floor_overflows = 0;     // overflows in a row at the lowest scale (the divergence limit)
  bool operator==(const LossScalerState&) const = default;
};

struct ManifestSlice {
  size_t index = 0;           // in its tensor's list of slices (messages count from 1)
  std::string file, tensor;   // the safetensors file (a name inside the checkpoint) and its entry
  SliceRegion region;
  uint32_t crc = 0;
};

struct ManifestTensor {
  std::string key;            // "model/layers.0.attn.qkv.weight"
  std::vector<int64_t> shape;
  int64_t rows = 0, cols = 0;  // the 2-D view slices are regions of (n elements: n x 1)
  std::vector<ManifestSlice> slices;
  int64_t numel() const { return rows * cols; }
};

struct Manifest {
  std::string dir;            // the checkpoint directory (step_*)
  std::string path;           // dir/manifest.json
  int64_t step = 0;
  int64_t consumed_samples = 0;
  uint64_t seed = 0;
  std::optional<LossScalerState> loss_scaler;
  std::map<int64_t, std::vector<float>> moe_expert_bias;  // "moe_expert_bias": block -> (E) values
  nlohmann::ordered_json layout;  // the layout it was saved under (world, tp, pp, dp, ...)
  nlohmann::ordered_json config;  // the resolved config of the run that saved it
  ModelConfig model;          // config.model, validated
  // "model", "optim/exp_avg", "optim/exp_avg_sq" over every parameter in layout order, then each
  // compression kind over the parameters it holds.
  std::vector<ManifestTensor> tensors;
  std::map<std::string, size_t> index;  // key -> tensors[i]

  const ManifestTensor* find(const std::string& key) const {
    const auto it = index.find(key);
    return it == index.end() ? nullptr : &tensors[it->second];
  }
};

// The checkpoint tensor kinds every checkpoint holds for every parameter.
inline const char* const kCheckpointKinds[] = {"model", "optim/exp_avg", "optim/exp_avg_sq"};

// Reads and checks `checkpoint_dir`/manifest.json (see the header comment). InputError otherwise.
Manifest read_manifest(const std::string& checkpoint_dir);

// The step a checkpoint directory's name says it holds: "step_00000008" -> 8, and the names a
// save stages and sets aside, ".step_00000008.tmp" and ".step_00000008.old" -> 8; -1 for any
// other name.
int64_t step_of_checkpoint_name(const std::string& name);

// "<dir>/<file>: tensor <key>, slice 2 of 4 ("<entry>": rows [..), columns [..), elements [..))"
std::string describe_slice(const Manifest& m, const ManifestTensor& t, const ManifestSlice& s);

// That the slices of `t` cover each element exactly once: InputError naming the slice otherwise.
void check_coverage(const Manifest& m, const ManifestTensor& t);

}  // namespace tetra
