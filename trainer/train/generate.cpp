#include "trainer/train/generate.h"
#include "trainer/train/compute_device.h"

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <spdlog/spdlog.h>

#include "kernels/backend.h"
#include "trainer/checkpoint/checkpoint.h"
#include "trainer/checkpoint/commit.h"
#include "trainer/checkpoint/hf_import.h"
#include "trainer/checkpoint/safetensors.h"
#include "trainer/comm/process_groups.h"
#include "trainer/comm/rank_grid.h"
#include "kernels/common/check.h"
#include "trainer/data/tokenizer.h"
#include "trainer/model/gpt.h"
#include "trainer/model/sampler.h"

namespace tetra {

std::string final_weights_path(const Config& cfg) {
  return cfg.logging.dir.empty() ? std::string() : cfg.logging.dir + "/model.safetensors";
}

std::unique_ptr<Tokenizer> load_sampling_tokenizer(const Config& cfg) {
  if (cfg.data.tokenizer.empty())
    throw InputError("sampling text needs the tokenizer the data was made with: set data.tokenizer "
                     "(gpt2:<dir>, sentencepiece:<file.model> or hf:<dir>)");
  std::unique_ptr<Tokenizer> tok = load_tokenizer(cfg.data.tokenizer);
  if (tok->vocab_size() > cfg.model.vocab_size)
    throw InputError(fmt::format("data.tokenizer {} has {} tokens but model.vocab_size is {}: the model "
                                 "cannot have been trained on its ids",
                                 to_string(cfg.data.tokenizer), tok->vocab_size(), cfg.model.vocab_size));
  return tok;
}

std::string generate_text(Sampler& sampler, const void* weights, const Tokenizer& tokenizer,
                          const std::string& prompt, const SampleConfig& s) {
  std::vector<int32_t> context{tokenizer.eod_id()};
  tokenizer.encode(prompt, context);
  const std::vector<int32_t> ids =
      sampler.generate(weights, context, s, tokenizer.eod_id(), tokenizer.vocab_size());
  // The continuation as it reads after the prompt: decoded with the prompt's ids in front, then the
  // prompt's text cut off. (Decoders that strip a leading space, as Llama-2's does, would
  // otherwise eat the space between the two.)
  std::vector<int32_t> all(context.begin() + 1, context.end());
  const std::string before = tokenizer.decode(all);
  all.insert(all.end(), ids.begin(), ids.end());
  const std::string text = tokenizer.decode(all);
  if (text.starts_with(before)) return text.substr(before.size());
  return tokenizer.decode(ids);
}

std::string escape_text(std::string_view text) {
  std::string out;
  out.reserve(text.size());
  for (char c : text) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '"': out += "\\\""; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f)
          out += fmt::format("\\x{:02x}", static_cast<unsigned char>(c));
        else
          out += c;
    }
  }
  return out;
}

void check_weights_file(const std::string& path, const std::string& missing_hint) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const fs::file_status st = fs::status(path, ec);  // stat: nothing is opened (a FIFO would block)
  switch (st.type()) {
    case fs::file_type::regular: break;
    case fs::file_type::not_found:
      throw InputError(fmt::format("{}: no such file: {}", path, missing_hint));
    case fs::file_type::directory: {
      const fs::path inside = fs::path(path) / "model.safetensors";
      throw InputError(fmt::format("{}: is a directory; the weights are a .safetensors file{}", path,
                                   fs::is_regular_file(inside, ec)
                                       ? fmt::format(" (this one holds {}: pass --weights {})", inside.string(),
                                                     inside.string())
                                       : std::string(" (training writes <logging.dir>/model.safetensors)")));
    }
    case fs::file_type::none:
    case fs::file_type::unknown:
      throw InputError(fmt::format("{}: cannot read the weights: {}", path, ec.message()));
    default:
      throw InputError(fmt::format("{}: is {}, not a regular file; the weights are a .safetensors file (training "
                                   "writes <logging.dir>/model.safetensors)",
                                   path,
                                   st.type() == fs::file_type::fifo        ? "a FIFO"
                                   : st.type() == fs::file_type::socket    ? "a socket"
                                   : st.type() == fs::file_type::block     ? "a block device"
                                   : st.type() == fs::file_type::character ? "a character device"
                                                                           : "a special file"));
  }
  const uintmax_t size = fs::file_size(path, ec);
  if (!ec && size == 0)
    throw InputError(fmt::format("{}: the file is empty (0 bytes), not a safetensors file of weights (an export "
                                 "that did not finish?)",
                                 path));
  if (!ec && size < 8)
    throw InputError(fmt::format("{}: not a safetensors file ({} bytes, shorter than its 8-byte header length)",
                                 path, size));
}

