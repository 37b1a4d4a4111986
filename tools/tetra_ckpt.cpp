// tetra_ckpt: reads Tetra checkpoints (trainer/checkpoint/checkpoint.h) without training.
//
//   tetra_ckpt inspect DIR                          what the checkpoint holds, every byte verified
//   tetra_ckpt export-hf DIR OUT [--dtype fp32|bf16|fp16]  OUT/model.safetensors + OUT/config.json
//
// DIR is a step_* directory, or a checkpoint.dir whose `latest` names one.
//
// `inspect` prints the step, the data position, the layout the checkpoint was saved under, the
// fp16 loss scaler's state where there is one, the model, and every tensor (global shape, slices,
// bytes), then verifies all of it: the manifest's tensors are exactly the model's, with its
// shapes; each tensor's slices lie inside it, overlap nowhere and together cover every element;
// every slice is read from its file and its CRC-32 compared with the manifest's. `export-hf` assembles each "model/" tensor from its slices (the
// same checks on the slices it reads) and writes it under Hugging Face's names and layouts
// (trainer/checkpoint/hf_export.h).
//
// Exit codes: 0 success; 2 a bad checkpoint or bad input, the message naming the file, tensor and
// slice of the first problem; 1 any other failure.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/hf_export.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/checkpoint/sharding.h"
#include "trainer/config/config.h"
#include "trainer/core/check.h"
#include "trainer/core/format.h"
#include "trainer/model/param_layout.h"

