#include "trainer/checkpoint/checkpoint.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <algorithm>
#include <array>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <nlohmann/json.hpp>
#include <spdlog/spdlog.h>

#include "kernels/common/dtype.h"
#include "kernels/common/math.h"
#include "trainer/checkpoint/commit.h"
#include "trainer/core/files.h"
#include "trainer/checkpoint/manifest.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/sharding.h"
#include "kernels/common/check.h"
#include "trainer/comm/process_groups.h"

namespace tetra {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

constexpr const char* kFormat = "tetra-checkpoint";
constexpr int kVersion = 1;

// Every rank's string, on every rank (the world's host-memory communicator): lengths, then
// padded bytes.
std::vector<std::string> all_gather_strings(Communicator& world, const std::string& mine) {
  const int p = world.size();
  std::vector<int32_t> lengths(static_cast<size_t>(p));
  lengths[static_cast<size_t>(world.rank())] = static_cast<int32_t>(mine.size());
  world.all_gather(lengths.data(), lengths.data() + world.rank(), 1, DType::I32);
  const int32_t words = (*std::max_element(lengths.begin(), lengths.end()) + 3) / 4;
  std::vector<std::string> out(static_cast<size_t>(p));
  if (words == 0) return out;
  std::vector<char> host(static_cast<size_t>(p) * words * 4, 0);
  char* slot = host.data() + static_cast<size_t>(world.rank()) * words * 4;
  std::memcpy(slot, mine.data(), mine.size());
  world.all_gather(host.data(), slot, words, DType::I32);
  for (int r = 0; r < p; ++r)
    out[r].assign(host.data() + static_cast<size_t>(r) * words * 4, static_cast<size_t>(lengths[r]));
  return out;
}

// Index of each owned range's first element in the compact optimizer state.
std::vector<int64_t> compact_starts(const std::vector<GradRange>& owned) {
  std::vector<int64_t> starts;
  int64_t at = 0;
  for (const GradRange& r : owned) {
    starts.push_back(at);
    at += r.numel;
  }
  return starts;
}

std::string rank_file(int rank) { return fmt::format("rank_{:05d}.safetensors", rank); }

json layout_json(const Config& cfg, int world) {
  return json{{"world", world},
              {"tp", cfg.parallel.tp},
              {"pp", cfg.parallel.pp},
              {"dp", cfg.parallel.dp},
              {"ep", cfg.parallel.ep},
              {"etp", cfg.parallel.expert_tp()},
              {"cp", cfg.parallel.cp},
              {"order", cfg.parallel.order},
              {"sequence_parallel", cfg.parallel.sequence_parallel},
              {"distributed_optimizer", cfg.parallel.distributed_optimizer},
              {"zero_stage", cfg.parallel.zero_stage}};
}

}  // namespace

void check_same_model(const Manifest& manifest, const Config& cfg) {
  // Compared as unordered JSON (key order is no difference), each key either side has named.
  // The vocabulary's padding is no part of the model (checkpoints hold the real rows alone).
  nlohmann::json want_model = nlohmann::json::parse(config_to_json(cfg).dump())["model"];
  nlohmann::json have_model =
      nlohmann::json::parse(manifest.config.contains("model") ? manifest.config["model"].dump() : "{}");
  want_model.erase("make_vocab_size_divisible_by");
  if (have_model.is_object()) have_model.erase("make_vocab_size_divisible_by");
  if (have_model == want_model) return;
  std::string diff;
  std::set<std::string> keys;
  for (auto it = want_model.begin(); it != want_model.end(); ++it) keys.insert(it.key());
  for (auto it = have_model.begin(); it != have_model.end(); ++it) keys.insert(it.key());
  for (const std::string& k : keys) {
    const bool have = have_model.contains(k), want = want_model.contains(k);
    if (have && want && have_model[k] == want_model[k]) continue;
    diff += fmt::format("{}model.{}: checkpoint {}, config {}", diff.empty() ? "" : "; ", k,
                        have ? have_model[k].dump() : "absent", want ? want_model[k].dump() : "absent");
  }
  throw InputError(fmt::format("{}: the checkpoint holds another model ({}); resume with its model config, or "
                               "give a run of another model its own checkpoint.dir", manifest.path, diff));
}

