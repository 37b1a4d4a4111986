#include "trainer/checkpoint/manifest.h"

#include <sys/stat.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <sstream>
#include <string_view>

#include <fmt/format.h>

#include "kernels/common/check.h"
#include "trainer/core/files.h"
#include "trainer/core/json_text.h"
#include "trainer/params/param_layout.h"

namespace tetra {

namespace fs = std::filesystem;
using json = nlohmann::ordered_json;

namespace {

std::string shape_text(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) s += (i ? ", " : "") + std::to_string(shape[i]);
  return s + "]";
}


// Typed access to manifest fields: a missing field or one of another type is an InputError naming
// the manifest, the field and what it holds.
class Fields {
 public:
  explicit Fields(std::string where) : where_(std::move(where)) {}

  const json& at(const json& obj, const std::string& key, const std::string& name) const {
    if (!obj.is_object() || !obj.contains(key))
      throw InputError(fmt::format("{}: field {} is missing", where_, name));
    return obj[key];
  }
  int64_t integer(const json& obj, const std::string& key, const std::string& name, int64_t lo = 0,
                  int64_t hi = std::numeric_limits<int64_t>::max()) const {
    const json& v = at(obj, key, name);
    if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(hi)))
      throw InputError(fmt::format("{}: field {} is {}, not an integer in [{}, {}]", where_, name, v.dump(), lo, hi));
    const int64_t x = v.get<int64_t>();
    if (x < lo || x > hi)
      throw InputError(fmt::format("{}: field {} is {}, outside [{}, {}]", where_, name, x, lo, hi));
    return x;
  }
  double number(const json& obj, const std::string& key, const std::string& name) const {
    const json& v = at(obj, key, name);
    if (!v.is_number()) throw InputError(fmt::format("{}: field {} is {}, not a number", where_, name, v.dump()));
    return v.get<double>();
  }
  std::string string(const json& obj, const std::string& key, const std::string& name) const {
    const json& v = at(obj, key, name);
    if (!v.is_string()) throw InputError(fmt::format("{}: field {} is {}, not a string", where_, name, v.dump()));
    return v.get<std::string>();
  }
  std::vector<int64_t> integers(const json& obj, const std::string& key, const std::string& name,
                                size_t count = 0) const {
    const json& v = at(obj, key, name);
    bool ok = v.is_array() && (count == 0 || v.size() == count);
    if (ok)
      for (const json& e : v) ok = ok && e.is_number_integer();
    if (!ok)
      throw InputError(fmt::format("{}: field {} is {}, not {} integers", where_, name, v.dump(),
                                   count ? std::to_string(count) : std::string("a list of")));
    return v.get<std::vector<int64_t>>();
  }
  const std::string& where() const { return where_; }

 private:
  std::string where_;
};

// The model the manifest's config describes (validated as a config of its own).
ModelConfig model_of(const json& manifest, const Fields& f) {
  const json& config = f.at(manifest, "config", "config");
  if (!config.is_object())
    throw InputError(fmt::format("{}: field config is {}, not an object (the run's config)", f.where(), config.dump()));
  const json& model = f.at(config, "model", "config.model");
  const nlohmann::json cfg = {{"model", nlohmann::json::parse(model.dump())}, {"data", {{"synthetic", true}}}};
  try {
    return config_from_json(cfg).model;
  } catch (const InputError& e) {
    throw InputError(fmt::format("{}: config.model is not a valid model: {}", f.where(), e.what()));
  }
}

}  // namespace

int64_t step_of_checkpoint_name(const std::string& name) {
  std::string digits;
  if (name.rfind("step_", 0) == 0)
    digits = name.substr(5);
  else if (name.rfind(".step_", 0) == 0 && name.size() > 10 &&
           (name.compare(name.size() - 4, 4, ".old") == 0 || name.compare(name.size() - 4, 4, ".tmp") == 0))
    digits = name.substr(6, name.size() - 10);
  if (digits.empty() || digits.size() > 18) return -1;
  for (char c : digits)
    if (c < '0' || c > '9') return -1;
  return std::stoll(digits);
}