namespace {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;
using tetra::InputError;

const char* const kKinds[] = {"model", "optim/exp_avg", "optim/exp_avg_sq"};

using tetra::grouped;

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw InputError(fmt::format("{}: cannot read", path));
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

// The step_* directory DIR names: itself, or what DIR/latest names.
std::string resolve_checkpoint(const std::string& dir) {
  if (fs::exists(fs::path(dir) / "manifest.json")) return dir;
  const fs::path latest = fs::path(dir) / "latest";
  if (!fs::exists(latest))
    throw InputError(fmt::format("{}: not a checkpoint (no manifest.json) nor a checkpoint directory (no "
                                 "latest); give a step_* directory or a checkpoint.dir", dir));
  std::string name = read_text(latest.string());
  while (!name.empty() && (name.back() == '\n' || name.back() == ' ' || name.back() == '\r')) name.pop_back();
  const fs::path path = fs::path(dir) / name;
  if (name.empty() || !fs::exists(path / "manifest.json"))
    throw InputError(fmt::format("{} names \"{}\", which is not a complete checkpoint (no manifest.json)",
                                 latest.string(), name));
  return path.string();
}

// ---- the tensor index of a manifest --------------------------------------------------------------

struct Slice {
  size_t index = 0;           // in the tensor's list of slices (messages count from 1)
  std::string file, tensor;   // the safetensors file (relative to the checkpoint) and its entry
  tetra::SliceRegion region;
  uint32_t crc = 0;
};

struct TensorEntry {
  std::string key;            // "model/layers.0.attn.qkv.weight"
  std::vector<int64_t> shape;
  int64_t rows = 0, cols = 0;  // the 2-D view slices are regions of (n elements: n x 1)
  std::vector<Slice> slices;
  int64_t numel() const { return rows * cols; }
  int64_t slice_elements() const {
    int64_t n = 0;
    for (const Slice& s : slices) n += s.region.numel();
    return n;
  }
};

struct Checkpoint {
  std::string path;           // the step_* directory
  json manifest;
  tetra::ModelConfig model;
  std::vector<TensorEntry> tensors;  // kKinds in order (every parameter), then compression kinds (those they hold)
  std::string manifest_path() const { return (fs::path(path) / "manifest.json").string(); }
};

std::string describe(const Checkpoint& ck, const TensorEntry& t, const Slice& s) {
  const tetra::SliceRegion& r = s.region;
  return fmt::format("{}: tensor {}, slice {} of {} (\"{}\": rows [{}, {}), columns [{}, {}), elements [{}, {}))",
                     (fs::path(ck.path) / s.file).string(), t.key, s.index + 1, t.slices.size(), s.tensor, r.row0,
                     r.row0 + r.rows, r.col0, r.col0 + r.cols, r.begin, r.end);
}

// The model the manifest's config describes (validated as a config of its own).
tetra::ModelConfig model_of(const json& manifest, const std::string& where) {
  if (!manifest.contains("config") || !manifest["config"].contains("model"))
    throw InputError(fmt::format("{}: no config.model", where));
  const nlohmann::json cfg = {{"model", nlohmann::json::parse(manifest["config"]["model"].dump())},
                              {"data", {{"synthetic", true}}}};
  try {
    return tetra::config_from_json(cfg).model;
  } catch (const InputError& e) {
    throw InputError(fmt::format("{}: config.model is not a valid model: {}", where, e.what()));
  }
}

Checkpoint read_index(const std::string& dir) {
  Checkpoint ck;
  ck.path = resolve_checkpoint(dir);
  const std::string where = ck.manifest_path();
  try {
    ck.manifest = json::parse(read_text(where));
    if (ck.manifest.value("format", "") != "tetra-checkpoint" || ck.manifest.value("version", 0) != 1)
      throw InputError(fmt::format("{}: not a tetra-checkpoint version 1 manifest (format {}, version {})", where,
                                   ck.manifest.value("format", json("absent")).dump(),
                                   ck.manifest.value("version", json("absent")).dump()));
    ck.model = model_of(ck.manifest, where);
    const json& tensors = ck.manifest.at("tensors");
    const tetra::ParamLayout layout = tetra::ParamLayout::build(ck.model);
    // The fixed kinds, each over every parameter, then any gradient compression error-feedback
    // kinds (trainer/optim/compressed_exchange.h: "optim/onebit_server_error",
    // "optim/onebit_worker_error/dp1of4", "optim/int8_worker_error/edp0of2_ep2", ...), each over the
    // parameters it applies to (a worker error keyed by DP rank holds the dense parameters, one
    // keyed by expert-DP rank the experts; the distributed optimizer's server error only a tied
    // embedding).
    std::vector<std::string> kinds(std::begin(kKinds), std::end(kKinds));
    for (auto it = tensors.begin(); it != tensors.end(); ++it) {
      const std::string& key = it.key();
      const size_t slash = key.rfind('/');
      const bool compression = key.rfind("optim/onebit_", 0) == 0 || key.rfind("optim/int8_", 0) == 0;
      if (!compression || slash == std::string::npos) continue;
      const std::string kind = key.substr(0, slash);
      if (std::find(kinds.begin(), kinds.end(), kind) == kinds.end()) kinds.push_back(kind);
    }
    std::set<std::string> expected;
    for (const std::string& kind : kinds) {
      for (const tetra::ParamSpec& p : layout.params) {
        TensorEntry t;
        t.key = kind + "/" + p.name;
        expected.insert(t.key);
        const bool fixed = std::find(std::begin(kKinds), std::end(kKinds), kind) != std::end(kKinds);
        if (!fixed && !tensors.contains(t.key)) continue;
        if (!tensors.contains(t.key))
          throw InputError(fmt::format("{}: tensor {} of the model is missing", where, t.key));
        const json& j = tensors[t.key];
        t.shape = j.at("shape").get<std::vector<int64_t>>();
        if (t.shape != p.global_shape)
          throw InputError(fmt::format("{}: tensor {} has shape {}, the model's is {}", where, t.key,
                                       shape_text(t.shape), shape_text(p.global_shape)));
        if (j.value("dtype", "") != "F32")
          throw InputError(fmt::format("{}: tensor {} has dtype {}, checkpoints hold F32", where, t.key,
                                       j.value("dtype", json("absent")).dump()));
        t.cols = tetra::global_cols(p);
        t.rows = 1;  // of the 2-D view: every dim but the last (3-D expert tensors)
        for (size_t d = 0; d + 1 < p.global_shape.size(); ++d) t.rows *= p.global_shape[d];
        if (p.global_shape.size() == 1) t.rows = p.global_shape[0];
        for (const json& s : j.at("slices")) {
          Slice sl;
          sl.index = t.slices.size();
          sl.file = s.at("file").get<std::string>();
          sl.tensor = s.at("tensor").get<std::string>();
          const auto reg = s.at("region").get<std::vector<int64_t>>();
          const auto rng = s.at("range").get<std::vector<int64_t>>();
          if (reg.size() != 4 || rng.size() != 2)
            throw InputError(fmt::format("{}: tensor {}, slice {}: region {} / range {} malformed", where, t.key,
                                         sl.index + 1, s.at("region").dump(), s.at("range").dump()));
          sl.region = tetra::SliceRegion{reg[0], reg[1], reg[2], reg[3], rng[0], rng[1]};
          sl.crc = s.at("crc32").get<uint32_t>();
          if (sl.file.find('/') != std::string::npos || sl.file == "..")
            throw InputError(fmt::format("{}: tensor {}, slice {}: file \"{}\" is not a file of the checkpoint",
                                         where, t.key, sl.index + 1, sl.file));
          t.slices.push_back(std::move(sl));
        }
        ck.tensors.push_back(std::move(t));
      }
    }
    for (auto it = tensors.begin(); it != tensors.end(); ++it)
      if (!expected.count(it.key()))
        throw InputError(fmt::format("{}: tensor {} is not one of the model's", where, it.key()));
  } catch (const json::exception& e) {
    throw InputError(fmt::format("{}: malformed manifest: {}", where, e.what()));
  }
  return ck;
}

// ---- verification ------------------------------------------------------------------------------

// Every slice inside the tensor, no element held twice, every element held: InputError naming the
// slice otherwise. Works on intervals of global flat indices (one per row a slice touches, or one
// for a slice of whole rows), so it needs no memory of the tensor's size.
void check_coverage(const Checkpoint& ck, const TensorEntry& t) {
  struct Interval {
    int64_t begin, end;
    size_t slice;
  };
  std::vector<Interval> iv;
  for (const Slice& s : t.slices) {
    const tetra::SliceRegion& r = s.region;
    if (r.row0 < 0 || r.rows <= 0 || r.row0 + r.rows > t.rows || r.col0 < 0 || r.cols <= 0 ||
        r.col0 + r.cols > t.cols || r.begin < 0 || r.begin > r.end || r.end > r.rows * r.cols)
      throw InputError(fmt::format("{}: lies outside the tensor's {} x {} elements", describe(ck, t, s), t.rows,
                                   t.cols));
    if (r.begin == r.end) continue;
    if (r.col0 == 0 && r.cols == t.cols) {  // whole rows: one interval
      iv.push_back({r.row0 * t.cols + r.begin, r.row0 * t.cols + r.end, s.index});
      continue;
    }
    for (int64_t row = r.begin / r.cols; row * r.cols < r.end; ++row) {
      const int64_t a = std::max(r.begin, row * r.cols), b = std::min(r.end, (row + 1) * r.cols);
      const int64_t g = (r.row0 + row) * t.cols + r.col0 - row * r.cols;
      iv.push_back({g + a, g + b, s.index});
    }
  }
  std::sort(iv.begin(), iv.end(), [](const Interval& a, const Interval& b) { return a.begin < b.begin; });
  int64_t at = 0;  // every element below `at` is held exactly once
  size_t last = 0;
  for (const Interval& i : iv) {
    if (i.begin < at)
      throw InputError(fmt::format("{}: overlaps slice {} (element {} of the tensor is held twice)",
                                   describe(ck, t, t.slices[i.slice]), last + 1, i.begin));
    if (i.begin > at)
      throw InputError(fmt::format("{}: tensor {} is not fully covered (it has {} slices): no slice holds elements "
                                   "[{}, {}) (row {}, column {})", ck.manifest_path(), t.key, t.slices.size(), at,
                                   i.begin, at / t.cols, at % t.cols));
    at = i.end;
    last = i.slice;
  }
  if (at != t.numel())
    throw InputError(fmt::format("{}: tensor {} is not fully covered (it has {} slices): no slice holds elements "
                                 "[{}, {}) (row {}, column {})", ck.manifest_path(), t.key, t.slices.size(), at,
                                 t.numel(), at / t.cols, at % t.cols));
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
      const std::string path = (fs::path(ck_.path) / s.file).string();
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
  check_coverage(ck, t);
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
                     m.vocab_size, m.seq_len, m.norm, m.norm_eps, m.activation, m.position,
                     m.position == "rope" ? fmt::format(" (theta {:g})", m.rope_theta) : "",
                     m.tie_embeddings ? "tied" : "untied", m.bias ? "biases" : "no biases");
}