std::string agree_checkpoint_to_resume(const CheckpointConfig& cfg, ProcessGroups& groups, int64_t last_save) {
  // Rank 0 decides; every rank takes its answer (a rank whose view of the directory lags behind,
  // as network filesystems' caches can, must not load another step), and must see it.
  const std::string mine = groups.rank == 0 ? checkpoint_to_resume(cfg, last_save) : std::string();
  const std::string chosen = all_gather_strings(*groups.world, mine)[0];
  struct stat st {};
  if (!chosen.empty() && ::stat((fs::path(chosen) / "manifest.json").c_str(), &st) != 0)
    throw InputError(fmt::format("checkpoint {} (the one rank 0 resumes from) is not visible from rank {}: {}; "
                                 "checkpoint.dir must be one directory shared by every node", chosen, groups.rank,
                                 std::strerror(errno)));
  return chosen;
}

std::string checkpoint_name(int64_t step) { return fmt::format("step_{:08d}", step); }

uint32_t crc32(const void* data, size_t bytes) { return crc32_update(0, data, bytes); }

namespace {
int64_t g_read_piece = 0;
}  // namespace

void set_checkpoint_read_piece(int64_t elements) { g_read_piece = elements; }

uint32_t crc32_update(uint32_t crc, const void* data, size_t bytes) {
  // Slicing-by-8 (8 table lookups per 8 bytes) of the reflected IEEE polynomial, zlib's CRC-32.
  static const std::array<std::array<uint32_t, 256>, 8> table = [] {
    std::array<std::array<uint32_t, 256>, 8> t{};
    for (uint32_t i = 0; i < 256; ++i) {
      uint32_t c = i;
      for (int k = 0; k < 8; ++k) c = (c & 1) ? 0xEDB88320u ^ (c >> 1) : c >> 1;
      t[0][i] = c;
    }
    for (uint32_t i = 0; i < 256; ++i)
      for (int s = 1; s < 8; ++s) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xFF];
    return t;
  }();
  uint32_t c = crc ^ 0xFFFFFFFFu;
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes >= 8) {
    uint32_t lo, hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= c;
    c = table[7][lo & 0xFF] ^ table[6][(lo >> 8) & 0xFF] ^ table[5][(lo >> 16) & 0xFF] ^ table[4][lo >> 24] ^
        table[3][hi & 0xFF] ^ table[2][(hi >> 8) & 0xFF] ^ table[1][(hi >> 16) & 0xFF] ^ table[0][hi >> 24];
    p += 8;
    bytes -= 8;
  }
  while (bytes-- > 0) c = table[0][(c ^ *p++) & 0xFF] ^ (c >> 8);
  return c ^ 0xFFFFFFFFu;
}

