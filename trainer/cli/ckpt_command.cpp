// `tetra ckpt`: reads Tetra checkpoints (trainer/checkpoint/checkpoint.h) without training.
//
//   tetra ckpt inspect DIR                          what the checkpoint holds, every byte verified
//   tetra ckpt export-hf DIR OUT [--dtype fp32|bf16|fp16] [--force]
//                                                    OUT/model.safetensors + OUT/config.json
//
// DIR is a step_* directory, or a checkpoint.dir whose `latest` names one.
//
// `inspect` prints the step, the data position, the layout the checkpoint was saved under, the
// fp16 loss scaler's state where there is one, the model, and every tensor (global shape, slices,
// bytes), then verifies all of it: the manifest's tensors are exactly the model's, with its
// shapes; each tensor's slices lie inside it, overlap nowhere and together cover every element;
// every slice is read from its file and its CRC-32 compared with the manifest's. `export-hf`
// assembles each "model/" tensor from its slices (the same checks on the slices it reads) and
// writes it under Hugging Face's names and layouts (trainer/checkpoint/hf_export.h). OUT is
// checked before any of that: a new directory (created with its parents) or an empty one; a
// non-empty one only with --force, which replaces the two files and leaves the rest. Nothing is
// written unless the whole export succeeds up to the write, and a write that fails takes back the
// files the export wrote. `import-hf` checks every tensor of HF_DIR from its headers (names,
// shapes, types, the data sections laid end to end) and the host's memory before it reads a
// weight; a failure after it began writing OUT removes what it wrote, so a retry finds OUT empty.
//
// Exit codes: 0 success; 2 a bad checkpoint or bad input, the message naming the file, tensor and
// slice of the first problem; 1 any other failure. A filesystem or JSON exception that escapes
// the commands is reported as "error: <file>: <what>", exit 2 where the error is the input's (a
// missing or unreadable file, a bad path, a malformed manifest), 1 otherwise.
#include <sys/stat.h>

#include <algorithm>
#include <cmath>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <system_error>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/hf_export.h"
#include "trainer/checkpoint/hf_import.h"
#include "trainer/comm/process_groups.h"
#include "trainer/comm/rank_grid.h"
#include "trainer/checkpoint/manifest.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/sharding.h"
#include "trainer/config/config.h"
#include "kernels/common/check.h"
#include "trainer/cli/cli.h"
#include "trainer/core/files.h"
#include "trainer/core/format.h"
#include "trainer/core/output_path.h"
#include "trainer/params/param_layout.h"

namespace tetra::cli {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using tetra::InputError;

using tetra::grouped;
using Checkpoint = tetra::Manifest;
using TensorEntry = tetra::ManifestTensor;
using Slice = tetra::ManifestSlice;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

int64_t slice_elements(const TensorEntry& t) {
  int64_t n = 0;
  for (const Slice& s : t.slices) n += s.region.numel();
  return n;
}

// The step_* directory DIR names: itself, or what DIR/latest names (the trainer's resolver: a
// `latest` that is missing or names an incomplete checkpoint falls back to the newest complete one).
std::string resolve_checkpoint(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0)
    throw InputError(fmt::format("{}: cannot read the checkpoint: {}", dir, std::strerror(errno)));
  if (!S_ISDIR(st.st_mode))
    throw InputError(fmt::format("{}: not a checkpoint directory (not a directory)", dir));
  const std::string manifest = (fs::path(dir) / "manifest.json").string();
  if (::stat(manifest.c_str(), &st) == 0) return dir;
  if (errno != ENOENT)
    throw InputError(fmt::format("{}: cannot read the checkpoint: {}", dir, std::strerror(errno)));
  tetra::CheckpointConfig cfg;
  cfg.dir = dir;
  cfg.resume.kind = tetra::ResumeKind::AUTO;
  const std::string path = tetra::checkpoint_to_resume(cfg);
  if (path.empty())
    throw InputError(fmt::format("{}: not a checkpoint (no manifest.json) nor a checkpoint directory (no "
                                 "latest, no step_*); give a step_* directory or a checkpoint.dir", dir));
  return path;
}