std::string layout_text(const json& l) {
  auto get = [&](const char* k) { return l.contains(k) ? l[k].dump() : std::string("?"); };
  return fmt::format("world {}: tp {}, pp {}, dp {}, ep {}, order {}, sequence_parallel {}, distributed_optimizer {}",
                     get("world"), get("tp"), get("pp"), get("dp"), get("ep"),
                     l.contains("order") && l["order"].is_string() ? l["order"].get<std::string>() : "?",
                     get("sequence_parallel"), get("distributed_optimizer"));
}

int inspect(const std::string& dir) {
  const Checkpoint ck = read_index(dir);
  const json& man = ck.manifest;
  const tetra::ParamLayout layout = tetra::ParamLayout::build(ck.model);
  int64_t params = 0;
  for (const tetra::ParamSpec& p : layout.params) params += p.numel;
  fmt::print("checkpoint:       {}\n", ck.path);
  fmt::print("step:             {}\n", man.value("step", json(nullptr)).dump());
  fmt::print("consumed samples: {}\n", man.value("consumed_samples", json(nullptr)).dump());
  fmt::print("seed:             {}\n", man.value("seed", json(nullptr)).dump());
  if (man.contains("loss_scaler"))  // fp16 runs: the dynamic loss scaler's state
    fmt::print("loss scaler:      {}\n", man["loss_scaler"].dump());
  fmt::print("layout:           {}\n", layout_text(man.value("layout", json::object())));
  fmt::print("model:            {}\n", model_text(ck.model));
  fmt::print("parameters:       {}\n", grouped(params));

  std::map<std::string, std::pair<size_t, int64_t>> files;  // file -> slices, bytes in it
  int64_t total = 0;
  size_t slices = 0, width = 6;
  for (const TensorEntry& t : ck.tensors) width = std::max(width, t.key.size());
  fmt::print("\n{:<{}}  {:>12}  {:>6}  {:>12}\n", "tensor", width, "shape", "slices", "bytes");
  for (const TensorEntry& t : ck.tensors) {
    const int64_t bytes = t.slice_elements() * 4;
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
    const auto size = fs::file_size(fs::path(ck.path) / file, ec);
    fmt::print("file:             {}: {} slices, {} bytes of tensors, {}\n", file, n.first, grouped(n.second),
               ec ? std::string("MISSING") : grouped(static_cast<int64_t>(size)) + " bytes on disk");
  }
  std::fflush(stdout);

  SliceFiles reader(ck);
  std::vector<float> values;
  for (const TensorEntry& t : ck.tensors) {
    check_coverage(ck, t);
    for (const Slice& s : t.slices) reader.read(t, s, values);
  }
  fmt::print("verified:         {} slices in {} files, {} bytes: every checksum matches, every tensor covered "
             "exactly once\n", slices, reader.files_opened(), grouped(static_cast<int64_t>(reader.bytes_read())));
  return 0;
}