std::string describe_slice(const Manifest& m, const ManifestTensor& t, const ManifestSlice& s) {
  const SliceRegion& r = s.region;
  // The region may not be validated yet (this describes bad ones too): ends saturate, never overflow.
  auto end = [](int64_t a, int64_t n) {
    if (n > 0 && a > std::numeric_limits<int64_t>::max() - n) return std::numeric_limits<int64_t>::max();
    if (n < 0 && a < std::numeric_limits<int64_t>::min() - n) return std::numeric_limits<int64_t>::min();
    return a + n;
  };
  return fmt::format("{}: tensor {}, slice {} of {} (\"{}\": rows [{}, {}), columns [{}, {}), elements [{}, {}))",
                     (fs::path(m.dir) / s.file).string(), t.key, s.index + 1, t.slices.size(), s.tensor, r.row0,
                     end(r.row0, r.rows), r.col0, end(r.col0, r.cols), r.begin, r.end);
}

Manifest read_manifest(const std::string& checkpoint_dir) {
  Manifest m;
  m.dir = checkpoint_dir;
  m.path = (fs::path(checkpoint_dir) / "manifest.json").string();
  const Fields f(m.path);
  const std::string text = read_text(m.path, "checkpoint manifest");
  json j;
  try {
    j = parse_json_text(m.path, text);
  } catch (const InputError& e) {
    throw InputError(fmt::format("malformed manifest: {}", e.what()));
  }
  if (!j.is_object() || j.value("format", json()) != "tetra-checkpoint" || j.value("version", json()) != 1)
    throw InputError(fmt::format("{}: not a tetra-checkpoint version 1 manifest (format {}, version {})", m.path,
                                 j.is_object() ? j.value("format", json("absent")).dump() : "absent",
                                 j.is_object() ? j.value("version", json("absent")).dump() : "absent"));
  m.step = f.integer(j, "step", "step");
  m.consumed_samples = f.integer(j, "consumed_samples", "consumed_samples");
  {
    const json& seed = f.at(j, "seed", "seed");
    if (!seed.is_number_unsigned())
      throw InputError(fmt::format("{}: field seed is {}, not an unsigned integer", m.path, seed.dump()));
    m.seed = seed.get<uint64_t>();
  }
  // The directory's name and the data position must agree with the step: a manifest copied or
  // edited into the wrong directory would otherwise resume at one step and overwrite another.
  const std::string name = fs::path(checkpoint_dir).lexically_normal().filename().string().empty()
                               ? fs::path(checkpoint_dir).lexically_normal().parent_path().filename().string()
                               : fs::path(checkpoint_dir).lexically_normal().filename().string();
  const int64_t named = step_of_checkpoint_name(name);
  if (named >= 0 && named != m.step)
    throw InputError(fmt::format("{}: field step is {}, but the directory {} holds step {}: the manifest belongs "
                                 "to another checkpoint", m.path, m.step, name, named));
  if (m.consumed_samples < m.step)
    throw InputError(fmt::format("{}: field consumed_samples is {}, fewer than the {} steps it took (each step "
                                 "consumes at least one sample): the manifest is corrupt", m.path,
                                 m.consumed_samples, m.step));
  if (j.contains("loss_scaler")) {
    const json& ls = j["loss_scaler"];
    LossScalerState s;
    s.scale = f.number(ls, "scale", "loss_scaler.scale");
    // The trackers are counters that may run below zero (hysteresis past its last overflow).
    constexpr int64_t kAny = std::numeric_limits<int64_t>::min();
    s.growth_tracker = f.integer(ls, "growth_tracker", "loss_scaler.growth_tracker", kAny);
    s.hysteresis_tracker = f.integer(ls, "hysteresis_tracker", "loss_scaler.hysteresis_tracker", kAny);
    s.skipped_steps = f.integer(ls, "skipped_steps", "loss_scaler.skipped_steps", 0, m.step);
    s.floor_overflows = f.integer(ls, "floor_overflows", "loss_scaler.floor_overflows", kAny);
    if (!(s.scale > 0.0) || !std::isfinite(s.scale))
      throw InputError(fmt::format("{}: field loss_scaler.scale is {}, not a positive finite number", m.path, s.scale));
    m.loss_scaler = s;
  }
  if (j.contains("moe_expert_bias")) {  // {"<block>": [E finite numbers], ...}
    const json& b = j["moe_expert_bias"];
    if (!b.is_object())
      throw InputError(fmt::format("{}: field moe_expert_bias is {}, not an object", m.path, b.dump().substr(0, 80)));
    for (const auto& [key, values] : b.items()) {
      const bool digits = !key.empty() && key.size() <= 9 &&
                          std::all_of(key.begin(), key.end(), [](char ch) { return ch >= '0' && ch <= '9'; });
      const std::optional<int64_t> block = digits ? std::optional<int64_t>(std::stoll(key)) : std::nullopt;
      if (!block || !values.is_array())
        throw InputError(fmt::format("{}: field moe_expert_bias.{} is not a block's array of biases", m.path, key));
      std::vector<float>& out = m.moe_expert_bias[*block];
      for (const json& v : values) {
        if (!v.is_number() || !std::isfinite(v.get<double>()))
          throw InputError(fmt::format("{}: field moe_expert_bias.{} holds {}, not a finite number", m.path, key,
                                       v.dump()));
        out.push_back(static_cast<float>(v.get<double>()));
      }
    }
  }
  m.layout = f.at(j, "layout", "layout");
  {  // The layout that wrote the checkpoint (a description: resharding reads the slices themselves).
    const json& l = m.layout;
    if (!l.is_object()) throw InputError(fmt::format("{}: field layout is {}, not an object", m.path, l.dump()));
    int64_t ranks = 1;
    for (const char* axis : {"tp", "cp", "pp", "dp"})  // cp: absent from older checkpoints
      if (l.contains(axis) || std::string_view(axis) != "cp")
        ranks *= f.integer(l, axis, fmt::format("layout.{}", axis), 1, kMaxRanks);
    if (l.contains("ep")) f.integer(l, "ep", "layout.ep", 1, kMaxRanks);  // within dp; absent from older ones
    if (l.contains("etp")) f.integer(l, "etp", "layout.etp", 1, kMaxRanks);  // the experts' tp; absent: tp
    const int64_t world = f.integer(l, "world", "layout.world", 1, kMaxRanks);
    if (world != ranks)
      throw InputError(fmt::format("{}: field layout.world is {}, but tp x cp x pp x dp of the layout is {}", m.path,
                                   world, ranks));
    f.string(l, "order", "layout.order");
    for (const char* flag : {"sequence_parallel", "distributed_optimizer"})
      if (!f.at(l, flag, fmt::format("layout.{}", flag)).is_boolean())
        throw InputError(fmt::format("{}: field layout.{} is {}, not true or false", m.path, flag, l[flag].dump()));
    if (l.contains("zero_stage")) f.integer(l, "zero_stage", "layout.zero_stage", 0, 3);
  }
  m.config = f.at(j, "config", "config");
  m.model = model_of(j, f);
  for (const auto& [block, values] : m.moe_expert_bias)  // against the model it describes
    if (block >= m.model.num_layers || !m.model.moe.is_moe_layer(block) ||
        static_cast<int64_t>(values.size()) != m.model.moe.num_experts)
      throw InputError(fmt::format("{}: field moe_expert_bias.{} holds {} values, but the model has {}: the manifest "
                                   "is corrupt", m.path, block, values.size(),
                                   block < m.model.num_layers && m.model.moe.is_moe_layer(block)
                                       ? fmt::format("{} experts in that block", m.model.moe.num_experts)
                                       : std::string("no MoE block of that number")));

  const json& tensors = f.at(j, "tensors", "tensors");
  if (!tensors.is_object()) throw InputError(fmt::format("{}: field tensors is not an object", m.path));
  const ParamLayout layout = ParamLayout::build(m.model);
  // The fixed kinds, each over every parameter, then any gradient compression error-feedback
  // kinds (trainer/optim/compressed_exchange.h: "optim/onebit_server_error",
  // "optim/onebit_worker_error/dp1of4", "optim/int8_worker_error/edp0of2_ep2", ...), each over the
  // parameters it applies to.
  std::vector<std::string> kinds(std::begin(kCheckpointKinds), std::end(kCheckpointKinds));
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
    const bool fixed = std::find(std::begin(kCheckpointKinds), std::end(kCheckpointKinds), kind) !=
                       std::end(kCheckpointKinds);
    for (const ParamSpec& p : layout.params) {
      ManifestTensor t;
      t.key = kind + "/" + p.name;
      expected.insert(t.key);
      if (!tensors.contains(t.key)) {
        if (!fixed) continue;
        throw InputError(fmt::format("{}: tensor {} of the model is missing", m.path, t.key));
      }
      const json& tj = tensors[t.key];
      const std::string tname = "tensors[\"" + t.key + "\"]";
      t.shape = f.integers(tj, "shape", tname + ".shape");
      if (t.shape != p.global_shape)
        throw InputError(fmt::format("{}: tensor {} has shape {}, the model's is {}", m.path, t.key,
                                     shape_text(t.shape), shape_text(p.global_shape)));
      if (tj.value("dtype", json()) != "F32")
        throw InputError(fmt::format("{}: tensor {} has dtype {}, checkpoints hold F32", m.path, t.key,
                                     tj.value("dtype", json("absent")).dump()));
      t.cols = global_cols(p);
      t.rows = 1;  // of the 2-D view: every dim but the last (3-D expert tensors)
      for (size_t d = 0; d + 1 < p.global_shape.size(); ++d) t.rows *= p.global_shape[d];
      if (p.global_shape.size() == 1) t.rows = p.global_shape[0];
      const json& slices = f.at(tj, "slices", tname + ".slices");
      if (!slices.is_array()) throw InputError(fmt::format("{}: field {}.slices is not a list", m.path, tname));
      for (const json& s : slices) {
        ManifestSlice sl;
        sl.index = t.slices.size();
        const std::string sname = fmt::format("{}.slices[{}]", tname, sl.index);
        sl.file = f.string(s, "file", sname + ".file");
        sl.tensor = f.string(s, "tensor", sname + ".tensor");
        const auto reg = f.integers(s, "region", sname + ".region", 4);
        const auto rng = f.integers(s, "range", sname + ".range", 2);
        sl.region = SliceRegion{reg[0], reg[1], reg[2], reg[3], rng[0], rng[1]};
        sl.crc = static_cast<uint32_t>(f.integer(s, "crc32", sname + ".crc32", 0, 0xFFFFFFFFll));
        if (sl.file.empty() || sl.file.find('/') != std::string::npos || sl.file == "." || sl.file == ".." ||
            sl.file.find('\0') != std::string::npos)
          throw InputError(fmt::format("{}: {}.file \"{}\" is not a file of the checkpoint", m.path, sname, sl.file));
        t.slices.push_back(std::move(sl));
        const SliceRegion& r = t.slices.back().region;
        // Inside the tensor, with the element range inside the rectangle (no overflow: each bound
        // is checked before it is multiplied).
        if (r.row0 < 0 || r.rows <= 0 || r.rows > t.rows || r.row0 > t.rows - r.rows || r.col0 < 0 || r.cols <= 0 ||
            r.cols > t.cols || r.col0 > t.cols - r.cols || r.begin < 0 || r.begin > r.end || r.end > r.rows * r.cols)
          throw InputError(fmt::format("{}: lies outside the tensor's {} x {} elements",
                                       describe_slice(m, t, t.slices.back()), t.rows, t.cols));
      }
      m.index[t.key] = m.tensors.size();
      m.tensors.push_back(std::move(t));
    }
  }
  for (auto it = tensors.begin(); it != tensors.end(); ++it)
    if (!expected.count(it.key()))
      throw InputError(fmt::format("{}: tensor {} is not one of the model's", m.path, it.key()));
  return m;
}

void check_coverage(const Manifest& m, const ManifestTensor& t) {
  struct Interval {
    int64_t begin, end;
    size_t slice;
  };
  std::vector<Interval> iv;
  for (const ManifestSlice& s : t.slices) {
    const SliceRegion& r = s.region;
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
                                   describe_slice(m, t, t.slices[i.slice]), last + 1, i.begin));
    if (i.begin > at)
      throw InputError(fmt::format("{}: tensor {} is not fully covered (it has {} slices): no slice holds elements "
                                   "[{}, {}) (row {}, column {})", m.path, t.key, t.slices.size(), at, i.begin,
                                   at / t.cols, at % t.cols));
    at = i.end;
    last = i.slice;
  }
  if (at != t.numel())
    throw InputError(fmt::format("{}: tensor {} is not fully covered (it has {} slices): no slice holds elements "
                                 "[{}, {}) (row {}, column {})", m.path, t.key, t.slices.size(), at, t.numel(),
                                 at / t.cols, at % t.cols));
}

}  // namespace tetra