// The checkpoint's manifest, through the reader the trainer uses (trainer/checkpoint/manifest.h).
Checkpoint read_index(const std::string& dir) { return tetra::read_manifest(resolve_checkpoint(dir)); }

std::string describe(const Checkpoint& ck, const TensorEntry& t, const Slice& s) {
  return tetra::describe_slice(ck, t, s);
}

// Reads slices, each file opened once, each slice checked against the manifest.
class SliceFiles {
 public:
  explicit SliceFiles(const Checkpoint& ck) : ck_(ck) {}

  // The slice's values, after its entry's type and size and its CRC-32 are checked.
  void read(const TensorEntry& t, const Slice& s, std::vector<float>& values) {
    const tetra::SafetensorsReader& f = open(t, s);
    const tetra::SafetensorsReader::Entry* e = f.find(s.tensor);
    if (!e) throw InputError(fmt::format("{}: the file has no entry \"{}\"", describe(ck_, t, s), s.tensor));
    const uint64_t want = static_cast<uint64_t>(s.region.numel()) * 4;
    if (e->dtype != tetra::DType::F32 || e->end - e->begin != want)
      throw InputError(fmt::format("{}: the file's entry is {} of {} bytes, the manifest's slice F32 of {} bytes",
                                   describe(ck_, t, s), tetra::dtype_name(e->dtype), e->end - e->begin, want));
    values.resize(static_cast<size_t>(s.region.numel()));
    try {
      f.read(*e, values.data());
    } catch (const InputError& err) {
      throw InputError(fmt::format("{}: {}", describe(ck_, t, s), err.what()));
    }
    const uint32_t crc = tetra::crc32(values.data(), want);
    if (crc != s.crc)
      throw InputError(fmt::format("{}: checksum {:08x} differs from the manifest's {:08x}: the file is corrupt",
                                   describe(ck_, t, s), crc, s.crc));
    bytes_ += want;
  }
  uint64_t bytes_read() const { return bytes_; }
  size_t files_opened() const { return readers_.size(); }

 private:
  const tetra::SafetensorsReader& open(const TensorEntry& t, const Slice& s) {
    std::unique_ptr<tetra::SafetensorsReader>& r = readers_[s.file];
    if (!r) {
      const std::string path = (fs::path(ck_.dir) / s.file).string();
      if (!fs::exists(path))
        throw InputError(fmt::format("{}: the file is missing", describe(ck_, t, s)));
      try {
        r = std::make_unique<tetra::SafetensorsReader>(path);
      } catch (const InputError& err) {  // a header that does not parse, offsets past the end
        throw InputError(fmt::format("{}: unreadable file: {}", describe(ck_, t, s), err.what()));
      }
    }
    return *r;
  }

  const Checkpoint& ck_;
  std::map<std::string, std::unique_ptr<tetra::SafetensorsReader>> readers_;
  uint64_t bytes_ = 0;
};

// The global tensor, assembled from its verified slices (row-major, t.shape).
std::vector<float> assemble(const Checkpoint& ck, const TensorEntry& t, SliceFiles& files) {
  tetra::check_coverage(ck, t);
  std::vector<float> out(static_cast<size_t>(t.numel())), values;
  for (const Slice& s : t.slices) {
    files.read(t, s, values);
    for (int64_t e = s.region.begin; e < s.region.end; ++e)
      out[static_cast<size_t>(s.region.global_index(e, t.cols))] = values[static_cast<size_t>(e - s.region.begin)];
  }
  return out;
}

// ---- subcommands -------------------------------------------------------------------------------

std::string model_text(const tetra::ModelConfig& m) {
  return fmt::format("{} layers, hidden {}, {} heads ({} kv, head size {}), ffn {}, vocab {}, seq_len {}; "
                     "{} (eps {:g}), {}, {}{}, {} embeddings, {}",
                     m.num_layers, m.hidden_size, m.num_heads, m.num_kv_heads, m.head_size(), m.ffn_hidden_size,
                     m.vocab_size, m.seq_len, tetra::to_string(m.norm), m.norm_eps, tetra::to_string(m.activation),
                     tetra::to_string(m.position),
                     m.position == tetra::Position::ROPE ? fmt::format(" (theta {:g})", m.rope_theta) : "",
                     m.tie_embeddings ? "tied" : "untied", m.bias ? "biases" : "no biases");
}