std::string save_checkpoint(const std::string& dir, const Config& cfg, ProcessGroups& groups, Backend& be,
                            const CheckpointBuffers& b, const CheckpointState& state) {
  const ParamLayout& layout = *b.layout;
  Communicator& world = *groups.world;
  const bool rank0 = groups.rank == 0;
  const std::string name = checkpoint_name(state.step);
  const std::string final_dir = (fs::path(dir) / name).string();
  const std::string tmp_dir = (fs::path(dir) / fmt::format(".{}.tmp", name)).string();
  CheckpointSaveScope scope;  // commit.h: the protocol's states, and its fault-injection points
  if (rank0) {
    checkpoint_io_point("mkdir", dir);
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw Error(fmt::format("checkpoint.dir: cannot create {}: {}", dir, ec.message()));
    recover_checkpoint_dir(dir);  // state 1: what crashed saves left
    checkpoint_io_point("mkdir", tmp_dir);
    if (::mkdir(tmp_dir.c_str(), 0755) != 0)
      throw Error(fmt::format("checkpoint.dir: cannot create {}: {}", tmp_dir, std::strerror(errno)));
  }
  world.barrier();
  {
    struct stat st {};
    if (::stat(tmp_dir.c_str(), &st) != 0 || !S_ISDIR(st.st_mode))
      throw Error(fmt::format("checkpoint.dir: {} (created by rank 0) is not visible from rank {}: checkpoint.dir "
                              "must be one directory shared by every node", tmp_dir, groups.rank));
  }

  // This rank's values: the master weights (whole buffer, or the owned ranges) and the moments,
  // read in place when backend memory is host memory, else copied to the host once.
  const size_t total = static_cast<size_t>(layout.total);
  const std::vector<int64_t> starts = compact_starts(*b.owned);
  const int64_t state_numel = b.owned->empty() ? 0 : starts.back() + b.owned->back().numel;
  std::vector<float> host_master, host_m, host_v;
  auto host_view = [&](const float* p, size_t n, std::vector<float>& copy) -> const float* {
    if (be.host_memory()) return p;
    copy.resize(n);
    be.copy_to_host(copy.data(), p, n * 4);
    return copy.data();
  };
  const float* master = b.master_shard ? host_view(b.master_shard, static_cast<size_t>(state_numel), host_master)
                                       : host_view(b.master_full, total, host_master);
  // Zero moments: every slice's view points at one block of zeros as large as the largest parameter.
  std::vector<float> zeros;
  if (b.zero_moments) {
    int64_t largest = 0;
    for (const ParamSpec& p : layout.params) largest = std::max(largest, p.numel);
    zeros.assign(static_cast<size_t>(largest), 0.0f);
  }
  const float* m = b.zero_moments ? nullptr : host_view(b.exp_avg, static_cast<size_t>(state_numel), host_m);
  const float* v = b.zero_moments ? nullptr : host_view(b.exp_avg_sq, static_cast<size_t>(state_numel), host_v);

  // Experts are replicated over expert-DP only: its first rank writes them.
  // The CP ranks of a replica hold the same weights, like its DP ranks.
  const bool dp_writer = b.sharded || (groups.coord.dp == 0 && groups.coord.cp == 0);
  const bool edp_writer = b.sharded || (groups.coord.edp == 0 && groups.coord.cp == 0);
  // An expert tensor's replicas over TP are those over its ETP group (the experts' own layout).
  const bool tp0 = groups.coord.tp == 0, etp0 = groups.coord.etp == 0;
  const auto replica = [&](const ParamSpec& p) { return !p.tp_split && !(p.expert ? etp0 : tp0); };
  std::vector<TensorView> views;
  json slices = json::array();
  for (const ParamSpec& p : layout.params) {
    // Replicas are written once: TP replicas by TP rank 0, a tied embedding by the first stage.
    if (!(p.expert ? edp_writer : dp_writer) || replica(p) || p.stage_copy) continue;
    for (size_t o = 0; o < b.owned->size(); ++o) {
      const GradRange& r = (*b.owned)[o];
      const int64_t lo = std::max(r.offset, p.offset) - p.offset;
      const int64_t hi = std::min(r.offset + r.numel, p.offset + p.numel) - p.offset;
      if (lo >= hi) continue;
      int64_t local = lo;  // local element of the slice's first value
      for (const SliceRegion& s : slices_of(p, lo, hi)) {
        const int64_t compact = starts[o] + (p.offset + local - r.offset);
        for (const char* kind : kCheckpointKinds) {
          const std::string k(kind);
          const float* src;
          if (k == "model")
            src = b.master_shard ? master + compact : master + p.offset + local;
          else if (b.zero_moments)
            src = zeros.data();
          else
            src = (k == "optim/exp_avg" ? m : v) + compact;
          TensorView t;
          t.name = fmt::format("{}/{}#{}", k, p.name, views.size());
          t.dtype = DType::F32;
          t.shape = {s.numel()};
          t.data = src;
          slices.push_back(json{{"key", k + "/" + p.name},
                                {"file", rank_file(groups.rank)},
                                {"tensor", t.name},
                                {"region", {s.row0, s.rows, s.col0, s.cols}},
                                {"range", {s.begin, s.end}},
                                {"crc32", crc32(src, static_cast<size_t>(s.numel()) * 4)}});
          views.push_back(std::move(t));
        }
        local += s.numel();
      }
    }
  }
  // Extra optimizer state: the same slicing over each kind's own ranges.
  std::vector<std::vector<float>> host_extra(b.extra.size());
  for (size_t x = 0; x < b.extra.size(); ++x) {
    const CheckpointExtra& e = b.extra[x];
    if (!e.writer) continue;
    const std::vector<int64_t> xs = compact_starts(e.ranges);
    const int64_t n = e.ranges.empty() ? 0 : xs.back() + e.ranges.back().numel;
    const float* data = e.host ? e.data : host_view(e.data, static_cast<size_t>(n), host_extra[x]);
    for (const ParamSpec& p : layout.params) {
      if (replica(p) || p.stage_copy) continue;
      for (size_t o = 0; o < e.ranges.size(); ++o) {
        const GradRange& r = e.ranges[o];
        const int64_t lo = std::max(r.offset, p.offset) - p.offset;
        const int64_t hi = std::min(r.offset + r.numel, p.offset + p.numel) - p.offset;
        if (lo >= hi) continue;
        int64_t local = lo;
        for (const SliceRegion& s : slices_of(p, lo, hi)) {
          const float* src = data + xs[o] + (p.offset + local - r.offset);
          TensorView t;
          t.name = fmt::format("{}/{}#{}", e.kind, p.name, views.size());
          t.dtype = DType::F32;
          t.shape = {s.numel()};
          t.data = src;
          slices.push_back(json{{"key", e.kind + "/" + p.name},
                                {"param", p.name},
                                {"file", rank_file(groups.rank)},
                                {"tensor", t.name},
                                {"region", {s.row0, s.rows, s.col0, s.cols}},
                                {"range", {s.begin, s.end}},
                                {"crc32", crc32(src, static_cast<size_t>(s.numel()) * 4)}});
          views.push_back(std::move(t));
          local += s.numel();
        }
      }
    }
  }
  if (!views.empty()) {
    const std::string file = (fs::path(tmp_dir) / rank_file(groups.rank)).string();
    write_safetensors(file, views);  // temp name, fsync, rename
  }
  const std::vector<std::string> all = all_gather_strings(world, slices.dump());
  // The MoE blocks' expert biases (the same on every rank holding a block): each rank's, merged.
  json biases = json::object();
  for (const auto& [block, values] : state.moe_expert_bias) biases[std::to_string(block)] = values;
  const std::vector<std::string> all_biases =
      cfg.model.moe.router_enable_expert_bias ? all_gather_strings(world, biases.dump()) : std::vector<std::string>();

  if (rank0) {
    json manifest;
    manifest["format"] = kFormat;
    manifest["version"] = kVersion;
    manifest["step"] = state.step;
    manifest["consumed_samples"] = state.consumed_samples;
    if (state.loss_scaler) {
      const LossScalerState& ls = *state.loss_scaler;
      manifest["loss_scaler"] = json{{"scale", ls.scale},
                                     {"growth_tracker", ls.growth_tracker},
                                     {"hysteresis_tracker", ls.hysteresis_tracker},
                                     {"skipped_steps", ls.skipped_steps},
                                     {"floor_overflows", ls.floor_overflows}};
    }
    if (cfg.model.moe.router_enable_expert_bias) {
      json merged = json::object();
      for (const std::string& s : all_biases) {
        const json rank_biases = json::parse(s);  // (a named value: items() refers into it)
        for (const auto& [block, values] : rank_biases.items()) merged[block] = values;
      }
      manifest["moe_expert_bias"] = merged;
    }
    manifest["seed"] = cfg.training.seed;
    manifest["layout"] = layout_json(cfg, world.size());
    manifest["config"] = json::parse(config_to_json(cfg).dump());
    json tensors = json::object();
    const ParamLayout whole = ParamLayout::build(cfg.model);
    for (const ParamSpec& p : whole.params)
      for (const char* kind : kCheckpointKinds)
        tensors[std::string(kind) + "/" + p.name] = json{{"shape", p.global_shape}, {"dtype", "F32"}, {"slices", json::array()}};
    for (const std::string& s : all)
      for (auto& slice : json::parse(s)) {
        const std::string key = slice["key"].get<std::string>();
        slice.erase("key");
        if (slice.contains("param")) {  // an extra kind: its entry is made by the first slice
          const std::string param = slice["param"].get<std::string>();
          slice.erase("param");
          if (!tensors.contains(key))
            for (const ParamSpec& p : whole.params)
              if (p.name == param)
                tensors[key] = json{{"shape", p.global_shape}, {"dtype", "F32"}, {"slices", json::array()}};
          TETRA_CHECK(tensors.contains(key), "checkpoint slice {} of unknown parameter {}", key, param);
        }
        tensors[key]["slices"].push_back(slice);
      }
    manifest["tensors"] = tensors;
    write_file_atomic((fs::path(tmp_dir) / "manifest.json").string(), manifest.dump(1), checkpoint_io_point);  // state 3
    commit_checkpoint(dir, name, tmp_dir);                      // states 4 and 5
    rotate_checkpoints(dir, cfg.checkpoint.keep, name);         // state 6
  }
  world.barrier();
  return final_dir;
}