std::vector<float> load_weights(const std::string& path, const ParamLayout& layout) {
  check_weights_file(path, "expected the safetensors file of the model's weights");
  const SafetensorsReader reader(path);  // the header checked, nothing read yet
  // Every tensor's name, shape and type from the header, before anything is allocated.
  for (const auto& [name, e] : reader.entries())
    if (!layout.find(name))
      throw InputError(fmt::format("{}: tensor \"{}\" is not a parameter of the config's model (other "
                                   "model settings than the run that wrote it?)",
                                   path, name));
  auto global_numel = [](const ParamSpec& spec) {
    int64_t n = 1;
    for (int64_t d : spec.global_shape) n *= d;
    return n;
  };
  int64_t largest = 0;
  for (const ParamSpec& spec : layout.params) {
    const SafetensorsReader::Entry* e = reader.find(spec.name);
    if (!e)
      throw InputError(fmt::format("{}: no tensor \"{}\" (shape [{}]), which the config's model has", path,
                                   spec.name, fmt::join(spec.global_shape, ", ")));
    if (e->shape != spec.global_shape)
      throw InputError(fmt::format("{}: tensor \"{}\" has shape [{}] but the config's model needs [{}]", path,
                                   spec.name, fmt::join(e->shape, ", "), fmt::join(spec.global_shape, ", ")));
    if (!is_weight_dtype(e->dtype))
      throw InputError(fmt::format("{}: tensor \"{}\" is {}, not a floating-point type", path, spec.name,
                                   dtype_name(e->dtype)));
    if (spec.tp_split) largest = std::max(largest, global_numel(spec));
  }
  std::vector<float> params(static_cast<size_t>(layout.total), 0.0f);
  std::vector<float> global;
  global.reserve(static_cast<size_t>(largest));
  for (const ParamSpec& spec : layout.params) {
    const SafetensorsReader::Entry& e = *reader.find(spec.name);
    float* dst = params.data() + spec.offset;
    if (!spec.tp_split) {
      read_weights_f32(reader, spec.name, e, dst);  // finite values, or the tensor and index named
      continue;
    }
    global.resize(static_cast<size_t>(global_numel(spec)));
    read_weights_f32(reader, spec.name, e, global.data());
    for (int64_t el = 0; el < spec.held(); ++el) dst[el] = global[static_cast<size_t>(spec.global_index(el))];
  }
  return params;
}