std::string layout_text(const json& l) {
  auto get = [&](const char* k) { return l.contains(k) ? l[k].dump() : std::string("?"); };
  // zero_stage: absent from checkpoints written before it (their stage is 0 or 1, as
  // distributed_optimizer says).
  return fmt::format(
      "world {}: tp {}, {}pp {}, dp {}, ep {}, order {}, sequence_parallel {}, distributed_optimizer {}{}",
      get("world"), get("tp"), l.contains("cp") ? "cp " + l["cp"].dump() + ", " : "", get("pp"), get("dp"), get("ep"),
      l.contains("order") && l["order"].is_string() ? l["order"].get<std::string>() : "?", get("sequence_parallel"),
      get("distributed_optimizer"), l.contains("zero_stage") ? ", zero_stage " + l["zero_stage"].dump() : "");
}

int inspect(const std::string& dir) {
  const Checkpoint ck = read_index(dir);
  const tetra::ParamLayout layout = tetra::ParamLayout::build(ck.model);
  int64_t params = 0;
  for (const tetra::ParamSpec& p : layout.params) params += p.held();
  fmt::print("checkpoint:       {}\n", ck.dir);
  fmt::print("step:             {}\n", ck.step);
  fmt::print("consumed samples: {}\n", ck.consumed_samples);
  fmt::print("seed:             {}\n", ck.seed);
  if (ck.loss_scaler) {  // fp16 runs: the dynamic loss scaler's state
    const tetra::LossScalerState& ls = *ck.loss_scaler;
    fmt::print("loss scaler:      {{\"scale\":{},\"growth_tracker\":{},\"hysteresis_tracker\":{},\"skipped_steps\":{},"
               "\"floor_overflows\":{}}}\n", json(ls.scale).dump(), ls.growth_tracker, ls.hysteresis_tracker,
               ls.skipped_steps, ls.floor_overflows);
  }
  fmt::print("layout:           {}\n", layout_text(ck.layout.is_object() ? ck.layout : json::object()));
  fmt::print("model:            {}\n", model_text(ck.model));
  fmt::print("parameters:       {}\n", grouped(params));

  std::map<std::string, std::pair<size_t, int64_t>> files;  // file -> slices, bytes in it
  int64_t total = 0;
  size_t slices = 0, width = 6;
  for (const TensorEntry& t : ck.tensors) width = std::max(width, t.key.size());
  fmt::print("\n{:<{}}  {:>12}  {:>6}  {:>12}\n", "tensor", width, "shape", "slices", "bytes");
  for (const TensorEntry& t : ck.tensors) {
    const int64_t bytes = slice_elements(t) * 4;
    fmt::print("{:<{}}  {:>12}  {:>6}  {:>12}\n", t.key, width, shape_text(t.shape), t.slices.size(), grouped(bytes));
    total += bytes;
    slices += t.slices.size();
    for (const Slice& s : t.slices) {
      files[s.file].first += 1;
      files[s.file].second += s.region.numel() * 4;
    }
  }
  fmt::print("\ntensors:          {} ({} slices)\n", ck.tensors.size(), slices);
  fmt::print("total bytes:      {}\n", grouped(total));
  for (const auto& [file, n] : files) {
    std::error_code ec;
    const auto size = fs::file_size(fs::path(ck.dir) / file, ec);
    fmt::print("file:             {}: {} slices, {} bytes of tensors, {}\n", file, n.first, grouped(n.second),
               ec ? std::string("MISSING") : grouped(static_cast<int64_t>(size)) + " bytes on disk");
  }
  std::fflush(stdout);

  SliceFiles reader(ck);
  std::vector<float> values;
  for (const TensorEntry& t : ck.tensors) {
    tetra::check_coverage(ck, t);
    for (const Slice& s : t.slices) reader.read(t, s, values);
  }
  fmt::print("verified:         {} slices in {} files, {} bytes: every checksum matches, every tensor covered "
             "exactly once\n", slices, reader.files_opened(), grouped(static_cast<int64_t>(reader.bytes_read())));
  return 0;
}