int export_hf(const std::string& dir, const std::string& out, const std::string& dtype_name) {
  const tetra::DType dtype = tetra::precision_dtype(dtype_name);
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
  const json& cfg = ck.manifest["config"];
  if (cfg.contains("data") && cfg["data"].value("tokenizer", "").rfind("gpt2:", 0) == 0 &&
      ck.model.vocab_size > 50256)
    eos = 50256;
  const json config = tetra::hf_config(ck.model, arch, dtype, eos);

  std::error_code ec;
  fs::create_directories(out, ec);
  if (ec || !fs::is_directory(out))
    throw InputError(fmt::format("{}: cannot create the output directory: {}", out,
                                 ec ? ec.message() : "not a directory"));
  const std::string weights = (fs::path(out) / "model.safetensors").string();
  tetra::write_safetensors(weights, records, tetra::hf_metadata());
  {
    const std::string path = (fs::path(out) / "config.json").string();
    std::ofstream f(path, std::ios::trunc);
    f << config.dump(2) << "\n";
    f.flush();
    if (!f) throw InputError(fmt::format("{}: cannot write", path));
  }
  int64_t elements = 0;
  for (const tetra::TensorRecord& r : records) elements += r.numel();
  fmt::print("checkpoint:  {} (step {})\n", ck.path, ck.manifest.value("step", json(nullptr)).dump());
  fmt::print("model:       {}\n", model_text(ck.model));
  fmt::print("exported as: {} ({}), {}\n", tetra::hf_model_type(arch), config["architectures"][0].get<std::string>(),
             dtype == tetra::DType::F32 ? "float32" : "bfloat16");
  fmt::print("wrote:       {}: {} tensors, {} values, {} bytes\n", weights, records.size(), grouped(elements),
             grouped(static_cast<int64_t>(fs::file_size(weights))));
  fmt::print("wrote:       {}\n", (fs::path(out) / "config.json").string());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"tetra_ckpt: inspect, verify and export Tetra checkpoints"};
  app.require_subcommand(1);
  std::string dir, out, dtype = "fp32";
  CLI::App* inspect_cmd = app.add_subcommand(
      "inspect", "print what a checkpoint holds and verify every slice (exit 2 on the first problem)");
  inspect_cmd->add_option("DIR", dir, "a step_* directory, or a checkpoint.dir with `latest`")->required();
  CLI::App* export_cmd = app.add_subcommand(
      "export-hf", "write the model as Hugging Face's Llama or GPT-2: OUT/model.safetensors and OUT/config.json");
  export_cmd->add_option("DIR", dir, "a step_* directory, or a checkpoint.dir with `latest`")->required();
  export_cmd->add_option("OUT", out, "output directory (created)")->required();
  export_cmd->add_option("--dtype", dtype, "stored type of the weights")
      ->check(CLI::IsMember({"fp32", "bf16", "fp16"}))
      ->capture_default_str();
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    const int code = app.exit(e);
    return code == 0 ? 0 : 2;
  }
  try {
    if (*inspect_cmd) return inspect(dir);
    return export_hf(dir, out, dtype);
  } catch (const InputError& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  } catch (const std::exception& e) {
    std::fflush(stdout);
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