CheckpointState load_checkpoint(const std::string& path, const Config& cfg, ProcessGroups& groups, Backend& be,
                                const CheckpointBuffers& b, bool weights_only) {
  const ParamLayout& layout = *b.layout;
  const Manifest manifest = read_manifest(path);
  const std::string& manifest_path = manifest.path;
  check_same_model(manifest, cfg);
  std::map<std::string, std::unique_ptr<SafetensorsReader>> files;
  auto reader = [&](const std::string& file) -> SafetensorsReader& {
    auto& r = files[file];
    if (!r) r = std::make_unique<SafetensorsReader>((fs::path(path) / file).string());
    return *r;
  };
  // What this rank needs: every local element of the weights, the owned ranges of the moments;
  // where the optimizer owns the master weights (no whole fp32 buffer), of the weights too: the
  // host holds the shard only (the compute weights are made from it, gathered over DP by
  // b.gather_compute).
  const size_t total = static_cast<size_t>(layout.total);
  const std::vector<int64_t> starts = compact_starts(*b.owned);
  const int64_t state_numel = b.owned->empty() ? 0 : starts.back() + b.owned->back().numel;
  const bool shard_weights = !b.master_full && b.master_shard && (b.compute_compact || !b.compute || b.gather_compute);
  std::vector<float> weights(shard_weights ? static_cast<size_t>(state_numel) : total, 0.0f);
  std::vector<float> m(static_cast<size_t>(state_numel)), v(static_cast<size_t>(state_numel));
  std::vector<float> values;
  // Reads the local elements [lo, hi) of `ranges` of parameter p's tensor `key` into `local` (p.numel).
  auto read_local = [&](const std::string& key, const ParamSpec& p,
                        const std::vector<std::pair<int64_t, int64_t>>& ranges, std::vector<float>& local) {
    const ManifestTensor* t = manifest.find(key);
    if (!t) throw InputError(fmt::format("{}: tensor {} is missing", manifest_path, key));
    if (ranges.empty()) return;
    local.assign(static_cast<size_t>(p.numel), 0.0f);
    std::vector<uint8_t> filled(static_cast<size_t>(p.numel), 0);
    for (const ManifestSlice& s : t->slices) {
      if (!may_intersect(p, s.region)) continue;  // only slices holding elements of this rank's
      SafetensorsReader& f = reader(s.file);
      const SafetensorsReader::Entry* e = f.find(s.tensor);
      if (!e || e->dtype != DType::F32 || e->end - e->begin != static_cast<uint64_t>(s.region.numel()) * 4)
        throw InputError(fmt::format("{}: slice {} of tensor {} is missing or of the wrong size", f.path(), s.tensor,
                                     key));
      // Read in pieces of at most kPiece elements (the host buffer's bound), each scattered into
      // this rank's elements, the checksum carried over the whole slice.
      const int64_t kPiece = g_read_piece > 0 ? g_read_piece : int64_t{1} << 22;  // 16 MiB of fp32
      const int64_t count = s.region.numel();
      values.resize(static_cast<size_t>(std::min(count, kPiece)));
      uint32_t crc = 0;
      int64_t overlaps = 0;
      for (int64_t k0 = 0; k0 < count; k0 += kPiece) {
        const int64_t n = std::min(kPiece, count - k0);
        f.read_range(*e, static_cast<uint64_t>(k0) * 4, static_cast<uint64_t>(n) * 4, values.data());
        crc = crc32_update(crc, values.data(), static_cast<size_t>(n) * 4);
        SliceRegion piece = s.region;
        piece.begin = s.region.begin + k0;
        piece.end = piece.begin + n;
        for (const auto& [lo, hi] : ranges) overlaps += scatter_slice(p, lo, hi, piece, values.data(), local.data(), filled);
      }
      if (crc != s.crc)
        throw InputError(fmt::format("{}: slice {} of tensor {} fails its checksum: the file is corrupt", f.path(),
                                     s.tensor, key));
      if (overlaps > 0)
        throw InputError(fmt::format("{}: slice {} of tensor {} overlaps another slice ({} elements): the "
                                     "manifest is corrupt", manifest_path, s.tensor, key, overlaps));
    }
    for (const auto& [lo, hi] : ranges)
      for (int64_t i = lo; i < std::min(hi, p.held()); ++i)  // the padding stays zero
        if (!filled[static_cast<size_t>(i)])
          throw InputError(fmt::format("{}: tensor {} lacks element {} of this rank's slice: the checkpoint "
                                       "is incomplete (a missing rank file?)", manifest_path, key, p.global_index(i)));
  };
  // The local ranges of p inside `owned`, and a copy from p's local values into compact state.
  auto local_ranges = [](const ParamSpec& p, const std::vector<GradRange>& owned) {
    std::vector<std::pair<int64_t, int64_t>> ranges;
    for (const GradRange& r : owned) {
      const int64_t lo = std::max(r.offset, p.offset) - p.offset;
      const int64_t hi = std::min(r.offset + r.numel, p.offset + p.numel) - p.offset;
      if (lo < hi) ranges.emplace_back(lo, hi);
    }
    return ranges;
  };
  auto to_compact = [](const ParamSpec& p, const std::vector<GradRange>& owned, const std::vector<int64_t>& at,
                       const std::vector<float>& local, std::vector<float>& dst) {
    for (size_t o = 0; o < owned.size(); ++o) {
      const GradRange& r = owned[o];
      const int64_t lo = std::max(r.offset, p.offset), hi = std::min(r.offset + r.numel, p.offset + p.numel);
      for (int64_t g = lo; g < hi; ++g)
        dst[static_cast<size_t>(at[o] + g - r.offset)] = local[static_cast<size_t>(g - p.offset)];
    }
  };
  std::vector<float> local;
  for (const ParamSpec& p : layout.params) {
    for (const char* kind : kCheckpointKinds) {
      const std::string key = std::string(kind) + "/" + p.name;
      const bool model = std::string(kind) == "model";
      if (weights_only && !model) continue;
      const auto ranges = model && !shard_weights ? std::vector<std::pair<int64_t, int64_t>>{{0, p.numel}}
                                                  : local_ranges(p, *b.owned);
      read_local(key, p, ranges, local);  // checks the tensor is there even when nothing is needed
      if (ranges.empty()) continue;
      if (model && shard_weights)
        to_compact(p, *b.owned, starts, local, weights);
      else if (model)
        std::memcpy(weights.data() + p.offset, local.data(), static_cast<size_t>(p.numel) * 4);
      else
        to_compact(p, *b.owned, starts, local, std::string(kind) == "optim/exp_avg" ? m : v);
    }
  }
  // Extra optimizer state: zeros when the checkpoint lacks the kind (one warning per kind).
  std::set<std::string> warned;
  for (const CheckpointExtra& x : b.extra) {
    if (weights_only) break;
    const std::vector<int64_t> xs = compact_starts(x.ranges);
    std::vector<float> host(static_cast<size_t>(x.ranges.empty() ? 0 : xs.back() + x.ranges.back().numel), 0.0f);
    // Present when the checkpoint holds the kind for the first parameter this rank needs it for.
    const ParamSpec* first = nullptr;
    for (const ParamSpec& p : layout.params)
      if (!first && !local_ranges(p, x.ranges).empty()) first = &p;
    const bool present = first && manifest.find(x.kind + "/" + first->name);
    if (first && !present) {
      if (warned.insert(x.kind).second)
        spdlog::warn("{} holds no {} (saved without it, or under another data-parallel layout, to which it "
                     "does not carry over): it starts from zero", path, x.kind);
    } else if (present) {
      for (const ParamSpec& p : layout.params) {
        const auto ranges = local_ranges(p, x.ranges);
        if (ranges.empty()) continue;
        read_local(x.kind + "/" + p.name, p, ranges, local);
        to_compact(p, x.ranges, xs, local, host);
      }
    }
    if (x.host)
      std::copy(host.begin(), host.end(), x.data);
    else
      be.copy_from_host(x.data, host.data(), host.size() * 4);
  }
  // Into backend memory: master weights (whole or shard), compute weights, moments.
  if (b.master_full) {
    be.copy_from_host(b.master_full, weights.data(), total * 4);
    if (b.compute && b.compute != b.master_full)
      be.cast(b.compute, b.compute_type, b.master_full, DType::F32, layout.total);
  } else {
    // No whole fp32 buffer (the distributed optimizer with 16-bit compute): the shard straight from
    // the host copy, and the compute weights rounded on the host (to nearest even, as
    // Backend::cast) a piece at a time, so that no whole fp32 copy is staged in backend memory.
    // (the element of owned range o at i: in the host copy, compact or whole)
    auto host_at = [&](size_t o, int64_t i) {
      return weights[static_cast<size_t>(shard_weights ? starts[o] + i : (*b.owned)[o].offset + i)];
    };
    if (b.master_shard)
      for (size_t o = 0; o < b.owned->size(); ++o)
        be.copy_from_host(b.master_shard + starts[o], weights.data() + (shard_weights ? starts[o] : (*b.owned)[o].offset),
                          static_cast<size_t>((*b.owned)[o].numel) * 4);
    // Owned range o rounded on the host (to nearest even, as Backend::cast) into the compute
    // weights at element `at`.
    auto round_range = [&](size_t o, int64_t at) {
      const GradRange& r = (*b.owned)[o];
      std::vector<uint16_t> piece(static_cast<size_t>(r.numel));
      for (int64_t i = 0; i < r.numel; ++i) {
        const float x = host_at(o, i);
        piece[static_cast<size_t>(i)] = b.compute_type == DType::BF16 ? math::f32_to_bf16_bits(x) : math::f32_to_f16_bits(x);
      }
      be.copy_from_host(static_cast<char*>(b.compute) + static_cast<size_t>(at) * 2, piece.data(), piece.size() * 2);
    };
    if (b.compute && b.compute_compact) {  // ZeRO-3: the owned ranges only, back to back
      TETRA_CHECK(is_half_type(b.compute_type), "a compact compute shard of type {}", dtype_name(b.compute_type));
      for (size_t o = 0; o < b.owned->size(); ++o) round_range(o, starts[o]);
    } else if (b.compute && shard_weights) {  // the owned ranges rounded in place, then gathered over DP
      TETRA_CHECK(is_half_type(b.compute_type), "compute weights of type {} without a whole fp32 buffer",
                  dtype_name(b.compute_type));
      for (size_t o = 0; o < b.owned->size(); ++o) round_range(o, (*b.owned)[o].offset);
      b.gather_compute();
    } else if (b.compute) {
      TETRA_CHECK(is_half_type(b.compute_type), "compute weights of type {} without a whole fp32 buffer",
                  dtype_name(b.compute_type));
      constexpr size_t kPiece = size_t{1} << 20;
      std::vector<uint16_t> piece(std::min(kPiece, total));
      for (size_t at = 0; at < total; at += kPiece) {
        const size_t len = std::min(kPiece, total - at);
        for (size_t i = 0; i < len; ++i) {
          const float x = weights[at + i];
          piece[i] = b.compute_type == DType::BF16 ? math::f32_to_bf16_bits(x) : math::f32_to_f16_bits(x);
        }
        be.copy_from_host(static_cast<char*>(b.compute) + at * 2, piece.data(), len * 2);
      }
    }
  }
  if (!weights_only) {
    be.copy_from_host(b.exp_avg, m.data(), m.size() * 4);
    be.copy_from_host(b.exp_avg_sq, v.data(), v.size() * 4);
  }
  groups.world->barrier();

  CheckpointState st;
  st.moe_expert_bias = manifest.moe_expert_bias;  // routing state of the model: also for checkpoint.init
  if (weights_only) {
    spdlog::info("initialised the weights from {} (step {} of the run that saved it; this run starts at step 0 "
                 "with a fresh optimizer)", path, manifest.step);
    return st;
  }
  st.step = manifest.step;
  st.consumed_samples = manifest.consumed_samples;
  st.loss_scaler = manifest.loss_scaler;
  if (cfg.model.moe.router_enable_expert_bias && manifest.moe_expert_bias.empty())
    spdlog::warn("{} holds no MoE expert bias (saved without model.moe.router_enable_expert_bias): the biases start "
                 "from zero", path);
  spdlog::info("resumed from {} (step {}, {} samples consumed; saved under layout {})", path, st.step,
               st.consumed_samples, manifest.layout.dump());
  return st;
}

}  // namespace tetra