// "5GB", "500MB", "64KB" (powers of 1000, as Hugging Face's max_shard_size) or a byte count.
int64_t shard_bytes(const std::string& text) {
  size_t used = 0;
  double v = 0;
  try {
    v = std::stod(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  std::string unit = text.substr(used);
  std::transform(unit.begin(), unit.end(), unit.begin(), [](unsigned char c) { return std::toupper(c); });
  const std::map<std::string, double> units = {{"", 1.0}, {"B", 1.0}, {"KB", 1e3}, {"MB", 1e6}, {"GB", 1e9}, {"TB", 1e12}};
  const auto it = units.find(unit);
  if (used == 0 || it == units.end() || !std::isfinite(v) || !(v > 0))
    throw InputError(fmt::format("--max-shard-size {}: expected a size such as 5GB, 500MB or a byte count", text));
  // At least one byte, at most 1 PB (beyond any file a loader maps): no overflow, no zero limit.
  const double bytes = v * it->second;
  if (!(bytes >= 1.0) || bytes > 1e15)
    throw InputError(fmt::format("--max-shard-size {}: {:.4g} bytes; give from 1 byte to 1000TB", text, bytes));
  return static_cast<int64_t>(bytes);
}

// Removes what a failed import or export wrote into `out` (the `names` of its own entries, and
// `out` itself when this command created it and it is empty again), so that the retry finds OUT
// as it was. Best effort: the failure being reported matters more.
void remove_written(const std::string& out, const std::vector<std::string>& names, bool created_out) {
  std::error_code ec;
  for (const std::string& n : names) fs::remove_all(fs::path(out) / n, ec);
  if (created_out) fs::remove(out, ec);  // only if empty
}

int export_hf(const std::string& dir, const std::string& out, const std::string& dtype_name, bool force,
              const std::string& max_shard) {
  const int64_t max_shard_bytes = shard_bytes(max_shard);
  const tetra::DType dtype =
      tetra::precision_dtype(tetra::enum_from_string<tetra::Precision>(dtype_name).value_or(tetra::Precision::FP32));
  tetra::hf_check_output_dir(out, force);  // before any work: a refusal reads and writes nothing
  const Checkpoint ck = read_index(dir);
  const tetra::HfArch arch = tetra::hf_architecture(ck.model);  // before any work: InputError if none
  std::map<std::string, const TensorEntry*> by_key;
  for (const TensorEntry& t : ck.tensors) by_key[t.key] = &t;
  SliceFiles files(ck);
  const std::vector<tetra::TensorRecord> records =
      tetra::hf_tensors(ck.model, arch, dtype, [&](const std::string& name) {
        return assemble(ck, *by_key.at("model/" + name), files);
      });
  // GPT-2's BPE ends documents with <|endoftext|> (id 50256); other tokenizers are not known here.
  int64_t eos = -1;
  const json& cfg = ck.config;
  if (cfg.contains("data")) {
    const json& data = cfg["data"];
    if (!data.is_object() || (data.contains("tokenizer") && !data["tokenizer"].is_string()))
      throw InputError(fmt::format("{}: field config.data is {}, not a data section (an object whose tokenizer is a "
                                   "string)", ck.path, data.dump()));
    if (data.value("tokenizer", "").rfind("gpt2:", 0) == 0 && ck.model.vocab_size > 50256) eos = 50256;
  }
  const json config = tetra::hf_config(ck.model, arch, dtype, eos);
  // Room for the tensors (plus a MiB for headers and config.json) before OUT is created.
  uint64_t need = uint64_t{1} << 20;
  for (const tetra::TensorRecord& r : records) need += r.data.size();
  tetra::check_output_dir("OUT", out, need);

  std::error_code ec;
  const bool created_out = !fs::exists(out, ec);
  fs::create_directories(out, ec);
  if (ec || !fs::is_directory(out))
    throw InputError(fmt::format("{}: cannot create the output directory: {}", out,
                                 ec ? ec.message() : "not a directory"));
  // Shards of at most max_shard_bytes (a larger tensor alone in its own), in state-dict order, with
  // Hugging Face's index when there is more than one; what an earlier export left is replaced.
  std::vector<std::vector<tetra::TensorRecord>> shards(1);
  int64_t in_shard = 0, total_bytes = 0;
  for (const tetra::TensorRecord& r : records) {
    const int64_t bytes = static_cast<int64_t>(r.data.size());
    if (in_shard > 0 && in_shard + bytes > max_shard_bytes) {
      shards.emplace_back();
      in_shard = 0;
    }
    shards.back().push_back(r);
    in_shard += bytes;
    total_bytes += bytes;
  }
  for (const auto& entry : fs::directory_iterator(out)) {
    const std::string name = entry.path().filename().string();
    if (name == "model.safetensors.index.json" ||
        (name.rfind("model-", 0) == 0 && name.find("-of-") != std::string::npos &&
         name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0))
      fs::remove(entry.path());
  }
  // Every file through the atomic writers (a temporary name, fsync, rename), config.json first; a
  // write that fails (a full disk, no inodes left) is exit 1 naming the file and the reason, and
  // takes back what this export wrote, so that OUT never holds weights without their config.
  std::vector<std::string> written;
  std::string weights = (fs::path(out) / "model.safetensors").string();
  try {
    written.push_back("config.json");
    tetra::write_file_atomic((fs::path(out) / "config.json").string(), config.dump(2) + "\n");
    if (shards.size() == 1) {
      written.push_back("model.safetensors");
      tetra::write_safetensors(weights, shards[0], tetra::hf_metadata());
    } else {
      fs::remove(weights);
      json index = {{"metadata", {{"total_size", total_bytes}}}, {"weight_map", json::object()}};
      for (size_t k = 0; k < shards.size(); ++k) {
        const std::string file = fmt::format("model-{:05d}-of-{:05d}.safetensors", k + 1, shards.size());
        written.push_back(file);
        tetra::write_safetensors((fs::path(out) / file).string(), shards[k], tetra::hf_metadata());
        for (const tetra::TensorRecord& r : shards[k]) index["weight_map"][r.name] = file;
      }
      weights = (fs::path(out) / "model.safetensors.index.json").string();
      written.push_back("model.safetensors.index.json");
      tetra::write_file_atomic(weights, index.dump(2) + "\n");
    }
  } catch (...) {
    remove_written(out, written, created_out);
    throw;
  }
  int64_t elements = 0;
  for (const tetra::TensorRecord& r : records) elements += r.numel();
  fmt::print("checkpoint:  {} (step {})\n", ck.dir, ck.step);
  fmt::print("model:       {}\n", model_text(ck.model));
  fmt::print("exported as: {} ({}), {}\n", tetra::hf_model_type(arch), config["architectures"][0].get<std::string>(),
             config["torch_dtype"].get<std::string>());
  fmt::print("wrote:       {}: {} tensors, {} values, {} bytes of tensors{}\n", weights, records.size(),
             grouped(elements), grouped(total_bytes),
             shards.size() > 1 ? fmt::format(" in {} shards", shards.size()) : std::string());
  fmt::print("wrote:       {}\n", (fs::path(out) / "config.json").string());
  return 0;
}

int import_hf(const std::string& hf_dir, const std::string& out, int64_t seq_len) {
  tetra::hf_check_output_dir(out, false, /*can_force=*/false);  // before any work: a refusal reads and writes nothing
  const tetra::HfModel hf = tetra::read_hf_model(hf_dir, seq_len);
  json j = {{"model", hf.model}, {"data", {{"synthetic", true}}}, {"checkpoint", {{"dir", out}}}};
  tetra::Config cfg;
  try {
    cfg = tetra::config_from_json(j);
  } catch (const tetra::ConfigError& e) {
    throw InputError(fmt::format("{}/config.json describes a model Tetra cannot build:{}", hf_dir,
                                 tetra::hf_config_problems(hf, e.problems())));
  }
  const tetra::ParamLayout layout = tetra::ParamLayout::build(cfg.model);
  // Room for the weights and the two (zero) moments, fp32, plus a MiB for the manifest.
  tetra::check_output_dir("OUT", out, static_cast<uint64_t>(layout.total) * 12 + (uint64_t{1} << 20));
  // Every header checked, then the memory (the weights, and the zero block the moments are written
  // from), then the weights read.
  int64_t largest = 0;
  for (const tetra::ParamSpec& p : layout.params) largest = std::max(largest, p.numel);
  std::vector<float> master = tetra::read_hf_weights(hf, cfg.model, static_cast<uint64_t>(largest) * 4);
  // Step 0 with zero moments, saved as a one-rank run would: any layout loads it (resharding).
  const std::vector<tetra::GradRange> owned = {{0, layout.total}};
  tetra::CheckpointBuffers b;
  b.layout = &layout;
  b.owned = &owned;
  b.master_full = master.data();
  b.zero_moments = true;
  b.compute = master.data();
  auto be = tetra::make_cpu_backend(1);
  tetra::ProcessGroups groups = tetra::ProcessGroups::create(tetra::RankGrid::build(tetra::GridSizes{}), 0);
  // OUT was new or empty: what is in it after a failure is this import's, and goes.
  std::error_code ec;
  const bool created_out = !fs::exists(out, ec);
  const std::string model_json = (fs::path(out) / "model.json").string();
  std::string step;
  try {
    step = tetra::save_checkpoint(out, cfg, groups, *be, b, tetra::CheckpointState{});
    tetra::write_file_atomic(model_json, json{{"model", hf.model}}.dump(2) + "\n");
  } catch (...) {
    std::vector<std::string> names;
    for (fs::directory_iterator it(out, ec), end; !ec && it != end; it.increment(ec))
      names.push_back(it->path().filename().string());
    remove_written(out, names, created_out);
    throw;
  }
  int64_t params = 0;
  for (const tetra::ParamSpec& p : layout.params) params += p.held();
  fmt::print("imported:    {} ({}, {} file(s))\n", hf_dir, hf.model_type, hf.weight_files.size());
  fmt::print("model:       {}\n", model_text(cfg.model));
  fmt::print("parameters:  {}\n", grouped(params));
  fmt::print("wrote:       {} (step 0: the weights, zero optimizer state; checkpoint.init or checkpoint.resume "
             "loads it under any layout)\n", step);
  fmt::print("wrote:       {} (the model section for a run config)\n", model_json);
  return 0;
}

// ---- errors that escape the commands -----------------------------------------------------------

// Whether a filesystem error is the input's (exit 2: a path that is missing, not what it should
// be, or not accessible) rather than a failure of the machine (exit 1: I/O, space, ...).
bool input_error(const std::error_code& ec) {
  if (ec.category() != std::generic_category() && ec.category() != std::system_category()) return false;
  switch (ec.value()) {
    case ENOENT: case ENOTDIR: case EISDIR: case EACCES: case EPERM: case ENAMETOOLONG: case ELOOP:
    case EEXIST: case ENOTEMPTY: case EROFS: case EINVAL:
      return true;
    default:
      return false;
  }
}

// "<path1>: <operation>: <reason>[ (and <path2>)]" from libstdc++'s "filesystem error: <operation>:
// <reason> [<path1>] [<path2>]".
std::string filesystem_message(const fs::filesystem_error& e) {
  std::string what = e.what();
  const std::string prefix = "filesystem error: ";
  if (what.rfind(prefix, 0) == 0) what.erase(0, prefix.size());
  for (const fs::path* p : {&e.path2(), &e.path1()}) {
    const std::string tail = " [" + p->string() + "]";
    if (!p->empty() && what.size() >= tail.size() && what.compare(what.size() - tail.size(), tail.size(), tail) == 0)
      what.erase(what.size() - tail.size());
  }
  const std::string file = e.path1().empty() ? std::string("(no path)") : e.path1().string();
  return e.path2().empty() ? fmt::format("{}: {}", file, what)
                           : fmt::format("{}: {} (and {})", file, what, e.path2().string());
}

// The manifest a JSON error is about: the only JSON `tetra ckpt` reads is DIR's manifest.json.
std::string manifest_of(const std::string& dir) {
  try {
    return (fs::path(resolve_checkpoint(dir)) / "manifest.json").string();
  } catch (const std::exception&) {
    return (fs::path(dir) / "manifest.json").string();
  }
}

class CkptCommand final : public Command {
 public:
  explicit CkptCommand(CLI::App& tetra) {
    ckpt_ = tetra.add_subcommand("ckpt", "inspect, verify, import and export Tetra checkpoints");
    ckpt_->require_subcommand(1);
    inspect_ = ckpt_->add_subcommand(
        "inspect", "print what a checkpoint holds and verify every slice (exit 2 on the first problem)");
    inspect_->add_option("DIR", dir_, "a step_* directory, or a checkpoint.dir with `latest`")->required();
    export_ = ckpt_->add_subcommand(
        "export-hf", "write the model as Hugging Face's Llama or GPT-2: OUT/model.safetensors and OUT/config.json");
    export_->add_option("DIR", dir_, "a step_* directory, or a checkpoint.dir with `latest`")->required();
    export_->add_option("OUT", out_, "output directory: new (created) or empty, unless --force")->required();
    export_->add_flag("--force", force_, "write into a non-empty OUT, replacing its model.safetensors and config.json");
    export_->add_option("--dtype", dtype_, "stored type of the weights")
        ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
        ->capture_default_str();
    export_->add_option("--max-shard-size", max_shard_,
                        "largest weights file (5GB, 500MB, bytes); above it model-0000k-of-0000n.safetensors and "
                        "model.safetensors.index.json")
        ->capture_default_str();
    import_ = ckpt_->add_subcommand(
        "import-hf", "read a Hugging Face model directory (Llama, Mistral, Qwen2, GPT-2) into a Tetra checkpoint at "
                     "step 0: OUT/step_00000000 and OUT/model.json");
    import_->add_option("HF_DIR", dir_, "config.json and model.safetensors (or its shards and their index)")->required();
    import_->add_option("OUT", out_, "the checkpoint directory to create: new or empty")->required();
    import_->add_option("--seq-len", seq_len_, "model.seq_len (0: GPT-2's n_positions, else max_position_embeddings "
                                               "up to 4096)")
        ->check(whole_number_in(0, INT32_MAX))
        ->capture_default_str();
  }

  CLI::App& app() override { return *ckpt_; }

  int run(int* /*argc*/, char*** /*argv*/, const RuntimeOptions& /*runtime*/) override {
    try {
      if (*inspect_) return inspect(dir_);
      if (*import_) return import_hf(dir_, out_, seq_len_);
      return export_hf(dir_, out_, dtype_, force_, max_shard_);
    } catch (const InputError& e) {
      std::fflush(stdout);
      std::fprintf(stderr, "error: %s\n", e.what());
      return 2;
    } catch (const fs::filesystem_error& e) {
      std::fflush(stdout);
      std::fprintf(stderr, "error: %s\n", filesystem_message(e).c_str());
      return input_error(e.code()) ? 2 : 1;
    } catch (const nlohmann::json::exception& e) {  // the manifest's values, read where a type differs
      std::fflush(stdout);
      std::fprintf(stderr, "error: %s: malformed manifest: %s\n", manifest_of(dir_).c_str(), e.what());
      return 2;
    } catch (const std::exception& e) {
      std::fflush(stdout);
      std::fprintf(stderr, "error: %s\n", e.what());
      return 1;
    }
  }

 private:
  CLI::App *ckpt_ = nullptr, *inspect_ = nullptr, *export_ = nullptr, *import_ = nullptr;
  std::string dir_, out_, dtype_ = "fp32", max_shard_ = "5GB";
  int64_t seq_len_ = 0;
  bool force_ = false;
};

}  // namespace

std::unique_ptr<Command> add_ckpt_command(CLI::App& tetra) { return std::make_unique<CkptCommand>(tetra); }

}  // namespace tetra::cli