std::vector<float> load_weights_dir(const std::string& dir, const Config& cfg,
                                    std::map<int64_t, std::vector<float>>* moe_expert_bias) {
  namespace fs = std::filesystem;
  std::error_code ec;
  const ParamLayout layout = ParamLayout::build(cfg.model);
  // A checkpoint: a step_* directory, or a checkpoint.dir (its `latest`, or the newest complete step).
  std::string step;
  if (fs::exists(fs::path(dir) / "manifest.json", ec)) {
    step = dir;
  } else if (fs::exists(fs::path(dir) / "latest", ec) || !fs::exists(fs::path(dir) / "config.json", ec)) {
    CheckpointConfig c;
    c.dir = dir;
    c.resume.kind = ResumeKind::AUTO;
    step = checkpoint_to_resume(c);
    if (step.empty()) {
      const fs::path inside = fs::path(dir) / "model.safetensors";
      throw InputError(fmt::format(
          "{}: is a directory; the weights are a .safetensors file{}, a checkpoint (a step_* directory or a "
          "checkpoint.dir) or a Hugging Face model directory (with config.json), and this is none of them",
          dir,
          fs::is_regular_file(inside, ec)
              ? fmt::format(" (this one holds {}: pass --weights {})", inside.string(), inside.string())
              : std::string(" (training writes <logging.dir>/model.safetensors)")));
    }
  }
  if (!step.empty()) {
    std::vector<float> host(static_cast<size_t>(layout.total), 0.0f);
    // The trainer's own loader (every slice's checksum verified, the model compared key by key),
    // on one rank, weights only, into host memory.
    std::unique_ptr<Backend> cpu = make_cpu_backend(1);
    ProcessGroups groups = ProcessGroups::create(RankGrid::build(GridSizes{}), 0);
    const std::vector<GradRange> owned = {{0, layout.total}};
    CheckpointBuffers b;
    b.layout = &layout;
    b.owned = &owned;
    b.master_full = host.data();
    {
      // Its "initialised the weights ... this run starts at step 0" line is a training run's; here
      // stdout is the generated text.
      struct Quiet {
        spdlog::level::level_enum was = spdlog::get_level();
        Quiet() { spdlog::set_level(std::max(was, spdlog::level::warn)); }
        ~Quiet() { spdlog::set_level(was); }
      } quiet;
      const CheckpointState st = load_checkpoint(step, cfg, groups, *cpu, b, /*weights_only=*/true);
      if (moe_expert_bias) *moe_expert_bias = st.moe_expert_bias;
    }
    return host;
  }
  // A Hugging Face directory: its config.json must describe the config's model.
  const HfModel hf = read_hf_model(dir, cfg.model.seq_len, "model.seq_len");
  nlohmann::json have;
  try {
    have = nlohmann::json::parse(
        config_to_json(config_from_json(nlohmann::json{{"model", hf.model}, {"data", {{"synthetic", true}}}})).dump())["model"];
  } catch (const ConfigError& e) {
    throw InputError(fmt::format("{}/config.json describes a model Tetra cannot build:{}", dir,
                                 hf_config_problems(hf, e.problems())));
  }
  nlohmann::json want = nlohmann::json::parse(config_to_json(cfg).dump())["model"];
  std::string diff;
  for (auto it = want.begin(); it != want.end(); ++it)
    if (it.key() != "make_vocab_size_divisible_by" && (!have.contains(it.key()) || have[it.key()] != it.value()))
      diff += fmt::format("{}model.{}: {}/config.json gives {}, the config {}", diff.empty() ? "" : "; ", it.key(), dir,
                          have.contains(it.key()) ? have[it.key()].dump() : "nothing", it.value().dump());
  if (!diff.empty())
    throw InputError(fmt::format("{}: another model than the config's ({}); put the model section `tetra ckpt "
                                 "import-hf` writes (model.json) in the config", dir, diff));
  // Beside the fp32 weights, generate_command holds them in the compute type (and, for a 16-bit
  // one, an fp32 copy to round from).
  const DType act = precision_dtype(cfg.training.precision);
  const uint64_t n = static_cast<uint64_t>(layout.total);
  return read_hf_weights(hf, cfg.model, n * dtype_size(act) + (act == DType::F32 ? 0 : n * 4));
}

GeneratedText generate_command(const Config& config, const std::string& weights_path, const DeviceOptions& device,
                               const IdPrompt* id_prompt) {
  Config cfg = config;
  cfg.parallel.tp = 1;  // one process: the global tensors load whole
  cfg.parallel.etp.reset();
  cfg.parallel.ep_overlap_chunks = 1;
  cfg.parallel.sequence_parallel = false;
  std::string path = weights_path.empty() ? final_weights_path(cfg) : weights_path;
  if (path.empty())
    throw InputError("no weights to generate with: the config has no logging.dir (where training writes "
                     "model.safetensors); pass --weights FILE|DIR");
  const ParamLayout layout = ParamLayout::build(cfg.model);
  std::vector<float> host;
  std::unique_ptr<Tokenizer> tokenizer;
  std::error_code ec;
  if (id_prompt) {
    if (id_prompt->ids.empty()) throw InputError("--prompt-ids: no token ids");
    for (int32_t id : id_prompt->ids)
      if (id < 0 || id >= cfg.model.vocab_size)
        throw InputError(fmt::format("--prompt-ids: id {} outside the model's vocabulary [0, {})", id,
                                     cfg.model.vocab_size));
  }
  std::map<int64_t, std::vector<float>> expert_bias;
  const bool needs_bias = cfg.model.moe.enabled() && cfg.model.moe.router_enable_expert_bias;
  if (!weights_path.empty() && std::filesystem::is_directory(path, ec)) {
    if (!id_prompt) tokenizer = load_sampling_tokenizer(cfg);
    host = load_weights_dir(path, cfg, &expert_bias);
    if (needs_bias && expert_bias.empty())
      throw InputError(fmt::format("{}: holds no MoE expert biases, which this model's routing needs "
                                   "(model.moe.router_enable_expert_bias): pass --weights a checkpoint of the run",
                                   path));
  } else {
    if (needs_bias)
      throw InputError(fmt::format("{}: a weights file holds no MoE expert biases, which this model's routing needs "
                                   "(model.moe.router_enable_expert_bias): pass --weights a checkpoint of the run "
                                   "(a step_* directory or its checkpoint.dir), which keeps them", path));
    check_weights_file(path, weights_path.empty()
                                 ? "train first (tetra --config <run.json> writes it at the end of training when "
                                   "logging.dir is set) or pass --weights FILE|DIR"
                                 : "give --weights the safetensors file training wrote "
                                   "(<logging.dir>/model.safetensors), a checkpoint or a Hugging Face directory");
    if (!id_prompt) tokenizer = load_sampling_tokenizer(cfg);
    host = load_weights(path, layout);
  }

  const DType act = precision_dtype(cfg.training.precision);
  std::unique_ptr<Backend> be =
      make_compute_device(cfg.training, act, device, /*want_peak=*/false).backend;
  // Backend buffers (declared after `be`, so freed before it goes).
  BackendBuffer weights(*be, static_cast<size_t>(layout.total) * dtype_size(act));
  if (act == DType::F32) {
    be->copy_from_host(weights.get(), host.data(), host.size() * 4);
  } else {
    BackendBuffer master(*be, host.size() * 4);
    be->copy_from_host(master.get(), host.data(), host.size() * 4);
    be->cast(weights.get(), act, master.get(), DType::F32, layout.total);
  }
  Gpt model(cfg.model, layout, *be, act, /*micro_batch=*/1);
  model.set_moe_expert_bias(expert_bias);
  Sampler sampler(model, *be, /*tp=*/nullptr);
  GeneratedText out;
  if (!id_prompt) {
    out.prompt = cfg.sample.prompt;
    out.continuation = generate_text(sampler, weights.get(), *tokenizer, cfg.sample.prompt, cfg.sample);
    return out;
  }
  if (!id_prompt->logits_out.empty()) {
    // The prompt's logits (its first T ids), as the first forward of generation computes them.
    const int64_t T = cfg.model.seq_len, V = cfg.model.vocab_size, Vl = model.dims().Vl;
    const int64_t n = std::min<int64_t>(T, static_cast<int64_t>(id_prompt->ids.size()));
    std::vector<int32_t> tokens(static_cast<size_t>(T), 0);
    std::copy(id_prompt->ids.begin(), id_prompt->ids.begin() + n, tokens.begin());
    BackendBuffer tokens_buf(*be, tokens.size() * 4), rows(*be, static_cast<size_t>(n * V) * 4);
    be->copy_from_host(tokens_buf.get(), tokens.data(), tokens.size() * 4);
    model.forward_logits(weights.get(), tokens_buf.as<int32_t>());
    TETRA_CHECK(model.dims().V == V && Vl >= V, "the generating model holds {} of {} vocabulary rows",
                model.dims().V, V);
    be->cast(rows.get(), DType::F32, model.logits(), act, n * V);
    std::vector<float> host_logits(static_cast<size_t>(n * V));
    be->copy_to_host(host_logits.data(), rows.get(), host_logits.size() * 4);
    write_safetensors(id_prompt->logits_out, {TensorView{"logits", DType::F32, {n, V}, host_logits.data()}});
  }
  out.ids = sampler.generate(weights.get(), id_prompt->ids, cfg.sample, /*eod=*/-1, cfg.model.vocab_size);
  return out;
}

}  // namespace tetra
